"""The Textual chat (``ptp-chat``) driven with ``App.run_test`` and Pilot: fake engines and the tiny real model."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

import pytest

from ptp_mlx.generate import ContextFull, GenerationStep

pytest.importorskip("textual")

from ptp_mlx.app.chat import ChatApp  # noqa: E402
from ptp_mlx.app.conversations import ConversationsScreen  # noqa: E402
from ptp_mlx.app.engine_thread import GenSettings  # noqa: E402
from ptp_mlx.app.history import (  # noqa: E402
    ConversationStore,
    default_history_path,
    model_key,
    store_for_model,
)
from ptp_mlx.app.main import main  # noqa: E402
from ptp_mlx.app.widgets import AnswerView, BlocksView, HelpScreen, StatsBar, UserMessage, sparkline, split_blocks  # noqa: E402
from textual.widgets import Input, Markdown, OptionList  # noqa: E402
from textual.widgets._markdown import MarkdownFence  # noqa: E402

from ptp_mlx.errors import UserError  # noqa: E402

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


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
    assert engine.calls[0]["accept"].label == "lenient entropy eps=0.3 delta=0.09" and engine.calls[1]["accept"] is None
    saved = [t for t in app.history.turns if t["role"] == "assistant"]
    assert "not the exact sample" in saved[0]["note"] and "lenient" not in saved[1]["note"]


async def test_mode_switch_without_adapter_warns(tmp_path):
    app = make_app(FakeEngine(has_adapter=False), tmp_path, mode="ptp")
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.ready)
        assert app.mode == "ar"
        await pilot.press("ctrl+t")
        assert app.mode == "ar"
        assert any("adapter" in n for n in notes(app))


async def test_history_saved_reloaded_and_new_chat_keeps_it(tmp_path):
    app = make_app(FakeEngine(), tmp_path)
    async with app.run_test() as pilot:
        await send(pilot, "first question")
        await wait_answered(pilot, app)
    [turns] = saved_chats(tmp_path)
    assert [t["role"] for t in turns] == ["user", "assistant"]
    assert turns[1]["content"] == "".join(BLOCKS) and turns[1]["blocks"] == [len(b) for b in BLOCKS]

    engine = FakeEngine(blocks=["Sure", "."])
    app = make_app(engine, tmp_path)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.ready)
        assert [m.text for m in app.query(UserMessage)] == ["first question"]  # the newest chat goes on
        old = answers(app)[0]
        assert old.blocks == BLOCKS and old.query_one(Markdown).source == "".join(BLOCKS)
        await send(pilot, "second")
        await wait_answered(pilot, app)
        assert engine.calls[0]["messages"] == [
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "".join(BLOCKS)},
            {"role": "user", "content": "second"},
        ]
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert not answers(app) and not list(app.query(UserMessage))
        assert "previous one is kept" in notes(app)[-1]
        assert len(saved_chats(tmp_path)) == 1  # a new chat gets a file with its first answer, not before
        await send(pilot, "third")
        await wait_answered(pilot, app)
        assert [m["content"] for m in engine.calls[-1]["messages"]] == ["third"]
    chats = {c[0]["content"]: [t["content"] for t in c if t["role"] == "user"] for c in saved_chats(tmp_path)}
    assert chats == {"first question": ["first question", "second"], "third": ["third"]}


async def test_new_chat_while_answering_keeps_the_partial_answer(tmp_path):
    gate = threading.Semaphore(0)
    engine = FakeEngine(gate=gate)
    app = make_app(engine, tmp_path)
    async with app.run_test() as pilot:
        await send(pilot, "hi")
        gate.release()
        await wait_until(pilot, lambda: answers(app) and len(answers(app)[0].blocks) == 1)
        await pilot.press("ctrl+l")
        gate.release(10)
        await asyncio.get_running_loop().run_in_executor(None, engine.closed.wait, 10)
        await pilot.pause(0.1)
        assert app.current is None and not answers(app) and app.history.turns == []
        [old] = saved_chats(tmp_path)
        assert old[1]["content"] == BLOCKS[0] and old[1]["stopped"]
        await send(pilot, "again")  # the chat goes on
        await wait_answered(pilot, app)
        assert answers(app)[0].text == "".join(BLOCKS)
        assert [m["content"] for m in engine.calls[-1]["messages"]] == ["again"]


async def test_unreadable_files_are_set_aside(tmp_path):
    legacy = tmp_path / "chat_history.json"
    legacy.write_text("{not json")
    chats = tmp_path / "chats"
    chats.mkdir()
    (chats / "bad.json").write_text('{"turns": 3}')
    damaged = {"role": "assistant", "content": "Fine", "mode": 7, "blocks": "x", "calls": [1, "2"], "sources": 3}
    (chats / "damaged.json").write_text(json.dumps({"turns": [{"role": "user", "content": "q"}, damaged]}))
    app = make_app(FakeEngine(), store=ConversationStore(chats, legacy=legacy))
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.ready)
        assert any("could not read the chat history" in n for n in notes(app))
        assert any("could not read the saved chat bad.json" in n for n in notes(app))
        # Damaged fields of a readable chat fall back to empty values: it still opens.
        assert [a.text for a in answers(app)] == ["Fine"]
        assert str(answers(app)[0].query_one(".answer-header").render()) == "AR · 1 tokens in 1 calls"
    assert (tmp_path / "chat_history.json.unreadable").read_text() == "{not json"
    assert (chats / "bad.json.unreadable").read_text() == '{"turns": 3}'


async def test_old_history_file_moves_into_the_default_models_list_once():
    legacy = default_history_path()
    old_turns = [
        {"role": "user", "content": "old question"},
        {"role": "assistant", "content": "Old answer", "mode": "ptp", "blocks": [3, 7], "stopped": False},
    ]
    legacy.parent.mkdir(parents=True, exist_ok=True)
    legacy.write_text(json.dumps({"version": 1, "turns": old_turns}))
    for _ in range(2):  # the second start finds it in the list, and once only
        app = make_app(FakeEngine(), store=store_for_model(None))
        async with app.run_test() as pilot:
            await wait_until(pilot, lambda app=app: app.ready)
            assert [m.text for m in app.query(UserMessage)] == ["old question"]
            assert answers(app)[0].blocks == ["Old", " answer"]
            assert str(answers(app)[0].query_one(".answer-header").render()) == "PTP"  # no counts were saved
        chats, warnings = store_for_model(None).list()
        assert [[(t["role"], t["content"]) for t in c.turns] for c in chats] == [
            [(t["role"], t["content"]) for t in old_turns]
        ]
        assert not warnings
    assert not legacy.exists() and legacy.with_name("chat_history.json.migrated").exists()
    assert store_for_model("org/other-model").legacy is None  # other models' lists start empty


async def test_history_is_kept_per_model(tmp_path):
    assert model_key(None) == "SmolLM2-135M-Instruct"
    assert model_key("org/Some Model") == "org--Some_Model"
    one, two = tmp_path / "a" / "model", tmp_path / "b" / "model"
    one.mkdir(parents=True)
    two.mkdir(parents=True)
    assert model_key(str(one)).startswith("model-") and model_key(str(one)) != model_key(str(two))

    async def chat(model, question=None) -> list[str]:
        app = make_app(FakeEngine(), store=store_for_model(model))
        async with app.run_test() as pilot:
            await wait_until(pilot, lambda: app.ready)
            if question:
                await send(pilot, question)
                await wait_answered(pilot, app)
            await pilot.press("ctrl+o")
            await pilot.pause()
            listed = app.screen.query_one(OptionList).option_count if app.history.turns else 0
            return [m.text for m in app.query(UserMessage)] + [f"{listed} listed"]

    assert await chat(None, "for the default model") == ["for the default model", "1 listed"]
    assert await chat(str(one)) == ["0 listed"]  # another model: its own, empty list
    assert await chat(str(one), "for model one") == ["for model one", "1 listed"]
    assert await chat(None) == ["for the default model", "1 listed"]
    assert await chat(str(two)) == ["0 listed"]
    assert store_for_model(None).folder.parent == store_for_model(str(one)).folder.parent


class CachingEngine(FakeEngine):
    """A fake with the real engine's prompt-cache surface: records the cache each answer got."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.caches: list[object] = []

    def new_prompt_cache(self):
        return object()

    def generate(self, prompt, mode=None, sampling=None, max_tokens=256, prompt_cache=None):
        self.caches.append(prompt_cache)
        return super().generate(prompt, mode, sampling, max_tokens)


