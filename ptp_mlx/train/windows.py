"""Training windows: the teacher pass, each record's bins (re-binned in another CDF order when asked), ``u``
drawn inside the bins, the auxiliary windows and the weighted loss (docs/method.md, section 6)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..bins import bins
from ..errors import UserError
from ..model.layers import StaticKV
from ..model.ptp import PTPAdapter, PTPModel
from ..model.shape import Window
from ..sampler import SamplingSettings

# Sampled u lie in [0, 1); 1.0 is never drawn, so it is free to mean "draft the argmax" (greedy decoding,
# where verification ignores u). One adapter then serves greedy and sampled decoding.
GREEDY_U = 1.0


def teacher_kv(pm: PTPModel, tokens: list[int], rec: dict | None = None, order: str = "id") -> list[StaticKV]:
    """The base model's K/V over ``tokens``, as constants the student's windows attend to.

    With ``order="prob"`` the same pass also gives the record's bins in probability order (``rebin``)."""
    if rec is not None and f"left_{order}" in rec:
        ensure_order(pm, rec, order)  # recorded at generation: no re-binning below
    cache = pm.make_cache()
    logits = pm.base(mx.array(tokens)[None], cache=cache)
    if rec is not None and order != "id":
        rebin(rec, logits[0], order)
    kv = [StaticKV(pm.ctx, mx.stop_gradient(k), mx.stop_gradient(v)) for k, v in cache.contents()]
    mx.eval([(c.keys, c.values) for c in kv])  # sync: the teacher pass is a constant input to the student
    return kv


def ensure_order(pm: PTPModel, rec: dict, order: str) -> None:
    """Put ``rec``'s bins in ``order``: the bins ``pregenerate`` recorded in that order when it has them (no model
    pass), else rebuilt once from a teacher pass (``rebin``)."""
    if rec.get("greedy") or rec.get("order", "id") == order:
        return
    if f"left_{order}" in rec:
        rec["left"], rec["right"], rec["order"] = rec[f"left_{order}"], rec[f"right_{order}"], order
        return
    teacher_kv(pm, rec["tokens"], rec, order)


def rebin(rec: dict, logits: mx.array, order: str) -> None:
    """Replace a sampled record's bins (id order, as written) by its bins in ``order``, computed from the teacher
    logits over its tokens under the record's own settings; done once per record (``rec["order"]`` marks it).
    The tokens stay the same sample: only the coupling of ``u`` to tokens changes."""
    if rec.get("greedy") or rec.get("order", "id") == order:
        return
    s = SamplingSettings.from_dict(rec.get("settings") or {})
    start = rec["start"]
    lo, hi = bins(logits[start - 1 : len(rec["tokens"]) - 1], mx.array(rec["tokens"][start:]), s, order)
    mx.eval(lo, hi)  # sync: the bins are host data for make_windows
    rec["left"] = np.array(lo, dtype=np.float64).tolist()
    rec["right"] = np.array(hi, dtype=np.float64).tolist()
    rec["order"] = order


def slot_weights(spec: str | None, width: int) -> np.ndarray:
    """Loss weight of each window slot: ``None`` (all 1), ``decay:G`` (``G**j`` at slot ``j``) or a comma list
    (the last value repeats). Acceptance stops at the first wrong draft, so early slots count most."""
    if not spec:
        return np.ones(width, np.float32)
    try:
        if spec.startswith("decay:"):
            w = float(spec[6:]) ** np.arange(width)
        else:
            vals = [float(x) for x in spec.split(",")]
            w = np.array([vals[min(j, len(vals) - 1)] for j in range(width)])
    except ValueError:
        raise UserError(f"--slot-weights: expected 'decay:G' or numbers separated by commas, got {spec!r}") from None
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise UserError(f"--slot-weights: weights must be finite, non-negative and not all zero ({spec!r})")
    return w.astype(np.float32)


def draw_u(lo: float, hi: float, b: float) -> float | None:
    """A float32 ``u`` inside the bin ``[lo, hi)`` at fraction ``b`` (None if no float32 lies inside it).

    The sampler compares float32 ``u`` with its CDF edges exactly, so a ``u`` inside the bin picks that token."""
    u = np.float32(lo + (hi - lo) * b)
    if u < lo:
        u = np.nextafter(u, np.float32(1))
    if u >= hi:
        u = np.nextafter(np.float32(hi), np.float32(0))
    return float(u) if lo <= u < hi else None


def make_windows(rec: dict, n_windows: int, width: int, rng: np.random.Generator, uniform: bool = False):
    """Window starts in the completion, their auxiliary ``u`` (inside each token's bin) and labels.

    A token with an empty bin (outside the truncated support of teacher-forced text, or a bin too narrow for
    float32) cannot be produced by any ``u``: its window ends there (that slot and the later ones are not
    scored)."""
    start, n_tok = rec["start"], len(rec["tokens"])
    cands = np.arange(start, n_tok)
    if cands.size == 0:
        return [], np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros(0, bool)
    picks = np.sort(rng.choice(cands, size=min(n_windows, cands.size), replace=False))
    windows, us, labels, valid = [], [], [], []
    left, right = np.asarray(rec["left"], np.float64), np.asarray(rec["right"], np.float64)
    greedy = bool(rec.get("greedy", False))
    for p in picks:
        windows.append(Window(int(p), width))
        broken = False
        for j in range(width):
            q = p + j
            u = None
            if q < n_tok:
                b = rng.random() if uniform else rng.beta(0.3, 0.3)
            if q < n_tok and not broken:
                # greedy targets: the reserved u = 1.0 (never drawn) asks for the argmax
                u = GREEDY_U if greedy else draw_u(left[q - start], right[q - start], b)
                broken = u is None
            if u is not None:
                us.append(u)
                labels.append(rec["tokens"][q])
                valid.append(True)
            else:  # past the end of the sequence or of a producible run: padded, not scored
                us.append(0.5)
                labels.append(0)
                valid.append(False)
    return windows, np.asarray(us, np.float32), np.asarray(labels, np.int32), np.asarray(valid)


def student_logits(pm: PTPModel, adapter: PTPAdapter, kv, windows, u):
    return pm(mx.zeros((0,), dtype=mx.int32), mx.array(u), windows, cache=kv, adapter=adapter)


def loss_fn(adapter, pm, batch, weights: np.ndarray | None = None):
    """Mean cross-entropy over the scored slots, each slot weighted by ``weights`` (default 1)."""
    total, count = mx.array(0.0), 0.0
    for kv, windows, u, labels, valid in batch:
        logits = student_logits(pm, adapter, kv, windows, u).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, mx.array(labels), reduction="none")
        w = valid * (np.tile(weights, len(windows)) if weights is not None else 1.0)
        total = total + (ce * mx.array(w.astype(np.float32))).sum()
        count += float(w.sum())
    return total / max(count, 1e-9)
