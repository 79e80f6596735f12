"""The CDF bin of each token, ``[F(t) - p(t), F(t))`` under the sampler's settings (``sampler.py``): what
distillation targets are made of (``ptp_mlx/train``), the bins the sampler's ``pick`` maps each uniform into."""

from __future__ import annotations

import mlx.core as mx

from .cdf import id_sorted_edges
from .sampler import CDF_ORDERS, SamplingSettings, filtered_probs, prob_sorted


def _bin_of(q: mx.array, edges: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
    """``[left, right)`` of each token's bin: its own edge and the previous token's (0 for the first)."""
    prev = mx.concatenate([mx.zeros_like(edges[..., :1]), edges[..., :-1]], axis=-1)
    right = mx.take_along_axis(edges, tokens[..., None], axis=-1)[..., 0]
    left = mx.take_along_axis(prev, tokens[..., None], axis=-1)[..., 0]
    return left, right


def _greedy_bins(tokens: mx.array) -> tuple[mx.array, mx.array]:
    # Greedy: every u picks the argmax, so its bin is [0, 1).
    z = mx.zeros(tokens.shape, dtype=mx.float32)
    return z, z + 1.0


def bins(
    logits: mx.array, tokens: mx.array, s: SamplingSettings, order: str | None = None
) -> tuple[mx.array, mx.array]:
    """The bin ``[F(t) - p(t), F(t))`` of each token in the CDF (for distillation targets).

    ``order="id"``: the CDF runs over the vocabulary in id order (what ``pick`` and the reference checkpoints
    use). ``order="prob"``: over the kept tokens in descending probability (ties by lower id), so small ``u``
    pick the likeliest tokens (docs/method.md, section 1). Default: ``s.order``."""
    order = order or s.order
    if s.greedy:
        return _greedy_bins(tokens)
    if order == "id":
        q = filtered_probs(logits, s)
        return _bin_of(q, id_sorted_edges(q), tokens)
    if order != "prob":
        raise ValueError(f"unknown CDF order {order!r} (known: {', '.join(CDF_ORDERS)})")
    sorted_ids, edges, qs = prob_sorted(logits, s)
    prev = mx.concatenate([mx.zeros_like(edges[..., :1]), edges[..., :-1]], axis=-1)
    hit = sorted_ids == tokens[..., None]
    found = mx.any(hit & (qs > 0), axis=-1)
    j = mx.argmax(hit, axis=-1)[..., None]
    right = mx.where(found, mx.take_along_axis(edges, j, axis=-1)[..., 0], 0.0)
    left = mx.where(found, mx.take_along_axis(prev, j, axis=-1)[..., 0], 0.0)
    return left, right  # a token outside the kept support gets the empty bin [0, 0)


def pick_with_bins(u: mx.array, logits: mx.array, s: SamplingSettings) -> tuple[mx.array, mx.array, mx.array]:
    """``pick`` and ``bins`` in one pass over the filtered distribution (teacher-data generation)."""
    if s.greedy:
        t = mx.argmax(logits, axis=-1).astype(mx.int32)
        return (t, *_greedy_bins(t))
    q = filtered_probs(logits, s)
    edges = id_sorted_edges(q)
    t = mx.sum(edges <= mx.expand_dims(u.astype(mx.float32).astype(edges.dtype), -1), axis=-1).astype(mx.int32)
    return (t, *_bin_of(q, edges, t))
