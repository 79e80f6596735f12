"""Prompt lookup (``ptp_mlx/drafting/lookup.py``) and the policy that picks between it and the adapter's chain
(``ptp_mlx/drafting/policy.py``): candidates from the latest match, exact strands, bursts ended early, and peers
that never read each other."""

from collections import Counter

import pytest

from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.chain import ChainDrafter
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.lookup import LookupProposer
from ptp_mlx.drafting.policy import DraftingConfig, DraftPolicy, make_drafter
from ptp_mlx.drafting.protocol import CallResult, DraftPlan
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.testing.decoding import PROMPTS, SETTINGS, WINDOW, ar, assert_same, with_seed


def test_lookup_candidates_follow_the_latest_match():
    d = LookupProposer([5, 6, 7, 8, 9, 1, 2, 6, 7], max_draft=3)
    assert d.candidates() == [8, 9, 1]  # "6 7" occurred before, followed by 8 9 1
    d.emitted([8, 9, 4, 4])
    assert d.candidates() == []  # "9 4 4" / "4 4" never occurred before
    d.emitted([6, 7, 8, 9])
    assert d.candidates() == [4, 4, 6]  # the longest match wins: "6 7 8 9" was followed by 4 4 6
    d.emitted([4, 4])  # "8 9 4 4" is followed by 6 7 8 (and the match right behind, "9 4 4 ...", is too recent)
    assert d.candidates() == [6, 7, 8]


def test_lookup_guess_is_the_offer_after_a_chain_that_stood():
    """``guess_after``: the chain the proposer will offer once its chain stood whole and the copied text went on,
    with the rate those hits make, computed without changing the proposer (random histories with repeats)."""
    import copy
    import random

    r, checked = random.Random(0), 0
    for _ in range(300):
        text = [r.randrange(6) for _ in range(r.randrange(8, 40))]
        d = LookupProposer(text * r.randrange(1, 3) + text[: r.randrange(len(text))], max_draft=r.randrange(2, 6))
        d.hits, d.misses = r.randrange(5), r.randrange(1, 5)
        d.class_hits = [float(r.randrange(5)) for _ in d.class_hits]  # (each match class's own record)
        d.class_misses = [float(r.randrange(5)) for _ in d.class_misses]
        d.turn_start = r.randrange(len(d.history) + 1)  # ``earlier`` offers must agree too
        offer = d.offer()
        if offer is None:
            continue
        n = r.randrange(1, len(offer.drafts) + 1)
        drafts = offer.drafts[:n]
        before = (list(d.history), d.hits, d.misses)
        guess = d.guess_after(drafts)
        assert (d.history, d.hits, d.misses) == before  # a guess changes nothing the proposer decides by
        real = copy.deepcopy(d)
        at = real._match(real.history)
        if at + n >= len(real.history):
            assert guess is None  # the copied text has no next token to assume
            continue
        real.observe(n, n, 1.0)
        real.emitted([*drafts, real.history[at + n]])
        assert guess == real.offer(), (text, drafts)
        checked += guess is not None
    assert checked > 50


def test_lookup_rates_follow_the_length_of_the_match():
    """A chain's drafts are priced at the hit rate of chains matched as long as it (``MATCH_CLASSES``), and what a
    verified chain did is credited to its own class."""
    assert LookupProposer.match_class([1, 2, 3, 9, 2, 3], 3) == 0  # "2 3" matched: 2 tokens
    assert LookupProposer.match_class([1, 2, 3, 4, 9, 2, 3, 4], 4) == 1  # 3 tokens
    assert LookupProposer.match_class([*range(12), 99, *range(12)], 12) == 4  # 12 tokens: 10 or more
    short = [7, 1, 2, 5, 6, 8, 3, 1, 2]  # "1 2" (2 tokens) matched, then 5 6 8
    d = LookupProposer(short, max_draft=3)
    assert d.offer().drafts == (5, 6, 8) and d.offer().rate == pytest.approx(0.5)  # (the prior: no record yet)
    d.observe(3, 0, 1.0)  # short matches miss
    assert d.class_misses[0] == 1 and d.class_hits == [0.0] * len(d.class_hits)
    d.emitted([4])
    d.history, d._matched = [*range(10, 22), 99, *range(10, 21)], None  # a long match (11 tokens): 21 follows
    d._index, d._alts, d._indexed = {}, {}, 0
    long_rate = d.offer().rate
    d.observe(3, 3, 1.0)
    assert d.class_hits[4] == 3
    assert d.offer().rate > max(long_rate, d.class_rate(0) + 0.3)  # (long matches stood, short ones fell)


