"""Saved conversations: per model, one JSON file per conversation in the user data dir, written atomically.

Layout: ``data_root()/chats/<model key>/<conversation id>.json``. The single ``chat_history.json`` of earlier
versions is moved once into the default model's list (and kept beside it as ``chat_history.json.migrated``).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ptp_mlx.paths import DEFAULT_MODEL_NAME, atomic_write_bytes, data_root

HISTORY_FILE = "chat_history.json"  # the one-conversation file of earlier versions
CHATS_DIR = "chats"
VERSION = 2
TITLE_CHARS = 60
MIGRATED_ID = "migrated-chat-history"  # fixed, so a migration interrupted half-way is not done twice


def default_history_path() -> Path:
    """The legacy single-conversation file (read once, for the migration)."""
    return data_root() / HISTORY_FILE


def model_key(model: str | None) -> str:
    """A folder name for ``--model``: the default model's name, ``org--name`` for a Hugging Face repo id, or a
    local folder's name plus a short hash of its full path (two folders called ``model`` stay apart)."""
    if not model:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.exists():
        digest = hashlib.sha1(str(path.resolve()).encode("utf-8")).hexdigest()[:8]
        key = f"{path.resolve().name}-{digest}"
    else:
        key = model.replace("/", "--")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._") or "model"


def _valid_turns(turns: object) -> bool:
    return isinstance(turns, list) and all(
        isinstance(t, dict) and t.get("role") in ("user", "assistant") and isinstance(t.get("content"), str)
        for t in turns
    )


def _ints(value: object) -> list[int]:
    return [n for n in value if isinstance(n, int) and n >= 0] if isinstance(value, list) else []


def _clean_turn(turn: dict) -> dict:
    """A read turn with its optional fields of the expected types (a hand-edited or damaged field is dropped
    to its empty value, so showing the chat never fails on it)."""
    if turn["role"] == "user":
        return {"role": "user", "content": turn["content"]}
    sources = turn.get("sources")
    tps = turn.get("tps")
    return {
        "role": "assistant",
        "content": turn["content"],
        "mode": turn.get("mode") if turn.get("mode") in ("ptp", "ar") else "ar",
        "blocks": _ints(turn.get("blocks")),
        "calls": _ints(turn.get("calls")),
        "sources": {k: v for k, v in sources.items() if isinstance(v, int)} if isinstance(sources, dict) else {},
        "tps": float(tps) if isinstance(tps, (int, float)) and not isinstance(tps, bool) else None,
        "stopped": bool(turn.get("stopped")),
        "note": turn.get("note") if isinstance(turn.get("note"), str) else "",
    }


