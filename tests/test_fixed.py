"""The fixed-shape call (ptp_mlx/decode/fixed.py) and the K/V state it writes (ptp_mlx/model/kv.py).

A compiled call equals the same call run eagerly, and both equal the eager pass of ``PTPModel.__call__`` (a
``CallPlan`` at the host offset: numpy mask over exactly ``offset + rows`` keys) to float32 rounding, on every shape
the decoders use (chains, branches, token trees with sibling strands, no windows), in every attention bucket
(offsets on both sides of a 256-row boundary) and while the buffers grow; the compile bank holds one entry per shape
and bucket; buffers are written in place.
"""

import sys
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from ptp_mlx.decode.call import build_call, call_shape, finish_call
from ptp_mlx.decode.fixed import bank_for
from ptp_mlx.decode.session import DecodeSession
from ptp_mlx.drafting.policy import DraftingConfig
from ptp_mlx.drafting.protocol import DraftPlan, Strand
from ptp_mlx.engine import Engine
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.kernels import extension
from ptp_mlx.model.block import block_layers
from ptp_mlx.model.kv import CHUNK, KVState, round_up
from ptp_mlx.sampler import SamplingSettings, UniformStream
from ptp_mlx.testing import make_tiny_model, save_random_adapter
from ptp_mlx.testing.decoding import prefilled

PLANS = {
    "one-window": DraftPlan([], [(0, 4)]),
    "chain": DraftPlan([7, 9], [(0, 2), (1, 2), (2, 3)]),
    "partial-branches": DraftPlan([7, 9, 11], [(1, 2), (3, 4)]),
    "tree": DraftPlan([7, 9], [(0, 2), (2, 3)], strands=[Strand(0, (12,), 2), Strand(0, (13,))]),
    "deep-tree": DraftPlan(
        [7, 9, 11], [(0, 2)], strands=[Strand(1, (12, 14), 2), Strand(2, (13,)), Strand(3, (5, 6, 8), 3)]
    ),
    "nested-tree": DraftPlan(
        [7, 9, 11],
        [(0, 2), (3, 2)],
        strands=[
            Strand(1, (12, 14), 2),
            Strand(2, (13, 4), 2, parent=0),
            Strand(0, (6,)),
            Strand(3, (5,), 0, parent=1),
        ],
    ),
    "no-windows": DraftPlan([7, 9, 11], []),
}
SETTINGS = {"greedy": SamplingSettings(0.0), "sampled": SamplingSettings(0.9, 40, 0.95, seed=3)}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("fixed")
    model = make_tiny_model(d / "model", varied=True, seed=3, context=1024)  # room for a 512-token answer
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PTP_MLX_HOME", str(d / "home"))
        eng = Engine.load(str(model), str(save_random_adapter(model, d / "adapter")), measure_cost=False)
    bank_for(eng.pm, True).compile_after = 1  # compiled from the first call: these tests compare compiled calls
    return eng


def run(pm, st, plan, s, bank):
    u = UniformStream(5)
    sess = DecodeSession(pm, st, u, s, None, bank=bank, runner_up=True, reads_top_prob=not s.greedy)
    call = build_call(sess, 3, plan, 0)
    res = finish_call(st, call)
    return res, [np.array(k) for k, _ in st.contents()], st.offset


