"""ptp-bench on the tiny random model: metric arithmetic, the exactness checks, JSON schema, plot, bad input."""

import json

import pytest

from ptp_mlx.bench import cli
from ptp_mlx.bench.methods import Measured
from ptp_mlx.bench.metrics import ALL, summarize
from ptp_mlx.bench.prompts import load_prompts, messages_for, parse_prompts
from ptp_mlx.bench.run import Record, compare, diagnose, first_difference, run_bench
from ptp_mlx.errors import UserError
from ptp_mlx.sampler import SamplingSettings

PROMPTS = [
    {"question_id": "a-1", "category": "alpha", "turns": ["Say hello."]},
    {"question_id": "b-1", "category": "beta", "turns": ["Count to three.", "Now backwards."]},
    {"question_id": "a-2", "category": "alpha", "turns": ["Name a colour."]},
]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    return p


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
    assert any(r["name"].endswith(" ahead") for r in ptp)  # every shape also pipelined (ptp_mlx/decode/ahead.py)
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
        if r["name"].endswith(" ahead") and r["phases"]["build"] == 0:
            assert r["host_on_path"] < next(x for x in ptp if x["name"] == r["name"][:-6])["phases"]["build"]


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


class FlipOne:
    """A deliberately broken decoder: the real one with the token at ``pos`` changed."""

    def __init__(self, inner, pos=3):
        self.inner, self.pos = inner, pos

    def __call__(self, ids, max_tokens, sampling):
        m = self.inner(ids, max_tokens, sampling)
        if len(m.token_ids) > self.pos:
            m.token_ids[self.pos] = (m.token_ids[self.pos] + 1) % 200 + 3
        return m


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

    def interrupting(ids, max_tokens, sampling):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return inner(ids, max_tokens, sampling)

    out = run_bench(
        load_prompts(prompt_file), {"ar": interrupting}, engine.tokenizer, 8, SamplingSettings(), warmup=False
    )
    assert out.interrupted and out.complete == ["a-1"] and len(out.records) == 1


def test_interrupt_keeps_the_turns_of_the_prompt_in_progress(engine, prompt_file):
    from ptp_mlx.bench.methods import make_runners

    inner, calls = make_runners(engine, ["ar"])["ar"], []

    def interrupting(ids, max_tokens, sampling):
        calls.append(1)
        if len(calls) == 3:  # a-1, then turn 0 of b-1, then Ctrl-C in turn 1
            raise KeyboardInterrupt
        return inner(ids, max_tokens, sampling)

    out = run_bench(
        load_prompts(prompt_file), {"ar": interrupting}, engine.tokenizer, 8, SamplingSettings(), warmup=False
    )
    assert out.complete == ["a-1"] and [r.question_id for r in out.records] == ["a-1", "b-1"]
    assert summarize(out.records, out.complete, ["ar"])["ar"][ALL]["prompts"] == 1


# --- the command -------------------------------------------------------------------------------------------


def _argv(tiny_model_dir, adapter_dir, prompt_file, tmp_path, *extra):
    return [
        "--model",
        str(tiny_model_dir),
        "--adapter",
        str(adapter_dir),
        "--prompts",
        str(prompt_file),
        "--max-tokens",
        "8",
        "--cost-widths",
        "1,2",
        "--json",
        str(tmp_path / "b.json"),
        "--plot",
        str(tmp_path / "b.png"),
        *extra,
    ]


def test_cli_json_schema_table_and_plot(tiny_model_dir, adapter_dir, prompt_file, tmp_path, capsys):
    rc = cli.main(_argv(tiny_model_dir, adapter_dir, prompt_file, tmp_path))
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.splitlines()[0].startswith("ptp-bench | model (float32) | cpu")
    assert "lossless (ptp == ar): 4/4 answers identical: ok" in out
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["schema"] == "ptp-bench/1" and doc["complete"] and not doc["interrupted"]
    assert doc["settings"]["methods"] == ["mlx-lm", "ar", "ptp"] and doc["settings"]["greedy"]
    for key in ("cpu", "mlx_version", "device", "dtype", "blas", "model_hash", "adapter_hash"):
        assert doc["environment"][key], key
    assert len(doc["records"]) == 12 and {
        "token_ids",
        "wall_time",
        "calls",
        "accepted_sum",
        "tokens",
        "peak_memory",
        "text",
    } <= set(doc["records"][0])
    assert set(doc["summary"]) == {"mlx-lm", "ar", "ptp"}
    assert set(doc["summary"]["ar"]) == {"alpha", "beta", ALL}
    assert doc["summary"]["ar"][ALL]["mean_accepted"] == 1.0
    assert [c["name"] for c in doc["checks"]] == ["lossless", "greedy parity"] and all(c["ok"] for c in doc["checks"])
    assert doc["cost_curve"]["widths"] == [1, 2] and doc["cost_curve"]["relative"][0] == 1.0
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_broken_decoder_fails_the_exit_code(
    tiny_model_dir, adapter_dir, prompt_file, tmp_path, capsys, monkeypatch
):
    from ptp_mlx.bench import methods

    real = methods.make_runners

    def broken(*a, **k):
        runners = real(*a, **k)
        runners["ptp"] = FlipOne(runners["ptp"], pos=2)
        return runners

    monkeypatch.setattr(methods, "make_runners", broken)
    rc = cli.main(
        _argv(
            tiny_model_dir, adapter_dir, prompt_file, tmp_path, "--limit", "1", "--methods", "ar,ptp", "--no-cost-curve"
        )
    )
    out, err = capsys.readouterr()
    assert rc == 1
    assert "first difference at position 2" in out and err.strip().splitlines()[-1].startswith(
        "error: lossless check failed"
    )
    doc = json.loads((tmp_path / "b.json").read_text())
    assert not doc["checks"][0]["ok"] and doc["checks"][0]["divergences"][0]["position"] == 2
    assert doc["cost_curve"] is None and (tmp_path / "b.png").exists()


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--methods", "ar,fast"], "unknown method"),
        (["--methods", "mlx-lm-draft"], "needs --draft-model"),
        (["--adapter", "none", "--methods", "ptp"], "needs an adapter"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--top-p", "0"], "top_p"),
        (["--cost-widths", "1,x"], "--cost-widths"),
        (["--prompts", "/nonexistent.jsonl"], "prompt file not found"),
        (["--categories", "gamma"], "unknown categories"),
    ],
)
def test_cli_bad_input(tiny_model_dir, adapter_dir, prompt_file, tmp_path, capsys, extra, msg):
    rc = cli.main(_argv(tiny_model_dir, adapter_dir, prompt_file, tmp_path) + extra)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and msg in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "b.png").exists()


