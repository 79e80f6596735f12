"""``ptp-convert {gguf,hf,ptp} SRC --out DIR``: converters to MLX folders.

stdout carries the product (the key mapping with ``--dry-run``); progress bars and the summary go to
stderr. Bad input exits 2 with one ``error:`` line and leaves no folder behind.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import ptp_mlx  # noqa: F401  (sets up the BLAS before mlx is imported)
from ptp_mlx.cli_common import run_cli
from ptp_mlx.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ptp-convert", description="Convert models and PTP checkpoints to MLX folders.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("src", help="what to convert")
    common.add_argument("--out", default=None, help="output folder (written atomically)")
    common.add_argument("--dry-run", action="store_true", help="list the key mapping, write nothing")
    common.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    pickle_flag = argparse.ArgumentParser(add_help=False)
    pickle_flag.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow PyTorch pickles that need code execution to load (only for trusted files)",
    )
    float_dtypes = ["auto", "float32", "float16", "bfloat16"]
    sub = p.add_subparsers(dest="command", required=True, metavar="{gguf,hf,ptp}")

    g = sub.add_parser("gguf", parents=[common], help="llama.cpp GGUF (Llama family) -> MLX model folder")
    g.add_argument(
        "--dtype",
        choices=["auto", "quantized", "float32", "float16", "bfloat16"],
        default="auto",
        help="keep the quantized weights or dequantize (auto: float32 on CPU, bfloat16 on a GPU)",
    )

    h = sub.add_parser("hf", parents=[common, pickle_flag], help="Hugging Face model folder -> MLX model folder")
    h.add_argument("--dtype", choices=float_dtypes, default="auto", help="float dtype (auto: the config's)")
    h.add_argument("--quantize", action="store_true", help="quantize the linear layers (affine)")
    # (default None: given without --quantize, they are refused rather than ignored)
    h.add_argument("--q-bits", type=int, default=None, help="bits per weight with --quantize (default 4)")
    h.add_argument("--q-group-size", type=int, default=None, help="group size with --quantize (default 64)")

    t = sub.add_parser(
        "ptp",
        parents=[common, pickle_flag],
        help="PyTorch PTP checkpoint (.ckpt/.pt/.bin/.safetensors) -> MLX model + adapter folders",
    )
    t.add_argument("--base", default=None, help="MLX folder of the base model (else written from the checkpoint)")
    t.add_argument(
        "--config",
        default=None,
        help="base model's Hugging Face folder (config.json + tokenizer) when writing the base model",
    )
    t.add_argument("--train-yaml", default=None, help="the run's train.yaml (default: found beside the checkpoint)")
    t.add_argument("--rank", type=int, default=None, help="LoRA rank (checked against the tensors)")
    t.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: train.yaml, else PEFT's 8)")
    t.add_argument(
        "--u-embedding",
        choices=["binary", "linear_interpolation"],
        default=None,
        help="u-embedding kind (checked against the tensors)",
    )
    t.add_argument("--window", type=int, default=None, help="auxiliary window the adapter was trained with")
    t.add_argument("--name", default=None, help="base model name recorded in the adapter config")
    t.add_argument(
        "--histogram",
        default=None,
        help="validation histogram of accepted lengths (default: correct_count_hist.pt beside the checkpoint)",
    )
    t.add_argument("--dtype", choices=float_dtypes, default="auto", help="base model dtype (auto: the config's)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Flag checks that need no file read (``UserError``)."""
    if args.command == "hf" and not args.quantize:
        for flag, value in (("--q-bits", args.q_bits), ("--q-group-size", args.q_group_size)):
            if value is not None:
                raise UserError(f"{flag} needs --quantize")
    if args.command == "gguf" and Path(args.src).expanduser().is_dir():  # (not "GGUF file not found")
        raise UserError(f"{args.src} is a folder, not a GGUF file")


def main_args(args: argparse.Namespace) -> int:
    check_args(args)
    summary = convert(args)
    if args.dry_run:
        for m in summary.mappings:
            print(m.line())
    for line in summary.lines():
        print(line, file=sys.stderr)
    return 0


def convert(args: argparse.Namespace):
    """Run the subcommand's converter; returns its ``Summary``."""
    if args.command == "gguf":
        from ptp_mlx.gguf import convert_gguf

        return convert_gguf(args.src, args.out, dtype=args.dtype, overwrite=args.overwrite, dry_run=args.dry_run)
    if args.command == "hf":
        from .hf import DEFAULT_Q_BITS, DEFAULT_Q_GROUP_SIZE, convert_hf

        return convert_hf(
            args.src,
            args.out,
            dtype=args.dtype,
            quantize_bits=(DEFAULT_Q_BITS if args.q_bits is None else args.q_bits) if args.quantize else None,
            q_group_size=DEFAULT_Q_GROUP_SIZE if args.q_group_size is None else args.q_group_size,
            overwrite=args.overwrite,
            dry_run=args.dry_run,
            trust_pickle=args.trust_pickle,
        )
    from .ptp import convert_ptp

    if args.base and args.config:
        raise UserError("pass either --base (use that MLX base model) or --config (write the base model), not both")
    return convert_ptp(
        args.src,
        args.out,
        base=args.base,
        config=args.config,
        train_yaml=args.train_yaml,
        rank=args.rank,
        alpha=args.alpha,
        u_embedding=args.u_embedding,
        window=args.window,
        name=args.name,
        histogram=args.histogram,
        dtype=args.dtype,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        trust_pickle=args.trust_pickle,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(main_args, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
