"""What a benchmark run produces: the fixed-format table (stdout), the JSON document and the PNG plot."""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import platform
import subprocess
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from .. import __version__, blas
from ..kernels.extension import gated_state
from ..kernels.graph_tools import state as graph_tools_state
from ..kernels.packed import packed_count
from ..paths import atomic_write_bytes
from ..stats import tree_line
from .metrics import ALL
from .run import BenchRun, Divergence

SCHEMA = "ptp-bench/1"


def draft_figures(records) -> tuple[dict, dict]:
    """Per method, over the timed answers: accepted drafts by proposer, and the token-tree figures (calls and
    tokens by tree size, accepted depth of paths through a strand; ``RunStats.tree_dict``)."""
    sources: dict[str, Counter] = {}
    trees: dict[str, dict[str, Counter]] = {}
    for r in records:
        sources.setdefault(r.method, Counter()).update(r.m.by_source)
        for k, v in r.m.trees.items():
            trees.setdefault(r.method, {}).setdefault(k, Counter()).update(v)
    return (
        {m: dict(c) for m, c in sources.items() if c},
        {m: {k: dict(c) for k, c in t.items()} for m, t in trees.items()},
    )


def draft_lines(doc: dict) -> list[str]:
    """The report's lines on drafts: accepted drafts by source, and tokens per call by tree size."""
    lines = [
        f"{n} accepted drafts by source: " + ", ".join(f"{k} {v}" for k, v in sorted(src.items()))
        for n, src in doc.get("draft_sources", {}).items()
    ]
    lines += [line for n, t in doc.get("trees", {}).items() if (line := tree_line(n, t))]
    return lines


def cpu_name() -> str:
    """The CPU or Apple chip, in the vendor's words."""
    if platform.system() == "Darwin":
        try:
            return (
                subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
                ).stdout.strip()
                or platform.processor()
            )
        except (OSError, subprocess.SubprocessError):
            return platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name() -> str:
    """``cpu`` or ``gpu`` (MLX's default device)."""
    import mlx.core as mx

    return str(mx.default_device().type).split(".")[-1]


def model_dtype(model) -> str:
    """Weight dtype of the model, e.g. ``float32`` or ``4-bit (group 32)``."""
    from ..model.layers import projections

    q = next(iter(projections(model.layers[0]).values()))
    if hasattr(q, "bits"):
        return f"{q.bits}-bit (group {q.group_size})"
    return str(q.weight.dtype).replace("mlx.core.", "")


def adapter_hash(path: str | None) -> str | None:
    """sha256 (16 hex digits) of an adapter folder's config and weights."""
    if not path:
        return None
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter.safetensors"):
        p = Path(path) / name
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def environment(engine, draft_model=None, draft_path: str | None = None) -> dict:
    import mlx.core as mx

    from ..models import model_fingerprint

    try:
        info = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in mx.device_info().items()}
    except Exception:
        info = {}
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "mlx_version": mx.__version__,
        "mlx_lm_version": importlib.metadata.version("mlx-lm"),
        "ptp_mlx_version": __version__,
        "device": device_name(),
        "device_info": info,
        "blas": blas.state["blas"],
        "gated_linear": gated_state(),
        "graph_tools": graph_tools_state(),
        "packed_matrices": packed_count(),
        "malloc": blas.state["malloc"],
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "model": engine.model_path,
        "model_hash": model_fingerprint(engine.pm.base),
        "dtype": model_dtype(engine.pm.base),
        "adapter": engine.adapter_path,
        "adapter_hash": adapter_hash(engine.adapter_path),
        "draft_model": draft_path,
        "draft_model_hash": model_fingerprint(draft_model) if draft_model else None,
    }


def _gated_tag(env: dict) -> str:
    """The header's note of the CPU primitives (kernels/extension.py: the LoRA, attention, norms, heads) where they
    serve the run."""
    tag = " + cpu-ops" if env.get("gated_linear") == "in use" else ""
    n = env.get("packed_matrices") or 0
    return tag + (f" + {n} matrices from codes" if n else "")


def check_doc(
    name: str, ref: str, other: str, compared: int, identical: int, divs: list[Divergence], fatal: bool
) -> dict:
    return {
        "name": name,
        "reference": ref,
        "method": other,
        "compared": compared,
        "identical": identical,
        "near_ties": sum(d.near_tie for d in divs),
        "ok": all(d.near_tie for d in divs),
        "fatal": fatal,
        "divergences": [asdict(d) for d in divs],
    }


def build_json(
    settings: dict, env: dict, prompts, run: BenchRun, summary: dict, checks: list[dict], cost: dict | None
) -> dict:
    """The JSON document: settings, environment, every raw record, the summary, checks and the cost curve."""
    return {
        "schema": SCHEMA,
        "complete": not run.interrupted,
        "interrupted": run.interrupted,
        "settings": settings,
        "environment": env,
        "prompts": [{"question_id": p.question_id, "category": p.category, "turns": len(p.turns)} for p in prompts],
        "prompts_complete": list(run.complete),
        "prompts_skipped": list(run.skipped),
        "warmup_time": run.warmup_time,
        "records": [r.to_json() for r in run.records],
        "summary": summary,
        "checks": checks,
        "cost_curve": cost,
    }


def _write(path: str | Path, data: bytes) -> None:
    """Atomic write with the permissions of an ordinary new file (the temporary file is private, 0600)."""
    atomic_write_bytes(Path(path), data)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_json(path: str | Path, doc: dict) -> None:
    _write(path, (json.dumps(doc, indent=1) + "\n").encode())


