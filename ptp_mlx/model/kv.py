"""The one owner of a model's K/V state: fixed-capacity buffers, an offset, and the verbs everything else uses.

Per layer a key and a value buffer ``[B, Hkv, capacity, D]``, capacity a multiple of ``CHUNK`` grown by whole
chunks; ``offset`` rows of them hold real tokens. Trimming moves the offset (rows past it are stale and never
read: the masks exclude them), a landed tree alternative is a row copy, a snapshot is the arrays by value (MLX
arrays are immutable: a later write makes new ones).

mlx-lm's attention talks to one ``LayerKV`` per layer (``state[i]``): ``offset``, ``update_and_fetch`` and
``make_mask``, as with its own ``KVCache``. Two kinds of pass run through them:

- a **plain pass** (prefill, a replay, an eager PTP pass with a ``CallPlan``): rows are written at the host offset and
  attention reads exactly ``offset + rows`` keys, as mlx-lm's ``KVCache`` does;
- a **fixed pass** (``fixed(...)``: the compiled calls of ``ptp_mlx/decode/``): rows are written at an int32 *array*
  offset with ``mx.slice_update`` and attention reads a constant-shape view of ``bucket`` keys (a multiple of
  ``CHUNK``) with an additive mask built in the graph, so the traced graph is the same whatever the offset. Buffers
  are written in place: the state holds the only reference to them, and MLX donates an array's memory to the update
  when nothing else holds it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

_pass = threading.local()  # .ours: the pass this thread is building runs over our K/V state


def mark_pass(ours: bool) -> None:
    """Say whether the pass this thread builds runs over our K/V state. Every pass starts out
    (``layers.TokenEmbedding``); our state's ``make_mask`` and each attention call over it say so."""
    _pass.ours = ours


def in_our_pass() -> bool:
    return getattr(_pass, "ours", False)


CHUNK = 256  # capacity and attention views grow in whole chunks of this many rows


