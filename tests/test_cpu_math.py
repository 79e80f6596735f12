"""The CPU's fused exp, softmax, attention and SwiGLU (ptp_mlx/model/cpu_math.py): close to MLX's own (exp within
1 ulp of ``mx.exp``; attention within float32 rounding of ``mx.fast.scaled_dot_product_attention`` for every mask
form mlx-lm passes), used only over our K/V state on the CPU, and off with ``PTP_MLX_CPU_MATH=0``."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from ptp_mlx.model import cpu_math


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def test_exp_is_mlx_exp_within_one_ulp_and_handles_the_ends():
    x = mx.concatenate([mx.random.normal((50000,), key=mx.random.key(1)) * 10, mx.linspace(-87.0, 88.0, 20001)])
    want, got = np.array(mx.exp(x)), np.array(mx.compile(cpu_math.exp)(x))
    normal = want > 1e-37
    assert ulps(want[normal], got[normal]).max() <= 1
    assert (got[~normal] < 1e-37).all()
    ends = np.array(cpu_math.exp(mx.array([-float("inf"), -1000.0, -88.5, 0.0])))
    assert ends.tolist() == [0.0, 0.0, 0.0, 1.0]  # a masked score (-inf) weighs exactly nothing


def test_softmax_logsumexp_silu_match_mlx():
    x = mx.random.normal((4, 3000), key=mx.random.key(2)) * 4
    np.testing.assert_allclose(np.array(cpu_math.softmax(x)), np.array(mx.softmax(x, axis=-1)), rtol=2e-6, atol=1e-9)
    lse = np.array(cpu_math.logsumexp(x))
    np.testing.assert_allclose(lse, np.array(mx.logsumexp(x, axis=-1)), rtol=1e-6)
    np.testing.assert_allclose(np.array(cpu_math.silu(x)), np.array(nn.silu(x)), rtol=2e-6, atol=1e-7)
    g = mx.random.normal((2, 5), key=mx.random.key(3))
    np.testing.assert_allclose(np.array(cpu_math.swiglu(g, x[:2, :5])), np.array(nn.silu(g) * x[:2, :5]), rtol=2e-6)
    row = mx.array([[0.0, -float("inf"), 1.0]])  # a masked entry gets exactly 0
    assert np.array(cpu_math.softmax(row))[0, 1] == 0.0


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("form", ["none", "additive", "bool", "causal", "4d"])
def test_attention_matches_mlx_for_every_mask_form(heads, form):
    hq, hkv = heads
    L, S, D = 5, 37, 16
    k0, k1, k2, k3 = mx.random.split(mx.random.key(4), 4)
    q = mx.random.normal((1, hq, L, D), key=k0)
    k = mx.random.normal((1, hkv, S, D), key=k1)
    v = mx.random.normal((1, hkv, S, D), key=k2)
    keep = mx.random.uniform(shape=(L, S), key=k3) < 0.7
    keep = keep | (mx.arange(S)[None] == (S - L + mx.arange(L))[:, None])  # every row sees a key
    mask = {
        "none": None,
        "additive": mx.where(keep, 0.0, -float("inf")),
        "bool": keep,
        "causal": "causal",
        "4d": mx.broadcast_to(keep[None, None], (1, hq, L, S)),
    }[form]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = cpu_math.attention(q, k, v, 0.25, mask)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


def test_attention_declines_forms_it_does_not_know():
    q, k = mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4))
    assert cpu_math.attention(q, k, k, 1.0, "sliding") is None


def test_dispatch_only_over_our_state_on_the_cpu(monkeypatch):
    from ptp_mlx.model.kv import KVState

    calls = []

    def stock(queries, keys, values, cache, scale, mask, sinks=None):
        calls.append("stock")
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    sdpa = cpu_math._attention_dispatcher(stock)
    swiglu = cpu_math._swiglu_dispatcher(lambda g, x: calls.append("stock swiglu") or g * x)
    q = mx.random.normal((1, 2, 1, 4), key=mx.random.key(5))
    ours = KVState(1)[0]
    monkeypatch.setattr(cpu_math, "enabled", lambda: True)
    sdpa(q, q, q, cache=ours, scale=1.0, mask=None)
    swiglu(q, q)
    assert calls == []  # our state: the fused kernels, and this layer's SwiGLU follows
    sdpa(q, q, q, cache=object(), scale=1.0, mask=None)  # mlx-lm's own cache: stock
    swiglu(q, q)
    assert calls == ["stock", "stock swiglu"]
    calls.clear()
    sdpa(q, q, q, cache=ours, scale=1.0, mask=None, sinks=mx.zeros((2,)))  # sinks: stock
    monkeypatch.setattr(cpu_math, "enabled", lambda: False)
    sdpa(q, q, q, cache=ours, scale=1.0, mask=None)
    swiglu(q, q)
    assert calls == ["stock", "stock", "stock swiglu"]


def test_enabled_follows_the_device_and_the_switch(monkeypatch):
    monkeypatch.delenv("PTP_MLX_CPU_MATH", raising=False)
    assert cpu_math.enabled() == (mx.default_device() == mx.cpu)
    monkeypatch.setenv("PTP_MLX_CPU_MATH", "0")
    assert not cpu_math.enabled()


def test_install_wraps_each_family_module_once(tiny):
    import sys

    from ptp_mlx.model.ptp import PTPModel

    model, _ = tiny
    PTPModel(model)
    mod = sys.modules[type(model.layers[0].self_attn).__module__]
    fn = mod.scaled_dot_product_attention
    assert hasattr(fn, "ptp_stock") and not hasattr(fn.ptp_stock, "ptp_stock")
    cpu_math.install(model.layers)
    assert mod.scaled_dot_product_attention is fn  # idempotent
    assert hasattr(mod.swiglu, "ptp_stock")