@pytest.mark.parametrize("sname", list(SETTINGS))
@pytest.mark.parametrize("pname", list(PLANS))
@pytest.mark.parametrize("offset", [20, CHUNK - 9, CHUNK - 3])  # the call's rows in one bucket, or across two
def test_compiled_call_equals_eager_call_and_eager_pass(engine, pname, sname, offset):
    pm, plan, s = engine.pm, PLANS[pname], SETTINGS[sname]
    got = {}
    for name, bank in (("pass", None), ("eager", bank_for(pm, False)), ("compiled", bank_for(pm, True))):
        got[name] = run(pm, prefilled(pm, offset), plan, s, bank)
    # Compiled and eager: the same function, bit for bit.
    (res, kv, off), (ref, ref_kv, ref_off) = got["compiled"], got["eager"]
    assert res == ref and off == ref_off and all(np.array_equal(a, b) for a, b in zip(kv, ref_kv, strict=True))
    # Against the eager pass: the same picks and drafts; attention over a padded bucket (the masked keys add exact
    # zeros, but the sums are blocked differently) rounds its confidences and K/V at float32 level.
    ps, ps_kv, ps_off = got["pass"]
    assert (res.block, res.accepted, res.strand, res.aux_tokens) == (ps.block, ps.accepted, ps.strand, ps.aux_tokens)
    assert [[t for t, _ in a] for a in res.alts] == [[t for t, _ in a] for a in ps.alts] and off == ps_off
    close = [(res.aux_conf, ps.aux_conf), ([[c for _, c in a] for a in res.alts], [[c for _, c in a] for a in ps.alts])]
    close += [(res.aux_top_prob or [], ps.aux_top_prob or [])] + list(zip(kv, ps_kv, strict=True))
    for a, b in close:
        assert np.allclose(a, b, rtol=1e-4, atol=1e-5)
    bank = bank_for(pm, True)
    assert (("ptp", call_shape(plan, True, not s.greedy).graph_key, s), round_up(offset + plan.rows)) in bank.entries


@pytest.mark.parametrize("sname", list(SETTINGS))
def test_shapes_with_the_same_row_counts_share_one_compiled_graph(engine, sname):
    """The tree and the windows are inputs of the graph (``topology``): shapes with the same row counts
    (``graph_key``) but other parents, branches and positions run one compiled entry, each equal to its own eager
    pass."""
    pm, s = engine.pm, SETTINGS[sname]
    alike = [  # 4 token rows (2 chain drafts), 6 auxiliary rows each
        DraftPlan([7, 9], [(0, 2), (2, 4)], strands=[Strand(0, (12,))]),
        DraftPlan([7, 9], [(1, 3)], strands=[Strand(1, (13,), 3)]),
        DraftPlan([7, 9], [(0, 6)], strands=[Strand(1, (5,))]),
    ]
    keys = {call_shape(p, True, not s.greedy).graph_key for p in alike}
    assert len(keys) == 1 and len({call_shape(p, True, not s.greedy) for p in alike}) == 3
    bank = bank_for(pm, True)
    bank.entries.clear()
    for plan in alike:
        res, kv, off = run(pm, prefilled(pm, 30), plan, s, bank)
        ps, ps_kv, ps_off = run(pm, prefilled(pm, 30), plan, s, None)
        assert (res.block, res.accepted, res.strand, res.aux_tokens) == (
            ps.block,
            ps.accepted,
            ps.strand,
            ps.aux_tokens,
        )
        assert off == ps_off and all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(kv, ps_kv, strict=True))
    assert len(bank.entries) == 1


def test_bank_holds_one_entry_per_shape_and_bucket(engine):
    pm = engine.pm
    bank = bank_for(pm)  # the bank decoding uses (compiled, or the eager reference under PTP_MLX_EAGER=1)
    bank.entries.clear()
    steps = list(engine.generate(engine.encode("hello there"), mode="ptp", max_tokens=60, num_draft_tokens=3))
    used = {k for k in bank.entries}
    assert 0 < len(used) == len(bank.entries)
    # A fixed budget has one chain shape (and shorter ones near the end); the buckets are those the answer crossed.
    offsets = {st.prompt_tokens + st.generated for st in steps}
    buckets = {bucket for what, bucket in used if what[0] == "ptp"}
    assert buckets <= {round_up(o + r) for o in offsets for r in range(1, 40)}
    again = list(engine.generate(engine.encode("hello there"), mode="ptp", max_tokens=60, num_draft_tokens=3))
    assert [t for st in again for t in st.tokens] == [t for st in steps for t in st.tokens]
    assert set(bank.entries) == used  # the same answer again: no new entry


