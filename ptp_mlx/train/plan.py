"""``ptp-train auto``'s plan: a short probe of this machine with this model, then each phase's size and time.

The probe measures three rates with the real code paths: batched teacher generation (tokens a second, the
``pregenerate`` phase), one-stream decoding (tokens a second, the bench) and training (seconds per auxiliary
row, three steps of ``train`` at the probe's row count). The budget left after the fixed phases (held-out data,
validation, bench) is split between generating the model's own completions and training on them; rows per step
are sized so the run gets a few hundred optimizer steps, and the rank from the rows the run will see.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..cli_common import UserError

ROWS_PER_SEQ = 16 * 8  # windows per sequence x window width (the recipe's)
VAL_PROMPTS, VAL_PER_PROMPT, VAL_TOKENS = 16, 2, 96
TRAIN_PER_PROMPT, TRAIN_TOKENS = 2, 128
BENCH_METHODS = 3  # mlx-lm, ar (the lossless check) and ptp
BYTES_PER_TOKEN = 100
SHORT, LONG = (
    2,
    18,
)  # the probe's two decode lengths  # a teacher record's JSON per completion token (id, bins in both CDF orders)


@dataclass
class Probe:
    teacher_tokens_per_s: float  # batched generation (the pregenerate phase)
    decode_tokens_per_s: float  # one stream (the bench)
    seconds_per_row: float  # training, per auxiliary row
    seconds: float  # the probe's own time


@dataclass
class TrainingPlan:
    minutes: float
    rank: int
    rows_per_step: int
    steps: int
    processes: int
    val_prompts: int
    phase_seconds: dict  # phase -> estimated seconds
    train_tokens: int  # estimated completion tokens the pregenerate phase writes
    disk_bytes: int  # estimated bytes the run writes
    fit_seconds: float = 0.0  # training time proper (validation excluded): the train phase's hard stop
    bench_prompts: int = 3  # bundled prompts per setting in the bench phase

    def describe(self) -> str:
        """What ``auto`` says up front: each phase's estimated time and the training shape."""
        parts = [f"{k} {_fmt(v)}" for k, v in self.phase_seconds.items()]
        total = sum(self.phase_seconds.values())
        return (
            f"plan ({_fmt(total)} in all, estimates): " + " | ".join(parts) + f"; training: {self.steps} steps of "
            f"{self.rows_per_step} rows, rank {self.rank}"
            + (f", {self.processes} processes" if self.processes > 1 else "")
            + f"; about {self.train_tokens} teacher tokens"
        )

    def save(self, path: Path) -> None:
        from ..paths import atomic_write_bytes

        atomic_write_bytes(path, (json.dumps(asdict(self), indent=1) + "\n").encode())

    @classmethod
    def load(cls, path: Path) -> TrainingPlan:
        return cls(**json.loads(Path(path).read_text()))


