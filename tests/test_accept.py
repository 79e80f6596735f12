"""Acceptance rules (ptp_mlx/decode/accept.py, issue 30): exact stays the default; a lenient rule at its strictest
setting is exact decoding token for token; a lenient answer's every token is either the exact sample given the
tokens before it or a draft its verifying row found likely enough (replayed with one-row plain steps); a lenient
answer is labelled; bad rules are refused with one line and exit code 2."""

import mlx.core as mx
import numpy as np
import pytest

from ptp_mlx.decode.accept import EXACT, AcceptRule
from ptp_mlx.decode.session import ContextTokens, number_tokens
from ptp_mlx.engine import Engine
from ptp_mlx.generate import decoding_settings
from ptp_mlx.generate_cli import main as generate_main
from ptp_mlx.sampler import SamplingSettings, UniformStream, pick
from ptp_mlx.testing import make_tiny_model, save_random_adapter

SAMPLINGS = {"greedy": SamplingSettings(0.0), "sampled": SamplingSettings(0.9, 40, 0.95, seed=3)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("accept")
    model = make_tiny_model(d / "model", varied=True, seed=3)
    return model, save_random_adapter(model, d / "adapter")


@pytest.fixture(scope="module")
def engine(dirs):
    return Engine.load(str(dirs[0]), str(dirs[1]), measure_cost=False)


def tokens_of(steps) -> list[int]:
    return [t for st in steps for t in st.tokens]


def test_rules_parse_and_refuse():
    assert AcceptRule.parse("exact") == EXACT and not EXACT.lenient and EXACT.label == "exact"
    r = AcceptRule.parse("entropy:eps=0.2,delta=0.05")
    assert r.lenient and (r.eps, r.delta) == (0.2, 0.05) and r.label.startswith("lenient entropy")
    assert AcceptRule.parse("threshold:0.25").tau == 0.25 == AcceptRule.parse("threshold:tau=0.25").tau
    assert AcceptRule.parse("threshold").tau == 0.3
    for bad, msg in [("nope", "unknown acceptance rule"), ("exact:1", "no parameters"), ("threshold:x=1", "no par"),
                     ("entropy:eps=abc", "must be a number"), ("threshold:tau=-1", ">= 0"),
                     ("threshold:tau=inf", "finite"), ("entropy:eps=0.1,eps=0.2", "given twice"),
                     ("threshold:0.2,tau=0.3", "given twice")]:  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            AcceptRule.parse(bad)


def test_floor_keeps_uncertain_rows_from_accepting_anything():
    """In a near-uniform row the entropy rule's bar falls to about delta / vocab: any draft stands. A floor keeps a
    least probability; where the bar is above the floor (a peaked row) the floor changes nothing."""
    flat = mx.zeros((1, 1000))  # p = 0.001 for every token, H = log(1000)
    peaked = mx.array([[8.0, 6.0] + [0.0] * 998])
    draft = mx.array([5])
    loose, floored = AcceptRule.parse("entropy"), AcceptRule.parse("entropy:floor=0.05")
    assert floored.label == "lenient entropy eps=0.3 delta=0.09 floor=0.05" and loose.floor == 0.0
    assert loose.accepts(flat, draft, 1.0).item() and not floored.accepts(flat, draft, 1.0).item()
    second = mx.array([1])  # the runner-up of a peaked row: p about 0.09, above both bars (0.008, 0.05)
    assert loose.accepts(peaked, second, 1.0).item() and floored.accepts(peaked, second, 1.0).item()
    assert not floored.accepts(peaked, draft, 1.0).item() and not loose.accepts(peaked, draft, 1.0).item()


@pytest.mark.parametrize("sname", list(SAMPLINGS))
@pytest.mark.parametrize("strictest", ["threshold:tau=1.01", "entropy:eps=1.01,delta=1e9"])
def test_strictest_setting_is_exact_decoding(engine, sname, strictest):
    s = SAMPLINGS[sname]
    ids = engine.encode("hello there")
    ar = tokens_of(engine.generate(ids, mode="ar", sampling=s, max_tokens=48))
    for n in (None, 3):
        steps = list(engine.generate(ids, sampling=s, max_tokens=48, num_draft_tokens=n, accept=strictest))
        assert tokens_of(steps) == ar
        assert {st.accept for st in steps} == {AcceptRule.parse(strictest).label}


@pytest.mark.parametrize("sname", list(SAMPLINGS))
def test_lenient_tokens_are_exact_or_likely_given_their_prefix(engine, sname):
    """Replay: each token of a lenient answer is pick(u, P(. | the tokens before it)) or a draft with
    p >= tau under its row (softmax at T, T 1 when greedy)."""
    s, tau = SAMPLINGS[sname], 0.002  # the tiny random model is near uniform over its 259 tokens
    ids = engine.encode("hello there")
    exact = list(engine.generate(ids, sampling=s, max_tokens=40, num_draft_tokens=3))
    steps = list(engine.generate(ids, sampling=s, max_tokens=40, num_draft_tokens=3, accept=f"threshold:tau={tau}"))
    answer = tokens_of(steps)
    assert sum(st.accepted for st in steps) > sum(st.accepted for st in exact)  # it does accept more drafts
    pm, ds = engine.pm, decoding_settings(engine.pm, s)
    u, cache = UniformStream(ds.seed), pm.make_cache()
    pm.base(mx.array(ids[:-1])[None], cache=cache)
    prev, lenient = ids[-1], 0
    for g, tok in enumerate(answer):
        logits = pm.base(mx.array([[prev]]), cache=cache)[0, -1]
        want = int(pick(mx.array(u[g]), logits, ds.temperature, ds.top_k, ds.top_p, order=ds.order).item())
        if tok != want:
            x = np.array(logits.astype(mx.float32), dtype=np.float64) / (ds.temperature or 1.0)
            p = np.exp(x[tok] - x.max()) / np.exp(x - x.max()).sum()
            assert p >= tau * (1 - 1e-4), (g, tok, want, p)
            lenient += 1
        prev = tok
    assert lenient > 0  # the rule changed the answer somewhere: the replay checked real lenient tokens


def test_lookup_exact_verifies_lookup_chains_by_the_exact_rule(engine):
    """``lookup=0``: a call whose drafts are a lookup chain is verified by the exact rule (its answer is exact where
    only lookup drafts were offered), while the adapter's own drafts stay lenient."""
    import dataclasses

    from ptp_mlx.generate import DecodeOptions, stream_generate
    from ptp_mlx.testing import OracleDrafter

    r = AcceptRule.parse("threshold:tau=0,lookup=0")
    assert r.label == "lenient threshold tau=0 lookup=exact" and r.for_source("lookup") == EXACT
    assert r.for_source("ptp") is r and AcceptRule.parse("threshold:tau=0").for_source("lookup").lenient
    with pytest.raises(ValueError, match="lookup must be 0 or 1"):
        AcceptRule.parse("entropy:lookup=0.5")
    ids = engine.encode("hello there")
    ar = tokens_of(engine.generate(ids, mode="ar", max_tokens=24))
    wrong = [(t + 1) % 200 + 3 for t in ar]  # every draft wrong: tau=0 would accept them all

    class WrongLookup(OracleDrafter):  # the same wrong drafts, offered as lookup chains
        def plan(self, i, remaining, room):
            return dataclasses.replace(super().plan(i, remaining, room), source="lookup")

    for kind, exact in ((WrongLookup, True), (OracleDrafter, False)):
        opts = DecodeOptions(mode="ptp", max_tokens=24, drafter=kind(wrong, 4), accept=r)
        steps = list(stream_generate(engine.pm, engine.tokenizer, ids, opts))
        assert (tokens_of(steps) == ar) is exact, kind
        assert {st.accept for st in steps} == {r.label}


def test_everything_accepted_at_tau_zero(engine):
    steps = list(engine.generate(engine.encode("hello"), max_tokens=40, num_draft_tokens=3, accept="threshold:tau=0"))
    full = [st for st in steps if st.proposed and st.finish_reason is None]
    assert full and all(st.accepted == st.proposed for st in full)


def test_cli_labels_lenient_answers_and_refuses_bad_rules(dirs, capsys):
    model, adapter = (str(x) for x in dirs)
    base = ["--model", model, "--adapter", adapter, "--prompt", "hi", "--max-tokens", "8", "--num-draft-tokens", "3"]
    assert generate_main([*base, "--accept", "threshold:0.1"]) == 0
    err = capsys.readouterr().err
    assert "lenient threshold tau=0.1: not the exact sample" in err
    assert generate_main(base) == 0
    assert "lenient" not in capsys.readouterr().err  # exact by default, unlabelled
    assert generate_main([*base, "--accept", "sloppy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --accept: unknown acceptance rule 'sloppy'")


def test_bench_prices_lenient_answers_in_quality(dirs, tmp_path, capsys):
    """ptp-bench's ptp-lenient method: its answers are scored under the base model beside exact decoding's, whose
    two methods (ar, ptp: the same answers) score the same; the JSON records the rule."""
    import json

    from ptp_mlx.bench.cli import main as bench_main
    from ptp_mlx.bench.quality import answer_scores

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "category": "c", "turns": [t]}) + "\n"
                               for i, t in enumerate(["hello there", "one two three"])))  # fmt: skip
    model, adapter = (str(x) for x in dirs)
    argv = ["--model", model, "--adapter", adapter, "--prompts", str(prompts), "--max-tokens", "16", "--no-cost-curve"]
    argv += [
        "--no-warmup",
        "--methods",
        "ar,ptp,ptp-lenient",
        "--accept",
        "threshold:0.002",
        "--json",
        str(tmp_path / "b.json"),
    ]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "quality under the base model" in out and "ptp-lenient (lenient threshold tau=0.002)" in out
    q = json.loads((tmp_path / "b.json").read_text())["quality"]
    assert set(q) == {"ar", "ptp", "ptp-lenient"} and q["ar"] == q["ptp"]
    assert 0 < q["ptp-lenient"]["mean_p"] <= 1 and q["ptp-lenient"]["perplexity"] >= 1
    lp, p, n = answer_scores(Engine.load(model, adapter, measure_cost=False).pm.base, [1, 2, 3], [4, 5])
    assert n == 2 and lp < 0 and 0 < p < 2


