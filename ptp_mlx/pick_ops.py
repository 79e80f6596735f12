"""The sampler's passes over a whole row as ptp-mlx's CPU primitives (``kernels/heads.cpp: top_ids``,
``kernels/picks.cpp``), with the switches that keep MLX's graph forms. A leaf module that ``sampler.py`` reads: off the
CPU, without the extension, or switched off, ``top_ids`` runs MLX's ops and the others give None (the caller's graph
form). The extension is built from these very sources (its file is keyed by their hash), so it has every primitive."""

from __future__ import annotations

import os

import mlx.core as mx

from .cdf import work_dtype


def top_ids(logits: mx.array, c: int) -> mx.array:
    """The ids of each row's ``c`` largest logits, int32 in increasing order (temperature and softmax keep the
    order). On the CPU one primitive (``kernels/heads.cpp: top_ids``, about 0.5 ms a row less than MLX's
    argpartition and sort; ``PTP_MLX_TOP_IDS=0``: those); which of equal logits at the edge come in does not matter
    (``_head``'s ``exact``)."""
    if logits.dtype == mx.float32 and mx.default_device() == mx.cpu and on("PTP_MLX_TOP_IDS"):
        from .kernels.extension import module

        mod = module()
        if mod is not None:
            return mod.top_ids(logits, c)
    part = mx.argpartition(-logits, kth=c - 1, axis=-1)[..., :c]
    return mx.sort(part.astype(mx.int32), axis=-1)


def on(switch: str) -> bool:
    """Whether the environment leaves the primitive behind ``switch`` on (anything but 0, off, no, false)."""
    return os.environ.get(switch, "1").strip().lower() not in ("0", "off", "no", "false")


def tempered_stats(logits: mx.array, temperature: float, cutoff: float) -> tuple[mx.array, mx.array, mx.array] | None:
    """``sampler._tempered``'s maximum and ``Z``, and the count of tokens above ``cutoff``, as one primitive on the CPU
    (``kernels/picks.cpp``: the graph's arithmetic in its order, every bit the same, two passes over the row instead
    of seven nodes); None where the work dtype is not float64, without the extension, or with
    ``PTP_MLX_TEMPERED=0``."""
    if work_dtype() != mx.float64 or not on("PTP_MLX_TEMPERED"):
        return None
    from .kernels.extension import module

    mod = module()
    return None if mod is None else tuple(mod.tempered_stats(logits.astype(mx.float32), float(temperature), cutoff))


def greedy_pick(logits: mx.array) -> mx.array | None:
    """The greedy pick as one primitive on the CPU (``kernels/picks.cpp: greedy_pick``: each row's argmax, the lowest
    id among equal maxima, -1 where the row is not finite; what ``mx.argmax`` and the finiteness test give, in two
    passes over the row instead of four, about 0.15 ms a row less here); None elsewhere, or with
    ``PTP_MLX_GREEDY_PICK=0``."""
    if logits.dtype != mx.float32 or mx.default_device() != mx.cpu or not on("PTP_MLX_GREEDY_PICK"):
        return None
    from .kernels.extension import module

    mod = module()
    return None if mod is None else mod.greedy_pick(logits)
