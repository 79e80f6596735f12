"""Building ahead on this machine, A/B in one process: the learnt choice (``ChainChoice``) against building the
next call ahead always, and never. AR, then PTP with each variant in turn (order rotated per round), on every
held-out prompt, ``rounds`` times: the VM's drift hits all alike. Each variant's share of PTP calls queued from a
build ahead is counted too.

Usage: ``python docs/results/decode-floor/chain_ab.py [rounds] [temperature]`` from the repository root."""

import json
import sys

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
from ptp_mlx.decode.chain_odds import choice_for
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
S = SamplingSettings(temperature=temp, top_p=0.95 if temp else 1.0, seed=0)
eng = Engine.load()
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]
VARIANTS = {"learnt": None, "always": True, "never": False}


def run(p, mode):
    steps = list(eng.generate([{"role": "user", "content": p["turns"][0]}], max_tokens=128, mode=mode, sampling=S))
    return sum(s.step_time for s in steps), [t for s in steps for t in s.tokens]


run(prompts[0], "ar")  # warm-up: every shape compiles
run(prompts[0], "ptp")
choice = choice_for(eng.pm)
tot = dict.fromkeys(["ar", *VARIANTS], 0.0)
order = list(VARIANTS)
for r in range(rounds):
    for p in prompts:
        t_ar, ref = run(p, "ar")
        tot["ar"] += t_ar
        for name in order:
            choice.forced = VARIANTS[name]
            t, toks = run(p, "ptp")
            assert toks == ref, "PTP diverged from AR"
            tot[name] += t
        order = order[1:] + order[:1]
    choice.forced = None
    line = "  ".join(f"PTP {k} {tot[k]:.2f}s ({tot['ar'] / tot[k]:.3f}x AR)" for k in VARIANTS)
    print(f"round {r + 1}: AR {tot['ar']:.2f}s  {line}  [{choice.describe()}]", flush=True)
