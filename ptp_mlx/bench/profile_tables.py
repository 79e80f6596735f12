"""The profile's tables (``ptp-bench --profile``): one line per kind of call, the compiled graphs' primitives, and
the token-tree shapes the default drafter used."""

from __future__ import annotations

PHASES = ("plan", "build", "queue", "chain", "compute", "read+trim", "update")


def tree_menu(shapes) -> str:
    """The token-tree layouts a budget's ``ShapeMemory`` used, and the compiled graphs they ran on (one per row
    counts and attention bucket: layouts with the same counts share one)."""
    from ..drafting.shapes import MAX_TREE_SHAPES

    trees = getattr(shapes, "trees", {})
    graphs = len(getattr(shapes, "tree_graphs", ()))

    def strand(at: int, k: int, w: int, parent: int) -> str:
        return f"{at}:{k}+{w}" + (f"^{parent}" if parent >= 0 else "")

    used = "; ".join(
        f"{n} drafts + strands {' '.join(strand(*st) for st in sig)} ({calls} calls)"
        for (n, _, sig), calls in sorted(trees.items(), key=lambda kv: -kv[1])[:8]
    )
    head = (
        f"token-tree layouts used: {len(trees)} on {graphs} compiled graphs (at most {MAX_TREE_SHAPES}; "
        "strand at:tokens+window, ^k: a strand of strand k)"
    )
    return head + (f": {used}" if used else "")


def default_lines(learnt, always=None) -> str:
    """What the default drafter's rows say: how many of its calls were chained, why the others were built after the
    read, and, beside the choice this machine learnt, building ahead always (its chained share and host time on
    the path where building ahead pays, and what it costs or saves here)."""

    def share(r) -> str:
        return f"{r.calls} PTP calls (bursts aside), {r.chained} of them chained ({100 * r.chained / max(1, r.calls):.0f}%)"

    text = f"ptp default: {share(learnt)}; rows and phases are medians over its calls, whose shapes vary"
    if learnt.why:
        text += "\nbuilt after the read: " + ", ".join(f"{v} {k}" for k, v in learnt.why.items())
    if always is not None:
        text += (
            f"\nptp default, built ahead always: {share(always)}, host on path {always.host_on_path:.2f} ms median; "
            f"the answer {always.ms_per_token:.2f} ms per token against {learnt.ms_per_token:.2f} as learnt here"
        )
    return text


def profile_table(rows: list, ar_ms: float, header: str) -> str:
    """The fixed-format table of ``profile.ProfileRow``s: one line per kind of call, milliseconds per call, and the
    ratio to an AR step."""
    cols = ["call", "rows", "calls"] + list(PHASES) + ["host on path", "wall - compute", "total ms", "x ar step"]
    cols += ["tokens/call"]
    lines = [header, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        ph = [f"{r.phases[k]:.2f}" if k in r.phases else "" for k in PHASES]
        if "compute" not in r.phases:  # pipelined steps: compute measured with the steps queued back to back
            ph[PHASES.index("compute")] = f"({r.compute:.2f})"
        ph += [f"{r.host_on_path:.2f}", f"{r.wall_minus_compute:.2f}"]
        lines.append(
            "| "
            + " | ".join(
                [r.name, str(r.rows), str(r.calls)]
                + ph
                + [f"{r.total:.2f}", f"{r.total / ar_ms:.2f}", f"{r.tokens_per_call:.2f}"]
            )
            + " |"
        )
    return "\n".join(lines)


def primitives_table(prims: dict[str, tuple[int, int]], layers: int, compiled: bool, entries: int) -> str:
    """Compute primitives and views in one call's graph per kind of call, and the PTP calls' excess per layer
    over our autoregressive step."""
    base = prims.get("ar", prims["mlx-lm"])[0]
    kind = "compiled" if compiled else "eager"
    lines = [
        f"primitives per call ({kind}; {layers} layers; compile bank after the profile: {entries} entries)",
        "| call | compute primitives | views | more per layer than our ar step |",
        "|---|---|---|---|",
    ]
    for name, (comp, views) in prims.items():
        lines.append(f"| {name} | {comp} | {views} | {(comp - base) / layers:+.1f} |")
    return "\n".join(lines)
