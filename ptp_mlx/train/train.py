"""Phase 2 of distillation: O-PTP training of the gated LoRA and the u-embedding (docs/method.md, section 6).

Per step, for a few teacher sequences: one teacher pass (base weights only) gives the context K/V; one
student pass runs many windows of auxiliaries against it with the window mask; the loss is cross-entropy of
the auxiliary logits against the teacher's tokens, with each ``u`` drawn inside its token's sampler bin
(Beta(0.3, 0.3) in training, uniform in evaluation). Everything random is derived from ``(seed, step)``, so a
run resumed from a checkpoint continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from tqdm import tqdm

from ..adapter import make_config, save_adapter
from ..errors import UserError
from ..model.layers import batched_rope, language_model, token_embedding
from ..model.ptp import PTPAdapter, PTPModel
from .batch import accumulate, step_items, weighted_ce_sum
from .checks import check_train_flags, check_train_paths, layer_ids
from .data import read_records
from .dist import Group
from .validate import evaluate
from .windows import GREEDY_U, ensure_order, loss_fn, make_windows, slot_weights, teacher_kv


def add_train_args(t: argparse.ArgumentParser) -> None:
    t.add_argument("--model", default=None, help="model folder (default: the default model)")
    t.add_argument("--data", required=True, type=Path, nargs="+", help="teacher JSONL file(s)")
    t.add_argument(
        "--val", type=Path, default=None, help="held-out teacher JSONL for validation (default: none, no validation)"
    )
    t.add_argument("--run", required=True, type=Path, help="run folder (checkpoints, log, best adapter)")
    t.add_argument("--out", type=Path, default=None, help="export the best adapter here at the end (default: none)")
    t.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    t.add_argument(
        "--init",
        type=Path,
        default=None,
        help="start from this adapter's weights, fresh optimizer (default: none, new weights)",
    )
    t.add_argument(
        "--reload-every", type=int, default=0, help="re-read --data every N steps (files still being written)"
    )
    t.add_argument("--steps", type=int, default=1000, help="optimizer steps in all (a resumed run stops there too)")
    t.add_argument("--rank", type=int, default=16, help="LoRA rank")
    t.add_argument("--alpha", type=float, default=32.0, help="LoRA scale = alpha / rank")
    t.add_argument("--layers", default="all", help="'all', 'last:N' or comma-separated layer ids")
    t.add_argument(
        "--targets", default="all", help="'all' or comma-separated projection names of a block (e.g. q_proj,v_proj)"
    )
    t.add_argument(
        "--u-embedding", default="binary", choices=["binary", "linear_interpolation"], help="how u is embedded"
    )
    t.add_argument("--window", type=int, default=8, help="auxiliaries per window (K)")
    t.add_argument(
        "--cdf-order", default="id", choices=["id", "prob"], help="CDF order the u of sampled records couple to"
    )
    t.add_argument(
        "--slot-weights",
        default=None,
        help="loss weight per window slot: 'decay:G' or 'w0,w1,...' (default: 1 for every slot)",
    )
    t.add_argument(
        "--eval-window", type=int, default=None, help="window width scored in validation (default: --window)"
    )
    t.add_argument("--windows-per-seq", type=int, default=16, help="windows drawn from each teacher sequence")
    t.add_argument("--seqs-per-step", type=int, default=2, help="teacher sequences per step")
    t.add_argument(
        "--rows-per-step",
        type=int,
        default=None,
        help="auxiliary rows per step, sets --seqs-per-step from it (default: none, --seqs-per-step decides)",
    )
    t.add_argument(
        "--micro-rows",
        type=int,
        default=None,
        help="auxiliary rows per student pass (a step's gradient sums them; default: 8192 on a GPU, one sequence's "
        "on the CPU, where padding sequences to one length costs more than the passes it saves)",
    )
    t.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="train for this long (training time only): sets --steps (default: no time limit)",
    )
    t.add_argument(
        "--eval-minutes",
        type=float,
        default=None,
        help="validate every N minutes of training, with --val (default: every --eval-every steps)",
    )
    t.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (cosine decay to a tenth)")
    t.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    t.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
    t.add_argument("--eval-every", type=int, default=100, help="validate every N steps (with --val)")
    t.add_argument("--eval-seqs", type=int, default=48, help="validation sequences (8 windows each)")
    t.add_argument("--seed", type=int, default=0, help="seed of every random choice (runs resume exactly)")


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak``, then cosine decay to a tenth of it at ``total`` steps."""
    if step < warmup:
        return peak * step / max(1, warmup)
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * frac)))


