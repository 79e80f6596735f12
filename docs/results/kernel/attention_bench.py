"""Attention of 30 layers over a bucket of 256 keys (CTX seen), compiled: ptp-attention (kernels/attention.cpp)
against the graph form (``PTP_MLX_ATTENTION=0``), for 1, 4 and 16 query rows; median of 15 (issue 41).

    python docs/results/kernel/attention_bench.py [CTX]     (default 128)
"""

import os
import sys
import time

import ptp_mlx  # noqa: F401  (the sgemm before MLX)

# isort: split
import mlx.core as mx

from ptp_mlx.kernels.extension import module
from ptp_mlx.model import cpu_math

mod = module()
if mod is None:
    raise SystemExit("the CPU primitives are not built here")
B, Hq, Hkv, D, S = 1, 9, 3, 64, 256
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 128
for L in (1, 4, 16):
    qs = [mx.random.normal((B, L, Hq, D)).transpose(0, 2, 1, 3) for _ in range(30)]  # one query per layer
    k, v = mx.random.normal((B, Hkv, S, D)), mx.random.normal((B, Hkv, S, D))
    col, row = mx.arange(S)[None], mx.arange(ctx, ctx + L)[:, None]
    mask = mx.where(col <= row, 0.0, -float("inf")).astype(mx.float32)
    mx.eval(qs, k, v, mask)

    def fused(qs, k, v, mask):
        return [mod.attention(q, k, v, 0.125, mask) for q in qs]

    def graph(qs, k, v, mask):
        os.environ["PTP_MLX_ATTENTION"] = "0"
        try:
            return [cpu_math.attention(q, k, v, 0.125, mask) for q in qs]
        finally:
            os.environ.pop("PTP_MLX_ATTENTION")

    for name, f in (("ptp-attention", fused), ("graph form", graph)):
        g = mx.compile(f)
        mx.eval(g(qs, k, v, mask))  # traces and compiles
        ts = []
        for _ in range(15):
            t = time.perf_counter()
            mx.eval(g(qs, k, v, mask))  # sync: one timed evaluation
            ts.append(time.perf_counter() - t)
        ts.sort()
        print(f"{L:2d} rows {name}: {ts[7] * 1e3:.2f} ms for 30 layers")
