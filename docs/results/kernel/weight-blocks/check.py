"""Whether the default model's float32 weights are exactly their GGUF blocks rebuilt: for every quantized tensor of
the GGUF the converter read, ``code * scale + bias`` in float32 (a multiply, then an add; scales and biases float16
widened to float32) against ``mx.dequantize`` (what ``ptp_mlx/gguf.py`` converts with), bit for bit. Also this
machine's read bandwidth on one and two threads, the floor of a plain step's products.

    python docs/results/kernel/weight-blocks/check.py      (after a first ``ptp-chat`` or ``ptp-bench``: the GGUF
                                                            in the cache)
"""

from __future__ import annotations

import threading
import time

import ptp_mlx  # noqa: F401  (before mlx.core: ptp-sgemm binds first)

# isort: split
import mlx.core as mx
import numpy as np

from ptp_mlx.models import default_gguf


def blocks_match() -> None:
    g = mx.load(str(default_gguf()))
    names = sorted({k.rsplit(".", 1)[0] for k in g if k.endswith(".scales")})
    bad = total = packed = 0
    kinds: dict[int, int] = {}
    for base in names:
        w, s16, b16 = g[base + ".weight"], g[base + ".scales"], g[base + ".biases"]
        in_dim = s16.shape[1] * 32
        bits = w.shape[1] * 32 // in_dim
        kinds[bits] = kinds.get(bits, 0) + 1
        s, b = s16.astype(mx.float32), b16.astype(mx.float32)
        want = np.array(mx.dequantize(w, s, b, group_size=32, bits=bits))
        words = np.array(w).view(np.uint32)
        codes = np.stack([(words >> (bits * i)) & ((1 << bits) - 1) for i in range(32 // bits)], axis=-1)
        codes = codes.reshape(words.shape[0], -1).astype(np.float32)
        got = (codes * np.repeat(np.array(s), 32, axis=1)).astype(np.float32) + np.repeat(np.array(b), 32, axis=1)
        total += want.size
        bad += int((got.view(np.uint32) != want.view(np.uint32)).sum())
        packed += w.nbytes + s16.nbytes + b16.nbytes
    print(f"{len(names)} quantized tensors (bits: {kinds}), {total} weights: {bad} differ from mx.dequantize")
    print(f"bytes: {4 * total / 1e6:.0f} MB as float32, {packed / 1e6:.0f} MB as blocks (float16 scales and biases)")


def bandwidth(threads: int, mb: int = 256) -> float:
    bufs = [np.ones(mb * 1024 * 256, np.float32) for _ in range(threads)]
    for x in bufs:
        x.sum()  # (touch the pages)
    out = [0.0] * threads

    def read(i: int) -> None:
        out[i] = float(np.add.reduce(bufs[i]))

    best = float("inf")
    for _ in range(3):
        ts = [threading.Thread(target=read, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return threads * mb * 2**20 / best / 1e9


if __name__ == "__main__":
    blocks_match()
    for n in (1, 2):
        print(f"read bandwidth, {n} thread(s) (numpy sum, a lower bound): {bandwidth(n):.1f} GB/s")
