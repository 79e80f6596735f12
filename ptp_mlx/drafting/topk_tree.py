"""The adapter's token tree from its top-k tokens per slot (docs/method.md, section 5, "Token trees").

Each auxiliary row of the branch that supplied the drafts in hand returns its argmax (the chain's draft) and its
runner-ups with their probabilities (``decode/fixed.py: runner_ups``). A node of the tree is one of those tokens
at slot ``e`` following a path of earlier tokens; it stands when every token on its path is the exact one. The
adapter's probability of a slot's token was measured calibrated given that the path before it stood, whatever
ranks that path took (teacher-forced on the development prompts: the argmax after a runner-up hit 26% against a
predicted 30%, runner-ups 14% against 14%; ``docs/results/trees/tree_oracle.py``), so a node's chance is the
product of its path's probabilities, scaled by the budget's live calibration ratio.

The tree grows best-first (EAGLE-2's dynamic tree): the likeliest node not yet in it comes next, and the budget
keeps the prefix of that order whose expected tokens per cost are best. Expected accepted drafts are the sum of
the chances of the tree's nodes (a prefix-closed tree's accepted path holds exactly the nodes that stand). The
tree is then laid out as strands (``Strand``): a node continues its parent's strand when it is the parent's
likeliest child, and otherwise starts a strand that follows its parent's row.

What the PTP coupling allows: an auxiliary row predicts its slot given the uniforms and the context before the
window, not given another token at an earlier slot; a deeper slot's distribution still spreads over the
continuations of the earlier slot's alternatives (measured above), so any path of top-k tokens is a fair guess,
and the call verifies every row exactly (its token against the exact pick at its parent row): the accepted path
is always the exact sample. Windows (the next call's drafts) hang only at a strand's last token.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from .protocol import Strand
from .strands import TreeCosts

MAX_NODES = 32  # tree rows beside the chain per call


@dataclass(frozen=True)
class SlotCandidates:
    """The tokens a drafter offers per slot of its drafts in hand: ``tokens[j]`` / ``probs[j]`` for slot ``j + 1``,
    the argmax (the chain's draft) first, then the runner-ups."""

    tokens: tuple[tuple[int, ...], ...]
    probs: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class _Node:
    p: float
    depth: int  # drafts on the path to it (its slot)
    token: int
    parent: int  # index in the chosen list, or -1 - a for the chain's row at depth ``a``


def grow(
    n: int, p_reach: Sequence[float], cands: SlotCandidates, ratio: float, limit: int, max_depth: int
) -> list[_Node]:
    """Up to ``limit`` nodes beside a chain of ``n`` verified drafts (``p_reach[m]``: P(at least m stand),
    calibrated), best first; no node deeper than ``max_depth`` drafts."""
    # The order nodes leave the heap does not depend on the limit, so a shorter tree is a prefix of the longest:
    # one growth serves every limit the budget asks for while it weighs a call's shapes (and the calls ahead).
    return list(_grow(n, tuple(float(x) for x in p_reach), cands, float(ratio), max_depth)[: max(limit, 0)])


@lru_cache(maxsize=512)
def _grow(n: int, p_reach: tuple, cands: SlotCandidates, ratio: float, max_depth: int) -> tuple[_Node, ...]:
    # Best first over a heap keyed (-chance, batch, rank): ``batch`` -1 for the nodes off the chain, else the index
    # of the node whose children they are, ``rank`` the candidate's place in its slot (the order they were found:
    # equal chances leave in that order). Where a slot's chances fall rank by rank, a node's children enter one at
    # a time (the next sibling once one leaves): no better node ever waits behind one still outside, so the same
    # nodes leave in the same order as with every child pushed at once, in about half the heap's work (the budget
    # grows a tree for every chain length it weighs, on the path after each read).
    limit = MAX_NODES
    slots = min(len(cands.tokens), max_depth)
    scaled = [[min(0.99, q * ratio) for q in cands.probs[d]] for d in range(slots)]
    falling = [all(x >= y for x, y in zip(c, c[1:], strict=False)) for c in scaled]
    heap: list = []
    push, pop = heapq.heappush, heapq.heappop
    rank = 0
    for a in range(min(n, slots - 1) + 1):  # off the chain's row at depth a: the tokens at slot a + 1
        if a >= slots:
            break
        falls = p_reach[a] - (p_reach[a + 1] if a < n else 0.0)  # P(the chain reaches a and its next draft falls)
        for r, (tok, q) in enumerate(zip(cands.tokens[a], scaled[a], strict=True)):
            if a < n and r == 0:
                continue  # the chain's own draft
            p = min(p_reach[a] * q, falls)
            if p > 0.0:
                push(heap, (-p, -1, rank, a + 1, tok, -1 - a))
            rank += 1
    out: list[_Node] = []
    while heap and len(out) < limit:  # (MAX_NODES: every caller's limit is at most that)
        negp, batch, r, depth, token, parent = pop(heap)
        out.append(_Node(-negp, depth, token, parent))
        if batch >= 0 and falling[depth - 1] and r + 1 < len(scaled[depth - 1]):  # its next sibling
            p = out[batch].p * scaled[depth - 1][r + 1]
            if p > 0.0:
                push(heap, (-p, batch, r + 1, depth, cands.tokens[depth - 1][r + 1], batch))
        if depth < slots:  # its children: the first (the rest follow it), or all where the slot's chances do not fall
            me, toks = len(out) - 1, cands.tokens[depth]
            for k, q in enumerate(scaled[depth]):
                p = -negp * q
                if p > 0.0:
                    push(heap, (-p, me, k, depth + 1, toks[k], me))
                if falling[depth]:
                    break
    return tuple(out)


def layout(nodes: Sequence[_Node], widths: dict[int, int] | None = None) -> tuple[tuple[Strand, ...], list[int]]:
    """The strands of ``nodes`` (best first, each after its parent) and, per strand, the index of its last node.
    ``widths``: a window's width by the index of a strand's last node."""
    strands, last = _layout(tuple(nodes), tuple(sorted(widths.items())) if widths else ())
    return strands, list(last)


def _owners(nodes: Sequence[_Node]) -> list[int]:
    """Each node's strand, strands numbered in order of their first node: a node continues its parent's strand when
    the parent is that strand's last token so far (the parent's likeliest child), else starts one. A prefix of the
    nodes keeps its nodes' strands: its layout is this assignment restricted to it."""
    owner: list[int] = []
    tail: list[int] = []  # strand -> its last node so far
    for i, v in enumerate(nodes):
        s = owner[v.parent] if v.parent >= 0 else -1
        if s >= 0 and tail[s] == v.parent:
            tail[s] = i
        else:
            s = len(tail)
            tail.append(i)
        owner.append(s)
    return owner


@lru_cache(maxsize=1024)
def _layout(nodes: tuple[_Node, ...], widths: tuple) -> tuple[tuple[Strand, ...], tuple[int, ...]]:
    # (the same trees come back while the budget weighs a call's sizes and plans the calls ahead of a read)
    owner = _owners(nodes)
    strands: list[list] = []  # [at, tokens, parent strand]
    last: list[int] = []
    for i, v in enumerate(nodes):
        s = owner[i]
        if s == len(strands):
            strands.append([v.depth - 1, [v.token], owner[v.parent] if v.parent >= 0 else -1])
            last.append(i)
        else:
            strands[s][1].append(v.token)
            last[s] = i
    widths = dict(widths)
    out = tuple(
        Strand.trusted(at, tuple(toks), widths.get(last[k], 0), "ptp", parent)
        for k, (at, toks, parent) in enumerate(strands)
    )
    return out, tuple(last)


def choose_tree(
    n: int,
    p_reach: Sequence[float],
    cands: SlotCandidates,
    ratio: float,
    value: float,
    rows: int,
    c: TreeCosts,
    allowed: Callable[..., bool] = lambda lay, extra=0: True,
) -> tuple[tuple[Strand, ...], float]:
    """The adapter's tree beside a chain of ``n`` drafts in a call of ``rows`` rows whose expected tokens are
    ``value``: ``(strands, expected tokens they add)``, the best-first prefix with the best expected tokens per
    cost, then a window at the strands' last tokens where it pays; ``allowed(layout, extra)`` refuses a layout
    (``(at, tokens, width, parent)`` per strand, as ``layout`` lays them out: a graph the compile bank may not
    add) with ``extra`` rows of windows: then the best allowed smaller tree, or none."""
    limit = min(MAX_NODES, c.room - rows)
    nodes = grow(n, p_reach, cands, ratio, limit, c.remaining - 1) if limit > 0 else []
    if not nodes:
        return (), 0.0
    base = value / c.cost(rows)
    scored, gains, gain = [], [0.0], 0.0
    for k, v in enumerate(nodes, 1):
        gain += v.p
        gains.append(gain)
        scored.append(((value + gain) / c.cost(rows + k), k))
    best_k = max(scored)[1]
    # A path that ends on a node without a window leaves the next call no drafts: fewer nodes may leave the rows
    # for windows that are worth more (a few sizes below the best one without windows are tried).
    best, out = base, ((), 0.0)
    first = sorted({best_k, (3 * best_k + 3) // 4, (best_k + 1) // 2, (best_k + 3) // 4}, reverse=True)
    rest = [k for k in range(best_k - 1, 0, -1) if k not in first]  # only when no size above was allowed
    shape_of = _prefix_layouts(nodes)
    for k in first + [0] + rest:
        if k == 0:
            if out[0]:
                break
            continue
        lay = shape_of(k)
        if not allowed(lay):  # (asked of the layout alone: the strands are built for the sizes allowed only)
            continue
        chosen = nodes[:k]
        strands, last = layout(chosen)
        strands, total = _windows(chosen, strands, last, lay, value + gains[k], rows + k, c, allowed)
        score = total / c.cost(rows + sum(st.rows for st in strands))
        if score > best:
            best, out = score, (strands, total - value)
        if k in rest:
            break  # (the largest allowed one)
    return out


def tree_value(
    n: int, p_reach: Sequence[float], cands: SlotCandidates, ratio: float, strands: Sequence[Strand], c: TreeCosts
) -> float:
    """Expected tokens the given ``strands`` add beside a chain of ``n`` drafts, priced as ``grow`` prices its nodes
    (a token that is not among a slot's candidates: no chance) plus their windows: what a tree built ahead is worth
    once the call before it is read."""

    def q(depth: int, token: int) -> float:
        if depth > len(cands.tokens):
            return 0.0
        for tok, prob in zip(cands.tokens[depth - 1], cands.probs[depth - 1], strict=True):
            if tok == token:
                return min(0.99, prob * ratio)
        return 0.0

    chances: list[list[float]] = []  # per strand, each token's chance to stand
    total = 0.0
    for st in strands:
        a = st.at
        if st.parent < 0:
            falls = p_reach[a] - (p_reach[a + 1] if a < n and a + 1 < len(p_reach) else 0.0)
            p = min(p_reach[a] * q(a + 1, st.tokens[0]), falls)
        else:
            up = strands[st.parent]
            p = chances[st.parent][a - up.at - 1] * q(a + 1, st.tokens[0])
        mine = [p]
        for k, tok in enumerate(st.tokens[1:], 2):
            mine.append(mine[-1] * q(a + k, tok))
        chances.append(mine)
        total += sum(mine) + (mine[-1] * c.window(st.width) if st.width else 0.0)
    return total


def _prefix_layouts(nodes: Sequence[_Node]) -> Callable[[int], list[list[int]]]:
    """``shape(k)``: the layout ``layout`` gives the first ``k`` nodes, as ``[at, tokens, 0, parent]`` per strand,
    read off the whole list's assignment (``_owners``) in O(k)."""
    owner = _owners(nodes)

    def shape(k: int) -> list[list[int]]:
        out: list[list[int]] = []
        for i in range(k):
            s = owner[i]
            if s == len(out):
                v = nodes[i]
                out.append([v.depth - 1, 1, 0, owner[v.parent] if v.parent >= 0 else -1])
            else:
                out[s][1] += 1
        return out

    return shape


def _windows(nodes, strands, last, lay, value: float, rows: int, c: TreeCosts, allowed):
    """Windows at the strands' last tokens, the likeliest ends first, each only where its rows pay. Windows add
    auxiliary rows only, so each trial asks ``allowed`` about the same layout ``lay`` with more rows of windows."""
    widths: dict[int, int] = {}
    added = 0
    for i in sorted(last, key=lambda i: -nodes[i].p):
        if nodes[i].depth >= c.remaining - 1:
            continue  # (no token wanted after it; a strand's last node has no children: ``layout``)
        best_w, best = 0, value / c.cost(rows)
        for w in range(2, c.max_width + 1):
            if rows + w > c.room or nodes[i].depth + w > c.remaining:
                break
            score = (value + nodes[i].p * c.window(w)) / c.cost(rows + w)
            if score > best:
                best_w, best = w, score
        if best_w and allowed(lay, added + best_w):
            widths[i] = best_w
            added += best_w
            value += nodes[i].p * c.window(best_w)
            rows += best_w
    return (layout(nodes, widths)[0] if widths else strands), value
