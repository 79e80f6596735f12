"""The Textual chat (``ptp-chat``) driven with ``App.run_test`` and Pilot on a fake engine: streaming, stopping,
modes and the lenient switch, notices, load errors, blocks, help and the command line. Saved chats:
``test_app_history.py``; the tiny real model: ``test_app_real.py``."""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import pytest

from ptp_mlx.generate import ContextFull

pytest.importorskip("textual")

from ptp_mlx.app.chat import ChatApp
from ptp_mlx.app.engine_thread import GenSettings
from ptp_mlx.app.history import (
    ConversationStore,
    default_history_path,
    store_for_model,
)
from ptp_mlx.app.main import main
from ptp_mlx.app.widgets import BlocksView, HelpScreen, StatsBar, UserMessage, sparkline, split_blocks
from textual.widgets import Input, Markdown
from textual.widgets._markdown import MarkdownFence

from ptp_mlx.decode.accept import SUGGESTED, AcceptRule
from ptp_mlx.errors import UserError
from ptp_mlx.testing.chat import (
    BLOCKS,
    FakeEngine,
    answers,
    make_app,
    notes,
    saved_chats,
    send,
    wait_answered,
    wait_until,
)

pytestmark = pytest.mark.anyio


async def test_streams_blocks_in_order(tmp_path):
    gate = threading.Semaphore(0)
    app = make_app(FakeEngine(gate=gate, eos=True), tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await send(pilot, "hi")
        answer = answers(app)[0]
        for i in range(len(BLOCKS)):
            assert answer.blocks == BLOCKS[:i]  # nothing shown ahead of the engine
            gate.release()
            await wait_until(pilot, lambda i=i: len(answer.blocks) == i + 1)
            assert answer.blocks == BLOCKS[: i + 1]
        await wait_answered(pilot, app)
        assert answer.query_one(Markdown).source == "".join(BLOCKS)
        assert answer.finished and not answer.stopped
        assert app.histogram == {5: 2, 6: 2, 7: 1}  # tokens per call -> calls (the last one decided the end)
        # The header counts what the stats bar counts: 28 shown tokens + the end token, 29 / 5 = 5.80 tok/call.
        assert str(answer.query_one(".answer-header").render()) == "PTP · 29 tokens in 5 calls"
        assert "5.80 tok/call" in str(app.query_one(StatsBar).render())
        assert app.query_one("#prompt", Input).value == ""


async def test_a_paste_of_several_lines_is_kept_whole(tmp_path):
    # Textual's Input kept only a paste's first line: the rest, and the question at its end, were dropped unsaid.
    from textual import events

    app = make_app(FakeEngine(eos=True), tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        prompt = app.query_one("#prompt", Input)
        prompt.post_message(events.Paste("Line 1: some text\n\n  Line 2: more\nWhat do these lines say?"))
        await pilot.pause()
        assert prompt.value == "Line 1: some text Line 2: more What do these lines say?"
        prompt.post_message(events.Paste(" one line"))
        await pilot.pause()
        assert prompt.value.endswith("say? one line")


async def test_the_help_scrolls_in_a_small_window(tmp_path):
    # At 80 x 24 the last keys and "Press esc to close" were cut off, with no way to scroll to them.
    from textual.containers import VerticalScroll

    app = make_app(FakeEngine(eos=True), tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f1")
        await pilot.pause()
        box = app.screen.query_one("#help", VerticalScroll)
        assert box.max_scroll_y > 0 and box.scroll_y == 0
        await pilot.press("end")
        await pilot.pause()
        assert box.scroll_y == box.max_scroll_y


async def test_slow_blas_is_said_in_the_stats_bar(tmp_path, monkeypatch):
    from ptp_mlx import blas

    app = make_app(FakeEngine(eos=True), tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.pause()
        assert "SLOW BLAS" not in str(app.query_one(StatsBar).render()) or blas.is_slow()
        monkeypatch.setitem(blas.state, "blas", "reference")
        await send(pilot, "hi")
        await wait_answered(pilot, app)
        assert "SLOW BLAS: pip install mkl" in str(app.query_one(StatsBar).render())


async def test_escape_stops_and_keeps_partial_answer(tmp_path):
    gate = threading.Semaphore(0)
    engine = FakeEngine(gate=gate)
    app = make_app(engine, tmp_path)
    async with app.run_test() as pilot:
        await send(pilot, "hi")
        answer = answers(app)[0]
        gate.release(2)
        await wait_until(pilot, lambda: len(answer.blocks) == 2)
        await pilot.press("escape")
        assert app.current is None and answer.finished and answer.stopped
        gate.release(10)  # the engine thread may compute one more block: it is dropped, then generation closes
        await asyncio.get_running_loop().run_in_executor(None, engine.closed.wait, 10)
        await pilot.pause(0.1)
        assert answer.blocks == BLOCKS[:2]
        assert answer.query_one(Markdown).source == "".join(BLOCKS[:2])
        assert "stopped" in str(app.query_one("#status").render())
    [saved] = saved_chats(tmp_path)
    assert saved[-1] == {
        "role": "assistant",
        "content": "Hello there",
        "mode": "ptp",
        "blocks": [5, 6],
        "calls": [5, 6],
        "sources": {"ptp": 9},
        "tps": 11 / 0.2,
        "stopped": True,
        "note": "",
    }


async def test_quit_while_answering_saves_the_partial_answer(tmp_path):
    gate = threading.Semaphore(0)
    app = make_app(FakeEngine(gate=gate), tmp_path)
    async with app.run_test() as pilot:
        await send(pilot, "hi")
        gate.release(1)
        await wait_until(pilot, lambda: len(answers(app)[0].blocks) == 1)
        threading.Timer(0.3, gate.release, args=(10,)).start()  # unblocks the engine thread after the quit
        await pilot.press("ctrl+q")
    [turns] = saved_chats(tmp_path)
    assert turns[0]["content"] == "hi" and turns[1]["stopped"] and turns[1]["content"].startswith("Hello")


async def test_mode_switch_applies_to_next_answer(tmp_path):
    engine = FakeEngine()
    app = make_app(engine, tmp_path)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.ready)
        assert app.mode == "ptp"
        await pilot.press("ctrl+t")
        assert app.mode == "ar"
        assert "AR" in str(app.query_one("#stats").render())
        await send(pilot, "one")
        await wait_answered(pilot, app)
        await pilot.press("ctrl+t")
        await send(pilot, "two")
        await wait_answered(pilot, app)
        assert [c["mode"] for c in engine.calls] == ["ar", "ptp"]
        first, second = answers(app)
        assert first.mode == "ar" and first.calls == len("".join(BLOCKS))
        assert second.mode == "ptp" and second.calls == len(BLOCKS)
        assert first.text == second.text  # lossless: same text, fewer calls
        # The second request carries the whole conversation (multi-turn chat template).
        assert [m["role"] for m in engine.calls[1]["messages"]] == ["user", "assistant", "user"]


async def test_lenient_acceptance_needs_an_adapter(tmp_path):
    # Without an adapter ctrl+g said "lenient acceptance (in PTP mode: ctrl+t)", and ctrl+t then refused.
    app = make_app(FakeEngine(has_adapter=False), tmp_path)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.ready)
        await pilot.press("ctrl+g")
        assert "needs an adapter" in notes(app)[-1] and not app.accept.lenient
        assert "LENIENT" not in str(app.query_one("#stats").render())


async def test_lenient_acceptance_is_a_labelled_switch(tmp_path):
    """ctrl+g: lenient acceptance for the next answers, marked in the stats bar and in the answer's saved note;
    exact again on the second press (and by default)."""
    engine = FakeEngine()
    app = make_app(engine, tmp_path)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.ready)
        assert "LENIENT" not in str(app.query_one("#stats").render())
        await pilot.press("ctrl+g")
        assert "PTP LENIENT" in str(app.query_one("#stats").render())
        assert "not the model's exact sample" in notes(app)[-1]
        await send(pilot, "one")
        await wait_answered(pilot, app)
        await pilot.press("ctrl+g")
        assert "LENIENT" not in str(app.query_one("#stats").render())
        await send(pilot, "two")
        await wait_answered(pilot, app)
    assert engine.calls[0]["accept"] == AcceptRule.parse(SUGGESTED) and engine.calls[1]["accept"] is None
    assert engine.calls[0]["accept"].label == "lenient entropy eps=0.3 delta=0.09 pivot=1"
    saved = [t for t in app.history.turns if t["role"] == "assistant"]
    assert "not the exact sample" in saved[0]["note"] and "lenient" not in saved[1]["note"]


async def test_chat_starts_with_the_rule_it_was_given(tmp_path):
    """``ptp-chat --accept RULE``: answers start under RULE (labelled), and ctrl+g switches between exact and it."""
    engine = FakeEngine()
    rule = AcceptRule.parse("threshold:0.2")
    app = make_app(engine, tmp_path, accept=rule)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.ready)
        assert "PTP LENIENT" in str(app.query_one("#stats").render())
        await send(pilot, "one")
        await wait_answered(pilot, app)
        for _ in range(2):
            await pilot.press("ctrl+g")
        await send(pilot, "two")
        await wait_answered(pilot, app)
    assert engine.calls[0]["accept"] == rule == engine.calls[1]["accept"]


