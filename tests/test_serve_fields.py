"""``ptp-serve`` for the clients people plug into it (issue 26), with the official ``openai`` client against real
servers: log-probabilities (equal to a plain replay's log-softmax, streamed or not, chat and completions),
penalties and ``logit_bias`` (identical under ``--mode ptp`` and ``--mode ar``, greedy and sampled), a tool-call
round trip on a tiny model whose template defines tools, ``response_format`` honoured (JSON, identical under both
modes), and every field the server cannot honour answered 400 with its name (``--lenient`` ignores them).
"""

import json

import httpx
import mlx.core as mx
import numpy as np
import pytest

from ptp_mlx.engine import Engine
from ptp_mlx.generate_cli import main as generate_main
from ptp_mlx.serve.app import create_app
from ptp_mlx.serve.schema import Defaults
from ptp_mlx.serve.worker import EngineWorker
from ptp_mlx.testing import multi_row_logit_gap, save_random_adapter
from ptp_mlx.testing.serving import DRAFTS, MODEL_ID, ThreadServer, ptp_generate
from ptp_mlx.testing.tools import TOOL_CALL, make_tool_model

MSG = [{"role": "user", "content": "hello there"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def start(model, adapter, home, mode=None, lenient=False, worker=None) -> ThreadServer:
    if worker is None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PTP_MLX_HOME", str(home))
            worker = EngineWorker(lambda: Engine.load(str(model), str(adapter)), mode=mode, num_draft_tokens=DRAFTS)
            worker.start()
    return ThreadServer(create_app(worker, MODEL_ID, Defaults(max_tokens=32, lenient=lenient)), worker)


@pytest.fixture(scope="module")
def servers(serve_model_dir, serve_adapter_dir, tmp_path_factory):
    """A PTP server, a plain (--mode ar) one, and a lenient front end on the PTP server's engine."""
    home = tmp_path_factory.mktemp("home")
    ptp = start(serve_model_dir, serve_adapter_dir, home)
    ar = start(serve_model_dir, serve_adapter_dir, home, mode="ar")
    lenient = start(None, None, None, lenient=True, worker=ptp.worker)
    yield ptp, ar, lenient
    lenient.server.should_exit = True
    lenient.thread.join(10)
    ar.stop()
    ptp.stop()


@pytest.fixture(scope="module")
def replay_engine(serve_model_dir, serve_adapter_dir):
    return Engine.load(str(serve_model_dir), str(serve_adapter_dir), measure_cost=False)


def replay(engine, ids, answer, temperature, bias=None) -> np.ndarray:
    """Log-softmax at the request's temperature of each answer position, from one-row plain steps."""
    model, cache = engine.pm.base, engine.pm.make_cache()
    model(mx.array(ids[:-1])[None], cache=cache)
    out, prev = [], ids[-1]
    for tok in answer:
        x = np.array(model(mx.array([[prev]]), cache=cache)[0, -1].astype(mx.float32), dtype=np.float64)
        for k, b in (bias or {}).items():
            x[k] += b
        x = x / (temperature or 1.0)
        out.append(x - x.max() - np.log(np.exp(x - x.max()).sum()))
        prev = tok
    return np.array(out)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chat_logprobs_equal_a_plain_replay(servers, replay_engine, temperature):
    ptp = servers[0]
    kw = {"temperature": temperature, "seed": 4, "max_tokens": 24, "logprobs": True, "top_logprobs": 3}
    r = ptp.client().chat.completions.create(model=MODEL_ID, messages=MSG, **kw)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    # The tokens, decoded, are the answer; each top list is sorted and holds the chosen token when greedy.
    ids = replay_engine.encode(MSG)
    steps = list(replay_engine.generate(ids, mode="ar", sampling=_sampling(temperature), max_tokens=24))
    answer = [t for st in steps for t in st.tokens]
    assert len(answer) == len(entries) and r.choices[0].message.content == "".join(st.text for st in steps)
    ref = replay(replay_engine, ids, answer, temperature)
    # Within 1e-5 plus what multi-row passes round differently, measured here (as in tests/test_logits.py).
    tol = 1e-5 + 4 * multi_row_logit_gap(replay_engine.pm.base, ids, answer) / (temperature or 1.0)
    assert tol < 1e-3
    for g, e in enumerate(entries):
        assert abs(e.logprob - ref[g, answer[g]]) < tol
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert np.allclose(tops, np.sort(ref[g])[::-1][:3], atol=tol)
        if temperature == 0:
            assert e.logprob == tops[0]
    # Streamed: the same entries, spread over the chunks.
    chunks = list(ptp.client().chat.completions.create(model=MODEL_ID, messages=MSG, stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    # Asked for none: none.
    plain = ptp.client().chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=8)
    assert plain.choices[0].logprobs is None


def _sampling(temperature):
    from ptp_mlx.sampler import SamplingSettings

    return SamplingSettings(temperature, seed=4)


def test_completion_logprobs(servers, replay_engine):
    ptp = servers[0]
    r = ptp.client().completions.create(model=MODEL_ID, prompt="count: 1 2 3", max_tokens=16, logprobs=2, seed=1)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == r.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert all(
        len(d) <= 2 and max(d.values()) >= v - 1e-6 for d, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    chunks = list(
        ptp.client().completions.create(
            model=MODEL_ID, prompt="count: 1 2 3", max_tokens=16, logprobs=2, seed=1, stream=True
        )
    )
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


PROCESSING = {
    "greedy": {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    "sampled": {"temperature": 0.9, "seed": 7, "presence_penalty": 1.0, "logit_bias": {"81": 3.0, "173": -100}},
}


@pytest.mark.parametrize("name", list(PROCESSING))
def test_penalties_and_bias_are_identical_in_ptp_and_ar(servers, name):
    ptp, ar, _ = servers
    kw = PROCESSING[name]
    prompt = "hello there"  # the tiny model repeats tokens after it: penalties change the answer
    base = ar.client().completions.create(model=MODEL_ID, prompt=prompt, max_tokens=40, seed=kw.get("seed", 0))
    got = {}
    for srv in (ptp, ar):
        r = srv.client().completions.create(model=MODEL_ID, prompt=prompt, max_tokens=40, **kw)
        got[r.usage.model_extra["ptp"]["mode"]] = r
    assert got["ptp"].choices[0].text == got["ar"].choices[0].text
    assert got["ptp"].usage.model_extra["ptp"]["drafts_proposed"] > 0
    assert got["ar"].choices[0].text != base.choices[0].text
    # Streamed chat too.
    chat = []
    for srv in (ptp, ar):
        chunks = srv.client().chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=30, stream=True, **kw)
        chat.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert chat[0] == chat[1]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    model = make_tool_model(d / "model")
    srv = start(model, save_random_adapter(model, d / "adapter"), d / "home")
    yield srv
    srv.stop()


def test_tool_call_round_trip(tool_server):
    client = tool_server.client()
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL_ID, messages=msgs, tools=TOOLS, tool_choice="auto")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == TOOL_CALL["name"] and call.id
    assert json.loads(call.function.arguments) == TOOL_CALL["arguments"]
    # The tools reached the template: the prompt is longer than without them.
    eng = tool_server.worker.engine
    assert r.usage.prompt_tokens == len(eng.encode(msgs, tools=TOOLS)) > len(eng.encode(msgs))
    # Streamed: the call arrives as a tool_calls delta.
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=msgs, tools=TOOLS, stream=True))
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", TOOL_CALL["arguments"])
    ]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The result goes back as a tool message, after the assistant's call.
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    r2 = client.chat.completions.create(model=MODEL_ID, messages=msgs, tools=TOOLS)
    want = eng.encode(
        [msgs[0], {**msgs[1], "content": "", "tool_calls": [{**msgs[1]["tool_calls"][0], "function": TOOL_CALL}]}]
        + [{"role": "tool", "content": '{"temperature": 21}', "tool_call_id": call.id}],
        tools=TOOLS,
    )
    assert r2.usage.prompt_tokens == len(want)
    assert "temperature" in eng.tokenizer.decode(want) and "get_weather" in eng.tokenizer.decode(want)
    # tool_choice "none": no tool is offered, no call parsed.
    r3 = client.chat.completions.create(model=MODEL_ID, messages=msgs[:1], tools=TOOLS, tool_choice="none")
    assert r3.usage.prompt_tokens == len(eng.encode(msgs[:1])) and r3.choices[0].message.tool_calls is None


