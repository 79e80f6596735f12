"""What a lenient acceptance rule costs in quality (``ptp-bench`` with method ``ptp-lenient``): every answer scored
under the base model, teacher-forced at T 1, one pass over prompt and answer: the mean probability of the emitted
tokens and the answers' perplexity. Exact decoding's answers (``ar``, ``ptp``) are the reference: they are the
model's own samples, so a rule that keeps these figures where exact decoding has them keeps the answers as likely
under the model."""

from __future__ import annotations

import math

import mlx.core as mx


def answer_scores(base, prompt_ids: list[int], answer: list[int]) -> tuple[float, float, int]:
    """(sum of log p, sum of p, tokens) of ``answer``'s tokens under ``base`` after ``prompt_ids`` (T 1)."""
    if not answer:
        return 0.0, 0.0, 0
    seq = list(prompt_ids) + list(answer)
    logits = base(mx.array(seq[:-1])[None])[0, len(prompt_ids) - 1 :].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    lp = mx.take_along_axis(logp, mx.array(answer)[:, None], axis=-1)[:, 0]
    mx.eval(lp)  # sync: the scores are host numbers
    return float(lp.sum().item()), float(mx.exp(lp).sum().item()), len(answer)


def quality(records, base) -> dict[str, dict]:
    """Per method: tokens scored, mean base-model probability of the emitted tokens, perplexity of the answers."""
    sums: dict[str, list[float]] = {}
    for r in records:
        lp, p, n = answer_scores(base, r.prompt_ids, r.m.token_ids)
        s = sums.setdefault(r.method, [0.0, 0.0, 0])
        s[0], s[1], s[2] = s[0] + lp, s[1] + p, s[2] + n
    return {
        m: {"tokens": n, "mean_p": p / n if n else 0.0, "perplexity": math.exp(-lp / n) if n else 0.0}
        for m, (lp, p, n) in sums.items()
    }


def quality_line(q: dict[str, dict], labels: dict[str, str]) -> str:
    parts = []
    for m, d in q.items():
        name = f"{m} ({labels[m]})" if m in labels else m
        parts.append(f"{name}: mean p {d['mean_p']:.3f}, perplexity {d['perplexity']:.2f}")
    return "quality under the base model (teacher-forced, T 1): " + " | ".join(parts)
