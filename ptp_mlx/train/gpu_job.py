"""One distillation run on a borrowed CUDA GPU machine (no MLX, no network, 64 MiB per transfer).

``stage`` (here, with the registries at hand) packs what that machine lacks: the ``mlx``, ``mlx-cuda-13`` and
``mlx-lm`` wheels, the default model's GGUF, the training prompts, the held-out teacher file and reference logits
of the teacher computed here. The pack is split into shards, one folder each (``.stage/p1``, ``.stage/p2``, ...),
so each transfer carries one. ``scripts/gpu_job.sh`` on the GPU machine joins and checks them, installs the wheels
and runs ``run``: check that MLX runs on the GPU, that the teacher's logits match the reference, and that a PTP
training step runs; generate the model's own completions (1 greedy + N sampled per prompt) for a time budget;
train from the shipped adapter for a time budget, validating every minute; write the best adapter (in files under
16 MiB) and the logs; optionally bench mlx-lm, ar and ptp on the GPU. ``tests/test_gpu_job.py`` runs the same
script end to end on the CPU at toy scale.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

WHEELS = ("mlx==0.32.4", "mlx-cuda-13==0.32.4", "mlx-lm==0.32.2", "platformdirs==4.5.0")
REF_PROMPT = "Explain in two sentences why the sky is blue."


def _log(out: Path, msg: str) -> None:
    """One timestamped line on stderr (scripts/gpu_job.sh keeps the whole stream in ``run.txt``)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- here: stage -------------------------------------------------------------------------------------------


def reference_logits(model_dir: str | None, out: Path) -> None:
    """Teacher logits of the reference prompt, computed here (float32, CPU), for the GPU's check."""
    import mlx.core as mx
    import numpy as np

    from ..models import load
    from ..prompt import encode_prompt

    model, tok = load(model_dir)
    ids = encode_prompt(tok, REF_PROMPT)
    logits = model(mx.array(ids)[None])[0, -16:].astype(mx.float32)  # the last 16 positions: 3 MB
    np.savez(out, ids=np.array(ids, np.int32), logits=np.array(logits))


def stage(files: dict[str, Path], out: Path, shard_mib: float = 40.0) -> list[Path]:
    """Pack ``files`` (name in the pack -> path here) into one tar split into shard folders under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "pack.tar"
        with tarfile.open(tar, "w") as t:
            for name, path in files.items():
                t.add(str(path), arcname=name)
        data = tar.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    size = int(shard_mib * 2**20)
    shards = []
    for k, i in enumerate(range(0, len(data), size), 1):
        d = out / f"p{k}"
        d.mkdir(exist_ok=True)
        (d / "part").write_bytes(data[i : i + size])
        shards.append(d)
    n = len(shards)
    (out / "p1" / "manifest.json").write_text(json.dumps({"shards": n, "sha256": digest, "bytes": len(data)}))
    return shards


def stage_default(out: Path, prompts: list[Path], val: Path, shard_mib: float) -> list[Path]:
    """Download the wheels, find the default model's GGUF, compute reference logits, and ``stage`` it all."""
    from ..models import default_gguf

    wheels = out.with_name(out.name + "-wheels")
    wheels.mkdir(parents=True, exist_ok=True)
    plat = [x for n in (17, 27, 28, 35) for x in ("--platform", f"manylinux_2_{n}_x86_64")]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version"]
    subprocess.run([*cmd, "3.12", "--implementation", "cp", *plat, "-d", str(wheels), *WHEELS], check=True)
    ref = out.with_name(out.name + "-ref.npz")
    reference_logits(None, ref)
    files = {f"wheels/{w.name}": w for w in sorted(wheels.glob("*.whl"))}
    files["SmolLM2-135M-Instruct.Q4_1.gguf"] = default_gguf()
    files.update({f"prompts/{p.name}": p for p in prompts})
    files["val.jsonl"] = val
    files["ref.npz"] = ref
    return stage(files, out, shard_mib)


# ---- there: run --------------------------------------------------------------------------------------------


