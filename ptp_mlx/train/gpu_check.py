"""The compiled-call GPU check (issue 29), one prepared command on a lent GPU from the existing staging:

    PTP_JOB_ARGS="--compiled-check" bash scripts/gpu_job.sh run

In separate processes (the environment switches must be set before MLX loads): issue 40's profile (``ptp-bench
--profile --prompts <held-out> --limit 1 --max-tokens 128``); ``ptp-bench --profile`` for the compiled calls and the eager reference, each with ``MLX_CUDA_USE_CUDNN_SDPA`` at 0 and 1; the held-out bench,
greedy and T 0.7 top-p 0.95, compiled and eager, and greedy with a fixed budget of 3 drafts (chained calls); the
top-k tree against chains plus one sibling (``docs/results/trees/sibling_ab.py``, one round); the cost sweep; and
2,000 PTP calls in one process (cuDNN's graph cache throws "Cache thrashing" after 512 misses: bucketed key lengths
must keep its shapes few). Every command
and its output go to ``compiled-check.txt``, the figures to ``compiled-check.json``, and ``summary.json`` gets each
step's exit code and seconds. ``--sweep-sizes`` and ``--stress-calls`` shrink it for the CPU dry run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _run(out: Path, name: str, argv: list[str], env: dict, timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, p.stdout + p.stderr[-4000:]
    except subprocess.TimeoutExpired as e:
        rc, text = 124, (e.stdout or "") if isinstance(e.stdout, str) else ""
    secs = round(time.perf_counter() - t0, 1)
    with open(out / "compiled-check.txt", "a") as f:
        f.write(
            f"$ {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(argv[2:])}\n{text}\n[rc {rc}, {secs} s]\n\n"
        )
    print(f"compiled check {name}: rc {rc} in {secs:.0f} s", flush=True)
    return {"rc": rc, "seconds": secs}


def compiled_check(
    work: Path, out: Path, adapter: Path, model_dir: str, prompts: Path, tokens: int = 64, sweep="all", calls=2000,
    profile_tokens: int = 128,
) -> dict:  # fmt: skip
    """Every step of the check (see the module docstring); returns each step's exit code and seconds. Tables go to
    ``compiled-check.txt``, every figure to ``compiled-check.json`` (two files: the transfer back takes at most 8)."""
    py = [sys.executable, "-m"]
    common = ["--model", model_dir, "--adapter", str(adapter), "--max-tokens", str(tokens)]
    figs = Path(work) / "compiled-check"
    figs.mkdir(parents=True, exist_ok=True)
    res = {}
    # Issue 40's profile item, its own command (at least 80% of the default drafter's calls chained, at most 0.5 ms
    # of host time on the path per call, median): first, so that it runs whatever the later steps take.
    name = "profile-issue40"
    argv = [*py, "ptp_mlx.bench.cli", "--model", model_dir, "--adapter", str(adapter), "--profile"]
    argv += ["--prompts", str(prompts), "--limit", "1", "--max-tokens", str(profile_tokens)]
    res[name] = _run(out, name, [*argv, "--json", str(figs / f"{name}.json")], {}, 240)
    for cudnn in ("1", "0"):
        for kind, flag in (("compiled", []), ("eager", ["--eager"])):
            name = f"profile-{kind}-cudnn{cudnn}"
            argv = [*py, "ptp_mlx.bench.cli", *common, "--profile", *flag, "--json", str(figs / f"{name}.json")]
            res[name] = _run(out, name, argv, {"MLX_CUDA_USE_CUDNN_SDPA": cudnn}, 240)
    for kind, env in (("compiled", {}), ("eager", {"PTP_MLX_EAGER": "1"})):
        for samp, extra in (("greedy", []), ("t07", ["--temp", "0.7", "--top-p", "0.95"])):
            name = f"bench-{samp}-{kind}"
            argv = [*py, "ptp_mlx.bench.cli", *common, "--prompts", str(prompts), "--limit", "12"]
            argv += ["--methods", "mlx-lm,ar,ptp", *extra, "--json", str(figs / f"{name}.json")]
            res[name] = _run(out, name, argv, env, 240)
    # A fixed budget's calls are chained (built for every outcome while the previous call computes): on a GPU, where
    # rows cost little, it may beat the adaptive budget's synchronous calls.
    name = "bench-greedy-fixed3"
    argv = [*py, "ptp_mlx.bench.cli", *common, "--prompts", str(prompts), "--limit", "12", "--num-draft-tokens", "3"]
    res[name] = _run(out, name, [*argv, "--methods", "mlx-lm,ar,ptp", "--json", str(figs / f"{name}.json")], {}, 240)
    # Issue 43: the adapter's top-k tree against chains plus one sibling, side by side where rows are cheap.
    script = Path(__file__).resolve().parents[2] / "docs" / "results" / "trees" / "sibling_ab.py"
    argv = [sys.executable, str(script), "1", "--model", model_dir, "--adapter", str(adapter)]
    argv += ["--prompts", str(prompts)]
    res["trees-vs-sibling"] = _run(out, "trees-vs-sibling", [*argv, "--max-tokens", str(tokens)], {}, 240)
    argv = [*py, "ptp_mlx.bench.cli", "--cost-sweep", sweep, "--json", str(figs / "cost-sweep.json")]
    res["cost-sweep"] = _run(out, "cost-sweep", argv, {}, 240)
    argv = [*py, "ptp_mlx.train.gpu_check", "stress", "--model", model_dir, "--adapter", str(adapter)]
    res["stress"] = _run(out, "stress", [*argv, "--calls", str(calls)], {}, 300)
    merged = {p.stem: json.loads(p.read_text()) for p in sorted(figs.glob("*.json"))}
    (out / "compiled-check.json").write_text(json.dumps(merged, indent=1))
    return res


def stress(model_dir: str, adapter: str, calls: int = 2000) -> int:
    """``calls`` PTP calls in one process (answers with EOS ignored, one after another), fixed budget: exits 0 when
    none failed, printing the calls, the tokens and the compile bank's entries."""
    from ..decode.fixed import bank_for
    from ..drafting.policy import DraftingConfig
    from ..engine import Engine
    from ..generate import DecodeOptions, stream_generate
    from ..sampler import SamplingSettings

    eng = Engine.load(model_dir, adapter, measure_cost=False)
    prompts = ["Write a long story about a lighthouse.", "Explain how tides work, in detail.", "List 200 animals."]
    done = tokens = k = 0
    t0 = time.perf_counter()
    while done < calls:
        s = SamplingSettings(0.0) if k % 2 == 0 else SamplingSettings(0.7, 0, 0.95, seed=k)
        opts = DecodeOptions(
            mode="ptp", max_tokens=min(2048, 3 * (calls - done) + 8), sampling=s, drafting=DraftingConfig(3)
        )
        for st in stream_generate(eng.pm, eng.tokenizer, eng.encode(prompts[k % len(prompts)]), opts, eos_ids=set()):
            done += 1
            tokens += len(st.tokens)
        k += 1
    bank = bank_for(eng.pm)
    print(f"{done} calls, {tokens} tokens, {time.perf_counter() - t0:.1f} s; compile bank {len(bank.entries)} entries")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ptp_mlx.train.gpu_check")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stress", help="2,000 PTP calls in one process")
    s.add_argument("--model", required=True)
    s.add_argument("--adapter", required=True)
    s.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args(argv)
    return stress(a.model, a.adapter, a.calls)


if __name__ == "__main__":
    sys.exit(main())
