"""The fast pick (sampler.py, ``pick(fast=True)``): it sorts the likeliest ``CANDIDATES`` tokens only, answers
what the full sort answers wherever it answers, and leaves the other rows ``UNRESOLVED`` for the host to settle
from the same logits (``resolve``). Decoding with it stays exact: plain decoding and PTP resolve the same rows, a
call or step queued on an unresolved token runs again, and the tokens equal those of the full sort."""

import mlx.core as mx
import numpy as np
import pytest

import ptp_mlx.decode.ar as ar_mod
import ptp_mlx.decode.call as call_mod
import ptp_mlx.decode.pipeline as pipeline
from ptp_mlx import sampler
from ptp_mlx.drafting.protocol import CallResult, Drafter, DraftPlan
from ptp_mlx.model.ptp import PTPModel
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import UNRESOLVED, SamplingSettings, may_leave_unresolved, pick, resolve
from ptp_mlx.testing.decoding import BUDGETS, PROMPTS, WINDOW, ar, assert_same, with_seed

CASES = [  # (order, temperature, top_p, logit scale)
    ("prob", 0.7, 0.95, 3.0),
    ("prob", 1.0, 1.0, 3.0),
    ("prob", 1.0, 0.9, 0.3),
    ("prob", 0.5, 0.99, 6.0),
    ("id", 0.7, 0.95, 3.0),
    ("id", 1.0, 0.9, 0.3),
]


def _logits(rows: int, vocab: int, scale: float, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, vocab)) * scale
    x = np.where(rng.random(x.shape) < 0.3, np.round(x), x)  # many exact ties, some at the head's edge
    return mx.array(x.astype(np.float32))


@pytest.mark.parametrize("top_ids", ["1", "0"])  # the candidates by the CPU primitive, or by MLX's argpartition
@pytest.mark.parametrize("order,t,top_p,scale", CASES)
def test_fast_pick_answers_what_the_full_sort_answers(order, t, top_p, scale, top_ids, monkeypatch):
    monkeypatch.setenv("PTP_MLX_TOP_IDS", top_ids)
    lg = _logits(96, 3000, scale, seed=int(10 * t + 100 * top_p))
    u = mx.array(np.random.default_rng(3).random(96, dtype=np.float32))
    s = SamplingSettings(t, 0, top_p, order=order)
    full = np.array(pick(u, lg, t, 0, top_p, check=False, order=order))
    fast = np.array(pick(u, lg, t, 0, top_p, check=False, order=order, fast=True))
    unresolved = fast == UNRESOLVED
    assert (fast[~unresolved] == full[~unresolved]).all()
    settled = [resolve(float(u[i].item()), lg[i], s) for i in np.flatnonzero(unresolved)]
    assert settled == full[unresolved].tolist()


def test_fast_pick_leaves_rows_unresolved_and_answers_most():
    """Both kinds of row occur (so the test above checks both), and a sharp distribution is settled at once."""
    lg, u = _logits(64, 3000, 3.0, seed=0), mx.array(np.linspace(0.01, 0.999, 64, dtype=np.float32))
    flat = np.array(pick(u, lg, 1.0, 0, 1.0, check=False, order="prob", fast=True))
    assert 0 < (flat == UNRESOLVED).sum() < 64
    sharp = np.array(pick(u, lg * 4, 0.7, 0, 0.95, check=False, order="prob", fast=True))
    assert (sharp != UNRESOLVED).all()


def test_fast_pick_applies_only_where_the_full_pick_sorts():
    v = 3000
    assert may_leave_unresolved(SamplingSettings(0.7, 0, 0.95, order="prob"), v)
    assert may_leave_unresolved(SamplingSettings(0.7, 0, 0.95), v)  # id order, the nucleus needs a sort
    assert not may_leave_unresolved(SamplingSettings(0.7, 0, 1.0), v)  # id order, no sort at all
    assert not may_leave_unresolved(SamplingSettings(0.7, 50, 0.95, order="prob"), v)  # top-k: a partition
    assert not may_leave_unresolved(SamplingSettings(0.0, order="prob"), v)  # greedy
    assert not may_leave_unresolved(SamplingSettings(0.7, order="prob"), sampler.CANDIDATES)
    lg = _logits(4, v, 1.0, seed=1)
    u = mx.array([0.999] * 4, dtype=mx.float32)
    out = pick(u, lg, 0.7, 50, 0.95, check=False, order="prob", fast=True)
    assert (np.array(out) >= 0).all()


def test_non_finite_rows_still_give_minus_one():
    lg = mx.concatenate([_logits(1, 3000, 1.0, seed=2), mx.full((1, 3000), -mx.inf)])
    out = pick(mx.array([0.5, 0.5]), lg, 1.0, 0, 0.9, check=False, order="prob", fast=True)
    assert int(out[1].item()) == -1