def check(model, work: Path, out: Path) -> dict:
    """The GPU runs MLX, the teacher's logits match the reference, and one PTP training step is finite."""
    import mlx.core as mx
    import numpy as np

    info = {"device": str(mx.default_device())}
    try:  # the accelerator's own name where MLX reports it
        info["device_name"] = mx.device_info().get("device_name")
    except (AttributeError, RuntimeError):
        pass
    ref = np.load(work / "ref.npz")
    got = np.array(model(mx.array(ref["ids"])[None])[0, -16:].astype(mx.float32))
    diff = float(np.abs(got - ref["logits"]).max())
    agree = float((got.argmax(-1) == ref["logits"].argmax(-1)).mean())
    info.update(logit_max_abs_diff=diff, argmax_agreement=agree)
    _log(out, f"check: device {info['device']}; teacher logits max |diff| {diff:.2e}, argmax agreement {agree:.3f}")
    # A GPU's float32 matmuls round differently (TF32 or another summation order): logits move by ~1e-3, and an
    # argmax can flip only at a near-tie. A wrong model or broken kernels move them by whole units.
    if agree < 0.85 or diff > 0.5:
        raise SystemExit(f"check failed: the teacher's logits do not match the reference ({info})")
    return info


def run(a: argparse.Namespace) -> int:
    import mlx.core as mx

    from ..gguf import convert_gguf
    from ..models import load
    from ..paths import shipped_adapters_dir
    from .data import read_prompts, read_records
    from .pregenerate import pregenerate
    from .train import add_train_args, train_from_args

    t_start = time.perf_counter()
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"args": vars(a)}
    _log(out, f"job starts: MLX {mx.__version__}, default device {mx.default_device()}")
    model_dir = a.model
    if model_dir is None:  # the default model from its GGUF, float32: exactly the CPU's default model
        model_dir = str(work / "model-f32")
        if not Path(model_dir).exists():
            convert_gguf(work / "SmolLM2-135M-Instruct.Q4_1.gguf", Path(model_dir), dtype="float32", overwrite=True)
    model, tok = load(model_dir)
    summary["check"] = check(model, work, out)
    if a.bench_only or a.compiled_check:  # GPU benches of the shipped (or --init) adapter, no training
        adapter = Path(a.init) if a.init not in (None, "none") else shipped_adapters_dir() / "SmolLM2-135M-Instruct"
        if a.compiled_check:  # issue 29's check (ptp_mlx/train/gpu_check.py)
            from .gpu_check import compiled_check

            prompts = a.bench_prompts or Path(__file__).resolve().parent.parent / "data" / "heldout_prompts.jsonl"
            bench_model = _bench_model(work, model_dir, a)
            # (issue 40's profile at its own 128 tokens; a dry run's few tokens shrink it too)
            summary["compiled_check"] = compiled_check(
                work, out, adapter, bench_model, prompts, a.bench_tokens, a.sweep_sizes, a.stress_calls,
                profile_tokens=128 if a.bench_tokens >= 64 else a.bench_tokens,
            )  # fmt: skip
        else:
            summary["bench"] = bench(work, out, adapter, _bench_model(work, model_dir, a), a)
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        _log(out, f"job done in {time.perf_counter() - t_start:.0f} s")
        return 0

    # 1. the model's own completions, over the train split of every prompt file
    teacher = work / "teacher.jsonl"
    prompts = sorted((work / "prompts").glob("*.jsonl"))
    n_prompts = sum(len(read_prompts(p, "train")) for p in prompts)
    _log(out, f"pregenerate: {n_prompts} train prompts x {a.per_prompt} completions, {a.gen_seconds:.0f} s budget")
    t0 = time.perf_counter()
    deadline = t0 + a.gen_seconds
    from ..sampler import SamplingSettings

    for p in prompts:
        pregenerate(
            model,
            tok,
            p,
            teacher,
            n=a.per_prompt,
            sampling=SamplingSettings(0.7, 50, 0.95),
            max_new=a.max_tokens,
            split="train",
            batch_prompts=a.batch_prompts,
            seed=a.seed,
            deadline=deadline,
        )
    recs = read_records(teacher)
    gen_s = time.perf_counter() - t0
    toks = sum(len(r["tokens"]) - r["start"] for r in recs)
    summary["pregenerate"] = {"completions": len(recs), "tokens": toks, "seconds": round(gen_s, 1)}
    _log(out, f"pregenerate: {len(recs)} completions, {toks} tokens in {gen_s:.0f} s ({toks / gen_s:.0f} tok/s)")

    # 2. training from the shipped adapter, validated every minute on the held-out file
    left = a.deadline - (time.perf_counter() - t_start) - a.reserve_seconds
    minutes = max(0.05, min(a.train_minutes, left / 60))
    p = argparse.ArgumentParser()
    add_train_args(p)
    init = a.init or str(shipped_adapters_dir() / "SmolLM2-135M-Instruct")
    targs = [
        "--model", model_dir, "--data", str(teacher), "--val", str(work / "val.jsonl"), "--run", str(work / "run"),
        "--rank", str(a.rank), "--alpha", str(2 * a.rank), "--window", "8", "--windows-per-seq", "16",
        "--rows-per-step", str(a.rows_per_step), "--micro-rows", str(a.micro_rows), "--minutes", f"{minutes:.3f}",
        "--eval-minutes", str(a.eval_minutes), "--eval-seqs", "100000", "--steps", "100000", "--lr", str(a.lr),
        "--warmup", "10", "--cdf-order", "prob", "--slot-weights", "decay:0.7", "--save-every", "100000",
        "--seed", str(a.seed),
    ]  # fmt: skip
    if init != "none":
        targs += ["--init", init]
    _log(out, f"train: {minutes:.2f} min, {a.rows_per_step} rows a step, from {init}")
    targs_ns = p.parse_args(targs)
    train_from_args(targs_ns)
    best = work / "run" / "best"
    log_lines = [json.loads(x) for x in (work / "run" / "train.log").read_text().splitlines()]
    evals = [x["eval"] for x in log_lines if "eval" in x]
    summary["train"] = {"evals": evals, "steps": sum(1 for x in log_lines if "loss" in x)}
    (out / "train.log").write_text((work / "run" / "train.log").read_text())
    if best.exists():
        export_adapter(best, out)
        _log(out, f"best adapter: {json.loads((best / 'adapter_config.json').read_text())['validation']}")

    # 3. the bench on this device, while time is left
    if a.bench and a.deadline - (time.perf_counter() - t_start) > a.reserve_seconds * 0.8:
        bench_model = _bench_model(work, model_dir, a)
        summary["bench"] = bench(work, out, best if best.exists() else Path(init), bench_model, a)
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    _log(out, f"job done in {summary['seconds']:.0f} s")
    return 0


