"""Fused projections: one matmul for the base projections that read the same input and their LoRA ``A``.

A decode call on a small model costs what its primitives cost (docs/method.md, section 10), so projections that
read the same input (q|k|v, gate|up) share one weight matrix, and the adapter's stacked ``A`` rides along as extra
output rows: ``z = x @ [W_q; W_k; W_v; A]^T``. On auxiliary rows the LoRA delta ``(a * gate) @ B`` (scale folded
into ``B``, block-diagonal over the group) is added to the base outputs by one ``mx.addmm``; token rows add an
exact zero, so they stay what a plain pass of the same rows gives (the base part of the fused product is the same
product: each output is the same dot product over the input, whatever other columns the matmul computes). A
plain pass reads only the base rows of the same matrix (a view), so the fused matrix replaces the base weights:
no second copy. Projections of one group are called on the very same input array (as mlx-lm's attention and MLP
do): the first computes the group and the others take their part.

A quantized base cannot be fused that way: ``FusedLoRA`` then stacks only the LoRA matmuls of a group beside the
base ones. Both forms build the group's ``B`` with one builder (``block_diagonal_b``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..kernels.extension import module as gated_linear_module
from .cpu_math import fused_op
from .kv import in_our_pass

# Projections that read the same input: fused into one matmul (their LoRA ``A`` stacked with them, or alone).
INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# The precision a float32 group's LoRA ``A`` and ``B`` are held at where the CPU primitive runs it (None: as
# given). bfloat16 halves what a drafting call reads for its deltas; only auxiliary rows see them, so token rows
# and every accepted token keep their bits, and drafts move by a rounding (docs/method.md, section 10).
LORA_STORAGE = mx.bfloat16


@dataclass
class FusedGate:
    """``PTPContext.lora`` for a pass of a fused adapter: the row gate (float32 [1, rows, 1]; None: every row
    auxiliary), whose adapter (``owner``) it is, and the per-projection form for groups fused for another."""

    gate: mx.array | None
    owner: int
    fallback: object  # lora(key, x) -> delta | None


def block_diagonal_b(loras: list, cols: list[int], width: int, dtype) -> mx.array | None:
    """A group's pre-scaled ``B`` [sum of ranks, width]: LoRA ``k``'s ``(B * scale)^T`` [r_k, out_k] at rows
    ``r_0 + .. + r_{k-1}`` (ranks in order) and at columns ``cols[k]..``, zeros elsewhere (block-diagonal over the
    group's projections); None for no LoRA."""
    if not loras:
        return None
    ranks = [lo.A.shape[0] for lo in loras]
    B = np.zeros((sum(ranks), width), dtype=np.float32)
    r = 0
    for lo, c, dr in zip(loras, cols, ranks, strict=True):
        B[r : r + dr, c : c + lo.B.shape[0]] = np.array((lo.B * lo.scale).T.astype(mx.float32))
        r += dr
    return mx.array(B).astype(dtype)


class FusedGroup:
    """The projections ``names`` of one block as one matrix ``[sum(out) + r, in]`` (base rows, then the adapter's
    ``A`` rows) with the pre-scaled block-diagonal ``B`` [r, sum(out)]."""

    def __init__(self, names, linears, loras, dtype, owner: int):
        self.names, self.owner = tuple(names), owner
        outs = [lin.weight.shape[0] for lin in linears]
        self.out = sum(outs)
        self.splits = list(np.cumsum(outs)[:-1])
        self.outs = outs
        with_a = [n for n in names if n in loras]
        ranks = [loras[n].A.shape[0] for n in with_a]
        # On the CPU a float32 group and its LoRA can be one primitive (kernels/gated_linear.cpp), whose A and B
        # are held at LORA_STORAGE precision (A's rows as stored in W, so the graph form reads the same values).
        self.gated = gated_module() if with_a and dtype == mx.float32 else None
        held = LORA_STORAGE if self.gated is not None else None
        parts = [lin.weight.astype(dtype) for lin in linears] + [_held(loras[n].A, held, dtype) for n in with_a]
        self.W = mx.concatenate(parts, axis=0)
        biases = [getattr(lin, "bias", None) for lin in linears]
        self.bias = (
            None
            if all(b is None for b in biases)
            else mx.concatenate(
                [b if b is not None else mx.zeros((o,), dtype) for b, o in zip(biases, outs, strict=True)]
            ).astype(dtype)
        )
        col = dict(zip(names, np.concatenate([[0], np.cumsum(outs)[:-1]]), strict=True))
        self.B = block_diagonal_b([loras[n] for n in with_a], [col[n] for n in with_a], self.out, dtype)
        # The primitive reads B as stored (B16: bfloat16 by default, half the bytes of a drafting call's deltas)
        # and B's non-zero columns per rank row (spans); the graph form gets the very same values widened.
        self.B16 = self.B if held is None else self.B.astype(held)
        self.B = self.B16.astype(dtype) if held is not None else self.B
        self.bias_full = None if self.bias is None else mx.concatenate([self.bias, mx.zeros((sum(ranks),), dtype)])
        self.plain = dtype == mx.float32  # a plain pass's group can be one node (kernels/linear.cpp)
        self.spans = _spans(self.B) if self.gated is not None else None
        self.base_W = self.W[: self.out]
        # The transposed views the matmuls read, made once: evaluated views of the same memory (no copy), so a
        # call's graph has no transpose node per projection and the matmul sees the very strides ``W.T`` gives.
        self.Wt, self.base_Wt = self.W.T, self.base_W.T
        mx.eval(
            self.W,
            self.base_W,
            self.Wt,
            self.base_Wt,
            *(a for a in (self.B, self.B16, self.bias, self.bias_full) if a is not None),
        )
        # The stock modules keep working (training, other adapters) on views of the fused matrix: no second copy.
        row = 0
        for lin, o in zip(linears, outs, strict=True):
            lin.weight = self.W[row : row + o]
            row += o
        mx.eval([lin.weight for lin in linears])
        self._x: mx.array | None = None
        self._memo: dict[str, mx.array] = {}

    def _matmul(self, x: mx.array, Wt: mx.array, bias: mx.array | None) -> mx.array:
        return x @ Wt if bias is None else mx.addmm(bias, x, Wt)

    def __call__(self, name: str, x: mx.array, gate: FusedGate | None) -> mx.array:
        """Projection ``name`` of ``x``: base output, plus the delta on auxiliary rows when ``gate`` is given."""
        if self._x is x and name in self._memo:
            y = self._memo.pop(name)
            if not self._memo:
                self._x = None
            return y
        if gate is not None and self.gated is not None and mx.default_device() == mx.cpu:
            # One node with one output per projection (no split after it); the gate [1, rows, 1] as it is (one
            # float per row of x, contiguous: no reshape node per group either).
            rows = gate.gate if gate.gate is not None else mx.ones((x.size // x.shape[-1],))
            parts = self.gated.gated_linear_parts(x, self.W, self.B16, rows, self.spans, self.outs, self.bias)
            return self._take(name, x, parts)
        if gate is not None and self.B is not None:
            z, a = mx.split(self._matmul(x, self.Wt, self.bias_full), [self.out], axis=-1)  # one node, two views
            if gate.gate is not None:  # zero rows in rank space: token rows then add an exact zero
                a = a * gate.gate.astype(a.dtype)
            y = mx.addmm(z, a, self.B)
        elif self.plain and x.dtype == mx.float32 and in_our_pass() and (linear := fused_op("linear")) is not None:
            # a pass over our K/V state: the group as one node, one output per projection (kernels/linear.cpp)
            return self._take(name, x, linear(x, self.W, self.outs, self.bias))
        else:
            y = self._matmul(x, self.base_Wt, self.bias)
        parts = mx.split(y, self.splits, axis=-1) if self.splits else [y]
        return self._take(name, x, parts)

    def _take(self, name: str, x: mx.array, parts: list[mx.array]) -> mx.array:
        """Projection ``name``'s part, the group's others kept for its next calls on the same ``x``."""
        mine = dict(zip(self.names, parts, strict=True))
        out = mine.pop(name)
        self._x, self._memo = (x, mine) if mine else (None, {})
        return out


def _held(a: mx.array, held, dtype) -> mx.array:
    """``a`` in ``dtype``, first rounded to ``held`` precision where given."""
    return a.astype(dtype) if held is None else a.astype(held).astype(dtype)


def gated_module():
    """The one-primitive form of a group and its LoRA (``kernels/extension.py``), or None where MLX runs
    elsewhere or it cannot be built."""
    return gated_linear_module() if mx.default_device() == mx.cpu else None


def _spans(B: mx.array) -> mx.array:
    """int32 [rank, 2]: the columns ``[lo, hi)`` outside which row k of the block-diagonal ``B`` is zero."""
    nz = np.array(B.astype(mx.float32)) != 0
    spans = np.zeros((nz.shape[0], 2), dtype=np.int32)
    for k, row in enumerate(nz):
        cols = np.flatnonzero(row)
        if cols.size:
            spans[k] = (cols[0], cols[-1] + 1)
    out = mx.array(spans)
    mx.eval(out)
    return out


def fuse_projections(blocks: list[list[dict]], adapter, dtype, owner: int) -> bool:
    """Fuse every float block's projections with ``adapter``'s LoRA, or alone where ``adapter`` is None (see the
    module docstring). ``blocks``: per layer, its attention's and its MLP's patched projections by name
    (``layers.projection_modules``), which then call their group. Returns False (nothing changed) for a quantized
    base."""
    if any(type(m.linear) is not nn.Linear for parts in blocks for mods in parts for m in mods.values()):
        return False
    for i, parts in enumerate(blocks):
        loras = adapter.layers[i] if adapter is not None else {}
        for mods in parts:
            groups = [tuple(n for n in g if n in mods) for g in INPUT_GROUPS]
            groups = [g for g in groups if len(g) > 1]
            grouped = {n for g in groups for n in g}
            groups += [(n,) for n in mods if n not in grouped]
            for g in groups:
                fg = FusedGroup(g, [mods[n].linear for n in g], {n: loras[n] for n in g if n in loras}, dtype, owner)
                for n in g:
                    mods[n].group = fg
    return True


class FusedLoRA:
    """Inference form of an adapter's LoRAs: ``A`` transposed, the scale folded into ``B``, and projections that
    read the same input (q/k/v, gate/up) stacked so a group costs two matmuls instead of two per projection
    (decoding on CPU is bound by per-op overhead; docs/method.md, section 10). Training uses ``LoRA`` itself.

    The first projection of a group computes the whole group's deltas and the others pick theirs up, provided
    they are called on the very same input array (as mlx-lm's attention and MLP do); otherwise each computes
    its own.
    """

    def __init__(self, adapter, dtype):  # adapter: a ``ptp.PTPAdapter``
        self.single: dict[tuple[int, str], tuple[mx.array, mx.array]] = {}
        self.group_of: dict[tuple[int, str], tuple[tuple[str, ...], mx.array, mx.array, list[int]]] = {}
        for i, loras in enumerate(adapter.layers):
            for n, lo in loras.items():
                self.single[(i, n)] = (lo.A.T.astype(dtype), (lo.B * lo.scale).T.astype(dtype))
            for group in INPUT_GROUPS:
                names = tuple(n for n in group if n in loras)
                if len(names) < 2:
                    continue
                At = mx.concatenate([loras[n].A for n in names], axis=0).T
                outs = [loras[n].B.shape[0] for n in names]
                splits = list(np.cumsum(outs)[:-1])
                B = block_diagonal_b([loras[n] for n in names], [0, *splits], sum(outs), dtype)
                entry = (names, At.astype(dtype), B, splits)
                for n in names:
                    self.group_of[(i, n)] = entry
        mx.eval([v for pair in self.single.values() for v in pair], [e[1:3] for e in self.group_of.values()])

    def bind(self, gate: mx.array | None):
        """The ``lora(key, x)`` callable for one call with this row gate."""
        memo: dict[tuple[int, str], mx.array] = {}  # deltas of a group's later projections, for input ``seen[0]``
        seen: list[mx.array] = []

        def lora(key: tuple[int, str], x: mx.array) -> mx.array | None:
            if key in memo and seen and seen[0] is x:
                return memo.pop(key)
            group = self.group_of.get(key)
            if group is not None and group[0][0] == key[1]:
                names, At, Bt, splits = group
                a = x @ At
                if gate is not None:
                    a = a * gate
                parts = mx.split(a @ Bt, splits, axis=-1)
                memo.clear()
                memo.update({(key[0], n): p for n, p in zip(names[1:], parts[1:], strict=True)})
                seen[:] = [x]
                return parts[0]
            pair = self.single.get(key)
            if pair is None:
                return None
            a = x @ pair[0]
            if gate is not None:
                a = a * gate
            return a @ pair[1]

        return lora
