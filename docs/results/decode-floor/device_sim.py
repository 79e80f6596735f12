"""The default drafter's calls where building ahead would run beside a device (issue 40's profile item), simulated on
this CPU: the budget prices rows by a device-like curve and the next call is built ahead always (as ``ptp-bench
--free-rows`` does with a flat curve). Per held-out prompt: PTP calls, how many were queued from a build ahead, the
median host time on the path per call (``ptp-bench --profile``'s ``ON_PATH`` phases); over all: why the others
were built after the read, what each dropped build's read found, and whether every answer equals plain decoding.

Curves: ``metal``, a step per five rows as MLX's Metal ``gemv_wide`` reads the weights once per five rows on M3 and
later (1.05, 1.55, 2.05 steps for 2-5, 6-10, 11-15 rows, then 2.3 rising slowly); ``free``, every width at one step.
Both are assumptions about a device, not measurements of one: only the host's part is real here. ``measured``: this
machine's own curve (the cached probe, corrected by the calls), building ahead forced on all the same.

Usage: ``python docs/results/decode-floor/device_sim.py [metal|free|measured] [prompts] [temperature]``."""

import collections
import json
import math
import statistics
import sys

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
import ptp_mlx.decode.pipeline as pl
from ptp_mlx.bench.profile import profile_default
from ptp_mlx.decode.chain_odds import choice_for
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.engine import Engine
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import SamplingSettings

kind = sys.argv[1] if len(sys.argv) > 1 else "metal"
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 14
temp = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
WIDTHS = list(range(1, 65))
CURVES = {
    "metal": [
        1.0 if w == 1 else 1.05 + 0.5 * (math.ceil(w / 5) - 1) if w <= 15 else 2.3 + 0.02 * (w - 16) for w in WIDTHS
    ],
    "free": [1.0] * len(WIDTHS),
}
seen: collections.Counter = collections.Counter()
_confirm = pl.confirm_chained


def confirm(chained, result, plan, i, cache, *more):
    """What the read found where it dropped the call built ahead (the path through a strand aside)."""
    out = _confirm(chained, result, plan, i, cache, *more)
    if out is None and result.strand is None:
        hit = chained.pick(result.accepted)
        if hit is None:
            seen["no build for that outcome"] += 1
        elif plan is None or plan.burst or result.resolved:
            seen["answer ended, burst or resolved"] += 1
        else:
            built = hit.guesses[result.accepted].realize(result)
            if plan.source != built.source:
                seen[f"planned {plan.source}, built {built.source}"] += 1
            else:
                seen["rows differ"] += 1
    return out


pl.confirm_chained = confirm
eng = Engine.load()
for b in [eng.budget, *eng.mode_budgets.values()]:
    b.curve = CostCurve(WIDTHS, CURVES[kind]) if kind in CURVES else b.curve
choice_for(eng.pm).forced = True
s = SamplingSettings(temperature=temp, top_p=0.95 if temp else 1.0, seed=0)
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")][:limit]
calls = chained = 0
why: collections.Counter = collections.Counter()
hosts, lossy = [], []
for p in prompts:
    ids = encode_prompt(eng.tokenizer, [{"role": "user", "content": p["turns"][0]}])
    row = profile_default(eng, ids, 128, s)
    if row is None:
        continue
    ar = [t for st in eng.generate(ids, mode="ar", max_tokens=128, sampling=s) for t in st.tokens]
    if ar != list(row.tokens):
        lossy.append(p["question_id"])
    calls, chained = calls + row.calls, chained + row.chained
    why.update(row.why)
    hosts.append(row.host_on_path)
    print(
        f"{p['question_id']:16s} PTP calls {row.calls:3d}  chained {row.chained:3d}  host on path {row.host_on_path:.2f} ms"
        f"  rows {row.rows}  tokens/call {row.tokens_per_call:.2f}",
        flush=True,
    )
print(f"{kind}: {calls} PTP calls, {chained} chained ({100 * chained / max(calls, 1):.0f}%); host on path per prompt:"
      f" median of medians {statistics.median(hosts):.2f} ms")  # fmt: skip
print("built after the read:", dict(why.most_common()))
print("dropped builds:", dict(seen.most_common()))
print("lossless:", "every answer equals plain decoding" if not lossy else f"DIVERGED on {lossy}")
