"""``ptp-train auto``: one command from a model to an installed adapter and a verdict.

Phases, each recorded in the run folder when it finishes (``phases/<name>.json``), so the same command resumes
at the first unfinished one after Ctrl-C or a crash; each phase resumes on its own too (pregenerate skips prompts
already answered, training continues from its last checkpoint):

1. ``prompts``: the bundled development prompts (templated maths problems and programming tasks) or ``--prompts``;
2. ``probe``: three rates of this machine with this model, then the plan (``plan.py``), said up front;
3. ``pregenerate``: held-out completions, then the model's own completions for the plan's time;
4. ``train``: the recipe (probability CDF order, slot weights ``decay:0.7``) at the plan's rank, rows and steps;
5. ``eval``: held-out tokens per window (and the adapter this model had before, if any);
6. ``bench``: mlx-lm, plain decoding and PTP side by side on a few bundled prompts, greedy and T 0.7;
7. ``install``: the adapter into ``$PTP_MLX_HOME/adapters``, where the model's fingerprint finds it, unless the
   verdict is "slower" (``--install-anyway`` installs it then).

Under ``mlx.launch`` every process trains (data parallel, ``dist.py``); process 0 runs the other phases while
the others wait, so the run folder must be one path every process reads (one machine, or a shared folder).
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
import sys
import time
from pathlib import Path

from ..cli_common import UserError
from .plan import TRAIN_PER_PROMPT, TRAIN_TOKENS, VAL_PER_PROMPT, VAL_TOKENS, TrainingPlan
from .run_folder import RunFolder, free_bytes, lock_run, release_runs, trim_partial_line

SIZES = {"small": 10.0, "medium": 30.0, "large": 90.0}  # minutes
PHASES = ("prompts", "probe", "pregenerate", "train", "eval", "bench", "install")
MIN_FREE = 64 * 2**20  # bytes: less than this refuses before anything is loaded


def add_auto_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or Hugging Face repo id (default: the default model)")
    b = p.add_mutually_exclusive_group()
    b.add_argument("--minutes", type=float, default=None, help="time budget of the whole run (default: 30)")
    b.add_argument(
        "--size",
        choices=list(SIZES),
        default=None,
        help="named budgets: small 10, medium 30, large 90 min (default: medium)",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="your own prompt JSONL ('turns'; ids ending 0/5 held out; default: the bundled prompts)",
    )
    p.add_argument("--run", type=Path, default=None, help="run folder (default: $PTP_MLX_HOME/runs/<model>)")
    p.add_argument("--install-anyway", action="store_true", help="install the adapter even if PTP is slower")
    p.add_argument("--no-install", action="store_true", help="never install the adapter (it stays in the run folder)")
    p.add_argument(
        "--max-prompts", type=int, default=None, help="use at most N training prompts (default: all of them)"
    )
    p.add_argument("--bench-prompts", type=int, default=3, help="bundled bench prompts per setting in the verdict")
    p.add_argument("--bench-tokens", type=int, default=64, help="tokens per bench answer")
    p.add_argument("--rank", type=int, default=None, help="LoRA rank (default: from the plan)")
    p.add_argument("--rows-per-step", type=int, default=None, help="auxiliary rows per step (default: from the plan)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: from the plan)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random choice")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_name(model: str | None) -> str:
    from ..paths import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME if model is None else Path(str(model).rstrip("/")).name or str(model).replace("/", "--")


def installed_dir(model: str | None, fingerprint: str) -> Path:
    """Where ``auto`` installs an adapter: under the cache root, found by the model's fingerprint."""
    from ..paths import cache_root

    return cache_root() / "adapters" / f"{model_name(model)}-{fingerprint[:8]}"


