"""Lookup chains built by token (``Drafter.guess_by_token``) off and on, A/B in one process, where building ahead
would run beside a device (``device_sim.py``'s Metal-like curve, building ahead forced on, time to spare as
measured): per variant, the default drafter's PTP calls over every held-out prompt answered by each variant in turn
(the order reversed in the second round), how many were chained, and the host time on the path per call (the
profile's ``ON_PATH`` phases): median and mean over all calls, and the median of the per-prompt medians (what
``device_sim.py`` prints). Every answer is checked against plain decoding's.

Runs at commit ``58f92d2`` (the builds by token, reverted after this measurement: README.md beside it).
Usage: ``python docs/results/decode-floor/2026-12-06i/token_ab.py [prompts] [temperature]`` from the repository
root of that checkout."""

import collections
import json
import math
import statistics
import sys

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
import ptp_mlx.decode.ahead as ahead
from ptp_mlx.bench.profile import ON_PATH, PhaseClock
from ptp_mlx.decode.chain_odds import choice_for
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.policy import DraftingConfig
from ptp_mlx.engine import Engine
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import SamplingSettings

limit = int(sys.argv[1]) if len(sys.argv) > 1 else 14
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
WIDTHS = list(range(1, 65))
METAL = [1.0 if w == 1 else 1.05 + 0.5 * (math.ceil(w / 5) - 1) if w <= 15 else 2.3 + 0.02 * (w - 16) for w in WIDTHS]
VARIANTS = {"by token off": float("inf"), "by token on": ahead.TOKEN_MIN}

eng = Engine.load()
for b in [eng.budget, *eng.mode_budgets.values()]:
    b.curve = CostCurve(WIDTHS, METAL)
choice_for(eng.pm).forced = True
s = SamplingSettings(temperature=temp, top_p=0.95 if temp else 1.0, seed=0)
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")][:limit]
hosts: dict[str, list[float]] = collections.defaultdict(list)
medians: dict[str, list[float]] = collections.defaultdict(list)
chained: collections.Counter = collections.Counter()
for rnd in range(2):
    for p in prompts:
        ids = encode_prompt(eng.tokenizer, [{"role": "user", "content": p["turns"][0]}])
        ar = [t for st in eng.generate(ids, mode="ar", max_tokens=128, sampling=s) for t in st.tokens]
        for name in list(VARIANTS)[:: 1 if rnd == 0 else -1]:
            ahead.TOKEN_MIN = VARIANTS[name]
            clock = PhaseClock()
            budget = eng.budget_for(s)
            opts = DecodeOptions(
                mode="ptp", max_tokens=128, sampling=s, drafting=DraftingConfig(budget=budget), clock=clock
            )
            toks = [t for st in stream_generate(eng.pm, eng.tokenizer, ids, opts) for t in st.tokens]
            assert toks == ar, f"{name} on {p['question_id']}: the answer differs from plain decoding's"
            calls = [c for c in clock.calls if "rows" in c]
            host = [1e3 * sum(c.get(k, 0.0) for k in ON_PATH) for c in calls]
            hosts[name] += host
            medians[name] += [statistics.median(host)] if host else []
            chained[name] += sum("build" not in c for c in calls)
            chained[name + " calls"] += len(calls)
ahead.TOKEN_MIN = VARIANTS["by token on"]
print(f"{len(prompts)} held-out prompts x 2 rounds, T {temp}, Metal-like curve, building ahead forced on; lossless")
for name in VARIANTS:
    h, n = hosts[name], chained[name + " calls"]
    print(
        f"{name:13s} PTP calls {n:5d}  chained {chained[name]:5d} ({100 * chained[name] / max(n, 1):.0f}%)  host on path"
        f" per call: median {statistics.median(h):.3f} ms, mean {statistics.mean(h):.3f} ms; median of the per-prompt"
        f" medians {statistics.median(medians[name]):.3f} ms"
    )
