"""``ptp-serve`` (issue 15): the real server (uvicorn on 127.0.0.1, a free port) on a tiny model with a PTP
adapter, talked to with the official ``openai`` client and raw HTTP.

Chat and completions, streamed and not, give the text ``ptp-generate`` prints for the same seed and settings;
usage carries the token counts and PTP's figures; stop strings cut the text (also across streamed blocks); a
bounded queue refuses with 503; a client that disconnects stops its generation (or its queued job is skipped);
16 concurrent streaming clients, some leaving early, all finish and memory returns near idle; every bad input
gets its status and an OpenAI error body; the command itself starts, serves and stops on Ctrl-C.
"""

import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import uvicorn
from openai import APIStatusError, NotFoundError, OpenAI

from ptp_mlx.engine import Engine
from ptp_mlx.generate_cli import main as generate_main
from ptp_mlx.serve.app import create_app
from ptp_mlx.serve.cli import main as serve_main
from ptp_mlx.serve.schema import Defaults
from ptp_mlx.serve.stops import StopMatcher
from ptp_mlx.serve.worker import EngineWorker
from ptp_mlx.testing import make_tiny_model, save_random_adapter

MODEL_ID = "tiny"
MAX_QUEUE = 16
MAX_BODY = 64 * 1024
DRAFTS = 3  # a fixed draft budget: every call verifies drafts (the random adapter would not pay its way adaptively)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("serve") / "model", varied=True, seed=3)


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    """A randomized PTP adapter: drafts are verified, some accepted."""
    return save_random_adapter(model_dir, tmp_path_factory.mktemp("serve") / "adapter")


class ThreadServer:
    """uvicorn serving ``app`` on a thread, on a socket bound to 127.0.0.1 and a free port."""

    def __init__(self, app, worker: EngineWorker):
        self.worker = worker
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def client(self, **kw) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.worker.shutdown()
        self.sock.close()


