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
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# Projections that read the same input, fused into one matmul.
INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class FusedGate:
    """``PTPContext.lora`` for a pass of a fused adapter: the row gate (float32 [1, rows, 1]; None: every row
    auxiliary), whose adapter (``owner``) it is, and the per-projection form for groups fused for another."""

    gate: mx.array | None
    owner: int
    fallback: object  # lora(key, x) -> delta | None


class FusedGroup:
    """The projections ``names`` of one block as one matrix ``[sum(out) + r, in]`` (base rows, then the adapter's
    ``A`` rows) with the pre-scaled block-diagonal ``B`` [r, sum(out)]."""

    def __init__(self, names, linears, loras, dtype, owner: int):
        self.names, self.owner = tuple(names), owner
        outs = [lin.weight.shape[0] for lin in linears]
        self.out = sum(outs)
        self.splits = list(np.cumsum(outs)[:-1])
        with_a = [n for n in names if n in loras]
        ranks = [loras[n].A.shape[0] for n in with_a]
        parts = [lin.weight.astype(dtype) for lin in linears] + [loras[n].A.astype(dtype) for n in with_a]
        self.W = mx.concatenate(parts, axis=0)
        biases = [getattr(lin, "bias", None) for lin in linears]
        self.bias = (
            None
            if all(b is None for b in biases)
            else mx.concatenate(
                [b if b is not None else mx.zeros((o,), dtype) for b, o in zip(biases, outs, strict=True)]
            ).astype(dtype)
        )
        B = np.zeros((sum(ranks), self.out), dtype=np.float32)
        col = dict(zip(names, np.concatenate([[0], np.cumsum(outs)[:-1]]), strict=True))
        r = 0
        for n, dr in zip(with_a, ranks, strict=True):
            lo = loras[n]
            B[r : r + dr, col[n] : col[n] + lo.B.shape[0]] = np.array((lo.B * lo.scale).T.astype(mx.float32))
            r += dr
        self.B = mx.array(B).astype(dtype) if ranks else None
        self.bias_full = None if self.bias is None else mx.concatenate([self.bias, mx.zeros((sum(ranks),), dtype)])
        self.base_W = self.W[: self.out]
        # The transposed views the matmuls read, made once: evaluated views of the same memory (no copy), so a
        # call's graph has no transpose node per projection and the matmul sees the very strides ``W.T`` gives.
        self.Wt, self.base_Wt = self.W.T, self.base_W.T
        mx.eval(
            self.W,
            self.base_W,
            self.Wt,
            self.base_Wt,
            *(a for a in (self.B, self.bias, self.bias_full) if a is not None),
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
        if gate is not None and self.B is not None:
            z, a = mx.split(self._matmul(x, self.Wt, self.bias_full), [self.out], axis=-1)  # one node, two views
            if gate.gate is not None:  # zero rows in rank space: token rows then add an exact zero
                a = a * gate.gate.astype(a.dtype)
            y = mx.addmm(z, a, self.B)
        else:
            y = self._matmul(x, self.base_Wt, self.bias)
        parts = mx.split(y, self.splits, axis=-1) if self.splits else [y]
        mine = dict(zip(self.names, parts, strict=True))
        out = mine.pop(name)
        self._x, self._memo = (x, mine) if mine else (None, {})
        return out


def fuse_projections(blocks: list[list[dict]], adapter, dtype, owner: int) -> bool:
    """Fuse every float block's projections with ``adapter``'s LoRA (see the module docstring). ``blocks``: per
    layer, its attention's and its MLP's patched projections by name (``layers.projection_modules``), which then
    call their group. Returns False (nothing changed) for a quantized base."""
    if any(type(m.linear) is not nn.Linear for parts in blocks for mods in parts for m in mods.values()):
        return False
    for i, parts in enumerate(blocks):
        loras = adapter.layers[i]
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
