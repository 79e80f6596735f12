"""The figures of the report, computed from the raw records (Spec-Bench's definitions).

- tokens/s: per prompt, generated tokens over wall time (all turns and repeats of that prompt summed), then
  the mean over prompts;
- mean accepted tokens per call: pooled over every call, each call counting the tokens it settled
  (accepted drafts + 1), so autoregressive decoding is exactly 1.0;
- speedup: a method's tokens/s over the baseline's (``mlx-lm``) in the same category;
- decode tokens/s: the same as tokens/s but without the first call (prefill), for reference;
- CPU ms per token: process CPU time over generated tokens, pooled. On a CPU-only machine shared with other
  work it compares methods more steadily than wall time (on Metal the GPU's time is not in it).
"""

from __future__ import annotations

from collections import defaultdict

from .run import Record

ALL = "all"


def _per_prompt(recs: list[Record]) -> dict[str, dict]:
    acc: dict[str, dict] = defaultdict(lambda: {"tokens": 0, "wall": 0.0, "dec_tokens": 0, "dec_wall": 0.0})
    for r in recs:
        a = acc[r.question_id]
        n = len(r.m.token_ids)
        a["tokens"] += n
        a["wall"] += r.m.wall_time
        a["dec_tokens"] += max(0, n - r.m.first_tokens)
        a["dec_wall"] += max(0.0, r.m.wall_time - r.m.first_time)
    return acc


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def method_figures(recs: list[Record]) -> dict:
    """Figures of one method over ``recs`` (one category or all)."""
    pp = _per_prompt(recs)
    tps = {q: a["tokens"] / a["wall"] if a["wall"] > 0 else 0.0 for q, a in pp.items()}
    dec = [a["dec_tokens"] / a["dec_wall"] for a in pp.values() if a["dec_wall"] > 0 and a["dec_tokens"] > 0]
    calls = sum(r.m.calls for r in recs)
    return {
        "prompts": len(pp),
        "answers": len(recs),
        "tokens": sum(len(r.m.token_ids) for r in recs),
        "calls": calls,
        "wall_time": sum(r.m.wall_time for r in recs),
        "mean_accepted": sum(r.m.accepted_sum for r in recs) / calls if calls else 0.0,
        "tokens_per_s": _mean(list(tps.values())),
        "decode_tokens_per_s": _mean(dec),
        "cpu_ms_per_token": 1e3 * sum(r.m.cpu_time for r in recs) / max(1, sum(len(r.m.token_ids) for r in recs)),
        "peak_memory_gb": max((r.m.peak_memory for r in recs), default=0.0),
        "per_prompt_tokens_per_s": tps,
        "speedup": None,
    }


def summarize(records: list[Record], complete: list[str], methods: list[str], baseline: str = "mlx-lm") -> dict:
    """``{method: {category | "all": figures}}`` over the prompts every method finished."""
    done = set(complete)
    recs = [r for r in records if r.question_id in done]
    cats = sorted({r.category for r in recs})
    out: dict[str, dict] = {}
    for m in methods:
        mine = [r for r in recs if r.method == m]
        if not mine:
            continue
        out[m] = {c: method_figures([r for r in mine if r.category == c]) for c in cats}
        out[m][ALL] = method_figures(mine)
    base = out.get(baseline)
    for figs in out.values():
        for c, f in figs.items():
            b = base.get(c) if base else None
            if b and b["tokens_per_s"] > 0:
                f["speedup"] = f["tokens_per_s"] / b["tokens_per_s"]
    return out
