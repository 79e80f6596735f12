"""The PTP model (docs/method.md, sections 2-3): token rows of a mixed pass are exactly the base model, auxiliary
rows see what section 3 says they see, the LoRA is gated to them, and trimming the cache forgets rejected rows.

Bit-exactness is checked against a plain mlx-lm forward **of the same shape** (the token rows followed by as
many filler tokens as there are auxiliary rows; the causal mask keeps the fillers away from the token rows).
On CPU, a BLAS gemm does not round a row identically for every number of rows (OpenBLAS blocks by row count),
so a forward of the token rows alone agrees only to rounding level; that is checked separately with a tolerance.
"""

import mlx.core as mx
import numpy as np
import pytest

from ptp_mlx.model.ptp import PTPAdapter, PTPModel, UEmbedding, Window
from ptp_mlx.model.shape import CallPlan
from ptp_mlx.testing import randomize_adapter

P = 30  # tokens already in the cache before the pass under test
IDS = [int(x) for x in np.random.default_rng(0).integers(3, 259, 80)]
ROUNDING = 1e-4  # tolerance where only BLAS blocking differs (observed ~1e-5 on logits of size ~10)


@pytest.fixture(scope="module")
def base(tiny):
    return tiny[0]


def adapter(base, kind: str = "binary", seed: int = 0, random: bool = True) -> PTPAdapter:
    mx.random.seed(100 + seed)
    ad = PTPAdapter(base, 4, 1.0, kind)
    if random:
        randomize_adapter(ad, seed=seed)
    mx.eval(ad.parameters())
    return ad


def prefilled(base, n: int = P):
    cache = PTPModel(base).make_cache()
    base(mx.array(IDS[:n])[None], cache=cache)
    mx.eval([c.keys_and_values() for c in cache])
    return cache


def uniforms(n: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).random(n, dtype=np.float32))


# (token rows, [(d, width), ...]) with Window(P + d, width): branch d sees the cache plus the first d token rows.
CONFIGS = [
    (1, [(1, 4)]),
    (1, [(1, 1)]),
    (6, [(1, 3), (3, 4)]),
    (3, [(1, 2), (2, 2), (3, 5)]),
    (5, [(1, 8), (5, 2)]),
]


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("kind", ["binary", "linear_interpolation"])
@pytest.mark.parametrize("n_tok,wins", CONFIGS, ids=lambda c: str(c))
def test_token_rows_equal_plain_forward(base, kind, n_tok, wins, fuse):
    windows = [Window(P + d, w) for d, w in wins]
    n_aux = sum(w.n for w in windows)
    tokens = IDS[P : P + n_tok]
    pm = PTPModel(base, adapter(base, kind), fuse=fuse)
    c_mixed, c_plain = prefilled(base), prefilled(base)
    mixed = pm(mx.array(tokens), uniforms(n_aux), windows, c_mixed)
    assert mixed.shape == (n_tok + n_aux, base.args.vocab_size)
    assert mixed.dtype == mx.float32
    filler = IDS[P + n_tok : P + n_tok + n_aux]
    plain = base(mx.array(tokens + filler)[None], cache=c_plain)[0]
    assert mx.array_equal(mixed[:n_tok], plain[:n_tok]), f"max diff {mx.abs(mixed[:n_tok] - plain[:n_tok]).max()}"
    # The KV rows written for the tokens (and the prefilled ones) are the plain forward's, bit for bit.
    for a, b in zip(c_mixed, c_plain, strict=True):
        (ka, va), (kb, vb) = a.keys_and_values(), b.keys_and_values()
        assert mx.array_equal(ka[..., : P + n_tok, :], kb[..., : P + n_tok, :])
        assert mx.array_equal(va[..., : P + n_tok, :], vb[..., : P + n_tok, :])
    # A forward of the token rows alone differs only by gemm blocking (rounding level).
    alone = base(mx.array(tokens)[None], cache=prefilled(base))[0]
    assert mx.abs(mixed[:n_tok] - alone).max().item() < ROUNDING
    assert mx.array_equal(mx.argmax(mixed[:n_tok], axis=-1), mx.argmax(alone, axis=-1))