def train_from_args(a: argparse.Namespace) -> int:
    from ..models import load

    check_train_flags(a)  # bad flags and paths: exit 2 before anything is read, loaded or written
    check_train_paths(a)
    for f in [*a.data, *([a.val] if a.val else [])]:
        if not Path(f).is_file():
            raise UserError(f"teacher file not found: {f}")

    def read_all() -> list[dict]:
        return [r for f in a.data for r in read_records(f, log=lambda m: print(m, file=sys.stderr))]

    records = read_all()
    if not records:
        raise UserError(f"no teacher records in {', '.join(map(str, a.data))}")
    val = read_records(a.val)[: a.eval_seqs] if a.val else []
    base, _ = load(a.model)
    from .dist import init

    grp = init()  # more than one process under mlx.launch: data parallel
    if grp.size > 1 and getattr(a, "reload_every", 0):
        raise UserError("--reload-every needs one process: each would read a different file length")
    return train(base, records, val, a, reload=read_all if getattr(a, "reload_every", 0) else None, grp=grp)


def train(
    base, records: list[dict], val: list[dict], a: argparse.Namespace, log=None, reload=None, grp: Group | None = None
) -> int:
    """Train (or resume) in ``a.run``; returns 0. ``a`` carries the ``add_train_args`` fields.

    ``reload`` (with ``a.reload_every``) re-reads the teacher records while pregenerate still appends to them;
    such a run is only reproducible from the same final files, not bit-identical on resume. ``grp``: the
    data-parallel group (``dist.py``); only its process 0 writes files and logs.
    """
    grp = grp or Group()
    log = log or (lambda m: print(m, file=sys.stderr))
    if not grp.main:
        log = lambda m: None  # noqa: E731 - the other processes stay quiet
    order = getattr(a, "cdf_order", "id")
    run = Path(a.run)  # created once every input is checked (below), so a refused run leaves no folder
    base.freeze()
    mx.random.seed(a.seed)
    layers = layer_ids(a.layers, len(base.layers))
    targets = None if a.targets == "all" else a.targets.split(",")
    try:
        adapter = PTPAdapter(base, a.rank, a.alpha / a.rank, a.u_embedding, targets=targets, layers=layers)
    except ValueError as e:
        raise UserError(str(e)) from None
    if a.u_embedding == "binary":  # start every auxiliary near an average token embedding
        emb = token_embedding(base)(mx.arange(language_model(base).args.vocab_size)).astype(mx.float32)
        adapter.u_embed.u_adapter.bias = emb.mean(axis=0)
        adapter.u_embed.u_adapter.weight = adapter.u_embed.u_adapter.weight * 0.1
    pm = PTPModel(base, adapter)  # patches the base model in place (refuses unsupported families)
    opt = optim.AdamW(learning_rate=a.lr, weight_decay=a.weight_decay)
    opt.init(adapter.trainable_parameters())
    seqs_per_step = a.seqs_per_step
    if getattr(a, "rows_per_step", None):
        seqs_per_step = max(1, -(-a.rows_per_step // (a.windows_per_seq * a.window)))
    batched = batched_rope(base)  # many sequences per pass; else one pass per sequence
    # Rows per student pass: many on a GPU; one sequence's on the CPU, where padding costs more than passes save.
    micro_rows = getattr(a, "micro_rows", None) or (8192 if mx.default_device() == mx.gpu else 1)
    state = {"step": 0, "best": None, "evals": [], "seconds": 0.0, "steps_total": a.steps}
    if getattr(a, "init", None) and not (a.resume and (run / "last" / "state.json").exists()):
        src = Path(a.init) / "adapter.safetensors"
        if not src.is_file():
            raise UserError(f"--init: no adapter.safetensors in {a.init}")
        try:
            adapter.load_weights(list(mx.load(str(src)).items()), strict=True)
        except ValueError as e:
            raise UserError(f"--init: {a.init} does not match this adapter shape ({e})") from None
        log(f"initialised from {a.init}")
    if a.resume and (run / "last" / "state.json").exists():
        state = json.loads((run / "last" / "state.json").read_text())
        adapter.load_weights(str(run / "last" / "adapter.safetensors"), strict=False)
        opt.state = tree_unflatten(list(mx.load(str(run / "last" / "optimizer.safetensors")).items()))
        log(f"resumed at step {state['step']}")
    config_extra = {
        "sampling": {"temperature": 0.7, "top_k": 50, "top_p": 0.95, "greedy_rows": True},
        "greedy_u": GREEDY_U,
        "cdf_order": order,
        "training": {
            "records": len(records),
            "steps": a.steps,
            "rank": a.rank,
            "alpha": a.alpha,
            "window": a.window,
            "windows_per_seq": a.windows_per_seq,
            "seqs_per_step": seqs_per_step,
            "rows_per_step": seqs_per_step * a.windows_per_seq * a.window,
            "micro_rows": max(micro_rows, a.windows_per_seq * a.window),
            "minutes": getattr(a, "minutes", None),
            "lr": a.lr,
            "layers": a.layers,
            "cdf_order": order,
            "slot_weights": getattr(a, "slot_weights", None),
            "seed": a.seed,
            "init": str(a.init) if getattr(a, "init", None) else None,
            "data": [str(f) for f in a.data],
        },
    }
    weights = slot_weights(getattr(a, "slot_weights", None), a.window)
    run.mkdir(parents=True, exist_ok=True)
    eval_width = getattr(a, "eval_window", None) or a.window
    minutes = getattr(a, "minutes", None)
    eval_minutes = getattr(a, "eval_minutes", None)
    micro_seqs = max(1, micro_rows // (a.windows_per_seq * a.window))
    if batched:
        grad_fn = nn.value_and_grad(adapter, lambda ad, kv, mb: weighted_ce_sum(ad, pm, kv, mb))
    else:
        grad_fn = nn.value_and_grad(adapter, lambda ad, batch: loss_fn(ad, pm, batch, weights))
    bar = tqdm(
        total=state["steps_total"],
        initial=state["step"],
        desc="train",
        unit="step",
        file=sys.stderr,
        disable=not grp.main,
    )
    logf = open(run / "train.log", "a") if grp.main else open(os.devnull, "w")
    step_times: list[float] = []
    next_eval = (len(state["evals"]) + 1) * eval_minutes * 60 if eval_minutes else None
    while state["step"] < state["steps_total"]:
        step = state["step"]
        if reload and a.reload_every and step % a.reload_every == 0 and step:
            records = reload() or records
            config_extra["training"]["records"] = len(records)
            log(f"step {step}: {len(records)} teacher records")
        t_start = time.perf_counter()
        opt.learning_rate = lr_at(step, state["steps_total"], a.lr, a.warmup)
        rng = np.random.default_rng([a.seed, step])
        idxs = rng.choice(len(records), size=min(seqs_per_step, len(records)), replace=False)
        if batched:
            items = step_items(pm, [records[int(i)] for i in idxs], a.windows_per_seq, a.window, rng, weights, order)
            total = float(sum(it[4].sum() for it in items))  # the whole step's weight, whatever slice is ours
            loss, grads, rows = accumulate(grad_fn, adapter, pm, grp.mine(items), a.window, micro_seqs, total)
        else:
            batch, counts = [], []
            for i, idx in enumerate(idxs):
                rec = records[int(idx)]
                ensure_order(pm, rec, order)  # bins in the step's CDF order before the windows draw u in them
                windows, u, labels, valid = make_windows(rec, a.windows_per_seq, a.window, rng)
                if windows:
                    w = valid * (np.tile(weights, len(windows)) if weights is not None else 1.0)
                    counts.append((i, float(w.sum())))
                    if i % grp.size == grp.rank:  # data parallel: only our slice runs the model
                        batch.append((teacher_kv(pm, rec["tokens"], rec, order), windows, u, labels, valid))
            loss, grads = grad_fn(adapter, batch)
            if grp.size > 1:  # this slice's part of the step's mean
                share = sum(c for i, c in counts if i % grp.size == grp.rank) / max(sum(c for _, c in counts), 1e-9)
                loss, grads = loss * share, tree_map(lambda g, k=share: g * k, grads)
            rows = sum(len(b[1]) * a.window for b in batch)
        if grp.size > 1:  # sync: every process applies the same summed gradient (mx.distributed, docs: dist.py)
            loss, grads = grp.sum(loss), grp.sum(grads)
            rows = int(grp.sum(mx.array(rows)).item())
        opt.update(adapter, grads)
        mx.eval(adapter.parameters(), opt.state, loss)  # sync: one per step
        state["step"] = step + 1
        dt = time.perf_counter() - t_start  # training time only: validation and checkpoints are not counted
        state["seconds"] += dt
        state["rows"] = state.get("rows", 0) + rows
        step_times.append(dt)
        if minutes and len(step_times) >= 3 and len(step_times) % 10 == 3:
            # Size the run from the recent pace (the first steps compile and warm up), again every 10 steps: the
            # cosine schedule then ends near the time budget, and the budget itself is a hard stop.
            left = minutes * 60 - state["seconds"]
            pace = float(np.mean(step_times[-10:] if len(step_times) > 3 else step_times[-1:]))
            state["steps_total"] = grp.agree(min(a.steps, state["step"] + max(0, int(left / pace))))
            bar.total = state["steps_total"]
            if len(step_times) == 3:
                log(f"--minutes {minutes}: {pace:.2f} s a step, about {state['steps_total']} steps")
        if minutes and grp.agree(int(state["seconds"] >= minutes * 60)):  # process 0's clock decides
            state["steps_total"] = state["step"]
        rec_log = {"step": step + 1, "loss": round(loss.item(), 4), "lr": float(opt.learning_rate.item())}
        logf.write(json.dumps({**rec_log, "rows": rows, "seconds": round(dt, 3)}) + "\n")
        bar.set_postfix(loss=f"{loss.item():.3f}", rows_s=f"{rows / dt:.0f}")
        bar.update(1)
        done = state["step"] >= state["steps_total"]
        due = (next_eval is not None and state["seconds"] >= next_eval) or (
            next_eval is None and state["step"] % a.eval_every == 0
        )
        if next_eval is not None and due:
            next_eval += eval_minutes * 60
        if val and (due or done) and grp.main:
            t_ev = time.perf_counter()
            ev = evaluate(pm, adapter, val, eval_width, 8, a.seed, order)
            ev["seconds"] = round(time.perf_counter() - t_ev, 1)
            ev["step"] = state["step"]
            ev["cpu_seconds"] = round(state["seconds"])  # training time so far (validation excluded)
            ev["train_rows"] = state["rows"]
            ev["rows_per_second"] = round(state["rows"] / max(state["seconds"], 1e-9), 1)
            state["evals"].append(ev)
            logf.write(json.dumps({"eval": ev}) + "\n")
            log(
                f"step {state['step']}: val mean accepted {ev['mean_accepted']:.3f} hist {ev['histogram']} "
                f"({ev['rows_per_second']:.0f} rows/s training, {ev['seconds']:.0f} s validating)"
            )
            if state["best"] is None or ev["mean_accepted"] > state["best"]["mean_accepted"]:
                state["best"] = ev
                cfg = make_config(
                    base,
                    adapter,
                    a.rank,
                    a.alpha / a.rank,
                    a.window,
                    name=getattr(a, "name", None),
                    acceptance_histogram=ev["histogram"],
                    acceptance_histograms=ev["histograms"],
                    validation=ev,
                    **{
                        **config_extra,
                        "training": {
                            **config_extra["training"],
                            "steps": state["steps_total"],
                            "best_step": state["step"],
                            "cpu_seconds": round(state["seconds"]),
                        },
                    },
                )
                save_adapter(adapter, cfg, run / "best")
        if (state["step"] % a.save_every == 0 or done) and grp.main:
            _checkpoint(run, adapter, opt, state)
        logf.flush()
    bar.close()
    logf.close()
    if a.out and grp.main:
        src = run / "best" if (run / "best").exists() else None
        if src is None:
            cfg = make_config(base, adapter, a.rank, a.alpha / a.rank, a.window, **config_extra)
            save_adapter(adapter, cfg, Path(a.out))
        else:
            import shutil

            from ..paths import atomic_dir

            with atomic_dir(Path(a.out), overwrite=True) as tmp:
                for f in src.iterdir():
                    shutil.copy2(f, tmp / f.name)
    log(f"trained {state['step']} steps in {state['seconds'] / 3600:.2f} h; best {state['best']}")
    return 0


def _checkpoint(run: Path, adapter: PTPAdapter, opt, state: dict) -> None:
    """Adapter, optimizer state and step, written atomically so an interrupted save leaves the last good one."""
    from ..paths import atomic_dir

    with atomic_dir(run / "last", overwrite=True) as tmp:
        mx.save_safetensors(str(tmp / "adapter.safetensors"), dict(tree_flatten(adapter.trainable_parameters())))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
        (tmp / "state.json").write_text(json.dumps(state))
