"""Lookup chains built ahead by the token a call emits (``Drafter.guess_by_token``, ``decode/ahead.py``): after the
adapter's call, prompt lookup's chain depends on the exact token the call computes, which the host reads only
after it; a build of its own picks each candidate token's drafts on the device, and the read tells whether the
token came and the plan is the real one."""

import copy
import random
from collections import Counter

import pytest

import ptp_mlx.decode.pipeline as pipeline
from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.chain import ChainDrafter
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.lookup import LookupProposer
from ptp_mlx.drafting.policy import DraftPolicy
from ptp_mlx.drafting.protocol import CallResult, DraftPlan, Guess
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.testing import StrandKindTreeDrafter
from ptp_mlx.testing.decoding import PROMPTS, SETTINGS, WINDOW, ar, assert_same, with_seed


def test_the_next_tokens_are_every_token_lookup_would_match_after():
    """``next_tokens``: every token whose emission gives lookup a chain is among them (latest, longest n-gram
    first), and ``offer_after`` is the offer the proposer then makes, computed without changing it (random
    histories over six tokens, with repeats)."""
    r, matched = random.Random(1), 0
    for _ in range(300):
        text = [r.randrange(6) for _ in range(r.randrange(6, 40))]
        d = LookupProposer(text * r.randrange(1, 3) + text[: r.randrange(len(text))], max_draft=r.randrange(2, 6))
        d.class_hits = [float(r.randrange(5)) for _ in d.class_hits]
        d.turn_start = r.randrange(len(d.history) + 1)
        path = [r.randrange(6) for _ in range(r.randrange(3))]  # drafts that stood in the call being read
        h = d.history + path
        before = list(d.history)
        tokens = d.next_tokens(h, 100)
        assert len(set(tokens)) == len(tokens) and d.history == before
        for x in range(6):
            real = copy.deepcopy(d)
            real.emitted([*path, x])
            offer = real.offer()
            assert d.offer_after(h + [x]) == offer
            assert offer is None or x in tokens, (h, x)
            matched += offer is not None
    assert matched > 300
    d = LookupProposer([1, 2, 3, 9, 1, 2, 4, 8, 5, 2, 7], max_draft=2)
    assert d.next_tokens([*d.history, 1, 2], 3) == [4, 3, 7]  # after "1 2": 4 latest, then 3; after "2": 7 too


def test_a_guess_by_token_is_the_plan_lookup_makes_after_that_token():
    """After the adapter's call, the policy's plan for each candidate token is the one it makes once the call's
    block (the drafts that stood, then that token) is read, where lookup's chain wins."""
    budget = Budget(CostCurve.linear(0.05), max_width=4)  # (rows not free: no strand of the adapter's beside)
    chain = ChainDrafter(budget)
    history = [5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4, 1, 2, 6, 9]
    policy = DraftPolicy(budget, chain, LookupProposer(history, max_draft=3, prior=(9.0, 1.0)))
    plan = DraftPlan([1, 2], [(2, 3)], source="ptp")
    guess = policy.guess_by_token(plan, 2, 20, 40, 100)  # both drafts stand: the history ends "... 6 9 1 2"
    assert isinstance(guess, Guess) and guess.by_token and set(guess.by_token) <= {6, 7, 8, 9, 1, 2, 3, 4, 5}
    for x, want in guess.by_token.items():
        real = copy.deepcopy(policy)
        real.emitted([1, 2, x])
        real.chain.drafts, real.chain.conf = [40, 41], [0.01, 0.01]  # the adapter's next chain expects little
        got = real.plan(23, 37, 97)
        assert got == want, (x, got, want)
        result = CallResult(block=[1, 2, x], accepted=2)
        assert guess.realize(result) == want
    missing = guess.realize(CallResult(block=[1, 2, 77], accepted=2))
    assert min(missing.drafts) == -1  # a token none was planned for: never a real plan
    assert policy.guess_by_token(DraftPlan([1], [], source="lookup"), 1, 20, 40, 100) is None  # lookup's own


