"""Time the BLAS's sgemm against ptp-sgemm on the default model's matmuls (project issue 41).

One "pass" is what a forward pass of M token rows sends to ``cblas_sgemm`` in the compiled decoder: per layer
the fused q/k/v projection (576 -> 960), o (576 -> 576), the fused gate/up (576 -> 3072) and down (1536 -> 576),
each ``x @ W.T`` (RowMajor, NoTrans, Trans); then the tied-embedding logits (576 -> 49152); with --attention also
MLX's attention fallback per head (9 heads, a 256-key cache: q k^T as M x 256 x 64 Trans-B, p v as M x 64 x 256
NoTrans-B). Every layer has its own weights (538 MB in all), so the working set exceeds the caches as in the real
model. Both paths run in one process: the kernel with ``ptp_sgemm_enable(0)`` forwards every call to the BLAS.

    python scripts/bench_sgemm.py [--widths 1,2,4,8,16,24,32] [--repeats 5] [--attention] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
os.environ.setdefault("MKL_INTERFACE_LAYER", "LP64")

import numpy as np

from ptp_mlx import blas, kernels

HIDDEN, INTER, LAYERS, VOCAB, HEADS, HEAD_DIM, KEYS = 576, 1536, 30, 49152, 9, 64, 256
LAYER_SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # (N, K) of each W


def load(threads: int, min_work: int, path: str | None = None, spin: int = 0):
    path = path or blas.kernel_library() or kernels.build()[0]
    if path is None:
        sys.exit(f"error: {kernels.build()[1]}")
    mkl_path = blas.mkl_library()
    if mkl_path is None:
        sys.exit("error: this benchmark compares against MKL (pip install mkl)")
    mkl = ctypes.CDLL(mkl_path)
    lib = ctypes.CDLL(path)
    lib.ptp_sgemm_info.restype = ctypes.c_char_p
    lib.ptp_sgemm_set_fallback(ctypes.cast(mkl.cblas_sgemm, ctypes.c_void_p))
    lib.ptp_sgemm_set_threads(threads, min_work, spin)
    f = lib.cblas_sgemm
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    f.argtypes += [ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib, f, mkl


def mlx_like(shape, rng) -> np.ndarray:
    """A random array 24 bytes past a 64-byte boundary, as MLX's CPU allocator places them (8 past 16)."""
    n = int(np.prod(shape))
    buf = np.empty(n + 32, np.float32)
    start = ((24 - buf.ctypes.data % 64) % 64) // 4
    out = buf[start : start + n].reshape(shape)
    out[...] = rng.standard_normal(shape, dtype=np.float32) * 0.05
    return out


def make_pass(m: int, attention: bool, rng):
    """The list of sgemm argument tuples of one pass of ``m`` rows (buffers kept alive by the tuples)."""
    weights = [[mlx_like(s, rng) for s in LAYER_SHAPES] for _ in range(LAYERS)]
    emb = mlx_like((VOCAB, HIDDEN), rng)
    x = {k: mlx_like((m, k), rng) for k in (HIDDEN, INTER)}
    out = {n: mlx_like((m, n), rng) for n in {s[0] for s in LAYER_SHAPES} | {VOCAB}}
    q, kc, vc = (mlx_like(s, rng) for s in ((m, 64), (KEYS, 64), (KEYS, 64)))
    scores, pv = mlx_like((m, KEYS), rng), mlx_like((m, HEAD_DIM), rng)
    calls = []
    for layer in weights:
        for w in layer:
            n, k = w.shape
            calls.append((101, 111, 112, m, n, k, 1.0, x[k], k, w, k, 0.0, out[n], n))
            if attention and w.shape == LAYER_SHAPES[0]:
                for _ in range(HEADS):
                    calls.append((101, 111, 112, m, KEYS, HEAD_DIM, 1.0, q, 64, kc, 64, 0.0, scores, KEYS))
                    calls.append((101, 111, 111, m, HEAD_DIM, KEYS, 1.0, scores, KEYS, vc, 64, 0.0, pv, 64))
    calls.append((101, 111, 112, m, VOCAB, HIDDEN, 1.0, x[HIDDEN], HIDDEN, emb, HIDDEN, 0.0, out[VOCAB], VOCAB))
    ptrs = [tuple(a.ctypes.data if isinstance(a, np.ndarray) else a for a in c) for c in calls]
    return ptrs, (weights, emb, x, out, q, kc, vc, scores, pv)


def time_pass(f, ptrs, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        t0 = time.perf_counter()
        for c in ptrs:
            f(*c)
        best = min(best, time.perf_counter() - t0)
    return 1000.0 * best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="1,2,4,8,16,24,32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--attention", action="store_true", help="add MLX's attention fallback calls per head")
    ap.add_argument("--threads", type=int, default=1, help="2: the kernel's second thread splits N")
    ap.add_argument("--min-work", type=int, default=0, help="smallest N*K the second thread takes (0: default)")
    ap.add_argument("--spin", type=int, default=0, help="the worker's spin before it sleeps (0: default)")
    ap.add_argument("--path", help="a kernel path to time instead of the best one: avx512, avx2 or portable")
    ap.add_argument("--lib", help="a kernel library to time instead of the one ptp_mlx built (tuning)")
    ap.add_argument("--kernel-only", action="store_true", help="skip the MKL timings (tuning)")
    args = ap.parse_args(argv)
    lib, f, _mkl = load(args.threads, args.min_work, args.lib, args.spin)
    lib.ptp_sgemm_use.argtypes = [ctypes.c_char_p]
    if args.path and not lib.ptp_sgemm_use(args.path.encode()):
        sys.exit(f"error: this CPU cannot run the {args.path} path")
    widths = [int(x) for x in args.widths.split(",")]
    rng = np.random.default_rng(0)
    print(f"ptp-sgemm {lib.ptp_sgemm_info().decode()} vs MKL | threads {args.threads} | attention {args.attention}")
    print("| rows | MKL ms | (x 1 row) | kernel ms | (x 1 row) | kernel / MKL |")
    print("|---|---|---|---|---|---|")
    base = {}
    for m in widths:
        ptrs, keep = make_pass(m, args.attention, rng)
        ms = {0: float("nan")}
        for on in (1,) if args.kernel_only else (0, 1):  # the kernel off (every call forwarded to MKL), then on
            lib.ptp_sgemm_enable(on)
            ms[on] = time_pass(f, ptrs, args.repeats)
        del keep
        base.setdefault("mkl", ms[0])
        base.setdefault("ker", ms[1])
        print(
            f"| {m} | {ms[0]:.1f} | {ms[0] / base['mkl']:.2f} | {ms[1]:.1f} | {ms[1] / base['ker']:.2f} "
            f"| {ms[1] / ms[0]:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
