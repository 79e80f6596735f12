"""ptp-mlx's one-node CPU primitives (ptp_mlx/kernels/attention.cpp, rowwise.cpp, linear.cpp): attention over our
K/V state, SwiGLU, RMS norm, the table RoPE and a plain pass's projection group.

Each agrees with its graph form (RoPE bit for bit, the others to rounding) and computes a row the same way whatever
rows surround it, how many there are and, for attention, at which slots its visible keys sit (a tree strand's
ancestors): the batch invariance PTP's exactness rests on. The norm runs only in passes over our K/V state, never in
mlx-lm's own steps or in training. Without the extension, the graph forms run."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import ptp_mlx  # noqa: F401  (the sgemm before MLX)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from ptp_mlx.kernels import extension
from ptp_mlx.model import cpu_math
from ptp_mlx.model.rope import _table, table_rope

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="built on Linux only")


@pytest.fixture(scope="module")
def ops():
    mod = extension.module()
    if mod is None:
        pytest.skip(f"the CPU primitives are not available here: {extension._state['why']}")
    return mod


def _graph_attention(monkeypatch, q, k, v, scale, mask):
    monkeypatch.setenv("PTP_MLX_ATTENTION", "0")
    try:
        return cpu_math.attention(q, k, v, scale, mask)
    finally:
        monkeypatch.delenv("PTP_MLX_ATTENTION")


def _mask(rng, kind: str, L: int, S: int, ctx: int):
    if kind == "none":
        return None
    sees = np.arange(S)[None] <= np.arange(ctx, ctx + L)[:, None]
    if kind == "tree":  # rows that skip some keys, as a tree strand skips its siblings
        sees &= rng.random((L, S)) < 0.7
        sees[:, 0] = True
    if kind == "additive":
        return mx.array(np.where(sees, 0.0, -np.inf).astype(np.float32))
    return mx.array(sees)


@pytest.mark.parametrize("kind", ["bool", "additive", "tree", "none"])
@pytest.mark.parametrize(
    "B,Hq,Hkv,D,S,L", [(1, 9, 3, 64, 256, 1), (1, 9, 3, 64, 256, 7), (2, 4, 2, 80, 40, 5), (1, 6, 2, 72, 33, 9)]
)
@pytest.mark.parametrize("scores", ["1", "0"])  # scores by ptp-sgemm's A B^T kernel, or by attention's own loop
def test_attention_agrees_with_the_graph_and_a_row_alone_is_the_same_bits(
    ops, monkeypatch, kind, B, Hq, Hkv, D, S, L, scores
):
    monkeypatch.setenv("PTP_MLX_ATTENTION_SCORES", scores)
    rng = np.random.default_rng(S + L)
    q = mx.array(rng.standard_normal((B, L, Hq, D)).astype(np.float32)).transpose(0, 2, 1, 3)  # a strided view
    k = mx.array(rng.standard_normal((B, Hkv, S, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, Hkv, S, D)).astype(np.float32))
    mask = _mask(rng, kind, L, S, S - L - 2)
    got = ops.attention(q, k, v, 0.3, mask)
    want = _graph_attention(monkeypatch, q, k, v, 0.3, mask)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=2e-5)
    for r in range(L):
        one = ops.attention(q[:, :, r : r + 1], k, v, 0.3, None if mask is None else mask[r : r + 1])
        assert np.array_equal(np.array(one), np.array(got[:, :, r : r + 1]))


@pytest.mark.parametrize("mask", ["causal", "window"])
def test_a_prefill_chunk_takes_the_primitive_and_agrees_with_the_graph(ops, monkeypatch, mask):
    """Passes longer than any decode call (a prefill chunk after a cached prefix) go through the primitive too,
    with mlx-lm's "causal" mask or a sliding window's array; each row is still the row alone, bit for bit."""
    rng = np.random.default_rng(11)
    B, Hq, Hkv, D, L, S = 1, 9, 3, 64, 200, 230
    q = mx.array(rng.standard_normal((B, L, Hq, D)).astype(np.float32)).transpose(0, 2, 1, 3)
    k = mx.array(rng.standard_normal((B, Hkv, S, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, Hkv, S, D)).astype(np.float32))
    m = "causal" if mask == "causal" else cpu_math._causal(L, S, window=64)
    dense = cpu_math._causal(L, S) if mask == "causal" else m
    got = cpu_math.attention(q, k, v, 0.125, m)
    assert np.array_equal(np.array(got), np.array(ops.attention(q, k, v, 0.125, dense)))  # the primitive's bits
    want = _graph_attention(monkeypatch, q, k, v, 0.125, m)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=2e-5)
    assert not np.array_equal(np.array(got), np.array(want))  # (the graph form rounds otherwise: not the one run)
    for r in (0, 63, 64, 199):
        one = ops.attention(q[:, :, r : r + 1], k, v, 0.125, dense[r : r + 1])
        assert np.array_equal(np.array(one), np.array(got[:, :, r : r + 1]))


def test_attention_depends_on_the_visible_keys_in_order_not_on_their_slots(ops):
    """A strand's row sees its ancestors at other slots than a plain step's row does: same bits."""
    rng = np.random.default_rng(3)
    S, D = 48, 64
    keys = rng.standard_normal((20, D)).astype(np.float32)
    vals = rng.standard_normal((20, D)).astype(np.float32)
    q = mx.array(rng.standard_normal((1, 3, 1, D)).astype(np.float32))
    results = []
    for slots in (np.arange(20), np.sort(rng.choice(S, 20, replace=False))):
        k, v = np.zeros((1, 1, S, D), np.float32), np.ones((1, 1, S, D), np.float32)  # unseen slots hold junk
        k[0, 0, slots], v[0, 0, slots] = keys, vals
        sees = np.zeros((1, S), bool)
        sees[0, slots] = True
        results.append(np.array(ops.attention(q, mx.array(k), mx.array(v), 0.125, mx.array(sees))))
    assert np.array_equal(results[0], results[1])


@pytest.mark.parametrize("kind", ["additive", "per head", "none"])
@pytest.mark.parametrize("B,Hq,Hkv,D,S,L", [(1, 9, 3, 64, 256, 1), (1, 9, 3, 64, 600, 16), (2, 4, 2, 80, 40, 5)])
def test_attention_on_two_threads_is_one_thread_bit_for_bit(ops, monkeypatch, kind, B, Hq, Hkv, D, S, L):
    """Its units (a key/value head's block of rows) shared with ptp-sgemm's second thread: the same bits as all
    of them on MLX's stream thread (``PTP_MLX_ATTENTION_THREADS=1``), masks shared or per batch and head."""
    from ptp_mlx import blas

    lib = blas.kernel()
    if lib is None:
        pytest.skip("ptp-sgemm is not built here: attention runs on one thread")
    before = lib.ptp_sgemm_set_threads(0, 0, 0)
    assert lib.ptp_sgemm_set_threads(2, 0, 0) == 2  # (the worker, even where a test before let it go)
    request_restore = lambda: lib.ptp_sgemm_set_threads(before, 0, 0)  # noqa: E731
    rng = np.random.default_rng(S * L)
    q = mx.array(rng.standard_normal((B, Hq, L, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, Hkv, S, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, Hkv, S, D)).astype(np.float32))
    if kind == "per head":  # every batch entry and head its own keys: scanned per unit
        mask = mx.array(rng.random((B, Hq, L, S)) < 0.6)
    else:
        mask = _mask(rng, kind, L, S, S - L - 2)
    try:
        two = np.array(ops.attention(q, k, v, 0.2, mask))
        monkeypatch.setenv("PTP_MLX_ATTENTION_THREADS", "1")
        one = np.array(ops.attention(q, k, v, 0.2, mask))
    finally:
        request_restore()
    assert np.array_equal(one, two, equal_nan=True)


def test_a_row_that_sees_no_key_is_nan_as_in_the_graph(ops):
    q = mx.ones((1, 1, 2, 16))
    k = mx.ones((1, 1, 4, 16))
    out = np.array(ops.attention(q, k, k, 1.0, mx.array([[True, False, False, False], [False] * 4])))
    assert np.isfinite(out[0, 0, 0]).all() and np.isnan(out[0, 0, 1]).all()


@pytest.mark.parametrize("n", [576, 1536, 37])
def test_swiglu_agrees_and_an_element_never_depends_on_its_place(ops, n):
    rng = np.random.default_rng(n)
    g = mx.array((rng.standard_normal((5, n)) * 6).astype(np.float32))
    x = mx.array(rng.standard_normal((5, n)).astype(np.float32))
    got = np.array(ops.swiglu(g, x))
    np.testing.assert_allclose(got, np.array(g * mx.sigmoid(g) * x), rtol=2e-6, atol=1e-6)
    # The same values shifted by 5 places (another lane, or the padded tail) and one row alone: the same bits.
    gs, xs = mx.concatenate([g[:, :5] * 0, g], 1), mx.concatenate([x[:, :5] * 0, x], 1)
    assert np.array_equal(np.array(ops.swiglu(gs, xs))[:, 5:], got)
    assert np.array_equal(np.array(ops.swiglu(g[2:3], x[2:3])), got[2:3])
    both = mx.split(mx.concatenate([g, x], axis=-1), 2, axis=-1)  # views of a fused gate|up product
    assert np.array_equal(np.array(ops.swiglu(*both)), got)


def test_swiglu_ends():
    g = mx.array([-200.0, -88.5, 0.0, 88.5, 200.0, float("nan")])
    got = np.array(cpu_math.swiglu(g, mx.ones_like(g)))
    assert got[0] == 0 and got[2] == 0 and got[3] == np.float32(88.5) and got[4] == 200 and np.isnan(got[5])


@pytest.mark.parametrize("n", [576, 100])
def test_rms_norm_agrees_and_rows_are_their_own(ops, n):
    rng = np.random.default_rng(n)
    x = mx.array(rng.standard_normal((3, 7, n)).astype(np.float32))
    w = mx.array(rng.standard_normal(n).astype(np.float32))
    for weight in (w, None):
        got = np.array(ops.rms_norm(x, weight, 1e-5))
        want = np.array(cpu_math._rms_norm_dispatcher(mx.fast.rms_norm).ptp_stock(x, weight, 1e-5))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
        assert np.array_equal(np.array(ops.rms_norm(x[1:2, 3:4], weight, 1e-5)), got[1:2, 3:4])


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
def test_table_rope_is_the_graph_form_bit_for_bit(ops, monkeypatch, traditional, dims):
    rng = np.random.default_rng(dims)
    rope = nn.RoPE(dims, traditional=traditional, base=10000)
    pos = mx.array([5, 9, 10, 11, 13, 40, 41], dtype=mx.int32)
    x = mx.array(rng.standard_normal((1, 7, 9, 64)).astype(np.float32)).transpose(0, 2, 1, 3)
    got = table_rope(rope, x, pos, {})
    monkeypatch.setenv("PTP_MLX_ROPE_TABLE", "0")
    want = table_rope(rope, x, pos, {})
    cos, sin = _table(rope, pos, mx.float32)
    assert np.array_equal(np.array(got), np.array(want))
    assert np.array_equal(np.array(ops.rope_table(x, cos, sin, dims, traditional)), np.array(want))
    stock = mx.swapaxes(rope(mx.swapaxes(x, 0, 2), offset=pos), 0, 2)  # MLX's own, one offset per row
    assert np.array_equal(np.array(got), np.array(stock))


def _names(*outs) -> set[str]:
    import os
    import re
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *outs)
        with open(path) as f:
            return set(re.findall(r'label ="([^"]+)", shape=rectangle', f.read()))
    finally:
        os.unlink(path)


