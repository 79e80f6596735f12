"""``ptp-bench`` from the command line: its JSON, table and plot, exit codes for broken decoders and bad input,
interrupts that keep partial results, carried chat caches, mlx-lm's draft-model baseline and free rows."""

import json

import pytest

from ptp_mlx.bench import cli
from ptp_mlx.bench.metrics import ALL
from ptp_mlx.testing import FlipOne


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
        # (these ran, and wrote no file or ran only one of the modes, exit 0)
        (["--methods", ","], "--methods lists no method"),
        (["--chat-turns", "2"], "--chat-turns writes no --json file"),
        (["--profile"], "--profile writes no --plot file"),
        (["--chat-turns", "2", "--profile"], "--chat-turns and --profile are separate runs"),
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

        def run(ids, max_tokens, sampling, turn_start=0):
            n.append(1)
            if len(n) == 3:  # warm-up, first prompt, then Ctrl-C on the second prompt
                raise KeyboardInterrupt
            return inner(ids, max_tokens, sampling, turn_start)

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
    from ptp_mlx.decode.chain_odds import choice_for

    assert choice_for(seen[0].pm).forced is True  # (every next call built ahead where it can be, as on a GPU)
    assert "\nbuilding ahead: on (set, not learnt)" in out


@pytest.mark.parametrize(
    "flag, path, msg",
    [
        ("--json", "emptydir", "--json emptydir: is a folder"),
        ("--json", "afile/x.json", "--json afile/x.json: cannot create it (afile is not a folder)"),
        ("--plot", "afile/p.png", "--plot afile/p.png: cannot create it (afile is not a folder)"),
    ],
)
def test_cli_bad_output_path_fails_before_loading(
    tiny_model_dir, adapter_dir, prompt_file, tmp_path, capsys, monkeypatch, flag, path, msg
):
    from ptp_mlx.engine import Engine

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the output path was checked")

    monkeypatch.setattr(Engine, "load", no_load)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "afile").write_text("")
    rc = cli.main(_argv(tiny_model_dir, adapter_dir, prompt_file, tmp_path) + [flag, path])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err == f"error: {msg}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "emptydir"]


def _long_prompts(tmp_path, turns):
    p = tmp_path / "longp.jsonl"
    p.write_text(json.dumps({"question_id": "long-1", "category": "alpha", "turns": turns}) + "\n")
    return p


def test_cli_no_prompt_fits_the_context(tiny_model_dir, adapter_dir, tmp_path, capsys, monkeypatch):
    """Every prompt too long for the tiny model's context (512): exit 2 before anything is measured."""
    from ptp_mlx.bench import methods

    def no_runners(*a, **k):
        raise AssertionError("measuring began")

    monkeypatch.setattr(methods, "make_runners", no_runners)
    prompts = _long_prompts(tmp_path, ["word " * 600])
    rc = cli.main(_argv(tiny_model_dir, adapter_dir, prompts, tmp_path, "--limit", "1"))
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and out == "" and "skipping" not in err
    assert errors == [f"error: no prompt in {prompts} fits the model's context of 512 tokens"]
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "b.png").exists()


def test_cli_every_prompt_skipped_while_running(tiny_model_dir, adapter_dir, tmp_path, capsys):
    """A first turn that fits and a second that does not: every prompt skipped, so no table but exit 2."""
    prompts = _long_prompts(tmp_path, ["Say hello.", "word " * 600])
    argv = _argv(tiny_model_dir, adapter_dir, prompts, tmp_path, "--methods", "ar", "--no-cost-curve", "--no-warmup")
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and out == "" and "notice: skipping long-1 turn 1" in err
    assert errors == [f"error: no prompt in {prompts} fits the model's context of 512 tokens"]
    assert not (tmp_path / "b.json").exists()


def test_cli_cost_curve_line_only_where_ptp_ran(tiny_model_dir, adapter_dir, prompt_file, tmp_path, capsys):
    # An ar-only bench printed "cost curve in use (..., moved 1.00x by 0 measured calls)", which said nothing.
    for methods, shown in (("ar", False), ("ar,ptp", True)):
        argv = _argv(tiny_model_dir, adapter_dir, prompt_file, tmp_path, "--limit", "1", "--methods", methods)
        assert cli.main([*argv, "--no-cost-curve"]) == 0
        assert ("cost curve in use" in capsys.readouterr().out) == shown, methods