def _fmt(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"


def probe(model, tokenizer, prompts_file: Path, work: Path, log=None) -> Probe:
    """Measure this machine with this model (under a minute for a 135M model on two idle CPU cores)."""
    import contextlib
    import io

    from .data import read_records
    from .pregenerate import pregenerate
    from .train import add_train_args, train

    log = log or (lambda m: print(m, file=sys.stderr))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    quiet = io.StringIO()

    def timed(name: str, tokens: int, **kw) -> float:
        t = time.perf_counter()
        pregenerate(model, tokenizer, prompts_file, work / f"{name}.jsonl", max_new=tokens, split="all", **kw)
        return time.perf_counter() - t

    def rate(rows: int, length: int, short: float, long: float) -> float:
        """Tokens a second at ``length`` tokens a row: the prompt's prefill (from the short run) once, then
        ``length`` decoding steps (from the difference between the runs)."""
        per_step = max(long - short, 0.25 * long) / (LONG - SHORT)  # floor: rows that ended early
        prefill = max(short - SHORT * per_step, 0.0)
        return rows * length / (prefill + length * per_step)

    with contextlib.redirect_stderr(quiet):  # the probe's own progress bars are noise here
        timed("warm", SHORT, n=1, limit=1)  # first use: allocation and set-up
        decode = rate(1, 64, timed("one-short", SHORT, n=1, limit=1), timed("one-long", LONG, n=1, limit=1))
        one = dict(n=2, limit=4, batch_prompts=4)
        short, long = timed("batch-short", SHORT, **one), timed("batch-long", LONG, **one)
        teacher = rate(8, TRAIN_TOKENS, short, long)
        recs = read_records(work / "batch-long.jsonl")
        p = argparse.ArgumentParser()
        add_train_args(p)
        a = p.parse_args(["--data", "x", "--run", str(work / "train"), "--steps", "2", "--rows-per-step", "256"])
        a.save_every, a.warmup = 1000, 1
        train(model, recs, [], a, log=lambda m: None)
    steps = [json.loads(x) for x in (work / "train" / "train.log").read_text().splitlines()]
    timed = steps[1:] or steps  # the first step warms up
    per_row = sum(s["seconds"] for s in timed) / max(1, sum(s["rows"] for s in timed))
    return Probe(teacher, decode, per_row, time.perf_counter() - t0)


def make_plan(
    pr: Probe,
    minutes: float,
    processes: int = 1,
    val_prompts: int | None = None,
    bench_prompts: int = 3,
    bench_tokens: int = 64,
    rank: int | None = None,
    rows_per_step: int | None = None,
    steps: int | None = None,
    previous: bool = False,
) -> TrainingPlan:
    """Size every phase from the probe's rates; ``UserError`` when the budget cannot hold a useful run.

    ``previous``: the model has an adapter already (the eval phase scores it too). A tight budget gets fewer
    held-out prompts (16, then 8) and then one bench prompt per setting before it is refused."""
    tries = [(val_prompts, bench_prompts)] if val_prompts else [(VAL_PROMPTS, bench_prompts), (8, bench_prompts)]
    tries += [(tries[-1][0], 1)] if bench_prompts > 1 else []
    for i, (vp, bp) in enumerate(tries):
        try:
            return _plan(pr, minutes, processes, vp, bp, bench_tokens, rank, rows_per_step, steps, previous)
        except UserError:
            if i == len(tries) - 1:
                raise
    raise AssertionError("unreachable")


def _plan(pr, minutes, processes, val_prompts, bench_prompts, bench_tokens, rank, rows_per_step, steps, previous):
    budget = minutes * 60 - pr.seconds
    val_gen = val_prompts * VAL_PER_PROMPT * VAL_TOKENS / pr.teacher_tokens_per_s
    val_rows = val_prompts * VAL_PER_PROMPT * 8 * 8
    validate = val_rows * pr.seconds_per_row / 2  # forward only: about a third of a training row
    evaluate = 10 + validate * (2 if previous else 1)
    bench = 30 + bench_prompts * 2 * BENCH_METHODS * (bench_tokens + 8) / pr.decode_tokens_per_s
    left = budget - val_gen - evaluate - bench
    if left < 60:
        need = (minutes * 60 - left + 60) / 60
        raise UserError(
            f"--minutes {minutes:g} is too short for this model on this machine: give at least {need:.0f} "
            f"(probe: {pr.teacher_tokens_per_s:.0f} teacher tokens/s, {pr.seconds_per_row * 1e3:.1f} ms a training row)"
        )
    gen, fit = 0.45 * left, 0.55 * left - 2 * validate  # training validates half way and at the end
    per_row = pr.seconds_per_row / max(1, processes)  # data parallel: each process runs its slice (estimate)
    if rows_per_step is None:
        rows_per_step = int(fit / (300 * per_row)) // ROWS_PER_SEQ * ROWS_PER_SEQ  # aim at a few hundred steps
        rows_per_step = max(ROWS_PER_SEQ, min(8192, rows_per_step))
    if steps is None:
        steps = max(10, int(max(fit, 0.0) / (rows_per_step * per_row)))
    if rank is None:
        rank = 16 if steps * rows_per_step >= 100_000 else 8  # few rows seen: a smaller adapter learns as much
    tokens = int(gen * pr.teacher_tokens_per_s)
    disk = (tokens + val_prompts * VAL_PER_PROMPT * VAL_TOKENS) * BYTES_PER_TOKEN + 64 * 2**20
    phases = {"pregenerate": val_gen + gen, "train": 0.55 * left, "eval": evaluate, "bench": bench}
    return TrainingPlan(
        minutes, rank, rows_per_step, steps, processes, val_prompts, phases, tokens, disk, max(fit, 30.0), bench_prompts
    )
