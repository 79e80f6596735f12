"""``ptp-train study``: the recipe study's table and plot from training runs' validation logs.

Every run folder (``ptp-train train --run DIR --val FILE``) logs its validations to ``train.log``; with the whole
held-out file as ``--val`` they are all on one metric. This collects them into ``study.json``, a Markdown table
(``study.md``: each run's recipe, CPU-hours and its last validation, greedy and sampled apart) and a plot
(``study.png``: tokens per window and slot-1 accuracy against CPU-hours, greedy and sampled in separate panels).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from ..paths import atomic_write_bytes

RECIPE_KEYS = ("init", "rank", "window", "cdf_order", "slot_weights", "data", "steps", "lr")


def _recipe(cfg: dict) -> dict:
    """What an adapter config records of its recipe."""
    training = cfg.get("training", {})
    recipe = {k: training.get(k) for k in RECIPE_KEYS}
    recipe["cdf_order"] = cfg.get("cdf_order", training.get("cdf_order", "id"))
    recipe["rank"] = cfg.get("rank", recipe["rank"])
    recipe["window"] = recipe["window"] or cfg.get("window")
    recipe["u_embedding"] = cfg.get("u_embedding", "binary")
    if isinstance(recipe["data"], list):
        recipe["data"] = "+".join(Path(f).stem for f in recipe["data"])
    return recipe


def _mode_mean(hist: list[int]) -> float:
    n = sum(hist)
    return 1.0 + sum(k * h for k, h in enumerate(hist)) / n if n else float("nan")


def _point(ev: dict, hours: float) -> dict:
    by_mode = ev.get("slot_accuracy_by_mode", {})
    return {
        "step": ev.get("step"),
        "cpu_hours": round(hours, 3),
        "tokens_per_window": round(ev["mean_accepted"], 4),
        "slot1": ev["slot_accuracy"][1],
        **{f"tokens_per_window_{m}": round(_mode_mean(h), 4) for m, h in ev.get("histograms", {}).items()},
        **{f"slot1_{m}": acc[1] for m, acc in by_mode.items()},
    }


def read_run(run: Path) -> dict | None:
    """One run's recipe and validation points (``None`` when it has not validated yet)."""
    log = run / "train.log"
    if not log.is_file():
        return None
    evals = []
    for line in log.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "eval" in row:
            evals.append(row["eval"])
    if not evals:
        return None
    cfg_path = run / "best" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    recipe = _recipe(cfg)
    notes_path = run / "study.json"  # optional: what the run's command line does not record (its data)
    if notes_path.is_file():
        recipe.update(json.loads(notes_path.read_text()))
    points = [_point(ev, ev.get("cpu_seconds", 0) / 3600) for ev in evals]
    return {"name": run.name, "recipe": recipe, "points": points, "last": points[-1]}


def baseline_run(name: str, eval_json: Path, recipe: dict | None = None) -> dict:
    """An adapter scored by ``ptp-train eval`` as a run of one point at 0 CPU-hours (where continued runs start)."""
    try:
        ev = json.loads(Path(eval_json).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read the evaluation {eval_json}: {e}") from None
    p = _point(ev, 0.0)
    cfg_path = Path(ev.get("adapter", "")) / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text()) if ev.get("adapter") and cfg_path.is_file() else {}
    full = {**_recipe(cfg), "init": "baseline", **(recipe or {})}
    return {"name": name, "recipe": full, "points": [p], "last": p}


def collect(runs_dir: Path, baseline: dict | None = None) -> list[dict]:
    runs = [r for d in sorted(Path(runs_dir).iterdir()) if d.is_dir() and (r := read_run(d))]
    if baseline:
        runs.insert(0, baseline)
    if not runs:
        raise UserError(f"no run with validations under {runs_dir}")
    return runs


def table(runs: list[dict]) -> str:
    head = (
        "| run | init | rank | window | u-embedding | CDF order | slot weights | data | CPU-h | tokens/window | greedy "
        "| sampled | slot-1 | slot-1 greedy | slot-1 sampled |\n" + "|---" * 15 + "|\n"
    )
    rows = []
    for r in runs:
        c, p = r["recipe"], r["last"]
        init = c["init"] if c.get("init") == "baseline" else "shipped" if c.get("init") else "scratch"
        rows.append(
            f"| {r['name']} | {init} | {c.get('rank')} | {c.get('window')} | {c.get('u_embedding') or 'binary'} | "
            f"{c.get('cdf_order') or 'id'} | "
            f"{c.get('slot_weights') or 'flat'} | {c.get('data') or ''} | {p['cpu_hours']:.2f} | "
            f"{p['tokens_per_window']:.3f} | {p.get('tokens_per_window_greedy', float('nan')):.3f} | "
            f"{p.get('tokens_per_window_sampled', float('nan')):.3f} | {p['slot1']:.3f} | "
            f"{p.get('slot1_greedy', float('nan')):.3f} | {p.get('slot1_sampled', float('nan')):.3f} |"
        )
    return head + "\n".join(rows) + "\n"


def plot(runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for col, mode in enumerate(("greedy", "sampled")):
        for row, (key, label) in enumerate((("tokens_per_window", "tokens per window"), ("slot1", "slot-1 accuracy"))):
            ax = axes[row][col]
            for r in runs:
                xs = [p["cpu_hours"] for p in r["points"]]
                ys = [p.get(f"{key}_{mode}", float("nan")) for p in r["points"]]
                style = "--" if r["recipe"].get("init") and r["recipe"]["init"] != "baseline" else "-"
                ax.plot(xs, ys, style, marker="o", label=r["name"])
            ax.set_title(f"{label}, {mode} (held-out)")
            ax.grid(alpha=0.3)
            if row == 1:
                ax.set_xlabel("CPU-hours of this run (dashed: continued from the shipped adapter)")
    axes[0][1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(out)


def write(runs: list[dict], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "study.json", (json.dumps(runs, indent=1) + "\n").encode())
    atomic_write_bytes(out_dir / "study.md", table(runs).encode())
    plot(runs, out_dir / "study.png")