def test_token_only_pass_equals_plain_forward(base):
    pm = PTPModel(base, adapter(base))
    for n in (1, 2, 7):
        got = pm(mx.array(IDS[P : P + n]), cache=prefilled(base))
        want = base(mx.array(IDS[P : P + n])[None], cache=prefilled(base))[0]
        assert mx.array_equal(got, want), n
    # Without a cache (a whole prompt in one pass: PTPModel makes its own K/V state, so the plain forward reads one
    # too; over mlx-lm's own caches attention runs MLX's kernels, not ``cpu_math``'s, and agrees to rounding).
    assert mx.array_equal(pm(mx.array(IDS[:12])), base(mx.array(IDS[:12])[None], cache=PTPModel(base).make_cache())[0])
    stock = base(mx.array(IDS[:12])[None])[0]
    assert mx.allclose(pm(mx.array(IDS[:12])), stock, rtol=1e-4, atol=1e-4)


def test_gate_token_rows_ignore_adapter_and_u_aux_rows_do_not(base):
    windows = [Window(P + 1, 4), Window(P + 3, 3)]
    tokens = mx.array(IDS[P : P + 4])

    def run(ad, u):
        return PTPModel(base, ad)(tokens, u, windows, prefilled(base))

    ref = run(adapter(base, seed=0), uniforms(7, 0))
    for other in (
        run(adapter(base, seed=1), uniforms(7, 0)),  # another LoRA
        run(adapter(base, random=False), uniforms(7, 0)),  # LoRA B = 0 (no delta)
        run(adapter(base, seed=0), uniforms(7, 1)),  # other uniforms
    ):
        assert mx.array_equal(other[:4], ref[:4])
        diff = mx.abs(other[4:] - ref[4:]).max(axis=-1)
        assert mx.all(diff > 1e-3).item(), diff  # every auxiliary row moved
    # The LoRA alone (same u-embedding, B random vs zero) changes the auxiliary rows.
    ad = adapter(base, seed=0)
    zero = adapter(base, seed=0)
    for layer in zero.layers:
        for lora in layer.values():
            lora.B = mx.zeros_like(lora.B)
    assert mx.abs(run(ad, uniforms(7))[4:] - run(zero, uniforms(7))[4:]).max().item() > 1e-3


def test_windows_see_only_their_context(base):
    """Section 3: windows never see each other, nor real tokens after their context (tolerance: shapes differ)."""
    pm = PTPModel(base, adapter(base))
    u2 = uniforms(3, 5)
    both = pm(
        mx.array(IDS[P : P + 5]),
        mx.concatenate([uniforms(4, 4), u2]),
        [Window(P + 2, 4), Window(P + 1, 3)],
        prefilled(base),
    )
    alone = pm(mx.array(IDS[P : P + 1]), u2, [Window(P + 1, 3)], prefilled(base))
    assert mx.abs(both[9:] - alone[1:]).max().item() < ROUNDING
    # A window whose context ends before the cache does: the later cached tokens are invisible to it.
    early = pm(mx.array(IDS[P : P + 1]), u2, [Window(P - 5, 3)], prefilled(base))
    short = pm(mx.array(IDS[P - 6 : P - 5]), u2, [Window(P - 5, 3)], prefilled(base, P - 6))
    assert mx.abs(early[1:] - short[1:]).max().item() < ROUNDING
    # ... while a window with a different context does give different drafts.
    assert mx.abs(early[1:] - alone[1:]).max().item() > 1e-2


