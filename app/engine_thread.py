"""The engine thread: the only thread that touches the model, its caches and its MLX stream.

The UI posts ``ChatRequest``s to it and gets Textual messages back: status lines while loading, one
``BlockGenerated`` per accepted block, and one ``AnswerFinished``/``AnswerFailed`` per request. The UI never
waits on it, so typing stays responsive while the model works.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from textual.message import Message

from ptp_mlx.engine_owner import EngineOwner
from ptp_mlx.sampler import SamplingSettings

LogFn = Callable[[str], None]


@dataclass(frozen=True)
class GenSettings(SamplingSettings):
    """Sampling settings plus the answer length, as given on the command line."""

    max_tokens: int = 256
    num_draft_tokens: int | None = None  # a fixed draft budget (None: adaptive)

    def describe(self) -> str:
        """Short text for the status bar, e.g. ``greedy · max 256``."""
        if self.greedy:
            parts = ["greedy"]
        else:
            parts = [f"T {self.temperature:g}"]
            if self.top_k:
                parts.append(f"top-k {self.top_k}")
            if self.top_p < 1:
                parts.append(f"top-p {self.top_p:g}")
        parts += [f"seed {self.seed}", f"max {self.max_tokens}"]
        if self.num_draft_tokens:
            parts.append(f"{self.num_draft_tokens} drafts")
        return " · ".join(parts)


class EngineLike(Protocol):
    """What the chat needs from an engine (``ptp_mlx.engine.Engine`` or a test fake)."""

    @property
    def has_adapter(self) -> bool: ...

    def default_mode(self) -> str: ...

    def generate(
        self, prompt: Sequence[dict], mode: str | None = None, sampling: Any = None, max_tokens: int = 256
    ) -> Iterator[Any]: ...


Loader = Callable[[LogFn], EngineLike]


@dataclass
class ChatRequest:
    """One answer to produce. ``stop`` is set by the UI (Esc, new chat, quit) and read between blocks.
    ``conversation``: the id of the chat it belongs to (the engine thread keeps one prompt cache per chat)."""

    request_id: int
    messages: list[dict]
    mode: str
    settings: GenSettings
    conversation: str = ""
    stop: threading.Event = field(default_factory=threading.Event)
    accept: Any = None  # a lenient ``AcceptRule`` (ptp_mlx/decode/accept.py); None or exact: the exact sample


class EngineStatus(Message):
    """A progress line while the model loads (fetching, converting, loading, measuring)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class EngineReady(Message):
    def __init__(self, has_adapter: bool, default_mode: str, description: str) -> None:
        super().__init__()
        self.has_adapter = has_adapter
        self.default_mode = default_mode
        self.description = description


class EngineFailed(Message):
    """The model could not be loaded; ``error`` is one line for a notification."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class BlockGenerated(Message):
    """One accepted block (a ``GenerationStep``) of request ``request_id``."""

    def __init__(self, request_id: int, step: Any) -> None:
        super().__init__()
        self.request_id = request_id
        self.step = step


class AnswerFinished(Message):
    def __init__(self, request_id: int, finish_reason: str | None, stopped: bool) -> None:
        super().__init__()
        self.request_id = request_id
        self.finish_reason = finish_reason
        self.stopped = stopped


class AnswerFailed(Message):
    def __init__(self, request_id: int, error: str) -> None:
        super().__init__()
        self.request_id = request_id
        self.error = error


def describe_error(e: BaseException) -> str:
    """One line for a notification: never a traceback."""
    from ptp_mlx.errors import UserError

    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    name = type(e).__name__
    if name == "ContextFull":
        return f"context full: {msg}. Start a new chat with ctrl+l."
    if isinstance(e, UserError):
        return msg or name
    return f"{name}: {msg}" if msg else name


def describe_engine(engine: EngineLike) -> str:
    """``model · adapter`` for the status line."""
    model = getattr(engine, "model_path", None) or "model"
    adapter = getattr(engine, "adapter_path", None)
    name = Path(str(model)).name or str(model)
    return f"{name} · " + (f"adapter {Path(str(adapter)).name}" if adapter else "no adapter")


def engine_loader(model: str | None, adapter: str | None, measure_cost: bool = True) -> Loader:
    """The real loader: ``Engine.load`` (fetching and converting the default model on first use)."""

    def load(log: LogFn) -> EngineLike:
        log("loading " + (model or "the default model") + " …")
        from ptp_mlx.engine import Engine

        return Engine.load(model, adapter, log=log, measure_cost=measure_cost)

    return load


class EngineThread(EngineOwner[ChatRequest]):
    """Owns the engine for the chat (``ptp_mlx/engine_owner.py``): loads it, then answers requests one at a time on
    its own MLX stream, posting Textual messages."""

    def __init__(self, loader: Loader, post: Callable[[Message], Any]) -> None:
        super().__init__("ptp-engine")
        self._loader = loader
        self._post = post
        self._load_error = ""
        # The conversation's KV cache, carried between answers: each turn prefills only what is new (the cache is
        # trimmed to whatever prefix the prompts still share). One cache, for the chat answered last: another
        # chat (a new one, or one reopened from the list) starts a fresh one and the old one's memory goes.
        self._prompt_cache = None
        self._cache_conversation: str | None = None

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: ChatRequest) -> None:
        self._jobs.put(request)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the answer in progress, end the thread and wait for it (bounded)."""
        if self._current is not None:
            self._current.stop.set()
        self._jobs.put(None)
        self.wait_stopped(timeout)  # (the thread itself parks: ``EngineOwner._closed``)

    def _load(self) -> EngineLike | None:
        try:
            engine = self._loader(lambda text: self._post(EngineStatus(text)))
        except Exception as e:
            self._load_error = describe_error(e)
            self._post(EngineFailed(self._load_error))
            return None
        self._post(EngineReady(engine.has_adapter, engine.default_mode(), describe_engine(engine)))
        return engine

    def _refuse(self, req: ChatRequest) -> None:
        self._post(AnswerFailed(req.request_id, "no model loaded: " + self._load_error))

    def _answer(self, engine: EngineLike, req: ChatRequest) -> None:
        s = req.settings
        sampling = SamplingSettings(s.temperature, s.top_k, s.top_p, s.seed)  # without max_tokens
        reason: str | None = None
        steps = None
        try:
            kw = {}
            if hasattr(engine, "new_prompt_cache"):  # the real engine (test fakes have no cache)
                if self._prompt_cache is None or self._cache_conversation != req.conversation:
                    self._prompt_cache = engine.new_prompt_cache()
                    self._cache_conversation = req.conversation
                kw["prompt_cache"] = self._prompt_cache
            if s.num_draft_tokens:
                kw["num_draft_tokens"] = s.num_draft_tokens
            if req.accept is not None and req.accept.lenient:
                kw["accept"] = req.accept
            steps = iter(engine.generate(req.messages, mode=req.mode, sampling=sampling, max_tokens=s.max_tokens, **kw))
            while not req.stop.is_set():
                step = next(steps, None)
                # Checked again after the call: a block computed after Esc is dropped, not shown.
                if step is None or req.stop.is_set():
                    break
                self._post(BlockGenerated(req.request_id, step))
                reason = getattr(step, "finish_reason", None)
                if reason:
                    break
        except Exception as e:
            self._post(AnswerFailed(req.request_id, describe_error(e)))
            return
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                close()
        self._post(AnswerFinished(req.request_id, reason, req.stop.is_set()))
