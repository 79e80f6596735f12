"""The budget's shape memory (``ptp_mlx/drafting/shapes.py``): the value it weighs a shape by is the one the greedy
allocation builds, known shapes are preferred unless a new one is worth its tracing, and over many calls with
confidences that wander the shapes in use stay few; the pace guard sees cold calls at their real time."""

import numpy as np

from ptp_mlx.decode.call import call_shape
from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.protocol import DraftPlan, Strand
from ptp_mlx.drafting.rows import reach
from ptp_mlx.drafting.shapes import NOVELTY, ShapeMemory, graph, shape_value


def test_shape_value_is_what_choose_counts():
    b = Budget.from_histogram(CostCurve([1, 64], [1.0, 1.0]), [1, 2, 3, 4, 5], max_width=6)
    for conf in ([0.9, 0.8, 0.5], [0.3], [], [0.99] * 5):
        n, branches = b.choose(conf, 64)
        p = reach(conf, b.ratio)
        v = shape_value(n, branches, p, b.survive)
        # choose's own running value: 1 + reach of the verified drafts + each branch's added rows' gains
        want = 1.0 + sum(p[1 : n + 1])
        for d, w in branches:
            p_end = p[d] - (p[d + 1] if d < n else 0.0)
            want += p_end * sum(b.survive(k) for k in range(1, w))
        assert np.isclose(v, want)


def test_a_known_shape_wins_unless_the_new_one_is_worth_its_novelty():
    mem = ShapeMemory()
    cost = CostCurve([1, 64], [1.0, 1.0 + 0.05 * 63])
    p = reach([0.8, 0.6, 0.4])
    s = lambda k: 0.5**k  # noqa: E731
    always = lambda k, br: True  # noqa: E731
    assert mem.prefer(2, [(2, 3)], p, s, cost, always) == (2, ((2, 3),))  # nothing known: take it
    mem.note(2, [(2, 3)])
    assert mem.prefer(2, [(2, 4)], p, s, cost, always) == (2, ((2, 3),))  # a small gain is not worth tracing
    assert mem.prefer(2, [(2, 3)], p, s, cost, always) == (2, ((2, 3),))
    # A much better shape (six sure drafts instead of two) is taken even though it is new.
    sure = reach([0.99] * 6)
    got = mem.prefer(6, [(6, 3)], sure, s, CostCurve([1, 64], [1.0, 1.0]), always)
    assert got == (6, ((6, 3),))
    # A known shape that does not fit (more drafts than in hand) is never offered.
    assert mem.prefer(1, [(1, 2)], p, s, cost, lambda k, br: k <= 1) == (1, ((1, 2),))
    assert NOVELTY > 0


def test_shapes_settle_on_a_few_over_many_calls():
    rng = np.random.default_rng(0)
    curve = CostCurve([1, 2, 4, 8, 16, 64], [1.0, 1.05, 1.15, 1.4, 2.0, 6.0])
    free = Budget.from_histogram(curve, [1, 2, 3, 3, 3, 2, 1], max_width=8)
    free.shapes.prefer = lambda n, br, *a: (n, tuple(map(tuple, br)))  # the greedy choice alone, for comparison
    kept = Budget.from_histogram(curve, [1, 2, 3, 3, 3, 2, 1], max_width=8)
    raw, settled = set(), set()
    for _ in range(300):
        k = int(rng.integers(0, 8))
        conf = list(rng.uniform(0.2, 0.95, size=k))
        a = free.rows_for([7] * k, conf, 200, 64)
        b = kept.rows_for([7] * k, conf, 200, 64)
        raw.add((len(a.drafts), a.branches))
        settled.add((len(b.drafts), b.branches))
    assert len(settled) <= len(raw) // 2, (len(settled), len(raw))


def test_the_pace_guard_counts_cold_calls_and_the_curve_takes_them_as_bounds_only():
    class Learning(CostCurve):
        step_seconds = 0.05
        seen: list = []
        bounds: list = []

        def observe(self, rows, seconds, cold=False):
            (self.bounds if cold else self.seen).append(rows)

    b = Budget(Learning([1, 64], [1.0, 3.0]), calibrate=True)
    for _ in range(3):
        b.record(4, 2, 0.5, cold=True)  # tracing: ten steps' time for two tokens
    # not a price of 4 rows (an upper bound at most: ``LearnedCost``), but the answer paid it
    assert Learning.seen == [] and Learning.bounds == [4, 4, 4] and b.behind()
    b.guard.clear()
    for _ in range(3):
        b.record(4, 4, 0.5)  # a warm call this slow is a spike: capped at 3x its expected time
    assert Learning.seen == [4, 4, 4] and not b.behind()


