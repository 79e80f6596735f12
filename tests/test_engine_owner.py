"""The one engine-owning thread of the chat and the server (``ptp_mlx/engine_owner.py``): jobs answered in order on
that thread, waiting jobs its owner skips never answered, and every job refused when loading failed."""

import threading

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
