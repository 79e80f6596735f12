"""Requests in, response bodies out: the OpenAI wire format, validated by hand so every bad field gets an
OpenAI-style error body (``{"error": {"message", "type", "param", "code"}}``) with status 400, not a framework's
422."""

from __future__ import annotations

import math
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from ..decode.accept import EXACT, AcceptRule
from ..logits import LogitsSettings
from ..sampler import SamplingSettings
from . import fields as F

MAX_STOPS = 4
ROLES = ("system", "developer", "user", "assistant", "tool")

# Every field a request may carry. Fields this server honours, and fields that change nothing in the answer
# (bookkeeping for the client or for OpenAI's platform), are accepted; any other field is refused with a 400 that
# names it, so a client never gets an answer without what it asked for (``--lenient`` ignores them instead).
COMMON_FIELDS = {
    "model", "temperature", "top_p", "top_k", "n", "seed", "max_tokens", "stop", "stream", "stream_options",
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "accept",
}  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "modalities",
}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
NO_EFFECT_FIELDS = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}


class APIError(Exception):
    """An error answered as an OpenAI error body with HTTP status ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Defaults:
    """The server's sampling flags: what a request gets for each field it leaves out. ``lenient``: fields the
    server does not honour are ignored instead of refused. ``fresh_seeds``: a request without ``seed`` draws a
    random one (``ptp-serve`` without ``--seed``), else it takes ``sampling.seed``."""

    sampling: SamplingSettings = SamplingSettings()
    max_tokens: int = 256
    lenient: bool = False
    fresh_seeds: bool = False


@dataclass
class GenRequest:
    """One validated generation request (chat or plain completion)."""

    kind: str  # "chat" or "completion"
    model: str
    sampling: SamplingSettings
    max_tokens: int
    messages: list[dict] | None = None  # chat
    prompt: str | list[int] | None = None  # completion: text or token ids
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logits: LogitsSettings = field(default_factory=LogitsSettings)  # penalties, logit_bias, logprobs
    tools: list[dict] | None = None  # chat: given to the chat template; calls are parsed back
    ignored: list[str] = field(default_factory=list)  # fields a lenient server ignored
    accept: AcceptRule = EXACT  # the ``accept`` extension: exact unless the client opts into a lenient rule


# --- field checks -------------------------------------------------------------------------------------------------


def _number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"'{name}' must be a number, got {v!r}", name, "invalid_type")
    return float(v)


def _int(body: dict, name: str, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer, got {v!r}", name, "invalid_type")
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {v!r}", name, "invalid_type")
    return v


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise bad(f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad("'stop' strings must not be empty", "stop")
    return list(dict.fromkeys(stops))


def _common(body: Any, served: str, defaults: Defaults, kind: str) -> tuple[dict, F.Refusals]:
    """Fields both endpoints share: model, sampling, processing, length, stop, stream; unknown fields refused."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    r = F.Refusals(defaults.lenient, bad)
    F.check_names(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS, NO_EFFECT_FIELDS, r)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {model!r}", "model", "invalid_type")
    if model is not None and model != served:
        raise APIError(
            404,
            f"The model '{model}' does not exist (this server serves '{served}')",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    n = _int(body, "n", 1)
    if n != 1:
        raise bad("only 'n' = 1 is supported", "n")
    d = defaults.sampling
    temperature = _number(body, "temperature", d.temperature)
    top_p = _number(body, "top_p", d.top_p)
    top_k = _int(body, "top_k", d.top_k)  # an extension (llama.cpp, vLLM and mlx-lm take it too)
    seed = _int(body, "seed", None)
    if seed is None:  # (OpenAI's API samples anew for each request that names no seed)
        seed = secrets.randbelow(2**63) if defaults.fresh_seeds else d.seed
    # max_completion_tokens is the newer name for max_tokens; either is accepted.
    max_tokens = _int(body, "max_tokens", _int(body, "max_completion_tokens", defaults.max_tokens))
    if temperature < 0:
        raise bad(f"'temperature' must be >= 0, got {temperature:g}", "temperature")
    if not 0 < top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {top_p:g}", "top_p")
    if top_k < 0:
        raise bad(f"'top_k' must be >= 0, got {top_k}", "top_k")
    if not 0 <= seed < 2**63:
        raise bad(f"'seed' must be a non-negative 64-bit integer, got {seed}", "seed")
    if max_tokens < 1:
        name = "max_tokens" if "max_tokens" in body else "max_completion_tokens"
        raise bad(f"'{name}' must be at least 1, got {max_tokens}", name)
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
    include_usage = _bool(opts or {}, "include_usage")
    accept = body.get("accept", "exact")  # an extension: PTP's acceptance rule (ptp_mlx/decode/accept.py)
    if not isinstance(accept, str):
        raise bad(f"'accept' must be a string, got {accept!r}", "accept", "invalid_type")
    try:
        rule = AcceptRule.parse(accept)
    except ValueError as e:
        raise bad(f"'accept': {e}", "accept") from None
    return {
        "accept": rule,
        "logits": F.logits_settings(body, kind, bad),
        "model": served,
        "sampling": SamplingSettings(temperature, top_k, top_p, seed),
        "max_tokens": max_tokens,
        "stop": _stops(body),
        "stream": stream,
        "include_usage": include_usage,
    }, r


def _content(v: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts (joined), as the OpenAI API allows."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for p in v:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad("only text content parts are supported", f"messages[{i}].content", "invalid_type")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(
        "a message's 'content' must be a string or a list of text parts", f"messages[{i}].content", "invalid_type"
    )


def parse_chat(body: Any, served: str, defaults: Defaults) -> GenRequest:
    """``POST /v1/chat/completions``: ``APIError`` on the first bad field."""
    common, r = _common(body, served, defaults, "chat")
    tools = F.chat_extras(body, r, bad)
    grammar = F.response_grammar(body, bad)
    if grammar is not None:
        common["logits"] = replace(common["logits"], grammar=grammar)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of messages", "messages", "invalid_type")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad("each message must be an object with 'role' and 'content'", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"'role' must be one of {', '.join(ROLES)}, got {role!r}", f"messages[{i}].role")
        # "developer" is the newer name of "system"; chat templates know the latter.
        try:
            messages.append(F.chat_message(m, i, _content))
        except ValueError as e:
            raise bad("'tool_calls' must be a list of function calls with a name and JSON arguments", str(e)) from None
    return GenRequest(kind="chat", messages=messages, tools=tools, ignored=r.ignored, **common)


def parse_completion(body: Any, served: str, defaults: Defaults) -> GenRequest:
    """``POST /v1/completions``: one prompt, text or token ids, without the chat template."""
    common, r = _common(body, served, defaults, "completion")
    F.completion_extras(body, r)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        prompt: str | list[int] = p
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        prompt = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise bad("only one prompt per request is supported", "prompt")
    else:
        raise bad("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")
    return GenRequest(kind="completion", prompt=prompt, ignored=r.ignored, **common)


# --- responses ----------------------------------------------------------------------------------------------------


@dataclass
class Usage:
    """Token counts plus PTP's figures (the ``ptp`` extension field)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prompt cache, not prefilled
    mode: str = "ar"
    accept: str = "exact"  # the acceptance rule's label: a lenient one is not the model's exact sample
    calls: int = 0
    tokens_per_call: float = 0.0  # as ptp-generate's summary: accepted drafts + 1, per model call
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    accepted_by_source: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "ptp": {
                "mode": self.mode,
                "accept": self.accept,
                "calls": self.calls,
                "tokens_per_call": round(self.tokens_per_call, 4),
                "drafts_proposed": self.drafts_proposed,
                "drafts_accepted": self.drafts_accepted,
                "accepted_by_source": dict(self.accepted_by_source),
            },
        }


def _first_per_key(top: list[dict]) -> dict[str, float]:
    """The legacy ``{token: logprob}`` map; tokens whose text is the same (bytes of one character) keep the
    likeliest."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t["token"], t["logprob"])
    return out


class Shaper:
    """Builds the response objects of one request (one id and timestamp for all its chunks).

    Log-probabilities arrive as chat entries (``{"token", "logprob", "bytes", "top_logprobs"}``, one per token);
    completions get them in the legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

    def __init__(self, req: GenRequest) -> None:
        self.req = req
        chat = req.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.offset = 0  # completions' text_offset of the next token

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def logprobs(self, entries: list[dict] | None) -> dict | None:
        if self.req.logits.logprobs is None or entries is None:
            return None
        if self.req.kind == "chat":
            return {"content": entries, "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_first_per_key(e["top_logprobs"]) for e in entries],
            "text_offset": offsets,
        }

    def full(
        self,
        text: str,
        finish_reason: str | None,
        usage: Usage,
        logprobs: list[dict] | None = None,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        """The non-streamed answer."""
        lp = self.logprobs(logprobs)
        if self.req.kind == "chat":
            message: dict = {"role": "assistant", "content": text}
            if tool_calls:
                message["content"] = text or None
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "logprobs": lp}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp}
        choice["finish_reason"] = finish_reason
        return {**self._head(self.object), "choices": [choice], "usage": usage.as_dict()}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        first: bool = False,
        logprobs: list[dict] | None = None,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        """One streamed chunk: a text delta (with its tokens' log-probabilities), the tool calls, or the closing
        one with ``finish_reason``."""
        lp = self.logprobs(logprobs)
        if self.req.kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(tool_calls)]
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the last
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage.as_dict()}