def post(url, body):
    with httpx.Client(timeout=60) as http:
        return http.post(url, json=body)


def test_unsupported_fields_are_refused_by_name(servers):
    ptp, _, lenient = servers
    chat, comp = ptp.url + "/v1/chat/completions", ptp.url + "/v1/completions"
    cases = [
        (chat, {"min_p": 0.1}, "min_p"),
        (chat, {"repetition_penalty": 1.1}, "repetition_penalty"),
        (chat, {"tools": TOOLS}, "tools"),  # this model's template defines no tool calls
        (chat, {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        (chat, {"parallel_tool_calls": False}, "parallel_tool_calls"),
        (chat, {"functions": [{"name": "f"}]}, "functions"),
        (chat, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        (chat, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        (chat, {"reasoning_effort": "low"}, "reasoning_effort"),
        (chat, {"modalities": ["text", "audio"]}, "modalities"),
        (comp, {"echo": True}, "echo"),
        (comp, {"suffix": "end"}, "suffix"),
        (comp, {"best_of": 2}, "best_of"),
    ]
    for url, extra, param in cases:
        body = {**({"messages": MSG} if url == chat else {"prompt": "hi"}), "max_tokens": 4, **extra}
        r = post(url, body)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"], (extra, err)
        # A lenient server ignores the field and answers as if it were not there.
        ok = post(lenient.url + url[len(ptp.url) :], body)
        assert ok.status_code == 200, (extra, ok.text)
    bad_values = [
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"presence_penalty": "x"}, "presence_penalty"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 200}}, "logit_bias"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]}, "messages[0]"),
    ]
    for extra, param in bad_values:
        for srv in (ptp, lenient):  # bad values are refused even by a lenient server
            r = post(srv.url + "/v1/chat/completions", {"messages": MSG, "max_tokens": 4, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (extra, r.text)
    # Fields that change nothing are accepted, and defaults the server honours anyway.
    same = {"user": "u1", "metadata": {"k": "v"}, "store": False, "response_format": {"type": "text"}}
    same |= {"tool_choice": "auto", "parallel_tool_calls": True, "modalities": ["text"], "logprobs": False}
    same |= {"min_p": 0.0, "repetition_penalty": 1, "audio": None, "frequency_penalty": 0}  # neutral or null
    r = post(chat, {"messages": MSG, "max_tokens": 8, **same})
    plain = post(chat, {"messages": MSG, "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_ptp_generate_takes_the_same_penalties(servers, serve_model_dir, serve_adapter_dir, capsys):
    flags = [
        "--no-chat",
        "--max-tokens",
        30,
        "--frequency-penalty",
        1.5,
        "--logit-bias",
        "81=3",
        "--logit-bias",
        "5=-1",
    ]
    want = ptp_generate(capsys, serve_model_dir, serve_adapter_dir, "hello there", *flags)
    kw = {"frequency_penalty": 1.5, "logit_bias": {"81": 3, "5": -1}}
    r = servers[0].client().completions.create(model=MODEL_ID, prompt="hello there", max_tokens=30, **kw)
    assert r.choices[0].text == want
    for bad in (["--logit-bias", "x"], ["--logit-bias", "999=1"], ["--presence-penalty", "5"]):
        rc = generate_main(
            ["--model", str(serve_model_dir), "--adapter", str(serve_adapter_dir), "--prompt", "hi", *bad]
        )
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1, err


def test_langchain_tools_and_logprobs(tool_server, servers):
    """A real client library beyond ``openai``: LangChain's ``ChatOpenAI`` binds a Python function as a tool, gets
    the call back as a structured tool call, and reads log-probabilities from the response metadata."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(base_url=tool_server.url + "/v1", api_key="none", model=MODEL_ID, temperature=0, max_retries=0)
    msgs = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather]).invoke(msgs)
    assert ai.tool_calls == [
        {"name": "get_weather", "args": {"city": "Paris"}, "id": ai.tool_calls[0]["id"], "type": "tool_call"}
    ]
    assert ai.response_metadata["finish_reason"] == "tool_calls"
    result = get_weather.invoke(ai.tool_calls[0])
    assert isinstance(result, ToolMessage) and result.content == "sunny in Paris"
    again = llm.bind_tools([get_weather]).invoke(msgs + [ai, result])  # the round trip: the result goes back
    assert again.usage_metadata["input_tokens"] > ai.usage_metadata["input_tokens"]
    # Log-probabilities through LangChain, on the PTP server.
    llm = ChatOpenAI(base_url=servers[0].url + "/v1", api_key="none", model=MODEL_ID, logprobs=True, max_tokens=12)
    out = llm.invoke("hello there")
    content = out.response_metadata["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace") == out.content
    assert all(e["logprob"] <= 0 for e in content)


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "boolean"}, "mood": {"enum": ["calm", "busy"]}},
    "required": ["answer", "mood"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_is_honoured_identically_in_ptp_and_ar(servers, temperature):
    ptp, ar, _ = servers
    formats = {
        "json_object": {"type": "json_object"},
        "json_schema": {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}},
    }
    for name, rf in formats.items():
        answers = []
        for srv in (ptp, ar):
            kw = {"temperature": temperature, "seed": 3, "max_tokens": 48, "response_format": rf}
            r = srv.client().chat.completions.create(model=MODEL_ID, messages=MSG, **kw)
            chunks = srv.client().chat.completions.create(model=MODEL_ID, messages=MSG, stream=True, **kw)
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert streamed == r.choices[0].message.content
            answers.append(r.choices[0])
        assert answers[0].message.content == answers[1].message.content, name
        text = answers[0].message.content
        assert text.startswith("{")
        if name == "json_schema":  # a bounded schema: the answer always completes
            assert answers[0].finish_reason == "stop"
            value = json.loads(text)
            assert set(value) == {"answer", "mood"} and isinstance(value["answer"], bool)
            assert value["mood"] in ("calm", "busy")
        elif answers[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_langchain_structured_output(servers):
    """LangChain's ``with_structured_output`` (a JSON schema from a pydantic model) gets a parsed object."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Reply(BaseModel):
        answer: bool

    llm = ChatOpenAI(base_url=servers[0].url + "/v1", api_key="none", model=MODEL_ID, temperature=0, max_retries=0)
    out = llm.with_structured_output(Reply, method="json_schema").invoke("Is water wet?")
    assert isinstance(out, Reply)


def test_ptp_generate_json_schema(servers, serve_model_dir, serve_adapter_dir, capsys, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    want = ptp_generate(
        capsys, serve_model_dir, serve_adapter_dir, "hello there", "--max-tokens", 48, "--json-schema", path
    )
    assert json.loads(want)["mood"] in ("calm", "busy")
    rf = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    r = servers[0].client().chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=48, response_format=rf)
    assert r.choices[0].message.content == want
    (tmp_path / "bad.json").write_text('{"type": "nope"}')
    for bad in (["--json-schema", tmp_path / "missing.json"], ["--json-schema", tmp_path / "bad.json"]):
        argv = ["--model", serve_model_dir, "--adapter", serve_adapter_dir, "--prompt", "hi", *bad]
        rc = generate_main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1, err
