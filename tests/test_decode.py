"""Decoding exactness, the central test (issue 3): PTP output equals autoregressive output token for token for
the same seed, for greedy and sampled settings, both step kinds, many budgets, EOS and the token limit inside a
block, and prompts at the context limit. An oracle drafter (the teacher's own continuation) proves that the
verify/trim bookkeeping wastes nothing: every call accepts the full width.

The tiny model of the shared fixture always emits one token, so these tests re-randomise a copy of it with
larger weights (varied, moderately peaked next-token distributions). Where an output differs, the failure
names the first divergent position, its top-2 logit gap and how close ``u`` was to a bin edge, so a numerical
near-tie (docs/method.md, section 11) is told apart from a logic error.
"""

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.policy import DraftingConfig
from ptp_mlx.generate import ContextFull, DecodeOptions, stream_generate
from ptp_mlx.model.kv import KVState
from ptp_mlx.model.ptp import PTPModel
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import SamplingSettings
from ptp_mlx.testing import (
    ChainingTreeDrafter,
    RandomTreeDrafter,
    StrandChainingTreeDrafter,
    StrandKindTreeDrafter,
)
from ptp_mlx.testing.decoding import BUDGETS, PROMPTS, SETTINGS, WINDOW, ar, assert_same, with_seed


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
            # the oracle's block ends at the EOS: drafts that stood past it do not count (each call decided its
            # accepted drafts and one token more, every one emitted or the EOS)
            assert steps[-1].accepted == len(steps[-1].tokens) <= steps[-1].proposed
            assert sum(st.accepted + 1 for st in steps) == k + 1
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
        assert sum(st.accepted + 1 for st in steps) == max_tokens  # (drafts that stood past the limit do not count)


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
        opts = DecodeOptions(
            mode="ptp", max_tokens=2, sampling=with_seed(s, seed), drafting=DraftingConfig(budget=BUDGETS["flat-w4"])
        )
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


@pytest.mark.parametrize("name", ["greedy", "T0.7-k20-p0.9", "T1.0"])
def test_random_token_trees_are_exact(varied, pm_sticky, pm_random, name):
    """Random tree shapes (chains, side strands of one to three tokens at every row of the chain and strands of
    those at their tokens, with and without their own branches, chain branches), token for token against
    autoregressive decoding; strands land, strands of strands too, and the cache is compacted."""
    _, tok = varied
    hits = deep = nested = 0
    for k, prompt in enumerate(PROMPTS[:3]):
        s = with_seed(SETTINGS[name], 11 + k)
        ids = encode_prompt(tok, prompt)
        for pm in (pm_sticky, pm_random):
            want = ar(pm, tok, ids, s, 24)
            for seed in range(3):
                drafter = RandomTreeDrafter(want[0], width=WINDOW, seed=seed)
                steps = assert_same(pm, tok, ids, s, 24, {"drafter": drafter}, want=want)
                assert sum(str(st.source).endswith("-strand") for st in steps) == drafter.alt_hits
                hits += drafter.alt_hits
                deep += drafter.deep_hits
                nested += drafter.nested_hits
    # strands really landed, strands of strands too (and the K/V compaction after them was exercised)
    assert hits >= 5 and deep >= 3 and nested >= 2, (hits, deep, nested)


@pytest.mark.parametrize("name", ["greedy", "T1.0"])
def test_calls_chained_on_token_trees_are_exact(varied, pm_sticky, name, monkeypatch):
    """A call built ahead on a tree call's chain outcomes runs when the chain decides, and is dropped, before the
    strand's K/V rows move, when a strand stands; token for token against autoregressive decoding."""
    from ptp_mlx.decode import pipeline

    dropped = []
    drop = pipeline.drop_chained
    monkeypatch.setattr(
        pipeline,
        "drop_chained",
        lambda ch, cache, keep=None, **kw: (dropped.append(keep is None), drop(ch, cache, keep, **kw)),
    )
    _, tok = varied
    hits = 0
    for k, prompt in enumerate(PROMPTS[:3]):
        s = with_seed(SETTINGS[name], 21 + k)
        ids = encode_prompt(tok, prompt)
        want = ar(pm_sticky, tok, ids, s, 32)
        for seed in range(3):
            drafter = ChainingTreeDrafter(want[0], width=WINDOW, seed=seed, p_right=0.6)
            assert_same(pm_sticky, tok, ids, s, 32, {"drafter": drafter}, want=want)
            hits += drafter.alt_hits
    assert hits >= 3 and sum(dropped) >= 1, (hits, sum(dropped))  # strands stood after calls chained on trees


