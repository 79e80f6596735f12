"""Prompt files and teacher-data records for distillation.

Prompt files are JSONL with ``turns`` (Spec-Bench / dev-prompt schema). Teacher records are JSONL, one
completion per line: ``{"prompt_id", "tokens": [...prompt+completion...], "start": n_prompt,
"left": [...], "right": [...], "settings": {...}}``, where ``left``/``right`` are the bins of each completion
token in the id-sorted CDF of the exact sampler (docs/method.md, section 6, step 1).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError


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


def read_records(path: Path, log=None) -> list[dict]:
    """Teacher records from a JSONL file written by ``pregenerate`` or ``corpus`` ([] if there is no file yet).

    A cut-off last line (an interrupted writer) is skipped with a notice; any other bad line is an error naming
    its line number."""
    recs = []
    path = Path(path)
    if not path.exists():
        return recs
    text = path.read_text()
    lines = text.split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) and not text.endswith("\n"):  # the last line, never finished
                if log:
                    log(f"notice: {path}:{n}: skipping a cut-off last line")
                continue
            raise UserError(f"{path}:{n}: not a valid teacher record (bad JSON)") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("tokens"), list) or "start" not in rec:
            raise UserError(f"{path}:{n}: not a teacher record (needs 'tokens' and 'start')")
        recs.append(rec)
    return recs
