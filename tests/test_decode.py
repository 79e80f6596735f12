"""Decoding exactness, the central test (issue 3): PTP output equals autoregressive output token for token for
the same seed, for greedy and sampled settings, both step kinds, many budgets, EOS and the token limit inside a
block, and prompts at the context limit. An oracle drafter (the teacher's own continuation) proves that the
verify/trim bookkeeping wastes nothing: every call accepts the full width.

The tiny model of the shared fixture always emits one token, so these tests re-randomise a copy of it with
larger weights (varied, moderately peaked next-token distributions). Where an output differs, the failure
names the first divergent position, its top-2 logit gap and how close ``u`` was to a bin edge, so a numerical
near-tie (docs/method.md, section 11) is told apart from a logic error.
"""

import warnings
from collections import Counter

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.chain import ChainDrafter
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.protocol import CallResult, Drafter, Plan
from ptp_mlx.generate import ContextFull, DecodeOptions, encode_prompt, stream_generate
from ptp_mlx.model.layers import token_embedding
from ptp_mlx.model.ptp import PTPAdapter, PTPModel
from ptp_mlx.sampler import SamplingSettings, UniformStream, bins
from ptp_mlx.testing import OracleDrafter, TreeDrafter, explain_divergence, randomize_adapter

WINDOW = 4
PROMPTS = ["hello there", "The quick brown fox", "12345", "zz"]
SETTINGS = {
    "greedy": SamplingSettings(0.0),
    "T0.7-k20-p0.9": SamplingSettings(0.7, 20, 0.9),
    "T1.0": SamplingSettings(1.0),
    "T1.0-k50-p0.8": SamplingSettings(1.0, 50, 0.8),
}


@pytest.fixture(scope="module")
def varied(tiny_model_dir):
    """(model, tokenizer): the tiny Llama with re-randomised, larger weights (a private copy)."""
    model, tok = mlx_lm.load(str(tiny_model_dir))
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
    return model, tok


@pytest.fixture(scope="module")
def pm_sticky(varied):
    """A random adapter whose u-embedding pushes every draft towards the model's most frequent output token:
    drafts are right exactly when the model emits that token, so calls accept 0, 1 or several drafts."""
    model, tok = varied
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


@pytest.fixture(scope="module")
def pm_random(varied):
    """A plainly random adapter with the linear_interpolation u-embedding and a reserved greedy u (drafts almost
    always wrong)."""
    model, _ = varied
    mx.random.seed(2)
    ad = PTPAdapter(model, 4, 1.0, "linear_interpolation")
    randomize_adapter(ad, seed=2)
    # greedy_u: under greedy decoding every auxiliary row gets this reserved u (drafts the argmax).
    return PTPModel(model, ad, {"window": WINDOW, "greedy_u": 1.0})


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
):
    # An oracle is a test drafter that proposes the given tokens (no auxiliary rows).
    if oracle is not None:
        drafter = OracleDrafter(oracle, budget.max_width if budget else pm.config.window)
    opts = DecodeOptions(
        mode=mode,
        step=step,
        max_tokens=max_tokens,
        sampling=s,
        budget=budget,
        drafter=drafter,
        num_draft_tokens=num_draft_tokens,
    )
    steps = list(stream_generate(pm, tok, ids, opts, eos_ids=eos))
    tokens = [t for st in steps for t in st.tokens]
    return tokens, steps


def ar(pm, tok, ids, s, max_tokens, eos=None):
    return run(pm, tok, ids, s, max_tokens, "ar", eos=eos)


def divergence_report(pm, ids, s, want, got) -> str:
    """First divergent position, its top-2 logit gap and u's distance to the nearest bin edge."""
    g = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
    if g >= min(len(want), len(got)):
        return f"lengths differ: ar {len(want)} vs ptp {len(got)} (common prefix {g})"
    logits = pm.base(mx.array(list(ids) + want[:g])[None])[0, -1].astype(mx.float32)
    top2 = np.sort(np.array(logits))[-2:]
    u = UniformStream(s.seed)[g]
    lo, hi = bins(mx.broadcast_to(logits, (2, logits.size)), mx.array([want[g], got[g]]), s)
    edge = min(abs(u - float(x)) for x in (*np.array(lo), *np.array(hi)))
    return (
        f"first divergence at generated position {g}: ar {want[g]} vs ptp {got[g]}; top-2 logit gap "
        f"{top2[1] - top2[0]:.3g}; u={u:.9f}, nearest bin edge {edge:.3g} away"
    )