def test_a_known_priming_shape_never_replaces_verifying_the_drafts_in_hand():
    # Measured on held-out prompts: with this machine's learnt curve (3 rows 1.28 steps, 6 rows 1.73), the priming
    # shape (no draft, one 2-row branch) was the only known one and outscored every new shape (novelty, chained);
    # its branch's value is the next call's verifying, which again preferred it: no draft was ever verified.

    curve = CostCurve([1, 2, 3, 4, 6, 8, 64], [1.0, 1.28, 1.28, 1.57, 1.73, 2.2, 12.0])
    b = Budget.from_histogram(curve, [3, 3, 2, 1, 1], max_width=8)
    b.shapes.note(0, [(0, 2)])
    pending = DraftPlan((), ((0, 2),))
    for drafts, conf in (([5, 6, 7], [0.5] * 3), ([5], [0.89])):
        plan = b.rows_for(drafts, conf, 100, 1000, pending=pending)
        assert plan.drafts, plan
        plan = b.rows_for(drafts, conf, 100, 1000)
        assert plan.drafts, plan


def test_the_usual_shape_after_a_branch_is_the_one_chosen_lately():
    mem = ShapeMemory()
    assert mem.usual(2) is None
    mem.note_after(2, 2, [(0, 3)])
    assert mem.usual(2) is None  # chosen once: not yet usual
    mem.note_after(2, 2, [(0, 3)])
    assert mem.usual(2) == (2, ((0, 3),))
    assert mem.usual(3) is None  # kept per count of drafts in hand
    for _ in range(8):  # the choices move on: the old shape fades
        mem.note_after(2, 1, [(0, 4)])
    assert mem.usual(2) == (1, ((0, 4),))


def test_a_guess_ahead_takes_the_usual_shape_the_read_then_keeps():
    # The prior's choice (average confidences) rarely drafts a branch at the first draft; after the read, a low
    # first confidence makes one pay. A guess that takes the shape usually chosen with that many drafts in hand is
    # the one the read keeps (it counts the call built ahead as cheaper).
    b = Budget.from_histogram(CostCurve([1, 64], [1.0, 1.0 + 0.1 * 63]), [3, 3, 2, 1, 1], max_width=6)
    b.shapes.note(3, [])  # both shapes compiled already (known shapes are preferred: not what is tested here)
    b.shapes.note(3, [(0, 3)])
    real = [0.3, 0.9, 0.9]
    prior = b.prior_confidences(3)
    chosen = b.rows_for([5, 6, 7], real, 100, 64, source="ptp")
    ahead = b.rows_for([0, 0, 0], prior, 100, 64, preview=True, source="ptp")
    assert (len(ahead.drafts), ahead.branches) != (len(chosen.drafts), chosen.branches)  # the case at hand
    b.rows_for([5, 6, 7], real, 100, 64, source="ptp")  # chosen twice: usual now
    ahead = b.rows_for([0, 0, 0], prior, 100, 64, preview=True, source="ptp")
    assert (len(ahead.drafts), ahead.branches) == (len(chosen.drafts), chosen.branches)
    built = DraftPlan((5, 6, 7)[: len(ahead.drafts)], ahead.branches)
    kept = b.rows_for([5, 6, 7], real, 100, 64, pending=built, source="ptp")
    assert (kept.drafts, kept.branches) == (built.drafts, built.branches)
    # other drafters' chains (no source, or lookup's) neither teach nor take it
    other = b.rows_for([0, 0, 0], prior, 100, 64, preview=True)
    assert (len(other.drafts), other.branches) != (len(chosen.drafts), chosen.branches)


def _random_tree(rng) -> DraftPlan:
    """A chain with branches and strands (some continuing the chain's run, some of strands), laid out at random."""
    n = int(rng.integers(0, 5))
    branches = [(d, int(rng.integers(1, 4))) for d in range(n + 1) if rng.random() < 0.4]
    strands: list[Strand] = []
    for _ in range(int(rng.integers(0, 6))):
        k, w = int(rng.integers(1, 4)), int(rng.choice([0, 0, 2, 3]))
        if strands and rng.random() < 0.5:
            parent = int(rng.integers(0, len(strands)))
            up = strands[parent]
            at = int(rng.integers(up.at + 1, up.depth + 1))
        else:
            parent, at = -1, int(rng.choice([n, int(rng.integers(0, n + 1))]))
        strands.append(Strand(at, tuple(range(k)), w, parent=parent))
    return DraftPlan(tuple(range(n)), branches, strands=strands)


def test_a_trees_graph_counts_are_its_call_shapes():
    # ``graph`` counts rows without building a plan (the budget asks it of every candidate tree): it must name the
    # graph the call really runs, whose chain counts every strand that continues the run right after it
    rng = np.random.default_rng(7)
    continued = 0
    for _ in range(2000):
        plan = _random_tree(rng)
        shape = call_shape(plan)
        tok, chain, aux = graph(len(plan.drafts), plan.branches, plan.strands)
        assert (tok, chain, aux) == (shape.n_tok, shape.n_drafts, shape.n_aux), plan
        continued += chain > len(plan.drafts)
    assert continued > 100  # (the run through strands was exercised)
