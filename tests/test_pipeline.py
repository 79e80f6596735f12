"""Chained PTP calls (ptp_mlx/decode/pipeline.py): the next call built for every outcome of this one while it computes
(its inputs gathered on the device by the accepted count), queued right after the read when the drafter's real plan
is the guessed one. The output must stay the
autoregressive one token for token (greedy and sampled, EOS and the token limit inside a block, the cache's
growth, a conversation's carried cache, a consumer that stops with a call still queued)."""

from collections import Counter

import mlx.core as mx
import pytest

import ptp_mlx.decode.ahead as ahead
import ptp_mlx.decode.pipeline as pipeline
from ptp_mlx.drafting.policy import DraftingConfig
from ptp_mlx.drafting.protocol import Drafter, DraftPlan, Guess
from ptp_mlx.drafting.rows import fit_rows
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.model.kv import KVState
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.prompt_cache import PromptCache
from ptp_mlx.testing import OracleDrafter
from ptp_mlx.testing.decoding import PROMPTS, SETTINGS, WINDOW, ar, assert_same, with_seed


@pytest.fixture
def spy(monkeypatch):
    """Counts the chained calls (the default on every device) queued ("hit"), those dropped after the read ("miss")
    and those built ("built")."""
    seen = Counter()
    build, confirm = pipeline.build_chained, pipeline.confirm_chained

    def built(*a, **k):
        nxt = build(*a, **k)
        seen["built"] += nxt is not None
        return nxt

    def counted(chained, result, plan, i, cache, *more):
        call = confirm(chained, result, plan, i, cache, *more)
        seen["hit" if call is not None else "miss"] += 1
        if call is None and plan is not None:
            seen["last miss at"] = max(seen["last miss at"], i)
            seen["first miss at"] = min(seen.get("first miss at", i), i)
        if call is not None:  # one build serves every outcome: count the outcomes it served
            seen[f"hit after {result.accepted}"] += 1
        return call

    monkeypatch.setattr(pipeline, "build_chained", built)
    monkeypatch.setattr(pipeline, "confirm_chained", counted)
    return seen


@pytest.mark.parametrize("name", ["greedy", "T0.7-k20-p0.9", "T1.0-k50-p0.8", "T1.0"])
def test_pipelined_fixed_budget_calls_are_exact(pm_sticky, pm_random, varied, spy, name):
    tok = varied[1]
    accepted = Counter()
    for pm in (pm_sticky, pm_random):
        for n_draft in (1, 2, 3):
            for k, p in enumerate(PROMPTS[:3]):
                s = with_seed(SETTINGS[name], 30 + k)
                steps = assert_same(pm, tok, encode_prompt(tok, p), s, 20, {"num_draft_tokens": n_draft})
                accepted.update(st.accepted for st in steps)
    # Every chained build is decided once; a fixed budget's guess is its real plan, so only an answer's end drops
    # one: there the outcomes' next calls are clipped to the tokens left, differ in shape, and one build serves
    # the likeliest of them.
    assert spy["hit"] > 0 and spy["built"] == spy["hit"] + spy["miss"], spy
    assert spy["miss"] == 0 or spy["first miss at"] >= 20 - 3 * 3 - 1, spy  # (outcomes past the last 2k tokens)
    assert spy["hit after 0"] > 0 and sum(v for k, v in spy.items() if k.startswith("hit after ") and k[-1] != "0") > 0
    assert accepted[0] > 0 and sum(v for a, v in accepted.items() if a > 0) > 0, accepted  # both kinds of outcome


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8])
def test_pipelined_calls_with_eos_and_max_tokens_inside_a_block(pm_sticky, varied, spy, max_tokens):
    tok = varied[1]
    for name in ("greedy", "T1.0"):
        s = with_seed(SETTINGS[name], 9)
        ids = encode_prompt(tok, PROMPTS[0])
        full = ar(pm_sticky, tok, ids, s, 24, eos=set())[0]
        kw = {"num_draft_tokens": WINDOW - 1}
        steps = assert_same(pm_sticky, tok, ids, s, max_tokens, kw, eos=set())
        assert [t for st in steps for t in st.tokens] == full[:max_tokens]
        eos = {full[min(max_tokens, len(full) - 1)]}  # an end token inside some block
        steps = assert_same(pm_sticky, tok, ids, s, 24, kw, eos=eos)
        assert steps[-1].finish_reason in ("stop", "length")
    assert spy["hit"] > 0 or max_tokens < 5, spy  # (one or two calls leave nothing to queue ahead)


