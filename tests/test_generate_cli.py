"""``ptp-generate`` on a tiny model: the text alone on stdout, one fixed-format summary line on stderr (plus the
acceptance histogram with an adapter), and one ``error:`` line with exit code 2 for bad input."""

import io
import re
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from ptp_mlx.adapter import make_config, save_adapter
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.generate_cli import main
from ptp_mlx.model.ptp import PTPAdapter, PTPModel
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import SamplingSettings
from ptp_mlx.testing import save_random_adapter

SUMMARY = re.compile(
    r"^prompt \d+\.\d tok/s \| generation \d+\.\d tok/s \| mean accepted \d+\.\d\d tokens/call \| "
    r"peak memory \d+\.\d\d GB$"
)
# The sources' suffix appears once any call verified drafts (the adaptive budget's choice depends on this
# machine's measured cost curve, so a run may draft or not).
HISTOGRAM = re.compile(r"^accepted per call \(tokens:calls\)( \d+:\d+)+( \| accepted drafts by source: .+)?$")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """A copy of the tiny model with larger random weights, so its answers are varied text."""
    out = tmp_path_factory.mktemp("cli") / "model"
    shutil.copytree(tiny_model_dir, out)
    model, _ = mlx_lm.load(str(out))
    mx.random.seed(0)
    w = {}
    for k, v in tree_flatten(model.parameters()):
        scale = 1.0 if k.endswith("embed_tokens.weight") else 2.0 / np.sqrt(v.shape[-1])
        w[k] = mx.random.normal(v.shape) * scale if v.ndim == 2 else v
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    return out


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    return save_random_adapter(model_dir, tmp_path_factory.mktemp("cli") / "adapter")


def expected_text(model_dir, prompt: str, s: SamplingSettings, max_tokens: int) -> str:
    model, tok = mlx_lm.load(str(model_dir))
    steps = stream_generate(
        PTPModel(model), tok, encode_prompt(tok, prompt), DecodeOptions(max_tokens=max_tokens, sampling=s)
    )
    return "".join(st.text for st in steps)


def cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err.splitlines()


def test_stdout_holds_only_the_text(model_dir, capsys):
    rc, out, err = cli(
        capsys,
        "--model",
        model_dir,
        "--prompt",
        "hello there",
        "--max-tokens",
        12,
        "--temp",
        0.7,
        "--top-k",
        20,
        "--seed",
        3,
    )
    assert rc == 0
    want = expected_text(model_dir, "hello there", SamplingSettings(0.7, 20, 1.0, 3), 12)
    assert want.strip() and out == want + "\n"
    assert SUMMARY.match(err[-1]), err
    assert "mean accepted 1.00 tokens/call" in err[-1]  # autoregressive: one token per call
    assert not any(line.startswith("error:") or HISTOGRAM.match(line) for line in err)


def test_adapter_prints_histogram_and_same_text(model_dir, adapter_dir, capsys):
    args = ["--model", model_dir, "--prompt", "The quick brown fox", "--max-tokens", 16, "--temp", 1.0, "--seed", 5]
    rc, ptp_out, err = cli(capsys, *args, "--adapter", adapter_dir)
    assert rc == 0
    assert SUMMARY.match(err[-2]) and HISTOGRAM.match(err[-1]), err
    hist = {int(k): int(v) for k, v in (p.split(":") for p in err[-1].split(" | ")[0].split(") ")[1].split())}
    mean = float(re.search(r"mean accepted (\S+)", err[-2]).group(1))
    assert mean == pytest.approx(sum(k * v for k, v in hist.items()) / sum(hist.values()), abs=0.006)
    # Lossless at the command line too: the same seed gives the same text with and without PTP.
    rc, ar_out, err = cli(capsys, *args, "--adapter", adapter_dir, "--mode", "ar")
    assert rc == 0 and ar_out == ptp_out and not HISTOGRAM.match(err[-1])
    rc, blocks, _ = cli(capsys, *args, "--adapter", adapter_dir, "--show-blocks", "--step", "simple")
    assert rc == 0 and blocks.count("|") >= 1 and blocks.replace("|", "") == ptp_out


