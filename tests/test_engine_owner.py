"""The one engine-owning thread of the chat and the server (``ptp_mlx/engine_owner.py``): jobs answered in order on
that thread, waiting jobs its owner skips never answered, and every job refused when loading failed."""

import threading

import pytest

from ptp_mlx.engine_owner import EngineOwner


class Recorder(EngineOwner[str]):
    def __init__(self, fail: bool = False):
        super().__init__("test-owner")
        self.fail, self.log, self.threads, self.done = fail, [], set(), threading.Event()

    def _load(self):
        self.threads.add(threading.current_thread().name)
        return None if self.fail else "engine"

    def _refuse(self, job):
        self.log.append(("refused", job))

    def _skip(self, job):
        return job.startswith("skip")

    def _answer(self, engine, job):
        self.threads.add(threading.current_thread().name)
        assert self._current == job
        self.log.append((engine, job))

    def _closed(self):
        self.done.set()
        threading.Event().wait()  # parked, as the server's worker is (an MLX stream's thread must outlive exit)


def test_jobs_are_answered_in_order_on_the_owners_thread():
    owner = Recorder()
    for job in ("a", "skip-b", "c", None):
        owner._jobs.put(job)
    owner._thread.start()
    assert owner.done.wait(30)
    assert owner.log == [("engine", "a"), ("engine", "c")] and owner._current is None
    assert owner.threads == {"test-owner"}


def test_a_failed_load_refuses_every_job():
    owner = Recorder(fail=True)
    for job in ("a", "b", None):
        owner._jobs.put(job)
    owner._thread.start()
    assert owner.done.wait(30)
    assert owner.log == [("refused", "a"), ("refused", "b")]


def test_the_thread_outlives_its_queue_for_the_chat_and_the_server():
    # Both owners park their thread once the queue closes (MLX aborts the process at exit when the thread that made
    # a stream ended first: the chat, which let its thread end, exited 134 one quit in a dozen).
    from ptp_mlx.app.engine_thread import EngineThread

    from ptp_mlx.serve.worker import EngineWorker

    def no_engine(*_):
        raise RuntimeError("no model here")  # (loading fails: the thread still waits for its queue to close)

    chat = EngineThread(no_engine, lambda message: None)
    chat.start()
    chat.shutdown(timeout=30)
    worker = EngineWorker(no_engine)
    with pytest.raises(RuntimeError):
        worker.start(timeout=30)
    worker.shutdown(timeout=30)
    for owner in (chat, worker):
        assert owner._stopped.is_set() and owner._thread.is_alive()
