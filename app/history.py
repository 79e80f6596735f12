"""Chat history: a JSON file in the user data dir, written atomically after every answer."""

from __future__ import annotations

import json
from pathlib import Path

from ptp_mlx.paths import atomic_write_bytes, data_root

HISTORY_FILE = "chat_history.json"
VERSION = 1


def default_history_path() -> Path:
    return data_root() / HISTORY_FILE


class ChatHistory:
    """The turns of the conversation.

    Each turn is a dict: ``{"role": "user", "content": ...}`` or ``{"role": "assistant", "content": ...,
    "mode": "ptp"|"ar", "blocks": [chars per accepted block], "stopped": bool}``.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.turns: list[dict] = []

    def load(self) -> str | None:
        """Read the file if there is one. Returns a warning line when it could not be read (it is then set
        aside as ``*.unreadable`` and the chat starts empty)."""
        if not self.path.exists():
            return None
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            turns = data["turns"]
            if not isinstance(turns, list) or not all(
                isinstance(t, dict) and t.get("role") in ("user", "assistant") and isinstance(t.get("content"), str)
                for t in turns
            ):
                raise ValueError("bad turns")
        except (OSError, ValueError, KeyError, TypeError) as e:
            aside = self.path.with_name(self.path.name + ".unreadable")
            try:
                self.path.replace(aside)
            except OSError:
                aside = self.path
            return f"could not read the chat history ({type(e).__name__}); kept it as {aside} and started fresh"
        self.turns = turns
        return None

    def save(self) -> None:
        data = {"version": VERSION, "turns": self.turns}
        atomic_write_bytes(self.path, (json.dumps(data, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))

    def add_user(self, text: str) -> None:
        self.turns.append({"role": "user", "content": text})

    def add_answer(self, text: str, mode: str, blocks: list[int], stopped: bool) -> None:
        self.turns.append({"role": "assistant", "content": text, "mode": mode, "blocks": blocks, "stopped": stopped})

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

    def clear(self) -> None:
        self.turns = []
        self.path.unlink(missing_ok=True)
