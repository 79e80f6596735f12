"""Cumulative distributions for the exact sampler (``sampler.py``): bin edges summed far more accurately than a
running float32 sum, in the same order for every row of a pass (docs/method.md, section 1)."""

from __future__ import annotations

import mlx.core as mx


def work_dtype():
    """float64 where the device has it (the CPU), else float32."""
    return mx.float64 if mx.default_device() == mx.cpu else mx.float32


BLOCK = 256  # block length of the two-level float32 cumulative sum (devices without float64)


def accurate_cumsum(q: mx.array) -> mx.array:
    """Cumulative sum along the last axis, far more accurate than a running float32 sum.

    A float32 running sum over a 49,152-token vocabulary drifts about 3e-5 from the exact CDF, which shifts the
    bin edges near its top by that much. On the CPU the sum runs in float64; elsewhere (Metal has no float64) in
    two float32 levels: within blocks of ``BLOCK`` tokens, plus the running sum of block totals. Either way each
    row is summed in the same order whatever the number of rows, so a 1-row and a many-row pass differ only by
    their logits.
    """
    if work_dtype() == mx.float64:
        return mx.cumsum(q.astype(mx.float64), axis=-1)
    return blocked_cumsum(q.astype(mx.float32))


def blocked_cumsum(q: mx.array) -> mx.array:
    """Two-level float32 cumulative sum (``accurate_cumsum`` on devices without float64)."""
    V = q.shape[-1]
    pad = (-V) % BLOCK
    x = mx.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, pad)]) if pad else q
    x = x.reshape(*q.shape[:-1], -1, BLOCK)
    within = mx.cumsum(x, axis=-1)
    before = mx.cumsum(within[..., -1], axis=-1) - within[..., -1]  # total of all earlier blocks
    return (within + before[..., None]).reshape(*q.shape[:-1], -1)[..., :V]


def id_sorted_edges(q: mx.array) -> mx.array:
    """Step 6: CDF in vocabulary-id order with the last kept edge forced to 1 (float64 on the CPU)."""
    cdf = accurate_cumsum(q)
    V = q.shape[-1]
    ids = mx.arange(V)
    last_kept = mx.max(mx.where(q > 0, ids, -1), axis=-1, keepdims=True)
    return mx.where(ids >= last_kept, 1.0, cdf)


def sorted_edges(qs: mx.array) -> mx.array:
    """CDF of probabilities already in descending order, the last kept edge forced to 1."""
    n_kept = mx.sum(qs > 0, axis=-1, keepdims=True)
    return mx.where(mx.arange(qs.shape[-1]) >= n_kept - 1, 1.0, accurate_cumsum(qs))
