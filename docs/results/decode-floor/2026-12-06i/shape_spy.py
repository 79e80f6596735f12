"""Where the read changed an adapter call's successor to a prompt-lookup chain: the lookup plan's shape against the
built guess's (drafts, branches, a tree or not). Usage: ``python docs/results/decode-floor/2026-12-06i/shape_spy.py
metal 14`` from the repository root (it wraps ``device_sim.py``)."""

import atexit
import collections
import runpy
import sys

import ptp_mlx  # noqa
import ptp_mlx.decode.pipeline as pl

cnt = collections.Counter()
_c = pl.confirm_chained


def c(chained, result, plan, i, cache, *more):
    hit = chained.pick(result.accepted) if result.strand is None else None
    built = hit.guesses[result.accepted].realize(result) if hit is not None else None
    out = _c(chained, result, plan, i, cache, *more)
    if (
        out is None
        and built is not None
        and plan is not None
        and plan.source == "lookup"
        and built.source != "lookup"
        and not result.resolved
    ):
        same = (len(plan.drafts), plan.branches, bool(plan.strands)) == (
            len(built.drafts),
            built.branches,
            bool(built.strands),
        )
        cnt["same shape" if same else "other shape"] += 1
        cnt[
            f"lookup {len(plan.drafts)}d{len(plan.branches)}b{'+s' if plan.strands else ''} vs built {len(built.drafts)}d{len(built.branches)}b{'+s' if built.strands else ''}"
        ] += 1
    return out


pl.confirm_chained = c
sys.argv = ["device_sim.py"] + sys.argv[1:]
atexit.register(lambda: print(dict(cnt.most_common(14))))
runpy.run_path("docs/results/decode-floor/device_sim.py", run_name="__main__")