def _f(x: float | None, spec: str, width: int) -> str:
    return (format(x, spec) if x is not None else "-").rjust(width)


def table(doc: dict) -> str:
    """The fixed-format report printed on stdout."""
    s, env, summ = doc["settings"], doc["environment"], doc["summary"]
    samp = "greedy" if s["greedy"] else f"temp {s['temp']} top-k {s['top_k']} top-p {s['top_p']} seed {s['seed']}"
    lines = [
        f"ptp-bench | {Path(str(env['model'])).name} ({env['dtype']}) | {env['device']} | blas "
        f"{env['blas'].split(':')[0]}{_gated_tag(env)} | {samp} | max {s['max_tokens']} tokens | "
        f"{len(doc['prompts_complete'])} prompts x "
        + (f"{s['seeds']} seeds" if s.get("seeds") else f"{s['repeats']} repeat(s)")
        + (" | INTERRUPTED" if doc["interrupted"] else ""),
        f"{'method':<13}{'category':<16}{'prompts':>8}{'tokens':>8}{'tok/call':>10}{'tok/s':>9}{'speedup':>9}"
        f"{'decode tok/s':>14}{'CPU ms/tok':>12}{'peak GB':>9}",
    ]
    for m, figs in summ.items():
        for c in [c for c in figs if c != ALL] + [ALL]:
            f = figs[c]
            sp = f"{f['speedup']:.2f}x" if f["speedup"] is not None else "-"
            lines.append(
                f"{m:<13}{c:<16}{f['prompts']:>8}{f['tokens']:>8}{_f(f['mean_accepted'], '.2f', 10)}"
                f"{_f(f['tokens_per_s'], '.2f', 9)}{sp:>9}{_f(f['decode_tokens_per_s'], '.2f', 14)}"
                f"{_f(f['cpu_ms_per_token'], '.1f', 12)}{_f(f['peak_memory_gb'], '.2f', 9)}"
            )
    cost = doc.get("cost_curve")
    if cost:
        pts = " ".join(f"{w}:{r:.2f}" for w, r in zip(cost["widths"], cost["relative"], strict=True))
        lines.append(f"cost curve (forward time vs 1 row, {cost['seconds'][0] * 1e3:.1f} ms): {pts}")
    for sk in doc.get("prompts_skipped", []):
        lines.append(f"skipped: {sk['reason']}")
    for c in doc["checks"]:
        status = "ok" if c["ok"] else "DIFFERS"
        ties = c.get("near_ties", 0)
        tie_note = f", {ties} parted at a float near-tie" if ties else ""
        lines.append(
            f"{c['name']} ({c['method']} == {c['reference']}): {c['identical']}/{c['compared']} "
            f"answers identical{tie_note}: {status}"
        )
        for d in c["divergences"]:
            lines.append("  " + Divergence(**d).describe(c["reference"], c["method"]))
    return "\n".join(lines)


def write_plot(path: str | Path, doc: dict) -> None:
    """PNG: speedup and tokens per call per category and method, and the cost curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = doc["summary"]
    methods = list(summ)
    cats = sorted({c for figs in summ.values() for c in figs if c != ALL}) + [ALL]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / max(1, len(methods))
    for ax, key, title in (
        (axes[0], "speedup", "speedup vs mlx-lm (tokens/s ratio)"),
        (axes[1], "mean_accepted", "mean accepted tokens per call"),
    ):
        for i, m in enumerate(methods):
            vals = [(summ[m].get(c) or {}).get(key) or 0.0 for c in cats]
            bars = ax.bar([j + (i - (len(methods) - 1) / 2) * width for j in range(len(cats))], vals, width, label=m)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(cats)), cats, rotation=20)
        ax.set_title(title)
        ax.margins(y=0.12)
    cost = doc.get("cost_curve")
    ax = axes[2]
    if cost:
        ws, rel = cost["widths"], cost["relative"]
        ax.plot(ws, rel, "o-", label="measured")
        ax.plot(ws, ws, ls=":", color="grey", label="linear (rows x 1-row time)")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="flat")
        ax.set_ylim(0, max(rel) * 1.3 + 0.5)
        ax.set_xlabel("rows in the forward pass")
        ax.set_ylabel(f"time relative to 1 row ({cost['seconds'][0] * 1e3:.1f} ms)")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "cost curve not measured", ha="center", va="center")
    ax.set_title("cost curve")
    env = doc["environment"]
    fig.suptitle(
        f"{Path(str(env['model'])).name} ({env['dtype']}) on {env['cpu']} | {env['device']} | "
        f"blas {env['blas'].split(':')[0]}{_gated_tag(env)}" + (" | interrupted" if doc["interrupted"] else ""),
        fontsize=10,
    )
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncols=max(1, len(methods)), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    _write(path, buf.getvalue())


def curve_line(curve) -> str:
    """One line on the cost curve the budget uses: where it came from, how far learning moved it, a few widths."""
    d = curve.to_dict()
    at = ", ".join(f"{w}: {curve(w):.2f}" for w in (2, 4, 8, 16))
    src = d.get("source", "flat")
    moved = f", moved {d['moved']:.2f}x by {d['calls']} measured calls" if "moved" in d else ""
    return f"cost curve in use ({src}{moved}): {at} steps"
