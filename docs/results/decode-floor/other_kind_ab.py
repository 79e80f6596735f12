"""``OTHER_KIND_MIN`` on this CPU, A/B in one process: PTP with building ahead forced on at 0.15 (before) and 0.05
(now), and the learnt choice at 0.05, against AR, on every held-out prompt (order rotated per prompt), ``rounds``
times; every answer checked against AR's.

Usage: ``python docs/results/decode-floor/other_kind_ab.py [rounds]`` from the repository root."""

import json
import sys

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
import ptp_mlx.decode.ahead as ah
from ptp_mlx.decode.chain_odds import choice_for
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

S = SamplingSettings(temperature=0.0, seed=0)
eng = Engine.load()
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]


def run(p, mode):
    steps = list(eng.generate([{"role": "user", "content": p["turns"][0]}], max_tokens=128, mode=mode, sampling=S))
    return sum(s.step_time for s in steps), [t for s in steps for t in s.tokens]


run(prompts[0], "ar")  # warm-up: every shape compiles
run(prompts[0], "ptp")
choice = choice_for(eng.pm)
V = {
    "ar": ("ar", None, 0.15),
    "always 0.15": ("ptp", True, 0.15),
    "always 0.05": ("ptp", True, 0.05),
    "learnt 0.05": ("ptp", None, 0.05),
}
tot = dict.fromkeys(V, 0.0)
order = list(V)
for r in range(int(sys.argv[1])):
    for p in prompts:
        ref = None
        for k in order:
            mode, choice.forced, ah.OTHER_KIND_MIN = V[k]
            t, toks = run(p, mode)
            ref = ref or toks
            assert toks == ref
            tot[k] += t
        order = order[1:] + order[:1]
    print(f"round {r + 1}: " + "  ".join(f"{k} {tot['ar'] / tot[k]:.3f}x" for k in V), flush=True)