def test_pipelined_calls_across_the_cache_growth(pm_sticky, varied, spy):
    """mlx-lm's cache grows in steps of 256 rows: calls built ahead across that boundary stay exact."""
    tok = varied[1]
    ids = encode_prompt(tok, "abcdefgh " * 26)
    assert 230 < len(ids) < 256
    for name in ("greedy", "T1.0-k50-p0.8"):
        s = with_seed(SETTINGS[name], 2)
        for n_draft in (2, 3):
            assert_same(pm_sticky, tok, ids, s, 40, {"num_draft_tokens": n_draft})
    assert spy["hit"] > 0


def test_a_consumer_that_stops_with_a_call_queued_leaves_the_cache_consistent(pm_sticky, varied, spy):
    """A server's stop string ends the answer one call late: the call queued meanwhile leaves the carried cache,
    so the next turn reuses it and answers exactly as a fresh cache would."""
    tok = varied[1]
    for s in (SETTINGS["greedy"], with_seed(SETTINGS["T1.0"], 3)):
        pc = PromptCache()
        opts = DecodeOptions(mode="ptp", max_tokens=16, sampling=s, drafting=DraftingConfig(3), chain=True)
        messages = [{"role": "user", "content": "hello there"}]
        ids = encode_prompt(tok, messages)
        gen = stream_generate(pm_sticky, tok, ids, opts, eos_ids=set(), prompt_cache=pc)
        first = [next(gen), next(gen)]
        gen.close()  # stopped by the consumer, the next call possibly queued
        assert pc.cache is not None and pc.cache[0].offset == len(pc.tokens)
        answer = [t for st in first for t in st.tokens]
        assert pc.tokens == (ids + answer)[: len(pc.tokens)] and len(pc.tokens) >= len(ids)
        messages += [{"role": "assistant", "content": tok.decode(answer)}, {"role": "user", "content": "more"}]
        ids2 = encode_prompt(tok, messages)
        got = [t for st in stream_generate(pm_sticky, tok, ids2, opts, prompt_cache=pc) for t in st.tokens]
        assert pc.reused > len(ids) // 2
        assert got == [t for st in stream_generate(pm_sticky, tok, ids2, opts) for t in st.tokens]
    assert spy["hit"] > 0


def test_the_kv_cache_never_writes_into_an_earlier_state():
    """Building ahead needs a state that later writes leave alone (snapshots are by value)."""
    st = KVState(1)
    c = st[0]
    c.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    snap = st.snapshot()
    keys, values, offset = snap[0][0], snap[1][0], snap[2]
    mx.eval(keys, values)
    before = float(keys.sum())
    st.trim(1)
    c.update_and_fetch(5 * mx.ones((1, 2, 2, 4)), 5 * mx.ones((1, 2, 2, 4)))
    assert float(keys.sum()) == before and float(values.sum()) == before and offset == 3
    assert st.offset == 4 and float(st.contents()[0][0].sum()) == 2 * 8 + 2 * 8 * 5
    st.restore(snap)
    assert st.offset == 3 and float(st.contents()[0][0].sum()) == before