def test_pivot_guard_reads_the_rows_picks_against_the_context():
    """A pivot rule's lenient acceptance stands only where the context does not offer the row's exact pick: as a
    token (``pivot=1``, where a number is always a pivot) or right after the row's own token (``pivot=2``)."""
    rows = mx.array([[2.0, 1.9, 0.0, 0.0], [2.0, 1.9, 0.0, 0.0]])  # the draft (1) nearly ties with the pick (0)
    drafts, picks, inputs = mx.array([1, 1]), mx.array([0, 0]), mx.array([3, 2])
    r = AcceptRule.parse("entropy:pivot=1")
    assert (
        r.guarded
        and r.label == "lenient entropy eps=0.3 delta=0.09 pivot=1"
        and not AcceptRule.parse("entropy").guarded
    )
    assert r.for_source("lookup") is r and not r.for_source("ptp").guarded and r.for_source("ptp").lenient
    assert not AcceptRule.parse("entropy:pivot=1,lookup=0").for_source("lookup").lenient
    held = ContextTokens(1, 4, [0, 1])  # the context holds the pick: a pivot, left to the exact rule
    assert r.accepts(rows, drafts, 1.0, picks, held.array(), inputs).tolist() == [False, False]
    assert r.accepts(rows, drafts, 1.0, picks, ContextTokens(1, 4, [1, 2, 3]).array(), inputs).tolist() == [True, True]
    number = ContextTokens(1, 4, [1, 2, 3], numbers=[0, 9])  # the pick is a number: a pivot though not in context
    assert r.accepts(rows, drafts, 1.0, picks, number.array(), inputs).tolist() == [False, False]
    assert AcceptRule.parse("entropy").accepts(rows, drafts, 1.0).tolist() == [True, True]
    pairs = AcceptRule.parse("threshold:tau=0.1,pivot=2")
    ctx = ContextTokens(2, 4, [3, 1])
    ctx.add([2])
    ctx.add([0])  # pairs 3-1, 1-2 and, across the two blocks, 2-0: the pick 0 follows token 2, not token 3
    assert ctx.seen.sum() == 3
    assert pairs.accepts(rows, drafts, 1.0, picks, ctx.array(), inputs).tolist() == [True, False]
    ctx = ContextTokens(2, 4, [3, 1, 2, 0], numbers=[0])  # the pick is a number: a pivot after any token
    assert pairs.accepts(rows, drafts, 1.0, picks, ctx.array(), inputs).tolist() == [False, False]
    with pytest.raises(ValueError, match="needs the rows' exact picks"):
        r.accepts(rows, drafts, 1.0)
    with pytest.raises(ValueError, match="pivot must be 0, 1 or 2"):
        AcceptRule.parse("threshold:pivot=3")


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("pivot", [1, 2])
def test_pivot_guard_leaves_picks_the_context_offers_to_the_exact_rule(engine, compiled, pivot):
    """Wrong lookup chains under ``threshold:tau=0`` (every draft would stand): under a pivot guard a token of the
    answer differs from the exact sample only where that sample was not a token of the context (``pivot=1``) or
    never followed the row's token there (``pivot=2``); with ``pivot=1`` a prompt that holds every token id leaves
    nothing lenient: the answer is the exact one."""
    import dataclasses

    from ptp_mlx.generate import DecodeOptions, stream_generate
    from ptp_mlx.testing import OracleDrafter

    class WrongLookup(OracleDrafter):
        def plan(self, i, remaining, room):
            return dataclasses.replace(super().plan(i, remaining, room), source="lookup")

    def answer(ids, rule, n=24):
        ar = tokens_of(engine.generate(ids, mode="ar", max_tokens=n))
        wrong = [(t + 1) % 200 + 3 for t in ar]
        opts = DecodeOptions(mode="ptp", max_tokens=n, drafter=WrongLookup(wrong, 4), accept=rule, compiled=compiled)
        steps = list(stream_generate(engine.pm, engine.tokenizer, ids, opts))
        assert {st.accept for st in steps} == {rule.label}
        return ar, tokens_of(steps)

    guarded = AcceptRule.parse(f"threshold:tau=0,pivot={pivot}")
    ids = engine.encode("hello there")
    ar, got = answer(ids, guarded)
    _, loose = answer(ids, AcceptRule.parse("threshold:tau=0"))
    assert loose != ar and got != ar  # drafts the context does not offer still stand
    pm, u, cache = engine.pm, UniformStream(0), engine.pm.make_cache()
    pm.base(mx.array(ids[:-1])[None], cache=cache)
    prev, refused, lenient = ids[-1], 0, 0
    numbers = set(number_tokens(engine.tokenizer))
    for g, tok in enumerate(got):
        logits = pm.base(mx.array([[prev]]), cache=cache)[0, -1]
        want = int(pick(mx.array(u[g]), logits, 0.0).item())
        seen = ids + got[:g]
        if pivot == 1:  # a token of the context, or a number (always a pivot)
            offered = want in seen or want in numbers
        else:  # the pick right after the row's own token (``prev``) somewhere in the context, or a number
            offered = want in numbers or any(a == prev and b == want for a, b in zip(seen[:-1], seen[1:], strict=True))
        if tok != want:
            assert not offered, (g, tok, want)
            lenient += 1
        refused += offered
        prev = tok
    assert lenient and refused  # both cases happened in this answer
    if pivot == 1:  # (every pair of the 259 ids would not fit the tiny model's context)
        ar_all, got_all = answer(list(range(3, 259)) + ids, guarded)
        assert got_all == ar_all


