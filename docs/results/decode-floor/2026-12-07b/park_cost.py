"""What keeping an unused build for later costs on the path (``ahead.park``: the cut of its edges to the K/V
buffers, ``cut_buffers``), timed inside ``device_sim.py`` (medians, ms, per number of builds kept at once).

Usage: ``python docs/results/decode-floor/2026-12-07b/park_cost.py [metal|free|measured] [prompts] [temperature]``."""

import collections
import runpy
import statistics
import sys
import time

import ptp_mlx  # noqa
import ptp_mlx.decode.ahead as ah

T = collections.defaultdict(list)
_park = ah.park


def park(grave, before, unused):
    t0 = time.perf_counter()
    _park(grave, before, unused)
    T[f"park {len(unused)}"].append((time.perf_counter() - t0) * 1e3)


ah.park = park
cb = ah._cut_buffers()


def cut(outs, bufs):
    t0 = time.perf_counter()
    n = cb(outs, bufs)
    T[f"cut {len(outs)}"].append((time.perf_counter() - t0) * 1e3)
    return n


ah._cut_buffers = lambda: cut
sys.argv = ["device_sim.py"] + sys.argv[1:]
runpy.run_path("docs/results/decode-floor/device_sim.py", run_name="__main__")
for k in sorted(T):
    v = T[k]
    print(f"{k:40s} n {len(v):5d} median {statistics.median(v):.3f} mean {statistics.mean(v):.3f}")