# ---- decoding: the tiny model's vocabulary (259) with a head of 3 tokens, so rows are often left unresolved ----


@pytest.fixture(scope="module")
def pms(varied, pm_sticky):
    """The decoding order is the adapter's: one model per order (the same weights and adapter)."""
    model, _ = varied
    prob = PTPModel(model, pm_sticky.adapter, {"window": WINDOW, "cdf_order": "prob"}, fuse=True)
    return {"id": pm_sticky, "prob": prob}


def _fresh_banks(pms) -> None:
    for pm in pms.values():  # (a bank's compiled graphs hold the head size they were traced with)
        pm.__dict__.pop("_banks", None)


@pytest.fixture
def small_head(monkeypatch, pms):
    """``CANDIDATES`` 3, and a count of the rows resolved on the host."""
    monkeypatch.setattr(sampler, "CANDIDATES", 3)
    _fresh_banks(pms)
    count = {"n": 0}

    def counted(*a, **k):
        count["n"] += 1
        return resolve(*a, **k)

    monkeypatch.setattr(ar_mod, "resolve", counted)
    monkeypatch.setattr(call_mod, "resolve", counted)
    yield count
    _fresh_banks(pms)


SAMPLED = {  # (CDF order, settings)
    "prob-T1.0": ("prob", SamplingSettings(1.0)),
    "prob-T0.7-p0.9": ("prob", SamplingSettings(0.7, 0, 0.9)),
    "id-T1.0-p0.8": ("id", SamplingSettings(1.0, 0, 0.8)),
}


@pytest.mark.parametrize("name", list(SAMPLED))
def test_plain_decoding_with_the_fast_pick_equals_the_full_sort(pms, varied, small_head, name, monkeypatch):
    tok = varied[1]
    order, s = SAMPLED[name]
    pm, ids, s = pms[order], encode_prompt(tok, PROMPTS[1]), with_seed(s, 5)
    fast, _ = ar(pm, tok, ids, s, 40)
    assert small_head["n"] > 0  # rows were resolved on the host
    monkeypatch.setattr(sampler, "CANDIDATES", 1024)  # above the vocabulary: every pick sorts it all
    _fresh_banks(pms)
    full, _ = ar(pm, tok, ids, s, 40)
    assert fast == full


@pytest.mark.parametrize("kw", [{"num_draft_tokens": 2}, {"budget": BUDGETS["flat-w4"]}, {"budget": BUDGETS["steep"]}])
@pytest.mark.parametrize("name", list(SAMPLED))
def test_ptp_with_unresolved_rows_equals_plain_decoding(pms, varied, small_head, name, kw):
    """Chained calls (a fixed budget), drafting calls and bursts (a steep curve) with rows settled on the host."""
    tok = varied[1]
    order, s = SAMPLED[name]
    for p in PROMPTS[:2]:
        ids = encode_prompt(tok, p)
        for seed in (0, 1):
            assert_same(pms[order], tok, ids, with_seed(s, seed), 24, {"step": "fused", **kw})
    assert small_head["n"] > 0


class _Bursty(Drafter):
    """Bursts of 2 plain steps, each followed by a priming call (one branch of 2 rows) told ahead
    (``guess_start``), so a call is built on every burst's last token while that token is lazy."""

    def __init__(self):
        self.calls = 0

    def plan(self, i: int, remaining: int, room: int) -> DraftPlan:
        self.calls += 1
        return DraftPlan([], [], burst=min(2, remaining)) if self.calls % 2 else self.guess_start(i, remaining, room)

    def guess_start(self, i: int, remaining: int, room: int) -> DraftPlan | None:
        w = min(2, remaining + 1, room - 1)
        return DraftPlan([], [(0, w)] if w >= 2 else [])

    def update(self, plan: DraftPlan, result: CallResult) -> None:
        pass


def test_a_call_built_on_an_unresolved_burst_token_is_dropped(pms, varied, small_head, monkeypatch):
    tok = varied[1]
    seen = {"built_on_unresolved": 0}
    confirm = pipeline.confirm_after_burst

    def spied(chained, plan, cache, last, *more):
        seen["built_on_unresolved"] += int(chained.token.item()) == UNRESOLVED
        return confirm(chained, plan, cache, last, *more)

    monkeypatch.setattr(pipeline, "confirm_after_burst", spied)
    for p in PROMPTS[:3]:
        for seed in (0, 1, 2):
            s = with_seed(SamplingSettings(1.0), seed)
            assert_same(pms["prob"], tok, encode_prompt(tok, p), s, 30, {"drafter": _Bursty()})
    assert seen["built_on_unresolved"] > 0 and small_head["n"] > 0
