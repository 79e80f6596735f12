"""Token trees (``ptp_mlx/drafting/tree.py``, ``drafting/strands.py``): the adapter's candidates, the drafts after a strand
that landed, and which offered strands the budget keeps."""

import pytest

from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.protocol import CallResult, DraftPlan, Strand, chain_accepted
from ptp_mlx.drafting.strands import MAX_STRANDS, StrandOffer, TreeCosts, choose_strands


def test_drafts_after_a_strand_come_from_its_branch():
    from ptp_mlx.drafting.tree import TreeDrafter

    d = TreeDrafter(Budget(CostCurve(), max_width=4))
    plan = DraftPlan([7, 8], [(0, 2), (2, 3)], strands=[Strand(0, (9,)), Strand(0, (5,), 3), Strand(1, (4, 6), 2)])
    aux = [10, 11, 20, 21, 22, 50, 51, 52, 60, 61]  # branch 0 | branch 2 | strand 1's branch | strand 2's branch
    alts = [[(t + 100, 0.1), (t + 200, 0.05)] for t in aux]
    d.update(plan, CallResult([], 1, aux, [0.5] * 10, alts, strand=1))
    assert d.drafts == [51, 52] and d.alts == [[(151, 0.1), (251, 0.05)], [(152, 0.1), (252, 0.05)]]
    d.update(plan, CallResult([], 0, aux, [0.5] * 10, alts, strand=None))
    assert d.drafts == [11] and d.alts == [[(111, 0.1), (211, 0.05)]]
    d.update(plan, CallResult([], 2, aux, [0.5] * 10, alts))
    assert d.drafts == [21, 22]
    d.update(plan, CallResult([], 1, aux, [0.5] * 10, alts, strand=0))
    assert d.drafts == [] and d.alts == []  # a strand without a branch leaves no drafts
    d.update(plan, CallResult([], 3, aux, [0.5] * 10, alts, strand=2))  # the whole deeper strand stood
    assert d.drafts == [61]
    d.update(plan, CallResult([], 2, aux, [0.5] * 10, alts, strand=2))  # only its first token: no branch
    assert d.drafts == []
    assert chain_accepted(plan, CallResult([], 3, strand=2)) == 1 and chain_accepted(plan, CallResult([], 2)) == 2


def test_a_strand_follows_a_row_of_the_chain():
    with pytest.raises(ValueError, match="at <= number of drafts"):
        DraftPlan([7], [], strands=[Strand(2, (5,))])
    with pytest.raises(ValueError, match="at least one token"):
        Strand(0, ())


def test_runner_ups_are_offered_at_every_slot():
    from ptp_mlx.drafting.tree import TreeDrafter

    d = TreeDrafter(Budget(CostCurve(), max_width=4))
    d.drafts, d.conf, d.alts = [7, 8], [0.6, 0.5], [[(30, 0.2), (40, 0.1)], [(31, 0.3), (41, 0.1)]]
    c = d.candidates(0)
    assert c.tokens == ((7, 30, 40), (8, 31, 41)) and c.probs == ((0.6, 0.2, 0.1), (0.5, 0.3, 0.1))
    d.alts = []
    assert d.candidates(0) is None


def _costs(per_row: float, room: int = 64, remaining: int = 100) -> TreeCosts:
    return TreeCosts(lambda rows: 1.0 + per_row * (rows - 1), lambda w: 0.5 * max(0, w - 1), 4, room, remaining)


def test_free_rows_take_every_offer_that_can_land_and_dear_rows_none():
    p = [1.0, 0.8, 0.4]  # P(at least m of 2 drafts stand)
    offers = [StrandOffer(0, (5,), (0.5,), "ptp"), StrandOffer(1, (6,), (0.4,), "ptp")]
    free = choose_strands([7, 8], p, 2.2, 3, offers, _costs(0.0))
    assert [(s.at, s.tokens) for s in free] == [(0, (5,)), (1, (6,))]
    assert choose_strands([7, 8], p, 2.2, 3, offers, _costs(1.0)) == ()