def test_copies_of_an_earlier_turn_are_planned_strict():
    """A lookup chain copied from before ``DraftSession.turn_start`` (an earlier turn of a chat) is offered
    ``earlier``, and the policy's plan for it is ``strict``: verified by the exact rule whatever the answer's rule."""
    from ptp_mlx.drafting.protocol import DraftSession
    from ptp_mlx.sampler import SamplingSettings, UniformStream

    prompt = [5, 6, 7, 8, 9, 1, 2, 6, 7]  # "6 7" occurred at 1: the chain 8 9 1 is copied from position 3
    for turn, earlier in ((6, True), (3, False), (0, False)):
        policy = make_drafter(DraftingConfig(), WINDOW)
        policy.lookup.max_draft, policy.lookup.hits = 3, 1000.0  # a confident lookup wins the call
        policy.begin(DraftSession(prompt, UniformStream(0), SamplingSettings(0.0), turn))
        assert policy.lookup.offer().drafts == (8, 9, 1) and policy.lookup.offer().earlier is earlier
        plan = policy.plan(0, 30, 100)
        assert plan.source == "lookup" and plan.strict is earlier, turn
        if earlier:  # the answer's own text follows the prompt: a copy from it is never earlier
            policy.emitted([8, 9, 1, 2, 8, 9])
            assert policy.lookup.offer().drafts == (1, 2, 8) and policy.lookup.offer().earlier is False


@pytest.mark.parametrize("name", ["greedy", "T0.7-k20-p0.9", "T1.0"])
def test_lookup_strands_are_exact(pm_sticky, varied, name):
    """Lookup drafts that are right (the answer itself planted in the history), wrong (another answer) or cut by
    EOS and the token limit inside a strand: the output is the autoregressive one, and right ones are accepted."""
    tok = varied[1]
    s = with_seed(SETTINGS[name], 7)
    ids = encode_prompt(tok, PROMPTS[0])
    want, _ = ar(pm_sticky, tok, ids, s, 30, eos=set())
    wrong, _ = ar(pm_sticky, tok, encode_prompt(tok, PROMPTS[1]), s, 30, eos=set())
    sources = Counter()
    for planted, max_tokens, eos in ((want, 30, set()), (wrong, 30, set()), (want, 13, set()), (want, 30, {want[9]})):
        history = ids[-4:] + planted + [0] + ids  # the prompt's last 4 tokens, then the planted continuation
        # A confident prior: the (uncalibrated, over-confident) sticky adapter would win most calls otherwise.
        budget = Budget(CostCurve(), WINDOW)
        lookup = LookupProposer(history, max_draft=WINDOW - 1, prior=(1000.0, 1.0))
        drafter = DraftPolicy(budget, ChainDrafter(budget), lookup)
        exp = ar(pm_sticky, tok, ids, s, max_tokens, eos=eos)
        steps = assert_same(pm_sticky, tok, ids, s, max_tokens, {"drafter": drafter}, eos=eos, want=exp)
        for st in steps:
            sources[st.source] += st.accepted
    assert sources["lookup"] > 20, sources


