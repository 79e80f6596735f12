"""Models PTP does not patch (issue 39): an SSM (mamba, state that cannot be rewound) and a KV family PTP has not
verified (starcoder2, mlx-lm's trimmable caches) decode plainly through ``StockCache``, with a prompt cache carried
from turn to turn in ``Engine.generate``, the chat, the server and ``ptp-bench --chat-turns``. Every answer is
mlx-lm's own greedy output for the same prompt; the KV family reuses its cache, the SSM prefills every prompt."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest

from ptp_mlx.engine import Engine
from ptp_mlx.model.stock_cache import StockCache
from ptp_mlx.testing import REFUSED_FAMILIES, make_tiny_model

MAX_TOKENS = 12
QUESTIONS = ["hi there", "tell me more", "and the last one"]


@pytest.fixture(scope="module", params=REFUSED_FAMILIES)
def refused(request, tmp_path_factory):
    """(family, model folder, engine) of a tiny random model PTP refuses."""
    d = make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", family=request.param, varied=True, seed=1)
    return request.param, d, Engine.load(str(d), log=lambda m: None, measure_cost=False)


def mlx_lm_answer(engine: Engine, messages: list[dict]) -> str:
    """mlx-lm's own greedy answer to ``messages`` (the reference every path must give)."""
    ids = engine.encode(messages)
    return "".join(r.text for r in mlx_lm.stream_generate(engine.pm.base, engine.tokenizer, ids, max_tokens=MAX_TOKENS))


def test_stock_cache_verbs(refused):
    family, _, engine = refused
    cache = engine.pm.make_cache()
    assert isinstance(cache, StockCache)
    if family == "mamba":  # no layer counts tokens: nothing can say what the state holds
        assert cache.offset is None and not cache.can_trim_to(0)
        with pytest.raises(ValueError, match="cannot trim"):
            cache.trim_to(0)
        return
    engine.pm.base(mx.array([[5, 6, 7, 8]]), cache=cache)
    assert cache.offset == 4 and cache.can_trim_to(2) and not cache.can_trim_to(5)
    cache.trim_to(2)
    assert cache.offset == 2


def test_engine_turns_with_a_prompt_cache_equal_mlx_lm(refused):
    """Three turns with one prompt cache, then the same turns without one: every answer is mlx-lm's."""
    family, _, engine = refused
    pc = engine.new_prompt_cache()
    messages: list[dict] = []
    for k, q in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": q})
        text = "".join(st.text for st in engine.generate(messages, max_tokens=MAX_TOKENS, prompt_cache=pc))
        want = mlx_lm_answer(engine, messages)
        assert text == want, (family, k)
        fresh = "".join(st.text for st in engine.generate(messages, max_tokens=MAX_TOKENS))
        assert fresh == want
        # The KV family prefills only the new turn; the SSM cannot be rewound, so it prefills everything.
        assert (pc.reused > 0) == (family != "mamba" and k > 0), (family, k, pc.reused)
        messages.append({"role": "assistant", "content": text})


@pytest.mark.anyio
async def test_chat_answers_two_messages(refused, tmp_path):
    """``ptp-chat --model DIR``: the chat as its command builds it answers two messages, each mlx-lm's answer."""
    pytest.importorskip("textual")
    from ptp_mlx.app.chat import ChatApp
    from ptp_mlx.app.engine_thread import GenSettings, engine_loader
    from ptp_mlx.app.history import ConversationStore
    from ptp_mlx.app.main import build_parser
    from textual.widgets import Markdown

    from ptp_mlx.testing.chat import answers, send, wait_until

    family, d, engine = refused
    args = build_parser().parse_args(["--model", str(d), "--max-tokens", str(MAX_TOKENS), "--no-measure"])
    settings = GenSettings(args.temp, args.top_k, args.top_p, args.seed, args.max_tokens, args.num_draft_tokens)
    app = ChatApp(
        engine_loader(args.model, args.adapter, measure_cost=False),
        settings,
        args.mode,
        store=ConversationStore(tmp_path / "chats"),
    )
    async with app.run_test() as pilot:
        for k, q in enumerate(QUESTIONS[:2]):
            await send(pilot, q)
            await wait_until(pilot, lambda k=k: app.current is None and len(answers(app)) == k + 1, timeout=60)
        shown = [a.query_one(Markdown).source for a in answers(app)]
        messages = app.history.messages()
    assert not app.load_error
    assert [m["content"] for m in messages if m["role"] == "assistant"] == shown
    for k in range(2):
        assert shown[k] == mlx_lm_answer(engine, messages[: 2 * k + 1]), (family, k)


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def test_server_plain_and_streamed_follow_up(refused, tmp_path_factory):
    """``ptp-serve --model DIR``: a plain answer, then a streamed follow-up; both mlx-lm's, the follow-up from the
    carried cache where the model's cache can be rewound."""
    from ptp_mlx.serve.app import create_app
    from ptp_mlx.serve.schema import Defaults
    from ptp_mlx.serve.worker import EngineWorker
    from ptp_mlx.testing.serving import MAX_BODY, MODEL_ID, ThreadServer, stream_text

    family, d, engine = refused
    worker = EngineWorker(lambda: Engine.load(str(d), log=lambda m: None, measure_cost=False), max_queue=4)
    worker.start()
    srv = ThreadServer(create_app(worker, MODEL_ID, Defaults(max_tokens=MAX_TOKENS), MAX_BODY), worker)
    try:
        client = srv.client()
        m = [{"role": "user", "content": QUESTIONS[0]}]
        first = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=MAX_TOKENS, temperature=0)
        assert first.choices[0].message.content == mlx_lm_answer(engine, m)
        m += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "more"}]
        stream = client.chat.completions.create(
            model=MODEL_ID,
            messages=m,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, _, chunks = stream_text(stream)
        assert text == mlx_lm_answer(engine, m)
        cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
        assert (cached > 0) == (family != "mamba"), (family, cached)
    finally:
        srv.stop()


def test_bench_chat_turns_ar(refused, tmp_path, capsys):
    """``ptp-bench --chat-turns 3 --methods ar``: the carried cache and full re-prefill give the same answers."""
    from ptp_mlx.bench import cli

    family, d, _ = refused
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(f'{{"question_id": "a-{k}", "category": "a", "turns": ["{q}"]}}\n' for k, q in enumerate(QUESTIONS))
    )
    argv = ["--model", str(d), "--prompts", str(prompts), "--max-tokens", "6", "--chat-turns", "3", "--methods", "ar"]
    rc = cli.main(argv + ["--no-cost-curve"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "answers identical: yes" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "turn" not in line]
    assert len(rows) == 3
    carried = [int(r[2]) for r in rows]
    full = [int(r[4]) for r in rows]
    assert (carried[1:] < full[1:]) if family != "mamba" else carried == full