def test_the_default_learns_whether_building_ahead_pays_and_stays_exact(pm_sticky, varied, spy):
    """``chain=None`` (the default): calls alternate between built ahead and built after the read until both ways are
    measured (``ChainChoice``), then follow the measured choice; every answer is the autoregressive one."""
    from ptp_mlx.decode.chain_odds import ChainChoice

    tok = varied[1]
    pm_sticky.__dict__["_chain_choice"] = choice = ChainChoice()  # (a fresh one: other tests used this model)
    for k, s in enumerate((SETTINGS["greedy"], with_seed(SETTINGS["T1.0"], 4))):
        ids = encode_prompt(tok, PROMPTS[k])
        opts = DecodeOptions(mode="ptp", max_tokens=40, sampling=s, drafting=DraftingConfig(3))
        got = [t for st in stream_generate(pm_sticky, tok, ids, opts) for t in st.tokens]
        assert got == ar(pm_sticky, tok, ids, s, 40)[0]
    assert choice.calls > 0 and min(choice.reads) > 0 and choice.saving is not None
    assert spy["built"] > 0  # (some built ahead, while it was being learnt at least)


def test_what_an_answer_learnt_is_kept_for_the_next_process(pm_sticky, varied, tmp_path):
    """The learnt choice kept on disk (``choice_at``) is written when an answer ends, and a new process (a fresh
    choice read from the file) starts from what it measured."""
    from ptp_mlx.decode.chain_odds import choice_at

    tok = varied[1]
    path = tmp_path / "chain-choice-k.json"
    choice = choice_at(pm_sticky, path)
    ids = encode_prompt(tok, PROMPTS[0])
    opts = DecodeOptions(mode="ptp", max_tokens=40, sampling=SETTINGS["greedy"], drafting=DraftingConfig(3))
    got = [t for st in stream_generate(pm_sticky, tok, ids, opts) for t in st.tokens]
    assert got == ar(pm_sticky, tok, ids, SETTINGS["greedy"], 40)[0]
    assert sum(choice.reads) > 0 and path.exists()
    again = choice_at(pm_sticky, path)
    assert again is not choice and again.reads == choice.reads and again.calls == choice.calls
    pm_sticky.__dict__.pop("_chain_choice")  # (other tests: this process only)


def test_no_build_ahead_when_switched_off(pm_sticky, varied, spy):
    tok = varied[1]
    ids = encode_prompt(tok, PROMPTS[0])
    opts = DecodeOptions(mode="ptp", max_tokens=16, drafting=DraftingConfig(2), chain=0)
    got = [t for st in stream_generate(pm_sticky, tok, ids, opts) for t in st.tokens]
    assert got == ar(pm_sticky, tok, ids, SETTINGS["greedy"], 16)[0]
    assert spy["built"] == 0 and spy["hit"] == 0 and spy["miss"] == 0


class KnownDraftsOracle(OracleDrafter):
    """An oracle whose next call is known to the host for every outcome (the way a lookup continuation is):
    ``guess`` returns the real next plan with its drafts as tokens, not as rows of the current call."""

    def guess(self, plan, accepted, i, remaining, room):
        return Guess(self.plan(i, remaining, room), None)


@pytest.mark.parametrize("name", ["greedy", "T1.0-k50-p0.8"])
def test_calls_with_drafts_the_host_knows_are_chained_and_exact(pm_sticky, varied, spy, name):
    """Chained calls whose drafts are host tokens gathered by the outcome (``Guess.draft_rows`` None): every outcome
    is guessed right, so every build is queued; drafts right and wrong, the answer is the autoregressive one."""
    tok = varied[1]
    s = with_seed(SETTINGS[name], 5)
    ids = encode_prompt(tok, PROMPTS[1])
    want, _ = ar(pm_sticky, tok, ids, s, 40)
    drafts = [t if k % 5 else (t + 7) % 200 + 3 for k, t in enumerate(want)]  # every fifth draft wrong
    opts = DecodeOptions(mode="ptp", max_tokens=40, sampling=s, drafter=KnownDraftsOracle(drafts, 4), chain=True)
    steps = list(stream_generate(pm_sticky, tok, ids, opts))
    assert [t for st in steps for t in st.tokens] == want
    # (near the answer's end the oracle's drafts run out, its outcomes' next calls differ in shape, and the one
    # build serves the likeliest: the last calls may drop theirs)
    assert spy["hit"] > 3 and spy["miss"] <= 2 and spy["first miss at"] >= len(want) - 2 * 4, spy
    assert len({k for k in spy if k.startswith("hit after ")}) > 1  # several outcomes served by host tokens


