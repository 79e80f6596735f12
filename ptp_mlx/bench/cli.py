"""``ptp-bench``: mlx-lm, our autoregressive path, PTP (and mlx-lm's speculative decoding) side by side.

stdout: the table. stderr: progress and notices. ``--json`` / ``--plot`` write the raw figures and a PNG.
Exit 1 when PTP's output differs from autoregressive decoding, or on Ctrl-C (after writing what was measured).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli_common import add_model_flags, add_sampling_flags, run_cli
from ..errors import UserError
from .methods import METHODS
from .report import curve_line
from .validate import no_prompt_fits, parse_list, validate

DEFAULT_WIDTHS = "1,2,4,8,12,16,24,32,48,64"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ptp-bench",
        description="Measure PTP against mlx-lm and autoregressive "
        "decoding on the same weights, interleaved per prompt.",
    )
    add_model_flags(p, adapter=False)
    p.add_argument(
        "--adapter", default=None, help="adapter folder (default: the one shipped for the model; 'none' for no adapter)"
    )
    add_sampling_flags(p, max_tokens=128)
    p.add_argument("--prompts", default=None, help="Spec-Bench JSONL file (default: the bundled dev prompts)")
    p.add_argument(
        "--limit", type=int, default=None, help="at most N prompts, taken round-robin over categories (default: all)"
    )
    p.add_argument("--categories", default=None, help="only these categories, comma-separated (default: all)")
    p.add_argument("--repeats", type=int, default=1, help="answer every prompt N times per method")
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        metavar="N",
        help="answer every prompt with seeds SEED..SEED+N-1 (instead of --repeats): identity rates over many seeds",
    )
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated subset of {','.join(METHODS)} (default: mlx-lm, ar, ptp when an "
        "adapter is loaded, mlx-lm-draft with --draft-model)",
    )
    p.add_argument(
        "--draft-model", default=None, help="draft model folder for mlx-lm's speculative decoding (default: none)"
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="fixed draft budget for ptp (default: adaptive) and draft tokens per step for mlx-lm-draft (default: 2)",
    )
    p.add_argument("--step", choices=["fused", "simple"], default="fused", help="PTP step kind")
    p.add_argument("--cost-widths", default=DEFAULT_WIDTHS, help="pass widths of the cost-curve probe")
    p.add_argument("--no-cost-curve", action="store_true", help="skip the cost-curve probe")
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="probe this machine's PTP cost curve again (the cached one lives under PTP_MLX_HOME/cost-curves/)",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up answers")
    p.add_argument(
        "--free-rows",
        action="store_true",
        help="price every row of a call at nothing (the flat cost curve of a GPU) and build every next call ahead "
        "where the drafter can (as a GPU learns to): shows the tokens per call the budget's widest useful shapes "
        "reach; wall-clock figures on a CPU then say nothing",
    )
    p.add_argument(
        "--chat-turns",
        type=int,
        default=None,
        metavar="N",
        help="instead of the method comparison: one N-turn chat, prefill with the carried cache vs full re-prefill",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of the method comparison: where the time of one call goes (AR steps, PTP calls of several "
        "shapes), on the first prompt",
    )
    p.add_argument(
        "--accept",
        default="entropy",
        metavar="RULE",
        help="the lenient rule of method ptp-lenient (see ptp-generate --accept; not the exact sample)",
    )
    p.add_argument(
        "--cost-sweep",
        default=None,
        metavar="SIZES",
        help="instead of the method comparison: price a plain step against PTP calls of 4, 8 and 16 rows on "
        "random-weight models of these shapes (comma-separated from 135m,0.5b,1.5b,3b; 'all' for every one)",
    )
    p.add_argument(
        "--tasks",
        type=int,
        default=None,
        metavar="N",
        help="instead of the method comparison: task accuracy with 95%% intervals, tokens per call and speed of "
        "every rule of --rules on N generated questions with checkable answers (passages, sums, units, capitals)",
    )
    p.add_argument(
        "--follow-ups",
        action="store_true",
        help="with --tasks: ask each question as a chat's second turn, after another of its kind and exact "
        "decoding's answer to it (what a lenient rule must not copy)",
    )
    p.add_argument(
        "--rules",
        default="exact;entropy;threshold",
        metavar="LIST",
        help="acceptance rules for --tasks, separated by ';' (exact is always first: the reference)",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="run our steps and PTP calls eagerly (the reference the compiled calls are tested against)",
    )
    p.add_argument("--json", default=None, help="write every raw figure and the environment to this file")
    p.add_argument("--plot", default=None, help="write a PNG plot to this file")
    return p


def run(args: argparse.Namespace) -> int:
    sampling, methods, widths = validate(args)
    from .prompts import load_prompts

    prompts = load_prompts(args.prompts, args.limit, parse_list(args.categories) or None)

    from tqdm import tqdm

    from ..decode.chain_odds import choice_for
    from ..engine import Engine
    from ..models import load
    from . import report
    from .methods import make_runners
    from .metrics import summarize
    from .run import BenchRun, compare, diagnose, fits_context, probe_cost_curve, run_bench

    if args.cost_sweep:
        from .sweep import cost_sweep

        return cost_sweep(args)
    eng = Engine.load(args.model, args.adapter, recalibrate=args.recalibrate)
    if args.free_rows:
        from ..drafting.cost import CostCurve

        for b in [eng.budget, *eng.mode_budgets.values()]:
            if b is not None:
                b.curve = CostCurve([1, 64], [1.0, 1.0])
        # ... and, as on a GPU, the next call built while this one computes (there the build runs beside the device
        # and building ahead pays; on this CPU the learnt choice is off: decode/chain_odds.ChainChoice)
        choice_for(eng.pm).forced = True
    ctx = getattr(eng.pm.args, "max_position_embeddings", None)
    if not args.tasks and not any(fits_context(eng.tokenizer, p, ctx) for p in prompts):
        raise no_prompt_fits(args, ctx)  # before any measurement: there would be nothing to measure
    if args.chat_turns:
        from .conversation import chat_table

        mode = "ptp" if eng.has_adapter and (methods is None or "ptp" in methods) else "ar"
        text, ok = chat_table(eng, prompts, args.chat_turns, mode, sampling, args.max_tokens, args.repeats)
        print(text)
        if not ok:
            print("error: answers with the carried cache differ from full re-prefill", file=sys.stderr)
        return 0 if ok else 1
    if args.profile:
        return _profile(eng, prompts[0], sampling, args)
    if args.tasks:
        if not eng.has_adapter:
            raise UserError("--tasks compares acceptance rules of PTP: it needs an adapter")
        from .tasks import tasks_command

        return tasks_command(eng, sampling, args)
    if methods is None:
        methods = (
            ["mlx-lm", "ar"] + (["ptp"] if eng.has_adapter else []) + (["mlx-lm-draft"] if args.draft_model else [])
        )
    if {"ptp", "ptp-chain", "ptp-lenient"} & set(methods) and not eng.has_adapter:
        raise UserError("method ptp needs an adapter (--adapter DIR); none is loaded for this model")
    if "ptp" in methods and "ar" not in methods:
        print("notice: without method ar there is no lossless check for ptp", file=sys.stderr)
    draft = load(args.draft_model)[0] if args.draft_model else None
    runners = make_runners(eng, methods, draft, args.num_draft_tokens, args.step, args.accept)

    cost, bench = None, BenchRun()
    try:
        if widths:
            print(f"measuring the cost curve (widths {widths[0]}..{widths[-1]})...", file=sys.stderr)
            cost = probe_cost_curve(eng.pm, widths, max(1, min(256, (ctx or 1 << 30) - widths[-1] - 1)))
    except KeyboardInterrupt:
        bench.interrupted = True
    if not bench.interrupted:
        with tqdm(
            total=len(prompts) * (args.seeds or args.repeats) * len(runners),
            desc="ptp-bench",
            unit="answer",
            file=sys.stderr,
            disable=None,
        ) as bar:
            bench = run_bench(
                prompts,
                runners,
                eng.tokenizer,
                args.max_tokens,
                sampling,
                args.seeds or args.repeats,
                warmup=not args.no_warmup,
                progress=bar.update,
                context=ctx,
                log=lambda msg: tqdm.write(msg, file=sys.stderr),
                seeds_vary=args.seeds is not None,
            )

    if not bench.interrupted and not bench.complete and bench.skipped:
        raise no_prompt_fits(args, ctx)  # (a later turn of every prompt outgrew the context)
    checks = []
    for m in ("ptp", "ptp-chain"):
        if m in methods and "ar" in methods:
            checks.append(("lossless", "ar", m, True))
    if sampling.greedy and "mlx-lm" in methods and "ar" in methods:
        checks.append(("greedy parity", "mlx-lm", "ar", False))
    check_docs = []
    for name, ref, other, fatal in checks:
        n, same, divs = compare(bench.records, ref, other)
        eos = sorted(getattr(eng.tokenizer, "eos_token_ids", None) or [])
        for d in divs:
            diagnose(d, bench.records, ref, eng.pm, sampling, eos, seeds_vary=args.seeds is not None)
        check_docs.append(report.check_doc(name, ref, other, n, same, divs, fatal))

    settings = {
        "temp": args.temp,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "greedy": sampling.greedy,
        "max_tokens": args.max_tokens,
        "repeats": args.seeds or args.repeats,
        "seeds": args.seeds,
        "limit": args.limit,
        "categories": parse_list(args.categories),
        "methods": methods,
        "prompts_file": str(args.prompts or "bundled"),
        "step": args.step,
        "num_draft_tokens": args.num_draft_tokens,
        "warmup": not args.no_warmup,
        "budget_curve": eng.budget.curve.to_dict() if eng.budget else None,
    }
    summary = summarize(bench.records, bench.complete, methods)
    doc = report.build_json(
        settings, report.environment(eng, draft, args.draft_model), prompts, bench, summary, check_docs, cost
    )
    doc["draft_sources"], doc["trees"] = report.draft_figures(bench.records)
    print(report.table(doc))
    for line in report.draft_lines(doc):
        print(line)
    if eng.budget is not None and any(m.startswith("ptp") for m in methods):  # (no PTP call: nothing to say)
        print(curve_line(eng.budget.curve))  # (after the run: what every call's measured time made of the curve)
        print(choice_for(eng.pm).describe())  # (and of building calls ahead)
    if "ptp-lenient" in methods and bench.records:
        from .quality import quality, quality_line

        doc["quality"] = quality(bench.records, eng.pm.base)
        doc["accept"] = args.accept.label
        print(quality_line(doc["quality"], {"ptp-lenient": args.accept.label}))
    sys.stdout.flush()
    if args.json:
        report.write_json(args.json, doc)
    if args.plot:
        report.write_plot(args.plot, doc)

    failed = [c for c in check_docs if c["fatal"] and not c["ok"]]
    if failed:
        c = failed[0]
        print(
            f"error: lossless check failed: {c['method']} differs from {c['reference']} on "
            f"{c['compared'] - c['identical']} of {c['compared']} answers",
            file=sys.stderr,
        )
        return 1
    if bench.interrupted:
        print(
            f"error: interrupted after {len(bench.complete)} of {len(prompts)} prompts "
            "(the partial results were written)",
            file=sys.stderr,
        )
        return 1
    return 0


def _profile(eng, prompt, sampling, args) -> int:
    import json

    from ..paths import atomic_write_bytes
    from ..prompt import encode_prompt
    from .profile import run_profile

    ids = encode_prompt(eng.tokenizer, [{"role": "user", "content": prompt.turns[0]}])
    print(f"profiling on {prompt.question_id} ({len(ids)} prompt tokens)...", file=sys.stderr)
    text, doc = run_profile(eng, ids, args.max_tokens, sampling, compiled=False if args.eager else None)
    print(text)
    curve = eng.budget.curve if eng.budget is not None else None
    if curve is not None:
        doc["budget_curve"] = curve.to_dict()
        print(curve_line(curve))
    if args.json:
        atomic_write_bytes(Path(args.json), (json.dumps({"profile": doc}, indent=1) + "\n").encode())
    if doc["diverged"]:
        print(f"error: PTP output differs from ar in {', '.join(doc['diverged'])}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    return run_cli(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
