"""The measuring loop: methods interleaved per prompt, warm-up first, Ctrl-C keeps what was measured.

Also the exactness checks: ``ptp`` must return token for token what ``ar`` returns (any setting, because both
read the same seeded uniforms); greedy ``ar`` is compared with greedy ``mlx-lm`` too (the same model and the
same argmax, so any difference is a bug or a numerical near-tie, told apart by the logit gap).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ..prompt import encode_prompt, turn_start
from ..sampler import SamplingSettings
from .methods import Measured, Runner
from .prompts import Prompt, messages_for

WARMUP_TOKENS = 8


@dataclass
class Record:
    """One turn of one prompt answered by one method (one repeat)."""

    method: str
    question_id: str
    category: str
    turn: int
    repeat: int
    prompt_tokens: int
    m: Measured
    text: str = ""
    prompt_ids: list[int] = field(default_factory=list, repr=False)  # for divergence diagnosis and quality scores

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("m", "prompt_ids")}
        d.update(asdict(self.m))
        d["tokens"] = len(self.m.token_ids)
        return d


@dataclass
class BenchRun:
    records: list[Record] = field(default_factory=list)
    complete: list[str] = field(default_factory=list)  # question_ids every method finished (all repeats)
    skipped: list[dict] = field(default_factory=list)  # prompts that did not fit the context
    interrupted: bool = False
    warmup_time: float = 0.0


@dataclass
class Divergence:
    question_id: str
    turn: int
    repeat: int
    position: int  # first generated position where the two outputs differ
    ref_token: int | None  # None: that output had already ended
    other_token: int | None
    ref_tokens: int
    other_tokens: int
    logit_gap: float | None = None  # base logit of ref_token minus that of other_token at that position
    top2_gap: float | None = None  # top-1 minus top-2 base logit there (near 0: a numerical near-tie)
    near_tie: bool = False  # a float near-tie (ptp_mlx.ties): reported, not a failure
    tie: str | None = None  # how near: "float near-tie (bin edge 3.1e-07)" or "NOT a near-tie (...)"

    def describe(self, ref: str, other: str) -> str:
        what = (
            f"{ref} token {self.ref_token} vs {other} token {self.other_token}"
            if self.ref_token is not None and self.other_token is not None
            else f"{ref} has {self.ref_tokens} tokens, {other} has {self.other_tokens}"
        )
        gap = f", logit gap {self.logit_gap:.3g}, top-2 gap {self.top2_gap:.3g}" if self.logit_gap is not None else ""
        tie = f": {self.tie}" if self.tie else ""
        return (
            f"{self.question_id} turn {self.turn} repeat {self.repeat}: first difference at position "
            f"{self.position}: {what}{gap}{tie}"
        )


def warm_up(runners: dict[str, Runner], tokenizer, prompt: Prompt, sampling: SamplingSettings) -> float:
    """One short untimed answer per method, so no timed call pays for first-use allocation or kernel setup."""
    t0 = time.perf_counter()
    ids = encode_prompt(tokenizer, messages_for(prompt, 0, []))
    for run in runners.values():
        run(ids, WARMUP_TOKENS, sampling, 0)
    return time.perf_counter() - t0


def run_bench(
    prompts: list[Prompt],
    runners: dict[str, Runner],
    tokenizer,
    max_tokens: int,
    sampling: SamplingSettings,
    repeats: int = 1,
    warmup: bool = True,
    progress: Callable[[int], None] | None = None,
    context: int | None = None,
    log: Callable[[str], None] | None = None,
    seeds_vary: bool = False,
) -> BenchRun:
    """Answer every prompt with every method, interleaved per prompt; rotate the order between prompts.

    ``seeds_vary``: repeat ``r`` samples with seed ``sampling.seed + r`` (many seeds per prompt) instead of
    repeating the same answer.

    A ``KeyboardInterrupt`` ends the loop; the result keeps every finished record and says it was cut short.
    A prompt whose chat does not fit the model's context is skipped (and listed) for every method.
    """
    out = BenchRun()
    order = list(runners)
    mine: list[Record] = []
    try:
        if warmup and prompts:
            out.warmup_time = warm_up(runners, tokenizer, prompts[0], sampling)
        for pi, p in enumerate(prompts):
            k = pi % len(order)
            mine = []
            units = 0
            try:
                for rep in range(repeats):
                    s = dataclasses.replace(sampling, seed=sampling.seed + rep) if seeds_vary else sampling
                    for name in order[k:] + order[:k]:  # rotation: no method always runs first (caches, heat)
                        _conversation(runners[name], name, p, rep, tokenizer, max_tokens, s, context, mine)
                        units += 1
                        if progress:
                            progress(1)
            except _TooLong as e:
                out.skipped.append({"question_id": p.question_id, "reason": str(e)})
                if log:
                    log(f"notice: skipping {e}")
                if progress:
                    progress(repeats * len(order) - units)
                continue
            out.records += mine
            mine = []
            out.complete.append(p.question_id)
    except KeyboardInterrupt:
        out.interrupted = True
        out.records += mine  # raw records of the prompt in progress; the summary leaves that prompt out
    return out


def fits_context(tokenizer, prompt: Prompt, context: int | None) -> bool:
    """Whether ``prompt``'s first turn leaves room for an answer in ``context`` (later turns, which hold the
    answers, are checked as they come: ``_conversation``)."""
    return not context or len(encode_prompt(tokenizer, messages_for(prompt, 0, []))) < context


class _TooLong(Exception):
    pass


def _conversation(
    run: Runner,
    name: str,
    p: Prompt,
    rep: int,
    tokenizer,
    max_tokens: int,
    sampling: SamplingSettings,
    context: int | None,
    into: list[Record],
) -> None:
    """All turns of ``p`` answered by one method, each turn in the chat of its own earlier answers.

    Records are appended to ``into`` turn by turn, so an interrupted conversation keeps its finished turns.
    """
    answers: list[str] = []
    for t in range(len(p.turns)):
        msgs = messages_for(p, t, answers)
        ids = encode_prompt(tokenizer, msgs)
        limit = max_tokens
        if context:
            if len(ids) >= context:
                raise _TooLong(
                    f"{p.question_id} turn {t}: {len(ids)} prompt tokens do not fit the context of {context}"
                )
            limit = min(max_tokens, context - len(ids))  # every method stops at the context, as ours does
        # (a lenient rule verifies copies of this method's earlier answers exactly, as in the chat)
        m = run(ids, limit, sampling, turn_start(tokenizer, msgs, ids))
        text = tokenizer.decode(m.token_ids)
        answers.append(text)
        into.append(Record(name, p.question_id, p.category, t, rep, len(ids), m, text, ids))


def probe_cost_curve(pm, widths: list[int], context: int, rounds: int = 3) -> dict:
    """Forward time of each width relative to width 1, the fastest of ``rounds`` sweeps per width.

    Sweeping all widths several times (rather than timing each width in one go) spreads every width over the
    run, so a burst of other load on the machine cannot inflate one width, width 1 above all.
    """
    from ..decode.probe import measure_cost_curve

    secs = [float("inf")] * len(widths)
    for _ in range(rounds):
        _, s = measure_cost_curve(pm, widths, context=context, repeats=2)
        s = s["seconds"]
        secs = [min(a, b) for a, b in zip(secs, s, strict=True)]
    return {
        "widths": list(widths),
        "relative": [x / secs[0] for x in secs],
        "seconds": secs,
        "context": context,
        "rounds": rounds,
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(records: list[Record], ref: str, other: str) -> tuple[int, int, list[Divergence]]:
    """Compare ``other``'s outputs with ``ref``'s on every (prompt, turn, repeat) both answered.

    Returns (answers compared, answers identical, divergences); only the first divergent turn of a conversation is listed, since
    later turns then start from different chats.
    """
    by_key = {(r.question_id, r.turn, r.repeat): r for r in records if r.method == ref}
    pairs, same, diverged, seen = 0, 0, [], set()
    for r in records:
        if r.method != other or (r.question_id, r.turn, r.repeat) not in by_key:
            continue
        pairs += 1
        a, b = by_key[(r.question_id, r.turn, r.repeat)].m.token_ids, r.m.token_ids
        pos = first_difference(a, b)
        same += pos is None
        if pos is None or (r.question_id, r.repeat) in seen:
            continue
        seen.add((r.question_id, r.repeat))
        diverged.append(
            Divergence(
                r.question_id,
                r.turn,
                r.repeat,
                pos,
                a[pos] if pos < len(a) else None,
                b[pos] if pos < len(b) else None,
                len(a),
                len(b),
            )
        )
    return pairs, same, diverged


def diagnose(
    div: Divergence,
    records: list[Record],
    ref: str,
    pm,
    sampling: SamplingSettings | None = None,
    eos_ids=(),
    seeds_vary: bool = False,
) -> None:
    """Fill in the logit gaps at the divergent position (the reference decoder's own logits, replayed) and
    classify the divergence as a float near-tie or not (``ptp_mlx.ties``). An answer that ended there ended
    with an end token: each of ``eos_ids`` is tried as its token. ``pm`` is the engine's ``PTPModel``."""
    import mlx.core as mx

    from ..sampler import UniformStream
    from ..ties import judge_divergence

    rec = next(
        (
            r
            for r in records
            if r.method == ref and (r.question_id, r.turn, r.repeat) == (div.question_id, div.turn, div.repeat)
        ),
        None,
    )
    if rec is None or (div.ref_token is None and div.other_token is None):
        return
    refs = [div.ref_token] if div.ref_token is not None else list(eos_ids)
    others = [div.other_token] if div.other_token is not None else list(eos_ids)
    if not refs or not others:
        return
    s = sampling or SamplingSettings()
    s = dataclasses.replace(s, seed=s.seed + div.repeat) if seeds_vary else s
    u = UniformStream(s.seed)[div.position]
    logits, best = judge_divergence(pm, rec.prompt_ids, rec.m.token_ids[: div.position], refs, others, u, s)
    top2 = mx.topk(logits, 2)
    div.logit_gap = float(logits[refs[0]] - logits[others[0]])
    div.top2_gap = float(mx.max(top2) - mx.min(top2))
    if sampling is None:
        return
    div.near_tie, div.tie = best.near_tie, best.describe()
