"""Shared pieces of the chat tests (``tests/test_app*.py``): a fake engine with ``Engine``'s surface, the app on it,
and Pilot helpers. Tests only."""

from __future__ import annotations

import json
import threading
import time

from textual.widgets import Input

from ..app.chat import ChatApp
from ..app.engine_thread import GenSettings
from ..app.history import ConversationStore
from ..app.widgets import AnswerView
from ..generate import GenerationStep

BLOCKS = ["Hello", " there", ", how", " can I", " help?"]


class FakeEngine:
    """Same surface as ``Engine``: PTP yields the given blocks (one token per character), AR one character
    per call. With ``gate``, every block waits for one ``gate.release()`` so a test can step through."""

    def __init__(
        self,
        blocks=BLOCKS,
        has_adapter=True,
        gate: threading.Semaphore | None = None,
        error: Exception | None = None,
        sizes: list[int] | None = None,
        eos: bool = False,
        sources: list[str | None] | None = None,
    ):
        self.blocks = list(blocks)
        self.sizes = sizes or [len(b) for b in blocks]  # tokens per PTP block
        self._has_adapter = has_adapter
        self.gate = gate
        self.error = error
        self.calls: list[dict] = []
        self.model_path = "fake-model"
        self.adapter_path = "fake-adapter" if has_adapter else None
        self.closed = threading.Event()
        self.eos = eos  # the last PTP call also decided an end-of-answer token (counted, not shown)
        self.sources = sources or ["ptp"] * len(self.blocks)  # who proposed each PTP block's drafts

    @property
    def has_adapter(self) -> bool:
        return self._has_adapter

    def default_mode(self) -> str:
        return "ptp" if self._has_adapter else "ar"

    def generate(self, prompt, mode=None, sampling=None, max_tokens=256, accept=None):
        self.calls.append(
            {"messages": list(prompt), "mode": mode, "sampling": sampling, "max_tokens": max_tokens, "accept": accept}
        )
        if self.error is not None:
            raise self.error
        return self._steps(mode)

    def _steps(self, mode):
        if mode == "ptp":
            blocks, sizes, sources = self.blocks, self.sizes, self.sources
        else:
            blocks = list("".join(self.blocks))
            sizes = [1] * len(blocks)
            sources = [None] * len(blocks)
        generated = 0
        try:
            for i, (text, n, source) in enumerate(zip(blocks, sizes, sources, strict=True)):
                if self.gate is not None and not self.gate.acquire(timeout=10):
                    return
                generated += n
                last = i == len(blocks) - 1
                yield GenerationStep(
                    tokens=list(range(n)),
                    text=text,
                    accepted=n - 1 + (last and self.eos and mode == "ptp"),
                    proposed=n,
                    generated=generated,
                    elapsed=0.1 * (i + 1),
                    finish_reason="stop" if last else None,
                    source=source,
                )
        finally:
            self.closed.set()


def make_app(engine=None, tmp_path=None, **kw) -> ChatApp:
    engine = engine or FakeEngine()
    kw.setdefault("store", ConversationStore(tmp_path / "chats") if tmp_path else None)
    return ChatApp(lambda log: engine, GenSettings(max_tokens=64), **kw)


async def wait_until(pilot, cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)


async def wait_answered(pilot, app) -> None:
    """Until the answer is finished and shown: ``current`` is cleared before the last awaits of finishing
    (Markdown flush, header), and the status line leaves "answering" only after them."""
    await wait_until(pilot, lambda: app.current is None and not app._status_text.startswith("answering"))


async def send(pilot, text: str) -> None:
    app = pilot.app
    await wait_until(pilot, lambda: app.ready or app.load_error)
    app.query_one("#prompt", Input).value = text
    await pilot.press("enter")


def saved_chats(tmp_path) -> list[list[dict]]:
    """The turns of every saved chat under ``tmp_path/chats``, oldest file name first."""
    return [json.loads(f.read_text())["turns"] for f in sorted((tmp_path / "chats").glob("*.json"))]


def answers(app) -> list[AnswerView]:
    return list(app.query(AnswerView))


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]