def option_labels(screen) -> list[str]:
    options = screen.query_one(OptionList)
    return [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]


async def test_chat_list_reopens_and_deletes(tmp_path):
    engine = CachingEngine()
    clock = iter(range(1_000_000, 2_000_000, 60))  # a minute per save: a fixed order
    app = make_app(engine, store=ConversationStore(tmp_path / "chats", now=lambda: next(clock)))
    async with app.run_test(size=(100, 30)) as pilot:
        for question in ["alpha", "alpha again", None, "beta"]:
            if question is None:
                await pilot.press("ctrl+l")
                continue
            await send(pilot, question)
            await wait_answered(pilot, app)
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert isinstance(app.screen, ConversationsScreen)
        labels = option_labels(app.screen)
        # Newest first; the open chat is marked.
        assert labels[0].startswith("● beta  ·  1 question ·") and labels[1].startswith("  alpha  ·  2 questions ·")
        await pilot.press("down", "enter")
        await pilot.pause()
        assert not isinstance(app.screen, ConversationsScreen)
        assert [m.text for m in app.query(UserMessage)] == ["alpha", "alpha again"]
        assert [a.text for a in answers(app)] == ["".join(BLOCKS)] * 2
        await send(pilot, "alpha third")
        await wait_answered(pilot, app)
        assert [m["content"] for m in engine.calls[-1]["messages"] if m["role"] == "user"] == [
            "alpha",
            "alpha again",
            "alpha third",
        ]
        # One prompt cache per chat: kept within a chat, fresh for a new one and for a reopened one.
        a1, a2, b, a3 = engine.caches
        assert a1 is a2 and b is not a1 and a3 is not a1 and a3 is not b

        await pilot.press("ctrl+o")
        await pilot.pause()
        assert option_labels(app.screen)[0].startswith("● alpha")
        await pilot.press("down", "d")  # beta, not the open one
        await pilot.pause()
        assert [c[0]["content"] for c in saved_chats(tmp_path)] == ["alpha"]
        assert [m.text for m in app.query(UserMessage)] == ["alpha", "alpha again", "alpha third"]
        assert len(option_labels(app.screen)) == 1 and "chat deleted" in notes(app)
        await pilot.press("d")  # the open one: its file goes and a new chat opens
        await pilot.pause()
        assert saved_chats(tmp_path) == [] and app.history.turns == [] and not answers(app)
        assert option_labels(app.screen) == ["no saved chats yet"]
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, ConversationsScreen)
        await send(pilot, "gamma")  # the chat goes on
        await wait_answered(pilot, app)
        assert [c[0]["content"] for c in saved_chats(tmp_path)] == ["gamma"]