async def test_mode_switch_without_adapter_warns(tmp_path):
    app = make_app(FakeEngine(has_adapter=False), tmp_path, mode="ptp")
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.ready)
        assert app.mode == "ar"
        await pilot.press("ctrl+t")
        assert app.mode == "ar"
        assert any("adapter" in n for n in notes(app))


async def test_notices_stay_above_the_bottom_bars(tmp_path):
    from textual.widgets._toast import Toast

    app = make_app(FakeEngine(), tmp_path)
    async with app.run_test(size=(100, 30), notifications=True) as pilot:  # (tests show no toasts by default)
        await wait_until(pilot, lambda: app.ready)
        for i in range(3):
            app.notify(f"notice {i}: " + "a long line " * 12, severity="warning")
        await wait_until(pilot, lambda: len(app.screen.query(Toast)) == 3)
        await pilot.pause()
        toasts = list(app.screen.query(Toast))
        assert all(t.region.area for t in toasts)
        bars = [app.query_one(StatsBar), app.query_one("#prompt"), app.query_one("#status")]
        for toast in toasts:
            assert not any(toast.region.overlaps(bar.region) for bar in bars), (toast.region, bars)
        stats = app.query_one(StatsBar).region
        assert all(
            app.screen.get_widget_at(x, stats.y)[0] is app.query_one(StatsBar) for x in range(stats.x, stats.right)
        )


