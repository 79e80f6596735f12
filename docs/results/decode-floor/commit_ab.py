"""Committing to the call built ahead (``Drafter.commit``) against planning after every read, A/B in one process:
AR, then PTP with each variant in turn (order rotated per prompt), on every held-out prompt, ``rounds`` times.
Building ahead as learnt (``ChainChoice``), or ``always`` / ``never`` as the third argument.

Usage: ``python docs/results/decode-floor/commit_ab.py [rounds] [temperature] [learnt|always|never]``."""

import json
import sys

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
from ptp_mlx.decode.chain_odds import choice_for
from ptp_mlx.drafting.policy import DraftPolicy
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
forced = {"learnt": None, "always": True, "never": False}[sys.argv[3] if len(sys.argv) > 3 else "learnt"]
S = SamplingSettings(temperature=temp, top_p=0.95 if temp else 1.0, seed=0)
eng = Engine.load()
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]
commit = DraftPolicy.commit
VARIANTS = {"commit": commit, "plan": lambda self, plan, i: None}


def run(p, mode):
    steps = list(eng.generate([{"role": "user", "content": p["turns"][0]}], max_tokens=128, mode=mode, sampling=S))
    return sum(s.step_time for s in steps), [t for s in steps for t in s.tokens], sum(s.rows > 1 for s in steps)


run(prompts[0], "ar")  # warm-up: every shape compiles
run(prompts[0], "ptp")
choice_for(eng.pm).forced = forced
tot = dict.fromkeys(["ar", *VARIANTS], 0.0)
calls = dict.fromkeys(VARIANTS, 0)
order = list(VARIANTS)
for r in range(rounds):
    for p in prompts:
        t_ar, ref, _ = run(p, "ar")
        tot["ar"] += t_ar
        for name in order:
            DraftPolicy.commit = VARIANTS[name]
            t, toks, n = run(p, "ptp")
            assert toks == ref, "PTP diverged from AR"
            tot[name] += t
            calls[name] += n
        order = order[1:] + order[:1]
    line = "  ".join(f"PTP {k} {tot[k]:.2f}s ({tot['ar'] / tot[k]:.3f}x AR, {calls[k]} PTP calls)" for k in VARIANTS)
    print(f"round {r + 1}: AR {tot['ar']:.2f}s  {line}  [{choice_for(eng.pm).describe()}]", flush=True)
