"""The FastAPI application: OpenAI's ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``.

Handlers run on the event loop and never touch MLX: they parse and tokenize the request, queue a ``Job`` for the
engine worker and turn its events into one JSON body or a server-sent event stream (``data: {...}`` lines, then
``data: [DONE]``). Every failure is an OpenAI error body with its status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..tools import supports_tools
from .schema import APIError, Defaults, GenRequest, Shaper, parse_chat, parse_completion
from .worker import Delta, Done, EngineWorker, Failed, Job

POLL_S = 0.25  # how often a non-streamed request checks that its client is still there (waiting or not)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def read_json(request: Request, limit: int) -> object:
    """The JSON body, refused with 413 past ``limit`` bytes (before reading it, when Content-Length says so)."""
    too_big = APIError(413, f"the request body is larger than the limit of {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def create_app(worker: EngineWorker, model_id: str, defaults: Defaults, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The server for ``worker`` (already started: its engine loaded) serving the model named ``model_id``."""
    eng = worker.engine
    context = getattr(eng.pm.args, "max_position_embeddings", None) or 1 << 30
    vocab = getattr(eng.pm.args, "vocab_size", None)
    created = int(time.time())
    app = FastAPI(title="ptp-serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return _error(APIError(e.status_code, f"{e.detail}: {request.method} {request.url.path}", code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(APIError(400, str(e), code="invalid_value"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        return _error(APIError(500, f"internal error: {type(e).__name__}", "server_error"))

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "ptp-mlx"}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict:
        if name != model_id:
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return model_card()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "waiting": worker.waiting}

    def check_extras(req: GenRequest) -> None:
        """What needs the model: token ids of ``logit_bias``, and a chat template that defines tool calls."""
        if vocab is not None and any(not 0 <= t < vocab for t in req.logits.logit_bias):
            raise APIError(400, f"'logit_bias' token ids must be in [0, {vocab})", param="logit_bias")
        if req.tools and not supports_tools(eng.tokenizer):
            if not defaults.lenient:
                raise APIError(
                    400,
                    "this model's chat template defines no tool-call format, so 'tools' cannot be honoured "
                    "(ptp-serve --lenient ignores it)",
                    param="tools",
                    code="unsupported_parameter",
                )
            req.tools = None
            req.ignored.append("tools")
        if req.ignored:
            logging.getLogger("uvicorn.error").warning("ignored (--lenient): %s", ", ".join(req.ignored))

    def prompt_ids(req: GenRequest) -> list[int]:
        check_extras(req)
        param = "messages" if req.kind == "chat" else "prompt"
        if req.kind == "chat":
            try:
                # exactly as ptp-generate builds them (docs/conventions.md); tools go to the template
                ids = eng.encode(req.messages, tools=req.tools)
            except Exception as e:
                raise APIError(400, f"the chat template refused the messages: {e}", param=param) from None
        elif isinstance(req.prompt, str):
            ids = list(eng.tokenizer.encode(req.prompt))  # as ptp-generate --no-chat
        else:
            ids = req.prompt
            if vocab is not None and any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"token ids must be in [0, {vocab})", param=param)
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        if len(ids) >= context:
            raise APIError(
                400,
                f"the prompt is {len(ids)} tokens but the model's context is {context}",
                param=param,
                code="context_length_exceeded",
            )
        return ids

    async def respond(request: Request, req: GenRequest):
        ids = prompt_ids(req)
        # (a lenient rule verifies copies of an earlier turn exactly: where this request's own turn starts)
        turn = eng.turn_start(req.messages, ids, req.tools) if req.kind == "chat" and req.accept.lenient else 0
        job = Job(req, ids, asyncio.get_running_loop(), turn_start=turn)
        worker.submit(job)
        shaper = Shaper(req)
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(_sse(job, shaper), media_type="text/event-stream", headers=headers)
        text, logprobs = [], []
        watch = ClientWatch(request)
        try:
            while True:
                ev = await _next_event(job, watch)
                if ev is None:  # the client left: stop its generation, answer nobody
                    return JSONResponse({}, status_code=499)
                if isinstance(ev, Delta):
                    text.append(ev.text)
                    logprobs += ev.logprobs or []
                elif isinstance(ev, Done):
                    body = shaper.full("".join(text), ev.finish_reason, ev.usage, logprobs, ev.tool_calls)
                    return JSONResponse(body)
                else:
                    return _error(ev.error)
        finally:
            job.cancel.set()  # no-op once done; stops the worker when this handler was cancelled

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, parse_chat(await read_json(request, max_body_bytes), model_id, defaults))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, parse_completion(await read_json(request, max_body_bytes), model_id, defaults))

    return app


class ClientWatch:
    """Whether a non-streamed request's client is still there, asked at most every ``POLL_S`` seconds: between
    events too, so a client that leaves while the tokens flow stops its generation (a streamed one is cancelled by
    Starlette instead)."""

    def __init__(self, request: Request):
        self.request, self.last = request, time.monotonic()

    async def gone(self) -> bool:
        now = time.monotonic()
        if now - self.last < POLL_S:
            return False
        self.last = now
        return await self.request.is_disconnected()


async def _next_event(job: Job, watch: ClientWatch | None) -> Delta | Done | Failed | None:
    """The job's next event; ``None`` when ``watch`` finds that the client disconnected (the job is cancelled)."""
    while True:
        if watch is not None and await watch.gone():
            job.cancel.set()
            return None
        try:
            return await asyncio.wait_for(job.events.get(), POLL_S)
        except asyncio.TimeoutError:
            pass


def _sse_line(obj: object) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _sse(job: Job, shaper: Shaper) -> AsyncIterator[str]:
    """The event stream of one job. A client that disconnects cancels this generator (Starlette), whose
    ``finally`` sets the job's cancel flag: the worker stops at its next model call, or skips the job."""
    try:
        if shaper.req.kind == "chat":
            yield _sse_line(shaper.chunk(None, first=True))  # the role, as OpenAI's first chunk
        while True:
            ev = await _next_event(job, None)
            if isinstance(ev, Delta):
                yield _sse_line(shaper.chunk(ev.text, logprobs=ev.logprobs))
            elif isinstance(ev, Done):
                if ev.tool_calls:
                    yield _sse_line(shaper.chunk(None, tool_calls=ev.tool_calls))
                yield _sse_line(shaper.chunk(None, ev.finish_reason))
                if shaper.req.include_usage:
                    yield _sse_line(shaper.usage_chunk(ev.usage))
                break
            elif isinstance(ev, Failed):
                yield _sse_line(ev.error.body())  # the status line is sent already: the error goes in the stream
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()
