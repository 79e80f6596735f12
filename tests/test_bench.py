"""ptp-bench on the tiny random model: metric arithmetic, the exactness checks, JSON schema, plot, bad input."""

import json

import pytest

from ptp_mlx.bench.methods import Measured
from ptp_mlx.bench.metrics import ALL, summarize
from ptp_mlx.bench.prompts import load_prompts, messages_for, parse_prompts
from ptp_mlx.bench.run import Record, compare, diagnose, first_difference, run_bench
from ptp_mlx.errors import UserError
from ptp_mlx.sampler import SamplingSettings
from ptp_mlx.testing import FlipOne


@pytest.fixture(scope="module")
def engine(tiny_model_dir, adapter_dir):
    from ptp_mlx.engine import Engine

    return Engine.load(str(tiny_model_dir), str(adapter_dir), log=lambda m: None, measure_cost=False)


def _rec(method, qid, cat, n_tokens, wall, calls, acc, turn=0, first_time=0.0, first_tokens=1):
    m = Measured(list(range(n_tokens)), calls, acc, wall, first_time, first_tokens, 0.1, "length")
    return Record(method, qid, cat, turn, 0, 5, m)


# --- prompts -----------------------------------------------------------------------------------------------


def test_prompts_round_robin_categories_and_messages(prompt_file):
    ps = load_prompts(prompt_file)
    assert [p.question_id for p in ps] == ["a-1", "b-1", "a-2"]
    assert [p.question_id for p in load_prompts(prompt_file, limit=2)] == ["a-1", "b-1"]
    assert [p.question_id for p in load_prompts(prompt_file, categories=["alpha"])] == ["a-1", "a-2"]
    msgs = messages_for(ps[1], 1, ["1 2 3"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"] and msgs[1]["content"] == "1 2 3"


def test_bundled_prompts_are_spec_bench_and_held_out():
    ps = load_prompts()
    assert len(ps) == 24 and {p.category for p in ps} == {"instruction", "math_reasoning", "coding"}
    from ptp_mlx.bench.prompts import default_prompts_path

    lines = [json.loads(x) for x in default_prompts_path().read_text().splitlines()]
    for d in lines:  # permissive licences only, each line naming its origin (ptp_mlx/data/README.md)
        assert "MIT" in d["source"] or "Apache-2.0" in d["source"], d
        assert "alpaca" not in d["source"].lower()
        # Taken from public sets: ids in the dev prompts' validation split; written here: never trained on.
        assert d["question_id"][-1] in "05" or d["source"].startswith("written for ptp-mlx"), d


def test_profile_splits_real_calls_into_phases(engine, prompt_file):
    from ptp_mlx.bench.profile import PHASES, run_profile
    from ptp_mlx.sampler import SamplingSettings

    ids = engine.encode([{"role": "user", "content": "1 2 3 4"}])
    text, doc = run_profile(engine, ids, 12, SamplingSettings(), rounds=1)
    names = [r["name"] for r in doc["rows"]]
    assert names[:3] == ["mlx-lm", "ar (pipelined)", "ar (unpipelined)"]
    ptp = [r for r in doc["rows"] if r["name"].startswith("ptp ")]
    assert ptp and all(set(r["phases"]) == set(PHASES) and r["calls"] > 0 for r in ptp)
    for r in ptp:  # the phases add up to about the whole call (medians of sums vs sums of medians)
        assert r["total"] > 0 and sum(r["phases"].values()) <= 1.5 * r["total"] + 0.5
    assert text.splitlines()[0].startswith("ptp-bench --profile") and "| ptp 3+" in text
    assert any(r["name"].endswith(" chained") for r in ptp)  # every shape also pipelined (ptp_mlx/decode/pipeline.py)
    default = next(r for r in ptp if r["name"] == "ptp default")  # the default drafter's own calls
    assert 0 <= default["chained"] <= default["calls"] and f"{default['chained']} of them chained" in text
    # every call built after the read says why; the answer's first is built while the prompt's prefill computes
    assert sum(default["why"].values()) == default["calls"] - default["chained"] > 0
    assert "\nbuilt after the read: " in text and "the answer's first call" not in default["why"]
    assert "\nbuilding ahead: " in text  # the learnt choice (decode/chain_odds.ChainChoice)
    # Beside it, building ahead always (what a device where it pays runs): never "off", its share and pace shown
    always = next(r for r in ptp if r["name"] == "ptp default, built ahead always")
    assert "building ahead off" not in always["why"] and always["chained"] > 0
    assert sum(always["why"].values()) == always["calls"] - always["chained"]
    assert f"built ahead always: {always['calls']} PTP calls (bursts aside), {always['chained']} of them" in text
    assert always["ms_per_token"] > 0 and f"{always['ms_per_token']:.2f} ms per token against" in text
    assert doc["diverged"] == [] and "every PTP shape == ar" in text  # padded drafts included: still exact
    # Host time on the critical path, measured directly: the host phases while nothing is queued (none for
    # pipelined steps); the indirect wall time minus compute beside it, for every kind of call.
    assert "host on path" in text.splitlines()[1] and set(doc["host_on_path"]) == set(names)
    for r in doc["rows"]:
        assert r["compute"] > 0 and 0 <= r["host_on_path"] <= r["total"]
        assert r["wall_minus_compute"] == pytest.approx(max(0.0, r["total"] - r["compute"]))
    assert all(r["host_on_path"] == 0 for r in doc["rows"] if r["name"] in ("mlx-lm", "ar (pipelined)"))
    unpiped = next(r for r in doc["rows"] if r["name"] == "ar (unpipelined)")
    host = unpiped["phases"]["build"] + unpiped["phases"]["read+trim"]  # (sum of medians: the median of sums)
    assert 0 < unpiped["host_on_path"] <= 2 * host + 0.5
    for r in ptp:  # a synchronous call builds on the path; a chained one was built while the one before computed
        on_path = sum(r["phases"][k] for k in ("plan", "build", "read+trim", "update"))
        assert 0 < r["host_on_path"] <= 2 * on_path + 0.5
        if r["name"].endswith(" chained") and r["phases"]["build"] == 0:
            assert (
                r["host_on_path"]
                < next(x for x in ptp if x["name"] == r["name"].removesuffix(" chained"))["phases"]["build"]
            )


@pytest.mark.parametrize(
    "line, msg",
    [
        ("{not json", "not valid JSON"),
        ('{"category": "x", "turns": ["q"]}', "missing 'question_id'"),
        ('{"question_id": 1, "turns": []}', "'turns'"),
        ('{"question_id": 1, "turns": ["q"]}\n{"question_id": 1, "turns": ["q"]}', "duplicate"),
    ],
)
def test_bad_prompt_lines(line, msg):
    with pytest.raises(UserError, match=msg):
        parse_prompts(line.splitlines(), "f.jsonl")


def test_unknown_category(prompt_file):
    with pytest.raises(UserError, match="unknown categories"):
        load_prompts(prompt_file, categories=["gamma"])


# --- metric arithmetic -------------------------------------------------------------------------------------


def test_metric_arithmetic():
    recs = [
        _rec("mlx-lm", "q1", "c", 10, 1.0, 10, 10),
        _rec("mlx-lm", "q2", "c", 20, 4.0, 20, 20),
        _rec("ar", "q1", "c", 10, 0.5, 10, 10),
        _rec("ar", "q2", "c", 20, 2.0, 20, 20),
        # ptp: 12 tokens in 4 calls and 18 in 6 calls -> 3 tokens per call pooled
        _rec("ptp", "q1", "c", 12, 0.5, 4, 12),
        _rec("ptp", "q2", "c", 18, 1.0, 6, 18),
        # multi-turn prompt q3: turns are summed before dividing
        _rec("ar", "q3", "d", 6, 1.0, 6, 6, turn=0),
        _rec("ar", "q3", "d", 4, 1.0, 4, 4, turn=1),
    ]
    s = summarize(recs, ["q1", "q2", "q3"], ["mlx-lm", "ar", "ptp"])
    mlx, ar, ptp = s["mlx-lm"]["c"], s["ar"]["c"], s["ptp"]["c"]
    assert mlx["tokens_per_s"] == pytest.approx((10 / 1 + 20 / 4) / 2)  # per-prompt rate, then the mean
    assert ar["tokens_per_s"] == pytest.approx((20 + 10) / 2)
    assert ar["speedup"] == pytest.approx(15 / 7.5)
    assert ar["mean_accepted"] == 1.0 and mlx["mean_accepted"] == 1.0
    assert ptp["mean_accepted"] == pytest.approx(3.0)
    assert ptp["tokens_per_s"] == pytest.approx((24 + 18) / 2)
    assert s["ar"]["d"]["tokens_per_s"] == pytest.approx(5.0) and s["ar"]["d"]["speedup"] is None
    assert s["ar"][ALL]["prompts"] == 3 and s["ar"][ALL]["tokens"] == 40
    # Prompts not finished by every method stay out of the summary.
    assert summarize(recs, ["q1"], ["ar"])["ar"][ALL]["tokens"] == 10


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


# --- the measuring loop on the tiny model ------------------------------------------------------------------


def test_run_bench_ar_is_one_token_per_call_and_ptp_is_exact(engine, prompt_file):
    from ptp_mlx.bench.methods import make_runners

    prompts = load_prompts(prompt_file)
    runners = make_runners(engine, ["mlx-lm", "ar", "ptp"])
    ticks = []
    out = run_bench(prompts, runners, engine.tokenizer, 12, SamplingSettings(), progress=ticks.append)
    assert not out.interrupted and out.complete == ["a-1", "b-1", "a-2"] and len(ticks) == 9
    assert len(out.records) == 3 * 4  # 4 turns in all, per method
    s = summarize(out.records, out.complete, ["mlx-lm", "ar", "ptp"])
    assert s["ar"][ALL]["mean_accepted"] == 1.0 and s["mlx-lm"][ALL]["mean_accepted"] == 1.0
    assert s["ptp"][ALL]["mean_accepted"] >= 1.0 and s["mlx-lm"][ALL]["speedup"] == pytest.approx(1.0)
    assert compare(out.records, "ar", "ptp")[1:] == (4, [])
    assert compare(out.records, "mlx-lm", "ar")[1:] == (4, [])  # greedy parity with mlx-lm


def test_sampled_ptp_equals_ar(engine, prompt_file):
    from ptp_mlx.bench.methods import make_runners

    prompts = load_prompts(prompt_file, limit=2)
    s = SamplingSettings(temperature=1.0, top_k=50, top_p=0.9, seed=3)
    out = run_bench(prompts, make_runners(engine, ["ar", "ptp"]), engine.tokenizer, 12, s, warmup=False)
    n, same, divs = compare(out.records, "ar", "ptp")
    assert n == 3 and same == 3 and not divs


def test_prompt_longer_than_the_context_is_skipped_for_every_method(engine):
    from ptp_mlx.bench.methods import make_runners
    from ptp_mlx.bench.prompts import Prompt

    prompts = [Prompt("long", "x", ("y" * 600,)), Prompt("short", "x", ("Hi.",))]
    ticks, notes = [], []
    out = run_bench(
        prompts,
        make_runners(engine, ["mlx-lm", "ar"]),
        engine.tokenizer,
        8,
        SamplingSettings(),
        warmup=False,
        progress=ticks.append,
        context=512,
        log=notes.append,
    )
    assert out.complete == ["short"] and out.skipped[0]["question_id"] == "long" and "do not fit" in notes[0]
    assert {r.question_id for r in out.records} == {"short"} and sum(ticks) == 4


def test_lossless_check_catches_a_broken_decoder(engine, prompt_file):
    from ptp_mlx.bench.methods import make_runners

    runners = make_runners(engine, ["ar", "ptp"])
    runners["ptp"] = FlipOne(runners["ptp"])
    out = run_bench(load_prompts(prompt_file, limit=1), runners, engine.tokenizer, 8, SamplingSettings(), warmup=False)
    n, same, divs = compare(out.records, "ar", "ptp")
    assert (n, same, len(divs)) == (1, 0, 1) and divs[0].position == 3
    diagnose(divs[0], out.records, "ar", engine.pm, SamplingSettings())
    assert divs[0].logit_gap > 0  # the reference token is the argmax, the flipped one is not
    assert not divs[0].near_tie and "NOT a near-tie" in divs[0].describe("ar", "ptp")
    assert "position 3" in divs[0].describe("ar", "ptp")


def test_interrupt_keeps_what_was_measured(engine, prompt_file):
    from ptp_mlx.bench.methods import make_runners

    runners = make_runners(engine, ["ar"])
    inner, calls = runners["ar"], []

    def interrupting(ids, max_tokens, sampling, turn_start=0):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return inner(ids, max_tokens, sampling, turn_start)

    out = run_bench(
        load_prompts(prompt_file), {"ar": interrupting}, engine.tokenizer, 8, SamplingSettings(), warmup=False
    )
    assert out.interrupted and out.complete == ["a-1"] and len(out.records) == 1


def test_interrupt_keeps_the_turns_of_the_prompt_in_progress(engine, prompt_file):
    from ptp_mlx.bench.methods import make_runners

    inner, calls = make_runners(engine, ["ar"])["ar"], []

    def interrupting(ids, max_tokens, sampling, turn_start=0):
        calls.append(1)
        if len(calls) == 3:  # a-1, then turn 0 of b-1, then Ctrl-C in turn 1
            raise KeyboardInterrupt
        return inner(ids, max_tokens, sampling, turn_start)

    out = run_bench(
        load_prompts(prompt_file), {"ar": interrupting}, engine.tokenizer, 8, SamplingSettings(), warmup=False
    )
    assert out.complete == ["a-1"] and [r.question_id for r in out.records] == ["a-1", "b-1"]
    assert summarize(out.records, out.complete, ["ar"])["ar"][ALL]["prompts"] == 1


# --- the command -------------------------------------------------------------------------------------------


def test_a_later_turn_is_told_where_it_starts(engine, prompt_file):
    """A conversation's later turn reaches the method with where its last user message starts (a lenient rule
    then verifies copies of the method's earlier answers exactly, as in the chat); a first turn with 0."""
    from ptp_mlx.bench.methods import make_runners

    inner, seen = make_runners(engine, ["ar"])["ar"], []

    def recording(ids, max_tokens, sampling, turn_start=0):
        seen.append((list(ids), turn_start))
        return inner(ids, max_tokens, sampling, turn_start)

    prompts = load_prompts(prompt_file)
    run_bench(prompts, {"ar": recording}, engine.tokenizer, 8, SamplingSettings(), warmup=False)
    assert [t for _, t in seen][:2] == [0, 0] and len(seen) == sum(len(p.turns) for p in prompts)
    later = [(ids, t) for ids, t in seen if t]
    assert later and all(0 < t < len(ids) for ids, t in later)
    ids, t = later[0]
    assert engine.tokenizer.decode(ids[t:]).count(prompts[1].turns[1]) == 1  # the second user turn is after it
    assert prompts[1].turns[0] not in engine.tokenizer.decode(ids[t:])
