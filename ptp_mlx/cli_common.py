"""What every command shares: the error/exit-code contract and the common flags (docs/conventions.md)."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence

from .errors import UserError


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default, unless the help already names it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if "default" in text or action.required or d is None or d is False or d == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def run_cli(
    main: Callable[[argparse.Namespace], int | None], parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> int:
    """Parse ``argv``, run ``main`` and map failures to the exit-code contract.

    0 success, 1 failure while running (Ctrl-C included), 2 bad usage or bad input. Errors are one line on
    stderr starting with ``error:``; tracebacks only with ``--debug``.
    """
    if not any(a.dest == "debug" for a in parser._actions):
        parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    _one_line_usage_errors(parser)
    args = parser.parse_args(argv)
    _quiet_libraries(args)
    try:
        rc = main(args)
        return int(rc or 0)
    except UserError as e:
        _report(args, e)
        return 2
    except KeyboardInterrupt:
        print("\nerror: interrupted", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 1
    except Exception as e:
        _report(args, e)
        return 1


def _quiet_libraries(args: argparse.Namespace) -> None:
    """Library warnings (transformers' "sequence length is longer than..." and the like) are not for the
    terminal: our checks report what matters as one line. ``--debug`` keeps them."""
    if getattr(args, "debug", False):
        return
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def _one_line_usage_errors(parser: argparse.ArgumentParser) -> None:
    """Usage errors as one ``error:`` line and exit code 2, for the parser and its subparsers."""

    def error(message: str):
        print(f"error: {message} (see {parser.prog} --help)", file=sys.stderr)
        raise SystemExit(2)

    parser.error = error
    parser.formatter_class = HelpFormatter  # --help shows every default
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _one_line_usage_errors(sub)


def _report(args: argparse.Namespace, e: BaseException) -> None:
    if getattr(args, "debug", False):
        traceback.print_exc()
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"error: {msg}", file=sys.stderr)


def add_model_flags(p: argparse.ArgumentParser, adapter: bool = True) -> None:
    p.add_argument(
        "--model", default=None, help="model folder or Hugging Face repo id (default: SmolLM2-135M-Instruct)"
    )
    if adapter:
        p.add_argument(
            "--adapter",
            default=None,
            help="adapter folder (default: the one shipped for the model; 'none' for no adapter)",
        )
        p.add_argument(
            "--mode",
            choices=["ptp", "ar"],
            default=None,
            help="decoding mode (default: ptp when an adapter is available, else ar)",
        )
        p.add_argument(
            "--num-draft-tokens",
            type=int,
            default=None,
            metavar="N",
            help="fixed draft budget: verify up to N drafts on every PTP call (default: the adaptive budget)",
        )


def add_sampling_flags(
    p: argparse.ArgumentParser, max_tokens: int = 256, seed_help: str = "seed of the uniform stream"
) -> None:
    """The sampling flags every command shares (``seed_help``: what ``--seed`` means for this command)."""
    p.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus threshold (1 = off)")
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="maximum new tokens")


def sampling_from_args(args: argparse.Namespace):
    """Validated ``SamplingSettings`` from the shared sampling flags (``UserError`` on bad values)."""
    from .sampler import SamplingSettings

    s = SamplingSettings(args.temp, args.top_k, args.top_p, args.seed)
    try:
        s.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    if getattr(args, "max_tokens", 1) < 1:
        raise UserError("--max-tokens must be at least 1")
    adapter = getattr(args, "adapter", None)
    if getattr(args, "mode", None) == "ptp" and adapter and str(adapter).lower() == "none":
        raise UserError("--mode ptp needs an adapter")
    n = getattr(args, "num_draft_tokens", None)
    if n is not None and n < 1:
        raise UserError("--num-draft-tokens must be at least 1")
    if getattr(args, "mode", None) == "ptp":
        from .models import check_ptp_model

        check_ptp_model(getattr(args, "model", None))  # refuse before any weights load
    return s
