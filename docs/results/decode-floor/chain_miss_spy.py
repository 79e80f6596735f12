"""Why calls built ahead of the read are dropped: wraps ``ptp-bench`` and counts, per chained build, what the read
decided (the call ran, or why it was dropped), and the calls after which nothing was built.

Usage: ``python docs/results/decode-floor/chain_miss_spy.py --prompts ptp_mlx/data/heldout_prompts.jsonl
--max-tokens 128 --methods ar,ptp`` (any ``ptp-bench`` arguments)."""

import atexit
import sys
from collections import Counter

import ptp_mlx.decode.pipeline as pl
from ptp_mlx.bench.cli import main

seen: Counter = Counter()
_build, _confirm = pl.build_chained, pl.confirm_chained


def build(sess, drafter, call, *more):
    out = _build(sess, drafter, call, *more)
    seen["built" if out is not None else "not built"] += 1
    if out is not None and out.others:
        seen["built: with another kind's build"] += 1
    if out is None:
        p = call.plan
        seen[f"not built: drafts {len(p.drafts)} strands {len(p.strands)} src {p.source}"] += 1
    return out


def why(chained, result, plan) -> str:
    if result.strand is not None:
        return "path took a strand"
    hit = chained.pick(result.accepted)
    if hit is None:
        return "no guess for this outcome"
    g = hit.guesses[result.accepted]
    other = " (another kind's build)" if hit.state is not None else ""
    if plan is None or plan.burst:
        return "answer ended / burst"
    if result.resolved:
        return "resolved"
    b = g.realize(result)
    if plan.branches != b.branches or plan.drafts != b.drafts:
        return f"rows differ (src {plan.source} vs {b.source})"
    if plan.strands != b.strands:
        return f"tree differs now {len(plan.strands)} built {len(b.strands)}"
    if plan.source != b.source or plan.strict != b.strict:
        return "source differs"
    return "hit" + other


def confirm(chained, result, plan, i, cache, *more):
    reason = why(chained, result, plan)
    out = _confirm(chained, result, plan, i, cache, *more)
    seen["confirm: " + reason + ("" if out is not None else " [dropped]")] += 1
    return out


@atexit.register
def report() -> None:
    for k, v in sorted(seen.items()):
        print(f"SPY {v:5d} {k}", file=sys.stderr)


if __name__ == "__main__":
    pl.build_chained, pl.confirm_chained = build, confirm
    sys.exit(main(sys.argv[1:]))
