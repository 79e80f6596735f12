"""Task accuracy for acceptance rules (``ptp-bench --tasks N``): questions with checkable answers, generated from a
seed, so a lenient rule's cost shows as answers that stop being right, with a confidence interval.

The kinds are ones the default model (SmolLM2-135M-Instruct) answers right often enough for a change to show:
a fact to find in a given passage (a city, an age, a colour, with a wrong candidate beside it), a small sum, an
opposite, a capital, a word to repeat. An answer is right when the expected word or number appears as a whole
word in it (case and punctuation aside, thousands separators dropped) and no wrong candidate the prompt offered does. Every rule answers the same items with
the same uniforms, so its answers can also be compared one by one with exact decoding's.
"""

from __future__ import annotations

import io
import math
import random
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from ..paths import atomic_write_bytes

NAMES = "Anna Ben Clara David Elena Felix Grace Hugo Iris Jonas Karin Liam Maria Noah Olga Paul Rosa Sam Tara Victor"
CITIES = "Paris Berlin Madrid Rome Vienna Lisbon Prague Dublin Oslo Athens Warsaw Zurich Tokyo Cairo Lima Toronto"
JOBS = "teacher doctor baker pilot farmer nurse painter lawyer chef engineer".split()
COLORS = "red blue green yellow black white".split()
OBJECTS = "car bike hat coat bag cup".split()
CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Egypt": "Cairo",
    "Russia": "Moscow",
    "China": "Beijing",
    "England": "London",
    "Greece": "Athens",
    "Portugal": "Lisbon",
    "Austria": "Vienna",
    "Ireland": "Dublin",
    "Norway": "Oslo",
    "Poland": "Warsaw",
    "Canada": "Ottawa",
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "day": "night",
    "fast": "slow",
    "happy": "sad",
    "open": "closed",
    "light": "dark",
    "wet": "dry",
    "full": "empty",
    "early": "late",
    "rich": "poor",
}
WORDS = "river window garden silver planet orange candle forest market yellow bridge winter".split()
KINDS = ("passage-city", "passage-number", "passage-color", "sum", "opposite", "capital", "repeat")


@dataclass(frozen=True)
class Task:
    kind: str
    prompt: str
    answer: str
    others: tuple[str, ...] = ()  # wrong candidates the prompt offers: an answer naming one of them is wrong


def _passage_city(r: random.Random) -> Task:
    people, cities, jobs = r.sample(NAMES.split(), 2), r.sample(CITIES.split(), 2), r.sample(JOBS, 2)
    lines = [f"{p} lives in {c} and works as a {j}." for p, c, j in zip(people, cities, jobs, strict=True)]
    k = r.randrange(2)
    q = f"Read the passage and answer the question.\n\n{' '.join(lines)}\n\nQuestion: In which city does {people[k]} live?"
    return Task("passage-city", q, cities[k], (cities[1 - k],))


def _passage_number(r: random.Random) -> Task:
    people, ages = r.sample(NAMES.split(), 2), r.sample(range(21, 80), 2)
    lines = [f"{p} is {a} years old." for p, a in zip(people, ages, strict=True)]
    k = r.randrange(2)
    q = f"Read the passage and answer the question.\n\n{' '.join(lines)}\n\nQuestion: How old is {people[k]}?"
    return Task("passage-number", q, str(ages[k]), (str(ages[1 - k]),))


def _passage_color(r: random.Random) -> Task:
    name, objs, colors = r.choice(NAMES.split()), r.sample(OBJECTS, 2), r.sample(COLORS, 2)
    k = r.randrange(2)
    q = (
        f"Read the passage and answer the question.\n\n{name} has a {colors[0]} {objs[0]} and a {colors[1]} "
        f"{objs[1]}.\n\nQuestion: What color is {name}'s {objs[k]}?"
    )
    return Task("passage-color", q, colors[k], (colors[1 - k],))


def _sum(r: random.Random) -> Task:
    a, b = r.randrange(1, 7), r.randrange(1, 7)
    return Task("sum", f"What is {a} + {b}? Answer with the number.", str(a + b))


def _opposite(r: random.Random) -> Task:
    w = r.choice(sorted(OPPOSITES))
    return Task("opposite", f"What is the opposite of the word {w!r}? Answer with one word.", OPPOSITES[w])


def _capital(r: random.Random) -> Task:
    country = r.choice(sorted(CAPITALS))
    return Task("capital", f"What is the capital of {country}?", CAPITALS[country])


def _repeat(r: random.Random) -> Task:
    w = r.choice(WORDS)
    return Task("repeat", f'Repeat this word exactly once: "{w}"', w)