def failing_loader(log):
    log("loading the model ...")
    raise UserError("model folder not found: /nowhere")


async def test_load_error_is_a_notification(tmp_path):
    app = ChatApp(failing_loader, store=ConversationStore(tmp_path / "chats"))
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.load_error is not None)
        assert notes(app) == ["model folder not found: /nowhere"]
        assert "no model loaded" in str(app.query_one("#status").render())
        app.query_one("#prompt", Input).value = "hello"
        await pilot.press("enter")
        assert not answers(app) and "no model loaded" in notes(app)[-1]


async def test_loader_progress_shows_in_status_line(tmp_path):
    release = threading.Event()

    def slow_loader(log):
        log("converting the model ...")
        print("\rconverting:  50%|#####     | 136/272", end="", file=sys.stderr, flush=True)
        release.wait(10)
        return FakeEngine()

    app = ChatApp(slow_loader, store=ConversationStore(tmp_path / "chats"), clock=lambda: 0.0)
    async with app.run_test() as pilot:
        status = app.query_one("#status")
        try:
            await wait_until(pilot, lambda: "50%" in str(status.render()))
            assert str(status.render()).startswith("0 s · converting:  50%")
        finally:
            release.set()
        await wait_until(pilot, lambda: app.ready)
        assert str(status.render()) == "ready · fake-model · adapter fake-adapter"


async def test_context_full_is_a_notification_and_returns_the_question(tmp_path):
    app = make_app(FakeEngine(error=ContextFull("prompt is 600 tokens but the model's context is 512")), tmp_path)
    async with app.run_test() as pilot:
        await send(pilot, "a long question")
        await wait_answered(pilot, app)
        assert any(n.startswith("context full: prompt is 600 tokens") for n in notes(app))
        assert not answers(app) and not list(app.query(UserMessage))
        assert app.query_one("#prompt", Input).value == "a long question"
        assert app.history.turns == []


