"""Telling a float near-tie from a bug where PTP and plain decoding part (docs/method.md, section 11).

In exact arithmetic PTP returns the autoregressive tokens. In float32 a pass of several rows and a pass of one
row round differently (BLAS picks kernels by row count; Metal too), and the difference is carried on in the KV
cache, so the two decoders' logits differ by about 1e-5 and their bin edges by up to about 1e-6 (measured on the
default model; docs/results/lossless.md). Where the sampler's choice sits that close to a boundary, the two may
choose differently. ``classify`` decides, from the autoregressive decoder's own logits at the first divergent
position (``replay_ar_logits`` recomputes them exactly as autoregressive decoding did), whether the other
token was that close:

- greedy: the two tokens' logits are within ``LOGIT_TOL``;
- sampled: ``u`` lies within ``EDGE_TOL`` of the other token's bin (in probability order: or the two tokens'
  probabilities are within ``EDGE_TOL``, so their places in the CDF may swap), or a token at the top-p cut-off has a
  probability mass before it within ``MASS_TOL`` of ``top_p`` and keeping (or dropping) it picks the other token.

Anything else is a logic error: the bench's lossless check fails on it and the tests report it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .cdf import id_sorted_edges
from .sampler import SamplingSettings, filtered_probs, prob_sorted, tempered_probs

LOGIT_TOL = 1e-3  # about 50x the logit difference measured between the two decoders
EDGE_TOL = 1e-5  # about 10x the largest bin-edge difference measured between them
MASS_TOL = 1e-5


@dataclass
class Tie:
    near_tie: bool
    kind: str  # "logit gap", "bin edge", "top-p cut-off" or "none"
    distance: float  # logit gap, distance of u from the other token's bin, or of the cut-off mass from top_p

    def describe(self) -> str:
        verdict = "float near-tie" if self.near_tie else "NOT a near-tie"
        return f"{verdict} ({self.kind} {self.distance:.3g})"


def _pick(p: np.ndarray, keep: np.ndarray, u: float, order: str = "id") -> int:
    q = np.where(keep, p, 0.0)
    ids = np.argsort(-q, kind="stable") if order == "prob" else np.arange(q.size)
    edges = np.cumsum(q[ids] / q.sum())
    last = int(np.flatnonzero(keep[ids])[-1])
    edges[last:] = 1.0
    return int(ids[min(int(np.sum(edges <= u)), q.size - 1)])


def replay_ar_logits(pm, prompt_ids, prefix) -> mx.array:
    """The logits autoregressive decoding computed for the token after ``prompt_ids + prefix``: the same prefill
    and the same one-row steps (a single pass over the whole prefix rounds differently, by more than a near-tie)."""
    from .decode.ar import prefill

    cache = pm.make_cache()
    prefill(pm.base, list(prompt_ids[:-1]), cache)
    logits = None
    for t in [prompt_ids[-1], *prefix]:
        logits = pm.base(mx.array([[int(t)]]), cache=cache)[0, -1]
    return logits


def classify(logits: mx.array, ref_token: int, other_token: int, u: float, s: SamplingSettings) -> Tie:
    """Is ``other_token`` within float rounding of what ``logits`` (one pass) give at uniform ``u``?"""
    logits = logits.astype(mx.float32).reshape(-1)
    if s.greedy:
        x = np.array(logits, dtype=np.float64)
        gap = float(x[ref_token] - x[other_token])
        return Tie(abs(gap) <= LOGIT_TOL, "logit gap", abs(gap))
    # The sampler's own distribution and edges (what decoding compared u with), not an idealised CDF: its
    # float rounding is shared by both decoders and is no part of their difference.
    q_mx = filtered_probs(logits, s)
    q = np.array(q_mx, dtype=np.float64)
    keep = q > 0
    if s.order == "prob":
        # Probability order: two tokens whose probabilities are within rounding may swap places, and
        # with them their bins.
        diff = float(abs(q[ref_token] - q[other_token]))
        if keep[other_token] and diff <= EDGE_TOL:
            return Tie(True, "probability order", diff)
        ids, edges_mx, _ = prob_sorted(logits, s)
        edges = np.array(edges_mx, dtype=np.float64)
        j = int(np.flatnonzero(np.array(ids) == other_token)[0])  # the other token's place in the order
        lo, hi = (edges[j - 1] if j > 0 else 0.0), edges[j]
    else:
        edges = np.array(id_sorted_edges(q_mx), dtype=np.float64)
        lo = edges[other_token - 1] if other_token > 0 else 0.0
        hi = edges[other_token]
    dist = 0.0 if lo <= u < hi else float(min(abs(u - lo), abs(u - hi)))
    if keep[other_token] and dist <= EDGE_TOL:
        return Tie(True, "bin edge", dist)
    if s.top_p < 1.0:
        p = np.array(tempered_probs(logits, s), dtype=np.float64)
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        near = np.flatnonzero(np.abs(before - s.top_p) <= MASS_TOL)
        for j in near[:4]:
            flipped = keep.copy()
            flipped[order[j]] = not flipped[order[j]]
            if flipped.any() and _pick(p, flipped, u, s.order) == other_token:
                return Tie(True, "top-p cut-off", float(abs(before[j] - s.top_p)))
    return Tie(False, "bin edge", dist)


def judge_divergence(
    pm, prompt_ids, prefix, refs: list[int], others: list[int], u: float, s: SamplingSettings
) -> tuple[mx.array, Tie]:
    """The one divergence explainer (tests, ``ptp-bench`` and ``ptp_mlx.testing.explain_divergence`` use it): the
    reference decoder's own logits after ``prefix`` (replayed, float32) and the closest call between each token of
    ``refs`` (what the reference emitted there) and each of ``others`` (what the other decoder did), judged under
    the uniform ``u`` and settings ``s`` in the CDF order of ``pm``'s adapter: a float near-tie if any is one."""
    from .generate import decoding_settings

    logits = replay_ar_logits(pm, list(prompt_ids), list(prefix)).astype(mx.float32)
    s = decoding_settings(pm, s)  # the CDF order decoding used
    ties = [classify(logits, r, o, u, s) for r in refs for o in others]
    return logits, min(ties, key=lambda t: (not t.near_tie, t.distance))