def test_each_chained_call_is_charged_its_own_queueing(pm_sticky, varied, monkeypatch):
    """On MLX's CPU backend ``async_eval`` returns only near the end of the graph, so the time spent queueing a
    chained call (in the iteration before it) is that call's compute. On a clock that moves only while a call is
    queued (a fixed cost per queueing), every call and step must be charged exactly one queueing, and the total
    must be the clock's."""
    from types import SimpleNamespace

    import ptp_mlx.decode.ar as ar_mod
    import ptp_mlx.decode.ptp as ptp_mod

    fake = SimpleNamespace(now=0.0)
    clock = SimpleNamespace(perf_counter=lambda: fake.now)
    real = mx.async_eval

    def queue(*arrays):
        fake.now += 1.0
        return real(*arrays)

    for module in (ptp_mod, pipeline, ar_mod):
        monkeypatch.setattr(module, "time", clock)
    monkeypatch.setattr(mx, "async_eval", queue)
    tok = varied[1]
    s = with_seed(SETTINGS["greedy"], 3)
    for kw in ({"drafting": DraftingConfig(2)}, {"mode": "ar"}):
        mode = kw.pop("mode", "ptp")
        opts = DecodeOptions(mode=mode, max_tokens=24, sampling=s, **kw)
        start = fake.now
        steps = list(stream_generate(pm_sticky, tok, encode_prompt(tok, PROMPTS[0]), opts))
        times = [st.step_time for st in steps]
        assert times == [1.0] * len(steps), (mode, times)
        assert fake.now - start >= len(steps)  # (the prefill may queue too)


class TwoKinds(Drafter):
    """Verifies up to two of the adapter's drafts in hand, with a branch at every depth ``d`` of ``2 + d`` rows: after
    outcome 0 the next call verifies one draft, after the others two, so the outcomes' next calls are of two kinds
    (one build each); it tells every outcome's next call ahead (``guess``), so no build is dropped for a wrong
    guess."""

    def __init__(self) -> None:
        self.drafts: list[int] = []

    @staticmethod
    def _shape(in_hand: int, remaining: int, room: int) -> tuple[int, list[tuple[int, int]]]:
        n = min(in_hand, 2)
        return fit_rows(n, [(d, 2 + d) for d in range(n + 1)], remaining, room, 2)

    def plan(self, i: int, remaining: int, room: int) -> DraftPlan:
        n, branches = self._shape(len(self.drafts), remaining, room)
        return DraftPlan(self.drafts[:n], branches)

    def guess(self, plan, accepted, i, remaining, room):
        rows = plan.branch_rows(accepted)
        r, w = rows if rows is not None else (0, 1)
        n, branches = self._shape(w - 1, remaining, room)
        return Guess(DraftPlan([0] * n, branches), [r + 1 + k for k in range(n)])

    def likely(self, plan):
        # every draft standing said likeliest: with a random adapter outcome 0 is the usual one, served by the
        # other kind's build
        return [0.2] * len(plan.drafts) + [0.6]

    def update(self, plan, result) -> None:
        rows = plan.branch_rows(result.accepted, result.strand)
        r, w = rows if rows is not None else (0, 1)
        self.drafts = result.aux_tokens[r + 1 : r + w]


