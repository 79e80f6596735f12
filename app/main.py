"""``ptp-chat``: the Textual chat (docs/conventions.md flags; errors inside the app are notifications)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ptp_mlx.cli_common import add_model_flags, add_sampling_flags, run_cli, sampling_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ptp-chat", description="Chat with a local model; watch PTP accept token blocks.")
    add_model_flags(p)
    add_sampling_flags(p, max_tokens=512)
    p.add_argument(
        "--system", default=None, help="system prompt, where the chat template has a system role (default: none)"
    )
    p.add_argument(
        "--accept",
        default="exact",
        metavar="RULE",
        help="acceptance rule to start with: exact (the model's exact sample, default) or a LENIENT rule, as for "
        "ptp-generate (not the exact sample); ctrl+g switches between exact and this rule (entropy:pivot=1 when exact)",
    )
    p.add_argument(
        "--no-measure",
        action="store_true",
        help="skip measuring the forward-pass cost curve for the PTP budget (a flat curve is used)",
    )
    return p


def run(args: argparse.Namespace) -> int:

    from ptp_mlx.decode.accept import AcceptRule
    from ptp_mlx.errors import UserError

    from .chat import ChatApp
    from .engine_thread import GenSettings, engine_loader
    from .history import store_for_model

    sampling_from_args(args)
    try:
        accept = AcceptRule.parse(args.accept)
    except ValueError as e:
        raise UserError(f"--accept: {e}") from None
    settings = GenSettings(args.temp, args.top_k, args.top_p, args.seed, args.max_tokens, args.num_draft_tokens)
    # A model or adapter folder that does not exist is refused here (one error line, exit 2, no window); what only
    # loading finds (a bad config, another model's adapter) is reported inside the app, where the model loads.
    if args.model is not None:
        from ptp_mlx.models import resolve_model

        resolve_model(args.model)  # (a local path is checked; a hub repo id passes, fetched when the app loads)
    if args.adapter is not None and args.adapter.lower() != "none" and not Path(args.adapter).expanduser().exists():
        raise UserError(f"adapter folder not found: {args.adapter}")
    loader = engine_loader(args.model, args.adapter, measure_cost=not args.no_measure)
    app = ChatApp(loader, settings, args.mode, store=store_for_model(args.model), system=args.system, accept=accept)
    app.run()
    return 1 if app.load_error else 0  # the model never loaded: a failure while running


def main(argv=None) -> int:
    return run_cli(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