def test_after_a_lookup_chain_cut_short_the_guess_by_token_is_the_next_lookup_plan():
    """A lookup chain that falls at draft ``g`` emits the model's own token there; lookup's next chain hangs on it,
    and on the hit rates the read moves (``observe``): each guess is the plan the policy makes after that read."""
    budget = Budget(CostCurve.linear(0.02), max_width=6)
    history = [5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4, 1, 2, 6, 9, 4, 1, 5, 6, 7, 8]
    policy = DraftPolicy(budget, ChainDrafter(budget), LookupProposer(history, max_draft=4, prior=(1.0, 1.0)))
    plan = DraftPlan([9, 1, 2, 6], [(4, 2)], source=policy.lookup.source)
    checked = 0
    for accepted in range(len(plan.drafts)):
        guess = policy.guess_by_token(plan, accepted, 30, 60, 200)
        assert isinstance(guess, Guess) and guess.by_token
        for x, want in guess.by_token.items():
            real = copy.deepcopy(policy)
            real.lookup.observe(len(plan.drafts), accepted, budget.curve(plan.rows))  # (``update``'s part for lookup)
            real.emitted([*plan.drafts[:accepted], x])
            real.chain.drafts, real.chain.conf = [40, 41], [0.01, 0.01]  # the adapter's next chain expects little
            got = real.plan(31 + accepted, 59 - accepted, 199 - accepted)
            assert got == want, (accepted, x, got, want)
            assert guess.realize(CallResult(block=[*plan.drafts[:accepted], x], accepted=accepted)) == want
            checked += 1
    assert checked >= 4
    assert policy.guess_by_token(plan, len(plan.drafts), 30, 60, 200) is None  # a whole chain goes on (``guess``)


def test_a_lookup_chain_planned_ahead_is_committed_where_the_read_leaves_it_lookup_s_chain():
    """After the read, a lookup plan made ahead (for the token the read revealed) runs without re-planning where
    lookup's chain now verifies its drafts and still beats the adapter's chain; another token, or an adapter chain
    that expects more, plans as ever."""
    budget = Budget(CostCurve.linear(0.05), max_width=4)
    history = [5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4, 1, 2, 6, 9]
    policy = DraftPolicy(budget, ChainDrafter(budget), LookupProposer(history, max_draft=3, prior=(9.0, 1.0)))
    plan = DraftPlan([1, 2], [(2, 3)], source="ptp")
    guess = policy.guess_by_token(plan, 2, 20, 40, 100)
    x, want = next(iter(guess.by_token.items()))
    other = next(t for t in range(3, 10) if t not in guess.by_token)
    for token, adapter_conf, committed in ((x, 0.01, True), (other, 0.01, False), (x, 0.99, False)):
        real = copy.deepcopy(policy)
        real.emitted([1, 2, token])
        real.chain.drafts, real.chain.conf = [40, 41, 42], [adapter_conf] * 3
        got = real.commit(guess.realize(CallResult(block=[1, 2, token], accepted=2)), 23)
        assert (got is not None) == committed, (token, adapter_conf, got)
        if committed:
            assert got == want


@pytest.mark.parametrize("name", ["greedy", "T1.0"])
def test_lookup_chains_built_by_token_run_and_stay_exact(pm_sticky, varied, monkeypatch, name):
    """With time to spare (as on a GPU), the lookup chain for the token the adapter's call emits is built beside
    the adapter's next call (or alone, where the adapter's is not told ahead); reads whose token and plan it
    guessed queue it, and the answer is the autoregressive one token for token. The history holds the answer
    with every seventh token wrong: lookup's chains fall there, an adapter call follows, and lookup matches again
    only once that call's token is read."""
    seen = Counter()
    confirm = pipeline.confirm_chained

    def counted(chained, result, plan, i, cache, *more):
        builds = chained.builds(result.accepted) if result.strand is None else []
        call = confirm(chained, result, plan, i, cache, *more)
        for b in builds:
            if call is not None and b.call.out is call.out:
                seen["by token" if b.guesses[result.accepted].by_token is not None else "adapter's"] += 1
        return call

    monkeypatch.setattr(pipeline, "confirm_chained", counted)
    monkeypatch.setattr(pipeline, "spare", lambda left, build: True)  # (as on a GPU: time for more builds)
    tok = varied[1]
    for k, prompt in enumerate(PROMPTS[:3]):
        s = with_seed(SETTINGS[name], 80 + k)
        ids = encode_prompt(tok, prompt)
        want = ar(pm_sticky, tok, ids, s, 48, eos=set())
        planted = [t if j % 7 != 3 else 0 for j, t in enumerate(want[0])]
        for _ in range(2):  # (the second answer finds the lookup shapes compiled: a build by token needs them)
            budget = Budget(CostCurve.linear(0.05), WINDOW)  # (rows not free: lookup's chains run alone)
            lookup = LookupProposer(ids[-4:] + planted + [0] + ids, max_draft=WINDOW - 1, prior=(9.0, 1.0))
            drafter = DraftPolicy(budget, ChainDrafter(budget), lookup)
            assert_same(pm_sticky, tok, ids, s, 48, {"drafter": drafter}, eos=set(), want=want)
    assert seen["by token"] >= 3, seen


