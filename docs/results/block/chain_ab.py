"""Building the next call ahead (``decode/chain_odds.py: ChainChoice``) after ptp-block made a step about 7 ms: per
held-out prompt, interleaved, our AR, then PTP on one engine per configuration (``learnt``: the choice as measured,
``on`` / ``off``: forced); decode seconds summed over ``rounds`` passes.

Usage, from the repository root: ``python docs/results/block/chain_ab.py 0 2 learnt,on,off`` (temperature, rounds,
configurations)."""

import json
import sys

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
from ptp_mlx.decode.chain_odds import choice_for
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

temp = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
confs = (sys.argv[3] if len(sys.argv) > 3 else "learnt,on,off").split(",")
S = SamplingSettings(temperature=temp, top_p=0.95 if temp else 1.0, seed=0)
engines = {c: Engine.load() for c in confs}
for c, e in engines.items():
    choice_for(e.pm).forced = {"learnt": None, "on": True, "off": False}[c]
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]


def run(eng, p, mode):
    out = eng.generate([{"role": "user", "content": p["turns"][0]}], max_tokens=128, mode=mode, sampling=S)
    return sum(s.step_time for s in out)


for e in engines.values():  # warm-up, as the bench
    run(e, prompts[0], "ar"), run(e, prompts[0], "ptp")
tot = {"ar": 0.0, **{c: 0.0 for c in confs}}
for _ in range(rounds):
    for p in prompts:
        tot["ar"] += run(engines[confs[0]], p, "ar")
        for c, e in engines.items():
            tot[c] += run(e, p, "ptp")
print(
    f"T {temp}, {rounds} rounds: ar {tot['ar']:.2f}s; PTP "
    + ", ".join(f"{c} {tot[c]:.2f}s ({tot['ar'] / tot[c]:.3f}x our AR)" for c in confs)
)
for c, e in engines.items():
    print(c, choice_for(e.pm).describe())