@pytest.mark.parametrize("name", ["greedy", "T1.0"])
def test_outcomes_of_another_kind_run_their_own_build_and_stay_exact(pm_sticky, pm_random, varied, monkeypatch, name):
    """Where the outcomes' next calls differ in shape, a second build serves the other kind once its graph is
    compiled: reads that report such an outcome queue that build (the cache takes the state after it), and the
    answer is the autoregressive one token for token."""
    seen = Counter()
    confirm = pipeline.confirm_chained

    def counted(chained, result, plan, i, cache, *more):
        hit = chained.pick(result.accepted) if result.strand is None else None
        call = confirm(chained, result, plan, i, cache, *more)
        kind = "none" if hit is None else "other" if hit.state is not None else "likeliest"  # (none: not compiled yet)
        if call is not None or (plan is not None and not result.resolved):  # (not the answer's end)
            seen[f"{'hit' if call is not None else 'miss'} {kind}"] += 1
        return call

    monkeypatch.setattr(pipeline, "confirm_chained", counted)
    monkeypatch.setattr(pipeline, "spare", lambda left, build: True)  # (as on a GPU: time for a second build)
    tok = varied[1]
    for pm in (pm_sticky, pm_random):
        for k, p in enumerate(PROMPTS[:2]):
            s = with_seed(SETTINGS[name], 60 + k)
            assert_same(pm, tok, encode_prompt(tok, p), s, 40, {"drafter": TwoKinds()})
    assert seen["hit other"] >= 3 and seen["hit likeliest"] >= 3, seen
    assert seen["miss other"] + seen["miss likeliest"] == 0, seen  # (every guess is the real plan)


def test_a_second_build_only_with_time_to_spare():
    # (seconds) the read's wait after one build against one build's time; nothing measured yet: one build
    assert not pipeline.spare(None, 0.004) and not pipeline.spare(0.01, None)
    assert pipeline.spare(0.010, 0.004)  # a GPU: the call's compute hides a second build
    assert not pipeline.spare(0.002, 0.004)  # this CPU: the build shares the cores, the read waits little


def test_builds_go_to_the_outcomes_whose_guesses_the_read_confirms():
    """``Confirmed`` weighs each outcome's chance by how often guesses of its kind (after calls of the same source)
    were the real next plan: a lookup chain of 3 drafts whose every fall was followed by something other than the
    adapter's guess, and whose full hit was continued as guessed, builds for the full hit even where a fall is
    likelier; unjudged kinds stay at one half; the counts fade."""
    adapter = Guess(DraftPlan([0, 0], [(2, 3)], source="ptp"), [1, 2])
    lookup = Guess(DraftPlan([5, 6, 7], [(3, 2)], source="lookup"), None)
    guesses = [adapter, adapter, adapter, lookup]
    likely = [0.3, 0.2, 0.1, 0.4]  # P(c == g): the falls together 0.6
    conf = pipeline.Confirmed()
    fresh = conf.weigh("lookup", guesses, likely)
    assert fresh == pytest.approx([0.15, 0.1, 0.05, 0.2])  # (prior: one half each)
    assert ahead._by_kind(guesses, fresh)[0][3] is None  # the falls' kind first: 0.3 against 0.2
    for _ in range(6):
        conf.judge("lookup", adapter, hit=False)
        conf.judge("lookup", lookup, hit=True)
    weighed = conf.weigh("lookup", guesses, likely)
    assert weighed[3] > sum(weighed[:3])
    first = ahead._by_kind(guesses, weighed)[0]
    assert first[3] is lookup and first[:3] == [None, None, None]
    assert conf.rate(("ptp", "ptp")) == 0.5  # another call's kind: not judged yet
    assert conf.weigh("ptp", [None, adapter], None) == [1.0, 0.5]  # (no likely: all alike; no guess: unweighed)
    many = pipeline.Confirmed()
    for _ in range(200):
        many.judge("lookup", lookup, hit=False)
    for _ in range(40):  # the counts fade: a kind that starts to be confirmed is soon weighed up again
        many.judge("lookup", lookup, hit=True)
    assert many.rate(("lookup", "lookup")) > 0.8


