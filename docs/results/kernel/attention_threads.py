"""ptp-attention on one thread or two (ptp-sgemm's second thread, ``ptp_sgemm_parallel``): 30 layers, each with its
own K/V (so they stream from memory as in the model), a bucket of keys just above CTX, 1, 4 and 16 query rows;
median of 15 compiled evaluations.

    python docs/results/kernel/attention_threads.py [CTX ...]                   (two threads where there are two)
    PTP_MLX_ATTENTION_THREADS=1 python docs/results/kernel/attention_threads.py [CTX ...]   (one)
"""

import sys
import time

import ptp_mlx  # noqa: F401  (the sgemm before MLX)

# isort: split
import mlx.core as mx

from ptp_mlx.kernels.extension import module

mod = module()
if mod is None:
    raise SystemExit("the CPU primitives are not built here")
B, Hq, Hkv, D = 1, 9, 3, 64
for ctx in [int(a) for a in sys.argv[1:]] or [128, 500, 1000, 2000]:
    S = 1 << (ctx + 16).bit_length()  # the bucket: a power of two above the context
    ks = [mx.random.normal((B, Hkv, S, D)) for _ in range(30)]
    vs = [mx.random.normal((B, Hkv, S, D)) for _ in range(30)]
    for L in (1, 4, 16):
        qs = [mx.random.normal((B, L, Hq, D)).transpose(0, 2, 1, 3) for _ in range(30)]
        col, row = mx.arange(S)[None], mx.arange(ctx, ctx + L)[:, None]
        mask = mx.where(col <= row, 0.0, -float("inf")).astype(mx.float32)
        mx.eval(qs, ks, vs, mask)
        g = mx.compile(
            lambda qs, ks, vs, m: [mod.attention(q, k, v, 0.125, m) for q, k, v in zip(qs, ks, vs, strict=True)]
        )
        mx.eval(g(qs, ks, vs, mask))  # traces and compiles
        ts = []
        for _ in range(15):
            t = time.perf_counter()
            mx.eval(g(qs, ks, vs, mask))  # sync: one timed evaluation
            ts.append(time.perf_counter() - t)
        ts.sort()
        print(f"context {ctx:5d} (bucket {S}) {L:2d} rows: {ts[7] * 1e3:6.2f} ms for 30 layers", flush=True)
