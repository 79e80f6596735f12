"""SVG snapshots of the chat (pytest-textual-snapshot): fake engine, fixed clock, fixed seed, fixed size.

Update after an intended change with ``pytest tests/test_app_snapshot.py --snapshot-update`` and look at the
SVGs under ``tests/__snapshots__/``.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("pytest_textual_snapshot")

from ptp_mlx.app.chat import ChatApp
from ptp_mlx.app.engine_thread import GenSettings
from ptp_mlx.app.history import ConversationStore
from textual.widgets import Input

from ptp_mlx.testing.chat import FakeEngine, wait_until

SIZE = (100, 32)
ANSWER = [
    "Parallel",
    " token prediction",
    " drafts several",
    " tokens per call",
    ":\n\n",
    "```python\n",
    "def add(a, b):\n",
    "    return a",
    " + b\n```\n\n",
    "Every token",
    " is checked",
    ".",
]
SIZES = [2, 3, 2, 3, 1, 3, 5, 2, 4, 2, 2, 1]  # tokens per block


def chat_app(tmp_path, engine=None, loader=None, store=None) -> ChatApp:
    engine = engine or FakeEngine(blocks=ANSWER, sizes=SIZES)
    return ChatApp(
        loader or (lambda log: engine),
        GenSettings(temperature=0.7, top_k=40, seed=1, max_tokens=64),
        store=store or ConversationStore(tmp_path / "chats"),
        clock=lambda: 0.0,
    )


def steady_cursor(app: ChatApp) -> None:
    """A blinking cursor would make the screenshot depend on timing."""
    app.query_one("#prompt", Input).cursor_blink = False


async def one_exchange(pilot, *keys: str) -> None:
    app = pilot.app
    steady_cursor(app)
    await wait_until(pilot, lambda: app.ready)
    app.query_one("#prompt", Input).value = "How does PTP work?"
    await pilot.press("enter")
    await wait_until(pilot, lambda: app.current is None)
    await pilot.press(*keys)
    app.clear_notifications()
    await pilot.pause()


def test_main_screen(snap_compare, tmp_path):
    assert snap_compare(chat_app(tmp_path), terminal_size=SIZE, run_before=one_exchange)


def test_block_view(snap_compare, tmp_path):
    async def run_before(pilot):
        await one_exchange(pilot, "ctrl+b")

    assert snap_compare(chat_app(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_loading_progress(snap_compare, tmp_path):
    release = threading.Event()

    def slow_loader(log):
        log("converting SmolLM2-135M-Instruct.Q4_1.gguf to an MLX folder (float32) ...")
        release.wait(10)
        return FakeEngine()

    async def run_before(pilot):
        steady_cursor(pilot.app)
        await wait_until(pilot, lambda: "converting" in str(pilot.app.query_one("#status").render()))

    try:
        assert snap_compare(chat_app(tmp_path, loader=slow_loader), terminal_size=SIZE, run_before=run_before)
    finally:
        release.set()


def test_help_screen(snap_compare, tmp_path):
    async def run_before(pilot):
        steady_cursor(pilot.app)
        await wait_until(pilot, lambda: pilot.app.ready)
        await pilot.press("f1")

    assert snap_compare(chat_app(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_notice_above_the_stats_bar(snap_compare, tmp_path):
    """A notice (here: the mode switch) stacks above the status line, input and stats bar, never over them."""

    async def run_before(pilot):
        await one_exchange(pilot)
        await pilot.press("ctrl+t")
        await pilot.pause()

    assert snap_compare(chat_app(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_chat_list(snap_compare, tmp_path, monkeypatch):
    """Ctrl+o: the model's saved chats, newest first, the open one marked."""
    monkeypatch.setenv("TZ", "UTC")  # the list shows local times
    time.tzset()
    clock = iter(range(1_750_000_000, 1_760_000_000, 3600))
    store = ConversationStore(tmp_path / "chats", now=lambda: next(clock))
    for questions in (["What is PTP?", "And is it lossless?"], ["Write a haiku about caches"]):
        conv = store.new()
        for q in questions:
            conv.add_user(q)
            conv.add_answer("Yes.", "ptp", [4], False, calls=[2])
        store.save(conv)
    app = chat_app(tmp_path, store=store)

    async def run_before(pilot):
        steady_cursor(pilot.app)
        await wait_until(pilot, lambda: pilot.app.ready)
        await pilot.press("ctrl+o")
        await pilot.pause()

    try:
        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
    finally:
        monkeypatch.undo()
        time.tzset()