def test_the_norm_primitive_runs_only_in_passes_over_our_state(ops, tiny):
    """Our K/V state: one node per norm. mlx-lm's own cache right after (the bench's mlx-lm method): the stock
    norm, with nothing of ours."""
    from mlx_lm.models.cache import make_prompt_cache

    from ptp_mlx.model.ptp import PTPModel

    pm = PTPModel(tiny[0], None, None)
    ids = mx.array([[1, 2, 3, 4]])
    ours = pm.base(ids, cache=pm.make_cache())
    assert {"PTPRMSNorm", "PTPAttention"} <= _names(ours)
    stock = pm.base(ids, cache=make_prompt_cache(pm.base))
    assert not {n for n in _names(stock) if n.startswith("PTP")}


def test_without_the_extension_the_graph_forms_run(monkeypatch):
    monkeypatch.setattr(extension, "_state", {"module": None, "tried": True, "why": "test"})
    for name in ("attention", "swiglu", "rms_norm", "rope_table"):
        assert cpu_math.fused_op(name) is None
    q = mx.ones((1, 2, 3, 8))
    out = cpu_math.attention(q, q, q, 0.5, "causal")
    assert out is not None and "PTPAttention" not in _names(out)
    assert "PTPSwiGLU" not in _names(cpu_math.swiglu(q, q))


