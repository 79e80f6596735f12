"""``ptp-bench``'s flags checked before anything slow happens (one error line, exit 2: docs/conventions.md)."""

from __future__ import annotations

import argparse

from ..cli_common import sampling_from_args
from ..errors import UserError
from .methods import METHODS

NO_FILE = {"--chat-turns": ("--json", "--plot"), "--profile": ("--plot",), "--cost-sweep": ("--plot",)}


def parse_list(s: str | None) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()] if s else []


def validate(args: argparse.Namespace):
    """Check every flag before anything slow happens. Returns (sampling, methods or None, widths)."""
    sampling = sampling_from_args(args)
    for flag, v in (
        ("--max-tokens", args.max_tokens),
        ("--repeats", args.repeats),
        ("--num-draft-tokens", 1 if args.num_draft_tokens is None else args.num_draft_tokens),
    ):
        if v < 1:
            raise UserError(f"{flag} must be at least 1")
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be at least 1")
    if args.seeds is not None and (args.seeds < 1 or args.repeats != 1):
        raise UserError("--seeds must be at least 1 and replaces --repeats")
    if args.chat_turns is not None and args.chat_turns < 1:
        raise UserError("--chat-turns must be at least 1")
    from ..decode.accept import AcceptRule

    try:
        args.accept = AcceptRule.parse(args.accept)
    except ValueError as e:
        raise UserError(f"--accept: {e}") from None
    modes = [f for f, on in (("--cost-sweep", args.cost_sweep), ("--chat-turns", args.chat_turns),
                             ("--profile", args.profile), ("--tasks", args.tasks)) if on]  # fmt: skip
    if len(modes) > 1:
        raise UserError(f"{modes[0]} and {modes[1]} are separate runs: give one of them")
    for flag, value in (("--json", args.json), ("--plot", args.plot)):  # (what a mode writes: NO_FILE says not)
        if value and modes and flag in NO_FILE.get(modes[0], ()):
            raise UserError(f"{modes[0]} writes no {flag} file")
    methods = parse_list(args.methods) or None
    if args.methods is not None and methods is None:
        raise UserError("--methods lists no method")
    if methods:
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise UserError(f"unknown method {bad[0]!r} (known: {', '.join(METHODS)})")
        if len(set(methods)) != len(methods):
            raise UserError("--methods lists a method twice")
        if "mlx-lm-draft" in methods and not args.draft_model:
            raise UserError("method mlx-lm-draft needs --draft-model DIR")
        if {"ptp", "ptp-chain", "ptp-lenient"} & set(methods) and args.adapter and args.adapter.lower() == "none":
            raise UserError("method ptp needs an adapter")
    widths: list[int] = []
    if not args.no_cost_curve:
        try:
            widths = sorted({int(w) for w in parse_list(args.cost_widths)} | {1})
        except ValueError:
            raise UserError(f"--cost-widths must be comma-separated integers, got {args.cost_widths!r}") from None
        if widths[0] < 1 or widths[-1] > 1024:
            raise UserError("--cost-widths must lie in 1..1024")
    if args.tasks is not None and args.tasks < 1:
        raise UserError("--tasks must be at least 1")
    if args.follow_ups and not args.tasks:
        raise UserError("--follow-ups goes with --tasks N")
    rules = []
    for part in filter(None, (x.strip() for x in (args.rules or "").split(";"))):
        try:
            rules.append(AcceptRule.parse(part))
        except ValueError as e:
            raise UserError(f"--rules: {e}") from None
    args.rules = [AcceptRule()] + [r for r in dict.fromkeys(rules) if r.lenient]
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install 'ptp-mlx[bench]'") from None
    from ..paths import check_output_file

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_output_file(path, flag)  # a folder or unwritable path fails now, not after the whole bench
    return sampling, methods, widths


def no_prompt_fits(args: argparse.Namespace, context: int | None) -> UserError:
    where = args.prompts or "the bundled prompts"
    return UserError(f"no prompt in {where} fits the model's context of {context} tokens")
