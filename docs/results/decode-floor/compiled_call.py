"""What calling a compiled function costs on the host (issue 40's host time on the path): the default model's compiled
plain step, called again and again on the same inputs with nothing computing (its graph is built, never evaluated),
beside synthetic compiled functions of as many inputs and outputs and about as many nodes.

Usage: ``python docs/results/decode-floor/compiled_call.py [calls]``. Best of 5 rounds of ``calls`` calls each.

2026-12-06 (Zen 4 VM): the plain step 178-210 us a call (63 arrays in; three runs); the synthetic function 66-99 us
with no captured arrays and 76-123 us with 300 (each captured array costs a call up to ~0.2 us, and the model's graph
captures every weight its primitives take). ``perf`` over the loop: array destructors and ``release`` ~26%,
``compile_replace``'s hash maps ~13%, malloc and free ~25%."""

import sys
import time

import ptp_mlx.decode.fixed as fixed  # (ptp_mlx before MLX: the kernel binds first)
from ptp_mlx.engine import Engine
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import SamplingSettings


def best_us(fn, args, calls: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        best = min(best, (time.perf_counter() - t0) / calls)
        del out
    return best * 1e6


def step_call(calls: int) -> None:
    """The default model's compiled plain step, taken from the bank at its 40th call of an answer."""
    import mlx.core as mx  # (after ptp_mlx)

    seen = {"n": 0}
    orig = fixed.CompileBank._fn

    def spy(self, what, bucket, make):
        fn = orig(self, what, bucket, make)

        def call(*args):
            seen["n"] += 1
            if seen["n"] == 40:
                mx.synchronize()  # (nothing computing while it is timed)
                print(f"compiled plain step: {best_us(fn, args, calls):6.1f} us a call ({len(args)} arrays in)")
            return fn(*args)

        return call

    fixed.CompileBank._fn = spy
    try:
        eng = Engine.load()
        ids = encode_prompt(eng.tokenizer, [{"role": "user", "content": "Write a long story about a dragon."}])
        opts = DecodeOptions(mode="ar", max_tokens=60, sampling=SamplingSettings())
        for _ in stream_generate(eng.pm, eng.tokenizer, ids, opts):
            pass
    finally:
        fixed.CompileBank._fn = orig


def synthetic(calls: int) -> None:
    import mlx.core as mx  # (after ptp_mlx)

    x = mx.ones((1, 64))
    for n_const in (0, 300):
        consts = [mx.ones((64, 64)) * (i + 1) for i in range(n_const)]
        bufs = [mx.zeros((64, 64)) for _ in range(60)]
        mx.eval(consts, bufs)

        def f(x, *b, consts=consts):
            y = x
            for i in range(60):
                y = y @ (consts[i * 5 % len(consts)] if consts else b[i]) * 0.01
            return (y, *[v + 0 for v in b])

        us = best_us(mx.compile(f), [x, *bufs], calls)
        print(f"synthetic: 60 inputs, 61 outputs, ~180 nodes, {n_const} captured arrays: {us:6.1f} us a call")


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    step_call(n)
    synthetic(n)