@pytest.mark.parametrize("V", [49152, 1000, 130])
def test_the_aux_head_reads_what_the_graph_reads(ops, V):
    """Drafts, their probabilities, three runner-ups (ties to the lower id) and the top probability at T."""
    rng = np.random.default_rng(V)
    x = (rng.standard_normal((6, V)) * 3).astype(np.float32)
    x[1, 7] = x[1, 900 % V] = x[1].max() + 1  # a tie for the argmax: the lower id wins
    x[2, [5, 60, 61]] = x[2].max() + 1  # a tie among runner-ups
    x[3, -1] = x[3].max() + 2  # the argmax in the last, partial block
    top, conf, alt, alt_conf, top_prob = (np.array(a) for a in ops.aux_head(mx.array(x), 3, 1 / 0.7))
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    pt = np.exp((x - x.max(1, keepdims=True)) / 0.7)
    pt /= pt.sum(1, keepdims=True)
    for i in range(6):
        order = sorted(range(V), key=lambda j: (-x[i, j], j))
        assert top[i] == order[0] and list(alt[i]) == order[1:4]
        np.testing.assert_allclose(conf[i], p[i, order[0]], rtol=1e-5)
        np.testing.assert_allclose(alt_conf[i], p[i, order[1:4]], rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(top_prob[i], pt[i, order[0]], rtol=1e-5)


def test_the_aux_head_of_a_tiny_vocabulary(ops):
    top, conf, alt, alt_conf, top_prob = (np.array(a) for a in ops.aux_head(mx.array([[0.0, 2.0, 1.0]]), 3, 0.0))
    assert top[0] == 1 and list(alt[0]) == [2, 0, 1] and alt_conf[0, 2] == 0 and top_prob[0] == 0


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 70])
def test_linear_is_mlx_product_bit_for_bit_one_output_per_projection(ops, with_bias, rows):
    """A plain pass's group (kernels/linear.cpp): each projection's part of MLX's own ``x @ W[:N].T`` (or addmm with
    the bias), for a decode width and a prefill chunk's (the BLAS's sgemm past ptp-sgemm's rows), x a view too."""
    rng = np.random.default_rng(rows)
    K, outs = 96, [40, 24, 24]
    N = sum(outs)
    W = mx.array(rng.standard_normal((N + 8, K)).astype(np.float32))  # rows past N (a LoRA's A) are not read
    x = mx.array(rng.standard_normal((1, rows, K)).astype(np.float32))
    view = mx.array(np.ascontiguousarray(np.array(x).transpose(0, 2, 1))).transpose(0, 2, 1)  # x as a strided view
    bias = mx.array(rng.standard_normal(N).astype(np.float32)) if with_bias else None
    want = np.array(x @ W[:N].T if bias is None else mx.addmm(bias, x, W[:N].T))
    for run in (ops.linear, mx.compile(ops.linear)):
        for arg in (x, view):  # (MLX multiplies a view its own way; ours reads it as the rows it holds)
            parts = run(arg, W, outs, bias)
            assert [p.shape for p in parts] == [(1, rows, n) for n in outs]
            assert np.array_equal(np.concatenate([np.array(p) for p in parts], axis=-1), want)