def test_offers_are_aligned_with_the_chain_and_deduplicated():
    p = [1.0, 0.9, 0.5, 0.2]
    # A lookup continuation that agrees with the chain's first two drafts hangs off row 2, from its third token.
    offers = [StrandOffer(0, (7, 8, 4, 5), (0.9,) * 4, "lookup"), StrandOffer(2, (4,), (0.3,), "ptp")]
    got = choose_strands([7, 8, 9], p, 2.6, 4, offers, _costs(0.0))
    assert got[0] == Strand(2, (4, 5), got[0].width, "lookup") and len(got) == 1  # the runner-up duplicates it
    # Fully inside the chain: nothing left to offer; a strand past the chain's end follows its last row.
    assert choose_strands([7, 8], p[:3], 2.4, 3, [StrandOffer(0, (7, 8), (0.9, 0.9), "lookup")], _costs(0.0)) == ()
    past = choose_strands([7, 8], p[:3], 2.4, 3, [StrandOffer(0, (7, 8, 3), (0.9,) * 3, "lookup")], _costs(0.0))
    assert [(s.at, s.tokens) for s in past] == [(2, (3,))]


def test_strands_respect_rows_tokens_and_the_menu():
    p = [1.0, 0.5]
    many = [StrandOffer(0, (t,), (0.3,), "ptp") for t in range(10, 20)]
    assert len(choose_strands([7], p, 1.5, 2, many, _costs(0.0))) == MAX_STRANDS
    long = [StrandOffer(0, (1, 2, 3, 4, 5), (0.9,) * 5, "lookup")]
    assert choose_strands([7], p, 1.5, 2, long, _costs(0.0, room=4))[0].rows <= 2  # 4 rows: 2 are the chain's
    assert len(choose_strands([7], p, 1.5, 2, long, _costs(0.0, remaining=3))[0].tokens) <= 2  # 3 tokens wanted


def test_the_budget_bounds_the_tree_shapes_it_uses():
    from ptp_mlx.drafting import shapes

    b = Budget(CostCurve([1, 64], [1.0, 1.0]), max_width=4)
    seen = set()
    for k in range(60):
        offers = [StrandOffer(0, tuple(range(100, 101 + k % 7)), (0.9,) * 7, "lookup")]
        plan = b.rows_for([7, 8, 9], [0.9, 0.5 + 0.01 * k, 0.3], 100, 64, offers=offers)
        seen.add(tuple((s.at, len(s.tokens), s.width) for s in plan.strands) + (len(plan.drafts), plan.branches))
    assert len(b.shapes.trees) <= shapes.MAX_TREE_SHAPES and len(b.shapes.trees) >= 2


def test_run_stats_count_tokens_per_call_by_tree_size_and_strand_depth():
    from ptp_mlx.generate import GenerationStep
    from ptp_mlx.stats import RunStats, tree_line

    stats = RunStats()
    steps = [
        GenerationStep([1, 2], "", proposed=2, accepted=1, rows=5, source="ptp"),
        GenerationStep([1, 2, 3], "", proposed=3, accepted=2, rows=8, source="lookup-strand", strand_rows=2),
        GenerationStep([1], "", proposed=3, accepted=0, rows=8, source=None, strand_rows=6),
        GenerationStep([1], ""),  # a plain step of a burst: not a PTP call
    ]
    for st in steps:
        stats.add(st, final=False)
    t = stats.tree_dict()
    assert t == {
        "calls": {"chain": 1, "2": 1, "5-8": 1},
        "tokens": {"chain": 2, "2": 3, "5-8": 1},
        "strand_depth": {"2": 1},
    }
    line = tree_line("ptp", t)
    assert "chain: 2.00 (1 calls)" in line and "2: 3.00 (1 calls)" in line and "accepted drafts: 2:1" in line
    assert tree_line("ptp-chain", {"calls": {"chain": 4}, "tokens": {"chain": 6}}) is None