def screen_lines(app, widget) -> list[str]:
    """The text the screen shows in ``widget``'s region."""
    region = widget.region
    strips = app.screen._compositor.render_strips()
    return [strips[y].text[region.x : region.right] for y in range(region.y, region.bottom)]


async def test_restored_answers_look_like_live_ones(tmp_path):
    blocks = [" Sure", ", here", " it is."]  # the model's first token starts with a space
    engine = FakeEngine(blocks=blocks, sizes=[2, 3, 3], eos=True, sources=["ptp", "lookup", "ptp"])

    async def screen(question=None):
        app = make_app(engine, tmp_path)
        async with app.run_test(size=(80, 30)) as pilot:
            if question:
                await send(pilot, question)
                await wait_answered(pilot, app)
                await pilot.press("ctrl+t")  # the next one in AR mode
                await send(pilot, question + " again")
                await wait_answered(pilot, app)
            await wait_until(pilot, lambda: app.ready)
            app.clear_notifications()
            await pilot.pause()
            views = answers(app)
            headers = [str(a.query_one(".answer-header").render()) for a in views]
            markdown = [screen_lines(app, a.query_one(Markdown)) for a in views]
            stats = str(app.query_one(StatsBar).render()).split(" │ ", 1)[1]  # (the mode is the session's)
            return headers, [screen_lines(app, a) for a in views], markdown, stats

    live = await screen("Hi")
    restored = await screen()
    assert live[0] == ["PTP · 9 tokens in 3 calls", "AR · 18 tokens in 18 calls"]
    assert restored == live  # headers, what the answers show, the stats bar
    assert restored[2][0][0].startswith("Sure, here it is.")  # no leading space
    assert "drafts lookup 2 ptp 4" in restored[3]


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
    ],
)
def test_cli_bad_flags_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


