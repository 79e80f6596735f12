"""What letting go of a build ahead costs the path. ``whole``: ``confirm_chained`` timed by how many builds of other
kinds it lets go. ``parts``: before it runs, each build of another kind the read does not use is let go here, its
state's arrays first, then its outputs (the lazy graph of a whole compiled call), each timed. Runs
``device_sim.py`` (its curve and prompt count) with the spy.

Usage: ``python docs/results/decode-floor/release_cost.py whole|parts [metal|free|measured] [prompts]``."""

import collections
import runpy
import statistics
import sys
import time

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
import ptp_mlx.decode.pipeline as pl

mode = sys.argv[1] if len(sys.argv) > 1 else "whole"
times: dict = collections.defaultdict(list)
_confirm = pl.confirm_chained


def spy(chained, result, plan, i, cache, *more):
    hit = chained.pick(result.accepted) if result.strand is None else None
    if mode == "parts":
        for o in [o for o in chained.others if o is not hit]:
            chained.others.remove(o)
            state, out = o.state, o.call.out
            o.state = o.call = None
            t0 = time.perf_counter()
            del state
            t1 = time.perf_counter()
            del out
            times["let go of a build's state"].append(t1 - t0)
            times["then of its outputs"].append(time.perf_counter() - t1)
    others = len(chained.others)
    del hit
    t0 = time.perf_counter()
    out = _confirm(chained, result, plan, i, cache, *more)
    times[f"confirm_chained, {others} other build(s), {'ran' if out is not None else 'dropped'}"].append(
        time.perf_counter() - t0
    )
    return out


pl.confirm_chained = spy
sys.argv = ["device_sim.py", *(sys.argv[2:] or ["metal", "4"])]
try:
    runpy.run_path("docs/results/decode-floor/device_sim.py", run_name="__main__")
finally:
    for k, v in sorted(times.items()):
        print(f"{k}: {len(v)} reads, median {1e3 * statistics.median(v):.3f} ms")
