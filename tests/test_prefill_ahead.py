"""The answer's first PTP call planned and built while the prompt's last prefill chunk computes (``ar.prefill`` with
``wait=False``, ``DecodeSession.settle``): the same tokens as plain decoding, greedy and sampled, with a prompt
cache and without; the build is off the path (no ``build`` phase, as a chained call's); the prompt's time ends
where the prefill did; the prefill left in flight fills the cache as the waited one."""

import mlx.core as mx
import pytest

import ptp_mlx.decode.pipeline as pipeline
from ptp_mlx.decode.ar import prefill
from ptp_mlx.decode.call import PhaseClock
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.prompt_cache import PromptCache
from ptp_mlx.testing.decoding import PROMPTS, SETTINGS, ar, assert_same, with_seed


@pytest.fixture
def first_builds(monkeypatch):
    """Per build after the read: whether a prefill was still in flight, and whether it was counted on the path."""
    seen = []
    build = pipeline.CallQueue.build

    def spy(self, last, plan, i, on_path=True):
        seen.append((self.sess.prefilling is not None, on_path))
        return build(self, last, plan, i, on_path)

    monkeypatch.setattr(pipeline.CallQueue, "build", spy)
    return seen


@pytest.mark.parametrize("name", ["greedy", "T0.7-k20-p0.9", "T1.0"])
def test_the_first_call_is_built_while_the_prefill_computes_and_stays_exact(pm_sticky, varied, first_builds, name):
    tok = varied[1]
    ahead = 0
    for k, p in enumerate(PROMPTS[:3]):
        first_builds.clear()
        s = with_seed(SETTINGS[name], 70 + k)
        ids = encode_prompt(tok, p)
        assert_same(pm_sticky, tok, ids, s, 20, {})
        if first_builds:  # (an answer that starts with a burst builds its first step after the wait)
            assert first_builds[0] == (True, False), first_builds
            assert all(not prefilling and on_path for prefilling, on_path in first_builds[1:]), first_builds
            ahead += 1
    assert ahead >= 2


def test_the_first_call_has_no_build_phase_and_the_prompt_time_is_the_prefill(pm_sticky, varied):
    tok = varied[1]
    ids = encode_prompt(tok, PROMPTS[1])
    clock = PhaseClock()
    opts = DecodeOptions(mode="ptp", max_tokens=12, sampling=SETTINGS["greedy"], clock=clock)
    steps = list(stream_generate(pm_sticky, tok, ids, opts, eos_ids=set()))
    calls = [c for c in clock.calls if "rows" in c]
    first = clock.calls[0]
    assert "prefill" in first and "build" not in first and "chain" in first, first
    assert calls and [t for st in steps for t in st.tokens] == ar(pm_sticky, tok, ids, SETTINGS["greedy"], 12)[0]
    # the prompt's time ends where the prefill did: before the first block, and every step's elapsed after it
    assert steps[0].prompt_time > 0 and all(st.prompt_time == steps[0].prompt_time for st in steps)
    assert 0 < steps[0].elapsed <= steps[-1].elapsed


def test_a_follow_up_turn_on_a_prompt_cache_prefills_ahead_too(pm_sticky, varied, first_builds):
    """The second turn prefills only its new tokens (still more than one: the first call is built beside them)."""
    tok = varied[1]
    s = SETTINGS["greedy"]
    pc = PromptCache()
    messages = [{"role": "user", "content": "hello there"}]
    ids = encode_prompt(tok, messages)
    opts = DecodeOptions(mode="ptp", max_tokens=10, sampling=s)
    answer = [t for st in stream_generate(pm_sticky, tok, ids, opts, prompt_cache=pc) for t in st.tokens]
    messages += [{"role": "assistant", "content": tok.decode(answer)}, {"role": "user", "content": "more please"}]
    ids2 = encode_prompt(tok, messages)
    first_builds.clear()
    got = [t for st in stream_generate(pm_sticky, tok, ids2, opts, prompt_cache=pc) for t in st.tokens]
    assert pc.reused > len(ids) // 2 and got == ar(pm_sticky, tok, ids2, s, 10)[0]
    assert first_builds[0] == (True, False), first_builds


def test_prefill_left_in_flight_fills_the_cache_as_the_waited_one(pm_sticky):
    tokens = list(range(3, 40))
    waited, ahead = pm_sticky.make_cache(), pm_sticky.make_cache()
    assert prefill(pm_sticky.base, tokens, waited) is None
    state = prefill(pm_sticky.base, tokens, ahead, wait=False)
    assert state is not None and len(state) == 2 * len(ahead)
    mx.eval(state)
    assert prefill(pm_sticky.base, [], pm_sticky.make_cache(), wait=False) is None  # (nothing to leave in flight)
    for (k1, v1), (k2, v2) in zip(waited.contents(), ahead.contents(), strict=True):
        assert mx.array_equal(k1, k2).item() and mx.array_equal(v1, v2).item()
