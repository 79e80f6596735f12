"""Free rows, greedy, the held-out prompts: what each PTP call verified, and what came before each priming call (a
call with no drafts in hand). A measurement, not a decoder (docs/results/trees/joint-windows/README.md).

    python docs/results/trees/joint-windows/calls.py [prompts]
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import ptp_mlx  # (before mlx: it loads the BLAS)

# isort: split
from ptp_mlx.decode import pipeline
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.policy import DraftingConfig
from ptp_mlx.engine import Engine
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import SamplingSettings

PROMPTS = Path(ptp_mlx.__file__).parent / "data" / "heldout_prompts.jsonl"


def main() -> None:
    log: list = []
    read = pipeline.CallQueue.read

    def logged(self, clock=pipeline.NO_CLOCK):
        plan, res = read(self, clock)
        log.append((plan, res))
        return plan, res

    pipeline.CallQueue.read = logged
    eng = Engine.load()
    for b in [eng.budget, *eng.mode_budgets.values()]:
        if b is not None:
            b.curve = CostCurve([1, 64], [1.0, 1.0])  # (what ``ptp-bench --free-rows`` sets)
    s = SamplingSettings()
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 14
    for line in PROMPTS.read_text().splitlines()[:limit]:
        ids = encode_prompt(eng.tokenizer, [{"role": "user", "content": json.loads(line)["turns"][0]}])
        opts = DecodeOptions(mode="ptp", max_tokens=128, sampling=s, drafting=DraftingConfig(budget=eng.budget_for(s)))
        for _ in stream_generate(eng.pm, eng.tokenizer, ids, opts):
            pass
        log.append(None)
    calls = [x for x in log if x is not None]
    print(f"calls {len(calls)}, tokens {sum(len(r.block) for _, r in calls)} (bursts aside), tokens per call "
          f"{sum(len(r.block) for _, r in calls) / len(calls):.3f}")  # fmt: skip
    by, why, prev = collections.defaultdict(list), collections.Counter(), None
    for x in log:
        if x is None:
            prev = None
            continue
        plan, res = x
        tree = sum(len(st.tokens) for st in plan.strands)
        kind = "priming" if not plan.drafts and not tree else f"{plan.source} {'tree' if tree else 'chain'}"
        by[kind].append(len(res.block))
        if kind == "priming":
            why[_before(prev)] += 1
        prev = x
    for kind, blocks in sorted(by.items()):
        print(f"{kind:14s} {len(blocks):4d} calls, {sum(blocks) / len(blocks):.2f} tokens per call")
    print("before a priming call:")
    for reason, k in why.most_common():
        print(f"  {k:4d} {reason}")


def _before(prev) -> str:
    """Where the call before a priming call left its path: no window there, so no drafts in hand."""
    if prev is None:
        return "the answer's first call (or one after a burst)"
    plan, res = prev
    if res.strand is None:
        return f"the chain, {'with' if res.accepted in dict(plan.branches) else 'without'} a branch there"
    st = plan.strands[res.strand]
    where = "its last token" if res.accepted == st.depth else "an inner token"
    return f"a strand of {len(st.tokens)} token(s), window {st.width}, stopped at {where}"


if __name__ == "__main__":
    main()
