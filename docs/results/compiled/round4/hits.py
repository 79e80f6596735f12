"""How often the default drafter's calls are built ahead and queued from that build (issue 29, round 4).

usage: python docs/results/compiled/round4/hits.py PROMPTS.jsonl N  (greedy, 64 new tokens, the default drafter)
"""

import json
import sys
from collections import Counter

import ptp_mlx  # noqa: F401  (before mlx.core)
import ptp_mlx.generate as G
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

seen: Counter = Counter()
build, confirm = G.build_chained, G.confirm_chained


def built(sess, drafter, call, *args):
    nxt = build(sess, drafter, call, *args)
    seen[f"calls {call.plan.source}"] += 1
    seen[f"built ahead after {call.plan.source}"] += nxt is not None
    return nxt


def confirmed(chained, result, plan, i, cache, *more):
    call = confirm(chained, result, plan, i, cache, *more)
    if call is not None:
        seen["queued from the build"] += 1
    elif result.alt is not None or chained.guesses[result.accepted] is None:
        seen["dropped: outcome not guessed"] += 1
    else:
        seen["dropped: another plan" if plan is not None else "dropped: answer ended"] += 1
    return call


G.build_chained, G.confirm_chained = built, confirmed
eng = Engine.load()
with open(sys.argv[1]) as f:
    prompts = [json.loads(line) for line in f][: int(sys.argv[2])]
for p in prompts:
    msgs = [{"role": "user", "content": p["turns"][0]}]
    list(eng.generate(msgs, mode="ptp", sampling=SamplingSettings(0.0), max_tokens=64))
print(dict(seen))
