"""The chat's saved conversations (``ptp-chat``, Pilot on a fake engine): saved, reloaded, kept per model, listed,
reopened and deleted; unreadable files set aside; restored answers look like live ones."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytest.importorskip("textual")

from ptp_mlx.app.conversations import ConversationsScreen
from ptp_mlx.app.history import (
    ConversationStore,
    default_history_path,
    model_key,
    store_for_model,
)
from ptp_mlx.app.widgets import StatsBar, UserMessage
from textual.widgets import Markdown, OptionList

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