class _AlwaysBurst(ChainDrafter):
    """An inner drafter whose budget never drafts: every plan is a 16-token autoregressive burst."""

    def __init__(self, width):
        super().__init__(Budget(CostCurve(), max_width=width))

    def plan(self, i, remaining, room, offers=()):
        return DraftPlan([], [], burst=min(16, remaining))

    def update(self, plan, result):
        pass


@pytest.mark.parametrize("name", ["greedy", "T1.0"])
def test_a_ready_lookup_chain_ends_a_burst_early_and_stays_exact(varied, pm_sticky, name):
    _, tok = varied
    s = with_seed(SETTINGS[name], 4)
    interrupted = 0
    for prompt in PROMPTS:
        ids = encode_prompt(tok, prompt * 6)  # a repetitive prompt: lookup chains appear inside bursts
        want = ar(pm_sticky, tok, ids, s, 48)
        inner = _AlwaysBurst(WINDOW)
        lookup = LookupProposer(ids, max_draft=WINDOW - 1, prior=(9.0, 1.0))
        drafter = DraftPolicy(inner.budget, inner, lookup)
        steps = assert_same(pm_sticky, tok, ids, s, 48, {"drafter": drafter}, want=want)
        interrupted += sum(st.source == "lookup" for st in steps)  # only reachable by ending a burst early
    assert interrupted > 0


def test_the_policy_verifies_the_offer_expected_to_land_more_and_credits_it():
    budget = Budget(CostCurve(), max_width=4)
    chain = ChainDrafter(budget)
    lookup = LookupProposer([5, 6, 7, 8, 9, 1, 2, 6, 7], max_draft=3, prior=(9.0, 1.0))
    policy = DraftPolicy(budget, chain, lookup)
    chain.drafts, chain.conf = [40, 41], [0.2, 0.2]  # the adapter's chain expects little
    plan = policy.plan(0, 100, 100)
    assert plan.source == "lookup" and plan.drafts == (8, 9, 1)[: len(plan.drafts)] and plan.drafts
    policy.update(plan, CallResult([8, 3], 1, [], []))
    assert (lookup.hits, lookup.misses) == (10.0, 2.0)  # one stood, then one fell
    chain.drafts, chain.conf = [40, 41], [0.99, 0.99]  # now the chain is the better offer
    lookup.hits, lookup.misses = 1.0, 9.0
    plan = policy.plan(2, 100, 100)
    assert plan.source == "ptp" and plan.drafts == (40, 41)
    policy.update(plan, CallResult([40, 3], 1, [], []))
    assert (lookup.hits, lookup.misses) == (1.0, 9.0)  # the chain's calls are not lookup evidence


def test_a_long_match_offers_a_longer_chain_cut_where_its_rows_pay():
    """After a match of 10 tokens or more (``LONG_CHAIN``) the chain offered is twice ``max_draft`` long; the policy
    verifies as much of it as pays at the budget's curve (flat: all of it; steep: no more than a short chain)."""
    text = list(range(100, 130))
    lookup = LookupProposer([*text, 7, *text[:12]], max_draft=4, prior=(19.0, 1.0))
    offer = lookup.offer()
    assert offer.drafts == tuple(text[12:20]) and lookup.match_class(lookup.history, 12) == 4  # (12 tokens)
    for curve, n in ((CostCurve(), 8), (CostCurve.linear(1.0), 4)):
        budget = Budget(curve, max_width=4)
        lookup.class_hits = [0.0] * len(lookup.class_hits)
        policy = DraftPolicy(budget, ChainDrafter(budget), lookup)
        plan = policy.plan(0, 100, 100)
        assert plan.source == "lookup" and len(plan.drafts) == n, (curve, plan)
    short = LookupProposer([1, 2, 3, 9, 8, 1, 2, 3], max_draft=4)
    assert len(short.offer().drafts) == 4  # (a match of 3 tokens: max_draft)


