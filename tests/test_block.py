"""ptp-block (``kernels/block.cpp``, ``model/block.py``): a fixed pass's llama-style layer as one primitive.

It must equal the per-op graph it stands for bit for bit (every output of a PTP call of every plan shape, greedy and
sampled, the K/V rows it writes, a plain step's logits), on the real default model with its shipped adapter and on
the tiny test model; it must actually run there (counted), never on passes it does not cover (prefill, mlx-lm's own
cache), and ``PTP_MLX_BLOCK=0`` must switch it off."""

from __future__ import annotations

import contextlib
import io
import sys

import mlx.core as mx
import numpy as np
import pytest

from ptp_mlx.decode.call import build_call, finish_call
from ptp_mlx.decode.fixed import bank_for
from ptp_mlx.decode.session import DecodeSession
from ptp_mlx.drafting.protocol import DraftPlan, Strand
from ptp_mlx.engine import Engine
from ptp_mlx.kernels import extension, packed
from ptp_mlx.model import block as blockmod
from ptp_mlx.sampler import SamplingSettings, UniformStream
from ptp_mlx.testing import make_tiny_model, save_random_adapter
from ptp_mlx.testing.decoding import chain_logits, prefilled

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="built on Linux only")

PLANS = {
    "one-window": DraftPlan([], [(0, 4)]),
    "chain": DraftPlan([7, 9], [(0, 2), (1, 2), (2, 3)]),
    "tree": DraftPlan([7, 9], [(0, 2), (2, 3)], strands=[Strand(0, (12,), 2), Strand(0, (13,))]),
    "no-windows": DraftPlan([7, 9, 11], []),
}
SETTINGS = {"greedy": SamplingSettings(0.0), "sampled": SamplingSettings(0.9, 40, 0.95, seed=3)}


@pytest.fixture(scope="module")
def needs_extension():
    if extension.module() is None:
        pytest.skip(f"the CPU extension is not built here: {extension._state['why']}")


@pytest.fixture(scope="module")
def default_engine(default_model_dir, needs_extension):
    return Engine.load(str(default_model_dir), None, measure_cost=False)


_TINY: dict[str, Engine] = {}


def _tiny(family: str, tmp_path_factory) -> Engine:
    """A tiny random model of ``family`` with a random adapter (one per family for the module)."""
    if family not in _TINY:
        d = tmp_path_factory.mktemp(f"block-{family}")
        model = make_tiny_model(d / "model", family=family, varied=True, seed=3)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PTP_MLX_HOME", str(d / "home"))
            _TINY[family] = Engine.load(str(model), str(save_random_adapter(model, d / "adapter")), measure_cost=False)
    return _TINY[family]


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory, needs_extension):
    return _tiny("llama", tmp_path_factory)


@pytest.fixture
def counted(monkeypatch):
    """How many layers took the primitive (a list, appended to per layer call that did)."""
    seen: list[int] = []
    real = blockmod.layer_block

    def spy(*args):
        out = real(*args)
        if out is not None:
            seen.append(1)
        return out

    monkeypatch.setattr(blockmod, "layer_block", spy)
    return seen


def _call(pm, plan: DraftPlan, s: SamplingSettings, after_prefill=None):
    """One eager PTP call after a 40-token prefix: every output it returns and the K/V rows it keeps."""
    st = prefilled(pm, 40)
    if after_prefill is not None:
        after_prefill()
    sess = DecodeSession(
        pm, st, UniformStream(5), s, None, bank=bank_for(pm, False), runner_up=True, reads_top_prob=not s.greedy
    )
    call = build_call(sess, 3, plan, 0)
    outs = {k: np.array(v) for k, v in vars(call.out).items() if isinstance(v, mx.array)}
    finish_call(st, call)
    return outs, [np.array(a) for kv in st.contents() for a in kv]


def _same(a, b) -> None:
    assert a.keys() == b.keys() if isinstance(a, dict) else len(a) == len(b)
    for x, y in zip(a.values(), b.values(), strict=True) if isinstance(a, dict) else zip(a, b, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)