@dataclass
class Conversation:
    """The turns of one conversation.

    Each turn is a dict: ``{"role": "user", "content": ...}`` or ``{"role": "assistant", "content": ...,
    "mode": "ptp"|"ar", "blocks": [chars per accepted block], "calls": [tokens decided per model call],
    "sources": {proposer: accepted drafts}, "tps": tokens/s or None, "stopped": bool, "note": str}``.
    ``calls``, ``sources``, ``tps`` and ``note`` are what the live answer's header and the stats bar show; answers
    saved by earlier versions lack them.
    """

    id: str
    turns: list[dict] = field(default_factory=list)
    created: float = 0.0
    updated: float = 0.0

    @property
    def title(self) -> str:
        """The first question on one line, cut to ``TITLE_CHARS``."""
        first = next((t["content"] for t in self.turns if t["role"] == "user"), "")
        line = " ".join(first.split())
        return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"

    def add_user(self, text: str) -> None:
        self.turns.append({"role": "user", "content": text})

    def add_answer(
        self,
        text: str,
        mode: str,
        blocks: list[int],
        stopped: bool,
        calls: list[int] | None = None,
        sources: dict[str, int] | None = None,
        tps: float | None = None,
        note: str = "",
    ) -> None:
        self.turns.append(
            {
                "role": "assistant",
                "content": text,
                "mode": mode,
                "blocks": blocks,
                "calls": list(calls or []),
                "sources": dict(sources or {}),
                "tps": tps,
                "stopped": stopped,
                "note": note,
            }
        )

    def pop_user(self) -> str | None:
        """Remove a trailing user turn that got no answer; returns its text."""
        if self.turns and self.turns[-1]["role"] == "user":
            return self.turns.pop()["content"]
        return None

    def messages(self) -> list[dict]:
        """The conversation for the chat template: role and content only."""
        return [{"role": t["role"], "content": t["content"]} for t in self.turns]

    def last_answer(self) -> str | None:
        for t in reversed(self.turns):
            if t["role"] == "assistant":
                return t["content"]
        return None

    def to_json(self) -> bytes:
        data = {
            "version": VERSION,
            "id": self.id,
            "title": self.title,  # for people reading the folder; recomputed from the turns on load
            "created": self.created,
            "updated": self.updated,
            "turns": self.turns,
        }
        return (json.dumps(data, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


class ConversationStore:
    """One model's saved conversations (a folder of ``<id>.json``). ``legacy``: the old single-conversation file
    to migrate into this list (given for the default model only). ``now``: the wall clock (fixed in tests)."""

    def __init__(self, folder: Path, legacy: Path | None = None, now: Callable[[], float] = time.time) -> None:
        self.folder = Path(folder)
        self.legacy = Path(legacy) if legacy else None
        self.now = now

    def new(self) -> Conversation:
        """An empty conversation; it gets a file with its first answer (empty chats are never saved)."""
        t = self.now()
        cid = time.strftime("%Y%m%d-%H%M%S", time.localtime(t)) + "-" + secrets.token_hex(3)
        return Conversation(cid, [], t, t)

    def path(self, cid: str) -> Path:
        return self.folder / f"{cid}.json"

    def list(self) -> tuple[list[Conversation], list[str]]:
        """Every conversation, most recently updated first, and warning lines for files that could not be read
        (each is set aside as ``*.unreadable``, so it is reported once and not lost)."""
        warnings = [w for w in [self._migrate()] if w]
        out = []
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            try:
                out.append(self._read(path))
            except (OSError, ValueError, KeyError, TypeError) as e:
                warnings.append(f"could not read the saved chat {path.name} ({type(e).__name__}); {_set_aside(path)}")
        out.sort(key=lambda c: (c.updated, c.id), reverse=True)
        return out, warnings

    def save(self, conv: Conversation) -> None:
        """Write the conversation (raises ``OSError``; the app turns it into a notice)."""
        conv.updated = self.now()
        atomic_write_bytes(self.path(conv.id), conv.to_json())

    def delete(self, cid: str) -> None:
        self.path(cid).unlink(missing_ok=True)

    def _read(self, path: Path) -> Conversation:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not _valid_turns(data["turns"]):
            raise ValueError("bad turns")
        cid = path.stem  # the file name wins: a copied file must not act on its twin
        turns = [_clean_turn(t) for t in data["turns"]]
        return Conversation(cid, turns, float(data.get("created", 0)), float(data.get("updated", 0)))

    def _migrate(self) -> str | None:
        """Move the legacy file's conversation into this list, once."""
        if self.legacy is None or not self.legacy.exists():
            return None
        try:
            data = json.loads(self.legacy.read_text(encoding="utf-8"))
            if not _valid_turns(data["turns"]):
                raise ValueError("bad turns")
            turns = [_clean_turn(t) for t in data["turns"]]
            mtime = self.legacy.stat().st_mtime
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"could not read the chat history ({type(e).__name__}); {_set_aside(self.legacy)}"
        try:
            if turns:
                atomic_write_bytes(self.path(MIGRATED_ID), Conversation(MIGRATED_ID, turns, mtime, mtime).to_json())
            # Renamed only after the copy is written: the old file is never the only thing lost.
            self.legacy.replace(self.legacy.with_name(self.legacy.name + ".migrated"))
        except OSError as e:
            return f"could not move the old chat history into the list of chats: {e}"
        return None


def _set_aside(path: Path) -> str:
    aside = path.with_name(path.name + ".unreadable")
    try:
        path.replace(aside)
    except OSError:
        return f"it stays at {path}"
    return f"kept it as {aside}"


def store_for_model(model: str | None) -> ConversationStore:
    """The saved conversations of ``--model`` (None: the default model, which also takes the legacy file)."""
    return ConversationStore(
        data_root() / CHATS_DIR / model_key(model), legacy=default_history_path() if not model else None
    )