@pytest.mark.parametrize("compiled", [True, False])
def test_copies_of_an_earlier_turn_are_verified_exactly(engine, compiled):
    """``DraftPlan.strict`` (a lookup chain copied from an earlier turn of a chat): verified by the exact rule under
    any lenient rule, guarded or not, chained or built after the read: wrong drafts at ``tau=0`` leave the exact
    answer."""
    import dataclasses

    from ptp_mlx.generate import DecodeOptions, stream_generate
    from ptp_mlx.testing import OracleDrafter

    class EarlierTurn(OracleDrafter):
        def plan(self, i, remaining, room):
            return dataclasses.replace(super().plan(i, remaining, room), source="lookup", strict=True)

    ids = engine.encode("hello there")
    ar = tokens_of(engine.generate(ids, mode="ar", max_tokens=24))
    wrong = [(t + 1) % 200 + 3 for t in ar]
    for text in ("threshold:tau=0", "threshold:tau=0,pivot=1", "entropy:eps=0,delta=0"):
        rule = AcceptRule.parse(text)
        assert rule.for_source("lookup", strict=True) == EXACT and rule.for_source("lookup").lenient
        opts = DecodeOptions(mode="ptp", max_tokens=24, drafter=EarlierTurn(wrong, 4), accept=rule, compiled=compiled)
        steps = list(stream_generate(engine.pm, engine.tokenizer, ids, opts))
        assert tokens_of(steps) == ar, text
        assert {st.accept for st in steps} == {rule.label}  # still a lenient answer: labelled as one
    loose = DecodeOptions(mode="ptp", max_tokens=24, drafter=OracleDrafter(wrong, 4), accept=rule, compiled=compiled)
    assert tokens_of(stream_generate(engine.pm, engine.tokenizer, ids, loose)) != ar  # not strict: they stand


