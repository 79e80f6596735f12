"""Checks of ``ptp-train``'s flags, before any model loads or file is written: a bad value is one ``error:`` line
and exit code 2 (``UserError``; docs/conventions.md, "Streams and exit codes")."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..errors import UserError


def at_least(flag: str, value: int | None, low: int) -> None:
    """``value`` (``None``: not given) is at least ``low``."""
    if value is not None and value < low:
        raise UserError(f"{flag} must be at least {low}, got {value}")


def positive(flag: str, value: float | None) -> None:
    """``value`` (``None``: not given) is a finite number above 0."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UserError(f"{flag} must be a finite number above 0, got {value}")


def non_negative(flag: str, value: float | None) -> None:
    """``value`` (``None``: not given) is a finite number, 0 or more."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise UserError(f"{flag} must be a finite number, 0 or more, got {value}")


def check_seed(value: int) -> None:
    """A seed numpy and MLX accept: 0 to 2**63 - 1."""
    if not 0 <= value < 2**63:
        raise UserError(f"--seed must be a non-negative integer below 2**63, got {value}")


def check_layers(spec: str) -> None:
    """``--layers`` is 'all', 'last:N' (N >= 1) or layer ids (>= 0) separated by commas (range: ``layer_ids``)."""
    bad = UserError(f"--layers {spec}: expected 'all', 'last:N' or layer ids separated by commas")
    if spec == "all":
        return
    try:
        ids = [int(spec[5:])] if spec.startswith("last:") else [int(x) for x in spec.split(",")]
    except ValueError:
        raise bad from None
    if spec.startswith("last:") and ids[0] < 1:
        raise UserError(f"--layers {spec}: N must be at least 1")
    if any(i < 0 for i in ids):
        raise bad


def layer_ids(spec: str, n: int) -> list[int]:
    """The LoRA layer ids of ``--layers`` for an ``n``-layer model; ``UserError`` when out of range."""
    check_layers(spec)
    if spec == "all":
        return list(range(n))
    if spec.startswith("last:"):
        ids = list(range(n - int(spec[5:]), n))
    else:
        ids = [int(x) for x in spec.split(",")]
    if ids and (min(ids) < 0 or max(ids) >= n):
        raise UserError(f"--layers {spec}: the model has {n} layers (ids 0 to {n - 1})")
    return ids


def check_train_flags(a: argparse.Namespace) -> None:
    """Every numeric and spec flag of ``ptp-train train`` (``train.add_train_args``); no file is read."""
    from .windows import slot_weights

    for flag, low in (
        ("steps", 1),
        ("rank", 1),
        ("window", 1),
        ("eval_window", 1),
        ("windows_per_seq", 1),
        ("seqs_per_step", 1),
        ("rows_per_step", 1),
        ("micro_rows", 1),
        ("save_every", 1),
        ("eval_every", 1),
        ("eval_seqs", 1),
        ("warmup", 0),
        ("reload_every", 0),
    ):
        at_least("--" + flag.replace("_", "-"), getattr(a, flag, None), low)
    for flag in ("alpha", "lr", "minutes", "eval_minutes"):
        positive("--" + flag.replace("_", "-"), getattr(a, flag, None))
    non_negative("--weight-decay", getattr(a, "weight_decay", None))
    check_seed(a.seed)
    check_layers(a.layers)
    if not a.targets or any(not t for t in a.targets.split(",")):
        raise UserError(f"--targets {a.targets!r}: expected 'all' or projection names separated by commas")
    slot_weights(getattr(a, "slot_weights", None), a.window)  # raises on a bad spec


def check_train_paths(a: argparse.Namespace) -> None:
    """The run folder, ``--resume``'s checkpoint and ``--init``'s adapter, before anything loads (CLI only:
    ``auto`` resumes a run folder that may not hold a checkpoint yet)."""
    run = Path(a.run)
    if run.exists() and not run.is_dir():
        raise UserError(f"--run {run}: not a folder")
    if a.resume and not (run / "last" / "state.json").is_file():
        raise UserError(f"--resume: no checkpoint in {run}")
    init = getattr(a, "init", None)
    if init and not a.resume and not (Path(init) / "adapter.safetensors").is_file():
        raise UserError(f"--init: no adapter.safetensors in {init}")


def check_args(args: argparse.Namespace) -> None:
    """The flags of a ``ptp-train`` subcommand other than ``auto`` (which checks its own), before any work."""
    cmd = args.cmd
    if cmd == "train":
        check_train_flags(args)
        check_train_paths(args)
    elif cmd == "pregenerate":
        for flag in ("per_prompt", "max_tokens", "batch_prompts", "limit"):
            at_least("--" + flag.replace("_", "-"), getattr(args, flag), 1)
        check_seed(args.seed)
    elif cmd == "corpus":
        at_least("--limit", args.limit, 1)
        at_least("--max-tokens", args.max_tokens, 1)
    elif cmd == "eval":
        at_least("--window", args.window, 1)
        check_seed(args.seed)
    elif cmd == "prompts":
        at_least("--math", args.math, 0)
        from ..paths import check_output_file

        check_output_file(args.out, "--out")  # a folder or unwritable path fails now, not after reading the wheels
