"""The PTP call after an autoregressive burst, built while the burst's last step computes
(``decode/pipeline.py: build_after_burst``) and queued when the drafter's plan after the read is the one it was built
for; and the drafts in hand dropped by a burst (``ChainDrafter.emitted``). The output must stay the autoregressive
one token for token: greedy and sampled, guesses right and wrong, EOS and the token limit inside a burst, a consumer
that stops with the call built."""

from collections import Counter

import pytest

import ptp_mlx.decode.pipeline as pipeline
from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.chain import ChainDrafter
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.protocol import CallResult, Drafter, DraftPlan
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.prompt_cache import PromptCache
from ptp_mlx.testing.decoding import PROMPTS, SETTINGS, ar, assert_same, with_seed


class BurstyDrafter(Drafter):
    """Alternates bursts of ``burst`` plain steps with a priming call (no drafts, one branch of ``width`` rows at
    depth 0), and tells that call ahead (``guess_start``); every ``wrong``-th guess is another width, so the read
    drops its build."""

    def __init__(self, burst: int = 3, width: int = 3, wrong: int = 0):
        self.burst, self.width, self.wrong = burst, width, wrong
        self.calls = self.guesses = 0

    def _priming(self, remaining: int, room: int, width: int) -> DraftPlan:
        w = min(width, remaining + 1, room - 1)
        return DraftPlan([], [(0, w)] if w >= 2 else [])

    def plan(self, i: int, remaining: int, room: int) -> DraftPlan:
        self.calls += 1
        if self.calls % 2:
            return DraftPlan([], [], burst=min(self.burst, remaining))
        return self._priming(remaining, room, self.width)

    def guess_start(self, i: int, remaining: int, room: int) -> DraftPlan | None:
        self.guesses += 1
        off = self.wrong and self.guesses % self.wrong == 0
        return self._priming(remaining, room, self.width + (1 if off else 0))

    def update(self, plan: DraftPlan, result: CallResult) -> None:
        pass


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls built after a burst ("built"), queued ("hit") and dropped ("miss")."""
    seen = Counter()
    build, confirm = pipeline.build_after_burst, pipeline.confirm_after_burst

    def built(*a, **k):
        out = build(*a, **k)
        seen["built"] += out is not None
        return out

    def counted(*a, **k):
        call = confirm(*a, **k)
        seen["hit" if call is not None else "miss"] += 1
        return call

    monkeypatch.setattr(pipeline, "build_after_burst", built)
    monkeypatch.setattr(pipeline, "confirm_after_burst", counted)
    return seen


@pytest.mark.parametrize("name", ["greedy", "T0.7-k20-p0.9", "T1.0"])
@pytest.mark.parametrize("wrong", [0, 2])
def test_calls_after_bursts_are_chained_and_exact(pm_sticky, varied, spy, name, wrong):
    tok = varied[1]
    for k, p in enumerate(PROMPTS[:2]):
        s = with_seed(SETTINGS[name], 40 + k)
        ids = encode_prompt(tok, p)
        for burst in (1, 3):
            assert_same(pm_sticky, tok, ids, s, 24, {"drafter": BurstyDrafter(burst, 3, wrong)})
    # Every build is decided once, but where the answer ends inside the burst (at most once per answer).
    assert spy["hit"] > 4 and 0 <= spy["built"] - spy["hit"] - spy["miss"] <= 4, spy
    if wrong:
        assert spy["miss"] > 2, spy  # (wrong guesses are dropped, and the answer is still the same)
    else:
        assert spy["miss"] == 0, spy


@pytest.mark.parametrize("max_tokens", [2, 4, 7, 9])
def test_calls_after_bursts_with_eos_and_max_tokens_inside(pm_sticky, varied, spy, max_tokens):
    tok = varied[1]
    for name in ("greedy", "T1.0"):
        s = with_seed(SETTINGS[name], 11)
        ids = encode_prompt(tok, PROMPTS[0])
        full = ar(pm_sticky, tok, ids, s, 24, eos=set())[0]
        steps = assert_same(pm_sticky, tok, ids, s, max_tokens, {"drafter": BurstyDrafter(3)}, eos=set())
        assert [t for st in steps for t in st.tokens] == full[:max_tokens]
        eos = {full[min(max_tokens, len(full) - 1)]}  # an end token inside a burst or a call
        assert_same(pm_sticky, tok, ids, s, 24, {"drafter": BurstyDrafter(3)}, eos=eos)


def test_a_consumer_that_stops_after_the_build_leaves_the_cache_consistent(pm_sticky, varied, spy):
    """Stopped on the burst's second-to-last token (the next call already built on the last): the carried cache
    holds exactly the answer so far, and the next turn answers as with a fresh cache."""
    tok = varied[1]
    s = SETTINGS["greedy"]
    pc = PromptCache()
    messages = [{"role": "user", "content": "hello there"}]
    ids = encode_prompt(tok, messages)
    opts = DecodeOptions(mode="ptp", max_tokens=16, sampling=s, drafter=BurstyDrafter(3))
    gen = stream_generate(pm_sticky, tok, ids, opts, eos_ids=set(), prompt_cache=pc)
    first = [next(gen), next(gen)]  # two of the burst's three tokens: the call after it is built
    assert spy["built"] == 1
    gen.close()
    assert pc.cache is not None and pc.cache[0].offset == len(pc.tokens)
    answer = [t for st in first for t in st.tokens]
    assert pc.tokens == (ids + answer)[: len(pc.tokens)]
    messages += [{"role": "assistant", "content": tok.decode(answer)}, {"role": "user", "content": "more"}]
    ids2 = encode_prompt(tok, messages)
    opts2 = DecodeOptions(mode="ptp", max_tokens=16, sampling=s, drafter=BurstyDrafter(3))
    got = [t for st in stream_generate(pm_sticky, tok, ids2, opts2, prompt_cache=pc) for t in st.tokens]
    assert pc.reused > len(ids) // 2
    assert got == ar(pm_sticky, tok, ids2, s, 16)[0]


def test_a_burst_drops_the_adapter_drafts_in_hand():
    """Drafts predict the positions right after the call that made them: a burst's tokens move past those, so the
    chain drafter's next plan verifies none of them (and the budget calibrates on none)."""
    budget = Budget(CostCurve(), max_width=4)
    chain = ChainDrafter(budget)
    plan = DraftPlan([], [(0, 4)])
    result = CallResult([7], 0, aux_tokens=[7, 8, 9, 10], aux_conf=[0.9, 0.9, 0.9, 0.9])
    chain.update(plan, result)
    chain.emitted(result.block)  # the call's own block: its drafts stand
    assert chain.drafts == [8, 9, 10] and chain.plan(1, 20, 100).drafts == (8, 9, 10)
    chain.update(plan, result)
    chain.emitted(result.block)
    chain.emitted([5])  # a burst's token
    assert chain.drafts == [] and chain.conf == []
    assert chain.plan(2, 20, 100).drafts == ()