@pytest.mark.parametrize("compiled, spare", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("name", ["greedy", "T1.0"])
def test_calls_chained_on_a_path_through_a_strand_move_its_rows_and_are_exact(varied, pm_sticky, name, compiled, spare,
                                                                               monkeypatch):  # fmt: skip
    """A call built ahead on a tree call serves the paths through its strands too, strands of strands included
    (``decode/strand_paths.py``): where the read finds the path took strands and the plan is the one guessed for
    that path, the built call runs and moves the strands' K/V rows in its own graph (the host copies none); where it
    is dropped, the host moves them. The paths are guessed only where the host has time to spare beside the compute
    (``pipeline.spare``: several milliseconds a wide tree). Token for token against autoregressive decoding,
    compiled and eager."""
    from ptp_mlx.decode import pipeline

    seen = Counter()
    confirm, copy = pipeline.confirm_chained, KVState.copy_rows

    def counted(chained, result, plan, i, cache, *more):
        call = confirm(chained, result, plan, i, cache, *more)
        if result.strand is not None and plan is not None and not result.resolved:
            seen["ran" if call is not None else "dropped"] += 1
            nested = plan_read[0].strands[result.strand].parent >= 0
            seen["nested ran"] += call is not None and nested
            seen["nested"] += nested
        return call

    def copied(state, src, dst, n=1):
        seen["host copies"] += 1
        return copy(state, src, dst, n)

    def verdict(queue, dropped):
        pending, before = len(queue._moves), seen["host copies"]
        moved(queue, dropped)
        if pending:  # (a path through a strand whose rows had to move: the built call moves them, or the host)
            assert seen["host copies"] - before == (pending if dropped else 0)
            seen["moved by the host" if dropped else "moved in the graph"] += 1

    moved = pipeline.CallQueue._moved
    plan_read = [None]  # the plan of the call just read (its strands)
    finish = pipeline.finish_call

    def read(cache, call, *a, **k):
        plan_read[0] = call.plan
        return finish(cache, call, *a, **k)

    monkeypatch.setattr(pipeline, "finish_call", read)
    monkeypatch.setattr(pipeline, "confirm_chained", counted)
    monkeypatch.setattr(KVState, "copy_rows", copied)
    monkeypatch.setattr(pipeline.CallQueue, "_moved", verdict)
    monkeypatch.setattr(pipeline, "spare", lambda left, build: spare)  # (a GPU: time to spare beside the compute)
    monkeypatch.setenv("PTP_MLX_EAGER", "" if compiled else "1")  # (the eager reference: the same function)
    _, tok = varied
    for k, prompt in enumerate(PROMPTS[:3]):
        s = with_seed(SETTINGS[name], 31 + k)
        ids = encode_prompt(tok, prompt)
        want = ar(pm_sticky, tok, ids, s, 32)
        for seed in range(8):
            drafter = StrandChainingTreeDrafter(want[0], width=WINDOW, seed=seed, p_right=0.6)
            assert_same(pm_sticky, tok, ids, s, 32, {"drafter": drafter}, want=want)
    if not spare:  # (no time to spare, as on this CPU: the paths are not guessed, a strand drops the build)
        assert seen["ran"] == seen["moved in the graph"] == 0 and seen["host copies"] > 0, seen
        return
    assert seen["ran"] >= 3 and seen["dropped"] >= 1, seen  # (dropped: the plan after the read was another)
    assert seen["nested ran"] >= 1, seen  # (a path through a strand of a strand: two strands' rows moved)
    assert seen["moved in the graph"] >= 1 and seen["moved by the host"] >= 1, seen


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("name", ["greedy", "T1.0"])
def test_paths_through_strands_of_another_kind_get_a_build_of_their_own(varied, pm_sticky, pm_random, name, compiled,
                                                                         monkeypatch):  # fmt: skip
    """Where time is spare (a GPU), the paths through a tree's strands whose next calls differ in shape from every
    other build's get one more build (``ahead._strand_kind``); it runs where the read finds such a path and the plan
    is its guess, its graph moving the strands' rows (the cache takes the state after it). Exact, compiled and
    eager."""
    from ptp_mlx.decode import pipeline

    seen = Counter()
    confirm = pipeline.confirm_chained

    def counted(chained, result, plan, i, cache, *more):
        hit = chained.pick(chained.outcome(result))
        call = confirm(chained, result, plan, i, cache, *more)
        if result.strand is not None and call is not None:
            seen["own" if hit.state is None else "its own build"] += 1
        return call

    monkeypatch.setattr(pipeline, "confirm_chained", counted)
    monkeypatch.setattr(pipeline, "spare", lambda left, build: True)  # (as on a GPU: time for more builds)
    monkeypatch.setenv("PTP_MLX_EAGER", "" if compiled else "1")
    _, tok = varied
    for pm in (pm_sticky, pm_random):
        for k, prompt in enumerate(PROMPTS[:3]):
            s = with_seed(SETTINGS[name], 31 + k)
            ids = encode_prompt(tok, prompt)
            want = ar(pm, tok, ids, s, 32)
            for seed in range(4):
                drafter = StrandKindTreeDrafter(want[0], width=WINDOW, seed=seed, p_right=0.6)
                assert_same(pm, tok, ids, s, 32, {"drafter": drafter}, want=want)
    assert seen["its own build"] >= 3, seen


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_trees_with_eos_and_max_tokens_inside_a_strand(varied, pm_sticky, max_tokens):
    _, tok = varied
    s = with_seed(SETTINGS["T1.0"], 5)
    ids = encode_prompt(tok, PROMPTS[1])
    full = ar(pm_sticky, tok, ids, s, 20)[0]
    for seed in range(4):  # max tokens inside a strand (an alternative's block is 2 tokens)
        steps = assert_same(pm_sticky, tok, ids, s, max_tokens, {"drafter": RandomTreeDrafter(full, WINDOW, seed, 0.3)})
        assert steps[-1].finish_reason == "length" and [t for st in steps for t in st.tokens] == full[:max_tokens]
    k = first_new(full, 1, set())  # an EOS that an alternative's second token or a chain can reach
    eos = {full[k]}
    want = ar(pm_sticky, tok, ids, s, 20, eos=eos)
    for seed in range(4):
        steps = assert_same(
            pm_sticky, tok, ids, s, 20, {"drafter": RandomTreeDrafter(full, WINDOW, seed, 0.3)}, eos=eos, want=want
        )
        assert steps[-1].finish_reason == "stop"
