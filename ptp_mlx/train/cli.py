"""``ptp-train {pregenerate,train}``: distil a PTP adapter in two resumable phases."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli_common import UserError, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ptp-train", description="Distil a PTP adapter (O-PTP) in MLX.")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("pregenerate", help="teacher completions with sampler bins")
    g.add_argument("--model", default=None)
    g.add_argument("--prompts", required=True, type=Path, help="JSONL with 'turns'")
    g.add_argument("--out", required=True, type=Path, help="teacher JSONL (appended; resumable)")
    g.add_argument("--split", choices=["all", "train", "val"], default="train")
    g.add_argument("--per-prompt", type=int, default=16, help="completions per prompt (one batch)")
    g.add_argument("--greedy-only", action="store_true", help="one greedy completion per prompt")
    g.add_argument("--no-greedy-row", action="store_true", help="do not make the first completion greedy")
    g.add_argument("--temp", type=float, default=0.7)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--max-tokens", type=int, default=96)
    g.add_argument("--limit", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train", help="O-PTP distillation of the gated LoRA and u-embedding")
    from .train import add_train_args

    add_train_args(t)
    return p


def run(args: argparse.Namespace) -> int:
    from ..models import load
    from ..sampler import SamplingSettings

    if args.cmd == "pregenerate":
        s = SamplingSettings(args.temp, args.top_k, args.top_p)
        try:
            s.validate()
        except ValueError as e:
            raise UserError(str(e)) from None
        model, tok = load(args.model)
        from .pregenerate import pregenerate

        pregenerate(
            model,
            tok,
            args.prompts,
            args.out,
            n=args.per_prompt,
            greedy_first=not args.no_greedy_row,
            sampling=s,
            max_new=args.max_tokens,
            split=args.split,
            limit=args.limit,
            seed=args.seed,
            greedy_only=args.greedy_only,
        )
        return 0
    from .train import train_from_args

    return train_from_args(args)


def main(argv=None) -> int:
    return run_cli(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
