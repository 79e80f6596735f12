"""Prompt files and teacher-data records for distillation.

Prompt files are JSONL with ``turns`` (Spec-Bench / dev-prompt schema). Teacher records are JSONL, one
completion per line: ``{"prompt_id", "tokens": [...prompt+completion...], "start": n_prompt,
"left": [...], "right": [...], "settings": {...}}``, where ``left``/``right`` are the bins of each completion
token in the id-sorted CDF of the exact sampler (docs/method.md, section 6, step 1).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..cli_common import UserError


def is_validation(prompt_id: str) -> bool:
    """The project's fixed validation split: ids ending in 0 or 5 are never trained on."""
    return str(prompt_id)[-1:] in ("0", "5")


def read_prompts(path: Path, split: str = "all") -> list[dict]:
    """Prompts from a JSONL file; ``split`` is ``all``, ``train`` or ``val`` (see ``is_validation``)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{n}: not valid JSON") from None
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise UserError(f"{path}:{n}: needs a non-empty list of strings under 'turns'")
        pid = str(row.get("id", row.get("question_id", n)))
        if split == "train" and is_validation(pid) or split == "val" and not is_validation(pid):
            continue
        out.append({"id": pid, "category": row.get("category", "other"), "turns": turns})
    return out


def read_records(path: Path) -> list[dict]:
    """Teacher records from a JSONL file written by ``pregenerate`` (a torn last line is ignored)."""
    recs = []
    path = Path(path)
    if not path.exists():
        return recs
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted run
    return recs
