"""The engine worker: the one thread that touches MLX, the model and its caches.

MLX streams belong to the thread that made them, and one model decodes one answer at a time, so requests queue
in order (a bounded queue: a full one is refused at once with 503) and each job sends its text back to the event
loop through ``loop.call_soon_threadsafe``. A job's ``cancel`` flag (the client went away) is read between model
calls; a job cancelled while it waited is skipped. Prompt caches are kept in a small LRU: a request that continues
a cached conversation prefills only its new tokens.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine_owner import EngineOwner
from ..errors import UserError
from ..generate import ContextFull
from ..prompt_cache import PromptCache
from ..stats import RunStats
from .schema import APIError, GenRequest, Usage
from .stops import StopMatcher
from .tools_out import AnswerText


@dataclass
class Delta:
    text: str
    logprobs: list[dict] | None = None  # chat-shaped entries of the tokens behind ``text`` (when asked for)


@dataclass
class Done:
    finish_reason: str
    usage: Usage
    tool_calls: list[dict] | None = None


@dataclass
class Failed:
    error: APIError


_SHUTTING_DOWN = APIError(503, "the server is shutting down", "server_error", None, "shutting_down")


@dataclass
class Job:
    """One request for the worker; its events arrive on ``events`` (an ``asyncio.Queue`` of ``loop``)."""

    req: GenRequest
    ids: list[int]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    turn_start: int = 0  # where the prompt's last user message starts (``Engine.turn_start``)

    def post(self, event: Delta | Done | Failed) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is going down, nobody listens
            self.cancel.set()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PromptCachePool:
    """At most ``size`` prompt caches, least recently used evicted first.

    ``take`` hands out the cache that shares the longest prefix with the prompt when the prompt continues it:
    the shared prefix covers the prompt that cache last answered (the same prompt again, or the conversation
    plus a new turn), or at least half of all it holds. Otherwise a fresh cache: a cache taken is trimmed to the
    shared prefix, so handing it to a stranger that shares only a chat-template header would throw its
    conversation away. ``put`` returns a cache with the length of the prompt it answered."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: list[tuple[PromptCache, int]] = []  # (cache, its last prompt's length), least recent first

    def take(self, ids: list[int]) -> PromptCache:
        best, best_n = None, 0
        for entry in self.entries:
            n = common_prefix(entry[0].tokens, ids[:-1])
            if n > best_n:
                best, best_n = entry, n
        if best is not None and (best_n >= best[1] - 1 or best_n * 2 >= len(best[0].tokens)):
            self.entries.remove(best)
            return best[0]
        return PromptCache()

    def put(self, pc: PromptCache, prompt_len: int) -> None:
        if pc.cache is None:
            return  # nothing stored (the answer failed): nothing worth keeping
        self.entries.append((pc, prompt_len))
        del self.entries[: max(0, len(self.entries) - self.size)]


