"""Probability-ordered CDF (``cdf_order: prob``): the sampler, its bins, decoding with an adapter that records
it (PTP against plain decoding, token for token), training's re-binning of teacher records, and near-tie
classification in that order."""

import mlx.core as mx
import numpy as np
import pytest

from ptp_mlx.adapter import AdapterConfig
from ptp_mlx.bins import bins
from ptp_mlx.model.ptp import PTPModel
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import SamplingSettings, UniformStream, filtered_probs, pick
from ptp_mlx.testing.decoding import PROMPTS, SETTINGS, WINDOW, ar, assert_same, with_seed
from ptp_mlx.ties import classify

CASES = [(0.7, 50, 0.95), (1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 20, 1.0)]


def _reference(q: np.ndarray, u: float) -> int:
    """The definition: tokens by descending probability (ties by id), the first whose CDF exceeds u."""
    order = np.argsort(-q, kind="stable")
    cdf = np.cumsum(q[order])
    cdf[int((q > 0).sum()) - 1 :] = 1.0
    return int(order[int(np.sum(cdf <= u))])


@pytest.mark.parametrize("case", CASES)
def test_prob_order_pick_matches_its_definition_and_bins_contain_u(case):
    rng = np.random.default_rng(0)
    logits = mx.array((rng.normal(size=(32, 4096)) * 3).astype(np.float32))
    s = SamplingSettings(*case, order="prob")
    u = rng.random(32).astype(np.float32)
    got = pick(mx.array(u), logits, *case, order="prob")
    q = np.array(filtered_probs(logits, s), dtype=np.float64)
    assert np.array(got).tolist() == [_reference(q[r], float(u[r])) for r in range(32)]
    lo, hi = (np.array(x) for x in bins(logits, got, s))
    assert np.all((lo <= u) & (u < hi))
    assert np.allclose(hi - lo, q[np.arange(32), np.array(got)])
    # Small u pick the likeliest token: the point of the order.
    first = pick(mx.zeros(32), logits, *case, order="prob")
    assert np.array(first).tolist() == np.argmax(q, axis=-1).tolist()
    # A token outside the truncated support has an empty bin.
    if case[1] or case[2] < 1:
        out = mx.array(np.argmin(q, axis=-1).astype(np.int32))
        lo, hi = bins(logits, out, s)
        assert np.all(np.array(lo) == np.array(hi))


def test_prob_order_differs_from_id_order():
    rng = np.random.default_rng(1)
    logits = mx.array((rng.normal(size=(64, 512)) * 2).astype(np.float32))
    u = mx.array(rng.random(64).astype(np.float32))
    a, b = pick(u, logits, 1.0, order="id"), pick(u, logits, 1.0, order="prob")
    assert (np.array(a) != np.array(b)).mean() > 0.5


def test_adapter_config_reads_the_order():
    assert AdapterConfig.from_dict({}).cdf_order == "id"
    assert AdapterConfig.from_dict({"cdf_order": "prob"}).cdf_order == "prob"
    with pytest.raises(ValueError, match="CDF order"):
        AdapterConfig.from_dict({"cdf_order": "sorted"})


@pytest.fixture(scope="module")
def pm_prob(varied, pm_sticky):
    model, _ = varied
    return PTPModel(model, pm_sticky.adapter, {"window": WINDOW, "cdf_order": "prob"}, fuse=True)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_ptp_equals_ar_in_probability_order(pm_prob, varied, name):
    tok = varied[1]
    for p in PROMPTS[:3]:
        ids = encode_prompt(tok, p)
        for seed in [0] if SETTINGS[name].greedy else [0, 1, 2]:
            s = with_seed(SETTINGS[name], seed)
            assert_same(pm_prob, tok, ids, s, 20, {"step": "fused"})
            want = ar(pm_prob, tok, ids, s, 20)
            # An oracle drafter proposing the answer itself is accepted in full, in this order too.
            steps = assert_same(pm_prob, tok, ids, s, 20, {"oracle": want[0]}, want=want)
            assert all(st.accepted == st.proposed for st in steps[:-1])


