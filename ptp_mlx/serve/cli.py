"""``ptp-serve``: the OpenAI-compatible server (uvicorn) on one engine worker.

Notices and uvicorn's logs go to stderr (docs/conventions.md: a server has no product on stdout). Bad flags exit
2 with one ``error:`` line; Ctrl-C stops the server cleanly (exit 0).
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from ..cli_common import add_model_flags, add_sampling_flags, run_cli, sampling_from_args
from ..errors import UserError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ptp-serve",
        description="Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models) with lossless PTP decoding. The sampling flags are the defaults of requests that leave "
        "those fields out.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free port)")
    add_model_flags(p)
    add_sampling_flags(
        p,
        seed_help="seed of the uniform stream for requests without 'seed' (default: a fresh one per request, as "
        "OpenAI's API samples anew; give a number to make every such request reproducible)",
    )
    p.set_defaults(seed=None)
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait for the engine; more get 503")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body; larger get 413")
    p.add_argument(
        "--prompt-cache-size", type=int, default=4, help="conversations whose KV cache is kept (0: no prompt cache)"
    )
    p.add_argument("--model-id", default=None, help="the model's name in the API (default: the model folder's name)")
    p.add_argument("--no-access-log", action="store_true", help="do not log each request on stderr")
    p.add_argument(
        "--lenient",
        action="store_true",
        help="ignore request fields this server cannot honour (logged on stderr) instead of answering 400",
    )
    return p


def model_name(model: str | None) -> str:
    """The id the API shows: the folder's name for a local model, the repo id as given otherwise."""
    from ..paths import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path.resolve().name if path.exists() else model


def _listen(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails at once, as one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _log_config(access: bool) -> dict:
    """uvicorn's logging, every handler on stderr."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    for h in cfg["handlers"].values():
        h["stream"] = "ext://sys.stderr"
    if not access:
        cfg["loggers"]["uvicorn.access"]["handlers"] = []
        cfg["loggers"]["uvicorn.access"]["propagate"] = False
    return cfg


def _serve(config, worker, sock) -> None:
    """Run uvicorn on ``sock`` until Ctrl-C, which first ends the answer in progress (``EngineWorker.interrupt``): an
    open stream then closes with an error event and ``[DONE]`` at once, instead of running until the graceful
    shutdown's timeout cancels it (a traceback per stream on stderr)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            worker.interrupt()
            super().handle_exit(sig, frame)

    Server(config).run(sockets=[sock])


def run(args: argparse.Namespace) -> int:
    fresh_seeds = args.seed is None  # (a request without 'seed' then draws its own: ``schema.Defaults``)
    args.seed = 0 if fresh_seeds else args.seed
    sampling = sampling_from_args(args)
    for flag, value, low in (("--max-queue", args.max_queue, 1), ("--max-body-bytes", args.max_body_bytes, 1)):
        if value < low:
            raise UserError(f"{flag} must be at least {low}")
    if args.prompt_cache_size < 0:
        raise UserError("--prompt-cache-size must be at least 0")
    if not 0 <= args.port <= 65535:
        raise UserError("--port must be between 0 and 65535")
    try:
        import uvicorn

        from .app import create_app
    except ImportError as e:
        raise UserError(f"ptp-serve needs the serve extra (pip install 'ptp-mlx[serve]'): {e}") from None
    from ..engine import Engine
    from .schema import Defaults
    from .worker import EngineWorker

    sock = _listen(args.host, args.port)
    worker = EngineWorker(
        lambda: Engine.load(args.model, args.adapter),
        max_queue=args.max_queue,
        cache_size=args.prompt_cache_size,
        mode=args.mode,
        num_draft_tokens=args.num_draft_tokens,
    )
    try:
        eng = worker.start()
        if args.mode == "ptp" and not eng.has_adapter:
            raise UserError("PTP mode needs an adapter (--adapter DIR), or use --mode ar")
        n = args.num_draft_tokens
        if n is not None and not eng.has_adapter:
            raise UserError("--num-draft-tokens needs an adapter (--adapter DIR)")
        if n is not None and not 1 <= n <= eng.pm.config.window - 1:
            raise UserError(f"--num-draft-tokens must be between 1 and {eng.pm.config.window - 1} for this adapter")
        defaults = Defaults(sampling, args.max_tokens, lenient=args.lenient, fresh_seeds=fresh_seeds)
        model_id = args.model_id or model_name(args.model)
        app = create_app(worker, model_id, defaults, args.max_body_bytes)
        host, port = sock.getsockname()[:2]
        print(
            f"serving {model_id} ({worker.mode}) on http://{host}:{port}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True
        )
        config = uvicorn.Config(
            app, log_config=_log_config(not args.no_access_log), timeout_graceful_shutdown=5, lifespan="off"
        )
        try:
            _serve(config, worker, sock)
        except KeyboardInterrupt:
            pass  # uvicorn re-raises the Ctrl-C it handled: the server has stopped cleanly
    finally:
        worker.shutdown()
        sock.close()
    return 0


def main(argv=None) -> int:
    return run_cli(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