@pytest.mark.parametrize("budget", ["adaptive", "fixed"])
def test_bank_after_a_512_token_answer_holds_only_what_it_used(engine, budget, monkeypatch):
    """A long answer (bursts, lookup chains, trees, chained calls, three buckets) leaves one entry per key it asked
    for: (shape, bucket, settings) of every call and step, and nothing else."""
    bank = bank_for(engine.pm)
    bank.entries.clear()
    asked: set = set()
    real = bank._fn

    def spy(what, bucket, make):
        asked.add((what, bucket))
        return real(what, bucket, make)

    monkeypatch.setattr(bank, "_fn", spy)
    s = SamplingSettings()
    opts = DecodeOptions(mode="ptp", max_tokens=512, sampling=s, drafting=DraftingConfig(budget=engine.budget_for(s)))
    if budget == "fixed":
        opts.drafting = replace(opts.drafting, num_draft_tokens=3)
    ids = engine.encode("hello there")
    steps = list(stream_generate(engine.pm, engine.tokenizer, ids, opts, eos_ids=set()))  # no end token: 512
    assert sum(len(st.tokens) for st in steps) == 512
    assert set(bank.entries) == asked and len(bank.entries) == len(asked)
    assert len({bucket for _, bucket in asked}) >= 2  # the answer crossed attention buckets
    assert len(asked) <= 3 * 4 * 16  # a handful of shapes per bucket, not one entry per call
    assert len(steps) > len(asked)


def test_ar_steps_compiled_equal_eager_across_growth(engine):
    """Plain decoding over a 256-row boundary: the buffers grow by a chunk, the bucket moves, tokens agree."""
    ids = list(((np.arange(240) * 5 + 1) % 250).tolist())
    for s in SETTINGS.values():
        runs = [
            [t for st in engine.generate(ids, mode="ar", sampling=s, max_tokens=40, compiled=c) for t in st.tokens]
            for c in (True, False)
        ]
        assert runs[0] == runs[1] and len(runs[0]) > 16


def test_shapes_compile_on_their_second_use(engine):
    """A shape met once runs eagerly (tracing costs several calls); its second call compiles it."""
    bank = bank_for(engine.pm, True)
    bank.compile_after, plan, s = 2, PLANS["chain"], SETTINGS["greedy"]
    try:
        bank.entries.clear()
        bank.recurring.clear()  # (earlier tests compiled this shape in this bucket)
        first = run(engine.pm, prefilled(engine.pm, 30), plan, s, bank)
        assert not bank.entries and len(bank.uses) == 1
        second = run(engine.pm, prefilled(engine.pm, 30), plan, s, bank)
        assert len(bank.entries) == 1 and not bank.uses
        assert first[0] == second[0] and all(np.array_equal(a, b) for a, b in zip(first[1], second[1], strict=True))
    finally:
        bank.compile_after = 1


def test_a_shape_compiles_at_its_first_call_where_a_layer_is_one_primitive(engine, monkeypatch):
    """Where a layer is one node (ptp-block on the CPU) a shape's tracing costs about its eager call, so a bank
    compiles it at its first call; over MLX's per-op graph (the block off) the first call runs eagerly."""
    saved = engine.pm.__dict__.pop("_banks", None)
    try:
        on = block_layers(engine.pm.base) > 0
        assert on or sys.platform != "linux" or extension.module() is None  # (built here: the block is in use)
        assert bank_for(engine.pm, True).compile_after == (1 if on else 2)
        engine.pm.__dict__.pop("_banks")
        monkeypatch.setenv("PTP_MLX_BLOCK", "0")
        assert block_layers(engine.pm.base) == 0 and bank_for(engine.pm, True).compile_after == 2
    finally:
        engine.pm.__dict__.pop("_banks", None)
        if saved is not None:
            engine.pm.__dict__["_banks"] = saved


def test_a_shape_compiled_for_one_bucket_compiles_at_once_in_the_next(engine):
    """A shape compiled for one attention bucket recurs: in a new bucket (a context past 256) its first call compiles
    it, without the eager call first, and gives the eager call's bits."""
    bank = bank_for(engine.pm, True)
    bank.compile_after, plan, s = 2, PLANS["chain"], SETTINGS["greedy"]
    try:
        bank.entries.clear()
        bank.recurring.clear()
        for _ in range(2):  # bucket 256: eager, then compiled
            run(engine.pm, prefilled(engine.pm, 30), plan, s, bank)
        assert len(bank.entries) == 1 and not bank.uses
        compiled = run(engine.pm, prefilled(engine.pm, 300), plan, s, bank)  # bucket 512: compiled at once
        assert len(bank.entries) == 2 and not bank.uses
        bank.entries.clear()
        bank.recurring.clear()
        eager = run(engine.pm, prefilled(engine.pm, 300), plan, s, bank)  # a shape never compiled: eager first
        assert not bank.entries and len(bank.uses) == 1
        assert compiled[0] == eager[0] and all(np.array_equal(a, b) for a, b in zip(compiled[1], eager[1], strict=True))
    finally:
        bank.compile_after = 1
        bank.uses.clear()


