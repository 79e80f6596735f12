"""The exact sampler: a token as a pure function of a uniform ``u`` (docs/method.md, section 1).

``pick(u, logits)`` returns the first kept token whose cumulative probability exceeds ``u``, in one of two CDF
orders: vocabulary-id order (the reference code's, and its checkpoints') or descending probability. PTP's
losslessness rests on drafting and verification using this same function with the same ``u``; an adapter is
trained against one order and records it (``cdf_order`` in its config), and decoding with it uses that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .cdf import accurate_cumsum, id_sorted_edges, sorted_edges, work_dtype
from .fused_exp import exp as fused_exp
from .pick_ops import greedy_pick, tempered_stats, top_ids
from .uniforms import UniformStream  # noqa: F401  (its home before uniforms.py; callers import it from here)

CDF_ORDERS = ("id", "prob")


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling settings; ``temperature == 0`` (or ``top_k == 1``) means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # CDF order: "id" (vocabulary order) or "prob" (descending probability), set from the adapter. Keyword-only, so
    # subclasses (the chat's GenSettings) keep their positional fields.
    order: str = field(default="id", kw_only=True)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1

    def validate(self) -> SamplingSettings:
        if self.temperature < 0 or not np.isfinite(self.temperature):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.order not in CDF_ORDERS:
            raise ValueError(f"unknown CDF order {self.order!r} (known: {', '.join(CDF_ORDERS)})")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be a non-negative integer below 2**63, got {self.seed}")
        return self

    @classmethod
    def from_dict(cls, d: dict) -> SamplingSettings:
        """Settings as teacher records store them (``as_dict``); missing fields take the distillation defaults."""
        return cls(float(d.get("temperature", 0.7)), int(d.get("top_k", 50)), float(d.get("top_p", 0.95)))

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


# Below this, a token's tempered logit is that far under the row's maximum that it gets probability 0 (e^-700 is
# far above float64's smallest number, so every token above it has a positive probability: "p > 0" is this test).
_CUTOFF = -700.0


def _tempered(logits: mx.array, s: SamplingSettings) -> tuple[mx.array, mx.array, mx.array]:
    """The logits at temperature T in the work dtype, their row maximum and the softmax normaliser ``Z``.

    ``Z`` sums ``e^(x - max)`` over the vocabulary in float64, each term by the fused float32 exp
    (``fused_exp.py``): about 1e-7 relative, against a float32 sum's 1e-4, for a fifth of the float64 exp's cost
    (MLX's CPU backend computes that one element at a time). Only the tokens a pick needs then get the float64
    exp of their own (``_probs_at``)."""
    x = _scaled(logits, s)
    stats = tempered_stats(logits, s.temperature, _CUTOFF)
    if stats is not None:
        return x, stats[0], stats[1]
    m = mx.max(x, axis=-1, keepdims=True)
    z = mx.sum(fused_exp((x - m).astype(mx.float32)).astype(x.dtype), axis=-1, keepdims=True)
    return x, m, z


def _scaled(logits: mx.array, s: SamplingSettings) -> mx.array:
    """The logits at temperature T in the work dtype (elementwise: the same values for any subset of a row)."""
    x = logits.astype(mx.float32).astype(work_dtype())
    return x / s.temperature if s.temperature not in (0, 1) else x


def _probs_at(x: mx.array, m: mx.array, z: mx.array) -> mx.array:
    """The probabilities of the tokens whose tempered logits are ``x`` (any subset of a row's): ``e^(x - m) / Z``,
    0 below the cutoff. The same function of a token's logit whichever tokens it is computed with."""
    d = x - m
    return mx.where(d > _CUTOFF, mx.exp(d) / z, mx.array(0.0, x.dtype))


def tempered_probs(logits: mx.array, s: SamplingSettings) -> mx.array:
    """Step 1: softmax at temperature T, in float64 on the CPU.

    In float32 the softmax of a 49,152-token vocabulary misplaces the cumulative distribution by up to about
    1e-4 (its normaliser's rounding, measured on the default model); here each probability is a float64 exp over
    a normaliser within about 1e-7 (``_tempered``). The rows need not sum to 1 exactly: the last kept CDF edge is
    1 by definition. The logits themselves are float32 (the model's), converted exactly. On a device without
    float64, MLX's softmax in float32."""
    if work_dtype() != mx.float64:
        x = logits.astype(mx.float32)
        return mx.softmax(x / s.temperature if s.temperature not in (0, 1) else x, axis=-1, precise=True)
    x, m, z = _tempered(logits, s)
    return _probs_at(x, m, z)


def _head_probs(logits: mx.array, s: SamplingSettings):
    """``probs_at(ids)``: ``tempered_probs`` at the token ids ``ids`` (bit for bit), with the float64 exp taken for
    those tokens only; and the number of tokens with a positive probability per row."""
    if work_dtype() != mx.float64:
        p = tempered_probs(logits, s)
        return (lambda ids: mx.take_along_axis(p, ids, axis=-1)), mx.sum(p > 0, axis=-1, keepdims=True)
    stats = tempered_stats(logits, s.temperature, _CUTOFF)
    if stats is not None:  # (the tempered logits of the wanted ids only: the whole row is never converted)
        m, z, positive = stats
        return (lambda ids: _probs_at(_scaled(mx.take_along_axis(logits, ids, axis=-1), s), m, z)), positive
    x, m, z = _tempered(logits, s)
    positive = mx.sum(x - m > _CUTOFF, axis=-1, keepdims=True)
    return (lambda ids: _probs_at(mx.take_along_axis(x, ids, axis=-1), m, z)), positive


def _top_k(p: mx.array, s: SamplingSettings) -> tuple[mx.array, mx.array]:
    """Steps 2-4 for top-k: the k candidates in vocabulary-id order and their filtered, renormalised probabilities.

    One partition over the vocabulary, then everything (top-p, renormalising) works on k values only."""
    k = s.top_k
    part = mx.argpartition(-p, kth=k - 1, axis=-1)[..., :k]
    ids = mx.sort(part, axis=-1)
    pk = mx.take_along_axis(p, ids, axis=-1)
    if s.top_p < 1.0:
        order = mx.argsort(-pk, axis=-1)  # descending probability
        ps = mx.take_along_axis(pk, order, axis=-1)
        keep_sorted = (mx.cumsum(ps, axis=-1) - ps) <= s.top_p  # masses of the full vocabulary (not renormalised)
        keep = mx.put_along_axis(mx.zeros(pk.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
        pk = mx.where(keep, pk, 0.0)
    return ids, pk / pk.sum(axis=-1, keepdims=True)


def filtered_probs(logits: mx.array, s: SamplingSettings) -> mx.array:
    """Steps 1-4: softmax at temperature T, top-k, top-p, renormalised; float64 on the CPU, else float32."""
    p = tempered_probs(logits, s)
    if 0 < s.top_k < p.shape[-1]:
        ids, qk = _top_k(p, s)
        return mx.put_along_axis(mx.zeros_like(p), ids, qk, axis=-1)
    if s.top_p < 1.0:
        order = mx.argsort(-p, axis=-1)  # descending probability
        p_sorted = mx.take_along_axis(p, order, axis=-1)
        keep_sorted = (mx.cumsum(p_sorted, axis=-1) - p_sorted) <= s.top_p
        # Scatter the kept flags back to vocabulary-id order.
        keep = mx.put_along_axis(mx.zeros(p.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
        p = mx.where(keep, p, 0.0)
    return p / p.sum(axis=-1, keepdims=True)


def prob_sorted(logits: mx.array, s: SamplingSettings) -> tuple[mx.array, mx.array, mx.array]:
    """Steps 2-6 in probability order: the token ids by descending probability (a stable sort: equal
    probabilities keep id order), their CDF edges (last kept edge 1) and their filtered probabilities.

    One sort: of the k candidates under top-k, else of the vocabulary, which top-p needs anyway."""
    if 0 < s.top_k < logits.shape[-1]:
        ids, q = _top_k(tempered_probs(logits, s), s)
        rank = mx.argsort(-q, axis=-1)
        qs = mx.take_along_axis(q, rank, axis=-1)
        return mx.take_along_axis(ids, rank, axis=-1), sorted_edges(qs), qs
    p = tempered_probs(logits, s)
    rank = mx.argsort(-p, axis=-1)
    ps = mx.take_along_axis(p, rank, axis=-1)
    if s.top_p < 1.0:
        ps = mx.where((mx.cumsum(ps, axis=-1) - ps) <= s.top_p, ps, 0.0)  # masses of the full vocabulary
        qs = ps / ps.sum(axis=-1, keepdims=True)
    else:  # the whole vocabulary, normalised by Z already (as the fast pick, which sees only its head, uses it)
        qs = ps
    return rank, sorted_edges(qs), qs


def _pick_prob(u, logits: mx.array, s: SamplingSettings) -> tuple[mx.array, mx.array]:
    sorted_ids, edges, qs = prob_sorted(logits, s)
    u = mx.array(u, dtype=mx.float32).astype(edges.dtype)
    j = mx.minimum(mx.sum(edges <= mx.expand_dims(u, -1), axis=-1), qs.shape[-1] - 1)
    out = mx.take_along_axis(sorted_ids, j[..., None], axis=-1)[..., 0].astype(mx.int32)
    return out, mx.all(~mx.isnan(qs), axis=-1)


# ---- the fast pick: the likeliest tokens sorted, the rest only when a row needs them ----
#
# Sorting a 49,152-token vocabulary costs about 7.5 ms a row on MLX's CPU backend (a plain step of the default
# model: 50-60 ms), and every sampled token row paid it. A pick needs the sorted order only up to where its row's
# CDF reaches ``u`` (and, under top-p, up to the nucleus' end), almost always among the likeliest few hundred
# tokens. ``pick(fast=True)`` sorts the ``CANDIDATES`` likeliest only and gives ``UNRESOLVED`` for a row whose
# answer lies beyond the part of them it can prove to be the full sort's; the host resolves that row with the
# full sort (``resolve``, from the same logits). Together they are one deterministic function of a row's logits
# and ``u``, so plain decoding and PTP, which both use it, still agree token for token; where the fast part
# answers, it answers what the full sort does (up to the float64 rounding of a normaliser: a near-tie).

CANDIDATES = 1024  # the likeliest tokens a fast pick sorts
UNRESOLVED = -2  # a fast pick's answer for a row that needs the full sort (``resolve``)


def _candidates(logits: mx.array, probs_at, c: int):
    """The ``c`` likeliest tokens in id order (``ids``, ``pc = probs_at(ids)``), the order that sorts them as the
    full sort does (``rank``: descending probability, ties by id), their sorted probabilities ``ps``, and how many
    lead surely as in the full sort (``exact``: those strictly likelier than the least likely candidate; a token
    left out may tie with that one)."""
    ids = top_ids(logits, c)  # id order first: the stable sort below then breaks ties by id
    pc = probs_at(ids)
    rank = mx.argsort(-pc, axis=-1)
    ps = mx.take_along_axis(pc, rank, axis=-1)
    return ids, pc, rank, ps, mx.sum(ps > ps[..., -1:], axis=-1, keepdims=True)


def _head(logits: mx.array, probs_at, c: int) -> tuple[mx.array, mx.array, mx.array]:
    """``_candidates`` in the full sort's order: their ids, their probabilities and ``exact``."""
    ids, _, rank, ps, exact = _candidates(logits, probs_at, c)
    return mx.take_along_axis(ids, rank, axis=-1), ps, exact


def _nucleus(ps: mx.array, exact: mx.array, top_p: float) -> tuple[mx.array, mx.array]:
    """Top-p over the sorted head: the kept flags, and whether they are the full sort's (the first token the
    nucleus leaves out lies at most one past the exact part, so every later one is out too)."""
    keep = (mx.cumsum(ps, axis=-1) - ps) <= top_p  # masses of the full vocabulary, as in ``filtered_probs``
    return keep, mx.sum(keep, axis=-1, keepdims=True) <= exact


def _fast_prob(u, logits: mx.array, s: SamplingSettings) -> tuple[mx.array, mx.array]:
    """``_pick_prob`` from the sorted head (``UNRESOLVED`` where the head cannot tell)."""
    probs_at, positive = _head_probs(logits, s)
    c = CANDIDATES  # (fewer than the vocabulary: ``may_leave_unresolved``)
    ids, ps, exact = _head(logits, probs_at, c)
    known = None  # without top-p every token is kept: the nucleus is the whole row, known
    if s.top_p < 1.0:
        keep, known = _nucleus(ps, exact, s.top_p)
        ps = mx.where(keep, ps, 0.0)
        qs = ps / ps.sum(axis=-1, keepdims=True)
        n_kept = mx.sum(keep, axis=-1, keepdims=True)
    else:  # normalised by the whole row's Z already (``prob_sorted``)
        qs, n_kept = ps, positive
    edges = mx.where(mx.arange(c) >= n_kept - 1, 1.0, accurate_cumsum(qs))
    u = mx.expand_dims(mx.array(u, dtype=mx.float32).astype(edges.dtype), -1)
    j = mx.minimum(mx.sum(edges <= u, axis=-1, keepdims=True), c - 1)
    # Known: the nucleus is the full sort's, and u's bin lies within the head's exact part.
    inside = u < mx.take_along_axis(edges, mx.maximum(exact - 1, 0), axis=-1)
    settled = inside if known is None else known & inside
    out = mx.where(settled, mx.take_along_axis(ids, j, axis=-1), UNRESOLVED)[..., 0].astype(mx.int32)
    return out, mx.all(~mx.isnan(qs), axis=-1)


def _fast_id(u, logits: mx.array, s: SamplingSettings) -> tuple[mx.array, mx.array]:
    """``pick`` in vocabulary-id order under top-p: the nucleus from the sorted head (``UNRESOLVED`` where it
    reaches past the head's exact part), then the same id-order CDF as ``filtered_probs``."""
    probs_at, _ = _head_probs(logits, s)
    if work_dtype() == mx.float64:
        return _fast_id_head(u, logits, probs_at, s)
    ids, ps, exact = _head(logits, probs_at, CANDIDATES)
    keep, known = _nucleus(ps, exact, s.top_p)
    # the kept probabilities scattered into id order: the very array ``filtered_probs`` renormalises
    q = mx.put_along_axis(mx.zeros(logits.shape, dtype=ps.dtype), ids, mx.where(keep, ps, 0.0), axis=-1)
    q = q / q.sum(axis=-1, keepdims=True)
    edges = id_sorted_edges(q)
    u = mx.array(u, dtype=mx.float32).astype(edges.dtype)
    out = mx.sum(edges <= mx.expand_dims(u, -1), axis=-1).astype(mx.int32)
    return mx.where(known[..., 0], out, UNRESOLVED), mx.all(~mx.isnan(q), axis=-1)


def _fast_id_head(u, logits: mx.array, probs_at, s: SamplingSettings) -> tuple[mx.array, mx.array]:
    """``_fast_id`` on the candidates alone, in id order, where sums run in float64 (the CPU): the whole row's
    renormalising sum and id-order cumulative sum add the kept probabilities one after the other with zeros between
    (MLX sums a float64 row in order, and adding 0 changes no bit), so over the candidates in id order they give the
    same values at every kept token; the first edge above ``u`` is a kept token's, the same token. Every answer is
    the whole-row form's (``tests/test_sampler_fast_pick.py``), at a third of its cost."""
    ids, pc, rank, ps, exact = _candidates(logits, probs_at, CANDIDATES)  # (ids in increasing id order)
    keep_sorted, known = _nucleus(ps, exact, s.top_p)
    keep = mx.put_along_axis(mx.zeros(pc.shape, dtype=mx.bool_), rank, keep_sorted, axis=-1)
    q = mx.where(keep, pc, 0.0)
    q = q / q.sum(axis=-1, keepdims=True)
    edges = id_sorted_edges(q)  # (float64: a plain cumulative sum in id order, the last kept edge 1)
    u = mx.expand_dims(mx.array(u, dtype=mx.float32).astype(edges.dtype), -1)
    j = mx.minimum(mx.sum(edges <= u, axis=-1, keepdims=True), q.shape[-1] - 1)
    out = mx.take_along_axis(ids, j, axis=-1)[..., 0]
    return mx.where(known[..., 0], out, UNRESOLVED), mx.all(~mx.isnan(q), axis=-1)


def may_leave_unresolved(s: SamplingSettings, vocab: int) -> bool:
    """Whether ``pick(fast=True)`` under ``s`` can give ``UNRESOLVED`` (it sorts: sampled, no top-k, in
    probability order or under top-p, over more than ``CANDIDATES`` tokens)."""
    sorts = not 0 < s.top_k < vocab and (s.order == "prob" or s.top_p < 1.0)
    return not s.greedy and sorts and vocab > CANDIDATES


def resolve(u: float, logits: mx.array, s: SamplingSettings) -> int:
    """The exact token of one row that a fast pick left ``UNRESOLVED``, by the full sort (``logits``: [vocab])."""
    t = pick_with(mx.array(u, dtype=mx.float32), logits, s, check=False)
    return int(t.item())  # sync: the host needs this token


def pick(
    u: mx.array | float,
    logits: mx.array,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    check: bool = True,
    order: str = "id",
    fast: bool = False,
) -> mx.array:
    """Exact sampler, batched over leading axes of ``logits`` (``u`` has the leading shape).

    ``order`` is the CDF order (``SamplingSettings.order``): ``u`` picks the first kept token in vocabulary-id
    order, or in descending probability, whose cumulative probability exceeds it.

    Returns int32 token ids. Rows whose filtered distribution is empty or not finite (e.g. all logits
    ``-inf``) give ``-1``; with ``check=True`` such rows raise ``ValueError`` (this synchronises).

    ``fast``: without top-k, sort only the likeliest ``CANDIDATES`` tokens; a row whose answer lies beyond them
    gives ``UNRESOLVED`` (-2), which ``resolve`` turns into its exact token from the same logits.
    """
    s = SamplingSettings(temperature, top_k, top_p, order=order)
    fused = greedy_pick(logits)  # (one node on the CPU: the argmax, and -1 where the row is not finite)
    if fused is not None and s.greedy:
        return _checked(fused) if check else fused
    if fused is not None:  # the same finiteness test, one pass over the row
        finite = fused >= 0
    else:
        finite = mx.isfinite(mx.max(logits, axis=-1)) & mx.all(~mx.isnan(logits), axis=-1)
    if s.greedy:
        out = mx.argmax(logits, axis=-1).astype(mx.int32)
    elif fast and may_leave_unresolved(s, logits.shape[-1]):
        out, ok = (_fast_prob if order == "prob" else _fast_id)(u, logits, s)
        finite = finite & ok
    elif order == "prob":
        out, ok = _pick_prob(u, logits, s)
        finite = finite & ok
    elif 0 < s.top_k < logits.shape[-1]:
        out, ok = _pick_top_k(u, logits, s)
        finite = finite & ok
    else:
        q = filtered_probs(logits, s)
        edges = id_sorted_edges(q)
        u = mx.array(u, dtype=mx.float32).astype(edges.dtype)  # exact: every float32 is a float64
        out = mx.sum(edges <= mx.expand_dims(u, -1), axis=-1).astype(mx.int32)
        finite = finite & mx.all(~mx.isnan(q), axis=-1)
    out = mx.where(finite, out, -1)
    return _checked(out) if check else out


def _checked(out: mx.array) -> mx.array:
    # Sync: validation needs the values on the host.
    if bool(mx.any(out < 0).item()):
        raise ValueError("cannot sample: a row of logits is entirely masked (-inf) or not finite")
    return out


def pick_with(u: mx.array | float, logits: mx.array, s: SamplingSettings, **kw) -> mx.array:
    """``pick`` under the settings ``s`` (temperature, top-k, top-p and CDF order; ``kw``: ``check``, ``fast``)."""
    return pick(u, logits, s.temperature, s.top_k, s.top_p, order=s.order, **kw)


def _pick_top_k(u, logits: mx.array, s: SamplingSettings) -> tuple[mx.array, mx.array]:
    """``pick`` with top-k on the k candidates only (``_top_k``): the CDF over k values has the same edges as the
    full-vocabulary one of ``filtered_probs``, whose other tokens add exact zeros."""
    ids, q = _top_k(tempered_probs(logits, s), s)
    edges = id_sorted_edges(q)
    u = mx.array(u, dtype=mx.float32).astype(edges.dtype)
    j = mx.minimum(mx.sum(edges <= mx.expand_dims(u, -1), axis=-1), s.top_k - 1)
    out = mx.take_along_axis(ids, j[..., None], axis=-1)[..., 0].astype(mx.int32)
    return out, mx.all(~mx.isnan(q), axis=-1)