def _address(a) -> int:
    """Where an evaluated array's buffer is (the view is let go at once: it holds the buffer)."""
    import numpy as np

    return int(np.asarray(memoryview(a)).__array_interface__["data"][0])


def _builds(grave: list) -> int:
    """How many unused builds ``grave`` keeps (``(call, state, cut)``; the cut of the build that runs goes there too)."""
    return sum(isinstance(g, tuple) for g in grave)


def _watch_in_place(monkeypatch) -> list[bool]:
    """Per call queued after unused builds were kept (``release.park``): whether it wrote the K buffer they were built
    on in place (True) or copied it. (``before``: the state the running call, just read, wrote; after builds were
    kept last time, that call was the one queued instead: in place, its buffer is the one the kept builds were built
    on. Not counted: a call of a shape run for the first time, traced as it runs, which copies whatever; and a call
    that moves a strand's rows in its own graph, whose gather of the rows reads the buffer its slice update writes:
    MLX donates the buffer only where the gather has let go of it by then, which is a matter of timing.)"""
    seen, pending = [], []
    confirm = pipeline.CallQueue.confirm

    def watched(queue, result, plan, i):
        chained, cold = queue.chained, queue.sess.bank.cold
        now = _address(chained.before[0][0]) if chained is not None and chained.before is not None else None
        seen.extend(want == now for want, then in pending if now is not None and then == cold)
        pending.clear()
        kept = _builds(queue.grave)
        ready = confirm(queue, result, plan, i)
        moves = ready and result.strand is not None  # (it runs, moving the strand's rows itself)
        if _builds(queue.grave) > kept and now is not None and not moves:
            pending.append((now, cold))
        return ready

    monkeypatch.setattr(pipeline.CallQueue, "confirm", watched)
    monkeypatch.setattr(pipeline, "spare", lambda left, build: True)  # (as on a GPU: time for more builds)
    return seen


@pytest.mark.parametrize("cut", [True, False])
def test_builds_kept_until_the_next_call_is_queued_leave_it_the_buffers(pm_sticky, varied, monkeypatch, cut):
    """Builds not used are let go only after the call queued instead (``release.park``, ``CallQueue.bury``), their
    edges to the K/V buffers cut as they were built (``release.prepare``), so that call still writes the buffers in
    place: its K output is the buffer it was built on. With a cut that finds nothing (the control) the builds kept
    hold the buffers and the call copies them."""
    import ptp_mlx.decode.release as release

    if release._graph() is None:
        pytest.skip("ptp-graph is not built here")
    if not cut:

        class Uncut:  # (a cut that finds no edge: the builds are kept, holding the buffers)
            edges = shared = 0

        class NoCut:
            cut_ahead = staticmethod(lambda outs, bufs, stop, depth: Uncut())
            restore = staticmethod(lambda plan, bufs: 0)

        monkeypatch.setattr(release, "_graph", NoCut)
    seen = _watch_in_place(monkeypatch)
    tok = varied[1]
    s = with_seed(SETTINGS["greedy"], 80)
    ids = encode_prompt(tok, PROMPTS[0])
    want = ar(pm_sticky, tok, ids, s, 48, eos=set())
    planted = [t if j % 7 != 3 else 0 for j, t in enumerate(want[0])]
    for _ in range(2):
        budget = Budget(CostCurve.linear(0.05), WINDOW)
        lookup = LookupProposer(ids[-4:] + planted + [0] + ids, max_draft=WINDOW - 1, prior=(9.0, 1.0))
        drafter = DraftPolicy(budget, ChainDrafter(budget), lookup)
        assert_same(pm_sticky, tok, ids, s, 48, {"drafter": drafter}, eos=set(), want=want)
    assert len(seen) >= 3, seen
    assert all(seen) if cut else not any(seen), (seen.count(True), seen.count(False))


