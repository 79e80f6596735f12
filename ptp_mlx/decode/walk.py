"""The path that stood through a token tree (docs/method.md, section 5, "Token trees"): walked by the host after a
call is read (``walk``), and found in the graph before it is (``end_row``: a call built ahead for the outcomes
where the path took a strand gathers its inputs by that row). Both follow one rule, tested against each other."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..drafting.protocol import DraftPlan
from ..model.shape import tree_path


def walk(plan: DraftPlan, c: int, exact) -> tuple[list[int], int | None, list[tuple[int, int, int]], list[int]]:
    """The path that stood in a call of ``plan`` whose chain kept ``c`` drafts, ``exact(row)`` giving each row's exact
    token: ``(path, strand, moves, block)``, the token rows on the path, the last strand it took (None: the chain
    alone), the strand rows that must move next to the path's (``(src row, dst row, count)``, in order) and the
    emitted block but its last token (``exact(path[-1])``). Where the chain stopped, a strand that follows its row
    and starts with the exact token there takes the path on, token by token, and where that strand stops, a strand
    that follows its row there, and so on (the first such strand in order)."""
    # (the graph counts leading rows that each follow the row before: a strand hung after the chain's last draft
    # continues that count; the host walks strands itself)
    path, strand, moves = list(range(c + 1)), None, []
    block = list(plan.drafts[:c])
    line, depth = -1, c  # the line the path is on (-1: the chain) and the drafts on it so far
    while plan.strands:
        t = exact(path[-1])
        k = next(
            (k for k, st in enumerate(plan.strands) if st.parent == line and st.at == depth and st.tokens[0] == t),
            None,
        )
        if k is None:
            break
        st, row = plan.strands[k], plan.strand_row(k)
        m = 1
        while m < len(st.tokens) and st.tokens[m] == exact(row + m - 1):
            m += 1
        if row != len(path):  # (compacted: the strand's K/V rows that stood move next to the path's)
            moves.append((row, len(path), m))
        block += list(st.tokens[:m])
        path += list(range(row, row + m))
        strand, line, depth = k, k, st.at + m
    return path, strand, moves, block


@lru_cache(maxsize=256)
def _tables(parents: tuple[int, ...]) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A tree's static tables: each row's parent (-1: none), its depth, its ancestors (itself included) and its
    earlier siblings (rows before it that follow the same row)."""
    n = len(parents)
    par = np.array(parents, np.int32)
    depth = np.array([len(tree_path(parents, r)) - 1 for r in range(n)], np.int32)
    anc = np.zeros((n, n), bool)
    for r in range(n):
        anc[r, tree_path(parents, r)] = True
    sib = (par[:, None] == par[None, :]) & (np.arange(n)[None, :] < np.arange(n)[:, None]) & (par[:, None] >= 0)
    return mx.array(par), mx.array(depth), mx.array(anc), mx.array(sib)


def tree_rows(plan: DraftPlan) -> list[tuple[int, int, int]]:
    """``(row, parent row, depth)`` of every token row of ``plan``'s call after ``last`` and the chain: each strand's
    tokens in order, the first following the row ``plan.follows`` names (the chain's row ``at``, or a token of
    its parent strand)."""
    out, r = [], 1 + len(plan.drafts)
    for j, st in enumerate(plan.strands):
        parent = plan.follows(j)
        for k in range(len(st.tokens)):
            out.append((r, parent, st.at + 1 + k))
            parent, r = r, r + 1
    return out


def row_parents(plan: DraftPlan) -> tuple[int, ...]:
    """Each token row's parent row in a call of ``plan`` (-1 for the first): the chain, then every strand's tokens."""
    return (-1, *range(len(plan.drafts)), *(p for _, p, _ in tree_rows(plan)))


def row_depths(plan: DraftPlan) -> list[int]:
    """Each token row's depth: the drafts on the path to it (what a path that ends there has accepted)."""
    return [*range(1 + len(plan.drafts)), *(e for _, _, e in tree_rows(plan))]


def end_row(plan: DraftPlan, tokens: mx.array, targets: mx.array) -> mx.array:
    """int32 []: the token row where the path of a call of ``plan`` ends, in the graph from its token rows and exact
    targets, as ``walk`` finds it under the exact rule: a row stands where its token is its parent row's exact
    token, and lies on the path where it and every row before it on its line stand and no earlier row following
    the same row stands (the chain's next draft first, then strands in order); the path ends at its deepest row.
    (A target left UNRESOLVED never stands here; the host, which resolves it, may find a different row: a build
    chosen by this row is checked against the host's before it runs.)"""
    par, depth, anc, sib = _tables(row_parents(plan))
    stands = (tokens == mx.take(targets, mx.maximum(par, 0))) | (par < 0)
    good = stands & ~mx.any(sib & stands[None, :], axis=1)
    on = mx.all(mx.where(anc, good[None, :], True), axis=1)
    return mx.argmax(mx.where(on, depth, -1)).astype(mx.int32)
