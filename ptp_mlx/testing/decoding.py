"""Shared pieces of the decoding tests: prompts and sampling settings, ``run`` / ``ar`` (decode through the one
generator every interface uses) and ``assert_same``, the exactness check against autoregressive decoding (a
divergence passes only at a measured float near-tie, explained by ``explain_divergence``); ``prefilled`` and
``chain_logits``: a K/V state and a fixed plain pass's logits over it. The models they run on are the fixtures of
``tests/conftest.py`` (``varied``, ``pm_sticky``, ``pm_random``), built by the functions here."""

from __future__ import annotations

import warnings
from collections import Counter

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..decode.fixed import _mask_fn, bank_for, topology
from ..drafting.budget import Budget
from ..drafting.cost import CostCurve
from ..drafting.policy import DraftingConfig
from ..generate import DecodeOptions, stream_generate
from ..model.kv import FixedPass, KVState
from ..model.layers import token_embedding
from ..model.ptp import PTPAdapter, PTPModel
from ..model.shape import CallShape, FixedPlan
from ..prompt import encode_prompt
from ..sampler import SamplingSettings
from . import OracleDrafter, explain_divergence, randomize_adapter

WINDOW = 4
PROMPTS = ["hello there", "The quick brown fox", "12345", "zz"]
SETTINGS = {
    "greedy": SamplingSettings(0.0),
    "T0.7-k20-p0.9": SamplingSettings(0.7, 20, 0.9),
    "T1.0": SamplingSettings(1.0),
    "T1.0-k50-p0.8": SamplingSettings(1.0, 50, 0.8),
}

# Budgets of every kind the decoding tests run under.
BUDGETS = {f"flat-w{w}": Budget(CostCurve.linear(0.0), max_width=w) for w in range(2, 9)}
BUDGETS["steep"] = Budget(CostCurve.linear(1.0), max_width=8)  # never worth a second row: AR-like calls
BUDGETS["mild"] = Budget(CostCurve.linear(0.05), max_width=6)
BUDGETS["histogram"] = Budget.from_histogram(CostCurve.linear(0.02), [5, 3, 2, 1, 1], max_width=5)
# Learns from the calls it sees (as the engine's budgets do): its choices change between answers, never the tokens.
BUDGETS["calibrated"] = Budget.from_histogram(CostCurve.linear(0.0), [1, 1, 1, 1, 1], max_width=6, calibrate=True)


def run(
    pm,
    tok,
    ids,
    s,
    max_tokens,
    mode,
    step="fused",
    budget=None,
    oracle=None,
    eos=None,
    num_draft_tokens=None,
    drafter=None,
    chain=True,
):
    # An oracle is a test drafter that proposes the given tokens (no auxiliary rows). Calls are built ahead wherever
    # the drafter can tell them (``chain=True``), whatever this machine's learnt choice: every chained path is tested.
    if oracle is not None:
        drafter = OracleDrafter(oracle, budget.max_width if budget else pm.config.window)
    opts = DecodeOptions(
        mode=mode,
        max_tokens=max_tokens,
        sampling=s,
        drafting=DraftingConfig(num_draft_tokens, budget, step=step),
        drafter=drafter,
        chain=chain,
    )
    steps = list(stream_generate(pm, tok, ids, opts, eos_ids=eos))
    tokens = [t for st in steps for t in st.tokens]
    return tokens, steps


def ar(pm, tok, ids, s, max_tokens, eos=None):
    return run(pm, tok, ids, s, max_tokens, "ar", eos=eos)


def assert_same(pm, tok, ids, s, max_tokens, mode_kw, eos=None, want=None):
    """Run PTP with ``mode_kw`` and check it against autoregressive decoding; returns the PTP steps.

    A divergence at a measured float near-tie (``ptp_mlx.ties``) is reported as a warning; any other fails."""
    want_tokens, want_steps = want or ar(pm, tok, ids, s, max_tokens, eos=eos)
    got_tokens, steps = run(pm, tok, ids, s, max_tokens, "ptp", eos=eos, **mode_kw)
    if got_tokens != want_tokens:
        eos_ids = sorted(eos if eos is not None else tok.eos_token_ids)
        _, tie, report = explain_divergence(pm, ids, s, want_tokens, got_tokens, eos_ids)
        assert tie is not None and tie.near_tie, report
        warnings.warn(report, stacklevel=2)
        return steps
    assert "".join(st.text for st in steps) == "".join(st.text for st in want_steps)
    assert steps[-1].finish_reason == want_steps[-1].finish_reason
    # Bookkeeping of every step: counts add up, blocks are accepted + 1 tokens unless the run stopped there.
    total = 0
    for st in steps:
        total += len(st.tokens)
        assert st.generated == total and 0 <= st.accepted <= st.proposed and st.rows >= 1 + st.proposed
        if st.finish_reason is None:
            assert len(st.tokens) == st.accepted + 1
        else:
            assert len(st.tokens) <= st.accepted + 1 and st is steps[-1]
    return steps