async def test_code_block_survives_streaming(tmp_path):
    blocks = ["Here:\n\n", "```py", "thon\nprint(", "'hi')\n", "x = 1\n``", "`\n\nDone."]
    app = make_app(FakeEngine(blocks=blocks), tmp_path)
    async with app.run_test() as pilot:
        await send(pilot, "code please")
        await wait_answered(pilot, app)
        md = answers(app)[0].query_one(Markdown)
        assert md.source == "".join(blocks)
        fences = list(md.query(MarkdownFence))
        assert len(fences) == 1 and fences[0].code == "print('hi')\nx = 1" and fences[0].lexer == "python"


async def test_blocks_toggle_copy_and_help(tmp_path):
    app = make_app(FakeEngine(), tmp_path)
    async with app.run_test() as pilot:
        await pilot.press("ctrl+y")
        assert "no answer" in notes(app)[-1]
        await send(pilot, "hi")
        await wait_answered(pilot, app)
        view = answers(app)[0].query_one(BlocksView)
        assert not view.display or not view.region.height
        await pilot.press("ctrl+b")
        await pilot.pause()
        assert view.region.height > 0 and not answers(app)[0].query_one(Markdown).region.height
        rendered = view.render()
        assert rendered.plain == "".join(BLOCKS) and len({s.style for s in rendered.spans}) == 2
        await pilot.press("ctrl+y")
        assert app.clipboard == "".join(BLOCKS)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_typing_stays_possible_while_answering(tmp_path):
    gate = threading.Semaphore(0)
    app = make_app(FakeEngine(gate=gate), tmp_path)
    async with app.run_test() as pilot:
        await send(pilot, "hi")
        await pilot.press("n", "e", "x", "t")
        assert app.query_one("#prompt", Input).value == "next"
        await pilot.press("enter")  # refused while answering; the text stays
        assert app.query_one("#prompt", Input).value == "next" and "esc" in notes(app)[-1]
        gate.release(10)
        await wait_answered(pilot, app)


def test_helpers():
    assert sparkline({}) == ""
    assert sparkline({1: 2, 3: 8}) == "1▕▃ █▏3"
    assert split_blocks("abcdef", [2, 4]) == ["ab", "cdef"]
    assert split_blocks("abcdef", [2, 2]) == ["abcdef"]
    assert GenSettings().describe() == "greedy · seed 0 · max 256"
    assert GenSettings(0.7, 40, 0.9, 3, 10).describe() == "T 0.7 · top-k 40 · top-p 0.9 · seed 3 · max 10"
    assert default_history_path().name == "chat_history.json"
    store = store_for_model(None)
    conv = store.new()
    conv.add_user("q " * 40)
    store.save(conv)
    saved = json.loads(store.path(conv.id).read_text())
    assert saved["turns"] == [{"role": "user", "content": "q " * 40}]
    assert saved["title"] == "q " * 29 + "q…" and len(saved["title"]) == 60


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--mode", "ptp", "--adapter", "none"], "needs an adapter"),
        (["--accept", "sloppy"], "--accept: unknown acceptance rule 'sloppy'"),
        # (these opened the chat window, said so inside it, and exited 1 with no error line)
        (["--model", "/nonexistent/model"], "model folder not found: /nonexistent/model"),
        (["--adapter", "/nonexistent/adapter"], "adapter folder not found: /nonexistent/adapter"),
    ],
)
def test_cli_bad_flags_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


# ----- the real engine on the tiny random model -----


def test_stats_bar_names_the_draft_sources():
    """Once prompt lookup has landed drafts, the stats bar says who proposed the accepted drafts."""
    bar = StatsBar()
    bar.show("ptp", "greedy", 10.0, 2.0, {1: 2, 3: 4}, {"ptp": 3})
    assert "drafts" not in str(bar.render())
    bar.show("ptp", "greedy", 10.0, 2.0, {1: 2, 3: 4}, {"ptp": 3, "lookup": 5})
    assert "drafts lookup 5 ptp 3" in str(bar.render())
