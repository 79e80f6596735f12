"""The budget's token trees (docs/method.md, section 5, "What the budget keeps"): the adapter's top-k tree
(``topk_tree``) and the strands other peers offer (``strands``), beside a chain the budget chose, where their rows
pay at this machine's cost; and whether a tree is worth giving up the call built ahead for the chain alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .protocol import DraftPlan
from .rows import reach
from .shapes import CHAINED, Values
from .strands import TreeCosts, choose_strands
from .topk_tree import MAX_NODES, SlotCandidates, choose_tree, grow, tree_value


def tree_nodes(b, confidences: list[float], candidates: SlotCandidates, remaining: int) -> Callable[[int], list[float]]:
    """``tree(n)`` for ``Budget.choose``: the chances of the adapter's tree nodes beside a chain of ``n`` drafts,
    best first."""

    def nodes(n: int) -> list[float]:
        p = reach(confidences[:n], b.ratio)
        return [v.p for v in grow(n, p, candidates, b.ratio, MAX_NODES, remaining - 1)]

    return nodes


def with_tree(b, plan: DraftPlan, confidences, offers, remaining: int, room: int, candidates=None, chained=False):
    """``(plan with its tree, expected tokens the tree adds)`` for budget ``b``: the adapter's top-k tree and the
    offered strands whose rows pay; a tree graph never compiled is taken only while fewer than
    ``MAX_TREE_SHAPES`` are known (the compile bank stays bounded). ``chained``: the plan's call was built ahead,
    so the chain alone costs ``CHAINED`` steps less. Nothing is noted (the caller notes the plan it takes)."""
    n = len(plan.drafts)
    p = reach(confidences[:n], b.ratio)
    values = Values(p, b.survive)
    cost = b.curve
    if chained:  # the chain alone costs less by the host time its chained call keeps off the path

        def cost(r: int, curve=b.curve, alone=plan.rows) -> float:
            return curve(r) - (CHAINED if r == alone else 0.0)

    costs = TreeCosts(cost, values.window, b.max_width, min(room, b.max_rows), remaining)
    value, rows = values(n, plan.branches), plan.rows
    strands: tuple = ()
    if candidates is not None:
        allowed = lambda lay, extra=0: b.shapes.allows_layout(n, plan.branches, lay, extra)  # noqa: E731
        strands, gain = choose_tree(n, p, candidates, b.ratio, value, rows, costs, allowed)
        value, rows = value + gain, rows + sum(st.rows for st in strands)
    if offers:
        taken = {(st.at, st.tokens[0]) for st in strands if st.parent < 0}
        more = choose_strands(plan.drafts, p, value, rows, offers, costs, taken)
        if more and b.shapes.allows_tree(n, plan.branches, strands + more):
            strands = strands + more
    if not strands or not b.shapes.allows_tree(n, plan.branches, strands):
        return plan, 0.0
    return replace(plan, strands=strands), value - values(n, plan.branches)


def tree_call(
    b, plan: DraftPlan, confidences, offers, remaining, room, candidates, chained, alt=None, pending=None, preview=False
) -> DraftPlan:
    """The call budget ``b`` makes of ``plan``: with its tree where one pays (noted in the shape memory unless
    ``preview``). The best expected tokens per cost among: ``plan`` with its tree (``chained``: ``plan``'s call was
    built ahead, so the chain alone costs ``CHAINED`` steps less); ``alt``, the allocation that left rows for a
    tree before a known shape replaced it, with its tree; and ``pending``, the call built ahead with a tree whose
    tokens were just read, at ``CHAINED`` steps less."""
    built = pending if chained and pending is not None and pending.strands and candidates is not None else None
    options: list[tuple[float, DraftPlan]] = []
    for base, bonus in ((plan, chained and built is None), (alt, False)):
        if base is None:
            continue
        tree, gain = with_tree(b, base, confidences, offers, remaining, room, candidates, bonus)
        off = CHAINED if bonus and not tree.strands else 0.0
        options.append(((_worth(b, base, confidences) + gain) / (b.curve(tree.rows) - off), tree))
    if built is not None:
        n = len(plan.drafts)
        p = reach(confidences[:n], b.ratio)
        c = TreeCosts(b.curve, Values(p, b.survive).window, b.max_width, min(room, b.max_rows), remaining)
        kept = _worth(b, plan, confidences) + tree_value(n, p, candidates, b.ratio, built.strands, c)
        options.append((kept / (b.curve(built.rows) - CHAINED), replace(plan, strands=built.strands)))
    tree = max(options, key=lambda o: o[0])[1]  # (the first of equals: ``plan``'s)
    if tree.strands and not preview:
        b.shapes.note_tree(len(tree.drafts), tree.branches, tree.strands)
    return tree


def _worth(b, plan: DraftPlan, confidences) -> float:
    """Expected tokens of ``plan``'s chain and branches."""
    n = len(plan.drafts)
    return Values(reach(confidences[:n], b.ratio), b.survive)(n, plan.branches)
