"""Data-parallel training under ``mlx.launch`` (ring backend on localhost): two processes, each with its slice of
every step, give the same adapter as one process with the same global batch."""

import json
import os
import socket
import subprocess
import sys

import mlx.core as mx
import pytest

from ptp_mlx.testing import make_tiny_model

LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"


def _free_port_pair() -> int:
    """A starting port whose next one is free too (the ring backend listens on port, port + 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p > 65000:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def _teacher(model_dir, tmp_path):
    import mlx_lm

    from ptp_mlx.sampler import SamplingSettings
    from ptp_mlx.train.pregenerate import pregenerate

    model, tok = mlx_lm.load(str(model_dir))
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"id": f"p-{i}", "turns": [f"say {i} " * (i + 2)]}) for i in range(6)))
    out = tmp_path / "teacher.jsonl"
    pregenerate(model, tok, f, out, n=2, sampling=SamplingSettings(0.9, 0, 1.0), max_new=12, split="all")
    return out


@pytest.mark.parametrize("family", ["qwen3"])
def test_two_processes_equal_one(tmp_path, family):
    model_dir = make_tiny_model(tmp_path / "m", family=family)
    teacher = _teacher(model_dir, tmp_path)
    common = [
        "-m", "ptp_mlx.train.cli", "train", "--model", str(model_dir), "--data", str(teacher),
        "--steps", "4", "--rank", "4", "--alpha", "8", "--window", "4", "--windows-per-seq", "3",
        "--seqs-per-step", "5", "--micro-rows", "24", "--warmup", "1", "--lr", "2e-3", "--save-every", "100",
        "--cdf-order", "prob", "--slot-weights", "decay:0.7",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    one = subprocess.run(
        [sys.executable, *common, "--run", str(tmp_path / "one"), "--out", str(tmp_path / "one.ad")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-2000:]
    launch = [sys.executable, "-c", LAUNCH, "-n", "2", "--backend", "ring", "-p", str(_free_port_pair()), "--"]
    two = subprocess.run(
        [*launch, sys.executable, *common, "--run", str(tmp_path / "two"), "--out", str(tmp_path / "two.ad")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-2000:]
    a = mx.load(str(tmp_path / "one.ad" / "adapter.safetensors"))
    b = mx.load(str(tmp_path / "two.ad" / "adapter.safetensors"))
    assert a.keys() == b.keys()
    worst = max((mx.abs(a[k] - b[k]).max().item(), k) for k in a)
    assert worst[0] < 1e-5, worst
    # the steps really moved the weights (the comparison is not between two untouched initialisations)
    init = [k for k in a if k.endswith(".B")]
    assert init and any(mx.abs(a[k]).max().item() > 1e-4 for k in init)
    # process 0 alone wrote the log: one line per step
    log = [json.loads(x) for x in (tmp_path / "two" / "train.log").read_text().splitlines()]
    assert [r["step"] for r in log if "step" in r] == [1, 2, 3, 4]
    one_log = [json.loads(x) for x in (tmp_path / "one" / "train.log").read_text().splitlines()]
    for r1, r2 in zip(one_log, log, strict=True):
        assert abs(r1["loss"] - r2["loss"]) < 1e-3  # rows differ: each process pads its own slice
