"""Many teacher sequences in one pass: the batched teacher pass and student pass of distillation.

A step's sequences are right-padded to a common length and run as one batch: the teacher pass (base weights,
no vocabulary projection) fills every layer's K/V, and the student pass runs every sequence's auxiliary windows
against its own row of that K/V. Right padding sits after every real token, and a window sees only the tokens
before its own start, so padding is never attended to. Every sequence carries the same number of windows (short
ones are padded with unscored windows), so the rows form a dense ``[batch, rows]`` block: one graph per
micro-batch instead of one per sequence, which is what lets a GPU take thousands of rows per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..model.layers import StaticKV, language_model
from ..model.ptp import PTPAdapter, PTPModel
from ..model.shape import CallShape, PassKind, Window


class BatchPlan:
    """The rows of one batched training pass (``PassKind.BATCHED``): sequence ``b``'s rows are the ``CallShape`` of
    its windows after the padded teacher length ``ctx`` (no token rows), so its positions and mask are that
    shape's (``CallShape.mask``: the real tokens before each window, its own window causally).

    ``windows[b]`` are sequence ``b``'s windows (all sequences the same count and widths). Auxiliary row ``j`` of a
    window at ``ctx_len`` sits at RoPE position ``ctx_len + j - 1``."""

    kind = PassKind.BATCHED

    def __init__(self, ctx: int, windows: list[list[Window]]):
        self.offset = ctx
        self.shapes = [CallShape((), tuple(w.relative(ctx) for w in ws)) for ws in windows]
        self.pos = np.array([ctx + s.rel_pos.astype(np.int64) for s in self.shapes], dtype=np.int64)
        self.batch, self.rows = self.pos.shape
        self._masks: dict[int | None, mx.array] = {}
        self.positions = mx.array(self.pos.reshape(-1).astype(np.int32))

    def mask(self, window_size: int | None) -> mx.array:
        """Boolean mask [batch, 1, rows, ctx + rows] (with ``window_size``: only keys that close)."""
        if window_size not in self._masks:
            full = np.stack([s.mask(self.offset, window_size) for s in self.shapes])
            self._masks[window_size] = mx.array(full)[:, None]
        return self._masks[window_size]


@dataclass
class Micro:
    """One micro-batch: token ids [B, ctx] (right-padded), windows per sequence, u / labels / weights [B, rows]."""

    tokens: np.ndarray
    windows: list[list[Window]]
    u: np.ndarray
    labels: np.ndarray
    weights: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.u.size)


def pack(items: list[tuple[list[int], list[Window], np.ndarray, np.ndarray, np.ndarray]], width: int) -> Micro:
    """Stack sequences (tokens, windows, u, labels, per-row weights) into one micro-batch; a sequence with fewer
    auxiliary rows than the longest gets one unscored filler window, so every sequence has as many rows."""
    n_rows = max(len(u) for _, _, u, _, _ in items)
    ctx = max(len(t) for t, _, _, _, _ in items)
    tokens = np.zeros((len(items), ctx), dtype=np.int32)
    wins, us, labels, weights = [], [], [], []
    for b, (toks, ws, u, lab, wt) in enumerate(items):
        tokens[b, : len(toks)] = toks
        pad = n_rows - len(u)
        wins.append(list(ws) + ([Window(1, pad)] if pad else []))
        us.append(np.concatenate([u, np.full(pad, 0.5, np.float32)]))
        labels.append(np.concatenate([lab, np.zeros(pad, np.int32)]))
        weights.append(np.concatenate([wt, np.zeros(pad, np.float32)]))
    return Micro(tokens, wins, np.stack(us), np.stack(labels), np.stack(weights))


def cut_windows(windows: list[Window], u, labels, valid, weights, width: int):
    """Each window cut after its last scored slot (past the sequence's end, or after a token no ``u`` produces,
    rows are padding); a window with no scored slot is dropped. Later rows of a window never affect earlier ones
    (causal), so the loss is unchanged and the step computes fewer rows."""
    keep_w, keep = [], []
    for i, w in enumerate(windows):
        k = int(valid[i * width : (i + 1) * width].sum())  # valid slots form a prefix of the window
        if k:
            keep_w.append(Window(w.ctx_len, k, w.via))
            keep.append(np.arange(i * width, i * width + k))
    idx = np.concatenate(keep) if keep else np.zeros(0, np.int64)
    return keep_w, u[idx], labels[idx], weights[idx]


def teacher_kv(pm: PTPModel, tokens: np.ndarray) -> list[StaticKV]:
    """The base model's K/V over a right-padded batch [B, ctx], as constants for the student pass. Runs the
    inner model only: training needs the K/V, not the vocabulary projection of every teacher token."""
    cache = pm.make_cache()
    language_model(pm.base).model(mx.array(tokens), cache=cache)
    kv = [StaticKV(pm.ctx, mx.stop_gradient(k), mx.stop_gradient(v)) for k, v in cache.contents()]
    mx.eval([(c.keys, c.values) for c in kv])  # sync: the teacher pass is a constant input to the student
    return kv


def student_logits(pm: PTPModel, adapter: PTPAdapter, kv: list[StaticKV], mb: Micro) -> mx.array:
    """Auxiliary logits [B, rows, vocab] of every window of the micro-batch, in one pass."""
    plan = BatchPlan(int(mb.tokens.shape[1]), mb.windows)
    aux = adapter.u_embed(mx.array(mb.u))

    def lora(key, x, layers=adapter.layers):  # auxiliary rows only: no gate needed
        mod = layers[key[0]].get(key[1])
        return None if mod is None else mod(x).astype(x.dtype)

    pm.ctx.begin(plan, aux, lora)
    try:
        return pm.base(mx.zeros((mb.tokens.shape[0], 0), dtype=mx.int32), cache=kv)
    finally:
        pm.ctx.end()


def weighted_ce_sum(adapter: PTPAdapter, pm: PTPModel, kv: list[StaticKV], mb: Micro) -> mx.array:
    """Sum over the micro-batch of each row's cross-entropy times its weight (0 for unscored rows)."""
    logits = student_logits(pm, adapter, kv, mb).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, mx.array(mb.labels), reduction="none")
    return (ce * mx.array(mb.weights)).sum()


