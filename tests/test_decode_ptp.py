"""The PTP loop on the decode floor (ptp_mlx/decode/ptp.py) and its call queue (ptp_mlx/decode/pipeline.py):
``stream_generate`` gets one block per call and nothing else from decode or drafting; the queue gives the cache back
its accepted path however an answer stops."""

import sys

import pytest

from ptp_mlx.decode import pipeline
from ptp_mlx.drafting.policy import DraftingConfig
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.prompt_cache import PromptCache
from ptp_mlx.testing.decoding import PROMPTS, SETTINGS, ar, with_seed

LOWER = ("/ptp_mlx/decode/", "/ptp_mlx/drafting/")


def _returns_into_generate(steps_of) -> list[int]:
    """Per step ``steps_of()`` yields, how many frames of decode/ or drafting/ returned (or yielded) into a frame of
    ``generate.py`` since the step before it."""
    count = [0]

    def profile(frame, event, arg):
        back = frame.f_back
        if event == "return" and back is not None and back.f_code.co_filename.endswith("/ptp_mlx/generate.py"):
            if any(part in frame.f_code.co_filename for part in LOWER):
                count[0] += 1

    per_step = []
    it = steps_of()
    sys.setprofile(profile)
    try:
        before = None
        for _ in it:
            if before is not None:
                per_step.append(count[0] - before)
            before = count[0]
    finally:
        sys.setprofile(None)
    return per_step


@pytest.mark.parametrize("kw", [{}, {"drafting": DraftingConfig(2)}])
def test_stream_generate_hears_from_the_decode_floor_once_per_call(pm_sticky, varied, kw):
    tok = varied[1]
    ids = encode_prompt(tok, PROMPTS[0])
    opts = DecodeOptions(mode="ptp", max_tokens=32, sampling=with_seed(SETTINGS["greedy"], 1), **kw)
    per_step = _returns_into_generate(lambda: stream_generate(pm_sticky, tok, ids, opts))
    assert len(per_step) >= 5 and set(per_step) == {1}, per_step


def test_the_return_counter_sees_a_second_call_into_the_decode_floor(pm_sticky, varied, monkeypatch):
    """The counter itself: when ``stream_generate`` also calls a decode function per step, it counts 2 a step (so the
    test above can fail)."""
    from functools import partial

    from ptp_mlx import generate
    from ptp_mlx.decode import session

    monkeypatch.setattr(generate, "_peak_gb", partial(session.vocab_size, pm_sticky))  # (called once per step)
    tok = varied[1]
    ids = encode_prompt(tok, PROMPTS[1])
    opts = DecodeOptions(mode="ptp", max_tokens=16, sampling=with_seed(SETTINGS["greedy"], 1))
    assert set(_returns_into_generate(lambda: stream_generate(pm_sticky, tok, ids, opts))) == {2}


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5])
def test_a_stopped_answer_leaves_the_cache_at_its_accepted_path(pm_sticky, varied, stop_after, monkeypatch):
    """Closing the generator with calls in flight (queued, chained, built after a burst) leaves the stored cache
    holding exactly the prompt and the tokens handed out, so the next turn continues exactly."""
    abandoned = []
    real = pipeline.CallQueue.abandon

    def spied(self):
        abandoned.append((self.running is not None, self.chained is not None, self.started is not None))
        real(self)

    monkeypatch.setattr(pipeline.CallQueue, "abandon", spied)
    tok = varied[1]
    s = with_seed(SETTINGS["T1.0"], 7)
    ids = encode_prompt(tok, PROMPTS[2])
    cache = PromptCache()
    got = []
    opts = DecodeOptions(mode="ptp", max_tokens=40, sampling=s)
    for k, st in enumerate(stream_generate(pm_sticky, tok, ids, opts, prompt_cache=cache)):
        got += st.tokens
        if k + 1 == stop_after:
            break
    assert abandoned, "the queue was not asked to give its calls back"
    assert any(abandoned), abandoned  # (some stop found a call in flight)
    # The stored cache holds the prompt and the tokens handed out, the last one excepted (every call feeds it).
    assert cache.cache.offset == len(ids) + len(got) - 1 and cache.tokens == (ids + got)[:-1]
    # The next turn from the stored cache is the plain decoding of the whole conversation so far.
    follow = ids + got + encode_prompt(tok, "and then?", chat=False)
    want, _ = ar(pm_sticky, tok, follow, s, 12)
    opts = DecodeOptions(mode="ptp", max_tokens=12, sampling=s)
    again = [t for st in stream_generate(pm_sticky, tok, follow, opts, prompt_cache=cache) for t in st.tokens]
    assert again == want and cache.reused > 0