def assert_same(pm, tok, ids, s, max_tokens, mode_kw, eos=None, want=None):
    """Run PTP with ``mode_kw`` and check it against autoregressive decoding; returns the PTP steps.

    A divergence at a measured float near-tie (``ptp_mlx.ties``) is reported as a warning; any other fails."""
    want_tokens, want_steps = want or ar(pm, tok, ids, s, max_tokens, eos=eos)
    got_tokens, steps = run(pm, tok, ids, s, max_tokens, "ptp", eos=eos, **mode_kw)
    if got_tokens != want_tokens:
        eos_ids = sorted(eos if eos is not None else tok.eos_token_ids)
        _, tie, report = explain_divergence(pm, ids, s, want_tokens, got_tokens, eos_ids)
        assert tie is not None and tie.near_tie, report + "; " + divergence_report(pm, ids, s, want_tokens, got_tokens)
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


@pytest.mark.parametrize("step", ["fused", "simple"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_ptp_equals_ar(pm_sticky, varied, name, step):
    tok = varied[1]
    seeds = [0] if SETTINGS[name].greedy else [0, 1, 2]
    accepted = Counter()
    for p in PROMPTS[:3]:
        ids = encode_prompt(tok, p)
        for seed in seeds:
            steps = assert_same(pm_sticky, tok, ids, with_seed(SETTINGS[name], seed), 20, {"step": step})
            accepted.update(st.accepted for st in steps)
    # The drafts are sometimes right, so the accepted-prefix path (branch c > 0) is exercised too.
    assert accepted[0] > 0 and sum(v for k, v in accepted.items() if k > 0) > 0, accepted


@pytest.mark.parametrize("step", ["fused", "simple"])
@pytest.mark.parametrize("n_draft", [1, 2, 3])
def test_fixed_draft_budget(pm_sticky, varied, n_draft, step):
    """``--num-draft-tokens N``: exact, at most N drafts verified per call, never an autoregressive burst, and
    (fused) after the first call every call verifies min(N, tokens left - 1) drafts whatever was accepted."""
    tok = varied[1]
    accepted = Counter()
    for name in ("greedy", "T0.7-k20-p0.9", "T1.0"):
        for p in PROMPTS[:2]:
            kw = {"step": step, "num_draft_tokens": n_draft}
            steps = assert_same(pm_sticky, tok, encode_prompt(tok, p), with_seed(SETTINGS[name], 4), 20, kw)
            accepted.update(st.accepted for st in steps)
            assert all(st.proposed <= n_draft for st in steps)
            assert all(st.rows > 1 for st in steps[:-1])  # every call drafts or verifies: no plain steps
            if step == "fused":
                left = [20 - st.generated + len(st.tokens) for st in steps]
                assert all(st.proposed == min(n_draft, n - 1) for st, n in zip(steps[1:], left[1:], strict=True))
    assert accepted[0] > 0 and sum(v for k, v in accepted.items() if k > 0) > 0, accepted


@pytest.mark.parametrize("name", ["greedy", "T1.0-k50-p0.8"])
def test_random_linear_interpolation_adapter(pm_random, varied, name):
    tok = varied[1]
    for step in ("fused", "simple"):
        for seed, p in enumerate(PROMPTS):
            assert_same(pm_random, tok, encode_prompt(tok, p), with_seed(SETTINGS[name], seed), 16, {"step": step})


BUDGETS = {f"flat-w{w}": Budget(CostCurve.linear(0.0), max_width=w) for w in range(2, 9)}
BUDGETS["steep"] = Budget(CostCurve.linear(1.0), max_width=8)  # never worth a second row: AR-like calls
BUDGETS["mild"] = Budget(CostCurve.linear(0.05), max_width=6)
BUDGETS["histogram"] = Budget.from_histogram(CostCurve.linear(0.02), [5, 3, 2, 1, 1], max_width=5)
# Learns from the calls it sees (as the engine's budgets do): its choices change between answers, never the tokens.
BUDGETS["calibrated"] = Budget.from_histogram(CostCurve.linear(0.0), [1, 1, 1, 1, 1], max_width=6, calibrate=True)


def test_calibration_follows_observed_acceptance():
    curve = CostCurve([1, 2, 64], [1.0, 1.3, 30.0])  # a second row costs 30% more: drafting must earn it
    fixed = Budget.from_histogram(curve, [1, 1, 1, 1, 1], max_width=6)
    cal = Budget.from_histogram(curve, [1, 1, 1, 1, 1], max_width=6, calibrate=True)
    assert cal.ratio == 1.0 and cal.choose([0.9, 0.9], 64) == fixed.choose([0.9, 0.9], 64)
    assert fixed.choose([], 64)[1]  # the prior says a fresh branch pays
    for _ in range(50):  # confident drafts that always miss
        cal.observe([0.9, 0.9], 0)
        fixed.observe([0.9, 0.9], 0)
    assert fixed.ratio == 1.0 and fixed.hits == fixed.expected == 0.0  # only calibrating budgets learn
    assert cal.ratio == 0.25  # (8 + 0) / (8 + 45), bounded below
    assert fixed.choose([], 64)[1] and cal.choose([], 64) == (0, [])  # no branch pays: autoregressive bursts
    assert cal.choose([0.9, 0.9], 64)[1] == []  # drafts in hand are still verified (token rows), no new branch
    bursts = 0
    while not cal.choose([], 64)[1]:  # each autoregressive burst fades the evidence: drafting is tried again
        cal.relax()
        bursts += 1
    assert 3 <= bursts <= 12, bursts
    # Drafts after the first miss carry no information; hits count only leading accepted drafts.
    b = Budget(CostCurve(), calibrate=True)
    b.observe([0.5, 0.5, 0.5], 1)
    assert (b.hits, b.expected) == (1.0, 1.0)
    for _ in range(100):  # drafts better than their confidences: more drafting, bounded at 2x
        b.observe([0.4, 0.4], 2)
    assert b.ratio == 2.0 and b._s(1) <= 1.0


@pytest.mark.parametrize("bname", list(BUDGETS))
def test_budgets(pm_sticky, varied, bname):
    tok = varied[1]
    budget = BUDGETS[bname]
    ids = encode_prompt(tok, PROMPTS[1])
    rows = []
    for name in ("greedy", "T0.7-k20-p0.9"):
        steps = assert_same(pm_sticky, tok, ids, with_seed(SETTINGS[name], 3), 16, {"budget": budget})
        rows += [st.rows for st in steps]
    if bname == "steep":
        assert max(rows) == 1, rows  # the cost curve forces single-row passes
    else:
        assert max(rows) > 1
    # The simple step takes its draft width from the budget.
    assert_same(pm_sticky, tok, ids, with_seed(SETTINGS["T1.0"], 4), 12, {"step": "simple", "budget": budget})


@pytest.mark.parametrize("step", ["fused", "simple"])
@pytest.mark.parametrize("width", [2, 4, 8])
def test_oracle_accepts_full_width(varied, step, width):
    model, tok = varied
    pm = PTPModel(model)  # adapter-free: the oracle replaces the auxiliary rows
    budget = Budget(CostCurve(), max_width=width)
    for name, seed in (("greedy", 0), ("T1.0", 5), ("T0.7-k20-p0.9", 6)):
        s = with_seed(SETTINGS[name], seed)
        ids = encode_prompt(tok, PROMPTS[seed % 4])
        want = ar(pm, tok, ids, s, 30)
        steps = assert_same(pm, tok, ids, s, 30, {"step": step, "budget": budget, "oracle": want[0]}, want=want)
        for st in steps[:-1]:
            assert st.proposed == st.accepted == width - 1 and len(st.tokens) == width, st
        assert steps[-1].accepted == steps[-1].proposed
        assert len(steps) == -(-len(want[0]) // width)
        # An always-wrong oracle: every call accepts nothing, and the output is still the autoregressive one.
        wrong = [(t + 1) % model.args.vocab_size for t in want[0]]
        steps = assert_same(pm, tok, ids, s, 30, {"step": step, "budget": budget, "oracle": wrong}, want=want)
        assert all(st.accepted == 0 and len(st.tokens) == 1 for st in steps)
        assert [st.proposed for st in steps[:-width]] == [width - 1] * (len(steps) - width)


def first_new(tokens: list[int], start: int, avoid) -> int:
    """Smallest k >= start whose token does not occur earlier and whose position is not in ``avoid``."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k] and k % WINDOW not in avoid)


@pytest.mark.parametrize("name", ["greedy", "T1.0"])
def test_eos_inside_a_block(varied, pm_sticky, name):
    model, tok = varied
    s = with_seed(SETTINGS[name], 7)
    ids = encode_prompt(tok, PROMPTS[0])
    full = ar(pm_sticky, tok, ids, s, 40)[0]
    # With the oracle every block is WINDOW tokens, so an EOS at k with k % WINDOW != 0 lands inside a block.
    for k in (first_new(full, 1, {0}), first_new(full, WINDOW + 2, {0, 1})):
        eos = {full[k]}
        want = ar(pm_sticky, tok, ids, s, 40, eos=eos)
        assert want[0] == full[:k] and want[1][-1].finish_reason == "stop"
        budget = Budget(CostCurve(), max_width=WINDOW)
        for step in ("fused", "simple"):
            steps = assert_same(
                PTPModel(model), tok, ids, s, 40, {"step": step, "budget": budget, "oracle": full}, eos=eos, want=want
            )
            assert steps[-1].accepted > len(steps[-1].tokens) - 1  # the accepted block was cut at the EOS
            assert_same(pm_sticky, tok, ids, s, 40, {"step": step}, eos=eos, want=want)
    # EOS as the very first token: nothing is emitted.
    eos = {full[0]}
    for mode_kw in ({"step": "fused"}, {"step": "simple"}, {"oracle": full}):
        steps = assert_same(pm_sticky, tok, ids, s, 40, mode_kw, eos=eos)
        assert steps[-1].finish_reason == "stop" and not [t for st in steps for t in st.tokens]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 9])
def test_max_tokens_inside_a_block(varied, pm_sticky, max_tokens):
    model, tok = varied
    s = with_seed(SETTINGS["T1.0"], 8)
    ids = encode_prompt(tok, PROMPTS[2])
    full = ar(pm_sticky, tok, ids, s, 20)[0]
    for mode_kw in ({"step": "fused"}, {"step": "simple"}, {"oracle": full, "budget": Budget(CostCurve(), 4)}):
        steps = assert_same(pm_sticky, tok, ids, s, max_tokens, mode_kw)
        assert steps[-1].generated == max_tokens and steps[-1].finish_reason == "length"
        assert [t for st in steps for t in st.tokens] == full[:max_tokens]


def long_prompt(n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(n).integers(3, 259, n)]


@pytest.mark.parametrize("n", [505, 511])
def test_prompt_near_context_limit(varied, pm_sticky, n):
    model, tok = varied
    ctx = model.args.max_position_embeddings
    assert ctx == 512
    ids = long_prompt(n)
    for name in ("greedy", "T1.0"):
        s = with_seed(SETTINGS[name], 9)
        want = ar(pm_sticky, tok, ids, s, 50)
        assert len(want[0]) == ctx - n and want[1][-1].finish_reason == "length"
        for mode_kw in (
            {"step": "fused", "budget": BUDGETS["flat-w8"]},
            {"step": "simple"},
            {"oracle": want[0], "budget": BUDGETS["flat-w8"]},
        ):
            assert_same(pm_sticky, tok, ids, s, 50, mode_kw, want=want)


def test_prompt_longer_than_context(varied, pm_sticky):
    _, tok = varied
    for n in (512, 600):
        for mode in ("ar", "ptp"):
            with pytest.raises(ContextFull, match=f"prompt is {n} tokens"):
                next(stream_generate(pm_sticky, tok, long_prompt(n), DecodeOptions(mode=mode, max_tokens=4)))


def test_ptp_needs_an_adapter_or_oracle(varied):
    model, tok = varied
    ids = encode_prompt(tok, PROMPTS[0])
    with pytest.raises(ValueError, match="adapter"):
        next(stream_generate(PTPModel(model), tok, ids, DecodeOptions(mode="ptp", max_tokens=4)))
    with pytest.raises(ValueError, match="empty prompt"):
        next(stream_generate(PTPModel(model), tok, [], DecodeOptions(max_tokens=4)))


@pytest.mark.parametrize("mode", ["ar", "ptp"])
def test_prompt_cache_carries_a_conversation(pm_sticky, varied, mode):
    """A conversation continued from its cache: each turn prefills only its new tokens and answers exactly as a
    fresh cache would, greedy and sampled; a prompt that shares less (a new chat) trims the cache back."""
    from ptp_mlx.prompt_cache import PromptCache

    tok = varied[1]
    for s in (SETTINGS["greedy"], with_seed(SETTINGS["T0.7-k20-p0.9"], 6)):
        pc = PromptCache()
        messages, prev = [], []
        for turn, text in enumerate(["hello there", "and then?", "12345"]):
            messages.append({"role": "user", "content": text})
            ids = encode_prompt(tok, messages)
            opts = DecodeOptions(mode=mode, max_tokens=12, sampling=s)
            got = list(stream_generate(pm_sticky, tok, ids, opts, prompt_cache=pc))
            want = list(stream_generate(pm_sticky, tok, ids, opts))
            assert [t for st in got for t in st.tokens] == [t for st in want for t in st.tokens]
            answer = "".join(st.text for st in got)
            if turn:  # at least the whole previous prompt came from the cache
                assert len(prev) - 1 <= pc.reused < len(ids), (pc.reused, len(prev), len(ids))
            prev = ids
            ans = [t for st in got for t in st.tokens]
            held = pc.tokens[len(ids) :]  # the answer as far as the cache holds it (the end token included)
            assert pc.cache is not None and pc.tokens[: len(ids)] == ids
            assert held[: len(ans)] == ans[: len(held)] and len(held) <= len(ans) + 1
            messages.append({"role": "assistant", "content": answer})
        fresh = encode_prompt(tok, [{"role": "user", "content": "zz"}])
        opts = DecodeOptions(mode=mode, max_tokens=8, sampling=s)
        got = [t for st in stream_generate(pm_sticky, tok, fresh, opts, prompt_cache=pc) for t in st.tokens]
        assert got == [t for st in stream_generate(pm_sticky, tok, fresh, opts) for t in st.tokens]
        assert pc.reused < len(fresh)


def test_ptp_samples_follow_the_model_at_temperature_one(pm_sticky, varied):
    """The promise behind token-for-token identity: at T 1.0 on the full vocabulary, PTP's tokens at positions 0
    and 1 (position 1 comes from a verify row of a multi-row pass) follow the model's exact marginals
    (chi-squared, alpha 1e-4, as vLLM tests its samplers)."""
    from scipy.stats import chisquare

    from ptp_mlx.prompt_cache import PromptCache

    model, tok = varied
    ids = encode_prompt(tok, PROMPTS[3])
    s = SamplingSettings(1.0)
    # Exact marginals in float64: P(t0) and P(t1) = sum over t0 of P(t0) P(t1 | t0).
    p0 = np.array(mx.softmax(model(mx.array(ids)[None])[0, -1].astype(mx.float32)), dtype=np.float64)
    V = p0.size
    batch = mx.concatenate([mx.broadcast_to(mx.array(ids), (V, len(ids))), mx.arange(V)[:, None]], axis=1)
    cond = np.array(mx.softmax(model(batch)[:, -1].astype(mx.float32), axis=-1), dtype=np.float64)
    p0, p1 = p0 / p0.sum(), (p0 / p0.sum()) @ (cond / cond.sum(-1, keepdims=True))
    n = 3000
    counts = np.zeros((2, V))
    cache, multi_row = PromptCache(), 0
    for seed in range(n):
        opts = DecodeOptions(mode="ptp", max_tokens=2, sampling=with_seed(s, seed), budget=BUDGETS["flat-w4"])
        steps = list(stream_generate(pm_sticky, tok, ids, opts, eos_ids=set(), prompt_cache=cache))
        toks = [t for st in steps for t in st.tokens]
        counts[0, toks[0]] += 1
        counts[1, toks[1]] += 1
        multi_row += len(steps) > 1 and steps[1].rows > 1
    assert multi_row > n // 2  # position 1 mostly came out of a multi-row verify pass
    for pos, p in ((0, p0), (1, p1)):
        expected = p * n
        big = expected >= 5  # pool the rare tokens into one bin, as chi-squared needs
        obs = np.append(counts[pos][big], counts[pos][~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        assert counts[pos][p == 0].sum() == 0
        assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-4, pos
    # Power: the same test rejects a wrong law (position 1's tokens against position 0's marginal).
    big = p0 * n >= 5
    obs = np.append(counts[1][big], counts[1][~big].sum())
    exp = np.append(p0[big] * n, p0[~big].sum() * n)
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue < 1e-4


def test_lookup_candidates_follow_the_latest_match():
    from ptp_mlx.drafting.lookup import LookupDrafter

    d = LookupDrafter(ChainDrafter(Budget(CostCurve(), 4)), [5, 6, 7, 8, 9, 1, 2, 6, 7], max_draft=3)
    assert d.candidates() == [8, 9, 1]  # "6 7" occurred before, followed by 8 9 1
    d.emitted([8, 9, 4, 4])
    assert d.candidates() == []  # "9 4 4" / "4 4" never occurred before
    d.emitted([6, 7, 8, 9])
    assert d.candidates() == [4, 4, 6]  # the longest match wins: "6 7 8 9" was followed by 4 4 6
    d.emitted([4, 4])  # "8 9 4 4" is followed by 6 7 8 (and the match right behind, "9 4 4 ...", is too recent)
    assert d.candidates() == [6, 7, 8]


@pytest.mark.parametrize("name", ["greedy", "T0.7-k20-p0.9", "T1.0"])
def test_lookup_strands_are_exact(pm_sticky, varied, name):
    """Lookup drafts that are right (the answer itself planted in the history), wrong (another answer) or cut by
    EOS and the token limit inside a strand: the output is the autoregressive one, and right ones are accepted."""
    from ptp_mlx.drafting.lookup import LookupDrafter

    tok = varied[1]
    s = with_seed(SETTINGS[name], 7)
    ids = encode_prompt(tok, PROMPTS[0])
    want, _ = ar(pm_sticky, tok, ids, s, 30, eos=set())
    wrong, _ = ar(pm_sticky, tok, encode_prompt(tok, PROMPTS[1]), s, 30, eos=set())
    sources = Counter()
    for planted, max_tokens, eos in ((want, 30, set()), (wrong, 30, set()), (want, 13, set()), (want, 30, {want[9]})):
        history = ids[-4:] + planted + [0] + ids  # the prompt's last 4 tokens, then the planted continuation
        # A confident prior: the (uncalibrated, over-confident) sticky adapter would win most calls otherwise.
        inner = ChainDrafter(Budget(CostCurve(), WINDOW))
        drafter = LookupDrafter(inner, history, max_draft=WINDOW - 1, prior=(1000.0, 1.0))
        exp = ar(pm_sticky, tok, ids, s, max_tokens, eos=eos)
        steps = assert_same(pm_sticky, tok, ids, s, max_tokens, {"drafter": drafter}, eos=eos, want=exp)
        for st in steps:
            sources[st.source] += st.accepted
    assert sources["lookup"] > 20, sources


@pytest.mark.parametrize("name", ["greedy", "T0.7-k20-p0.9", "T1.0"])
def test_random_token_trees_are_exact(varied, pm_sticky, pm_random, name):
    """Random tree shapes (chains, alternatives to the first draft with and without their own branches, chain
    branches), token for token against autoregressive decoding; alternatives land and the cache is compacted."""
    _, tok = varied
    hits = 0
    for k, prompt in enumerate(PROMPTS[:3]):
        s = with_seed(SETTINGS[name], 11 + k)
        ids = encode_prompt(tok, prompt)
        for pm in (pm_sticky, pm_random):
            want = ar(pm, tok, ids, s, 24)
            for seed in range(3):
                drafter = TreeDrafter(want[0], width=WINDOW, seed=seed)
                steps = assert_same(pm, tok, ids, s, 24, {"drafter": drafter}, want=want)
                assert sum(st.source == "alt" for st in steps) == drafter.alt_hits
                hits += drafter.alt_hits
    assert hits >= 5  # alternatives really landed (and the K/V compaction after them was exercised)


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_trees_with_eos_and_max_tokens_inside_a_strand(varied, pm_sticky, max_tokens):
    _, tok = varied
    s = with_seed(SETTINGS["T1.0"], 5)
    ids = encode_prompt(tok, PROMPTS[1])
    full = ar(pm_sticky, tok, ids, s, 20)[0]
    for seed in range(4):  # max tokens inside a strand (an alternative's block is 2 tokens)
        steps = assert_same(pm_sticky, tok, ids, s, max_tokens, {"drafter": TreeDrafter(full, WINDOW, seed, 0.3)})
        assert steps[-1].finish_reason == "length" and [t for st in steps for t in st.tokens] == full[:max_tokens]
    k = first_new(full, 1, set())  # an EOS that an alternative's second token or a chain can reach
    eos = {full[k]}
    want = ar(pm_sticky, tok, ids, s, 20, eos=eos)
    for seed in range(4):
        steps = assert_same(
            pm_sticky, tok, ids, s, 20, {"drafter": TreeDrafter(full, WINDOW, seed, 0.3)}, eos=eos, want=want
        )
        assert steps[-1].finish_reason == "stop"


def test_the_budget_verifies_the_runner_up_when_rows_are_cheap(varied, pm_sticky):
    """With free rows the adaptive budget adds the adapter's runner-up for the first draft as a sibling strand;
    output is still exactly autoregressive, and the next drafts come from the branch of the strand that stood."""
    _, tok = varied
    for name in ("greedy", "T1.0"):
        s = with_seed(SETTINGS[name], 3)
        ids = encode_prompt(tok, PROMPTS[0])
        budget = Budget(CostCurve([1, 64], [1.0, 1.0]), max_width=WINDOW)
        steps = assert_same(pm_sticky, tok, ids, s, 32, {"budget": budget})
        assert sum(st.rows > 1 + st.proposed for st in steps)  # branches ran
        assert any(st.proposed > 0 for st in steps)


def test_bursts_back_off_while_probes_fail_and_reset_when_a_draft_lands():
    from ptp_mlx.drafting.budget import AR_BURST, MAX_BURST

    b = Budget(CostCurve(), max_width=4, calibrate=True)
    lens = []
    for _ in range(5):
        b.relax()  # a burst ran
        lens.append(b.burst_len)
        b.observe([0.9], 0)  # the probe after it: its draft fell
    assert lens == [AR_BURST, 2 * AR_BURST, 4 * AR_BURST, MAX_BURST, MAX_BURST]
    b.observe([0.9, 0.9], 1)
    assert b.burst_len == AR_BURST
    b.relax()
    assert b.burst_len == AR_BURST  # drafts landed since the last burst: no back-off
    fixed = Budget(CostCurve(), max_width=4)
    for _ in range(3):
        fixed.relax()
    assert fixed.burst_len == AR_BURST  # budgets that do not calibrate keep the fixed burst


def test_drafts_after_an_alternative_come_from_its_branch():
    from ptp_mlx.drafting.tree import TreeDrafter

    d = TreeDrafter(Budget(CostCurve(), max_width=4))
    plan = Plan([7, 8], [(0, 2), (2, 3)], alts=[(9, 0), (5, 3)])
    aux = [10, 11, 20, 21, 22, 50, 51, 52]  # branch 0 | branch 2 | alternative 1's branch (alternative 0 has none)
    second = [(t + 100, 0.1) for t in aux]
    d.update(plan, CallResult([], 1, aux, [0.5] * 8, second, alt=1))
    assert d.drafts == [51, 52] and d.second == (151, 0.1)
    d.update(plan, CallResult([], 0, aux, [0.5] * 8, second, alt=None))
    assert d.drafts == [11] and d.second == (111, 0.1)
    d.update(plan, CallResult([], 2, aux, [0.5] * 8, second))
    assert d.drafts == [21, 22]
    d.update(plan, CallResult([], 1, aux, [0.5] * 8, second, alt=0))
    assert d.drafts == [] and d.second is None  # an alternative without a branch leaves no drafts


class _AlwaysBurst(ChainDrafter):
    """An inner drafter whose budget never drafts: every plan is a 16-token autoregressive burst."""

    def __init__(self, width):
        super().__init__(Budget(CostCurve(), max_width=width))

    def plan(self, i, remaining, room):
        return Plan([], [], burst=min(16, remaining))

    def update(self, plan, result):
        pass


@pytest.mark.parametrize("name", ["greedy", "T1.0"])
def test_a_ready_lookup_chain_ends_a_burst_early_and_stays_exact(varied, pm_sticky, name):
    from ptp_mlx.drafting.lookup import LookupDrafter

    _, tok = varied
    s = with_seed(SETTINGS[name], 4)
    interrupted = 0
    for prompt in PROMPTS:
        ids = encode_prompt(tok, prompt * 6)  # a repetitive prompt: lookup chains appear inside bursts
        want = ar(pm_sticky, tok, ids, s, 48)
        drafter = LookupDrafter(_AlwaysBurst(WINDOW), ids, max_draft=WINDOW - 1, prior=(9.0, 1.0))
        steps = assert_same(pm_sticky, tok, ids, s, 48, {"drafter": drafter}, want=want)
        interrupted += sum(st.source == "lookup" for st in steps)  # only reachable by ending a burst early
    assert interrupted > 0


def test_drafting_that_delivers_less_than_plain_steps_gives_way_to_a_burst():
    from ptp_mlx.drafting.budget import Pace

    budget = Budget(CostCurve([1, 64], [1.0, 64.0]), max_width=4, calibrate=True, survival=[1.0, 0.99, 0.98, 0.97])
    d = ChainDrafter(budget)
    d.drafts, d.conf = [5, 6], [0.99, 0.99]
    assert not d.plan(0, 100, 100).burst  # the prediction says drafting pays
    plan = Plan([5, 6], [(0, 2), (1, 2), (2, 2)])
    for _ in range(3):  # three calls of 9 rows (cost 9 plain steps each) that delivered 1 token each
        d.update(plan, CallResult([], 0, [1] * 6, [0.99] * 6))
        d.drafts, d.conf = [5, 6], [0.99, 0.99]
    assert d.plan(3, 100, 100).burst  # what was delivered overrules the prediction
    assert d.pace == Pace()  # and the next episode starts afresh


class _RepeatDrafter(Drafter):
    """A new drafter is one class against one protocol: it drafts the latest token repeated (right in runs of a
    repeated token), learns the history from ``begin`` and ``emitted``, and runs one auxiliary branch per call
    for the mere exercise of the rows (its drafts ignore them)."""

    def __init__(self, n: int = 2):
        self.n, self.history, self.calls, self.hits = n, [], 0, 0

    def begin(self, session):
        self.history = list(session.prompt)

    def plan(self, i, remaining, room):
        n = max(0, min(self.n, remaining - 1, room - 3))
        return Plan([self.history[-1]] * n, [(0, 2)] if room >= n + 3 else [], source="repeat")

    def update(self, plan, result):
        self.calls += 1
        self.hits += result.accepted

    def emitted(self, tokens):
        self.history.extend(tokens)


@pytest.mark.parametrize("name", ["greedy", "T1.0-k50-p0.8"])
def test_a_drafter_defined_here_decodes_exactly(varied, pm_sticky, name):
    _, tok = varied
    for k, prompt in enumerate(PROMPTS):
        s = with_seed(SETTINGS[name], 20 + k)
        ids = encode_prompt(tok, prompt)
        drafter = _RepeatDrafter()
        steps = assert_same(pm_sticky, tok, ids, s, 20, {"drafter": drafter})
        out = [t for st in steps for t in st.tokens]
        # every call reported back; the history saw every block (a block may run past the output's end: EOS)
        assert drafter.calls == len(steps) and drafter.history[len(ids) : len(ids) + len(out)] == out