def round_up(n: int) -> int:
    """The smallest multiple of ``CHUNK`` that holds ``n`` rows (at least one chunk)."""
    return max(CHUNK, -(-n // CHUNK) * CHUNK)


@dataclass
class FixedPass:
    """A fixed-shape pass in progress: where it writes (an int32 scalar array), how many keys attention reads, and
    the mask for each window size (additive, built in the graph by ``mask_for``)."""

    offset: mx.array  # int32 []: cache rows before this pass
    bucket: int  # keys attention reads: a multiple of CHUNK, >= offset + rows
    mask_for: Callable[[int | None], mx.array]  # window size (None: full) -> additive mask [rows, bucket]

    @cached_property
    def start(self) -> mx.array:
        """int32 [1]: the write position as ``slice_update`` takes it, one node for every layer of the pass."""
        return self.offset.reshape(1)


class LayerKV:
    """Layer ``i``'s view of a ``KVState``: what mlx-lm's attention calls (``offset``, ``update_and_fetch``,
    ``make_mask``). It holds nothing of its own."""

    def __init__(self, state: KVState, i: int):
        self._state, self._i = state, i

    @property
    def offset(self):
        """The cache length before the pass: an int, or inside a fixed pass the pass's int32 array (RoPE takes
        either)."""
        p = self._state.pass_
        return self._state.offset if p is None else p.offset

    @property
    def state(self) -> list[mx.array]:
        s = self._state
        return [] if s.keys[self._i] is None else [s.keys[self._i], s.values[self._i]]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._state._write(self._i, keys, values)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        mark_pass(True)  # a pass over our K/V state: its norms take one primitive each (model/cpu_math.py)
        return self._state._mask(N, window_size, return_array)

    # mlx-lm's cache verbs (``trim_prompt_cache`` calls them on every layer with the same count): the offset is
    # shared, so layer 0 trims it and the other layers follow.
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return self._state.trim(n) if self._i == 0 else min(n, self._state.offset)

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self._state.contents()[self._i]


class KVState(Sequence):
    """A model's K/V: per-layer buffers and one offset. Iterating it gives the per-layer views mlx-lm expects
    (``model(x, cache=state)``); everything else uses its verbs."""

    def __init__(self, n_layers: int, ctx=None):
        self.keys: list[mx.array | None] = [None] * n_layers
        self.values: list[mx.array | None] = [None] * n_layers
        self.offset = 0  # rows holding real tokens
        self.pass_: FixedPass | None = None
        self._ctx = ctx  # the model's ``layers.PTPContext``: an eager PTP pass's plan gives the mask
        self._views = [LayerKV(self, i) for i in range(n_layers)]
        self._written = 0  # layers written in the current plain pass

    # -- mlx-lm's view -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i):
        return self._views[i]

    @property
    def capacity(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def _grow(self, i: int, rows: int, like_k: mx.array, like_v: mx.array) -> None:
        """Make layer ``i``'s buffers hold ``rows`` rows (whole chunks; old contents kept)."""
        k, v = self.keys[i], self.values[i]
        have = 0 if k is None else k.shape[2]
        if rows <= have:
            return
        B, H, _, Dk = like_k.shape
        extra = round_up(rows) - have
        nk, nv = mx.zeros((B, H, extra, Dk), like_k.dtype), mx.zeros((B, H, extra, like_v.shape[3]), like_v.dtype)
        self.keys[i] = nk if k is None else mx.concatenate([k, nk], axis=2)
        self.values[i] = nv if v is None else mx.concatenate([v, nv], axis=2)

    def _write(self, i: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        p = self.pass_
        if p is not None:  # fixed pass: write at the array offset, read the constant-shape bucket
            self.keys[i] = mx.slice_update(self.keys[i], k, p.start, axes=(2,))
            self.values[i] = mx.slice_update(self.values[i], v, p.start, axes=(2,))
            return self.keys[i][..., : p.bucket, :], self.values[i][..., : p.bucket, :]
        n, prev = k.shape[2], self.offset
        self._grow(i, prev + n, k, v)
        # Written through fresh handles of the same arrays (no copy): a snapshot's arrays stay as they were.
        nk, nv = mx.array(self.keys[i]), mx.array(self.values[i])
        nk[..., prev : prev + n, :] = k
        nv[..., prev : prev + n, :] = v
        self.keys[i], self.values[i] = nk, nv
        self._written += 1
        if self._written == len(self):  # every layer has its rows: the pass is complete
            self._written, self.offset = 0, prev + n
        end = prev + n
        return self.keys[i][..., :end, :], self.values[i][..., :end, :]

    def _mask(self, N: int, window_size: int | None, return_array: bool):
        if self.pass_ is not None:
            return self.pass_.mask_for(window_size)
        plan = getattr(self._ctx, "plan", None)
        if plan is not None:
            return plan.mask(window_size)
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    # -- verbs -----------------------------------------------------------------------------------------------------
    def reserve(self, rows: int, shapes: Sequence[tuple[tuple, tuple, mx.Dtype]]) -> None:
        """Make every buffer hold ``offset + rows`` rows before a fixed pass (``shapes``: per layer the key and
        value shapes of one row and their dtype, from ``kv_shapes``)."""
        need = self.offset + rows
        if need <= self.capacity:
            return
        for i, (ks, vs, dt) in enumerate(shapes):
            self._grow(i, need, mx.zeros(ks, dt), mx.zeros(vs, dt))

    def can_trim_to(self, n: int) -> bool:
        """Whether ``trim_to(n)`` can keep the first ``n`` rows (any count up to the offset)."""
        return 0 <= n <= self.offset

    def trim_to(self, n: int) -> None:
        """Keep the first ``n`` rows (the others become stale: never read, overwritten by later passes)."""
        if not 0 <= n <= self.offset:
            raise ValueError(f"cannot trim a {self.offset}-row cache to {n} rows")
        self.offset = n

    def trim(self, n: int) -> int:
        """Drop the last ``n`` rows (mlx-lm's verb); returns how many were dropped."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    def copy_rows(self, src: int, dst: int, n: int = 1) -> None:
        """Rows ``src..src+n`` of every layer's K/V to rows ``dst..dst+n`` (a token tree's strand that stood moves
        next to its parent; the rows are read before any is written, so the ranges may overlap)."""
        at = mx.array([dst], dtype=mx.int32)
        for i in range(len(self)):
            for bufs in (self.keys, self.values):
                bufs[i] = mx.slice_update(bufs[i], bufs[i][..., src : src + n, :], at, axes=(2,))

    def snapshot(self) -> tuple:
        """The state by value (arrays are immutable: later writes make new ones)."""
        return list(self.keys), list(self.values), self.offset

    def restore(self, snap: tuple) -> None:
        keys, values, offset = snap
        self.keys, self.values, self.offset = list(keys), list(values), offset

    def contents(self) -> list[tuple[mx.array, mx.array]]:
        """Per layer the keys and values of the real rows (``[..., :offset, :]``)."""
        return [
            (k[..., : self.offset, :], v[..., : self.offset, :]) for k, v in zip(self.keys, self.values, strict=True)
        ]

    def repeat(self, n: int) -> None:
        """Repeat the real rows ``n`` times along the batch (one prompt, ``n`` completions)."""
        for i, (k, v) in enumerate(self.contents()):
            self.keys[i], self.values[i] = mx.repeat(k, n, axis=0), mx.repeat(v, n, axis=0)

    def arrays(self) -> list[mx.array]:
        """Every buffer, for ``mx.eval``."""
        return [a for a in self.keys + self.values if a is not None]

    def take_buffers(self) -> tuple[list[mx.array], list[mx.array]]:
        """Hand the buffers to a fixed pass and drop the state's references (so the pass's writes need not copy);
        ``put_buffers`` takes the pass's outputs back."""
        keys, values = self.keys, self.values
        self.keys, self.values = [None] * len(self), [None] * len(self)
        return keys, values

    def put_buffers(self, keys: Sequence[mx.array], values: Sequence[mx.array], offset: int) -> None:
        self.keys, self.values, self.offset = list(keys), list(values), offset

    @classmethod
    def traced(cls, keys: Sequence[mx.array], values: Sequence[mx.array], p: FixedPass) -> KVState:
        """A state over a fixed pass's input buffers (inside a pure, possibly compiled, function)."""
        st = cls(len(keys))
        st.keys, st.values, st.pass_ = list(keys), list(values), p
        return st


def kv_shapes(model) -> list[tuple[tuple, tuple, mx.Dtype]]:
    """Per layer the shapes of one row of keys and values and their dtype: one throwaway one-token pass."""
    st = KVState(len(model.layers))
    model(mx.array([[0]]), cache=st)
    return [((1, *k.shape[1:2], 1, k.shape[3]), (1, *v.shape[1:2], 1, v.shape[3]), k.dtype) for k, v in st.contents()]