@pytest.fixture(scope="module")
def server(model_dir, adapter_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the cost curve is measured into a scratch cache root
        mp.setenv("PTP_MLX_HOME", str(tmp_path_factory.mktemp("home")))
        load = lambda: Engine.load(str(model_dir), str(adapter_dir))  # noqa: E731
        worker = EngineWorker(load, max_queue=MAX_QUEUE, num_draft_tokens=DRAFTS)
        worker.start()
    srv = ThreadServer(create_app(worker, MODEL_ID, Defaults(max_tokens=32), MAX_BODY), worker)
    yield srv
    srv.stop()


def ptp_generate(capsys, model_dir, adapter_dir, prompt, *flags) -> str:
    argv = ["--model", model_dir, "--adapter", adapter_dir, "--num-draft-tokens", DRAFTS, "--prompt", prompt, *flags]
    rc = generate_main([str(a) for a in argv])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.endswith("\n")
    return out.out[:-1]


def stream_text(stream) -> tuple[str, str | None, list]:
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, (reasons[-1] if reasons else None), chunks


def test_models_lists_the_served_model(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert server.client().models.retrieve(MODEL_ID).id == MODEL_ID


SETTINGS = {  # name -> (request fields, ptp-generate flags, system prompt)
    "greedy": ({}, [], None),
    "sampled": (
        {"temperature": 1.0, "top_p": 0.95, "seed": 5, "extra_body": {"top_k": 40}},
        ["--temp", 1.0, "--top-p", 0.95, "--top-k", 40, "--seed", 5],
        "be brief",
    ),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_chat_is_ptp_generate_streamed_or_not(server, model_dir, adapter_dir, capsys, setting):
    kw, flags, system = SETTINGS[setting]
    prompt = "The quick brown fox"
    if system:
        flags = [*flags, "--system", system]
    want = ptp_generate(capsys, model_dir, adapter_dir, prompt, "--max-tokens", 40, *flags)
    assert want.strip()
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    client = server.client()
    r = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=40, **kw)
    assert r.object == "chat.completion" and r.model == MODEL_ID
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    engine_ids = server.worker.engine.encode(messages)
    assert u.prompt_tokens == len(engine_ids) and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 1 <= u.completion_tokens <= 40
    ptp = u.model_extra["ptp"]
    assert ptp["mode"] == "ptp" and 1 <= ptp["calls"] <= u.completion_tokens + 1 and ptp["tokens_per_call"] >= 1
    assert 0 <= ptp["drafts_accepted"] <= ptp["drafts_proposed"] and ptp["drafts_proposed"] >= ptp["calls"] - 1
    assert ptp["drafts_accepted"] == sum(ptp["accepted_by_source"].values())
    assert ptp["accept"] == "exact"  # exact unless the client opts out
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=40, stream=True, stream_options={"include_usage": True}, **kw
    )
    text, reason, chunks = stream_text(stream)
    assert text == want and reason == r.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == u.completion_tokens
    assert last.usage.prompt_tokens == u.prompt_tokens
    # The same prompt again continues from the prompt cache: all but its last token come from it.
    assert last.usage.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1


def test_completions_are_ptp_generate_without_template(server, model_dir, adapter_dir, capsys):
    want = ptp_generate(capsys, model_dir, adapter_dir, "count: 1 2 3", "--no-chat", "--max-tokens", 24, "--seed", 2)
    client = server.client()
    r = client.completions.create(model=MODEL_ID, prompt="count: 1 2 3", max_tokens=24, seed=2)
    assert r.object == "text_completion" and r.choices[0].text == want
    assert r.usage.prompt_tokens == len("count: 1 2 3")  # the byte tokenizer: one token per byte
    chunks = list(client.completions.create(model=MODEL_ID, prompt="count: 1 2 3", max_tokens=24, seed=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    ids = list(server.worker.engine.tokenizer.encode("count: 1 2 3"))
    assert client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=24, seed=2).choices[0].text == want


def test_conversation_continues_from_the_prompt_cache(server):
    """A follow-up turn prefills only its new tokens, and the answer is the one a fresh cache gives."""
    client = server.client()
    m = [{"role": "user", "content": "a conversation starts here"}]
    first = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=16)
    m = m + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and goes on"}]
    second = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=16)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    server.worker.pool.entries.clear()  # the worker is idle: no cache left to reuse
    fresh = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=16)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].message.content == second.choices[0].message.content


def test_defaults_follow_the_server_flags(server):
    """Without temperature, seed and max_tokens the request gets the server's flags: greedy, seed 0, 32 tokens."""
    client = server.client()
    m = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=MODEL_ID, messages=m)
    same = client.chat.completions.create(model=MODEL_ID, messages=m, temperature=0, seed=0, max_tokens=32)
    assert r.choices[0].message.content == same.choices[0].message.content
    assert r.usage.completion_tokens <= 32


def test_stop_strings_cut_the_text(server):
    client = server.client()
    m = [{"role": "user", "content": "hello world"}]
    full = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=60).choices[0].message.content
    assert len(full) > 20
    stop = full[12:15]  # three characters: a stop string that spans blocks and tokens
    want = full[: full.find(stop)]
    r = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=60, stop=[stop, "\x00never"])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    text, reason, _ = stream_text(
        client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=60, stop=stop, stream=True)
    )
    assert text == want and reason == "stop"
    # A stop string that never occurs changes nothing.
    r = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=60, stop="\x00never")
    assert r.choices[0].message.content == full


def test_stop_matcher_any_chunking():
    text = "abcabxabcd"
    for stops, want in ((["abx"], "abc"), (["cd", "bca"], "a"), (["zz"], text), (["d"], "abcabxabc")):
        for size in range(1, len(text) + 1):
            m = StopMatcher(stops)
            out = "".join(m.feed(text[i : i + size]) for i in range(0, len(text), size)) + m.flush()
            assert out == want, (stops, size)


