"""Attention and SwiGLU for MLX's CPU backend whose exponentials cost what a multiply-add does.

Why: on x86 MLX's CPU backend evaluates ``exp`` one element at a time (its SIMD width there is 1, and each of the
polynomial's six fused multiply-adds is a call into libm): about 18 ns an element, against 0.3 ns for a multiply.
A PTP row pays for it three times: attention's softmax over every key of the bucket (9 heads x 512 keys x 30
layers for the default model: 3.4 ms a row), SwiGLU's sigmoid (1536 x 30: 1.1 ms a row) and, for an auxiliary
row, the log-sum-exp over the vocabulary (0.9 ms). Those, not the matmuls, made a 16-row call cost 3x a step.

``exp`` here is the same algorithm MLX's CPU backend uses (``2^round(x log2 e)`` through the exponent bits, the
fraction by a degree-6 polynomial), written as elementwise graph ops: ``mx.compile`` fuses them into one loop the
compiler vectorises. Without a fused multiply-add its last bit can differ from ``mx.exp`` (within 2 ulp), so
our attention is not bit for bit MLX's: every decoding path of ours (plain steps, PTP calls, prefill) uses it,
so PTP still equals our plain decoding bit for bit, and a difference from stock mlx-lm is a float near-tie.

Scope: only on the CPU device, only for passes over our own K/V state (``LayerKV``: mlx-lm's own caches, and so
the bench's ``mlx-lm`` method, keep the stock kernels), and not when ``PTP_MLX_CPU_MATH=0``. ``install`` swaps
the two names the supported families' modules call (``scaled_dot_product_attention``, ``swiglu``) for
dispatchers; SwiGLU takes no cache, so it follows the attention call of its own layer (``kv.in_our_pass``).
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx

from ..fused_exp import exp
from .kv import LayerKV, in_our_pass, mark_pass


def enabled() -> bool:
    """Whether passes over our K/V state use these kernels: on the CPU device unless ``PTP_MLX_CPU_MATH=0``."""
    if os.environ.get("PTP_MLX_CPU_MATH", "1").lower() in ("0", "false", "no"):
        return False
    return mx.default_device() == mx.cpu


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """Softmax over ``axis`` in float32 (then ``x``'s dtype), with ``exp`` above."""
    xf = x.astype(mx.float32)
    e = exp(xf - mx.max(xf, axis=axis, keepdims=True))
    return (e / mx.sum(e, axis=axis, keepdims=True)).astype(x.dtype)


def logsumexp(x: mx.array, axis: int = -1) -> mx.array:
    """``log(sum(exp(x)))`` over ``axis`` in float32, with ``exp`` above (finite rows)."""
    xf = x.astype(mx.float32)
    m = mx.max(xf, axis=axis, keepdims=True)
    return mx.squeeze(m, axis) + mx.log(mx.sum(exp(xf - m), axis=axis))


def silu(x: mx.array) -> mx.array:
    """``x * sigmoid(x)`` with ``exp`` above."""
    xf = x.astype(mx.float32)
    return (xf / (1.0 + exp(-xf))).astype(x.dtype)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``: one primitive (``kernels/rowwise.cpp``) for float32 where the extension is built (it is
    elementwise, so every pass length takes it), else with ``exp`` above."""
    fused = fused_op("swiglu")
    if fused is not None and gate.dtype == mx.float32 and x.dtype == mx.float32 and gate.shape == x.shape:
        return fused(gate, x)
    return silu(gate) * x


def _causal(L: int, S: int, window: int | None = None) -> mx.array:
    """bool [L, S]: query row i (at key position S - L + i) sees the keys at or before it (within ``window``)."""
    rows = mx.arange(S - L, S)[:, None]
    cols = mx.arange(S)[None]
    m = cols <= rows
    return m & (cols > rows - window) if window is not None else m


def attention(queries, keys, values, scale: float, mask) -> mx.array | None:
    """Scaled dot-product attention as MLX's CPU fallback computes it (grouped heads share their K/V, the
    scores' softmax over the keys), with ``softmax`` above. None where a mask's form is not handled here."""
    B, Hq, L, D = queries.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    if isinstance(mask, str):
        if mask != "causal":
            return None
        mask = _causal(L, S)
    if mask is not None and mask.ndim == 4 and mask.shape[1] not in (1, Hq):
        return None
    fused = fused_op("attention")
    if fused is not None and queries.dtype == mx.float32 and keys.dtype == mx.float32:
        if mask is not None and mask.dtype != mx.bool_:
            mask = mask.astype(mx.float32)
        return fused(queries, keys, values, scale, mask)
    q = queries * mx.array(scale, queries.dtype)
    rep = Hq // Hkv
    if rep > 1:  # [B, Hkv, rep, L, D] against [B, Hkv, 1, S, D]
        q = q.reshape(B, Hkv, rep, L, D)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
        if mask is not None and mask.ndim == 4:
            mask = mask.reshape(mask.shape[0], -1, rep if mask.shape[1] == Hq else 1, L, S)
    scores = q @ mx.swapaxes(keys, -1, -2)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-float("inf"), scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    out = softmax(scores) @ values
    return out.reshape(B, Hq, L, D)


def fused_op(name: str):
    """The extension's ``attention``, ``swiglu``, ``rms_norm``, ``rope_table`` or ``linear`` (``kernels/``), or
    None: not on the CPU device, not built, or switched off (``PTP_MLX_CPU_MATH=0`` for all, ``PTP_MLX_<NAME>=0``
    for one: the graph forms, for comparison)."""
    if not enabled() or os.environ.get(f"PTP_MLX_{name.upper()}", "1").lower() in ("0", "false", "no", "off"):
        return None
    from ..kernels.extension import module

    mod = module()
    return None if mod is None else getattr(mod, name)


def _rms_norm_dispatcher(stock):
    def rms_norm(x, weight, eps, *args, **kwargs):
        # Passes over our K/V state only (``kv.mark_pass``): training's and mlx-lm's own keep the stock norm, and
        # every pass over our state, prefill included, takes the same form, so no row is compared across the two.
        if in_our_pass() and not args and not kwargs and x.dtype == mx.float32:
            fused = fused_op("rms_norm")
            if fused is not None and (weight is None or (weight.dtype == mx.float32 and weight.ndim == 1)):
                return fused(x, weight, float(eps))
        return stock(x, weight, eps, *args, **kwargs)

    rms_norm.ptp_stock = stock
    return rms_norm


def _attention_dispatcher(stock):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        ours = sinks is None and isinstance(cache, LayerKV) and enabled()
        mark_pass(ours)  # (this layer's SwiGLU and the norms after it follow)
        out = attention(queries, keys, values, scale, mask) if ours else None
        if out is None:
            return stock(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return out

    scaled_dot_product_attention.ptp_stock = stock
    return scaled_dot_product_attention


def _swiglu_dispatcher(stock):
    def dispatch(gate, x):
        return swiglu(gate, x) if in_our_pass() else stock(gate, x)

    dispatch.ptp_stock = stock
    return dispatch


def install(layers) -> None:
    """Route the attention and SwiGLU of these transformer layers through the dispatchers (once per family
    module), and ``mx.fast.rms_norm`` through its dispatcher (once per process)."""
    if not hasattr(mx.fast.rms_norm, "ptp_stock"):
        mx.fast.rms_norm = _rms_norm_dispatcher(mx.fast.rms_norm)
    for name in {type(getattr(layer, "self_attn", layer)).__module__ for layer in layers}:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        fn = getattr(mod, "scaled_dot_product_attention", None)
        if fn is not None and not hasattr(fn, "ptp_stock"):
            mod.scaled_dot_product_attention = _attention_dispatcher(fn)
        fn = getattr(mod, "swiglu", None)
        if fn is not None and not hasattr(fn, "ptp_stock"):
            mod.swiglu = _swiglu_dispatcher(fn)
