"""The one thread that owns an engine, for the chat (``app/engine_thread.py``) and the server (``serve/worker.py``).

It is the only thread that touches the model, its caches and its MLX stream: it makes its own stream, loads the
engine inside it, then answers jobs from a queue one at a time, in order, until ``None`` arrives. What differs
between its owners are hooks: how loading is reported, how a job is answered and where its output goes (Textual
messages, a request's stream), which waiting jobs are skipped, and what the thread does once the queue closes.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Generic, TypeVar

J = TypeVar("J")


class EngineOwner(Generic[J]):
    """A queue of jobs answered in order on one thread that owns the engine (see the module docstring)."""

    def __init__(self, name: str, max_queue: int = 0) -> None:
        self._jobs: queue.Queue[J | None] = queue.Queue(maxsize=max_queue)
        self._current: J | None = None  # the job being answered (read by other threads to cancel it)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = threading.Event()  # the queue closed and the last job is done (``wait_stopped``)

    def _run(self) -> None:
        import mlx.core as mx

        # MLX streams belong to the thread that made them: this thread makes its own and does every model operation
        # (loading included) inside it.
        with mx.stream(mx.new_stream(mx.default_device())):
            engine = self._load()
            while (job := self._jobs.get()) is not None:
                if engine is None:
                    self._refuse(job)
                    continue
                if self._skip(job):
                    continue
                self._current = job
                try:
                    self._answer(engine, job)
                finally:
                    self._current = None
        self._closed()

    # -- hooks -------------------------------------------------------------------------------------------------------
    def _load(self) -> Any | None:
        """Load the engine and say so; None when loading failed (reported here)."""
        raise NotImplementedError

    def _refuse(self, job: J) -> None:
        """A job that arrived although loading failed."""

    def _skip(self, job: J) -> bool:
        """Whether a waiting job is dropped unanswered (its client left)."""
        return False

    def _answer(self, engine: Any, job: J) -> None:
        raise NotImplementedError

    def wait_stopped(self, timeout: float) -> None:
        """Wait (bounded) until the thread has answered its last job after the queue closed."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._stopped.wait(timeout)

    def _closed(self) -> None:
        """After the queue closed, still on this thread: it says so, then parks for good, never ending. MLX (0.32,
        Linux) aborts the process at exit ("terminate called without an active exception") when the thread that
        made a stream ended before it (the chat quit during an answer: exit 134, one time in a dozen); a daemon
        thread blocked here is harmless."""
        self._stopped.set()
        threading.Event().wait()
