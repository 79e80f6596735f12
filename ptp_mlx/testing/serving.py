"""Shared pieces of the server tests (``tests/test_serve*.py``): a real uvicorn server on a thread, the
``ptp-generate`` reference, a gate around the engine's ``generate`` and polling helpers. The server and its model
are the fixtures of ``tests/conftest.py`` (``serve_model_dir``, ``serve_adapter_dir``, ``server``). Tests only: this
imports the server's test dependencies (uvicorn, openai)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from openai import OpenAI

from ..generate_cli import main as generate_main
from ..serve.worker import EngineWorker

MODEL_ID = "tiny"
MAX_QUEUE = 16
MAX_BODY = 64 * 1024
DRAFTS = 3  # a fixed draft budget: every call verifies drafts (the random adapter would not pay its way adaptively)


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
