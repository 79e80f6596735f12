"""Shapes the budget has used before, preferred over new ones (docs/method.md, section 5, "Shapes").

Each call's graph is compiled once per attention bucket for its row counts (``graph``: token rows, chain drafts,
auxiliary rows; which rows see which are inputs of the graph, ``decode/fixed.py: topology``), and the first calls
of new counts run eagerly and then trace it: about three plain steps' worth of time once, on this CPU. The
budget's greedy allocation, left alone, meets new counts on many calls of an answer (the confidences differ a
little each time), so an answer paid for tracing on many of its calls. ``ShapeMemory`` keeps the shapes used so
far and the graphs they compiled; the budget then takes the best known shape unless the new one is worth more
than its tracing (``NOVELTY`` plain steps added to its price when its graph is new), so the graphs in use settle on
a few.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

NOVELTY = 0.5  # plain steps added to the price of a shape never used (a share of its eager call and tracing)
CHAINED = 0.15  # plain steps a call built ahead saves (its plan, build and queueing are off the path: ~5 ms here)
MAX_SHAPES = 48  # graphs; past this many, only known ones (the compile bank keeps 256 entries across buckets)
MAX_TREE_SHAPES = 24  # graphs of token trees (a chain with side strands); past this many, only known ones
USUAL_KEEP = 0.9  # how much of its weight each shape chosen after a branch of some width keeps per later choice
USUAL_MIN = 1.5  # the weight a shape needs (about two choices) before a guess ahead of the read takes it

Shape = tuple[int, tuple[tuple[int, int], ...]]  # (drafts verified, ((depth, width), ...))
Graph = tuple[int, int, int]  # (token rows, chain drafts as the graph counts them, auxiliary rows)


def graph(n: int, branches, strands: Sequence = ()) -> Graph:
    """The row counts that key a call's compiled graph (``CallShape.graph_key``): token rows, the leading rows that
    each follow the row before (the chain, and strands that continue it), auxiliary rows."""
    return layout_graph(n, branches, tuple((st.at, len(st.tokens), st.width, st.parent) for st in strands))


def layout_graph(n: int, branches, layout: Sequence[tuple[int, int, int, int]]) -> Graph:
    """``graph`` of strands given by their layout, ``(at, tokens, width, parent)`` each: plain arithmetic over
    ``DraftPlan.strand_row`` and ``follows``, no plan nor strand built (the budget asks it of thousands of candidate
    trees a call where rows are cheap)."""
    rows = 1 + n  # token rows so far: the strands' first rows follow
    chain, run = n, True
    starts: list[int] = []  # each strand's first token row
    aux = sum(int(w) for _, w in branches)
    for at, k, width, up in layout:
        starts.append(rows)
        if run:  # (strands laid out right after the run so far, following its last row, continue it)
            follows = at if up < 0 else starts[up] + at - layout[up][0] - 1
            run = rows == chain + 1 and follows == chain
            if run:
                chain += k
        rows += k
        aux += width
    return rows, chain, aux


def shape_value(n: int, branches, p_reach: Sequence[float], survival: Callable[[int], float]) -> float:
    """Expected tokens of a call verifying ``n`` drafts (``p_reach[m]``: P(at least m stand)) with ``branches``
    ``[(d, w)]``: the tokens it emits, plus each branch's drafts for the next call weighed by the chance the path
    ends at ``d`` and that they stand (``survival(k)``: P(k drafts of a fresh branch stand)); as ``Budget.choose``
    counts it, row by row."""
    return Values(p_reach, survival)(n, branches)


class Values:
    """``shape_value`` of many shapes under one ``p_reach`` (``ShapeMemory.prefer`` scores every known shape on the
    host path after a read): the prefix sums and each width's survival sum are computed once, in plain floats."""

    def __init__(self, p_reach: Sequence[float], survival: Callable[[int], float]):
        self.p = [float(x) for x in p_reach]
        self.cum = [0.0]
        for x in self.p[1:]:
            self.cum.append(self.cum[-1] + x)
        self.survival, self.sums = survival, {}

    def __call__(self, n: int, branches) -> float:
        p = self.p
        value = 1.0 + self.cum[min(n, len(self.cum) - 1)]
        for d, w in branches:
            value += (p[d] - (p[d + 1] if d < n else 0.0)) * self.window(w)
        return value

    def window(self, w: int) -> float:
        """Expected accepted drafts of a fresh ``w``-row window (its first row is the exact token)."""
        s = self.sums.get(w)
        if s is None:
            s = self.sums[w] = sum(self.survival(k) for k in range(1, w))
        return s


