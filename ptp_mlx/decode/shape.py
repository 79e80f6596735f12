"""A PTP call's shape, inputs and outputs, each with a name (docs/method.md, sections 3 and 5).

``CallShape`` is everything about a call that is known without its values: the token rows and their parents, the
auxiliary windows relative to the cache offset, and which outputs are wanted. It is frozen and hashable: the key of
the compiled call (``decode/fixed.py``), whose traced graph it fixes, together with the attention bucket. Its
static parts (relative RoPE positions, the mask block among the call's own rows, the LoRA row gate) are computed
once per shape, never per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from ..model.tree import tree_path


@dataclass(frozen=True)
class WindowShape:
    """``n`` auxiliary rows that see the first ``ctx`` rows of the call after the cache (relative to the offset:
    ``ctx = 1 + d`` for branch ``d`` of a chain), or, with ``via``, the path of that token row instead."""

    ctx: int
    n: int
    via: int | None = None


@dataclass(frozen=True)
class CallShape:
    """Token rows ``[last, drafts..., alternatives...]`` (``parents[j]``: the row that token row ``j`` follows; -1 for
    the first), then the auxiliary ``windows``; ``runner_up`` / ``reads_top_prob``: also return each auxiliary row's
    runner-up / its top probability at the sampling temperature."""

    parents: tuple[int, ...]
    windows: tuple[WindowShape, ...] = ()
    runner_up: bool = False
    reads_top_prob: bool = False

    @property
    def n_tok(self) -> int:
        return len(self.parents)

    @property
    def n_aux(self) -> int:
        return sum(w.n for w in self.windows)

    @property
    def rows(self) -> int:
        return self.n_tok + self.n_aux

    @cached_property
    def depth(self) -> np.ndarray:
        d = np.zeros(self.n_tok, dtype=np.int32)
        for j, p in enumerate(self.parents):
            if not -1 <= p < j:
                raise ValueError("token-row parents must point to an earlier row (-1 for the first)")
            d[j] = d[p] + 1 if p >= 0 else 0
        return d

    def path(self, j: int) -> list[int]:
        """Token row ``j`` and its ancestors."""
        return tree_path(self.parents, j)

    @cached_property
    def rel_pos(self) -> np.ndarray:
        """int32 [rows]: each row's RoPE position minus the offset (an auxiliary predicting position ``p`` sits at
        ``p - 1``)."""
        parts = [self.depth] + [np.arange(w.n, dtype=np.int32) + w.ctx - 1 for w in self.windows]
        return np.concatenate(parts).astype(np.int32)

    @cached_property
    def block(self) -> np.ndarray:
        """bool [rows, rows]: which of the call's own rows each row sees (every row also sees the whole cache). A
        token row sees its path; an auxiliary row the token rows its window covers and its window causally."""
        rows, n_tok = self.rows, self.n_tok
        m = np.zeros((rows, rows), dtype=bool)
        for j in range(n_tok):
            m[j, self.path(j)] = True
        r = n_tok
        for w in self.windows:
            sees = m[r : r + w.n]
            if w.via is not None:
                sees[:, self.path(w.via)] = True
            else:
                sees[:, : min(n_tok, w.ctx)] = True
            sees[:, r : r + w.n] = np.tril(np.ones((w.n, w.n), dtype=bool))
            r += w.n
        return m

    @property
    def n_drafts(self) -> int:
        """Chain drafts after ``last`` (the rows before the first alternative)."""
        j = 1
        while j < self.n_tok and self.parents[j] == j - 1:
            j += 1
        return j - 1

    @property
    def chain(self) -> bool:
        return self.parents == tuple(range(-1, self.n_tok - 1))

    def gate(self) -> mx.array | None:
        """float32 [1, rows, 1]: the LoRA's row gate (0 on token rows, 1 on auxiliary rows); None without token rows."""
        if not self.n_tok:
            return None
        return mx.array((np.arange(self.rows) >= self.n_tok).astype(np.float32))[None, :, None]


@dataclass
class CallOutputs:
    """What a call returns (lazy arrays until read)."""

    targets: mx.array  # int32 [n_tok]: the exact token at every token row (pick of its u under the base model)
    accepted: mx.array  # int32 []: leading chain drafts equal to their targets
    aux_top: mx.array | None = None  # int32 [n_aux]: each auxiliary row's argmax (the next drafts)
    aux_conf: mx.array | None = None  # float32 [n_aux]: its probability (softmax at T 1)
    second: mx.array | None = None  # int32 [n_aux]: the runner-up (``runner_up``)
    second_conf: mx.array | None = None  # float32 [n_aux]: its probability
    top_prob: mx.array | None = None  # float32 [n_aux]: top probability at the sampling temperature
    scored: list[mx.array] | None = None  # what a logits hook reads back for logprobs (eager calls only)
    # float32 [n_tok, vocab]: the token rows' logits, where a target may read UNRESOLVED (sampler.py, ``resolve``)
    target_logits: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        fields = (self.targets, self.accepted, self.aux_top, self.aux_conf, self.second, self.second_conf)
        return [a for a in (*fields, self.top_prob, self.target_logits) if a is not None] + list(self.scored or [])
