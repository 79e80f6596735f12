"""Token trees (``ptp_mlx/drafting/tree.py``): the runner-up of the first draft, and the drafts after an
alternative that landed."""

from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.protocol import CallResult, DraftPlan


def test_drafts_after_an_alternative_come_from_its_branch():
    from ptp_mlx.drafting.tree import TreeDrafter

    d = TreeDrafter(Budget(CostCurve(), max_width=4))
    plan = DraftPlan([7, 8], [(0, 2), (2, 3)], alts=[(9, 0), (5, 3)])
    aux = [10, 11, 20, 21, 22, 50, 51, 52]  # branch 0 | branch 2 | alternative 1's branch (alternative 0 has none)
    second = [(t + 100, 0.1) for t in aux]
    d.update(plan, CallResult([], 1, aux, [0.5] * 8, second, alt=1))
    assert d.drafts == [51, 52] and d.second == (151, 0.1)
    d.update(plan, CallResult([], 0, aux, [0.5] * 8, second, alt=None))
    assert d.drafts == [11] and d.second == (111, 0.1)
    d.update(plan, CallResult([], 2, aux, [0.5] * 8, second))
    assert d.drafts == [21, 22]
    d.update(plan, CallResult([], 1, aux, [0.5] * 8, second, alt=0))
    assert d.drafts == [] and d.second is None  # an alternative without a branch leaves no drafts