@pytest.mark.parametrize("depth", [None, 1])
def test_builds_that_move_a_strands_rows_are_cut_through_the_move(pm_sticky, varied, monkeypatch, depth):
    """A build for a path through a token tree's strand reads the K/V buffers through its move of the strand's rows
    (``fixed.move_rows``: a gather and a slice update before the call): the cut walks that deep
    (``release.CUT_DEPTH``), so the call queued instead of such a build still writes the buffers in place. Cut only
    at the build's own outputs (depth 1, as before), those calls copy them."""
    import ptp_mlx.decode.ahead as ahead
    import ptp_mlx.decode.release as release

    if release._graph() is None:
        pytest.skip("ptp-graph is not built here")
    if depth is not None:
        monkeypatch.setattr(release, "CUT_DEPTH", depth)
    moved = []
    build_kind = ahead._build_kind

    def counted(sess, call, guesses, n, *a, **k):
        built = build_kind(sess, call, guesses, n, *a, **k)
        moved.append(built is not None and k.get("paths") is not None and k["paths"].rows(guesses, n) > 0)
        return built

    monkeypatch.setattr(ahead, "_build_kind", counted)
    seen = _watch_in_place(monkeypatch)
    _, tok = varied
    for k, prompt in enumerate(PROMPTS[:2]):
        s = with_seed(SETTINGS["greedy"], 31 + k)
        ids = encode_prompt(tok, prompt)
        want = ar(pm_sticky, tok, ids, s, 32)
        for seed in range(4):
            drafter = StrandKindTreeDrafter(want[0], width=WINDOW, seed=seed, p_right=0.6)
            assert_same(pm_sticky, tok, ids, s, 32, {"drafter": drafter}, want=want)
    assert sum(moved) >= 3 and len(seen) >= 3, (sum(moved), seen)
    assert all(seen) if depth is None else not all(seen), (seen.count(True), seen.count(False))


def test_without_the_extension_builds_go_at_once_and_answers_stay_exact(pm_sticky, varied, monkeypatch):
    """Where ``cut_buffers`` is not built (no compiler; a Mac), ``park`` keeps nothing: unused builds go as they come,
    before the next call is queued, and the answer is the autoregressive one."""
    import ptp_mlx.decode.release as release

    monkeypatch.setattr(release, "_graph", lambda: None)
    kept = []
    bury = pipeline.CallQueue.bury

    def watched(queue):
        kept.append(len(queue.grave))
        bury(queue)

    monkeypatch.setattr(pipeline.CallQueue, "bury", watched)
    monkeypatch.setattr(pipeline, "spare", lambda left, build: True)
    tok = varied[1]
    s = with_seed(SETTINGS["T1.0"], 81)
    ids = encode_prompt(tok, PROMPTS[1])
    want = ar(pm_sticky, tok, ids, s, 40, eos=set())
    budget = Budget(CostCurve.linear(0.05), WINDOW)
    lookup = LookupProposer(ids[-4:] + want[0] + ids, max_draft=WINDOW - 1, prior=(9.0, 1.0))
    drafter = DraftPolicy(budget, ChainDrafter(budget), lookup)
    assert_same(pm_sticky, tok, ids, s, 40, {"drafter": drafter}, eos=set(), want=want)
    assert len(kept) >= 5 and not any(kept), kept
