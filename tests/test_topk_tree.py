"""The adapter's top-k token tree (``ptp_mlx/drafting/topk_tree.py``): best-first nodes, their layout as strands of
strands, and what the budget keeps at a cost."""

import math

import numpy as np

from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.protocol import DraftPlan
from ptp_mlx.drafting.rows import reach
from ptp_mlx.drafting.strands import TreeCosts
from ptp_mlx.drafting.topk_tree import MAX_NODES, SlotCandidates, _prefix_layouts, choose_tree, grow, layout

# Three slots in hand: the argmax first (the chain's drafts 10, 20, 30), then two runner-ups each.
CANDS = SlotCandidates(((10, 11, 12), (20, 21, 22), (30, 31, 32)), ((0.6, 0.3, 0.1), (0.5, 0.4, 0.1), (0.7, 0.2, 0.1)))


def _costs(per_row: float, room: int = 64, remaining: int = 100, window: float = 0.5) -> TreeCosts:
    return TreeCosts(lambda rows: 1.0 + per_row * (rows - 1), lambda w: window * max(0, w - 1), 4, room, remaining)


def test_nodes_grow_best_first_with_their_paths_chances():
    p = reach([0.6, 0.5], 1.0)  # a chain of two drafts: P(reach 0, 1, 2) = 1, 0.6, 0.3
    nodes = grow(2, p, CANDS, 1.0, 50, 10)
    chances = [v.p for v in nodes]
    assert chances == sorted(chances, reverse=True)
    first = {(v.depth, v.token): v for v in nodes if v.parent < 0}
    # Off the chain: the runner-ups of slots 1 and 2 (capped by the chance the chain's draft falls there), and at
    # slot 3, after the chain's last draft, its argmax too; never the chain's own drafts.
    assert set(first) == {(1, 11), (1, 12), (2, 21), (2, 22), (3, 30), (3, 31), (3, 32)}
    assert math.isclose(first[(1, 11)].p, 0.3) and math.isclose(first[(2, 21)].p, min(0.6 * 0.4, 0.6 - 0.3))
    assert math.isclose(first[(3, 30)].p, 0.3 * 0.7)
    for v in nodes:  # a node's chance is its parent's times its slot's probability
        if v.parent >= 0:
            up = nodes[v.parent]
            q = dict(zip(CANDS.tokens[v.depth - 1], CANDS.probs[v.depth - 1], strict=True))[v.token]
            assert v.depth == up.depth + 1 and math.isclose(v.p, up.p * q)
    assert max(v.depth for v in grow(2, p, CANDS, 1.0, 50, 2)) == 2  # no deeper than the tokens wanted allow
    assert len(grow(2, p, CANDS, 1.0, 5, 10)) == 5


def test_layout_makes_strands_of_strands_a_plan_accepts():
    p = reach([0.6, 0.5], 1.0)
    nodes = grow(2, p, CANDS, 1.0, 20, 10)
    strands, last = layout(nodes)
    plan = DraftPlan([10, 20], [(0, 2)], strands=strands)  # (the plan checks every parent and depth)
    assert sum(len(st.tokens) for st in strands) == len(nodes) and any(st.parent >= 0 for st in strands)
    assert [nodes[i].token for i in last] == [st.tokens[-1] for st in strands]
    # Every node's path is on the plan: its tokens after ``last`` are the path's drafts.
    paths = {tuple(plan.path_drafts(k, m)) for k, st in enumerate(strands) for m in range(1, len(st.tokens) + 1)}
    for v in nodes:
        path, j = [v.token], v.parent
        while j >= 0:
            path.insert(0, nodes[j].token)
            j = nodes[j].parent
        chain_row = -1 - j
        assert tuple([10, 20][:chain_row] + path) in paths


def test_every_prefix_layout_is_the_layout_of_that_prefix():
    # ``choose_tree`` asks the compile bank about a prefix's layout before it builds the prefix's strands: the layout
    # it reads off must be the one ``layout`` gives that prefix (else it would ask about another graph)
    rng = np.random.default_rng(3)
    for _ in range(200):
        slots = int(rng.integers(2, 6))
        toks = tuple(tuple(int(t) for t in rng.choice(100, 4, replace=False)) for _ in range(slots))
        probs = tuple(tuple(sorted(rng.dirichlet(np.ones(5))[:4].tolist(), reverse=True)) for _ in range(slots))
        n = int(rng.integers(0, slots))
        nodes = grow(n, reach([q[0] for q in probs[:n]], 1.0), SlotCandidates(toks, probs), 1.0, MAX_NODES, 10)
        shape = _prefix_layouts(nodes)
        for k in range(len(nodes) + 1):
            strands, _ = layout(nodes[:k])
            assert shape(k) == [[st.at, len(st.tokens), 0, st.parent] for st in strands]


