"""``ptp-generate``: one prompt in, streamed text out (stdout), one summary line (stderr)."""

from __future__ import annotations

import argparse
import sys

from .cli_common import add_model_flags, add_sampling_flags, run_cli, sampling_from_args
from .errors import UserError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ptp-generate", description="Generate text with lossless PTP decoding.")
    p.add_argument("--prompt", required=True, help="the prompt ('-' reads it from stdin)")
    add_model_flags(p)
    add_sampling_flags(p)
    p.add_argument("--step", choices=["fused", "simple"], default="fused", help="PTP step kind")
    p.add_argument("--system", default=None, help="system prompt (where the chat template has a system role)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--no-lookup", action="store_true", help="no prompt-lookup drafts (the adapter's chain only)")
    p.add_argument("--show-blocks", action="store_true", help="mark accepted-block boundaries with '|' on stdout")
    return p


def run(args: argparse.Namespace) -> int:
    from .engine import Engine
    from .generate import ContextFull
    from .stats import RunStats

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise UserError("the prompt is empty")
    if args.system is not None and args.no_chat:
        raise UserError("--system needs the chat template (drop --no-chat)")
    sampling = sampling_from_args(args)
    eng = Engine.load(args.model, args.adapter)
    mode = args.mode or eng.default_mode()
    if args.no_chat:
        ids = list(eng.tokenizer.encode(prompt))
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        ids = eng.encode(messages + [{"role": "user", "content": prompt}])
    stats = RunStats()
    try:
        for st in stats.consume(
            eng.generate(
                ids,
                mode=mode,
                sampling=sampling,
                max_tokens=args.max_tokens,
                step=args.step,
                num_draft_tokens=args.num_draft_tokens,
                lookup=not args.no_lookup,
            )
        ):
            sys.stdout.write(st.text + ("|" if args.show_blocks and st.tokens else ""))
            sys.stdout.flush()
    except ContextFull as e:
        raise UserError(str(e)) from None
    sys.stdout.write("\n")
    sys.stdout.flush()  # the answer's last line before the summary, also when both streams share a terminal
    print(stats.summary(), file=sys.stderr)
    if mode == "ptp":
        print(stats.histogram_line(), file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return run_cli(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
