"""Validation: leading-correct drafts per window on held-out teacher records, and ``ptp-train eval``."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import UserError
from ..model.layers import batched_rope
from ..model.ptp import PTPAdapter, PTPModel
from ..sampler import SamplingSettings, pick
from .batch import pack
from .batch import student_logits as batch_logits
from .batch import teacher_kv as batch_kv
from .data import read_records
from .windows import ensure_order, make_windows, student_logits, teacher_kv


def _draft(logits: mx.array, u: np.ndarray, rec: dict, order: str, draft: str) -> mx.array:
    if draft == "coupled" and not rec.get("greedy"):
        st = SamplingSettings.from_dict(rec.get("settings") or {})
        return pick(mx.array(u), logits, st.temperature, st.top_k, st.top_p, check=False, order=order)
    return mx.argmax(logits, axis=-1)


def _predictions(pm, adapter, records, width, n_windows, seed, order, draft, micro_seqs: int | None = None):
    """(record, windows, labels, valid, drafts) per record with windows; many records a pass where the model's
    RoPE allows it (the same windows and u either way: each record draws from its own seeded stream)."""
    # A GPU takes many records a pass; the CPU, compute-bound, one (padding records to one length costs there).
    micro_seqs = micro_seqs or (32 if mx.default_device() == mx.gpu else 1)
    per, batched = [], batched_rope(pm.base)
    for i, rec in enumerate(records):
        rng = np.random.default_rng([seed, 10_000_000 + i])
        if batched:
            ensure_order(pm, rec, order)
            kv = None
        else:
            kv = teacher_kv(pm, rec["tokens"], rec, order)  # rebins first: the windows draw u inside the bins
        windows, u, labels, valid = make_windows(rec, n_windows, width, rng, uniform=True)
        if not windows:
            continue
        if kv is not None:
            pred = _draft(student_logits(pm, adapter, kv, windows, u), u, rec, order, draft)
            yield rec, windows, labels, valid, np.array(pred)
        else:
            per.append((rec, windows, u, labels, valid))
    for k in range(0, len(per), micro_seqs):
        chunk = per[k : k + micro_seqs]
        mb = pack([(r["tokens"], w, u, lab, v.astype(np.float32)) for r, w, u, lab, v in chunk], width)
        logits = batch_logits(pm, adapter, batch_kv(pm, mb.tokens), mb)
        argmax = None if draft == "coupled" else np.array(mx.argmax(logits, axis=-1))  # sync: one per chunk
        for b, (rec, windows, u, labels, valid) in enumerate(chunk):
            n = len(windows) * width
            pred = argmax[b, :n] if argmax is not None else np.array(_draft(logits[b, :n], u, rec, order, draft))
            yield rec, windows, labels, valid, pred


def evaluate(
    pm: PTPModel,
    adapter: PTPAdapter,
    records: list[dict],
    width: int,
    n_windows: int,
    seed: int,
    order: str = "id",
    draft: str = "argmax",
):
    """Mean leading-correct drafts per window (auxiliaries 1.., slot 0 is the exact token in decoding), with
    each slot's accuracy overall and for greedy and sampled records apart.

    ``draft``: how an auxiliary row's logits become a draft: their ``argmax``, or (``coupled``, sampled records)
    the sampler's own pick with the row's ``u`` in ``order`` under the record's settings."""
    hist = np.zeros(width, dtype=np.int64)
    per_cat: dict[str, list[int]] = {}
    slot_hits, slot_n = np.zeros(width), np.zeros(width)
    mode_hits = {m: np.zeros(width) for m in ("greedy", "sampled")}
    mode_n = {m: np.zeros(width) for m in ("greedy", "sampled")}
    for rec, windows, labels, valid, pred in _predictions(pm, adapter, records, width, n_windows, seed, order, draft):
        ok = (pred == labels) & valid
        slot_hits += ok.reshape(-1, width).sum(0)
        slot_n += valid.reshape(-1, width).sum(0)
        mode = "greedy" if rec.get("greedy") else "sampled"
        mode_hits[mode] += ok.reshape(-1, width).sum(0)
        mode_n[mode] += valid.reshape(-1, width).sum(0)
        for w in range(len(windows)):
            row = ok[w * width + 1 : (w + 1) * width]
            k = int(np.argmin(row)) if not row.all() else len(row)
            hist[k] += 1
            per_cat.setdefault(rec.get("category", "other"), []).append(k)
            per_cat.setdefault("greedy" if rec.get("greedy") else "sampled", []).append(k)
    n = max(1, hist.sum())
    mean_acc = float((hist * np.arange(width)).sum() / n) + 1.0
    return {
        "mean_accepted": mean_acc,
        "histogram": hist.tolist(),
        "histograms": {
            m: np.bincount(per_cat[m], minlength=width).tolist() for m in ("greedy", "sampled") if m in per_cat
        },
        # Accuracy of each auxiliary slot on its own (slot 0 is the exact token in decoding, never a draft).
        "slot_accuracy": [round(float(x), 4) for x in slot_hits / np.maximum(slot_n, 1)],
        "slot_accuracy_by_mode": {
            m: [round(float(x), 4) for x in mode_hits[m] / np.maximum(mode_n[m], 1)] for m in mode_n if mode_n[m].any()
        },
        "per_category": {c: float(np.mean(v)) + 1.0 for c, v in per_cat.items()},
    }


def evaluate_adapter(
    base, adapter_dir: Path, val_path: Path, width: int = 8, seed: int = 0, order=None, draft: str = "argmax", only=None
) -> dict:
    """``ptp-train eval``: one adapter on a whole held-out teacher file (8 windows per record, uniform ``u``),
    in the CDF order its config records unless ``order`` is given."""
    from ..adapter import load_adapter

    adapter, cfg = load_adapter(Path(adapter_dir), base)
    order = order or cfg.raw.get("cdf_order", "id")
    records = [r for r in read_records(val_path) if only is None or bool(r.get("greedy")) == (only == "greedy")]
    if not records:
        raise UserError(f"no teacher records in {val_path}")
    pm = PTPModel(base, adapter)
    t0 = time.perf_counter()
    ev = evaluate(pm, adapter, records, width, 8, seed, order, draft)
    return {
        "adapter": str(adapter_dir),
        "val": str(val_path),
        "records": len(records),
        "cdf_order": order,
        "draft": draft,
        "seconds": round(time.perf_counter() - t0, 1),
        **ev,
    }