def test_bad_inputs_get_openai_errors(server):
    url = server.url + "/v1/chat/completions"
    ok_msg = [{"role": "user", "content": "hi"}]
    cases = [
        # (body bytes or JSON object, status, param, code)
        (b"{not json", 400, None, "invalid_json"),
        (b"", 400, None, "invalid_json"),
        ([1, 2], 400, None, "invalid_type"),
        ({"model": MODEL_ID}, 400, "messages", "invalid_type"),
        ({"messages": "hi"}, 400, "messages", "invalid_type"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "invalid_type"),
        ({"messages": ok_msg, "temperature": "hot"}, 400, "temperature", "invalid_type"),
        ({"messages": ok_msg, "temperature": -1}, 400, "temperature", "invalid_value"),
        ({"messages": ok_msg, "top_p": 0}, 400, "top_p", "invalid_value"),
        ({"messages": ok_msg, "top_k": 1.5}, 400, "top_k", "invalid_type"),
        ({"messages": ok_msg, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ({"messages": ok_msg, "max_tokens": True}, 400, "max_tokens", "invalid_type"),
        ({"messages": ok_msg, "seed": -3}, 400, "seed", "invalid_value"),
        ({"messages": ok_msg, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
        ({"messages": ok_msg, "stop": 7}, 400, "stop", "invalid_type"),
        ({"messages": ok_msg, "stream": "yes"}, 400, "stream", "invalid_type"),
        ({"messages": ok_msg, "n": 2}, 400, "n", "invalid_value"),
        ({"messages": ok_msg, "accept": "sloppy"}, 400, "accept", "invalid_value"),
        ({"messages": ok_msg, "accept": 3}, 400, "accept", "invalid_type"),
        ({"messages": ok_msg, "model": "gpt-4o"}, 404, "model", "model_not_found"),
        ({"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages", "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": "x" * (MAX_BODY + 1)}]}, 413, None, "request_too_large"),
    ]
    with httpx.Client(timeout=30) as http:
        for body, status, param, code in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(url, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body if len(content) < 200 else content[:80], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            assert err["param"] == param and err["code"] == code, (content[:80], err)
            assert err["type"] == "invalid_request_error"
        for body, param in (
            ({"prompt": 5}, "prompt"),
            ({"prompt": ["a", "b"]}, "prompt"),
            ({"prompt": [1, 999]}, "prompt"),
        ):
            r = http.post(server.url + "/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = http.post(server.url + "/v1/completions", json={"prompt": "x" * 600})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = http.get(server.url + "/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert http.get(url).status_code == 405 and "error" in http.get(url).json()
    with pytest.raises(NotFoundError) as e:
        server.client().chat.completions.create(model="gpt-4o", messages=ok_msg)
    assert e.value.body["code"] == "model_not_found"
    # Nothing broke: the server still answers.
    assert server.client().chat.completions.create(model=MODEL_ID, messages=ok_msg, max_tokens=4).choices


class Gate:
    """Wraps the engine's ``generate``: each answer waits at ``opened`` before its first step and may sleep
    between steps; counts answers started and steps taken."""

    def __init__(self, engine, delay: float = 0.0):
        self.engine, self.delay = engine, delay
        self.opened, self.entered = threading.Event(), threading.Event()
        self.started = 0
        self.steps = []

    def __enter__(self):
        inner = self.engine.generate

        def generate(*a, **kw):
            steps = inner(*a, **kw)

            def run():
                self.started += 1
                self.steps.append(0)
                self.entered.set()
                self.opened.wait(30)
                try:
                    for st in steps:
                        self.steps[-1] += 1
                        yield st
                        time.sleep(self.delay)
                finally:
                    steps.close()

            return run()

        self.engine.generate = generate
        return self

    def __exit__(self, *exc):
        self.opened.set()
        del self.engine.generate


def wait_for(cond, timeout=10.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def queued_jobs_cancelled(server):
    """A condition: every job waiting in the worker's queue has been cancelled (its client left)."""
    return lambda: all(j is None or j.cancel.is_set() for j in list(server.worker._jobs.queue))


def test_full_queue_is_refused_with_503(server):
    m = [{"role": "user", "content": "hi"}]
    with Gate(server.worker.engine) as gate, ThreadPoolExecutor(MAX_QUEUE + 1) as pool:
        first = pool.submit(server.client().chat.completions.create, model=MODEL_ID, messages=m, max_tokens=4)
        assert gate.entered.wait(10)
        queued = [
            pool.submit(server.client().chat.completions.create, model=MODEL_ID, messages=m, max_tokens=4)
            for _ in range(MAX_QUEUE)
        ]
        wait_for(lambda: server.worker.waiting == MAX_QUEUE)
        with pytest.raises(APIStatusError) as e:
            server.client().chat.completions.create(model=MODEL_ID, messages=m, max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
        gate.opened.set()
        for f in [first, *queued]:
            assert f.result(30).choices[0].finish_reason in ("stop", "length")


def test_disconnect_stops_generation_and_skips_queued_jobs(server):
    m = [{"role": "user", "content": "tell me a story"}]
    with Gate(server.worker.engine, delay=0.02) as gate:
        # A running stream read for two chunks, then dropped: the worker stops within a few calls.
        with httpx.Client(timeout=30) as http:
            body = {"model": MODEL_ID, "messages": m, "max_tokens": 400, "stream": True}
            with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
                gate.opened.set()
                lines = r.iter_lines()
                assert next(lines).startswith("data: ") and next(lines) == ""
            # A queued stream dropped before its turn is never started.
            gate.opened.clear()
            blocker = threading.Thread(
                target=server.client().chat.completions.create,
                kwargs={"model": MODEL_ID, "messages": m, "max_tokens": 4},
            )
            wait_for(lambda: server.worker._current is None)
            started = gate.started
            blocker.start()
            wait_for(lambda: gate.started == started + 1)
            with http.stream("POST", server.url + "/v1/chat/completions", json=body):
                wait_for(lambda: server.worker.waiting == 1)
            wait_for(queued_jobs_cancelled(server))  # the server noticed the disconnect (no fixed sleep: no race)
            gate.opened.set()
            blocker.join(30)
            wait_for(lambda: server.worker.waiting == 0 and server.worker._current is None)
    assert gate.steps[0] < 100, gate.steps  # 400 tokens would take more calls than that
    assert gate.started == started + 1  # the dropped queued job never reached the engine


def test_dropped_non_streamed_request_is_skipped(server):
    m = [{"role": "user", "content": "hi"}]
    with Gate(server.worker.engine) as gate:
        wait_for(lambda: server.worker._current is None)
        started = gate.started
        blocker = threading.Thread(
            target=server.client().chat.completions.create, kwargs={"model": MODEL_ID, "messages": m, "max_tokens": 4}
        )
        blocker.start()
        wait_for(lambda: gate.started == started + 1)
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as http:
            http.post(server.url + "/v1/chat/completions", json={"messages": m, "max_tokens": 4})
        wait_for(queued_jobs_cancelled(server))  # the handler polls for the disconnect every 0.25 s
        gate.opened.set()
        blocker.join(30)
        wait_for(lambda: server.worker.waiting == 0 and server.worker._current is None)
    assert gate.started == started + 1


def test_engine_failure_is_an_error_body_not_a_crash(server):
    engine = server.worker.engine
    m = [{"role": "user", "content": "hi"}]

    def broken(*a, **kw):
        yield from ()
        raise RuntimeError("the model broke")

    engine.generate = broken
    try:
        with pytest.raises(APIStatusError) as e:
            server.client().chat.completions.create(model=MODEL_ID, messages=m)
        assert e.value.status_code == 500 and e.value.body["type"] == "server_error"
        assert "the model broke" in e.value.body["message"]
        with httpx.Client(timeout=30) as http:  # streamed: the status is sent already, the error is in the stream
            r = http.post(server.url + "/v1/chat/completions", json={"messages": m, "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["message"].endswith("the model broke")
    finally:
        del engine.generate
    assert server.client().chat.completions.create(model=MODEL_ID, messages=m, max_tokens=4).choices


def test_load_16_streams_some_leave_early(server):
    client = server.client(timeout=120)
    proc = psutil.Process()
    client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "warm up"}], max_tokens=48)
    gc.collect()
    idle = proc.memory_info().rss

    def one(i: int):
        m = [{"role": "user", "content": f"request number {i}: say something"}]
        stream = client.chat.completions.create(
            model=MODEL_ID, messages=m, max_tokens=48, stream=True, seed=i, temperature=0.8
        )
        if i % 4 == 3:  # a quarter leave after their first text
            for c in stream:
                if c.choices and c.choices[0].delta.content:
                    break
            stream.close()
            return None
        return stream_text(stream)[:2]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    done = [r for i, r in enumerate(results) if i % 4 != 3]
    assert len(done) == 12 and all(reason in ("stop", "length") for _, reason in done)
    wait_for(lambda: server.worker.waiting == 0 and server.worker._current is None, 60)
    r = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "still there?"}], max_tokens=4
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    gc.collect()
    grew = (proc.memory_info().rss - idle) / 2**20
    assert grew < 64, f"RSS grew by {grew:.0f} MiB after the load"


def test_command_serves_and_stops_on_ctrl_c(model_dir, adapter_dir, tmp_path):
    env = {**os.environ, "PTP_MLX_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "ptp_mlx.serve.cli", "--model", str(model_dir), "--adapter", str(adapter_dir)]
    p = subprocess.Popen(cmd + ["--port", "0", "--max-tokens", "8"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in p.stderr:
            m = re.search(r"serving model \(ptp\) on (http://\S+/v1)", line)
            if m:
                url = m.group(1)
                break
        assert url, "no 'serving' line"
        client = OpenAI(base_url=url, api_key="none", max_retries=0)
        wait_for(lambda: _up(client), 30)
        r = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens <= 8
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _up(client) -> bool:
    try:
        return bool(client.models.list().data)
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "99999"], "--port must be between"),
        (["--max-queue", "0"], "--max-queue must be at least 1"),
        (["--temp", "-1"], "temperature must be >= 0"),
        (["--port", "x"], "invalid int value"),
        (["--port", "{busy}"], "cannot listen on 127.0.0.1:"),
        (["--adapter", "none", "--num-draft-tokens", "2"], "--num-draft-tokens needs an adapter"),
    ],
)
def test_bad_flags_one_line_exit_2(model_dir, capsys, argv, message):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    argv = [a.format(busy=busy.getsockname()[1]) for a in argv]
    try:
        rc = serve_main(["--model", str(model_dir), *argv])
    except SystemExit as e:
        rc = e.code
    finally:
        busy.close()
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_lenient_acceptance_is_opt_in_and_answered_with_its_label(server):
    """The ``accept`` extension: a lenient rule is used only when asked for, and the response names it; its
    strictest setting answers what exact decoding answers."""
    client = server.client()
    msg = [{"role": "user", "content": "hello there"}]
    exact = client.chat.completions.create(model=MODEL_ID, messages=msg, max_tokens=24)
    strict = client.chat.completions.create(
        model=MODEL_ID, messages=msg, max_tokens=24, extra_body={"accept": "threshold:tau=1.5"}
    )
    assert strict.choices[0].message.content == exact.choices[0].message.content
    assert strict.usage.model_extra["ptp"]["accept"] == "lenient threshold tau=1.5"
    loose = client.chat.completions.create(
        model=MODEL_ID, messages=msg, max_tokens=24, extra_body={"accept": "threshold:0"}
    )
    ptp = loose.usage.model_extra["ptp"]
    assert ptp["accept"] == "lenient threshold tau=0" and ptp["drafts_accepted"] == ptp["drafts_proposed"] > 0
