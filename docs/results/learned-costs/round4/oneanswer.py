"""One answer from the cost curve on disk: the answer's PTP calls, the drafts accepted, the learnt curve after it.

Usage: ``python docs/results/learned-costs/round4/oneanswer.py K [K ...]`` (K: held-out prompt indices)."""

import json
import sys

from ptp_mlx.drafting.budget import Budget
from ptp_mlx.engine import Engine

calls = []
orig = Budget.record


def record(self, rows, tokens, seconds, cold=False):
    if rows > 1:
        calls.append(tokens)
    return orig(self, rows, tokens, seconds, cold)


Budget.record = record
eng = Engine.load()
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]
for k in map(int, sys.argv[1:]):
    p = prompts[k]
    n0 = len(calls)
    steps = list(eng.generate([{"role": "user", "content": p["turns"][0]}], max_tokens=128, mode="ptp"))
    toks = sum(len(s.tokens) for s in steps)
    c = calls[n0:]
    cur = eng.budget.curve
    widths = " ".join(f"{cur(w):.2f}" for w in (2, 4, 8, 16))
    print(
        p["category"],
        f"tokens {toks}, PTP calls {len(c)} carrying {sum(c)} tokens, drafts accepted {sum(c) - len(c)};",
        f"curve 2/4/8/16: {widths}; source {getattr(cur, 'source', '?')}",
    )
