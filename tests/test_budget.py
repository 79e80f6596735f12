"""The budgets (``ptp_mlx/drafting/budget.py``): the adaptive budget's choice of rows, its calibration and bursts,
and exact decoding under budgets of every kind."""

import pytest

from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.testing.decoding import BUDGETS, PROMPTS, SETTINGS, WINDOW, assert_same, with_seed


def test_calibration_follows_observed_acceptance():
    curve = CostCurve([1, 2, 64], [1.0, 1.3, 30.0])  # a second row costs 30% more: drafting must earn it
    fixed = Budget.from_histogram(curve, [1, 1, 1, 1, 1], max_width=6)
    cal = Budget.from_histogram(curve, [1, 1, 1, 1, 1], max_width=6, calibrate=True)
    assert cal.ratio == 1.0 and cal.choose([0.9, 0.9], 64) == fixed.choose([0.9, 0.9], 64)
    assert fixed.choose([], 64)[1]  # the prior says a fresh branch pays
    for _ in range(50):  # confident drafts that always miss
        cal.observe([0.9, 0.9], 0)
        fixed.observe([0.9, 0.9], 0)
    assert fixed.ratio == 1.0 and fixed.hits == fixed.expected == 0.0  # only calibrating budgets learn
    assert cal.ratio == 0.25  # (8 + 0) / (8 + 45), bounded below
    assert fixed.choose([], 64)[1] and cal.choose([], 64) == (0, [])  # no branch pays: autoregressive bursts
    assert cal.choose([0.9, 0.9], 64)[1] == []  # drafts in hand are still verified (token rows), no new branch
    bursts = 0
    while not cal.choose([], 64)[1]:  # each autoregressive burst fades the evidence: drafting is tried again
        cal.relax()
        bursts += 1
    assert 3 <= bursts <= 12, bursts
    # Drafts after the first miss carry no information; hits count only leading accepted drafts.
    b = Budget(CostCurve(), calibrate=True)
    b.observe([0.5, 0.5, 0.5], 1)
    assert (b.hits, b.expected) == (1.0, 1.0)
    for _ in range(100):  # drafts better than their confidences: more drafting, bounded at 2x
        b.observe([0.4, 0.4], 2)
    assert b.ratio == 2.0 and b.survive(1) <= 1.0


@pytest.mark.parametrize("bname", list(BUDGETS))
def test_budgets(pm_sticky, varied, bname):
    tok = varied[1]
    budget = BUDGETS[bname]
    ids = encode_prompt(tok, PROMPTS[1])
    rows = []
    for name in ("greedy", "T0.7-k20-p0.9"):
        steps = assert_same(pm_sticky, tok, ids, with_seed(SETTINGS[name], 3), 16, {"budget": budget})
        rows += [st.rows for st in steps]
    if bname == "steep":
        assert max(rows) == 1, rows  # the cost curve forces single-row passes
    else:
        assert max(rows) > 1
    # The simple step takes its draft width from the budget.
    assert_same(pm_sticky, tok, ids, with_seed(SETTINGS["T1.0"], 4), 12, {"step": "simple", "budget": budget})


@pytest.mark.parametrize("name", ["greedy", "T0.7-k20-p0.9", "T1.0"])
def test_free_rows_verify_token_trees_exactly(varied, pm_sticky, name):
    """With free rows the adaptive budget hangs a token tree beside the chain: greedy, the adapter's top-k tree
    (strands of strands) and what other peers offer (lookup's continuation beside the adapter's chain or the other
    way round); sampling, only the peers' strands (the adapter's tree is greedy decoding's). Output is still exactly
    autoregressive, and the next drafts come from the branch of the strand that stood."""
    _, tok = varied
    trees = nested = adapter = 0
    for k, prompt in enumerate(PROMPTS[:3]):
        s = with_seed(SETTINGS[name], 3 + k)
        ids = encode_prompt(tok, prompt)
        budget = Budget(CostCurve([1, 64], [1.0, 1.0]), max_width=WINDOW)
        plans: list = []

        def spy(*a, real=budget.rows_for, plans=plans, **kw):
            plans.append(real(*a, **kw))
            return plans[-1]

        budget.rows_for = spy
        steps = assert_same(pm_sticky, tok, ids, s, 32, {"budget": budget})
        assert sum(st.rows > 1 + st.proposed for st in steps)  # branches ran
        trees += sum(st.strand_rows > 0 for st in steps)
        nested += sum(any(st.parent >= 0 for st in p.strands) for p in plans)
        adapter += sum(any(st.source == "ptp" for st in p.strands) for p in plans)
    if name == "greedy":
        assert trees >= 3 and nested >= 1, (trees, nested)
    else:
        assert adapter == 0


def test_bursts_back_off_while_probes_fail_and_reset_when_a_draft_lands():
    from ptp_mlx.drafting.budget import AR_BURST, MAX_BURST

    b = Budget(CostCurve(), max_width=4, calibrate=True)
    lens = []
    for _ in range(5):
        b.relax()  # a burst ran
        lens.append(b.burst_len)
        b.observe([0.9], 0)  # the probe after it: its draft fell
    assert lens == [AR_BURST, 2 * AR_BURST, 4 * AR_BURST, MAX_BURST, MAX_BURST]
    b.observe([0.9, 0.9], 1)
    assert b.burst_len == AR_BURST
    b.relax()
    assert b.burst_len == AR_BURST  # drafts landed since the last burst: no back-off
    fixed = Budget(CostCurve(), max_width=4)
    for _ in range(3):
        fixed.relax()
    assert fixed.burst_len == AR_BURST  # budgets that do not calibrate keep the fixed burst