def test_linear_rejects_bad_operands_with_one_clear_error(ops):
    W = mx.zeros((8, 4))
    with pytest.raises(ValueError, match="linear: W is"):
        ops.linear(mx.zeros((1, 2, 5)), W, [8])
    with pytest.raises(ValueError, match="linear: bias is"):
        ops.linear(mx.zeros((1, 2, 4)), W, [4, 4], mx.zeros((3,)))
    with pytest.raises(ValueError, match="linear: float32"):
        ops.linear(mx.zeros((1, 2, 4), mx.float16), W, [8])


def test_a_plain_pass_runs_its_groups_as_one_node_each_with_the_same_logits(
    ops, tiny_model_dir, adapter_dir, monkeypatch
):
    """A pass over our K/V state of the fused model: its projection groups as ``PTPLinear`` nodes, with the very
    logits of the graph form (``PTP_MLX_LINEAR=0``)."""
    import mlx_lm

    from ptp_mlx.adapter import load_adapter
    from ptp_mlx.model.ptp import PTPModel

    base, _ = mlx_lm.load(str(tiny_model_dir))  # (a private copy: fusing patches it)
    ad, cfg = load_adapter(adapter_dir, base)
    pm = PTPModel(base, ad, cfg, fuse=True)
    ids = mx.array([[5, 9, 2, 7, 11]])
    logits = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PTP_MLX_LINEAR", flag)
        out = pm.base(ids, cache=pm.make_cache())
        assert ("PTPLinear" in _names(out)) == (flag == "1")
        logits[flag] = np.array(out)
    assert np.array_equal(logits["1"], logits["0"])


