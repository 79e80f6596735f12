"""``ptp-train {auto,prompts,pregenerate,corpus,train,eval,study}``: distil a PTP adapter in resumable phases."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli_common import run_cli
from ..errors import UserError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ptp-train", description="Distil a PTP adapter (O-PTP) in MLX.")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("pregenerate", help="teacher completions with sampler bins")
    g.add_argument("--model", default=None, help="model folder (default: the default model)")
    g.add_argument("--prompts", required=True, type=Path, help="JSONL with 'turns'")
    g.add_argument("--out", required=True, type=Path, help="teacher JSONL (appended; resumable)")
    g.add_argument(
        "--split", choices=["all", "train", "val"], default="train", help="prompts of this split (ids ending 0/5: val)"
    )
    g.add_argument("--per-prompt", type=int, default=16, help="completions per prompt (one batch)")
    g.add_argument("--greedy-only", action="store_true", help="one greedy completion per prompt")
    g.add_argument("--no-greedy-row", action="store_true", help="do not make the first completion greedy")
    g.add_argument("--temp", type=float, default=0.7, help="temperature of the sampled completions")
    g.add_argument("--top-k", type=int, default=50, help="top-k of the sampled completions (0 = all)")
    g.add_argument("--top-p", type=float, default=0.95, help="top-p of the sampled completions (1 = off)")
    g.add_argument("--max-tokens", type=int, default=96, help="tokens per completion at most")
    g.add_argument(
        "--limit", type=int, default=None, help="only the first N prompts of the split (default: all of them)"
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the sampled completions")
    g.add_argument("--batch-prompts", type=int, default=1, help="prompts decoded together (left-padded)")
    c = sub.add_parser("prompts", help="build a larger prompt file from registry corpora and templates")
    c.add_argument("--out", required=True, type=Path, help="prompt JSONL to write")
    c.add_argument(
        "--chatterbot", type=Path, default=None, help="chatterbot_corpus-1.3.3 wheel (default: none, no chat prompts)"
    )
    c.add_argument(
        "--gensim", type=Path, default=None, help="gensim 4.x wheel, its test data (default: none, no news prompts)"
    )
    c.add_argument("--math", type=int, default=600, help="templated maths problems (0 = none)")
    c.add_argument(
        "--user-tasks",
        action="store_true",
        help="also questions, summaries and translations over the wheels' text, and chats of several turns",
    )
    c.add_argument("--seed", type=int, default=0, help="seed of the maths problems, the user tasks and the shuffle")
    f = sub.add_parser(
        "corpus",
        help="teacher-forced records from plain text (one teacher pass per document, no generation)",
    )
    f.add_argument("--model", default=None, help="model folder (default: the default model)")
    f.add_argument("--out", required=True, type=Path, help="teacher JSONL (appended; resumable)")
    f.add_argument("--no-stdlib", action="store_true", help="leave out the Python standard library's source")
    f.add_argument(
        "--chatterbot", type=Path, default=None, help="chatterbot_corpus-1.3.3 wheel, dialogs (default: none)"
    )
    f.add_argument("--gensim", type=Path, default=None, help="gensim 4.x wheel, news paragraphs (default: none)")
    f.add_argument("--split", choices=["all", "train", "val"], default="train", help="documents of this split")
    f.add_argument("--limit", type=int, default=None, help="at most N new documents (default: no limit)")
    f.add_argument("--max-tokens", type=int, default=384, help="answer tokens per document")
    f.add_argument("--temp", type=float, default=0.7, help="sampling settings whose bins are recorded")
    f.add_argument("--top-k", type=int, default=50, help="top-k of those settings (0 = untruncated)")
    f.add_argument("--top-p", type=float, default=0.95, help="top-p of those settings (1 = untruncated)")
    e = sub.add_parser("eval", help="score an adapter on a held-out teacher file (tokens per window, slot accuracy)")
    e.add_argument("--model", default=None, help="model folder (default: the default model)")
    e.add_argument("--adapter", required=True, type=Path, help="adapter folder")
    e.add_argument("--val", required=True, type=Path, help="held-out teacher JSONL")
    e.add_argument("--window", type=int, default=8, help="window width scored")
    e.add_argument("--seed", type=int, default=0, help="seed of the windows and their u")
    e.add_argument(
        "--cdf-order",
        choices=["id", "prob"],
        default=None,
        help="override the adapter's CDF order (default: the adapter's own)",
    )
    e.add_argument(
        "--draft", choices=["argmax", "coupled"], default="argmax", help="drafts: argmax, or the sampler's pick with u"
    )
    e.add_argument(
        "--only", choices=["greedy", "sampled"], default=None, help="score only these records (default: all of them)"
    )
    y = sub.add_parser("study", help="table and plot of training runs' validations (the recipe study)")
    y.add_argument("--runs", required=True, type=Path, help="folder of run folders (each with train.log)")
    y.add_argument("--out", required=True, type=Path, help="folder for study.md, study.json and study.png")
    y.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a 'ptp-train eval' JSON shown as the starting point (default: none)",
    )
    y.add_argument("--baseline-name", default="shipped", help="its name in the table")
    u = sub.add_parser(
        "auto", help="one command: prompts, completions, training, held-out score, bench, verdict and install"
    )
    from .auto import add_auto_args

    add_auto_args(u)
    t = sub.add_parser("train", help="O-PTP distillation of the gated LoRA and u-embedding")
    from .train import add_train_args

    add_train_args(t)
    return p


def run(args: argparse.Namespace) -> int:
    from ..models import check_ptp_model, load
    from ..sampler import SamplingSettings

    if args.cmd == "auto":
        from .auto import run_auto

        return run_auto(args)
    from .checks import check_args

    check_args(args)  # bad flags: one error line, before any notice, model load or file write
    if args.cmd in ("pregenerate", "train", "corpus", "eval"):
        from .. import blas

        blas.warn_if_slow()  # these run the model: say once if MLX is on its slow reference BLAS
        check_ptp_model(args.model)  # refuse an unsupported family before reading data or loading weights
    if args.cmd in ("pregenerate", "corpus"):
        s = SamplingSettings(args.temp, args.top_k, args.top_p)
        try:
            s.validate()
        except ValueError as e:
            raise UserError(str(e)) from None

    if args.cmd == "prompts":
        from .corpora import build_prompts

        n = build_prompts(
            args.out, args.chatterbot, args.gensim, n_math=args.math, seed=args.seed, user_tasks=args.user_tasks
        )
        print(f"prompts: {n} written to {args.out}", file=sys.stderr)
        return 0
    if args.cmd == "corpus":
        if s.greedy:
            raise UserError("corpus records need sampled settings (--temp > 0): greedy chains come from pregenerate")
        for w in (args.chatterbot, args.gensim):
            if w is not None and not w.is_file():
                raise UserError(f"wheel not found: {w}")
        if args.no_stdlib and args.chatterbot is None and args.gensim is None:
            raise UserError("no source: drop --no-stdlib or give --chatterbot / --gensim")
        model, tok = load(args.model)
        from ..model.layers import install
        from .teacher_forced import build

        install(model)  # the same patched model as training (refuses unsupported families)
        build(
            model,
            tok,
            args.out,
            stdlib=not args.no_stdlib,
            chatterbot=args.chatterbot,
            gensim=args.gensim,
            sampling=s,
            split=args.split,
            limit=args.limit,
            max_tokens=args.max_tokens,
        )
        return 0
    if args.cmd == "pregenerate":
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
            batch_prompts=args.batch_prompts,
        )
        return 0
    if args.cmd == "study":
        from .study import baseline_run, collect, write

        if not args.runs.is_dir():
            raise UserError(f"runs folder not found: {args.runs}")
        base = baseline_run(args.baseline_name, args.baseline) if args.baseline else None
        runs = collect(args.runs, base)
        write(runs, args.out)
        print(f"study: {len(runs)} runs written to {args.out}", file=sys.stderr)
        return 0
    if args.cmd == "eval":
        import json

        from .validate import evaluate_adapter

        if not args.val.is_file():
            raise UserError(f"teacher file not found: {args.val}")
        model, _ = load(args.model)
        ev = evaluate_adapter(
            model, args.adapter, args.val, args.window, args.seed, args.cdf_order, args.draft, args.only
        )
        print(json.dumps(ev))
        return 0
    from .train import train_from_args

    return train_from_args(args)


def main(argv=None) -> int:
    return run_cli(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