class ShapeMemory:
    """The (drafts, branches) shapes a budget has chosen, with how often, and the graphs its calls compiled."""

    def __init__(self) -> None:
        self.used: dict[Shape, int] = {}
        self.graphs: set[Graph] = set()  # every call's row counts (a compiled graph each)
        self.tree_graphs: set[Graph] = set()  # those of token trees
        self.trees: dict[tuple, int] = {}  # (drafts, branches, ((at, tokens, width, parent), ...)) -> calls
        self.after: dict[int, dict[Shape, float]] = {}  # drafts in hand -> shapes chosen then, faded weights

    def note_after(self, in_hand: int, n: int, branches) -> None:
        """The budget chose ``(n, branches)`` with ``in_hand`` of the adapter's drafts in hand (a branch of the call
        before): what a guess ahead of the next such read takes (``usual``)."""
        seen = self.after.setdefault(in_hand, {})
        for k in seen:
            seen[k] *= USUAL_KEEP
        key = (n, tuple(tuple(b) for b in branches))
        seen[key] = seen.get(key, 0.0) + 1.0

    def usual(self, in_hand: int) -> Shape | None:
        """The shape most often chosen lately with ``in_hand`` drafts in hand, once chosen about twice (None: none
        yet). The choice after a read follows the drafts' real confidences, which a guess before it has not seen:
        a guess of this shape is confirmed more often than the choice on prior confidences (which nearly never
        drafts a branch at the first draft, where a low real confidence makes one pay)."""
        seen = self.after.get(in_hand)
        if not seen:
            return None
        shape, weight = max(seen.items(), key=lambda kv: kv[1])
        return shape if weight >= USUAL_MIN else None

    @staticmethod
    def _tree_key(n: int, branches, strands) -> tuple:
        return (
            n,
            tuple(tuple(b) for b in branches),
            tuple((st.at, len(st.tokens), st.width, st.parent) for st in strands),
        )

    def allows_tree(self, n: int, branches, strands, extra: int = 0) -> bool:
        """Whether a call of this token tree may run: its graph compiled before, or a new one while fewer than
        ``MAX_TREE_SHAPES`` tree graphs are known. ``extra``: auxiliary rows added to the strands' windows (the
        token rows, so the rest of the graph's key, stay as they are)."""
        return self.allows_layout(
            n, branches, tuple((st.at, len(st.tokens), st.width, st.parent) for st in strands), extra
        )

    def allows_layout(self, n: int, branches, layout, extra: int = 0) -> bool:
        """``allows_tree`` for strands given by their layout, ``(at, tokens, width, parent)`` each."""
        tok, chain, aux = layout_graph(n, branches, layout)
        return (tok, chain, aux + extra) in self.graphs or len(self.tree_graphs) < MAX_TREE_SHAPES

    def note_tree(self, n: int, branches, strands) -> None:
        key = self._tree_key(n, branches, strands)
        self.trees[key] = self.trees.get(key, 0) + 1
        g = graph(n, branches, strands)
        if g not in self.graphs:
            self.graphs.add(g)
            self.tree_graphs.add(g)

    def note(self, n: int, branches) -> None:
        key = (n, tuple(tuple(b) for b in branches))
        self.used[key] = self.used.get(key, 0) + 1
        self.graphs.add(graph(n, key[1]))

    def known(self, n: int, branches) -> bool:
        """Whether a call of this shape runs a graph compiled before (its row counts met already)."""
        return graph(n, branches) in self.graphs

    def prefer(self, n: int, branches, p_reach, survival, cost: Callable[[int], float], fits, built=None) -> Shape:
        """``(n, branches)`` if its graph is known or it is worth its novelty; otherwise the known shape with the
        best expected tokens per cost among those ``fits`` accepts (drafts in hand, rows left). ``built``: the
        shape already built for this call (chained on the one before), which costs ``CHAINED`` steps less (no host
        work on the path)."""
        branches = tuple(tuple(b) for b in branches)
        known = self.known(n, branches) or not self.used
        if built is None and known:
            return n, branches

        value = Values(p_reach, survival)

        def score(shape: Shape, extra: float = 0.0) -> float:
            k, br = shape
            if shape == built:
                extra -= CHAINED
            return value(k, br) / (cost(1 + k + sum(w for _, w in br)) + extra)

        best, best_score = (n, branches), score((n, branches), 0.0 if known else NOVELTY)
        if len(self.graphs) >= MAX_SHAPES and not known:
            best, best_score = None, -1.0
        for shape in list(self.used) + ([built] if built is not None else []):
            if fits(*shape):
                s = score(shape)
                if s > best_score:
                    best, best_score = shape, s
        return best if best is not None else (n, branches)
