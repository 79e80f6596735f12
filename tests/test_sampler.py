"""The exact sampler (docs/method.md, section 1): ``pick(u, logits)`` is the id-sorted inverse CDF of the filtered
softmax, so its law over uniform ``u`` is the filtered softmax, greedy ignores ``u``, and bins agree with picks."""

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from ptp_mlx.bins import bins
from ptp_mlx.sampler import SamplingSettings, UniformStream, filtered_probs, pick

ALPHA = 1e-4  # chi-squared significance level (vLLM's choice, docs/method.md, section 11)
N_DRAWS = 40_000


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Steps 1-4 of the sampler (docs/method.md, section 1) in float64, written independently of the product code."""
    x = logits.astype(np.float64)
    if temperature not in (0, 1):
        x = x / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones(p.size, dtype=bool)
    if 0 < top_k < p.size:
        keep[order[top_k:]] = False
    ps = p[order]
    keep[order[(np.cumsum(ps) - ps) > top_p]] = False
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def reference_pick(u: float, q: np.ndarray) -> int:
    """Step 5-6: first kept id (in id order) whose cumulative probability exceeds ``u``."""
    kept = np.flatnonzero(q > 0)
    edges = np.cumsum(q[kept])
    edges[-1] = 1.0
    return int(kept[np.argmax(edges > u)])


def draw(logits: np.ndarray, s: SamplingSettings, n: int = N_DRAWS, seed: int = 0) -> np.ndarray:
    u = np.random.default_rng(seed).random(n, dtype=np.float32)
    batch = mx.broadcast_to(mx.array(logits), (n, logits.size))
    return np.array(pick(mx.array(u), batch, s.temperature, s.top_k, s.top_p))


CHI2_SETTINGS = [
    SamplingSettings(1.0, 0, 1.0),
    SamplingSettings(0.7, 5, 1.0),
    SamplingSettings(1.3, 0, 0.8),
    SamplingSettings(0.5, 8, 0.9),
    SamplingSettings(2.0, 3, 0.95),
    SamplingSettings(1.0, 40, 0.99),  # top_k above the vocabulary size
]


@pytest.mark.parametrize("s", CHI2_SETTINGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_distribution_matches_filtered_softmax(s):
    logits = np.random.default_rng(7).normal(0.0, 1.5, 24).astype(np.float32)
    q = reference_probs(logits, s.temperature, s.top_k, s.top_p)
    counts = np.bincount(draw(logits, s), minlength=logits.size)
    assert counts[q == 0].sum() == 0, "a zero-probability (filtered) token was emitted"
    kept = q > 0
    res = stats.chisquare(counts[kept], q[kept] * counts.sum())
    assert res.pvalue > ALPHA, f"chi2={res.statistic:.1f} p={res.pvalue:.2e} counts={counts[kept]} expected={q[kept]}"
    # The product's own filtered probabilities agree with the independent reference.
    np.testing.assert_allclose(np.array(filtered_probs(mx.array(logits), s)), q, atol=1e-6)


def test_matches_reference_pick_row_by_row():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (64, 50)).astype(np.float32)
    u = rng.random(64, dtype=np.float32)
    for s in CHI2_SETTINGS:
        got = np.array(pick(mx.array(u), mx.array(logits), s.temperature, s.top_k, s.top_p))
        want = [
            reference_pick(float(u[i]), reference_probs(logits[i], s.temperature, s.top_k, s.top_p)) for i in range(64)
        ]
        assert got.tolist() == want, s


def test_id_sorted_order_hand_example():
    # p = [0.1, 0.4, 0.2, 0.3]; id-order edges 0.1, 0.5, 0.7, 1.0 (a probability-sorted CDF would put token 1 first).
    logits = mx.array(np.log([0.1, 0.4, 0.2, 0.3]).astype(np.float32))
    cases = {0.05: 0, 0.3: 1, 0.6: 2, 0.69: 2, 0.75: 3, 0.999: 3}
    for u, want in cases.items():
        assert pick(u, logits, 1.0).item() == want, u
    # top_k=2 keeps {1, 3} renormalised to 4/7, 3/7, still in id order: token 1 first.
    for u, want in {0.05: 1, 0.5: 1, 0.6: 3, 0.99: 3}.items():
        assert pick(u, logits, 1.0, top_k=2).item() == want, u
    # top_p=0.5: sorted [0.4, 0.3, 0.2, 0.1], cumsum - p = [0, 0.4, 0.7, 0.9] -> keeps {1, 3} as well.
    for u, want in {0.05: 1, 0.6: 3}.items():
        assert pick(u, logits, 1.0, top_p=0.5).item() == want, u
    # top_p=0.3 keeps only the most likely token.
    assert {pick(u, logits, 1.0, top_p=0.3).item() for u in (0.0, 0.5, 0.99)} == {1}
    # Temperature 0.5 squares and renormalises: p ~ [1, 16, 4, 9] / 30 -> edges 1/30, 17/30, 21/30, 1.
    for u, want in {0.02: 0, 0.04: 1, 0.56: 1, 0.58: 2, 0.69: 2, 0.71: 3}.items():
        assert pick(u, logits, 0.5).item() == want, u


def test_top_k_at_or_above_vocab_is_no_filter():
    rng = np.random.default_rng(1)
    logits = mx.array(rng.normal(0, 1, (500, 10)).astype(np.float32))
    u = mx.array(rng.random(500, dtype=np.float32))
    base = pick(u, logits, 0.9)
    for k in (10, 11, 1000):
        assert mx.array_equal(pick(u, logits, 0.9, top_k=k), base)


def test_tiny_top_p_keeps_exactly_the_argmax():
    rng = np.random.default_rng(2)
    logits = mx.array(rng.normal(0, 1, (300, 30)).astype(np.float32))
    u = mx.array(rng.random(300, dtype=np.float32))
    for T in (0.5, 1.0, 3.0):
        assert mx.array_equal(pick(u, logits, T, top_p=1e-9), mx.argmax(logits, axis=-1).astype(mx.int32))


def test_top_p_one_is_no_filter():
    rng = np.random.default_rng(4)
    logits = mx.array(rng.normal(0, 1, (1, 40)).astype(np.float32))
    q = filtered_probs(logits, SamplingSettings(1.0, 0, 1.0))
    assert mx.allclose(q, mx.softmax(logits, axis=-1), atol=1e-7)
    assert int((np.array(q) > 0).sum()) == 40


def test_ties():
    logits = mx.array([1.0, 3.0, 3.0, 0.0])
    # Greedy: the lowest id among tied maxima, whatever u is.
    assert {pick(u, logits, 0.0).item() for u in (0.0, 0.5, 0.9999)} == {1}
    assert {pick(u, logits, 1.0, top_k=1).item() for u in (0.0, 0.5, 0.9999)} == {1}
    # Tied tokens get bins of equal width, adjacent in id order.
    lo, hi = bins(mx.broadcast_to(logits, (2, 4)), mx.array([1, 2]), SamplingSettings(1.0))
    w = np.array(hi - lo)
    assert abs(w[0] - w[1]) < 1e-6 and abs(float(hi[0]) - float(lo[1])) < 1e-6
    # top_k=2 among three tied maxima keeps exactly two tokens, each half of the mass.
    tied3 = np.array([3.0, 3.0, 0.0, 3.0], dtype=np.float32)
    out = draw(tied3, SamplingSettings(1.0, 2, 1.0), n=4000)
    vals, counts = np.unique(out, return_counts=True)
    assert len(vals) == 2 and set(vals) <= {0, 1, 3} and abs(counts[0] - 2000) < 200
    # Exact distribution over ties at T=1: the three tied maxima share the mass equally.
    counts = np.bincount(draw(tied3, SamplingSettings(1.0)), minlength=4)
    q = reference_probs(tied3, 1.0, 0, 1.0)
    assert stats.chisquare(counts[q > 0], q[q > 0] * counts.sum()).pvalue > ALPHA


def test_temperature_zero_is_argmax_whatever_u():
    rng = np.random.default_rng(5)
    logits = mx.array(rng.normal(0, 1, (200, 17)).astype(np.float32))
    want = mx.argmax(logits, axis=-1).astype(mx.int32)
    for u in (0.0, 0.3, 0.5, float(np.nextafter(np.float32(1), np.float32(0)))):
        for k, p in ((0, 1.0), (5, 0.5)):
            got = pick(mx.full((200,), u), logits, 0.0, k, p)
            assert got.dtype == mx.int32 and mx.array_equal(got, want)


def test_all_masked_rows_rejected():
    good = np.zeros(8, dtype=np.float32)
    bad = np.full(8, -np.inf, dtype=np.float32)
    logits = mx.array(np.stack([good, bad]))
    for T in (0.0, 1.0):
        with pytest.raises(ValueError, match="masked"):
            pick(mx.array([0.5, 0.5]), logits, T)
        out = pick(mx.array([0.5, 0.5]), logits, T, check=False)
        assert out[1].item() == -1 and 0 <= out[0].item() < 8
    with pytest.raises(ValueError, match="not finite"):
        pick(0.5, mx.array([0.0, float("nan"), 1.0]), 1.0)
    with pytest.raises(ValueError, match="masked"):
        pick(0.5, mx.array([0.0, float("inf"), 1.0]), 1.0)


def test_zero_probability_tokens_never_emitted():
    # Masked (-inf), underflowing (softmax exactly 0 in float32) and filtered tokens, at both ends of [0, 1).
    logits = np.array([-np.inf, 0.0, -200.0, 2.0, -np.inf, 1.0, -300.0, -np.inf], dtype=np.float32)
    u_edges = np.array([0.0, 1e-30, 0.5, np.nextafter(np.float32(1), np.float32(0))], dtype=np.float32)
    u = np.concatenate([u_edges, np.random.default_rng(6).random(20_000, dtype=np.float32)])
    batch = mx.broadcast_to(mx.array(logits), (u.size, logits.size))
    for s in (SamplingSettings(1.0), SamplingSettings(2.0, 2, 1.0), SamplingSettings(0.8, 0, 0.7)):
        out = np.array(pick(mx.array(u), batch, s.temperature, s.top_k, s.top_p))
        allowed = np.flatnonzero(reference_probs(logits, s.temperature, s.top_k, s.top_p) > 0)
        assert set(np.unique(out)) <= set(allowed.tolist()), s
        assert out[0] == allowed[0]  # u = 0 picks the first kept token, never a masked one before it


@pytest.mark.parametrize(
    "s",
    [SamplingSettings(1.0), SamplingSettings(0.7, 6, 0.9), SamplingSettings(1.5, 0, 0.6)],
    ids=["plain", "k6-p0.9", "p0.6"],
)
def test_bins_consistent_with_pick(s):
    rng = np.random.default_rng(8)
    logits = mx.array(rng.normal(0, 1.5, (5, 20)).astype(np.float32))
    q = np.array(filtered_probs(logits, s))
    for r in range(5):
        kept = np.flatnonzero(q[r] > 0)
        rows = mx.broadcast_to(logits[r], (kept.size, 20))  # bins() takes one token per row of logits
        lo, hi = bins(rows, mx.array(kept), s)
        lo, hi = np.array(lo), np.array(hi)
        np.testing.assert_allclose(hi - lo, q[r, kept], atol=1e-6)
        assert abs(lo[0]) < 1e-6 and hi[-1] == 1.0
        np.testing.assert_allclose(lo[1:], hi[:-1], atol=1e-6)  # bins tile [0, 1) in id order
        for frac in (0.5, 0.01, 0.99):
            u = lo + frac * (hi - lo)
            got = np.array(pick(mx.array(u.astype(np.float32)), rows, s.temperature, s.top_k, s.top_p))
            assert got.tolist() == kept.tolist(), (r, frac)
    # Greedy: every u picks the argmax, so its bin is [0, 1).
    lo, hi = bins(logits, mx.argmax(logits, axis=-1), SamplingSettings(0.0))
    assert np.all(np.array(lo) == 0) and np.all(np.array(hi) == 1)


def test_uniform_stream_reproducible_and_chunk_independent():
    n = UniformStream.CHUNK * 2 + 123
    whole = UniformStream(11).take(0, n).copy()
    assert whole.dtype == np.float32 and whole.min() >= 0 and whole.max() < 1
    one_by_one = UniformStream(11)
    assert [one_by_one[i] for i in range(0, n, 97)] == whole[::97].tolist()
    pieces = UniformStream(11)
    rng = np.random.default_rng(0)
    got, start = [], 0
    while start < n:
        k = int(rng.integers(1, 700))
        got.append(pieces.take(start, min(k, n - start)).copy())
        start += k
    assert np.array_equal(np.concatenate(got), whole)
    late_first = UniformStream(11)
    assert np.array_equal(late_first.take(UniformStream.CHUNK - 5, 10), whole[UniformStream.CHUNK - 5 :][:10])
    assert np.array_equal(late_first.take(0, 10), whole[:10])
    assert not np.array_equal(UniformStream(12).take(0, 100), whole[:100])


def test_settings_validation():
    for bad in (
        SamplingSettings(-0.1),
        SamplingSettings(float("nan")),
        SamplingSettings(1.0, -1),
        SamplingSettings(1.0, 0, 0.0),
        SamplingSettings(1.0, 0, 1.5),
    ):
        with pytest.raises(ValueError):
            bad.validate()
    assert SamplingSettings(0.0).greedy and SamplingSettings(1.0, 1).greedy and not SamplingSettings(1.0).greedy


def test_accurate_cumsum_tracks_the_exact_cdf():
    """A float32 running sum over a large vocabulary drifts from the exact CDF; the sampler's sums do not."""
    from ptp_mlx.cdf import accurate_cumsum, blocked_cumsum

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (2, 49152)).astype(np.float32)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
    exact = np.cumsum(p.astype(np.float64), axis=-1)
    naive = np.abs(np.array(mx.cumsum(mx.array(p), axis=-1)) - exact).max()
    accurate = np.abs(np.array(accurate_cumsum(mx.array(p))) - exact).max()
    blocked = np.abs(np.array(blocked_cumsum(mx.array(p))) - exact).max()
    assert accurate < 1e-9 and blocked < naive / 4 and blocked < 3e-6, (naive, accurate, blocked)
    # One row alone or among others: the same sums, bit for bit.
    assert mx.array_equal(accurate_cumsum(mx.array(p))[1], accurate_cumsum(mx.array(p[1])))
    assert mx.array_equal(blocked_cumsum(mx.array(p))[1], blocked_cumsum(mx.array(p[1])))


def test_top_k_fast_path_picks_what_the_full_vocabulary_path_picks():
    """``pick`` with top-k works on the k candidates only; it must choose what the full-vocabulary CDF chooses
    for every u (up to the rounding of the normaliser, far below any u spacing tested here)."""
    from ptp_mlx.cdf import id_sorted_edges
    from ptp_mlx.sampler import filtered_probs

    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(0, 2.5, (6, 3000)).astype(np.float32))
    us = rng.random((400, 6), dtype=np.float32)
    for temp, k, top_p in ((0.7, 50, 0.95), (1.0, 20, 1.0), (1.3, 200, 0.8), (0.5, 2, 1.0)):
        s = SamplingSettings(temp, k, top_p)
        edges = id_sorted_edges(filtered_probs(logits, s))
        for u in us:
            fast = pick(mx.array(u), logits, temp, k, top_p)
            full = mx.sum(edges <= mx.array(u).astype(edges.dtype)[:, None], axis=-1)
            assert mx.array_equal(fast, full.astype(mx.int32)), (temp, k, top_p)