class ShiftedCache:
    """Makes mlx-lm's own Llama layers compute auxiliary rows: new rows get RoPE positions from ``pos`` on and
    see the first ``ctx_len`` cached rows plus themselves causally (docs/method.md, section 3)."""

    def __init__(self, inner, ctx_len: int):
        self.inner, self.ctx_len, self.offset = inner, ctx_len, ctx_len - 1

    def update_and_fetch(self, k, v):
        K, V = self.inner.keys_and_values()
        return (
            mx.concatenate([K[..., : self.ctx_len, :], k], axis=2),
            mx.concatenate([V[..., : self.ctx_len, :], v], axis=2),
        )

    def make_mask(self, n, **_):
        return mx.array(np.concatenate([np.ones((n, self.ctx_len), bool), np.tril(np.ones((n, n), bool))], axis=1))


@pytest.mark.parametrize("kind", ["binary", "linear_interpolation"])
@pytest.mark.parametrize("ctx_len", [P, P - 4])
def test_aux_rows_match_reference_positions(base, kind, ctx_len):
    """With a zero LoRA, auxiliary rows are the base model fed the u-embedding at RoPE positions p - 1."""
    ad = adapter(base, kind, random=False)
    u = uniforms(5, 9)
    got = PTPModel(base, ad)(mx.array([], dtype=mx.int32), u, [Window(ctx_len, 5)], prefilled(base))
    cache = prefilled(base)
    want = base(
        mx.zeros((1, 5), dtype=mx.int32),
        cache=[ShiftedCache(c, ctx_len) for c in cache],
        input_embeddings=ad.u_embed(u)[None],
    )[0]
    assert mx.abs(got - want).max().item() < ROUNDING, mx.abs(got - want).max()


def test_trim_restores_cache_exactly(base):
    pm = PTPModel(base, adapter(base))
    tokens = IDS[P : P + 5]  # last accepted token + 4 drafts
    windows = [Window(P + 1, 3), Window(P + 3, 4)]
    accepted = 2
    keep = P + 1 + accepted
    follow = mx.array(IDS[60:63])  # a follow-up pass of 3 tokens overwrites rejected slots and goes beyond
    cache = prefilled(base)
    pm(mx.array(tokens), uniforms(7), windows, cache)
    for c in cache:
        c.trim(c.offset - keep)
    assert all(c.offset == keep for c in cache)
    got = pm(follow, cache=cache)
    # Reference: a fresh cache that never held the rejected rows, filled with the kept rows of a same-shape plain
    # forward (whose token rows are bit-identical to the mixed pass's, see above).
    plain = prefilled(base)
    base(mx.array(tokens + IDS[40:47])[None], cache=plain)
    fresh = PTPModel(base).make_cache()  # (the same kind of state: its attention is the same kernel's)
    for f, r in zip(fresh, plain, strict=True):
        k, v = r.keys_and_values()
        f.update_and_fetch(k[..., :keep, :], v[..., :keep, :])
    want = base(follow[None], cache=fresh)[0]
    assert mx.array_equal(got, want), f"max diff {mx.abs(got - want).max()}"
    # A fresh prefill of the accepted sequence agrees to rounding level (its gemm shapes differ).
    prefill = prefilled(base, keep)
    again = base(follow[None], cache=prefill)[0]
    assert mx.abs(got - again).max().item() < ROUNDING
    assert mx.array_equal(mx.argmax(got, axis=-1), mx.argmax(again, axis=-1))


def test_call_plan_mask_visibility():
    # Cache of 3, token rows at positions 3-4, Window(4, 2) and Window(5, 3).
    m = np.array(CallPlan.of_windows(3, 2, [Window(4, 2), Window(5, 3)]).mask(None))
    want = [  # cache | token rows | W1 | W2
        "111|10|00|000",  # token 3
        "111|11|00|000",  # token 4
        "111|10|10|000",  # W1 slot 0: sees 4 real tokens and itself
        "111|10|11|000",  # W1 slot 1
        "111|11|00|100",  # W2 slot 0: sees 5 real tokens, not W1
        "111|11|00|110",
        "111|11|00|111",
    ]
    assert m.shape == (7, 10) and m.dtype == bool
    assert ["".join("1" if x else "0" for x in row) for row in m] == [w.replace("|", "") for w in want]
    # Without a cache and without windows: plain causal.
    assert np.array_equal(np.array(CallPlan.of_windows(0, 4, []).mask(None)), np.tril(np.ones((4, 4), dtype=bool)))


