"""Prefill speed of our passes (``decode/ar.py: prefill``, chunks of 512) on the default model, and the parts of one
chunk: the products of a layer (``x @ W.T`` at the model's shapes) and attention over our K/V state.

Usage: ``python docs/results/kernel/prefill/prefill.py`` (nothing else running)."""

import time

import ptp_mlx  # noqa: F401  (before mlx.core: ptp-sgemm binds first)

# isort: split
import mlx.core as mx

from ptp_mlx import blas
from ptp_mlx.decode.ar import prefill
from ptp_mlx.engine import Engine
from ptp_mlx.model import cpu_math

SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))  # N, K


def best_ms(f, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(f())  # sync: timing the computation
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def main() -> None:
    print("blas:", blas.state["blas"])
    for m in (128, 512):
        total = 0.0
        for n, k in SHAPES:
            x, w = mx.random.normal((m, k)), mx.random.normal((n, k))
            mx.eval(x, w)
            total += best_ms(lambda x=x, w=w: x @ w.T)
        q = mx.random.normal((1, 9, m, 64))
        kv = mx.random.normal((1, 3, m, 64))
        mx.eval(q, kv)
        att = best_ms(lambda q=q, kv=kv: cpu_math.attention(q, kv, kv, 0.125, "causal"))
        flops = 2 * m * sum(n * k for n, k in SHAPES)
        print(
            f"{m} rows: a layer's products {total:.2f} ms ({flops / total / 1e6:.0f} GFLOP/s), attention {att:.2f} ms"
        )
    eng = Engine.load()
    ids = eng.encode([{"role": "user", "content": "Tell me about the history of paper making. " * 40}])
    for n in (128, 512, 1024):
        ms = []
        for _ in range(3):
            cache = eng.pm.make_cache()
            t = time.perf_counter()
            prefill(eng.pm.base, (ids * 4)[:n], cache)  # (syncs per chunk)
            ms.append(1e3 * (time.perf_counter() - t))
        print(f"prefill {n} tokens: {min(ms):.0f} ms ({n / min(ms) * 1e3:.0f} tokens/s)")


if __name__ == "__main__":
    main()
