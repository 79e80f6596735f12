"""The chat on the tiny real model: its text equals the generator's, and a full context is a notification."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from ptp_mlx.app.chat import ChatApp
from ptp_mlx.app.engine_thread import GenSettings
from ptp_mlx.app.history import (
    ConversationStore,
)
from textual.widgets import Input, Markdown

from ptp_mlx.testing.chat import (
    answers,
    notes,
    send,
    wait_until,
)

pytestmark = pytest.mark.anyio


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