MAKERS = {
    "passage-city": _passage_city,
    "passage-number": _passage_number,
    "passage-color": _passage_color,
    "sum": _sum,
    "opposite": _opposite,
    "capital": _capital,
    "repeat": _repeat,
}


def make_tasks(n: int, seed: int = 0, kinds=KINDS) -> list[Task]:
    """``n`` tasks, the kinds in turn, from ``seed`` (the same list every time)."""
    r = random.Random(seed)
    return [MAKERS[kinds[i % len(kinds)]](r) for i in range(n)]


def make_openers(tasks: list[Task], seed: int = 0) -> list[Task]:
    """For ``ptp-bench --tasks N --follow-ups``: per task, another of its kind with another answer, asked first in
    the same chat (so lookup offers the first answer after the same template header: a lenient rule must not let it
    stand for the second)."""
    r = random.Random(f"openers-{seed}")
    out = []
    for t in tasks:
        o = MAKERS[t.kind](r)
        for _ in range(50):
            if o.answer != t.answer and o.prompt != t.prompt:
                break
            o = MAKERS[t.kind](r)
        out.append(o)
    return out


def _norm(text: str) -> str:
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.lower())
    return " " + re.sub(r"[^a-z0-9]+", " ", text) + " "


def is_right(task: Task, answer: str) -> bool:
    """Whether ``answer`` contains the expected word or number as a whole word, and none of the wrong candidates
    the prompt offered (an answer that repeats the whole passage is not right)."""
    text = _norm(answer)
    return _norm(task.answer) in text and not any(_norm(o) in text for o in task.others)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``k / n``."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


@dataclass
class RuleRun:
    """One rule's answers to the task set: per item the answer's tokens, PTP calls, seconds and whether right."""

    label: str
    tokens: list[list[int]]
    calls: list[int]
    seconds: list[float]
    right: list[bool]

    def summary(self, exact: RuleRun | None = None) -> dict:
        n, k = len(self.right), sum(self.right)
        lo, hi = wilson(k, n)
        toks = sum(len(t) for t in self.tokens)
        doc = {
            "rule": self.label,
            "items": n,
            "right": k,
            "accuracy": k / n if n else 0.0,
            "ci95": [lo, hi],
            "tokens_per_call": toks / max(1, sum(self.calls)),
            "tokens_per_s": toks / max(1e-9, sum(self.seconds)),
        }
        if exact is not None:  # paired with exact decoding's answers to the same items
            doc["same_answer"] = sum(a == b for a, b in zip(self.tokens, exact.tokens, strict=True)) / max(1, n)
            doc["lost"] = sum(e and not s for s, e in zip(self.right, exact.right, strict=True))
            doc["gained"] = sum(s and not e for s, e in zip(self.right, exact.right, strict=True))
        return doc


def run_rules(
    eng, tasks: list[Task], rules, sampling, max_tokens: int, progress=None, openers: list[Task] | None = None
) -> list[RuleRun]:
    """Every task under every rule (``AcceptRule``s, exact first), rules interleaved per item so that machine noise
    hits them alike; each answer is one ``Engine.generate`` in PTP mode, as ``ptp-generate --accept`` decodes.
    ``openers``: each task is then the second turn of a chat whose first is its opener and exact decoding's answer
    to it (the same for every rule); an answer naming the opener's answer is wrong."""
    runs = [RuleRun(r.label, [], [], [], []) for r in rules]
    budgets = [_frozen_budgets(eng) for _ in rules]  # one private set per rule, all at the same prices
    saved = (eng.budget, eng.mode_budgets)
    try:
        _run_items(eng, tasks, rules, sampling, max_tokens, runs, budgets, progress, openers)
    finally:
        eng.budget, eng.mode_budgets = saved
    return runs


def _frozen_budgets(eng):
    """A copy of the engine's budgets priced by the curve as learnt so far, frozen: every rule drafts at the same
    prices and calibrates on its own answers only, so tokens per call compare the rules, not the machine's load
    while they ran (a budget without a learning curve has no measured pace guard either)."""
    import copy

    curve = eng.budget.curve if eng.budget is not None else None
    frozen = curve.curve() if hasattr(curve, "curve") else curve  # (``LearnedCost.curve``: a plain ``CostCurve``)
    memo = {id(curve): frozen} if curve is not None else None
    return copy.deepcopy(eng.budget, memo and dict(memo)), copy.deepcopy(eng.mode_budgets, memo and dict(memo))