def test_the_supported_layers_qualify(default_engine, tiny_engine):
    for eng in (default_engine, tiny_engine):
        assert all(getattr(type(layer), "_ptp_block", False) for layer in eng.pm.base.layers)


@pytest.mark.parametrize("sname", list(SETTINGS))
@pytest.mark.parametrize("pname", list(PLANS))
@pytest.mark.parametrize("which", ["default", "llama", "qwen2", "qwen3", "mistral"])
def test_a_call_through_the_block_equals_the_per_op_graph(
    default_engine, tmp_path_factory, needs_extension, counted, monkeypatch, which, pname, sname
):
    pm = (default_engine if which == "default" else _tiny(which, tmp_path_factory)).pm
    plan, s = PLANS[pname], SETTINGS[sname]
    monkeypatch.setenv("PTP_MLX_BLOCK", "0")
    per_op = _call(pm, plan, s)
    assert not counted
    monkeypatch.setenv("PTP_MLX_BLOCK", "1")
    one = _call(pm, plan, s)
    assert len(counted) == len(pm.base.layers)  # every layer of the call took it (prefill did not)
    _same(per_op[0], one[0])
    _same(per_op[1], one[1])


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_plain_passes_and_their_k_v_rows_are_the_per_op_graphs(default_engine, counted, monkeypatch, rows):
    pm = default_engine.pm
    got = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PTP_MLX_BLOCK", flag)
        st = prefilled(pm, 30)
        logits = chain_logits(pm, st, [101 + 13 * j for j in range(rows)])
        got[flag] = (logits, [np.array(a) for kv in st.contents() for a in kv])
    assert len(counted) == len(pm.base.layers)
    assert np.array_equal(got["0"][0], got["1"][0])
    _same(got["0"][1], got["1"][1])


@contextlib.contextmanager
def _weights_as_inputs():
    """``block_hold(False)`` within: every array a graph input (the reference)."""
    ext = extension.module()
    ext.block_hold(False)
    try:
        yield
    finally:
        ext.block_hold(True)


def _graph_edges(out: mx.array) -> int:
    f = io.StringIO()
    mx.export_to_dot(f, out)
    return sum("->" in line for line in f.getvalue().splitlines())


@pytest.mark.parametrize("which", ["default", "qwen3"])
def test_weights_held_by_the_primitive_give_the_bits_of_weights_as_inputs(
    default_engine, tmp_path_factory, counted, which
):
    pm = (default_engine if which == "default" else _tiny(which, tmp_path_factory)).pm
    plan, s = PLANS["tree"], SETTINGS["sampled"]
    with _weights_as_inputs():
        ref = _call(pm, plan, s)
    held = _call(pm, plan, s)
    assert len(counted) == 2 * len(pm.base.layers)
    _same(ref[0], held[0])
    _same(ref[1], held[1])


def _call_edges(pm, plan: DraftPlan, s: SamplingSettings, after_prefill=None) -> int:
    """The edges of one eager PTP call's graph as MLX holds it before the call is evaluated."""
    st = prefilled(pm, 40)
    if after_prefill is not None:
        after_prefill()
    sess = DecodeSession(pm, st, UniformStream(5), s, None, bank=bank_for(pm, False), runner_up=True)
    call = build_call(sess, 3, plan, 0)
    n = _graph_edges(call.out.targets)
    finish_call(st, call)
    return n


