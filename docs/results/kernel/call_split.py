"""A compiled call's wall time split into ptp-sgemm's own time (every ``cblas_sgemm`` it takes or forwards, by its
counters) and the rest (elementwise ops, reductions, attention's softmax, MLX's scheduling), for a plain step and
the cost sweep's 4-, 8- and 16-row PTP calls on its random-weight model of the default model's shape (issue 41).
Median of 10 interleaved rounds, each call synchronised. A measurement, not a decoder.

    CTX=128 python docs/results/kernel/call_split.py     (CTX: the cache's context; 300 puts it in bucket 512)
"""

from __future__ import annotations

import ctypes
import os
import time

from ptp_mlx import blas
from ptp_mlx.bench.sweep import CALLS, call_timers, random_model
from ptp_mlx.drafting.protocol import DraftPlan


def main() -> None:
    lib = blas.kernel()
    if lib is None:
        raise SystemExit("ptp-sgemm is not loaded: nothing to split")
    lib.ptp_sgemm_taken_ns.restype = lib.ptp_sgemm_forwarded_ns.restype = ctypes.c_ulonglong

    def sgemm_ns() -> int:
        return lib.ptp_sgemm_taken_ns() + lib.ptp_sgemm_forwarded_ns()

    step, call_for = call_timers(random_model("135m"), int(os.environ.get("CTX", "128")))
    fns = {1: step, **{r: call_for(DraftPlan([5] * n, br)) for r, (n, br) in CALLS.items()}}
    for f in fns.values():
        f(), f()  # compile and warm
    res: dict[int, list[tuple[float, float]]] = {r: [] for r in fns}
    for _ in range(10):
        for r, f in fns.items():
            a, t = sgemm_ns(), time.perf_counter()
            f()
            wall, b = time.perf_counter() - t, sgemm_ns()
            res[r].append((wall * 1000, (b - a) / 1e6))
    for r, v in res.items():
        wall, sg = sorted(v)[len(v) // 2]
        print(f"{r:2d} rows: wall {wall:.1f} ms  sgemm {sg:.1f} ms  rest {wall - sg:.1f} ms")


if __name__ == "__main__":
    main()
