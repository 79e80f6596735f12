"""Interleaved timing of several ptp-sgemm builds on the default model's five product shapes (30 layers of distinct
weights, the tied head once): ms for one pass of every product, best of R rounds, builds interleaved in one process.

    T=2 W=1,4,8,16 python docs/results/kernel/l2-prefetch/shapes.py OLD.so NEW.so [...]
    (T: threads, W: widths, R: rounds, OFF: token rows that many floats off alignment, KPATH=avx2: time that SIMD path, DETAIL=1: per shape)

Builds: ``gcc -O3 -shared -fPIC -ffp-contract=off -pthread -march=native -o X.so ptp_mlx/kernels/sgemm.c``.
"""

import ctypes
import os
import sys
import time

import numpy as np

P = ctypes.c_void_p
libs = []
for path in sys.argv[1:]:
    lib = ctypes.CDLL(path)
    lib.ptp_sgemm_set_threads(int(os.environ.get("T", "1")), 0, 0)
    if os.environ.get("KPATH"):
        assert lib.ptp_sgemm_use(os.environ["KPATH"].encode())
    f = lib.cblas_sgemm
    f.argtypes = [ctypes.c_int] * 6 + [
        ctypes.c_float,
        P,
        ctypes.c_int,
        P,
        ctypes.c_int,
        ctypes.c_float,
        P,
        ctypes.c_int,
    ]
    libs.append((os.path.basename(path), f))
# name: (N, K, copies) of each W in x @ W.T
shapes = {
    "qkv": (960, 576, 30),
    "o": (576, 576, 30),
    "gu": (3072, 576, 30),
    "down": (576, 1536, 30),
    "head": (49152, 576, 1),
}
rng = np.random.default_rng(0)
Ws = {k: [rng.standard_normal((n, kk), dtype=np.float32) for _ in range(c)] for k, (n, kk, c) in shapes.items()}
WID = [int(x) for x in os.environ.get("W", "1,4,8,12,16").split(",")]
REP = int(os.environ.get("R", "5"))
OFF = int(os.environ.get("OFF", "0"))
res = {}
for M in WID:
    # OFF > 0: the token rows that many floats past the buffer's start, off 64-byte alignment as MLX hands them over
    A = {
        k: rng.standard_normal(M * kk + 4, dtype=np.float32)[OFF:][: M * kk].reshape(M, kk)
        for k, (_n, kk, _c) in shapes.items()
    }
    C = {k: np.zeros((M, n), np.float32) for k, (n, _kk, _c) in shapes.items()}
    for _rep in range(REP):
        for li, (_name, f) in enumerate(libs):
            for name, (n, kk, _c) in shapes.items():
                t0 = time.perf_counter()
                for W in Ws[name]:
                    f(
                        101,
                        111,
                        112,
                        M,
                        n,
                        kk,
                        1.0,
                        A[name].ctypes.data,
                        kk,
                        W.ctypes.data,
                        kk,
                        0.0,
                        C[name].ctypes.data,
                        n,
                    )
                dt = (time.perf_counter() - t0) * 1000
                res[(li, M, name)] = min(res.get((li, M, name), 1e9), dt)
print("total ms per pass (sum of shapes), best of", REP, "; x = relative to the first build's first width")
print("M  " + "  ".join(f"{name:>16}" for name, _ in libs))
base1 = sum(res[(0, WID[0], k)] for k in shapes)
for M in WID:
    tot = [sum(res[(li, M, k)] for k in shapes) for li in range(len(libs))]
    print(f"{M:<3}" + "  ".join(f"{t:8.2f} ({t / base1:4.2f})" for t in tot))
if os.environ.get("DETAIL"):
    for M in WID:
        for li, (name, _) in enumerate(libs):
            print(M, name, " ".join(f"{k}={res[(li, M, k)]:.2f}" for k in shapes))