def test_turn_start_is_where_the_last_user_message_starts(engine, monkeypatch):
    """``Engine.turn_start``: the tokens before it are the earlier messages rendered alone; ``Engine.generate``
    finds it for chat messages under a lenient rule and passes it to decoding."""
    import ptp_mlx.engine as engine_mod

    first = [{"role": "user", "content": "hello there"}]
    chat = first + [{"role": "assistant", "content": "one two three"}, {"role": "user", "content": "four five"}]
    ids = engine.encode(chat)
    before = engine.tokenizer.apply_chat_template(chat[:2], add_generation_prompt=False, tokenize=True)
    t = engine.turn_start(chat, ids)
    assert 0 < t < len(ids) and ids[:t] == list(before)[:t]
    assert engine.tokenizer.decode(ids[t:]).count("four five") == 1 and "three" not in engine.tokenizer.decode(ids[t:])
    assert engine.turn_start(first, engine.encode(first)) == 0
    seen = []
    real = engine_mod.stream_generate
    monkeypatch.setattr(engine_mod, "stream_generate", lambda *a, **k: seen.append(a[3].turn_start) or real(*a, **k))
    for accept, prompt in (("threshold:0.5", chat), ("exact", chat), ("threshold:0.5", ids)):
        list(engine.generate(prompt, max_tokens=2, accept=accept))
    list(engine.generate(ids, max_tokens=2, accept="threshold:0.5", turn_start=t))
    assert seen == [t, 0, 0, t]
