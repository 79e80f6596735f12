"""The prepared GPU job (scripts/gpu_job.sh) end to end on the CPU at toy scale: shards joined and checked,
the reference check, generation, training, export in small files, the bench; then the adapter rebuilt here."""

import json
import os
import subprocess
import sys
from pathlib import Path

from ptp_mlx.testing import make_tiny_model
from ptp_mlx.train import gpu_job

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_job_dry_run(tmp_path, tiny):
    from ptp_mlx.adapter import load_adapter
    from ptp_mlx.train.pregenerate import pregenerate

    model_dir = make_tiny_model(tmp_path / "tiny")
    model, tok = tiny
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"q-{i}", "turns": [f"count {i} {i}"]}) for i in range(1, 8)))
    val = tmp_path / "val.jsonl"
    pregenerate(model, tok, prompts, val, n=2, max_new=10, split="val")
    ref = tmp_path / "ref.npz"
    gpu_job.reference_logits(str(model_dir), ref)
    stage = tmp_path / ".stage"
    shards = gpu_job.stage({"prompts/p.jsonl": prompts, "val.jsonl": val, "ref.npz": ref}, stage, shard_mib=0.01)
    assert len(shards) >= 2  # the join is exercised

    out = tmp_path / "out"
    args = (
        f"--model {model_dir} --init none --per-prompt 3 --max-tokens 8 --batch-prompts 2 --gen-seconds 30 "
        "--train-minutes 0.03 --eval-minutes 0.01 --rows-per-step 64 --micro-rows 32 --rank 4 --deadline 300 "
        f"--reserve-seconds 1 --bench --bench-tokens 6 --bench-prompts {prompts}"
    )
    env = {
        **os.environ, "STAGE": str(stage), "WORK": str(tmp_path / "work"), "OUT": str(out), "PYTHON": sys.executable,
        "PTP_JOB_NO_INSTALL": "1", "PTP_JOB_ARGS": args, "PTP_MLX_HOME": str(tmp_path / "home"),
    }  # fmt: skip
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_job.sh"), "run"], env=env, capture_output=True, text=True)
    log = (out / "run.txt").read_text() if (out / "run.txt").exists() else ""
    assert r.returncode == 0, r.stderr[-3000:] + log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["check"]["argmax_agreement"] == 1.0
    assert summary["pregenerate"]["completions"] == 6 * 3  # the train split of 7 prompts, 3 each
    assert summary["train"]["evals"] and summary["train"]["steps"] >= 1
    assert {b["rc"] for b in summary["bench"].values()} == {0}
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all((out / f).stat().st_size < 16 * 2**20 for f in files)
    assert "mlx-lm" in (out / "bench.txt").read_text()
    # issue 23's GPU bench from the same staging: bench only, greedy and sampled, with the trained adapter
    out2 = tmp_path / "out2"
    env2 = {**env, "OUT": str(out2), "PTP_JOB_ARGS": f"--model {model_dir} --init {tmp_path / 'work' / 'run' / 'best'} "
            f"--bench-only --bench-sampled --bench-tokens 6 --bench-prompts {prompts}"}  # fmt: skip
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_job.sh"), "run"], env=env2, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    s2 = json.loads((out2 / "summary.json").read_text())
    assert set(s2["bench"]) == {"greedy", "t07", "profile"} and {b["rc"] for b in s2["bench"].values()} == {0}
    assert "pregenerate" not in s2 and (out2 / "bench-t07.json").is_file()
    # issue 29's compiled-call check from the same staging, shrunk (one sweep shape, 30 calls)
    out3 = tmp_path / "out3"
    env3 = {**env, "OUT": str(out3), "PTP_JOB_ARGS": f"--model {model_dir} --init {tmp_path / 'work' / 'run' / 'best'} "
            f"--compiled-check --bench-tokens 6 --bench-prompts {prompts} --sweep-sizes 135m --stress-calls 30"}  # fmt: skip
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_job.sh"), "run"], env=env3, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    s3 = json.loads((out3 / "summary.json").read_text())["compiled_check"]
    assert len(s3) == 13 and {v["rc"] for v in s3.values()} == {0}, s3
    assert "every answer identical to AR" in (out3 / "compiled-check.txt").read_text()  # (trees-vs-sibling)
    assert "bench-greedy-fixed3" in s3  # the fixed budget's chained calls on the held-out prompts
    figs = json.loads((out3 / "compiled-check.json").read_text())
    assert figs["profile-compiled-cudnn1"]["profile"]["compiled"] is True
    assert figs["profile-eager-cudnn0"]["profile"]["compiled"] is False
    assert "profile-issue40" in figs  # (issue 40's own profile command, held-out prompt 1)
    assert "135m" in figs["cost-sweep"]["cost_sweep"] and len(list(out3.iterdir())) <= 8
    text = (out3 / "compiled-check.txt").read_text()
    assert "calls," in text and "compile bank" in text and "every PTP shape == ar" in text
    assert "ptp-bench --cost-sweep | Device(cpu" in text and " | blas " in text  # (what priced the rows)
    gpu_job.join(out, tmp_path / "adapter")
    adapter, cfg = load_adapter(tmp_path / "adapter", model)
    assert cfg.raw["cdf_order"] == "prob" and cfg.raw["training"]["slot_weights"] == "decay:0.7"


def test_gpu_job_refuses_missing_or_corrupt_shards(tmp_path):
    f = tmp_path / "x.txt"
    f.write_bytes(os.urandom(200_000))
    stage = tmp_path / ".stage"
    gpu_job.stage({"x.txt": f}, stage, shard_mib=0.1)
    env = {**os.environ, "STAGE": str(stage), "WORK": str(tmp_path / "w"), "OUT": str(tmp_path / "o")}
    env["PYTHON"] = sys.executable
    (stage / "p2" / "part").write_bytes(b"garbage")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_job.sh"), "run"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "corrupt" in r.stderr
    (stage / "p2" / "part").unlink()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_job.sh"), "run"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "p2 is missing" in r.stderr