def _run_items(eng, tasks, rules, sampling, max_tokens, runs, budgets, progress, openers) -> None:
    import time
    from dataclasses import replace

    for k, t in enumerate(tasks):
        msgs = [{"role": "user", "content": t.prompt}]
        if openers is not None:
            o = openers[k]
            first = [{"role": "user", "content": o.prompt}]
            steps = eng.generate(first, mode="ptp", sampling=sampling, max_tokens=max_tokens)
            msgs = first + [{"role": "assistant", "content": "".join(st.text for st in steps)}] + msgs
            t = replace(t, others=t.others + (o.answer,))
        for rule, run, own in zip(rules, runs, budgets, strict=True):
            eng.budget, eng.mode_budgets = own
            t0 = time.perf_counter()
            steps = list(eng.generate(msgs, mode="ptp", sampling=sampling, max_tokens=max_tokens, accept=rule))
            run.seconds.append(time.perf_counter() - t0)
            run.tokens.append([x for st in steps for x in st.tokens])
            run.calls.append(len(steps))
            run.right.append(is_right(t, "".join(st.text for st in steps)))
        if progress is not None:
            progress()


def tasks_table(summaries: list[dict], header: str) -> str:
    cols = "| rule | items | right | accuracy (95% CI) | same answer as exact | lost / gained | tokens/call | tok/s |"
    lines = [header, cols, "|---|---|---|---|---|---|---|---|"]
    for d in summaries:
        lo, hi = d["ci95"]
        same = f"{d['same_answer']:.0%}" if "same_answer" in d else ""
        lg = f"{d['lost']} / {d['gained']}" if "lost" in d else ""
        lines.append(
            f"| {d['rule']} | {d['items']} | {d['right']} | {d['accuracy']:.1%} ({lo:.1%}-{hi:.1%}) | {same} | {lg} "
            f"| {d['tokens_per_call']:.2f} | {d['tokens_per_s']:.2f} |"
        )
    return "\n".join(lines)


def write_tasks_plot(path: str, summaries: list[dict], title: str) -> None:
    """Speed (tokens per call) against task accuracy with its 95% interval, one point per rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.0, 4.2))
    lo, hi = summaries[0]["ci95"]  # exact decoding's interval: a rule inside this band kept its accuracy
    ax.axhspan(lo, hi, color="0.9", zorder=0, label="exact's 95% interval")
    for d in summaries:
        lo, hi = d["ci95"]
        acc = d["accuracy"]
        ax.errorbar(d["tokens_per_call"], acc, yerr=[[acc - lo], [hi - acc]], fmt="o", capsize=4, label=d["rule"])
    ax.set_xlabel("tokens per PTP call")
    ax.set_ylabel("task accuracy (95% Wilson interval)")
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())  # nothing half-written


def tasks_command(eng, sampling, args) -> int:
    """``ptp-bench --tasks N``: every rule of ``args.rules`` on N tasks; the table to stdout, ``--json``, ``--plot``."""
    import json
    import sys

    from tqdm import tqdm

    tasks = make_tasks(args.tasks, args.seed)
    openers = make_openers(tasks, args.seed) if args.follow_ups else None
    with tqdm(total=len(tasks), desc="ptp-bench --tasks", unit="item", file=sys.stderr, disable=None) as bar:
        runs = run_rules(eng, tasks, args.rules, sampling, args.max_tokens, progress=bar.update, openers=openers)
    exact = runs[0]
    summaries = [exact.summary()] + [r.summary(exact) for r in runs[1:]]
    how = "greedy" if sampling.greedy else f"T {sampling.temperature:g}, top-p {sampling.top_p:g}, seed {sampling.seed}"
    header = (
        f"ptp-bench --tasks {len(tasks)}{' --follow-ups' if openers else ''} | {how} | {args.max_tokens} new tokens | "
        f"task seed {args.seed} | "
        "lenient rules are not the exact sample"
    )
    print(tasks_table(summaries, header))
    settings = {"items": len(tasks), "sampling": how, "max_tokens": args.max_tokens, "follow_ups": bool(openers)}
    doc = {"tasks": {"settings": settings}}
    doc["tasks"]["rules"] = summaries
    doc["tasks"]["items"] = [
        {"kind": t.kind, "answer": t.answer, "right": [r.right[i] for r in runs]} for i, t in enumerate(tasks)
    ]
    if args.json:
        atomic_write_bytes(Path(args.json), (json.dumps(doc, indent=1) + "\n").encode())
    if args.plot:
        write_tasks_plot(args.plot, summaries, header)
    return 0