class EngineWorker(EngineOwner[Job]):
    """Loads the engine on its own thread (``ptp_mlx/engine_owner.py``), then answers ``Job``s one at a time, in
    order; a full queue is refused with 503."""

    def __init__(
        self,
        loader: Callable[[], object],
        max_queue: int = 16,
        cache_size: int = 4,
        mode: str | None = None,
        num_draft_tokens: int | None = None,
    ) -> None:
        super().__init__("ptp-serve-engine", max_queue)
        self._loader = loader
        self._ready = threading.Event()
        self._closing = False
        self.pool = PromptCachePool(cache_size) if cache_size > 0 else None
        self.engine = None
        self.load_error: BaseException | None = None
        self.mode = mode
        self.num_draft_tokens = num_draft_tokens

    # --- the asyncio side -----------------------------------------------------------------------------------------

    def start(self, timeout: float | None = None):
        """Start the thread and wait for the engine; re-raise what loading raised. Returns the engine."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not load in time")
        if self.load_error is not None:
            raise self.load_error
        return self.engine

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise ``APIError`` 503 when the queue is full or the server is stopping."""
        if self._closing:
            raise APIError(503, "the server is shutting down", "server_error", None, "shutting_down")
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise APIError(
                503,
                f"the server is busy: {self._jobs.maxsize} requests are already waiting; retry later",
                "server_error",
                None,
                "queue_full",
            ) from None

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def interrupt(self) -> None:
        """Ctrl-C: the answer in progress ends now, its client told (a 503 "shutting down", in the stream if it is
        one), so open streams close at once instead of holding the server's graceful shutdown. Never blocks (it
        runs in the signal handler); ``shutdown`` does the rest."""
        self._closing = True
        job = self._current
        if job is not None:
            job.cancel.set()
            job.post(Failed(_SHUTTING_DOWN))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancel the answer in progress and every waiting job, end the thread and wait for it (bounded)."""
        self._closing = True
        if self._current is not None:
            self._current.cancel.set()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.post(Failed(_SHUTTING_DOWN))
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass
        self.wait_stopped(timeout)

    # --- the engine thread ----------------------------------------------------------------------------------------

    def _load(self):
        try:
            engine = self._loader()
            self.mode = self.mode or engine.default_mode()
            self.engine = engine
        except BaseException as e:
            self.load_error = e
            engine = None
        self._ready.set()
        return engine

    def _refuse(self, job: Job) -> None:
        job.post(Failed(APIError(503, "the engine did not load", "server_error", None, None)))

    def _skip(self, job: Job) -> bool:
        return job.cancel.is_set()  # its client left while it waited

    def _answer(self, engine, job: Job) -> None:
        try:
            self._respond(job)
        except APIError as e:
            job.post(Failed(e))
        except ContextFull as e:
            job.post(Failed(APIError(400, str(e), param="messages", code="context_length_exceeded")))
        except (UserError, ValueError) as e:
            job.post(Failed(APIError(400, str(e))))
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            job.post(Failed(APIError(500, f"{type(e).__name__}: {msg}", "server_error", None, None)))

    def _respond(self, job: Job) -> None:
        eng, req = self.engine, job.req
        pc = self.pool.take(job.ids) if self.pool is not None else None
        out = AnswerText(eng.tokenizer, StopMatcher(req.stop), req.tools)
        stats = RunStats()
        label = req.accept.label if self.mode == "ptp" else "exact"
        usage = Usage(prompt_tokens=len(job.ids), mode=self.mode, accept=label)
        finish = None
        steps = None
        ok = False
        try:
            steps = eng.generate(
                job.ids,
                mode=self.mode,
                sampling=req.sampling,
                max_tokens=req.max_tokens,
                num_draft_tokens=self.num_draft_tokens,
                prompt_cache=pc,
                logits=req.logits,
                accept=req.accept,
                turn_start=job.turn_start,
                continuation=req.kind != "chat",  # (/v1/completions: the text continues the prompt, space and all)
            )
            for st in steps:
                stats.add(st, final=False)
                usage.completion_tokens = st.generated
                text, lps = out.feed(st)
                if text or lps:
                    job.post(Delta(text, lps))
                if out.stops.stopped:
                    finish = "stop"
                elif st.finish_reason:
                    finish = st.finish_reason
                if finish or job.cancel.is_set():
                    break
            ok = True
        finally:
            if steps is not None:
                steps.close()  # stores the prompt cache (stream_generate's finally)
            if pc is not None and ok:  # (a cache is taken only from a pool)
                self.pool.put(pc, len(job.ids))
        if job.cancel.is_set():
            return  # nobody is listening
        tail, lps, calls = out.finish()
        if tail or lps:
            job.post(Delta(tail, lps))
        if calls and finish == "stop":
            finish = "tool_calls"
        usage.calls, usage.drafts_proposed, usage.drafts_accepted = stats.calls, stats.proposed, stats.accepted
        usage.tokens_per_call = stats.mean_accepted
        usage.accepted_by_source = dict(stats.by_source)
        usage.cached_tokens = pc.reused if pc is not None else 0
        job.post(Done(finish or "length", usage, calls or None))