def with_seed(s: SamplingSettings, seed: int) -> SamplingSettings:
    return SamplingSettings(s.temperature, s.top_k, s.top_p, seed)


def varied_model(model):
    """Re-randomise ``model`` (the tiny Llama, a private copy) with larger weights: varied, moderately peaked
    next-token distributions (the shared tiny model always emits one token)."""
    mx.random.seed(0)
    new = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("embed_tokens.weight"):
            new.append((k, mx.random.normal(v.shape)))
        elif v.ndim == 2:
            new.append((k, mx.random.normal(v.shape) * 2.0 / np.sqrt(v.shape[1])))
        else:
            new.append((k, v))
    model.load_weights(new)
    mx.eval(model.parameters())
    return model


def sticky_model(model, tok) -> PTPModel:
    """A random adapter whose u-embedding pushes every draft towards the model's most frequent output token:
    drafts are right exactly when the model emits that token, so calls accept 0, 1 or several drafts."""
    counts = Counter()
    for p in PROMPTS:
        counts.update(ar(PTPModel(model), tok, encode_prompt(tok, p), SamplingSettings(0.0), 30)[0])
    frequent = counts.most_common(1)[0][0]
    mx.random.seed(1)
    ad = PTPAdapter(model, 4, 1.0, "binary")
    randomize_adapter(ad, seed=1)
    ad.u_embed.u_adapter.weight = mx.zeros_like(ad.u_embed.u_adapter.weight)
    ad.u_embed.u_adapter.bias = 30.0 * token_embedding(model).weight[frequent]
    mx.eval(ad.parameters())
    return PTPModel(model, ad, {"window": WINDOW}, fuse=True)  # the inference form the engine uses


def random_model(model) -> PTPModel:
    """A plainly random adapter with the linear_interpolation u-embedding and a reserved greedy u (drafts almost
    always wrong)."""
    mx.random.seed(2)
    ad = PTPAdapter(model, 4, 1.0, "linear_interpolation")
    randomize_adapter(ad, seed=2)
    # greedy_u: under greedy decoding every auxiliary row gets this reserved u (drafts the argmax).
    return PTPModel(model, ad, {"window": WINDOW, "greedy_u": 1.0})


def prefilled(pm, n: int):
    """``pm``'s K/V state after a prefill of ``n`` fixed token ids (``(7 i + 3) mod 250``)."""
    st = pm.make_cache()
    pm.base(mx.array((np.arange(n) * 7 + 3) % 250)[None], cache=st)
    mx.eval(st.arrays())  # sync: the tests read and trim this state
    return st


def chain_logits(pm, state, tokens: list[int]) -> np.ndarray:
    """One fixed pass (no auxiliary rows) of ``tokens`` as a chain (row j follows row j-1) after ``state``, as the
    compiled plain steps run it: their logits [k, vocab]; the state keeps the rows."""
    k = len(tokens)
    bucket, offset, end = bank_for(pm, False)._prepare(state, k)
    shape = CallShape(tuple(range(-1, k - 1)))
    p = FixedPass(offset, bucket, _mask_fn(*topology(shape), offset, bucket, pm.dtype))
    keys, values = state.take_buffers()
    st = KVState.traced(keys, values, p)
    pm.ctx.begin(FixedPlan(offset + mx.arange(k, dtype=mx.int32)), None, None)
    try:
        logits = pm.base(mx.array(tokens)[None], cache=st)[0]
    finally:
        pm.ctx.end()
    mx.eval(logits, *st.keys, *st.values)  # sync: the host reads the logits and trims the state
    state.put_buffers(st.keys, st.values, end)
    return np.array(logits)