# ----- the real engine on the tiny random model -----


def _reference(engine, messages, mode, settings: GenSettings) -> str:
    from ptp_mlx.sampler import SamplingSettings

    s = SamplingSettings(settings.temperature, settings.top_k, settings.top_p, settings.seed)
    return "".join(st.text for st in engine.generate(messages, mode=mode, sampling=s, max_tokens=settings.max_tokens))


@pytest.fixture(scope="module")
def tiny_adapter_dir(tiny_model_dir, tmp_path_factory):
    import mlx_lm

    from ptp_mlx.adapter import make_config, save_adapter
    from ptp_mlx.model.ptp import PTPAdapter
    from ptp_mlx.testing import randomize_adapter

    model, _ = mlx_lm.load(str(tiny_model_dir))
    adapter = PTPAdapter(model, 4, 1.0, "binary")
    randomize_adapter(adapter)
    out = tmp_path_factory.mktemp("adapter") / "tiny-ptp"
    save_adapter(adapter, make_config(model, adapter, 4, 1.0, window=4), out)
    return out


@pytest.mark.parametrize("mode", ["ar", "ptp"])
async def test_real_engine_text_equals_generator_text(mode, tiny_model_dir, tiny_adapter_dir, tmp_path):
    from ptp_mlx.app.engine_thread import engine_loader

    from ptp_mlx.engine import Engine

    adapter = str(tiny_adapter_dir) if mode == "ptp" else "none"
    settings = GenSettings(temperature=0.8, top_k=20, seed=7, max_tokens=40)
    app = ChatApp(
        engine_loader(str(tiny_model_dir), adapter, measure_cost=False),
        settings,
        mode,
        store=ConversationStore(tmp_path / "chats"),
    )
    async with app.run_test() as pilot:
        await send(pilot, "Hi there")
        await wait_until(pilot, lambda: app.current is None, timeout=60)
        answer = answers(app)[0]
        shown = answer.query_one(Markdown).source
        assert not notes(app) and answer.mode == mode and answer.calls > 0
        messages = app.history.messages()[:1]
    assert shown == answer.text and shown
    engine = Engine.load(str(tiny_model_dir), adapter, log=lambda m: None, measure_cost=False)
    assert shown == _reference(engine, messages, mode, settings)
    if mode == "ptp":  # lossless: the AR answer is the same text
        assert shown == _reference(engine, messages, "ar", settings)


async def test_real_engine_context_full(tiny_model_dir, tmp_path):
    from ptp_mlx.app.engine_thread import engine_loader

    app = ChatApp(
        engine_loader(str(tiny_model_dir), "none", measure_cost=False), store=ConversationStore(tmp_path / "chats")
    )
    async with app.run_test() as pilot:
        await send(pilot, "x" * 600)  # byte tokenizer: 600+ tokens, the tiny model's context is 512
        await wait_until(pilot, lambda: app.current is None, timeout=60)
        assert any(n.startswith("context full: prompt is") for n in notes(app))
        assert app.query_one("#prompt", Input).value == "x" * 600 and not answers(app)


def test_stats_bar_names_the_draft_sources():
    """Once prompt lookup has landed drafts, the stats bar says who proposed the accepted drafts."""
    bar = StatsBar()
    bar.show("ptp", "greedy", 10.0, 2.0, {1: 2, 3: 4}, {"ptp": 3})
    assert "drafts" not in str(bar.render())
    bar.show("ptp", "greedy", 10.0, 2.0, {1: 2, 3: 4}, {"ptp": 3, "lookup": 5})
    assert "drafts lookup 5 ptp 3" in str(bar.render())
