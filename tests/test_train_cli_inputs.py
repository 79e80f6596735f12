"""ptp-train's bad flags: one ``error:`` line naming the flag, exit code 2, checked before any work, and nothing
left behind (no run folder, no output file). Fast: no case trains."""

import argparse
import json

import pytest

from ptp_mlx.train.cli import build_parser, main

GREEDY = {"tokens": list(range(3, 15)), "start": 2, "left": [0.0] * 10, "right": [1.0] * 10, "greedy": True}


def _one_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert all(w in err[0] for w in words), err
    assert len(err[0]) < 200, err  # one readable line, not a dump
    return err[0]


@pytest.fixture
def train_argv(tiny_model_dir, tmp_path):
    """A small valid ``train`` command (one short step); a case appends one bad flag, which wins."""
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps(GREEDY) + "\n")
    return [
        "train", "--model", str(tiny_model_dir), "--data", str(data), "--run", str(tmp_path / "r"),
        "--steps", "1", "--window", "2", "--windows-per-seq", "1", "--seqs-per-step", "1", "--rank", "2",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "flags",
    [
        ["--steps", "0"],
        ["--steps", "-1"],
        ["--lr", "nan"],
        ["--lr", "0"],
        ["--lr", "inf"],
        ["--minutes", "-1"],
        ["--minutes", "nan"],
        ["--eval-minutes", "0"],
        ["--rank", "0"],
        ["--window", "0"],
        ["--eval-window", "0"],
        ["--alpha", "nan"],
        ["--weight-decay", "-1"],
        ["--warmup", "-1"],
        ["--save-every", "0"],
        ["--eval-every", "0"],
        ["--eval-seqs", "0"],
        ["--windows-per-seq", "0"],
        ["--seqs-per-step", "0"],
        ["--rows-per-step", "0"],
        ["--micro-rows", "0"],
        ["--reload-every", "-1"],
        ["--seed", "-1"],
        ["--layers", "garbage"],
        ["--layers", "last:0"],
        ["--layers", "0,-1"],
        ["--targets", "q_proj,"],
        ["--slot-weights", "decay:x"],
    ],
)
def test_train_refuses_bad_numbers_before_any_work(train_argv, tmp_path, capsys, flags):
    assert main([*train_argv, *flags]) == 2
    _one_error(capsys, flags[0])
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--layers", "last:999"], ["--layers last:999: the model has 2 layers"]),
        (["--layers", "0,7"], ["--layers 0,7: the model has 2 layers"]),
        (["--targets", "nope_proj"], ["nope_proj"]),
        (["--slot-weights", "0,0"], ["--slot-weights"]),
    ],
)
def test_train_checks_against_the_model_leave_no_run_folder(train_argv, tmp_path, capsys, flags, words):
    """Refused once the model is known (its layer count, its projections): still one short line, no folder."""
    assert main([*train_argv, *flags]) == 2
    _one_error(capsys, *words)
    assert not (tmp_path / "r").exists()


def test_train_init_without_an_adapter_leaves_no_run_folder(train_argv, tmp_path, capsys):
    assert main([*train_argv, "--init", str(tmp_path / "no-adapter")]) == 2
    _one_error(capsys, "--init")
    assert not (tmp_path / "r").exists()


def test_train_resume_needs_a_checkpoint(train_argv, tmp_path, capsys):
    """--resume with no run folder, or one without a checkpoint, is refused instead of starting afresh."""
    assert main([*train_argv, "--resume"]) == 2
    _one_error(capsys, "--resume: no checkpoint in", str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()
    (tmp_path / "r").mkdir()
    assert main([*train_argv, "--resume"]) == 2
    _one_error(capsys, "--resume: no checkpoint in")
    assert list((tmp_path / "r").iterdir()) == []


def test_train_run_that_is_a_file_is_refused(train_argv, tmp_path, capsys):
    (tmp_path / "r").write_text("not a folder")
    assert main(train_argv) == 2
    _one_error(capsys, "--run", "not a folder")


@pytest.mark.parametrize("limit", ["0", "-3"])
def test_pregenerate_limit_must_be_positive(tiny_model_dir, tmp_path, capsys, limit):
    prompts = tmp_path / "pr.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "turns": ["hi"]}) + "\n" for i in (1, 2, 3, 4, 6)))
    out = tmp_path / "t.jsonl"
    argv = ["pregenerate", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--out", str(out)]
    assert main([*argv, "--max-tokens", "2", "--per-prompt", "1", "--limit", limit]) == 2
    _one_error(capsys, "--limit must be at least 1")
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["pregenerate", "--prompts", "p.jsonl", "--out", "o.jsonl", "--seed", "-1"], ["--seed"]),
        (["pregenerate", "--prompts", "p.jsonl", "--out", "o.jsonl", "--per-prompt", "0"], ["--per-prompt"]),
        (["corpus", "--out", "o.jsonl", "--no-stdlib", "--limit", "0"], ["--limit"]),
        (["corpus", "--out", "o.jsonl", "--no-stdlib", "--max-tokens", "0"], ["--max-tokens"]),
        (["eval", "--adapter", "a", "--val", "v.jsonl", "--window", "0"], ["--window"]),
        (["eval", "--adapter", "a", "--val", "v.jsonl", "--seed", "-2"], ["--seed"]),
        (["prompts", "--out", "pr2.jsonl", "--math", "-5"], ["--math must be at least 0"]),
        (["prompts", "--out", "."], ["--out .: is a folder"]),  # (it failed after the work, with the temp's name)
    ],
)
def test_other_subcommands_refuse_bad_counts(tiny_model_dir, tmp_path, monkeypatch, capsys, argv, words):
    monkeypatch.chdir(tmp_path)
    model = [] if argv[0] == "prompts" else ["--model", str(tiny_model_dir)]
    assert main([*argv, *model]) == 2
    _one_error(capsys, *words)
    assert list(tmp_path.iterdir()) == []  # no output file, nothing else


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--minutes", "nan"], ["--minutes"]),
        (["--rank", "0"], ["--rank must be at least 1"]),
        (["--steps", "0"], ["--steps must be at least 1"]),
        (["--seed", "-1"], ["--seed"]),
    ],
)
def test_auto_refuses_bad_numbers_before_loading(tmp_path, capsys, flags, words):
    run = tmp_path / "run"
    assert main(["auto", "--model", str(tmp_path / "no-model"), "--run", str(run), *flags]) == 2
    _one_error(capsys, *words)
    assert not run.exists()


def test_every_option_has_help_and_shows_its_default(capsys):
    """docs/conventions.md: "--help shows every option with its default" (flags without a value excepted)."""
    from ptp_mlx.cli_common import HelpFormatter

    fmt = HelpFormatter("ptp-train")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, p in sub.choices.items():
        for a in p._actions:
            if not a.option_strings or a.nargs == 0 or a.required:
                continue  # -h, store_true flags, required ones
            text = fmt._get_help_string(a)
            if not a.help or "default" not in text:
                missing.append(f"{name} {a.option_strings[0]}")
    assert missing == []
    with pytest.raises(SystemExit):
        main(["prompts", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--seed SEED seed of" in out and "(default: 0)" in out