@pytest.mark.parametrize("V,c", [(49152, 1024), (3000, 1024), (259, 3), (40, 40)])
def test_top_ids_are_the_largest_in_id_order_ties_to_the_lower_ids(ops, V, c):
    """``top_ids`` (the fast pick's candidates): per row the ``c`` largest logits' ids, increasing; at equal logits
    on the edge the lower ids; -0.0 and 0.0 apart as their order keys say, infinities at the ends."""
    rng = np.random.default_rng(V + c)
    x = rng.normal(size=(6, V)).astype(np.float32) * 3
    x[1] = np.round(x[1])  # many ties, some at the edge
    x[2, :] = 1.0  # all equal: the first c ids
    x[3, rng.choice(V, min(V, 7), replace=False)] = np.inf
    x[4, : V // 2] = -np.inf
    x[5, ::16] += 50.0  # the sampled guess of the edge (every 16th logit) too high: the histogram decides
    got = np.array(ops.top_ids(mx.array(x), c))
    for r in range(6):
        order = np.lexsort((np.arange(V), -x[r]))  # descending value, then increasing id
        assert got[r].tolist() == sorted(order[:c].tolist()), r
    assert np.array(ops.top_ids(mx.array(x[None, 1:3]), c)).shape == (1, 2, c)  # leading axes kept
    with pytest.raises(ValueError, match="top_ids"):
        ops.top_ids(mx.array(x), V + 1)


@pytest.mark.parametrize("V", [49152, 259, 16, 1])
def test_greedy_pick_is_the_graph_argmax_and_minus_one_where_not_finite(ops, V, monkeypatch):
    """``greedy_pick`` (``sampler.pick`` at temperature 0 on the CPU) gives what ``mx.argmax`` and the finiteness
    test give: the lowest id among equal maxima, -0.0 equal to 0.0, -1 for a row with a NaN or a non-finite maximum;
    through ``pick`` with the primitive and without it, eager and compiled."""
    from ptp_mlx.sampler import pick

    rng = np.random.default_rng(V)
    x = rng.normal(size=(8, V)).astype(np.float32) * 3
    x[1] = np.round(x[1])  # ties at the maximum
    x[2, :] = 0.0
    x[2, -1] = -0.0  # (equal maxima of both signs: the first)
    x[3, rng.integers(V)] = np.nan
    x[4, :] = -np.inf
    x[5, rng.integers(V)] = np.inf
    x[6, : V // 2] = -np.inf
    x[7, -1] = 100.0  # the maximum in the tail past the last whole vector
    a = mx.array(x)
    want = np.where(
        np.isfinite(x.max(axis=1)) & ~np.isnan(x).any(axis=1), np.argmax(np.nan_to_num(x, nan=-np.inf), axis=1), -1
    )
    assert np.array(ops.greedy_pick(a)).tolist() == want.tolist()
    assert np.array(ops.greedy_pick(a.reshape(2, 4, V))).shape == (2, 4)  # leading axes kept
    assert np.array(ops.greedy_pick(a[:, ::-1])).tolist()[0] == int(np.argmax(x[0, ::-1]))  # a strided view
    for flag in ("1", "0"):
        monkeypatch.setenv("PTP_MLX_GREEDY_PICK", flag)
        assert np.array(pick(0.5, a, check=False)).tolist() == want.tolist(), flag
        assert np.array(mx.compile(lambda v: pick(0.5, v, check=False))(a)).tolist() == want.tolist(), flag
        with pytest.raises(ValueError, match="cannot sample"):
            pick(0.5, a)
        assert np.array(pick(0.5, a[7:], check=True)).tolist() == want[7:].tolist()
    with pytest.raises(ValueError, match="greedy_pick"):
        ops.greedy_pick(a.astype(mx.float16))


@pytest.mark.parametrize("T", [0.7, 1.0, 0.3, 1.3, 0.0])
def test_tempered_stats_are_the_graphs_every_bit(ops, T, monkeypatch):
    """``tempered_stats`` (``sampler._tempered`` on the CPU): the row maximum of x = float64(logit) / T, Z (the float64
    sum of the float32 fused exponentials of x - m, in order) and the count above the cutoff, bit for bit what the
    graph form gives, eager and compiled; picks through ``pick`` the same with the primitive and without it."""
    from ptp_mlx import sampler as S

    rng = np.random.default_rng(int(T * 10))
    x = (rng.normal(size=(7, 3001)) * 4).astype(np.float32)
    x[1, :100] = -np.inf
    x[2] = np.round(x[2])
    x[3] *= 40  # (many tokens past the cutoff at a low temperature)
    x[4, 2999:] = 9.0  # the maximum in the tail past the last whole vector
    x[5] = -0.0
    x[6] = x[0] * 1e-3
    a = mx.array(x)
    s = S.SamplingSettings(temperature=T, top_p=0.9, order="prob")
    m, z, positive = ops.tempered_stats(a, T, S._CUTOFF)
    monkeypatch.setenv("PTP_MLX_TEMPERED", "0")
    for graph in (lambda v: S._tempered(v, s), mx.compile(lambda v: S._tempered(v, s))):
        xg, mg, zg = graph(a)
        pg = mx.sum(xg - mg > S._CUTOFF, axis=-1, keepdims=True)
        assert np.array_equal(np.array(m), np.array(mg))
        assert np.array_equal(np.array(z).view(np.int64), np.array(zg).view(np.int64))
        assert np.array(positive).tolist() == np.array(pg).tolist()
    if T == 0:
        return
    u = mx.array(rng.random(7).astype(np.float32))
    want = np.array(S.pick_with(u, a, s, check=False, fast=True))
    monkeypatch.setenv("PTP_MLX_TEMPERED", "1")
    assert np.array(S.pick_with(u, a, s, check=False, fast=True)).tolist() == want.tolist()
    assert np.array(mx.compile(lambda v: S.pick_with(u, v, s, check=False, fast=True))(a)).tolist() == want.tolist()
    with pytest.raises(ValueError, match="tempered_stats"):
        ops.tempered_stats(a.astype(mx.float16), T, S._CUTOFF)
