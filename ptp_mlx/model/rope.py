"""RoPE from one cosine/sine table per call, where ``mx.fast.rope`` is not a kernel (MLX's CPU backend).

On Metal and CUDA ``mx.fast.rope`` is one primitive. On the CPU it expands into its op-level fallback, which
computes the positions, the inverse frequencies, their product, its cosine and sine again for every query and key
of every layer: about 17 graph nodes each, 30-40% of a small model's call graph, and graph nodes are what a
compiled call's host time costs (``mx.compile`` replays them one by one: docs/method.md, section 5). A fixed-shape
call has one position array for all layers, so the table is computed once per call and every layer only rotates:
two slices, two fused elementwise chains and a concatenation.

The table comes from the model's own RoPE module applied to a probe (ones in the first half of the rotated
dimensions, zeros in the second; pairs (1, 0) in the traditional layout): its outputs are exactly the cosines and
sines the fallback computes (``1 * c - 0 * s == c``), whatever the module's base, scale or frequencies. The rotation
is the fallback's own arithmetic in the same order (``x1 * c - x2 * s``, ``x1 * s + x2 * c``), so every row gets
bit for bit what ``mx.fast.rope`` gives it. Only modules whose call is ``mx.fast.rope`` of the input itself
qualify (``RoPE``, ``Llama3RoPE``); the others pre-scale the input and keep their own call.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import cpu_math

# RoPE modules whose ``__call__`` is ``mx.fast.rope(x, ...)`` of the unscaled input.
_PLAIN_ROPE = ("RoPE", "Llama3RoPE")


def uses_table(rope: nn.Module) -> bool:
    """Whether ``rope`` is rotated from a shared table here: a plain RoPE module on MLX's CPU backend (elsewhere
    ``mx.fast.rope`` is one kernel and stays)."""
    return type(rope).__name__ in _PLAIN_ROPE and mx.default_device() == mx.cpu


_FREQS: dict[int, tuple[mx.array, bytes]] = {}  # id -> (the array, kept alive so its id stays its own; its bytes)


def _freqs_key(rope: nn.Module) -> bytes | None:
    """The module's frequencies by value (every layer builds its own equal copy; equal ones share a table)."""
    f = getattr(rope, "_freqs", None)
    if f is None:
        return None
    if id(f) not in _FREQS:
        _FREQS[id(f)] = (f, np.array(f).tobytes())
    return _FREQS[id(f)][1]


def _table(rope: nn.Module, positions: mx.array, dtype) -> tuple[mx.array, mx.array]:
    """``(cos, sin)``, each [1, 1, rows, dims / 2] in ``dtype``, for rows at ``positions`` (int32 [rows])."""
    dims, half = rope.dims, rope.dims // 2
    if rope.traditional:  # pairs (x[2i], x[2i + 1]) = (1, 0)
        probe = mx.broadcast_to(mx.array([1, 0], dtype), (half, 2)).reshape(1, 1, 1, dims)
    else:
        probe = mx.concatenate([mx.ones((half,), dtype), mx.zeros((half,), dtype)]).reshape(1, 1, 1, dims)
    rows = positions.shape[0]
    out = rope(mx.broadcast_to(probe, (rows, 1, 1, dims)), offset=positions).reshape(1, 1, rows, dims)
    if rope.traditional:
        return out[..., 0::2], out[..., 1::2]
    return out[..., :half], out[..., half:]


def table_for(rope: nn.Module, positions: mx.array, tables: dict, dtype) -> tuple[mx.array, mx.array]:
    """The call's ``(cos, sin)`` for ``rope`` (built by the first layer that asks, kept in ``tables``)."""
    key = (_freqs_key(rope), rope.dims, rope.traditional, getattr(rope, "base", None), getattr(rope, "scale", None))
    key += (dtype,)
    if key not in tables:
        tables[key] = _table(rope, positions, dtype)
    return tables[key]


def table_rope(rope: nn.Module, x: mx.array, positions: mx.array, tables: dict) -> mx.array:
    """``rope(x)`` with row ``r`` of ``x`` [B, H, rows, D] at ``positions[r]``; the table is built on first use and
    kept in ``tables`` (one per call: every layer of the call shares it)."""
    cos, sin = table_for(rope, positions, tables, x.dtype)
    dims, half = rope.dims, rope.dims // 2
    fused = cpu_math.fused_op("rope_table")
    if fused is not None and x.dtype == mx.float32:  # one node, the same products and sums: the same bits
        return fused(x, cos, sin, dims, rope.traditional)
    if rope.traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
    else:
        x1, x2 = x[..., :half], x[..., half:dims]
    a, b = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    if rope.traditional:
        rot = mx.concatenate([a[..., None], b[..., None]], axis=-1).reshape(*x.shape[:-1], dims)
        parts = [rot]
    else:
        parts = [a, b]
    if dims < x.shape[-1]:
        parts.append(x[..., dims:])
    return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