def step_items(pm: PTPModel, records: list[dict], n_windows: int, width: int, rng, weights, order: str) -> list:
    """A step's sequences as (tokens, windows, u, labels, row weights), drawing windows as ``make_windows`` does
    (the same random stream as one pass per sequence)."""
    from .windows import ensure_order, make_windows

    items = []
    for rec in records:
        ensure_order(pm, rec, order)  # bins in the step's CDF order (recorded at generation, or rebuilt once)
        windows, u, labels, valid = make_windows(rec, n_windows, width, rng)
        if windows:
            w = (valid * (np.tile(weights, len(windows)) if weights is not None else 1.0)).astype(np.float32)
            windows, u, labels, w = cut_windows(windows, u, labels, valid, w, width)
            if windows:
                items.append((rec["tokens"], windows, u, labels, w))
    return items


def accumulate(grad_fn, adapter: PTPAdapter, pm: PTPModel, items: list, width: int, micro_seqs: int, total=None):
    """Loss and gradient of a whole step (weighted mean over its scored rows), summed micro-batch by micro-batch
    (sequences of similar length together: less padding). Returns (loss, grads, auxiliary rows).

    ``total``: the step's whole scored weight when ``items`` is one process's slice of it (data parallel: the
    slices' results then sum to the step's mean); default, the weight of ``items``."""
    from mlx.utils import tree_map

    items = sorted(items, key=lambda it: len(it[0]))
    total = float(sum(it[4].sum() for it in items)) if total is None else total
    loss, grads, rows = mx.array(0.0), None, 0
    if not items:  # an empty slice (data parallel) or no scored row in the step: a zero update
        return loss, tree_map(mx.zeros_like, adapter.trainable_parameters()), 0
    for i in range(0, len(items), micro_seqs):
        mb = pack(items[i : i + micro_seqs], width)
        kv = teacher_kv(pm, mb.tokens)
        part, g = grad_fn(adapter, kv, mb)
        grads = g if grads is None else tree_map(mx.add, grads, g)
        loss = loss + part
        rows += mb.rows
        mx.eval(grads, loss)  # sync: frees this micro-batch's graph before the next is built
    scale = 1.0 / max(total, 1e-9)
    return loss * scale, tree_map(lambda g: g * scale, grads), rows
