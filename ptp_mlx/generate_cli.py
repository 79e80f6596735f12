"""``ptp-generate``: one prompt in, streamed text out (stdout), one summary line (stderr)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

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
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="subtract this per earlier occurrence in the answer"
    )
    p.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtract this once a token occurs in the answer"
    )
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable)",
    )
    p.add_argument(
        "--accept",
        default="exact",
        metavar="RULE",
        help="acceptance rule: exact (the model's exact sample, default) or a LENIENT rule that also accepts likely "
        "drafts, so the answer is no longer the exact sample: entropy[:eps=E,delta=D,floor=F] or threshold[:tau=T], "
        "either also with lookup=0 or pivot=1|2 (README, 'Lenient acceptance')",
    )
    p.add_argument("--json", action="store_true", help="constrain the answer to a JSON object")
    p.add_argument("--json-schema", default=None, metavar="FILE", help="constrain the answer to JSON matching a schema")
    return p


def _grammar(args: argparse.Namespace) -> str | None:
    if not args.json and args.json_schema is None:
        return None
    import json
    from pathlib import Path

    from .constrain import json_grammar

    schema = None
    if args.json_schema is not None:
        try:
            schema = json.loads(Path(args.json_schema).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the JSON schema {args.json_schema}: {e}") from None
    try:
        return json_grammar(schema)
    except ValueError as e:
        raise UserError(str(e)) from None


def logits_from_args(args: argparse.Namespace):
    """Validated ``LogitsSettings`` from the penalty, bias and JSON flags (``UserError`` on bad values)."""
    from .logits import LogitsSettings

    bias = {}
    for item in args.logit_bias:
        tok, _, val = item.partition("=")
        try:
            bias[int(tok)] = float(val)
        except ValueError:
            raise UserError(f"--logit-bias takes ID=BIAS, got {item!r}") from None
    try:
        settings = LogitsSettings(args.frequency_penalty, args.presence_penalty, bias).validate()
    except ValueError as e:
        raise UserError(str(e).replace("_", "-")) from None
    return replace(settings, grammar=_grammar(args))


def run(args: argparse.Namespace) -> int:
    from .decode.accept import AcceptRule
    from .engine import Engine
    from .generate import ContextFull
    from .stats import RunStats

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise UserError("the prompt is empty")
    if args.system is not None and args.no_chat:
        raise UserError("--system needs the chat template (drop --no-chat)")
    sampling = sampling_from_args(args)
    logits = logits_from_args(args)
    try:
        rule = AcceptRule.parse(args.accept)
    except ValueError as e:
        raise UserError(f"--accept: {e}") from None
    eng = Engine.load(args.model, args.adapter)
    vocab = getattr(eng.pm.args, "vocab_size", None)
    if vocab is not None and any(not 0 <= t < vocab for t in logits.logit_bias):
        raise UserError(f"--logit-bias token ids must be in [0, {vocab})")
    mode = args.mode or eng.default_mode()
    if args.num_draft_tokens is not None and mode != "ptp":
        raise UserError("--num-draft-tokens sets PTP's draft budget: it needs --mode ptp (and an adapter)")
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
                logits=logits,
                accept=rule,
            )
        ):
            sys.stdout.write(st.text + ("|" if args.show_blocks and st.tokens else ""))
            sys.stdout.flush()
    except ContextFull as e:
        raise UserError(str(e)) from None
    sys.stdout.write("\n")
    sys.stdout.flush()  # the answer's last line before the summary, also when both streams share a terminal
    ctx = getattr(eng.pm.args, "max_position_embeddings", None)
    if ctx is not None and stats.tokens < args.max_tokens and len(ids) + stats.tokens >= ctx:
        print(f"notice: the answer stopped at the model's context of {ctx} tokens", file=sys.stderr)
    print(stats.summary() + (f" | {rule.label}: not the exact sample" if rule.lenient else ""), file=sys.stderr)
    if mode == "ptp":
        print(stats.histogram_line(), file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return run_cli(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
