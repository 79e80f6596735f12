"""Bad flags and paths for ``ptp-convert``, refused before any file is read (no torch needed): quantization
settings MLX cannot use, flags that only work with another, a folder given as a file, and a failed conversion
that must not leave the parent folders it made."""

from __future__ import annotations

import json

import pytest
from ptp_mlx.convert.cli import main as cli_main

from ptp_mlx.errors import UserError


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A scratch folder as the working directory, with a Hugging Face-looking folder that has no weights."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hfm").mkdir()
    (tmp_path / "hfm" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "trunc.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    return tmp_path


def error_line(capsys, args: list[str]) -> str:
    rc = cli_main(args)
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and out == "" and len(errors) == 1, err
    return errors[0]


STARTING = ["emptydir", "hfm", "trunc.gguf"]


@pytest.mark.parametrize(
    "flags, msg",
    [
        (["--quantize", "--q-bits", "0"], "--q-bits must be one of 2, 3, 4, 5, 6, 8, got 0"),
        (["--quantize", "--q-bits", "7"], "--q-bits must be one of"),
        (["--quantize", "--q-group-size", "7"], "--q-group-size must be one of 32, 64, 128, got 7"),
        (["--quantize", "--q-group-size", "0"], "--q-group-size must be one of"),
        (["--q-bits", "4"], "--q-bits needs --quantize"),
        (["--q-group-size", "64"], "--q-group-size needs --quantize"),
    ],
)
def test_hf_quantization_flags_are_checked_first(work, capsys, flags, msg):
    # (hfm has no weights: a check made after reading the folder would say "no weights" instead)
    assert msg in error_line(capsys, ["hf", "hfm", "--out", "deep/h5", *flags])
    assert sorted(p.name for p in work.iterdir()) == STARTING


def test_convert_hf_refuses_zero_bits(work):
    from ptp_mlx.convert.hf import convert_hf

    with pytest.raises(UserError, match="--q-bits"):
        convert_hf(work / "hfm", work / "out", quantize_bits=0)
    assert not (work / "out").exists()


@pytest.mark.parametrize("command", ["gguf", "ptp"])
def test_quantization_flags_belong_to_hf(work, capsys, command):
    with pytest.raises(SystemExit) as e:  # (argparse's usage error: one line, exit 2)
        cli_main([command, "trunc.gguf", "--out", "o", "--q-bits", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: unrecognized arguments: --q-bits") and err.count("\n") == 1


@pytest.mark.parametrize(
    "args, msg",
    [
        (["gguf", "trunc.gguf", "--out", "deep2/a/m"], "cannot read GGUF"),
        (["hf", "hfm", "--out", "deep3/a/m"], "no weights in hfm"),
        (["hf", "hfm", "--out", "hfm/new/m"], "no weights in hfm"),
    ],
)
def test_failed_convert_leaves_no_new_parent_folders(work, capsys, args, msg):
    assert msg in error_line(capsys, args)
    assert sorted(p.name for p in work.iterdir()) == STARTING
    assert [p.name for p in (work / "hfm").iterdir()] == ["config.json"]  # an existing parent stays as it was


@pytest.mark.parametrize(
    "command, msg",
    [("gguf", "emptydir is a folder, not a GGUF file"), ("ptp", "emptydir is a folder, not a checkpoint")],
)
def test_a_folder_is_not_a_file(work, capsys, command, msg):
    assert msg in error_line(capsys, [command, "emptydir", "--out", "o"])
    assert not (work / "o").exists()