def test_plain_decoding_follows_the_adapters_order(pm_prob, pm_sticky, varied):
    """With a probability-order adapter, plain decoding samples in that order (so PTP can equal it); the token
    at each step is the sampler's own pick in that order, and differs from id order somewhere."""
    model, tok = varied
    s = SamplingSettings(1.0, 0, 1.0, seed=3)
    ids = encode_prompt(tok, PROMPTS[0])
    got = ar(pm_prob, tok, ids, s, 16)[0]
    u = UniformStream(3)
    seq = list(ids)
    for i, t in enumerate(got):
        logits = model(mx.array(seq)[None])[0, -1]
        assert int(pick(mx.array(u[i]), logits, 1.0, order="prob").item()) == t
        seq.append(t)
    assert got != ar(pm_sticky, tok, ids, s, 16)[0]


def test_training_rebins_records_in_probability_order(varied):
    from ptp_mlx.train.windows import make_windows, rebin

    model, tok = varied
    s = SamplingSettings(0.7, 20, 0.9)
    ids = encode_prompt(tok, PROMPTS[1])
    # A record written in id order (as pregenerate and corpus write it), from the sampler itself.
    u = UniformStream(5)
    seq = list(ids)
    for i in range(12):
        seq.append(int(pick(mx.array(u[i]), model(mx.array(seq)[None])[0, -1], 0.7, 20, 0.9).item()))
    logits = model(mx.array(seq)[None])[0]
    lo, hi = bins(logits[len(ids) - 1 : -1], mx.array(seq[len(ids) :]), s)
    rec = {"tokens": seq, "start": len(ids), "left": np.array(lo).tolist(), "right": np.array(hi).tolist()}
    rec["settings"] = s.as_dict()
    rebin(rec, logits, "prob")
    assert rec["order"] == "prob"
    windows, wu, labels, valid = make_windows(rec, 4, 3, np.random.default_rng(0), uniform=True)
    assert valid.any()
    for w, win in enumerate(windows):
        for j in range(3):
            k = w * 3 + j
            if valid[k]:
                pos = win.ctx_len + j  # the token this slot predicts
                row = logits[pos - 1]
                assert int(pick(mx.array(wu[k]), row, 0.7, 20, 0.9, order="prob").item()) == labels[k]


def test_near_equal_probabilities_are_a_near_tie_in_probability_order():
    logits = mx.array([0.0, 2.0, 2.0 + 1e-6, 1.0, -1.0], dtype=mx.float32)
    s = SamplingSettings(1.0, order="prob")
    tie = classify(logits, 2, 1, 0.1, s)
    assert tie.near_tie and tie.kind == "probability order"
    far = classify(logits, 2, 4, 0.1, s)
    assert not far.near_tie


def test_known_uniforms_sharpen_draft_confidences_in_probability_order(pm_prob, pm_sticky, varied):
    """Sampling in probability order, a draft is the mode's token only when its u falls in the mode's bin: the
    chain drafter scales each draft's confidence by where its (known) u lies; in id order u says nothing."""
    from ptp_mlx.drafting.budget import Budget
    from ptp_mlx.drafting.chain import ChainDrafter
    from ptp_mlx.drafting.cost import CostCurve
    from ptp_mlx.drafting.rows import u_factor
    from ptp_mlx.generate import DecodeOptions, stream_generate

    assert u_factor(0.2, 0.5) > 1 > u_factor(0.7, 0.5) > u_factor(0.99, 0.4)
    d = ChainDrafter(Budget(CostCurve(), WINDOW))
    d.drafts, d.conf, d.top_prob = [5, 6], [0.5, 0.4], [0.6, 0.3]
    assert d.confidences(0) == [0.5, 0.4]  # no uniforms: unchanged
    d.uniforms = UniformStream(0)
    u1, u2 = UniformStream(0).take(4, 2)
    assert d.confidences(3) == [0.5 * u_factor(float(u1), 0.6), 0.4 * u_factor(float(u2), 0.3)]
    tok = varied[1]
    ids = encode_prompt(tok, PROMPTS[0])
    for pm, sampled, expect in ((pm_prob, True, True), (pm_prob, False, False), (pm_sticky, True, False)):
        s = SamplingSettings(1.0, seed=2) if sampled else SamplingSettings(0.0)
        drafter = ChainDrafter(Budget(CostCurve(), WINDOW))
        opts = DecodeOptions(mode="ptp", max_tokens=12, sampling=s, drafter=drafter)
        list(stream_generate(pm, tok, ids, opts))
        assert (drafter.uniforms is not None) == expect
