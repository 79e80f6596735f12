"""One description of a PTP pass's rows (docs/method.md, sections 3 and 5), and the pass kinds the model reads.

``CallShape`` is everything about a pass that is known without its values: the token rows and their parents, the
auxiliary windows relative to the cache offset, and which outputs are wanted. It is frozen and hashable: the key of
the compiled call (``decode/fixed.py``), whose traced graph it fixes, together with the attention bucket. Its
static parts (relative RoPE positions, the mask block among the pass's own rows, the LoRA row gate) are computed
once per shape, never per call; ``CallShape.mask`` places them after a cache of a given length (the host's mask).

What the patched modules read during a pass (``layers.PTPContext.plan``) is one of three kinds (``PassKind``):

- ``CallPlan`` (``EAGER``): a ``CallShape`` at a host offset (``PTPModel.__call__``): positions, the runs of
  consecutive positions, and boolean masks built on the host;
- ``FixedPlan`` (``FIXED``): a fixed-shape call of ``decode/fixed.py``: positions an array, the mask built in the
  graph (``model/kv.py: FixedPass``);
- ``train/batch.py: BatchPlan`` (``BATCHED``): many training sequences in one pass, one ``CallShape`` each.

``Window`` is a window in absolute terms (the real tokens it sees), as ``PTPModel.__call__`` and training take it;
``Window.relative`` is its ``WindowShape`` after a cache of a given length.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import mlx.core as mx
import numpy as np


class PassKind(enum.Enum):
    """How a pass gives its rows their positions and masks (what ``layers.RowRoPE`` and the caches branch on)."""

    EAGER = "eager"  # CallPlan: host positions (applied run by run where the RoPE needs it), host masks
    FIXED = "fixed"  # FixedPlan: positions an array, masks built in the graph from an array offset
    BATCHED = "batched"  # train/batch.py: BatchPlan: many sequences, one position per row of each


def tree_path(parents, j: int) -> list[int]:
    """Token row ``j`` and its ancestors in a tree of token rows (``parents[j]``: the row ``j`` follows, -1 none)."""
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out


@dataclass(frozen=True)
class WindowShape:
    """``n`` auxiliary rows that see the first ``ctx`` rows of the pass after the cache (relative to the offset:
    ``ctx = 1 + d`` for branch ``d`` of a chain), or, with ``via``, the path of that token row instead. A
    negative ``ctx`` sees only the first ``offset + ctx`` rows of the cache (a training window inside a prefilled
    sequence; eager passes only: a fixed-shape call's rows all see the whole cache)."""

    ctx: int
    n: int
    via: int | None = None


@dataclass(frozen=True)
class Window:
    """A run of ``n`` auxiliary rows that sees the first ``ctx_len`` real tokens (absolute count).

    Its auxiliary ``j`` predicts the token at absolute position ``ctx_len + j`` and sits at RoPE position
    ``ctx_len + j - 1``. ``via``: in a token tree, the token row whose path (its ancestors and itself) the window
    sees instead of the first token rows; ``ctx_len`` is then the cache length plus that path's length.
    """

    ctx_len: int
    n: int
    via: int | None = None

    def relative(self, offset: int) -> WindowShape:
        """The same window after a cache of ``offset`` rows."""
        return WindowShape(self.ctx_len - offset, self.n, self.via)


@dataclass(frozen=True)
class CallShape:
    """Token rows ``[last, drafts..., alternatives...]`` (``parents[j]``: the row that token row ``j`` follows; -1 for
    the first), then the auxiliary ``windows``; ``runner_up`` / ``reads_top_prob``: also return each auxiliary row's
    runner-ups (its next likeliest tokens: a token tree's candidates) / its top probability at the sampling
    temperature."""

    parents: tuple[int, ...]
    windows: tuple[WindowShape, ...] = ()
    runner_up: bool = False
    reads_top_prob: bool = False

    @property
    def n_tok(self) -> int:
        return len(self.parents)

    @property
    def graph_key(self) -> tuple:
        """What fixes a fixed-shape call's graph (``decode/fixed.py``): its row counts and outputs. Which rows see
        which and their positions (the tree, the windows) are input arrays, so every shape with this key shares one
        compiled graph."""
        return self.n_tok, self.n_drafts, self.n_aux, self.runner_up, self.reads_top_prob

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
        """bool [rows, rows]: which of the pass's own rows each row sees. A token row sees its path; an auxiliary
        row the token rows its window covers and its window causally."""
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
                sees[:, : max(0, min(n_tok, w.ctx))] = True
            sees[:, r : r + w.n] = np.tril(np.ones((w.n, w.n), dtype=bool))
            r += w.n
        return m

    def mask(self, offset: int, window_size: int | None = None) -> np.ndarray:
        """bool [rows, offset + rows] after a cache of ``offset`` rows: every row sees the cache (a window with a
        negative ``ctx`` its first ``offset + ctx`` rows) and the rows of ``block``; with ``window_size``, only keys
        within that many positions. (A fixed-shape call builds the same mask in its graph: ``decode/fixed.py``.)"""
        cut = [np.full(self.n_tok, offset)] + [np.full(w.n, offset + min(0, w.ctx)) for w in self.windows]
        full = np.zeros((self.rows, offset + self.rows), dtype=bool)  # columns: the cache, then this pass's rows
        full[:, :offset] = np.arange(offset)[None, :] < np.concatenate(cut)[:, None]
        full[:, offset:] = self.block
        if window_size is not None:
            pos = offset + self.rel_pos.astype(np.int64)
            col_pos = np.concatenate([np.arange(offset), pos])
            full &= col_pos[None, :] > pos[:, None] - window_size
        return full

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


class CallPlan:
    """An eager pass (``PassKind.EAGER``): ``shape`` after a cache of ``offset`` rows, as the installed modules read
    it: every row's position (``pos``, ``positions``), their runs of consecutive positions (``segments``), and the
    boolean masks (``mask``), each built once per pass and shared by all layers.

    Token rows form a chain, or a tree (``shape.parents``): a row sees the cache and its own path, and sits at the
    RoPE position of its depth."""

    kind: ClassVar[PassKind] = PassKind.EAGER

    def __init__(self, shape: CallShape, offset: int):
        self.shape, self.offset = shape, offset
        self.n_tok, self.rows = shape.n_tok, shape.rows
        self.pos = offset + shape.rel_pos.astype(np.int64)  # (checks the parents)
        # Runs of consecutive positions (RoPE modules that take one offset per call are applied run by run).
        self.segments: list[tuple[int, int, int]] = []
        for r in range(self.rows):
            if self.segments and self.segments[-1][1] == r and self.pos[r] == self.pos[r - 1] + 1:
                s0, _, p0 = self.segments[-1]
                self.segments[-1] = (s0, r + 1, p0)
            else:
                self.segments.append((r, r + 1, int(self.pos[r])))
        self._masks: dict[int | None, mx.array] = {}
        self._positions: mx.array | None = None

    @classmethod
    def of_windows(cls, offset: int, n_tok: int, windows: list[Window], parents: list[int] | None = None) -> CallPlan:
        """``n_tok`` token rows at ``offset..`` (``parents[j]``: the row token row ``j`` follows; default a chain),
        then the auxiliary ``windows`` (absolute)."""
        parents = tuple(parents) if parents is not None else tuple(range(-1, n_tok - 1))
        if len(parents) != n_tok:
            raise ValueError("token-row parents must point to an earlier row (-1 for the first)")
        return cls(CallShape(parents, tuple(w.relative(offset) for w in windows)), offset)

    @property
    def positions(self) -> mx.array:
        """RoPE position of every row (int32, built once per pass and shared by all layers)."""
        if self._positions is None:
            self._positions = mx.array(self.pos.astype(np.int32))
        return self._positions

    def mask(self, window_size: int | None) -> mx.array:
        """Boolean mask [rows, offset + rows] (``CallShape.mask``): a token row sees the cache and its path; an
        auxiliary row the real tokens before its window (or the path of its ``via`` row) and its own window
        causally; with ``window_size``, only keys within that many positions."""
        if window_size not in self._masks:
            self._masks[window_size] = mx.array(self.shape.mask(self.offset, window_size))
        return self._masks[window_size]


@dataclass
class FixedPlan:
    """A fixed-shape pass (``PassKind.FIXED``, ``decode/fixed.py``): every row's RoPE position as an array (rows go
    through RoPE as batch entries, one position each); the masks are the pass's ``kv.FixedPass``."""

    kind: ClassVar[PassKind] = PassKind.FIXED
    positions: mx.array  # int32 [rows]
    tables: dict = field(default_factory=dict)  # RoPE cos/sin tables, built by the first layer (model/rope.py)