def test_cli_ptp_without_adapter(tiny_model_dir, prompt_file, tmp_path, capsys):
    rc = cli.main(["--model", str(tiny_model_dir), "--prompts", str(prompt_file), "--methods", "ar,ptp"])
    assert rc == 2 and "needs an adapter" in capsys.readouterr().err


def test_cli_interrupt_writes_partial_results(tiny_model_dir, adapter_dir, prompt_file, tmp_path, capsys, monkeypatch):
    from ptp_mlx.bench import methods

    real = methods.make_runners

    def interrupting(*a, **k):
        runners = real(*a, **k)
        inner, n = runners["ar"], []

        def run(ids, max_tokens, sampling):
            n.append(1)
            if len(n) == 3:  # warm-up, first prompt, then Ctrl-C on the second prompt
                raise KeyboardInterrupt
            return inner(ids, max_tokens, sampling)

        runners["ar"] = run
        return runners

    monkeypatch.setattr(methods, "make_runners", interrupting)
    rc = cli.main(_argv(tiny_model_dir, adapter_dir, prompt_file, tmp_path, "--methods", "ar", "--no-cost-curve"))
    out, err = capsys.readouterr()
    assert rc == 1 and "interrupted after 1 of 3 prompts" in err and "INTERRUPTED" in out
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["interrupted"] and doc["prompts_complete"] == ["a-1"] and len(doc["records"]) == 1
    assert (tmp_path / "b.png").exists()


def test_chat_turns_carried_cache_prefills_less(tiny_model_dir, adapter_dir, prompt_file, capsys):
    """``--chat-turns``: one chat answered with the carried cache and with full re-prefill, same answers, and
    every follow-up turn prefills fewer tokens with the carried cache."""
    argv = ["--model", str(tiny_model_dir), "--adapter", str(adapter_dir), "--prompts", str(prompt_file)]
    rc = cli.main(argv + ["--max-tokens", "6", "--chat-turns", "3", "--no-cost-curve"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "answers identical: yes" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "turn" not in line]
    assert len(rows) == 3
    for i, r in enumerate(rows):
        carried, full = int(r[2]), int(r[4])
        assert full == int(r[1]) - 1 and (carried < full if i else carried == full)
    assert cli.main(argv + ["--chat-turns", "0"]) == 2


def test_draft_model_baseline(tiny_model_dir, adapter_dir, prompt_file, tmp_path, capsys):
    """``--draft-model``: mlx-lm's own speculative decoding as a method (a tiny model that shares the tokenizer;
    here the model drafts for itself, so greedy drafts always land)."""
    argv = ["--model", str(tiny_model_dir), "--adapter", str(adapter_dir), "--prompts", str(prompt_file)]
    argv += ["--max-tokens", "8", "--methods", "ar,mlx-lm-draft", "--draft-model", str(tiny_model_dir)]
    rc = cli.main(argv + ["--no-cost-curve", "--json", str(tmp_path / "d.json")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    summary = json.loads((tmp_path / "d.json").read_text())["summary"]
    assert summary["mlx-lm-draft"][ALL]["mean_accepted"] > 1.5
    assert summary["ar"][ALL]["mean_accepted"] == 1.0


def test_cli_free_rows_prices_rows_at_nothing(tiny_model_dir, adapter_dir, prompt_file, tmp_path, capsys, monkeypatch):
    from ptp_mlx.engine import Engine

    seen = []
    real_load = Engine.load

    def load(*a, **k):
        eng = real_load(*a, **k)
        seen.append(eng)
        return eng

    monkeypatch.setattr(Engine, "load", load)
    rc = cli.main(_argv(tiny_model_dir, adapter_dir, prompt_file, tmp_path, "--free-rows", "--methods", "ar,ptp"))
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "lossless (ptp == ar): 4/4 answers identical: ok" in out
    budgets = [seen[0].budget, *seen[0].mode_budgets.values()]
    assert all(b.curve(1) == b.curve(64) == 1.0 for b in budgets if b is not None)