def test_prompt_from_stdin(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there"))
    rc, out, _ = cli(capsys, "--model", model_dir, "--prompt", "-", "--max-tokens", 6)
    assert rc == 0 and out == expected_text(model_dir, "hello there", SamplingSettings(), 6) + "\n"


def test_no_chat_template(model_dir, capsys):
    rc, out, err = cli(capsys, "--model", model_dir, "--prompt", "abc", "--max-tokens", 5, "--no-chat")
    model, tok = mlx_lm.load(str(model_dir))
    steps = stream_generate(PTPModel(model), tok, list(tok.encode("abc")), DecodeOptions(max_tokens=5))
    assert rc == 0 and out == "".join(st.text for st in steps) + "\n" and SUMMARY.match(err[-1])


def test_an_answer_cut_by_the_context_says_so(model_dir, capsys):
    # The tiny model's context is 512 tokens: a 500-byte prompt leaves room for 12, not the 100 asked for.
    rc, out, err = cli(
        capsys, "--model", model_dir, "--prompt", "x" * 500, "--no-chat", "--max-tokens", 100, "--temp", 1
    )
    assert rc == 0 and "notice: the answer stopped at the model's context of 512 tokens" in err
    rc, out, err = cli(capsys, "--model", model_dir, "--prompt", "x" * 100, "--no-chat", "--max-tokens", 10)
    assert rc == 0 and not any(line.startswith("notice:") for line in err)


# name -> (argv given the model folder ``m``, another model's adapter ``o`` and a scratch folder ``t``; message)
BAD = {
    "missing model folder": (lambda m, o, t: ["--model", t / "missing", "--prompt", "hi"], "model folder not found"),
    "not a model folder": (lambda m, o, t: ["--model", t, "--prompt", "hi"], "not an MLX model folder"),
    # (PTP's family check read no config there and said "model type None is not supported for PTP")
    "not a model folder, ptp": (
        lambda m, o, t: ["--model", t, "--prompt", "hi", "--mode", "ptp", "--adapter", o],
        "not an MLX model folder",
    ),
    "a file for a model": (
        lambda m, o, t: ["--model", o / "adapter_config.json", "--prompt", "hi", "--mode", "ptp", "--adapter", o],
        "not an MLX model folder",
    ),
    "over-long prompt": (
        lambda m, o, t: ["--model", m, "--prompt", "x" * 600],
        r"prompt is \d+ tokens but the model's context is 512",
    ),
    "negative temp": (lambda m, o, t: ["--model", m, "--prompt", "hi", "--temp", -1], "temperature must be >= 0"),
    "nan temp": (lambda m, o, t: ["--model", m, "--prompt", "hi", "--temp", "nan"], "temperature"),
    "inf temp": (
        lambda m, o, t: ["--model", m, "--prompt", "hi", "--temp", "inf"],
        "temperature must be >= 0 and finite",
    ),
    "huge seed": (lambda m, o, t: ["--model", m, "--prompt", "hi", "--seed", 2**64], "below 2\\*\\*63"),
    "top-p zero": (lambda m, o, t: ["--model", m, "--prompt", "hi", "--top-p", 0], "top_p must be in"),
    "top-k negative": (lambda m, o, t: ["--model", m, "--prompt", "hi", "--top-k", -2], "top_k must be >= 0"),
    "max-tokens zero": (
        lambda m, o, t: ["--model", m, "--prompt", "hi", "--max-tokens", 0],
        "--max-tokens must be at least 1",
    ),
    "negative seed": (lambda m, o, t: ["--model", m, "--prompt", "hi", "--seed", -1], "--seed must be a non-negative"),
    "empty prompt": (lambda m, o, t: ["--model", m, "--prompt", ""], "the prompt is empty"),
    "all-space prompt": (lambda m, o, t: ["--model", m, "--prompt", "  \n "], "the prompt is empty"),
    "system without template": (
        lambda m, o, t: ["--model", m, "--prompt", "hi", "--system", "be brief", "--no-chat"],
        "--system needs the chat template",
    ),
    "missing adapter": (
        lambda m, o, t: ["--model", m, "--prompt", "hi", "--adapter", t / "nope"],
        "adapter folder not found",
    ),
    "draft budget without ptp": (
        lambda m, o, t: ["--model", m, "--prompt", "hi", "--num-draft-tokens", 2],
        "--num-draft-tokens sets PTP's draft budget",
    ),
    "ptp without adapter": (
        lambda m, o, t: ["--model", m, "--prompt", "hi", "--mode", "ptp"],
        "PTP mode needs an adapter",
    ),
    "ptp with adapter none": (
        lambda m, o, t: ["--model", m, "--prompt", "hi", "--mode", "ptp", "--adapter", "none"],
        "needs an adapter",
    ),
    "adapter of another model": (
        lambda m, o, t: ["--model", m, "--prompt", "hi", "--adapter", o],
        "another base model",
    ),
}


@pytest.fixture(scope="module")
def other_adapter(tiny, tmp_path_factory):
    model = tiny[0]
    ad = PTPAdapter(model, 4, 1.0, "binary")
    out = tmp_path_factory.mktemp("cli") / "other-adapter"
    save_adapter(ad, make_config(model, ad, 4, 1.0, window=4), out)
    return out


@pytest.mark.parametrize("case", BAD)
def test_bad_input_one_error_line_exit_2(model_dir, other_adapter, tmp_path, capsys, case):
    argv, message = BAD[case]
    rc, out, err = cli(capsys, *argv(model_dir, other_adapter, tmp_path))
    assert rc == 2
    assert out == ""  # nothing half-written on stdout
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(message, err[0]), err


def test_argparse_errors_exit_2(model_dir, capsys):
    for argv in (["--model", model_dir], ["--prompt", "hi", "--temp", "abc"], ["--prompt", "hi", "--step", "x"]):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in argv])
        assert e.value.code == 2
        assert "error:" in capsys.readouterr().err


def test_console_script_streams(model_dir):
    """As a process (imports and library warnings included), stdout holds the answer alone."""
    cmd = [
        sys.executable,
        "-m",
        "ptp_mlx.generate_cli",
        "--model",
        str(model_dir),
        "--prompt",
        "hello there",
        "--max-tokens",
        "8",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected_text(model_dir, "hello there", SamplingSettings(), 8) + "\n"
    assert SUMMARY.match(r.stderr.splitlines()[-1])
