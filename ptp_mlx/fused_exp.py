"""``e^x`` in float32 as elementwise graph ops that ``mx.compile`` fuses into one vectorised loop (a leaf module:
``model/cpu_math.py`` and ``sampler.py`` share it).

On x86 MLX's CPU backend evaluates ``exp`` one element at a time (about 18 ns an element, against 0.3 ns for a
multiply; ``model/cpu_math.py`` says where that hurt). This is the same algorithm MLX's CPU backend uses
(``2^round(x log2 e)`` through the exponent bits, the fraction by a degree-6 polynomial); without a fused
multiply-add its last bit can differ from ``mx.exp`` (within 2 ulp).
"""

from __future__ import annotations

import mlx.core as mx

# MLX's CPU exp polynomial for 2^f, f in [-0.5, 0.5] (Cephes' coefficients), highest degree first.
_POLY = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)
_ROUND = 12582912.0  # 1.5 * 2^23: t + _ROUND rounds t to an integer in float32 (no call to floor)


def exp(x: mx.array) -> mx.array:
    """``e^x`` in float32 by MLX's CPU algorithm, as fusable elementwise ops, for ``x <= 88`` (0 below -88)."""
    t = mx.clip(x.astype(mx.float32) * 1.442695, -127.0, 127.0)
    shifted = t + _ROUND  # its low mantissa bits hold round(t) + 2^22
    frac = t - (shifted - _ROUND)
    p = _POLY[0] * frac + _POLY[1]
    for c in _POLY[2:]:
        p = p * frac + c
    bits = (mx.view(shifted, mx.int32) - (0x4B400000 - 127)) << 23  # 2^round(t) through the exponent bits
    y = mx.view(bits, mx.float32) * p
    return mx.where(t < -126.9, mx.array(0.0, mx.float32), y)  # (-inf, a masked score, is exactly 0)