class CommittingTwoKinds(TwoKinds):
    """``TwoKinds`` that commits to any guess whose drafts are the ones in hand (``Drafter.commit``), counting its
    plans and its commits."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = Counter()

    def plan(self, i, remaining, room):
        self.seen["planned"] += 1
        return super().plan(i, remaining, room)

    def commit(self, plan, i):
        ok = list(plan.drafts) == list(self.drafts[: len(plan.drafts)])
        self.seen["committed" if ok else "refused"] += 1
        return plan if ok else None


@pytest.mark.parametrize("name", ["greedy", "T1.0"])
def test_an_outcome_no_build_served_runs_its_guess_without_planning(pm_sticky, pm_random, varied, monkeypatch, name):
    """One build a call (no time to spare), outcomes of two kinds: a read that reports an outcome of the kind not
    built hands its guess to the drafter (``CallQueue.guessed_plan``), which commits to it: the call is built after
    the read but not planned; every answer is the autoregressive one."""
    seen = Counter()
    guessed = pipeline.CallQueue.guessed_plan

    def counted(self, result):
        out = guessed(self, result)
        if out is not None and self.chained_plan(result) is None:
            seen["unbuilt"] += 1
        return out

    monkeypatch.setattr(pipeline.CallQueue, "guessed_plan", counted)
    monkeypatch.setattr(pipeline, "spare", lambda left, build: False)
    tok = varied[1]
    drafters = []
    for pm in (pm_sticky, pm_random):
        for k, p in enumerate(PROMPTS[:2]):
            drafters.append(CommittingTwoKinds())
            s = with_seed(SETTINGS[name], 60 + k)
            assert_same(pm, tok, encode_prompt(tok, p), s, 40, {"drafter": drafters[-1]})
    total = sum((d.seen for d in drafters), Counter())
    assert seen["unbuilt"] >= 3 and total["refused"] == 0, (seen, total)
    # planned only where nothing was guessed: each answer's first call (the rest were committed, built or not)
    assert total["planned"] == len(drafters) and total["committed"] >= seen["unbuilt"] + 3, total


def test_the_reads_bookkeeping_waits_until_the_next_call_is_queued(pm_sticky, varied, monkeypatch):
    """After a read whose call built ahead runs, nothing but the decision is on the critical path: the judgments of
    what was built ahead (``CallQueue.catch_up``: ``Confirmed.judge``) come after that call is queued, and before
    the call after it is built (the guesses read them). The answer stays the autoregressive one."""
    import ptp_mlx.decode.chain_odds as chain_odds

    events = []
    submit, confirm, chain = pipeline.CallQueue.submit, pipeline.CallQueue.confirm, pipeline.CallQueue.chain
    judge = chain_odds.Confirmed.judge

    def confirmed(queue, *a):
        ready = confirm(queue, *a)
        events.append(("confirm", ready))
        return ready

    monkeypatch.setattr(pipeline.CallQueue, "submit", lambda q: events.append(("submit",)) or submit(q))
    monkeypatch.setattr(pipeline.CallQueue, "confirm", confirmed)
    monkeypatch.setattr(pipeline.CallQueue, "chain", lambda q: events.append(("chain",)) or chain(q))
    monkeypatch.setattr(chain_odds.Confirmed, "judge", lambda c, *a: events.append(("judge",)) or judge(c, *a))
    tok = varied[1]
    s = with_seed(SETTINGS["T1.0"], 12)
    assert_same(pm_sticky, tok, encode_prompt(tok, PROMPTS[1]), s, 24, {"num_draft_tokens": 3})
    hits = [k for k, e in enumerate(events) if e == ("confirm", True)]
    assert len(hits) >= 3, events
    for k in hits:
        after = [e[0] for e in events[k + 1 :] if e[0] in ("submit", "judge", "chain")]
        assert after[:3] == ["submit", "judge", "chain"], events[k : k + 6]
