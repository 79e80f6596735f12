"""What the gated LoRA's extra operations cost on the CPU, in four algebraically equal forms (issue 41).

The default model's 30 layers have four projection groups each (q|k|v, o, gate|up, down; ranks 48, 16, 32, 16
after fusion, as ``model/fused.py`` stacks them). For ``rows`` rows (row 0 a token row, gate 0; the others
auxiliary, gate 1) this times, compiled, the groups' base matmuls alone against four ways of adding the LoRA
delta ``(x A^T * gate) B``, and checks that the token row stays bit for bit the base product in every form.
Random weights; a measurement, not a decoder.

    python docs/results/kernel/lora_forms.py [rows]
"""

from __future__ import annotations

import sys
import time

import ptp_mlx  # noqa: F401  (loads the BLAS and ptp-sgemm before MLX)

# isort: split
import mlx.core as mx

LAYERS = 30
GROUPS = [(576, 960, 48), (576, 576, 16), (576, 3072, 32), (1536, 576, 16)]  # (in, out, rank)


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    mx.random.seed(0)
    W = [[mx.random.normal((o + r, i)) * 0.02 for i, o, r in GROUPS] for _ in range(LAYERS)]
    B = [[mx.random.normal((r, o)) * 0.02 for _, o, r in GROUPS] for _ in range(LAYERS)]
    Wt = [[w.T for w in ws] for ws in W]  # [base; A] fused, as FusedGroup holds it
    base_t = [[w[:o].T for w, (_, o, _) in zip(ws, GROUPS, strict=True)] for ws in W]
    a_t = [[w[o:].T for w, (_, o, _) in zip(ws, GROUPS, strict=True)] for ws in W]
    xs = [mx.random.normal((rows, i)) for i, _, _ in GROUPS]
    gate = mx.array([0.0] + [1.0] * (rows - 1))[:, None]
    mx.eval(W, B, Wt, base_t, a_t, xs, gate)

    def each(form):
        def run(gate, *xs):
            return [form(layer, g, o, gate, xs[g]) for layer in range(LAYERS) for g, (_, o, _) in enumerate(GROUPS)]

        return run

    forms = {
        "base only": lambda lay, g, o, gate, x: x @ base_t[lay][g],
        "addmm (today)": lambda lay, g, o, gate, x: _addmm(*mx.split(x @ Wt[lay][g], [o], axis=-1), gate, B[lay][g]),
        "z + (a*gate) B": lambda lay, g, o, gate, x: _plus(*mx.split(x @ Wt[lay][g], [o], axis=-1), gate, B[lay][g]),
        "separate A": lambda lay, g, o, gate, x: mx.addmm(x @ base_t[lay][g], (x @ a_t[lay][g]) * gate, B[lay][g]),
        "z + gate*(a B)": lambda lay, g, o, gate, x: _after(*mx.split(x @ Wt[lay][g], [o], axis=-1), gate, B[lay][g]),
    }
    compiled = {k: mx.compile(each(f)) for k, f in forms.items()}
    for f in compiled.values():
        mx.eval(f(gate, *xs))
    times: dict[str, list[float]] = {k: [] for k in compiled}
    for _ in range(15):
        for k, f in compiled.items():
            t0 = time.perf_counter()
            mx.eval(f(gate, *xs))
            times[k].append(time.perf_counter() - t0)
    base = compiled["base only"](gate, *xs)
    print(f"lora_forms.py {rows}: median ms of {LAYERS} x {len(GROUPS)} groups; token row == base product")
    for k, v in times.items():
        out = compiled[k](gate, *xs)
        same = all(mx.array_equal(a[0], b[0]).item() for a, b in zip(out, base, strict=True))  # (a sync, after timing)
        print(f"  {k:16s} {1000 * sorted(v)[len(v) // 2]:6.2f} ms  {'identical' if same else 'DIFFERS'}")


def _addmm(z, a, gate, b):
    return mx.addmm(z, a * gate, b)


def _plus(z, a, gate, b):
    return z + (a * gate) @ b


def _after(z, a, gate, b):
    return z + gate * (a @ b)


if __name__ == "__main__":
    main()