def test_kv_state_verbs():
    st = KVState(2)
    for layer in st:
        layer.update_and_fetch(mx.ones((1, 2, 3, 4)), 2 * mx.ones((1, 2, 3, 4)))
    assert st.offset == 3 and st.capacity == CHUNK
    snap = st.snapshot()
    st.trim_to(1)
    assert st.offset == 1
    with pytest.raises(ValueError):
        st.trim_to(2 + CHUNK)
    for layer in st:
        layer.update_and_fetch(5 * mx.ones((1, 2, CHUNK, 4)), mx.zeros((1, 2, CHUNK, 4)))
    assert st.offset == 1 + CHUNK and st.capacity == 2 * CHUNK  # grown by a whole chunk, old rows kept
    k, _ = st.contents()[0]
    assert float(k[..., 0, :].sum()) == 8 and float(k[..., 1:, :].sum()) == 5 * 8 * CHUNK
    st.copy_rows(0, 5)
    assert float(st.contents()[1][0][..., 5, :].sum()) == 8
    st.restore(snap)
    assert st.offset == 3 and float(st.contents()[0][0].sum()) == 3 * 8


def test_writes_do_not_copy_the_buffers(engine):
    """A fixed call writes its rows in place: the state is the buffers' only holder, so MLX updates them where
    they are. Measured by memory, not time: a call on a 16-chunk buffer allocates no more than on a 1-chunk one."""
    pm = engine.pm
    bank = bank_for(pm, True)
    shape_plan = PLANS["chain"]
    peaks = []
    for extra in (0, 15 * CHUNK):
        st = prefilled(pm, 40)
        st.reserve(extra + 40, bank.shapes or __import__("ptp_mlx.model.kv", fromlist=["kv_shapes"]).kv_shapes(pm.base))
        mx.eval(st.arrays())
        run(pm, st, shape_plan, SETTINGS["greedy"], bank)  # warm: the trace is built
        st.trim_to(40)
        mx.eval(st.arrays())
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        run(pm, st, shape_plan, SETTINGS["greedy"], bank)
        peaks.append(mx.get_peak_memory() - before)
    kv_bytes = sum(a.nbytes for a in st.arrays())
    assert peaks[1] < peaks[0] + kv_bytes / 4, (peaks, kv_bytes)


@pytest.mark.parametrize("vocab", [250, 256, 49152, 1000])
def test_runner_ups_are_the_next_likeliest_tokens(vocab):
    """``runner_ups``: each row's ``ALTS`` likeliest tokens after its argmax, best first, as a full sort gives them
    (a vocabulary that is not a multiple of the search's block too); compiled equals eager."""
    from ptp_mlx.decode.fixed import ALTS, runner_ups

    rng = np.random.default_rng(vocab)
    x = rng.normal(size=(9, vocab)).astype(np.float32)
    x[3, :] = 0.0  # a row of ties: the argmax is the first, runner-ups any others of the same value
    x[4, vocab - 1] = 9.0  # the argmax in the last, padded block
    a = mx.array(x)
    top = mx.argmax(a, axis=-1)
    ids, logits = runner_ups(a, top)
    cids, clogits = mx.compile(runner_ups)(a, top)
    assert np.array_equal(np.array(ids), np.array(cids)) and np.array_equal(np.array(logits), np.array(clogits))
    ids, logits = np.array(ids), np.array(logits)
    for r in range(len(x)):
        order = np.argsort(-x[r], kind="stable")
        if r == 3:
            assert len(set(ids[r])) == ALTS and 0 not in ids[r] and np.all(logits[r] == 0.0)
            continue
        assert list(ids[r]) == list(order[1 : ALTS + 1]) and np.allclose(logits[r], x[r][order[1 : ALTS + 1]])
