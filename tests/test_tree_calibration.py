"""The adapter's tree calibrates itself (``Budget.tree_ratio``): its tokens' predicted chances against those that
stood, folded in after every call that verified a tree, scale the runner-ups' chances of the next trees."""

import pytest

from ptp_mlx.drafting.budget import TREE_KEEP, TREE_PRIOR, Budget
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.fixed_budget import FixedBudget
from ptp_mlx.drafting.protocol import CallResult, DraftPlan, Strand
from ptp_mlx.drafting.tree import TreeDrafter


def _budget(calibrate: bool = True) -> Budget:
    return Budget(CostCurve([1, 64], [1.0, 1.0]), max_width=8, calibrate=calibrate)


def test_tree_ratio_follows_what_stood_and_fades():
    b = _budget()
    assert b.tree_ratio == 1.0
    b.observe_tree(2.0, 1.0)
    assert b.tree_ratio == pytest.approx((TREE_PRIOR + 1.0) / (TREE_PRIOR + 2.0))
    for _ in range(300):  # trees that stand a quarter as often as priced, for long: the faded evidence's ratio
        b.observe_tree(0.4, 0.1)
    keep = 1.0 / (1.0 - TREE_KEEP)  # (what the evidence of many calls adds up to)
    assert b.tree_ratio == pytest.approx((TREE_PRIOR + 0.1 * keep) / (TREE_PRIOR + 0.4 * keep), rel=1e-3)
    assert b.tree_ratio < 0.5
    for _ in range(300):  # trees that never stand: down to the bound
        b.observe_tree(1.0, 0.0)
    assert b.tree_ratio == 0.25
    for _ in range(300):  # then trees that stand more often than priced: older evidence fades, the ratio rises
        b.observe_tree(0.2, 0.3)
    assert 1.2 < b.tree_ratio <= 1.5
    b.observe_tree(0.0, 100.0)
    assert b.tree_ratio == 1.5  # (bounded)


def test_budgets_that_do_not_calibrate_keep_ratio_one():
    b = _budget(calibrate=False)
    b.observe_tree(10.0, 0.0)
    assert b.tree_ratio == 1.0 and b.tree_expected == 0.0
    f = FixedBudget(3)
    f.observe_tree(10.0, 0.0)
    assert f.tree_ratio == 1.0


def _drafter(b: Budget) -> TreeDrafter:
    d = TreeDrafter(b)
    d.drafts, d.conf = [5, 6], [0.5, 0.4]
    d.alts = [[(7, 0.3), (8, 0.1), (9, 0.05)], [(10, 0.2), (11, 0.1), (12, 0.05)]]
    return d


def test_candidates_scale_the_runner_ups_not_the_chain():
    b = _budget()
    b.tree_expected, b.tree_hits = 10.0, 1.0  # ratio (4 + 1) / (4 + 10)
    d = _drafter(b)
    c = d.candidates(0)
    k = (TREE_PRIOR + 1.0) / (TREE_PRIOR + 10.0)
    assert c.tokens == ((5, 7, 8, 9), (6, 10, 11, 12))
    assert c.probs[0] == pytest.approx((0.5, 0.3 * k, 0.1 * k, 0.05 * k))
    assert c.probs[1] == pytest.approx((0.4, 0.2 * k, 0.1 * k, 0.05 * k))
    assert d.priced.probs[0] == pytest.approx((0.5, 0.3, 0.1, 0.05))  # what calibration compares against
    d.rank_prob = [[0.3, 0.1, 0.05], [0.2, 0.1, 0.05]]
    p = d.prior_candidates([0.5, 0.4])
    assert p.probs[1] == pytest.approx((0.4, 0.2 * k, 0.1 * k, 0.05 * k))


@pytest.mark.parametrize(
    ("accepted", "strand", "hits"),
    [(1, 0, 1.0), (0, None, 0.0), (1, None, 0.0)],  # the strand's token stood; the chain fell there; the chain stood
)
def test_a_verified_tree_is_folded_in(accepted, strand, hits):
    b = _budget()
    d = _drafter(b)
    d.plan(0, remaining=32, room=64)  # (prices the candidates: ``priced``)
    plan = DraftPlan([5], [], strands=(Strand(0, (7,)),), source="ptp")
    d.update(plan, CallResult([1], accepted, strand=strand))
    assert b.tree_expected == 0.0 and b.tree_hits == 0.0  # (put off until the next call is queued: ``catch_up``)
    d.drafts, d.conf = [9], [0.9]  # (what the drafter took from the read does not change what it folds in)
    d.catch_up()
    # the strand's token: chance min(P(reach 0) * 0.3, P(the chain's draft falls) = 0.5)
    assert b.tree_expected == pytest.approx(0.3)
    assert b.tree_hits == hits
    assert d.priced is None


def test_another_peers_strand_is_neither_priced_nor_a_hit():
    b = _budget()
    d = _drafter(b)
    d.plan(0, remaining=32, room=64)
    plan = DraftPlan([5], [], strands=(Strand(0, (7,)), Strand(0, (8, 3), source="lookup")), source="ptp")
    d.update(plan, CallResult([1, 2, 3], 2, strand=1))
    d.catch_up()
    assert b.tree_expected == pytest.approx(0.3) and b.tree_hits == 0.0
    b.tree_expected = 0.0
    d = _drafter(b)
    d.plan(0, remaining=32, room=64)
    d.update(DraftPlan([5], [], strands=(Strand(0, (8, 3), source="lookup"),), source="ptp"), CallResult([1], 0))
    d.catch_up()
    assert b.tree_expected == 0.0  # (no tree of the adapter's: nothing folded in)