def test_the_default_drafter_is_composed_from_one_config():
    chain = make_drafter(DraftingConfig(lookup=False, trees=False), 4)
    assert type(chain) is ChainDrafter
    policy = make_drafter(DraftingConfig(), 4)
    assert isinstance(policy, DraftPolicy) and policy.lookup is not None and policy.lookup.max_draft == 3
    assert policy.budget is policy.chain.budget  # one budget, given to both when they were made
    fixed = make_drafter(DraftingConfig(num_draft_tokens=2, lookup=False), 4)
    assert fixed.budget.num_draft == 2 and fixed.budget.shape_only


def test_a_burst_ended_early_keeps_the_step_it_had_queued(varied, pm_sticky, monkeypatch):
    """Ending a burst for a lookup chain reads the step already queued and keeps its token: every plain step
    computed is a token of the answer (none is computed and then thrown away)."""
    from ptp_mlx.decode.fixed import CompileBank

    _, tok = varied
    steps_run = []
    ar_step = CompileBank.ar_step

    def counted(self, *a, **k):
        steps_run.append(1)
        return ar_step(self, *a, **k)

    monkeypatch.setattr(CompileBank, "ar_step", counted)
    s = with_seed(SETTINGS["greedy"], 4)
    interrupted = 0
    for prompt in PROMPTS:
        ids = encode_prompt(tok, prompt * 6)
        want = ar(pm_sticky, tok, ids, s, 48)
        steps_run.clear()
        inner = _AlwaysBurst(WINDOW)
        drafter = DraftPolicy(inner.budget, inner, LookupProposer(ids, max_draft=WINDOW - 1, prior=(9.0, 1.0)))
        steps = assert_same(pm_sticky, tok, ids, s, 48, {"drafter": drafter}, want=want)
        ends = sum(st.source == "lookup" for st in steps)  # bursts ended early (lookup calls follow only those)
        interrupted = max(interrupted, ends)
        # (one step past the answer's end may have been queued, as in any pipelined decoding)
        assert len(steps_run) <= sum(1 for st in steps if st.rows == 1) + 1, (len(steps_run), ends)
    assert interrupted > 0  # bursts were ended early


def test_lookup_offers_other_continuations_of_the_same_words():
    # "1 2 3" was followed by 9 ..., then by 7 ...; the chain in hand continues the latest (7), the alternative the
    # other (9), and a third occurrence followed by 7 again replaces the older 7 rather than adding one.
    h = [1, 2, 3, 9, 10, 11, 12, 5, 1, 2, 3, 7, 20, 21, 22, 6, 1, 2, 3, 7, 30, 31, 32, 4, 1, 2, 3]
    lookup = LookupProposer(h, max_draft=3)
    assert lookup.offer().drafts == (7, 30, 31)
    alts = lookup.alternatives()
    assert [a.drafts for a in alts] == [(9, 10, 11)]
    assert LookupProposer([1, 2, 3, 9, 10, 11, 12, 1, 2, 3], max_draft=3).alternatives() == []


def test_lookup_strands_beside_the_adapters_chain_are_exact(varied, pm_sticky):
    """Free rows, a repetitive prompt: lookup's continuations hang beside the adapter's chain (and the adapter's
    chain beside lookup's) as strands of a token tree; the answer is plain decoding's, token for token."""
    _, tok = varied
    landed = Counter()
    for name in ("greedy", "T1.0"):
        s = with_seed(SETTINGS[name], 7)
        trees = 0
        for prompt in PROMPTS:
            ids = encode_prompt(tok, prompt * 6)
            budget = Budget(CostCurve([1, 64], [1.0, 1.0]), max_width=WINDOW)
            steps = assert_same(pm_sticky, tok, ids, s, 48, {"budget": budget})
            trees += sum(st.strand_rows > 0 for st in steps)
            landed.update(st.source for st in steps if str(st.source).endswith("-strand"))
        # (sampling, the adapter's own tree is off: the strands are lookup's and the adapter's chain beside it)
        assert trees >= (5 if name == "greedy" else 1), (name, trees)
    assert landed["lookup-strand"] + landed["ptp-strand"] >= 1, landed
