"""The pace guard's margin (``drafting/learn.py: GUARD_MARGIN``) and the longest burst after failed probes
(``drafting/budget.py: MAX_BURST``) on this machine's costs: per held-out prompt, interleaved, our AR, then PTP on
one engine per configuration (each learning over its own answers); decode seconds summed over ``rounds`` passes.

Usage, from the repository root: ``python docs/results/guard/guard_ab.py 0.7 3 0.03:64,-0.05:64,-0.05:128``
(temperature, rounds, configurations ``margin:max_burst``)."""

import json
import sys

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
from ptp_mlx.drafting import budget, learn
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

temp = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
margins = (sys.argv[3] if len(sys.argv) > 3 else "0.03:64,0:64").split(",")
S = SamplingSettings(temperature=temp, top_p=0.95 if temp else 1.0, seed=0)
engines = {m: Engine.load() for m in margins}
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]


def run(eng, p, mode, conf="0.03:64"):
    margin, longest = conf.split(":")
    learn.GUARD_MARGIN, budget.MAX_BURST = float(margin), int(longest)
    out = eng.generate([{"role": "user", "content": p["turns"][0]}], max_tokens=128, mode=mode, sampling=S)
    return sum(s.step_time for s in out)


for m, e in engines.items():  # warm-up, as the bench
    run(e, prompts[0], "ar"), run(e, prompts[0], "ptp", m)
tot = {"ar": 0.0, **{m: 0.0 for m in margins}}
for _ in range(rounds):
    for p in prompts:
        tot["ar"] += run(engines[margins[0]], p, "ar")
        for m, e in engines.items():
            tot[m] += run(e, p, "ptp", m)
print(
    f"T {temp}, {rounds} rounds: ar {tot['ar']:.2f}s; PTP "
    + ", ".join(f"{m} {tot[m]:.2f}s ({tot['ar'] / tot[m]:.3f}x our AR)" for m in margins)
)