def bits_msb_first(u: float) -> list[int]:
    i = int(np.array([u], dtype=np.float32).view(np.uint32)[0])
    return [(i >> (31 - j)) & 1 for j in range(32)]


def test_binary_u_embedding_bits_msb_first():
    emb = UEmbedding("binary", 40)
    emb.u_adapter.weight = mx.eye(40, 32)  # output[:32] = the bit features themselves
    emb.u_adapter.bias = mx.zeros((40,))
    us = [0.0, 0.5, 0.75, 1 / 3, float(np.nextafter(np.float32(1), np.float32(0))), 1e-8]
    out = np.array(emb(mx.array(us, dtype=mx.float32)))
    for r, u in enumerate(us):
        assert out[r, :32].tolist() == bits_msb_first(u), u
        assert not out[r, 32:].any()
    assert out[1, :32].tolist() == [0, 0] + [1] * 6 + [0] * 24  # 0.5 == 0x3F000000
    assert out[2, :32].tolist() == [0, 0] + [1] * 6 + [0, 1] + [0] * 22  # 0.75 == 0x3F400000


def test_linear_interpolation_u_embedding_endpoints():
    emb = UEmbedding("linear_interpolation", 4)
    E = mx.array([[1.0, 0, 0, 2], [0, 1.0, 0, 4], [0, 0, 1.0, 8]])
    emb.embedding.weight = E
    got = np.array(emb(mx.array([0.0, 0.25, 0.5, 0.75, 1.0])))
    want = np.array([E[0], (E[0] + E[1]) / 2, E[1], (E[1] + E[2]) / 2, E[2]])
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.array_equal(got[0], np.array(E[0])) and np.array_equal(got[2], np.array(E[1]))
    near_one = np.array(emb(mx.array([float(np.nextafter(np.float32(1), np.float32(0)))])))[0]
    np.testing.assert_allclose(near_one, np.array(E[2]), atol=1e-6)


def test_bad_construction_raises(base):
    with pytest.raises(ValueError, match="unknown u-embedding kind 'sawtooth'"):
        UEmbedding("sawtooth", 8)
    with pytest.raises(ValueError, match="unknown u-embedding kind"):
        PTPAdapter(base, 4, 1.0, "nope")
    with pytest.raises(ValueError, match="unknown LoRA target"):
        PTPAdapter(base, 4, 1.0, "binary", targets=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="out of range"):
        PTPAdapter(base, 4, 1.0, "binary", layers=[0, 5])
    with pytest.raises(ValueError, match="adapter"):
        PTPModel(base)(mx.array(IDS[:2]), uniforms(2), [Window(2, 2)])


def test_partial_adapter_targets_and_layers(base):
    """An adapter on some layers/targets only still keeps token rows exact and moves auxiliary rows."""
    mx.random.seed(3)
    ad = PTPAdapter(base, 2, 0.5, "binary", targets=("q_proj", "down_proj"), layers=[1])
    randomize_adapter(ad, seed=3)
    assert ad.layers[0] == {} and set(ad.layers[1]) == {"q_proj", "down_proj"}
    windows = [Window(P + 1, 3)]
    got = PTPModel(base, ad)(mx.array(IDS[P : P + 2]), uniforms(3), windows, prefilled(base))
    plain = base(mx.array(IDS[P : P + 2] + IDS[50:53])[None], cache=prefilled(base))[0]
    assert mx.array_equal(got[:2], plain[:2])


