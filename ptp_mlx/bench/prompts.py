"""Benchmark prompts in Spec-Bench's JSONL schema: one object a line with ``question_id``, ``category``, ``turns``.

Multi-turn questions are asked turn by turn; each method answers in its own conversation, so the chat holds
that method's earlier answers (``messages_for``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

BUNDLED = Path(__file__).resolve().parent.parent / "data" / "bench_prompts.jsonl"


@dataclass(frozen=True)
class Prompt:
    question_id: str
    category: str
    turns: tuple[str, ...]


def default_prompts_path() -> Path:
    """The bundled dev prompts (8 per category, held out of adapter training)."""
    return BUNDLED


def parse_prompts(lines, source: str = "<prompts>") -> list[Prompt]:
    """Parse JSONL lines; any malformed line is a ``UserError`` naming the file and line."""
    out: list[Prompt] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{source}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise UserError(f"{source}:{n}: expected a JSON object")
        # Spec-Bench names it question_id; the project's dev prompts call it id.
        qid = obj.get("question_id", obj.get("id"))
        turns = obj.get("turns")
        cat = obj.get("category", "default")
        if qid is None:
            raise UserError(f"{source}:{n}: missing 'question_id'")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise UserError(f"{source}:{n}: 'turns' must be a non-empty list of non-empty strings")
        if not isinstance(cat, str) or not cat:
            raise UserError(f"{source}:{n}: 'category' must be a non-empty string")
        qid = str(qid)
        if qid in seen:
            raise UserError(f"{source}:{n}: duplicate question_id {qid!r}")
        seen.add(qid)
        out.append(Prompt(qid, cat, tuple(turns)))
    return out


def load_prompts(
    path: str | Path | None = None, limit: int | None = None, categories: list[str] | None = None
) -> list[Prompt]:
    """Load, filter by category, and take ``limit`` prompts round-robin over categories.

    Round-robin (in order of first appearance) keeps every category in a short run: ``--limit 6`` on the
    bundled file gives two prompts of each of its three categories.
    """
    p = Path(path) if path else default_prompts_path()
    if not p.is_file():
        raise UserError(f"prompt file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompt file {p}: {e}") from None
    prompts = parse_prompts(text.splitlines(), str(p))
    if not prompts:
        raise UserError(f"no prompts in {p}")
    if categories:
        known = sorted({q.category for q in prompts})
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise UserError(f"unknown categories {', '.join(unknown)} in {p} (known: {', '.join(known)})")
        prompts = [q for q in prompts if q.category in categories]
    by_cat: dict[str, list[Prompt]] = {}
    for q in prompts:
        by_cat.setdefault(q.category, []).append(q)
    mixed: list[Prompt] = []
    queues = list(by_cat.values())
    while any(queues):
        for qu in queues:
            if qu:
                mixed.append(qu.pop(0))
    return mixed[:limit] if limit else mixed


def messages_for(prompt: Prompt, turn: int, answers: list[str]) -> list[dict]:
    """Chat messages for ``turn``: earlier user turns interleaved with this method's own ``answers``."""
    msgs: list[dict] = []
    for i in range(turn):
        msgs.append({"role": "user", "content": prompt.turns[i]})
        msgs.append({"role": "assistant", "content": answers[i]})
    msgs.append({"role": "user", "content": prompt.turns[turn]})
    return msgs