def _grow_every_child_at_once(n, p_reach, cands, ratio, max_depth):
    """The reference ``grow``: every child pushed as its parent leaves, ties in the order found."""
    import heapq

    slots, heap, out, tick = min(len(cands.tokens), max_depth), [], [], 0
    for a in range(min(n, slots - 1) + 1):
        falls = p_reach[a] - (p_reach[a + 1] if a < n else 0.0)
        for r, (tok, q) in enumerate(zip(cands.tokens[a], cands.probs[a], strict=True)):
            p = min(p_reach[a] * min(0.99, q * ratio), falls)
            if not (a < n and r == 0) and p > 0.0:
                heapq.heappush(heap, (-p, tick, a + 1, tok, -1 - a))
                tick += 1
    while heap and len(out) < MAX_NODES:
        negp, _, depth, token, parent = heapq.heappop(heap)
        out.append((-negp, depth, token, parent))
        for tok, q in zip(cands.tokens[depth], cands.probs[depth], strict=True) if depth < slots else ():
            if -negp * min(0.99, q * ratio) > 0.0:
                heapq.heappush(heap, (negp * min(0.99, q * ratio), tick, depth + 1, tok, len(out) - 1))
                tick += 1
    return out


def test_grow_leaves_the_nodes_in_the_order_every_child_at_once_would():
    # ``grow`` lets a node's children in one at a time where a slot's chances fall rank by rank: the same nodes in
    # the same order, ties included (capped chances, equal probabilities, zeros), and slots that do not fall
    rng = np.random.default_rng(11)
    for trial in range(400):
        slots = int(rng.integers(1, 7))
        probs = []
        for _ in range(slots):
            q = sorted(rng.choice([0.0, 0.05, 0.2, 0.2, 0.5, 0.9], 4).tolist(), reverse=True)
            probs.append(tuple(q if trial % 3 else rng.permutation(q).tolist()))  # (a third not falling)
        toks = tuple(tuple(int(t) for t in rng.choice(50, 4, replace=False)) for _ in range(slots))
        cands = SlotCandidates(toks, tuple(probs))
        n = int(rng.integers(0, slots))
        ratio = float(rng.choice([1.0, 1.5, 3.0]))
        p = tuple(reach([q[0] for q in probs[:n]], ratio))
        depth = int(rng.integers(1, 8))
        got = [(v.p, v.depth, v.token, v.parent) for v in grow(n, p, cands, ratio, MAX_NODES, depth)]
        assert got == _grow_every_child_at_once(n, p, cands, ratio, depth)


def test_free_rows_take_the_whole_tree_and_dear_rows_none():
    p = reach([0.6, 0.5], 1.0)
    everything = len(grow(2, p, CANDS, 1.0, MAX_NODES, 99))
    whole, _ = choose_tree(2, p, CANDS, 1.0, 2.0, 5, _costs(0.0, window=0.0))  # windows worth nothing: every node
    assert sum(len(st.tokens) for st in whole) == everything and not any(st.width for st in whole)
    free, gain = choose_tree(2, p, CANDS, 1.0, 2.0, 5, _costs(0.0))
    # windows where a path may end, paid for with the least likely nodes when the rows run out
    assert any(st.width for st in free) and sum(len(st.tokens) for st in free) >= everything // 2 and gain > 0.5
    assert choose_tree(2, p, CANDS, 1.0, 2.0, 5, _costs(1.0)) == ((), 0.0)
    some, _ = choose_tree(2, p, CANDS, 1.0, 2.0, 5, _costs(0.05))
    assert 0 < sum(len(st.tokens) for st in some) < sum(len(st.tokens) for st in free)
    small, _ = choose_tree(2, p, CANDS, 1.0, 2.0, 5, _costs(0.0, room=9))
    assert sum(st.rows for st in small) <= 4  # the call's rows stay within the room
    # A layout the compile bank may not take is refused: a smaller one, or none.
    assert choose_tree(2, p, CANDS, 1.0, 2.0, 5, _costs(0.0), allowed=lambda st, extra=0: False) == ((), 0.0)
    one, _ = choose_tree(2, p, CANDS, 1.0, 2.0, 5, _costs(0.0), allowed=lambda st, extra=0: len(st) <= 1)
    assert len(one) == 1


def test_the_budget_verifies_a_tree_beside_its_chain_when_rows_are_cheap():
    b = Budget(CostCurve([1, 64], [1.0, 1.0]), max_width=4)
    plan = b.rows_for([10, 20, 30], [0.6, 0.5, 0.7], 100, 64, candidates=CANDS)
    assert plan.strands and sum(len(st.tokens) for st in plan.strands) >= 8
    dear = Budget(CostCurve([1, 2, 64], [1.0, 2.0, 64.0]), max_width=4)
    assert not dear.rows_for([10, 20, 30], [0.6, 0.5, 0.7], 100, 64, candidates=CANDS).strands