@pytest.mark.parametrize("targets,layers", [(None, None), (("q_proj", "v_proj", "up_proj", "down_proj"), [1])])
def test_fused_lora_matches_per_projection_lora(base, targets, layers, monkeypatch):
    """The inference form (stacked A, block-diagonal pre-scaled B) gives the same auxiliary logits: to rounding
    with A and B as given, to bfloat16's rounding with them held at it (the CPU primitive's default)."""
    from ptp_mlx.model import fused as fused_mod

    mx.random.seed(5)
    kw = {"targets": targets} if targets else {}
    ad = PTPAdapter(base, 3, 1.5, "binary", layers=layers, **kw)
    randomize_adapter(ad, scale=0.2, seed=5)
    windows = [Window(P + 1, 4), Window(P + 2, 3)]
    u = uniforms(7, seed=2)
    plain = PTPModel(base, ad)(mx.array(IDS[P : P + 2]), u, windows, prefilled(base))
    held = PTPModel(base, ad, fuse=True)(mx.array(IDS[P : P + 2]), u, windows, prefilled(base))
    monkeypatch.setattr(fused_mod, "LORA_STORAGE", None)
    fused = PTPModel(base, ad, fuse=True)(mx.array(IDS[P : P + 2]), u, windows, prefilled(base))
    assert mx.array_equal(plain[:2], fused[:2]) and mx.array_equal(plain[:2], held[:2])  # token rows: exact
    assert mx.abs(plain[2:] - fused[2:]).max().item() < ROUNDING
    if fused_mod.gated_module() is not None:  # held at bfloat16: 8 bits of mantissa in A and B, not 24
        assert ROUNDING < mx.abs(plain[2:] - held[2:]).max().item() < 0.05
    no_lora = PTPModel(base, PTPAdapter(base, 3, 1.5, "binary"))(mx.array(IDS[P : P + 2]), u, windows, prefilled(base))
    assert mx.abs(no_lora[2:] - fused[2:]).max().item() > 100 * ROUNDING  # the adapter does move them
    assert mx.abs(no_lora[2:] - held[2:]).max().item() > 100 * ROUNDING


def test_row_rope_in_one_call_equals_per_segment_rope_bit_for_bit():
    """RowRoPE gives every row its position in one kernel call (rows as batch entries); that must equal the
    per-segment calls, and token rows must equal a plain pass, bit for bit, for every RoPE class it batches."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE

    from ptp_mlx.model.layers import _BATCHED_ROPE, RowRoPE
    from ptp_mlx.model.shape import CallPlan, Window

    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    ropes = [
        nn.RoPE(16, traditional=False, base=10000),
        nn.RoPE(16, traditional=True, base=500000, scale=0.5),
        Llama3RoPE(16, max_position_embeddings=2048, traditional=False, base=500000, scaling_config=llama3),
        SuScaledRoPE(16, max_position_embeddings=4096, original_max_position_embeddings=64, long_factor=2.0),
        YarnRoPE(16, scaling_factor=4.0, original_max_position_embeddings=64),
    ]
    assert {type(r).__name__ for r in ropes} == set(_BATCHED_ROPE)

    class Ctx:
        plan = None

    for rope in ropes:
        ctx = Ctx()
        row = RowRoPE(rope, ctx)
        ctx.plan = CallPlan.of_windows(300, 3, [Window(301, 2), Window(302, 2), Window(303, 3)])
        x = mx.random.normal((1, 3, ctx.plan.rows, 16), key=mx.random.key(1))
        got = row(x)
        want = mx.concatenate([rope(x[:, :, s:e], offset=p) for s, e, p in ctx.plan.segments], axis=2)
        assert mx.array_equal(got, want).item(), type(rope).__name__
        assert mx.array_equal(got[:, :, :3], rope(x[:, :, :3], offset=300)).item(), type(rope).__name__