def export_adapter(src: Path, out: Path, max_mib: float = 15.0) -> None:
    """The adapter's folder in files under ``max_mib`` each (``adapter-N.safetensors``; ``join`` reverses it)."""
    import shutil

    import mlx.core as mx

    weights = mx.load(str(src / "adapter.safetensors"))
    parts, cur, size = [], {}, 0
    for k in sorted(weights):
        nbytes = weights[k].nbytes
        if cur and size + nbytes > max_mib * 2**20:
            parts.append(cur)
            cur, size = {}, 0
        cur[k], size = weights[k], size + nbytes
    parts.append(cur)
    for i, part in enumerate(parts):
        mx.save_safetensors(str(out / f"adapter-{i}.safetensors"), part)
    shutil.copy2(src / "adapter_config.json", out / "adapter_config.json")


def join(src: Path, dest: Path) -> None:
    """Rebuild an adapter folder from ``export_adapter``'s files (here, after the run)."""
    import mlx.core as mx

    from ..paths import atomic_dir

    weights = {}
    for f in sorted(src.glob("adapter-*.safetensors")):
        weights.update(mx.load(str(f)))
    cfg = json.loads((src / "adapter_config.json").read_text())
    if (src / "summary.json").is_file():  # the job's own record of its data and compute goes into the config
        summary = json.loads((src / "summary.json").read_text())
        evals = (summary.get("train") or {}).get("evals") or []
        cfg.setdefault("training", {})["compute"] = {
            "device": (summary.get("check") or {}).get("device_name") or (summary.get("check") or {}).get("device"),
            "job": "scripts/gpu_job.sh (ptp_mlx/train/gpu_job.py)",
            "teacher": summary.get("pregenerate"),
            "train_steps": (summary.get("train") or {}).get("steps"),
            "train_rows": evals[-1].get("train_rows") if evals else None,
            "train_seconds": evals[-1].get("cpu_seconds") if evals else None,
        }
    with atomic_dir(dest, overwrite=True) as tmp:
        mx.save_safetensors(str(tmp / "adapter.safetensors"), weights)
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2))


def _bench_model(work: Path, model_dir: str, a: argparse.Namespace) -> str:
    """The model folder benched: the trained one, or the staged GGUF converted to ``--bench-dtype``."""
    if a.model is not None or a.bench_dtype == "float32":
        return model_dir
    from ..gguf import convert_gguf

    out = work / f"model-{a.bench_dtype}"
    if not out.exists():
        convert_gguf(work / "SmolLM2-135M-Instruct.Q4_1.gguf", out, dtype=a.bench_dtype, overwrite=True)
    return str(out)