class StoppedDrafter(BurstyDrafter):
    """Bursts of 6 plain steps that a chain in hand ends after 2 (``ready``, as a prompt-lookup match does), then
    that chain's call: the plain answer's next tokens (``answer``) as drafts, told ahead on the burst's last token
    before it is read (``guess_start``, as ``DraftPolicy`` guesses a lookup chain); every ``wrong``-th guess drafts
    another first token, so the read drops its build."""

    def __init__(self, answer: list[int], wrong: int = 0):
        super().__init__(6, 3, wrong)
        self.answer, self.since_burst = answer, 0

    def _chain(self, i: int, remaining: int) -> DraftPlan:
        return DraftPlan(list(self.answer[i : i + min(2, max(0, remaining - 1))]), [], source="lookup")

    def plan(self, i: int, remaining: int, room: int) -> DraftPlan:
        self.calls += 1
        if self.calls % 2:
            self.since_burst = 0
            return DraftPlan([], [], burst=min(6, remaining))
        return self._chain(i, remaining)

    def emitted(self, tokens: list[int]) -> None:
        self.since_burst += len(tokens)

    def ready(self) -> bool:
        return self.since_burst >= 2

    def guess_start(self, i: int, remaining: int, room: int) -> DraftPlan | None:
        self.guesses += 1
        plan = self._chain(i, remaining)
        if self.wrong and self.guesses % self.wrong == 0 and plan.drafts:
            plan = DraftPlan([plan.drafts[0] + 1, *plan.drafts[1:]], [], source="lookup")
        return plan


@pytest.mark.parametrize("name", ["greedy", "T1.0"])
@pytest.mark.parametrize("wrong", [0, 2])
def test_a_chain_that_ends_a_burst_is_built_on_its_last_token(pm_sticky, varied, spy, name, wrong):
    """The burst stopped early: the call after it, with drafts guessed before the last token is read, is built
    while that step computes, queued when the read confirms the guess, dropped otherwise; the answer stays the
    plain one."""
    tok = varied[1]
    s = with_seed(SETTINGS[name], 7)
    ids = encode_prompt(tok, PROMPTS[0])
    answer = ar(pm_sticky, tok, ids, s, 24, eos=set())[0]
    assert_same(pm_sticky, tok, ids, s, 24, {"drafter": StoppedDrafter(answer, wrong)}, eos=set())
    assert spy["hit"] >= 1, spy
    assert (spy["miss"] >= 1) == bool(wrong), spy