def run_auto(a: argparse.Namespace) -> int:
    """The whole run; Ctrl-C says where it stopped and exits 130 (the same command resumes)."""
    from . import dist

    where = {"phase": "checks"}
    try:
        return _auto(a, dist.init(), where)
    except KeyboardInterrupt:
        print(f"\nerror: interrupted during {where['phase']}; run the same command again to resume", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise UserError(f"no space left on the device during {where['phase']}: free some and run again") from None
        raise
    finally:
        release_runs()


def _checks(a: argparse.Namespace):
    """Everything that can be refused, before any long work: (base, tokenizer, minutes)."""
    from ..model.layers import check_model_type, model_type
    from ..models import check_ptp_model, load, resolve_model
    from .checks import at_least, check_seed, positive
    from .data import read_prompts

    minutes = a.minutes if a.minutes is not None else SIZES[a.size or "medium"]
    positive("--minutes", minutes)
    for flag, v in (("--rank", a.rank), ("--rows-per-step", a.rows_per_step), ("--steps", a.steps)):
        at_least(flag, v, 1)
    check_seed(a.seed)
    if a.max_prompts is not None and a.max_prompts < 1:
        raise UserError("--max-prompts must be at least 1")
    if a.bench_prompts < 1 or a.bench_tokens < 1:
        raise UserError("--bench-prompts and --bench-tokens must be at least 1")
    if a.model is not None:
        resolve_model(a.model)  # a missing folder: one line, nothing loaded
    check_ptp_model(a.model)  # an SSM or another unsupported family, from its config alone
    if a.prompts is not None:
        rows = read_prompts(a.prompts)  # a broken line: its file and line number
        if not any(r for r in read_prompts(a.prompts, "train")) or not any(read_prompts(a.prompts, "val")):
            raise UserError(
                f"{a.prompts}: needs training prompts and held-out ones (ids ending in 0 or 5; {len(rows)} prompts)"
            )
    if free_bytes(a.run) < MIN_FREE:
        raise UserError(f"too little disk space for {a.run}: {free_bytes(a.run) / 2**20:.0f} MiB free")
    base, tok = load(a.model)
    check_model_type(model_type(base))  # a hub model, whose config was not on disk before loading
    if a.prompts is None and not getattr(tok, "chat_template", None):
        raise UserError("this model has no chat template: give your own prompts with --prompts FILE")
    return base, tok, minutes


def _auto(a: argparse.Namespace, grp, where: dict) -> int:
    from ..models import model_fingerprint
    from ..paths import atomic_write_bytes, cache_root

    a.run = a.run or cache_root() / "runs" / model_name(a.model)
    base, tok, minutes = _checks(a)
    fp = model_fingerprint(base)
    run = RunFolder(a.run)
    if grp.main:
        lock_run(run.root)
    meta = run.root / "auto.json"
    if meta.is_file() and json.loads(meta.read_text()).get("fingerprint") != fp:
        raise UserError(f"run folder {run.root} belongs to another model: pass --run DIR")
    if grp.main and not meta.is_file():
        atomic_write_bytes(meta, json.dumps({"model": str(a.model), "fingerprint": fp}).encode())
    inst = run.done("install")
    if inst and not inst.get("installed") and a.install_anyway and grp.main:
        (run.root / "phases" / "install.json").unlink()  # asked now: install what the finished run made
    grp.agree(0)  # sync: every process reads the same markers (data parallel: dist.py)
    todo = [p for p in PHASES if not run.done(p)]
    if todo and todo[0] != PHASES[0]:
        _say(f"auto: resuming at phase {todo[0]} in {run.root}")

    def phase(name: str, fn, every: bool = False):
        where["phase"] = name
        if name in todo:
            if grp.main or every:
                t0 = time.perf_counter()
                info = fn() or {}
                if grp.main:
                    run.mark(name, {**info, "seconds": round(time.perf_counter() - t0, 1)})
            grp.agree(0)  # sync: the other processes wait for process 0's phases
        return run.done(name)

    phase("prompts", lambda: _prompts(a, run))
    phase("probe", lambda: _probe(a, base, tok, run, minutes, grp.size))
    plan = TrainingPlan.load(run.plan)
    _say(plan.describe())
    phase("pregenerate", lambda: _pregenerate(a, base, tok, run, plan))
    phase("train", lambda: _train(a, base, run, plan, grp), every=True)
    ev = phase("eval", lambda: _eval(base, run))
    bench = phase("bench", lambda: _bench(a, run, plan))
    inst = phase("install", lambda: _install(a, run, fp, bench, ev))
    if grp.main:
        print(verdict_line(ev, bench, inst))
    return 0


def _eta(name: str, seconds: float) -> None:
    end = time.strftime("%H:%M", time.localtime(time.time() + seconds))
    _say(f"auto: {name}: about {seconds / 60:.1f} min (until about {end})")


def _prompts(a, run: RunFolder) -> dict:
    from ..paths import atomic_write_bytes
    from .corpora import build_prompts

    if a.prompts is not None:
        atomic_write_bytes(run.prompts, Path(a.prompts).read_bytes())
        return {"source": str(a.prompts)}
    n = build_prompts(run.prompts, None, None)
    return {"source": "bundled development prompts", "prompts": n}


def _probe(a, base, tok, run: RunFolder, minutes: float, processes: int) -> dict:
    from ..adapter import adapter_for
    from ..paths import atomic_write_bytes
    from .plan import Probe, make_plan, probe

    saved = run.root / "probe.json"
    if saved.is_file():  # measured by an earlier try (whose budget was refused): not measured again
        pr = Probe(**{**json.loads(saved.read_text()), "seconds": 0.0})  # its time was spent in that try
    else:
        _say("auto: probing this machine with this model (under a minute on an idle machine)...")
        pr = probe(base, tok, run.prompts, run.probe_dir)
        shutil.rmtree(run.probe_dir, ignore_errors=True)
        atomic_write_bytes(saved, json.dumps(pr.__dict__).encode())
    plan = make_plan(pr, minutes, processes, bench_prompts=a.bench_prompts, bench_tokens=a.bench_tokens,
                     rank=a.rank, rows_per_step=a.rows_per_step, steps=a.steps,
                     previous=adapter_for(base) is not None)  # fmt: skip
    free = free_bytes(run.root)
    if free < plan.disk_bytes:
        raise UserError(f"too little disk space: the run needs about {plan.disk_bytes / 2**20:.0f} MiB, "
                        f"{free / 2**20:.0f} MiB free at {run.root}")  # fmt: skip
    plan.save(run.plan)
    _say(
        f"auto: probe: {pr.teacher_tokens_per_s:.0f} teacher tokens/s batched, {pr.decode_tokens_per_s:.0f} tokens/s "
        f"one stream, {pr.seconds_per_row * 1e3:.2f} ms per training row ({pr.seconds:.0f} s)"
    )
    return {"probe": pr.__dict__}


def _pregenerate(a, base, tok, run: RunFolder, plan: TrainingPlan) -> dict:
    from ..sampler import SamplingSettings
    from .data import read_records
    from .pregenerate import pregenerate

    seconds = plan.phase_seconds["pregenerate"]
    prog = run.root / "phases" / "pregenerate.progress"
    spent = json.loads(prog.read_text())["seconds"] if prog.is_file() else 0.0
    _eta("pregenerate", max(0.0, seconds - spent))
    t0 = time.perf_counter()
    s = SamplingSettings(0.7, 50, 0.95)
    try:
        for f in (run.val, run.teacher):
            trim_partial_line(f)
        pregenerate(base, tok, run.prompts, run.val, n=VAL_PER_PROMPT, sampling=s, max_new=VAL_TOKENS,
                    split="val", limit=plan.val_prompts, seed=7, batch_prompts=8,
                    deadline=t0 + 0.35 * max(1.0, seconds - spent))  # fmt: skip
        deadline = t0 + max(1.0, seconds - spent - (time.perf_counter() - t0))
        pregenerate(base, tok, run.prompts, run.teacher, n=TRAIN_PER_PROMPT, sampling=s, max_new=TRAIN_TOKENS,
                    split="train", limit=a.max_prompts, seed=a.seed, batch_prompts=8, deadline=deadline)  # fmt: skip
    finally:
        from ..paths import atomic_write_bytes

        atomic_write_bytes(prog, json.dumps({"seconds": spent + time.perf_counter() - t0}).encode())
    n = len(read_records(run.teacher))
    if n == 0:
        raise UserError("no teacher completions were written: give a larger budget (--minutes)")
    return {"records": n, "val_records": len(read_records(run.val))}


def _train(a, base, run: RunFolder, plan: TrainingPlan, grp) -> dict:
    from .data import read_records
    from .train import add_train_args, train

    if grp.main:
        _eta("train", plan.phase_seconds["train"])
    p = argparse.ArgumentParser()
    add_train_args(p)
    steps = plan.steps
    # --steps given: exactly that many (a resumed run then equals an uninterrupted one). Else the plan's time is a
    # hard stop and the steps follow the measured pace (up to three times the plan's, on a faster machine).
    timed = (
        []
        if a.steps
        else ["--minutes", f"{plan.fit_seconds / 60:.3f}", "--eval-minutes", f"{plan.fit_seconds / 120:.3f}"]
    )
    t = p.parse_args(
        ["--data", str(run.teacher), "--val", str(run.val), "--run", str(run.train), "--out", str(run.adapter),
         "--resume", "--steps", str(steps if a.steps else 3 * steps), "--rank", str(plan.rank),
         "--alpha", str(2 * plan.rank), "--rows-per-step", str(plan.rows_per_step), "--cdf-order", "prob",
         "--slot-weights", "decay:0.7", "--eval-every", str(max(1, steps // 2)),
         "--save-every", str(max(1, min(50, steps // 10))), "--warmup", str(min(20, max(1, steps // 10))),
         "--seed", str(a.seed), *timed]
    )  # fmt: skip
    t.name = model_name(a.model)
    records = read_records(run.teacher)
    train(base, records, read_records(run.val)[: t.eval_seqs], t, grp=grp)
    return {"steps": steps, "records": len(records)}


def _eval(base, run: RunFolder) -> dict:
    from ..adapter import adapter_for
    from ..paths import atomic_write_bytes
    from .validate import evaluate_adapter

    _say("auto: eval: scoring the adapter on the held-out completions...")
    ev = evaluate_adapter(base, run.adapter, run.val)
    out = {"mean_accepted": ev["mean_accepted"], "histograms": ev["histograms"], "records": ev["records"]}
    before = adapter_for(base)  # the adapter this model had (shipped or installed earlier), for comparison
    if before is not None:
        old = evaluate_adapter(base, before, run.val)
        out["previous"] = {"adapter": str(before), "mean_accepted": old["mean_accepted"]}
    atomic_write_bytes(run.root / "eval.json", (json.dumps({**ev, "previous": out.get("previous")}) + "\n").encode())
    _say(f"auto: held-out: {ev['mean_accepted']:.3f} tokens per window")
    return out


def _bench(a, run: RunFolder, plan: TrainingPlan) -> dict:
    from tqdm import tqdm

    from ..bench.methods import make_runners
    from ..bench.metrics import summarize
    from ..bench.prompts import load_prompts
    from ..bench.run import compare, diagnose, run_bench
    from ..engine import Engine
    from ..paths import atomic_write_bytes
    from ..sampler import SamplingSettings

    eng = Engine.load(a.model, str(run.adapter), log=lambda m: None)
    prompts = load_prompts(None, plan.bench_prompts)
    methods = ["mlx-lm", "ar", "ptp"]
    runners = make_runners(eng, methods)
    out: dict = {"settings": {}}
    identical = compared = ties = 0
    for label, s in (("greedy", SamplingSettings()), ("T 0.7", SamplingSettings(0.7, 50, 0.95))):
        with tqdm(total=len(prompts) * len(methods), desc=f"bench {label}", unit="answer", file=sys.stderr) as bar:
            res = run_bench(prompts, runners, eng.tokenizer, a.bench_tokens, s, progress=bar.update)
        figs = summarize(res.records, res.complete, methods)
        n, same, divs = compare(res.records, "ar", "ptp")
        for d in divs:
            diagnose(d, res.records, "ar", eng.pm, s, sorted(getattr(eng.tokenizer, "eos_token_ids", None) or []))
        identical, compared, ties = identical + same, compared + n, ties + sum(d.near_tie for d in divs)
        out["settings"][label] = {m: figs[m]["all"]["tokens_per_s"] for m in methods if m in figs}
        out["settings"][label]["mean_accepted"] = figs["ptp"]["all"]["mean_accepted"] if "ptp" in figs else None
    speed = [v["ptp"] / v["mlx-lm"] for v in out["settings"].values() if v.get("mlx-lm")]
    out.update(speedup=sum(speed) / max(1, len(speed)), identical=identical, compared=compared, near_ties=ties)
    atomic_write_bytes(run.root / "bench.json", (json.dumps(out, indent=1) + "\n").encode())
    if identical + ties < compared:
        raise RuntimeError(f"PTP differed from plain decoding on {compared - identical - ties} answers (not near-ties)")
    return out


def _install(a, run: RunFolder, fp: str, bench: dict, ev: dict | None = None) -> dict:
    from ..paths import atomic_dir

    if a.no_install:
        return {"installed": None, "why": "--no-install"}
    if bench["speedup"] < 1.0 and not a.install_anyway:
        return {"installed": None, "why": "slower (--install-anyway installs it)"}
    prev = (ev or {}).get("previous")
    if prev and prev["mean_accepted"] > ev["mean_accepted"] and not a.install_anyway:
        return {"installed": None, "why": "the model's adapter scores higher held-out (--install-anyway installs it)"}
    dest = installed_dir(a.model, fp)
    with atomic_dir(dest, overwrite=True) as tmp:
        for f in run.adapter.iterdir():
            shutil.copy2(f, tmp / f.name)
    return {"installed": str(dest)}


def verdict_line(ev: dict, bench: dict, inst: dict) -> str:
    """The one-line verdict: faster or slower on this machine, by how much, and where the adapter went."""
    g, t = bench["settings"].get("greedy", {}), bench["settings"].get("T 0.7", {})
    word = "faster" if bench["speedup"] >= 1.0 else "slower"
    prev = ev.get("previous")
    held = f"held-out {ev['mean_accepted']:.2f} tokens per window" + (
        f" (before: {prev['mean_accepted']:.2f})" if prev else ""
    )
    where = f"installed in {inst['installed']}" if inst.get("installed") else f"not installed: {inst.get('why')}"
    return (
        f"verdict: {word}, {bench['speedup']:.2f}x mlx-lm on this machine (greedy {g.get('mlx-lm', 0):.1f} -> "
        f"{g.get('ptp', 0):.1f} tok/s, T 0.7 {t.get('mlx-lm', 0):.1f} -> {t.get('ptp', 0):.1f} tok/s); {held}; "
        f"lossless on {bench['identical']}/{bench['compared']} answers; {where}"
    )