def bench(work: Path, out: Path, adapter: Path, model_dir: str, a: argparse.Namespace) -> dict:
    """mlx-lm, ar and ptp side by side on this device, greedy and at T 0.7 / top-p 0.95, then ``--profile``; the
    tables go to ``bench.txt`` (an adapter follows its model into bf16 by its signature)."""
    import contextlib
    import io

    from ..bench.cli import main as bench_main

    prompts = a.bench_prompts or Path(__file__).resolve().parent.parent / "data" / "heldout_prompts.jsonl"
    res = {}
    runs = [("greedy", ["--json", str(out / "bench-greedy.json")])]
    if a.bench_sampled:
        # (its JSON only in a bench-only run: a full run's files would pass the transfer's limit of 8)
        json_t07 = ["--json", str(out / "bench-t07.json")] if a.bench_only else []
        runs.append(("t07", ["--temp", "0.7", "--top-p", "0.95", *json_t07]))
    for name, extra in (*runs, ("profile", ["--profile"])):
        argv = ["--model", model_dir, "--adapter", str(adapter), "--prompts", str(prompts)]
        argv += ["--max-tokens", str(a.bench_tokens), "--methods", "mlx-lm,ar,ptp", *extra]
        _log(out, f"bench {name}: ptp-bench {' '.join(argv)}")
        t0 = time.perf_counter()
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                rc = bench_main(argv)
        except SystemExit as e:
            rc = e.code
        with open(out / "bench.txt", "a") as f:
            f.write(f"$ ptp-bench {' '.join(argv)}\n{buf.getvalue()}\n")
        res[name] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1)}
        _log(out, f"bench {name}: rc {rc} in {res[name]['seconds']:.0f} s")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ptp_mlx.train.gpu_job")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage", help="pack wheels, model, prompts and references into shard folders (here)")
    s.add_argument("--out", type=Path, default=Path(".stage"))
    s.add_argument("--prompts", type=Path, nargs="+", required=True)
    s.add_argument("--val", type=Path, required=True)
    s.add_argument("--shard-mib", type=float, default=40.0)
    j = sub.add_parser("join", help="rebuild the adapter folder from the job's files (here)")
    j.add_argument("src", type=Path)
    j.add_argument("dest", type=Path)
    r = sub.add_parser("run", help="the job (on the GPU machine, from scripts/gpu_job.sh)")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--model", default=None, help="model folder (default: the staged GGUF, converted)")
    r.add_argument("--init", default=None, help="adapter to start from (default: the shipped one; 'none')")
    r.add_argument("--per-prompt", type=int, default=17)
    r.add_argument("--max-tokens", type=int, default=96)
    r.add_argument("--batch-prompts", type=int, default=64)
    r.add_argument("--gen-seconds", type=float, default=150)
    r.add_argument("--train-minutes", type=float, default=4.0)
    r.add_argument("--eval-minutes", type=float, default=1.0)
    r.add_argument("--rows-per-step", type=int, default=30720)
    r.add_argument("--micro-rows", type=int, default=8192)
    r.add_argument("--rank", type=int, default=16)
    r.add_argument("--lr", type=float, default=5e-4)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--deadline", type=float, default=540, help="seconds the whole job may take")
    r.add_argument("--reserve-seconds", type=float, default=60, help="kept for export and bench")
    r.add_argument("--bench", action="store_true")
    r.add_argument("--bench-tokens", type=int, default=64)
    r.add_argument("--bench-prompts", type=Path, default=None, help="default: the bundled held-out prompts")
    r.add_argument("--bench-only", action="store_true", help="only the bench (no generation or training)")
    r.add_argument("--bench-sampled", action="store_true", help="also bench T 0.7, top-p 0.95")
    r.add_argument(
        "--compiled-check",
        action="store_true",
        help="only the compiled-call check: profiles, benches, cost sweep and 2,000 calls (ptp_mlx/train/gpu_check.py)",
    )
    r.add_argument("--sweep-sizes", default="all", help="the compiled check's cost-sweep shapes")
    r.add_argument("--stress-calls", type=int, default=2000, help="the compiled check's calls in one process")
    r.add_argument(
        "--bench-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"], help="weights benched"
    )
    a = p.parse_args(argv)
    if a.cmd == "stage":
        shards = stage_default(a.out, a.prompts, a.val, a.shard_mib)
        for d in shards:
            print(f"{d}: {(d / 'part').stat().st_size / 2**20:.1f} MiB")
        return 0
    if a.cmd == "join":
        join(a.src, a.dest)
        return 0
    os.environ.setdefault("PTP_MLX_HOME", str(Path(a.work) / "home"))
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
