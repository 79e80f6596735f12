"""The adapter's chain drafter (``ptp_mlx/drafting/chain.py``): its drafts come from the branch that stood, and
drafting that delivers less than plain steps gives way to an autoregressive burst."""

from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.chain import ChainDrafter
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.fixed_budget import FixedBudget
from ptp_mlx.drafting.protocol import CallResult, DraftPlan, Strand


def test_drafting_that_delivers_less_than_plain_steps_gives_way_to_a_burst():
    from ptp_mlx.drafting.rows import Pace

    budget = Budget(CostCurve([1, 64], [1.0, 64.0]), max_width=4, calibrate=True, survival=[1.0, 0.99, 0.98, 0.97])
    d = ChainDrafter(budget)
    d.drafts, d.conf = [5, 6], [0.99, 0.99]
    assert not d.plan(0, 100, 100).burst  # the prediction says drafting pays
    plan = DraftPlan([5, 6], [(0, 2), (1, 2), (2, 2)])
    for _ in range(3):  # three calls of 9 rows (cost 9 plain steps each) that delivered 1 token each
        d.update(plan, CallResult([], 0, [1] * 6, [0.99] * 6))
        d.drafts, d.conf = [5, 6], [0.99, 0.99]
    assert d.plan(3, 100, 100).burst  # what was delivered overrules the prediction
    assert d.pace == Pace()  # and the next episode starts afresh


def test_chain_drafts_come_from_the_branch_that_stood_and_fixed_budgets_guess_ahead():
    d = ChainDrafter(FixedBudget(2, max_width=4))
    plan = DraftPlan([5, 6], [(0, 3), (1, 3), (2, 3)])
    aux = [10, 11, 12, 20, 21, 22, 30, 31, 32]
    d.update(plan, CallResult([6, 9], 1, aux, [0.5] * 9))
    assert d.drafts == [21, 22] and d.conf == [0.5, 0.5]  # branch 1, slots 1.. (slot 0 is the exact token)
    nxt = d.plan(2, 100, 100)
    assert nxt.drafts == (21, 22) and nxt.source == "ptp"
    # A fixed budget's next call has the same rows whatever is accepted: known before the read.
    for accepted in range(3):
        g = d.guess(plan, accepted, 2, 100, 100)
        assert g is not None and g.plan.branches == nxt.branches
        assert [aux[r] for r in g.draft_rows] == aux[3 * accepted + 1 : 3 * accepted + 3]
    assert ChainDrafter(Budget(CostCurve(), max_width=4)).guess(plan, 0, 2, 100, 100) is None  # adaptive: unknown


def test_a_guess_built_ahead_is_committed_as_planned_unless_the_budget_would_not_draft():
    """``ChainDrafter.commit``: the adaptive budget's call built ahead runs as the next plan (its confidences kept
    for the calibration after the read, its shape noted as used but not as a choice after a read); refused when
    its drafts are not the ones in hand, when drafting delivered less than plain steps, or for a fixed budget."""
    from ptp_mlx.drafting.rows import Pace

    budget = Budget(CostCurve([1, 64], [1.0, 1.0]), max_width=4, calibrate=True)
    d = ChainDrafter(budget)
    d.drafts, d.conf = [5, 6, 7], [0.9, 0.8, 0.7]
    plan = DraftPlan([5, 6], [(0, 2), (2, 3)], source="ptp")
    assert d.commit(plan, 0) is plan
    assert d.planned == [0.9, 0.8, 0.7] and budget.shapes.used[(2, ((0, 2), (2, 3)))] == 1
    assert budget.shapes.usual(3) is None  # (a guess takes the usual shape: it never teaches it)
    d.update(plan, CallResult([5, 6, 9], 2, [1] * 7, [0.5] * 7))
    assert budget.hits > 0  # the committed call's drafts were calibrated on
    d.drafts, d.conf = [5, 6, 7], [0.9, 0.8, 0.7]
    assert d.commit(DraftPlan([5, 8], [(0, 2)], source="ptp"), 0) is None  # not the drafts in hand
    assert d.commit(DraftPlan([5], [(0, 2)], source="lookup"), 0) is None  # another drafter's
    hole = DraftPlan([5, 6], [(0, 2)], source="ptp", strands=(Strand(0, (-1,)),))
    assert d.commit(hole, 0) is None  # a tree's placeholder the read had no token for
    slow = DraftPlan([5, 6], [(0, 2), (1, 2), (2, 2)])
    for _ in range(3):  # calls that delivered far less than plain steps would have
        d.pace.add(1, 64.0)
    assert d.pace.behind() and d.commit(plan, 3) is None
    d.pace = Pace()
    assert d.commit(slow, 3) is not None
    fixed = ChainDrafter(FixedBudget(2, max_width=4))
    fixed.drafts, fixed.conf = [5, 6], [0.5, 0.5]
    assert fixed.commit(DraftPlan([5, 6], [(0, 3)], source="ptp"), 0) is None