def test_held_weights_leave_the_graph_and_lazy_ones_stay_in_it(default_engine, counted, monkeypatch):
    """The graph a call hands MLX (what a compiled call replays, a queue traverses and a release frees) loses the
    weights' edges (14 a layer with the adapter's LoRA); a weight not evaluated yet stays a graph input, computed
    first, with the same bits."""
    pm = default_engine.pm
    plan, s = PLANS["chain"], SETTINGS["greedy"]
    with _weights_as_inputs():
        as_inputs = _call_edges(pm, plan, s)
    held = _call_edges(pm, plan, s)
    assert as_inputs - held >= 14 * len(pm.base.layers)
    ref = _call(pm, plan, s)
    norm = pm.base.layers[0].input_layernorm

    def lazy_norm():  # the same values, as a node not evaluated yet (the prefill would have evaluated it)
        monkeypatch.setattr(norm, "weight", norm.weight * 1.0)

    assert _call_edges(pm, plan, s, lazy_norm) > held
    monkeypatch.undo()
    lazy = _call(pm, plan, s, lazy_norm)
    _same(ref[0], lazy[0])
    _same(ref[1], lazy[1])


def test_stock_caches_and_prefill_keep_the_module_path(default_engine, counted):
    from mlx_lm.models.cache import make_prompt_cache

    base = default_engine.pm.base
    mx.eval(base(mx.array([[1, 2, 3]]), cache=make_prompt_cache(base)))
    prefilled(default_engine.pm, 12)
    assert not counted


def test_a_snapshot_keeps_its_buffers_while_the_block_writes(default_engine, counted):
    """The K/V rows are written in place only where nothing else holds the buffers (MLX's own rule for a slice
    update): a snapshot of the state taken before the pass keeps what it had."""
    pm = default_engine.pm
    st = prefilled(pm, 20)
    snap = st.snapshot()
    before = [np.array(a) for a in snap[0] + snap[1]]
    chain_logits(pm, st, [5, 6, 7])
    assert len(counted) == len(pm.base.layers)
    _same(before, [np.array(a) for a in snap[0] + snap[1]])
    assert not np.array_equal(np.array(st.keys[0]), before[0])  # the state's own buffers did get the rows


@pytest.mark.parametrize("k", range(2, 25))
def test_k_rows_through_the_block_equal_k_one_row_passes(default_engine, counted, k):
    """Batch invariance (docs/method.md section 10) holds through the block, as through the per-op graph, on the
    default model as it runs: products from its codes up to 10 rows, from its floats beyond (k = 2..24)."""
    pm = default_engine.pm
    if packed.enabled() and packed.registry() is not None:  # (the AVX-512 kernel: the model is read from codes)
        assert packed.registered(m.weight for m in pm.base.modules() if hasattr(m, "weight")) > 0
    tokens = [200 + 31 * j for j in range(k)]
    st = prefilled(pm, 25)
    alone = np.concatenate([chain_logits(pm, st, [t]) for t in tokens])
    st.trim_to(25)
    together = chain_logits(pm, st, tokens)
    assert len(counted) == (k + 1) * len(pm.base.layers)
    assert np.array_equal(alone, together)


def test_an_engine_without_an_adapter_takes_the_block_too(tmp_path, counted, monkeypatch, needs_extension):
    """No adapter (a converted model decoded plainly or with prompt lookup): its projections are fused alone, and
    its fixed passes run one node a layer, with the per-op graph's bits."""
    model = make_tiny_model(tmp_path / "model", varied=True, seed=5)
    monkeypatch.setenv("PTP_MLX_HOME", str(tmp_path / "home"))
    pm = Engine.load(str(model), "none", measure_cost=False).pm
    assert pm.adapter is None
    got = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PTP_MLX_BLOCK", flag)
        st = prefilled(pm, 10)
        got[flag] = chain_logits(pm, st, [3, 4, 5])
    assert len(counted) == len(pm.base.layers)
    assert np.array_equal(got["0"], got["1"])


def test_the_cost_curve_key_counts_the_block_layers(default_engine, monkeypatch):
    """A curve probed with a node per op must not price calls made one node a layer (a step ~30% cheaper)."""
    base = default_engine.pm.base
    assert blockmod.block_layers(base) == len(base.layers)
    monkeypatch.setenv("PTP_MLX_BLOCK", "0")
    assert blockmod.block_layers(base) == 0
