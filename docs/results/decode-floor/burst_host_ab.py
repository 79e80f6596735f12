"""A burst step's host work, A/B in one process: the learnt cost curve rebuilt at every plain step (as before
2026-12-06's third session) against rebuilt only when the budget next reads it. AR, then PTP with each variant in
turn, on every held-out prompt, ``rounds`` times (interleaved: the VM's drift hits all three alike).

Usage: ``python docs/results/decode-floor/burst_host_ab.py [rounds] [temperature]`` from the repository root."""

import json
import sys

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
from ptp_mlx.drafting.learn import LearnedCost
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

lazy_observe = LearnedCost.observe


def eager_observe(self, rows, seconds, cold=False):
    lazy_observe(self, rows, seconds, cold)
    _ = self.step_seconds  # (the old order: the table rebuilt at once, as every plain step did)
    self._should_save()


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
S = SamplingSettings(temperature=temp, top_p=0.95 if temp else 1.0, seed=0)
eng = Engine.load()
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]


def run(p, mode):
    steps = list(eng.generate([{"role": "user", "content": p["turns"][0]}], max_tokens=128, mode=mode, sampling=S))
    return sum(s.step_time for s in steps), [t for s in steps for t in s.tokens]


run(prompts[0], "ar")  # warm-up: every shape compiles
run(prompts[0], "ptp")
tot = {"ar": 0.0, "eager": 0.0, "lazy": 0.0}
for r in range(rounds):
    for p in prompts:
        t_ar, ref = run(p, "ar")
        tot["ar"] += t_ar
        for name in ("eager", "lazy") if r % 2 == 0 else ("lazy", "eager"):
            LearnedCost.observe = eager_observe if name == "eager" else lazy_observe
            t, toks = run(p, "ptp")
            assert toks == ref, "PTP diverged from AR"
            tot[name] += t
    print(
        f"round {r + 1}: AR {tot['ar']:.2f}s  PTP eager rebuild {tot['eager']:.2f}s ({tot['ar'] / tot['eager']:.3f}x AR)"
        f"  PTP lazy rebuild {tot['lazy']:.2f}s ({tot['ar'] / tot['lazy']:.3f}x AR)",
        flush=True,
    )
