"""``ptp-bench --profile``: where the time of one call goes, for autoregressive steps and PTP calls.

Every figure comes from real decoding of a real prompt, the way ``ptp-generate`` decodes:
- ``mlx-lm``: ``mlx_lm.stream_generate`` per token (what a user would otherwise run);
- ``ar``: our pipelined autoregressive path per token, and the same step unpipelined, split into graph
  building on the host, compute (``mx.eval``: the pass, waited for) and reading the token;
- ``ptp R+A``: PTP calls of a fixed shape (R token rows: the last token and R-1 drafts; A auxiliary rows),
  split by ``PhaseClock`` into planning, graph building, building the next call ahead (``ptp_mlx/decode/pipeline.py``),
  compute (the wait for it), reading + cache trim, and the drafter's update with the next plan and its queueing.
  A fixed shape is known ahead, so these calls run pipelined: plan and build are empty when the call was
  queued from its build ahead;
- ``ptp default``: the PTP calls of the default drafter (the engine's adaptive budget, prompt lookup, trees) on
  the same prompt, autoregressive bursts left out: its calls are chained only where the drafter can tell the next
  one before the read (and building ahead pays on this machine), so its host time mixes chained and synchronous
  calls; ``chained`` says how many of its calls were queued from a build ahead (the answer's first among them when
  it was built while the prompt's last prefill chunk computed);
- ``ptp default, built ahead always``: the same with building ahead forced on, as a device where it pays runs it:
  its chained share and host time on the path, and its answer's time per token beside the learnt choice's (on a
  CPU whose cores all compute, the builds delay the compute and the learnt choice keeps them off).

Every row also reports **host time on the critical path** per call: the host work done while nothing is queued
on the device, measured directly. For a PTP call that is its phases between the read of the call before it and
its own queueing: planning and building it (zero when it was chained), then its read, trim and the drafter's
update (median over calls of their sum); the "chain" phase is not on the path (it runs while the call computes).
For the unpipelined AR step it is its build and read; pipelined steps (mlx-lm's and ours) queue the next step
before reading this one, so nothing of the host is on the path. Not included: MLX's walk of a call's graph inside
``mx.async_eval`` before its first kernel starts (the "queue" phase also holds the dispatch of all but its last
kernels, which runs while the device computes).

The older, indirect figure stays beside it: **wall - compute**, the wall time of a call as the consumer of
``stream_generate`` sees it (yield to yield) minus its compute (the wait in ``mx.eval`` of the synchronous run of
the same shape; for pipelined steps the step's time with many steps queued back to back). It differences two
separate runs, so on a noisy machine it moves by the noise of the compute (tens of milliseconds here).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..decode.call import PhaseClock
from ..decode.chain_odds import choice_for
from ..decode.fixed import bank_for, compiled_by_default
from ..drafting.policy import DraftingConfig
from ..drafting.protocol import CallResult, Drafter, DraftPlan, Guess
from ..generate import DecodeOptions, decoding_settings, stream_generate
from ..sampler import UNRESOLVED, SamplingSettings, UniformStream, pick_with, resolve
from .graph import call_primitives
from .profile_tables import PHASES, default_lines, primitives_table, profile_table, tree_menu

# The host phases on the critical path of a call (see above): nothing is queued on the device while they run.
ON_PATH = ("plan", "build", "read+trim", "update")
# (drafts verified, [(branch, width), ...]): 3+7 is the reference shape (2 drafts, 7 auxiliaries).
SHAPES: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = (
    (0, ((0, 2),)),
    (1, ((0, 2), (1, 3))),
    (2, ((0, 2), (1, 2), (2, 3))),
    (3, ((0, 2), (1, 3), (2, 3), (3, 4))),
    (5, ((0, 2), (1, 2), (2, 2), (3, 3), (4, 3), (5, 4))),
)


@dataclass
class ProfileRow:
    name: str
    rows: int
    calls: int
    phases: dict[str, float]  # median milliseconds per call
    total: float  # median milliseconds per call (wall time, yield to yield; unpipelined AR: its phases)
    tokens_per_call: float
    tokens: list[int] | None = None  # what the calls emitted (PTP rows: compared with AR, a free lossless check)
    compute: float = 0.0  # median milliseconds of compute per call (the device's part)
    calls_raw: list[dict] | None = None  # (PTP rows, while profiling: every call's phases in seconds)
    host_on_path: float = 0.0  # median ms per call of the host phases on the critical path (``ON_PATH``)
    chained: int | None = None  # (the default drafter's row) calls queued from a build ahead, with no build phase
    why: dict[str, int] | None = None  # (the default drafter's row) why the others were built after the read
    ms_per_token: float | None = None  # (the default drafter's rows) the answer's wall time per token after its first

    @property
    def wall_minus_compute(self) -> float:
        """The indirect figure: wall time per call minus compute, at least 0."""
        return max(0.0, self.total - self.compute)

    def to_json(self) -> dict:
        doc = {k: v for k, v in self.__dict__.items() if k != "calls_raw"}
        return {**doc, "wall_minus_compute": self.wall_minus_compute}


class ShapeDrafter(Drafter):
    """The adapter's own drafts, verified in a fixed call shape."""

    def __init__(self, drafts: int, branches: Sequence[tuple[int, int]], width: int):
        self.n, self.branches = drafts, list(branches)
        self.drafts: list[int] = []
        self.width = width

    def plan(self, i: int, remaining: int, room: int) -> DraftPlan:
        n = max(0, min(self.n, remaining - 1))
        # Short of drafts (a narrow branch was taken), pad with the last one: verification rejects what is
        # wrong, exactly as ever, and every call keeps the shape being profiled.
        drafts = (self.drafts + [self.drafts[-1] if self.drafts else 0] * n)[:n]
        branches = [(d, min(w, self.width)) for d, w in self.branches if d <= n]
        return DraftPlan(drafts, branches, source="ptp" if n else None)

    def guess(self, plan: DraftPlan, accepted: int, i: int, remaining: int, room: int) -> Guess | None:
        # The shape is fixed, so the next call is known before this one is read (queued as soon as it is).
        r, w = plan.branch_rows(accepted) or (0, 1)
        n = max(0, min(self.n, remaining - 1))
        if n and w < 2:
            return None  # no drafts in the branch: the padding is a constant the plan makes on the host
        branches = [(d, min(b, self.width)) for d, b in self.branches if d <= n]
        return Guess(
            DraftPlan([0] * n, branches, source="ptp" if n else None), [r + 1 + min(k, w - 2) for k in range(n)]
        )

    def update(self, plan: DraftPlan, result: CallResult) -> None:
        rows = plan.branch_rows(result.accepted, result.strand)
        self.drafts = result.aux_tokens[rows[0] + 1 : rows[0] + rows[1]] if rows else []


def _describe(s: SamplingSettings) -> str:
    return "greedy" if s.greedy else f"T {s.temperature:g}, top-k {s.top_k}, top-p {s.top_p:g}, seed {s.seed}"


def _median_ms(xs: list[float]) -> float:
    return 1000.0 * statistics.median(xs) if xs else 0.0


def _yield_gaps(steps) -> list[float]:
    """Seconds between consecutive items of an iterator, as its consumer sees them (the first item excluded)."""
    times, last = [], None
    for _ in steps:
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return times


def queued_compute(model, ids: list[int], step, n: int = 16, repeats: int = 2, make_cache=None) -> float:
    """Pure compute of one autoregressive step, in milliseconds: ``n`` steps (``step(tok, i, cache)`` feeds a token
    and returns the next) are built first and then evaluated at once, so no host work sits between them;
    the best of ``repeats`` runs. The cache (``make_cache()``, default mlx-lm's) is a fresh prefill of ``ids[:-1]``."""
    from ..decode.ar import prefill

    best = float("inf")
    for _ in range(repeats):
        cache = (make_cache or (lambda: _make_cache(model)))()
        prefill(model, ids[:-1], cache)
        tok = mx.array([ids[-1]], dtype=mx.int32)
        mx.eval(tok)
        toks = []
        for i in range(n):
            tok = step(tok, i, cache).reshape(1)
            toks.append(tok)
        t0 = time.perf_counter()
        mx.eval(toks)  # sync: every queued step, back to back (we are timing compute)
        best = min(best, (time.perf_counter() - t0) / n)
    return 1000.0 * best


def _make_cache(model):
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def profile_mlx_lm(model, tokenizer, ids: list[int], max_tokens: int) -> ProfileRow:
    import mlx_lm

    times = _yield_gaps(mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=max_tokens))

    def greedy(tok, i, cache):  # mlx-lm's default sampler: the argmax of the log-probabilities
        logits = model(tok.reshape(1, 1), cache=cache)[0, -1]
        return mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1)

    compute = queued_compute(model, ids, greedy)
    return ProfileRow("mlx-lm", 1, len(times), {}, _median_ms(times), 1.0, compute=compute)


def profile_ar(eng, ids: list[int], max_tokens: int, s: SamplingSettings, compiled: bool = True) -> list[ProfileRow]:
    """Our pipelined AR step per token, then the same step unpipelined, split into phases (the fixed-shape step,
    compiled or eager, where the model has one; else the stock pass)."""
    steps, times, last = [], [], None
    for st in eng.generate(ids, mode="ar", sampling=s, max_tokens=max_tokens, compiled=compiled):
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
        steps.append(st)
    toks = [t for st in steps for t in st.tokens]
    pm, u = eng.pm, UniformStream(s.seed)
    s = decoding_settings(pm, s)  # the adapter's CDF order, as generate uses

    bank = bank_for(pm, compiled)

    def ours(tok, i, cache):
        if bank is not None:
            return bank.ar_step(cache, s, tok.astype(mx.int32), mx.array([u[i]], dtype=mx.float32))
        logits = pm.base(tok.reshape(1, 1), cache=cache)[0, -1]
        return pick_with(mx.array(u[i]), logits, s, check=False)

    compute = queued_compute(pm.base, ids, ours, make_cache=pm.make_cache)
    rows = [ProfileRow("ar (pipelined)", 1, len(times), {}, _median_ms(times), 1.0, toks, compute=compute)]
    cache = pm.make_cache()
    mx.eval(pm.base(mx.array([ids[:-1]]), cache=cache))
    tok, ph = mx.array([ids[-1]], dtype=mx.int32), {k: [] for k in ("build", "compute", "read+trim")}
    for i in range(max_tokens):
        t0 = time.perf_counter()
        if bank is not None:
            nxt, logits = bank.ar_step(cache, s, tok, mx.array([u[i]], dtype=mx.float32), with_logits=True)
        else:
            nxt, logits = ours(tok, i, cache), None
        t1 = time.perf_counter()
        mx.eval(nxt)  # sync: unpipelined, to see the parts
        t2 = time.perf_counter()
        t = int(nxt.item())
        tok = mx.array([resolve(u[i], logits.reshape(-1), s) if t == UNRESOLVED else t], dtype=mx.int32)
        t3 = time.perf_counter()
        for k, a, b in (("build", t0, t1), ("compute", t1, t2), ("read+trim", t2, t3)):
            ph[k].append(b - a)
    med = {k: _median_ms(v) for k, v in ph.items()}
    host = _median_ms([b + r for b, r in zip(ph["build"], ph["read+trim"], strict=True)])
    unpiped = ProfileRow(
        "ar (unpipelined)", 1, max_tokens, med, sum(med.values()), 1.0, compute=med["compute"], host_on_path=host
    )
    rows.append(unpiped)
    return rows


def profile_ptp(
    eng, ids: list[int], max_tokens: int, s: SamplingSettings, shapes=SHAPES, compiled: bool = True
) -> list[ProfileRow]:
    """PTP calls of each fixed shape, decoding the prompt for real; medians over calls of the full shape. Each
    shape runs twice: one call at a time (``chain=0``: the call is built after the previous one is read; its
    queue + compute phases are the call's pure compute), then chained (the next call built for every outcome while this
    one computes, ``ptp_mlx/decode/pipeline.py``, one outcome ahead); host time on the path is wall time minus that pure
    compute."""
    out = []
    width = eng.pm.config.window
    for n, branches in shapes:
        sync = None
        for chain in (0, 1):
            row = _profile_shape(eng, ids, max_tokens, s, n, branches, width, chain, compiled)
            if row is None:
                break
            if sync is None:
                sync = row
                row.compute = _median_ms([c.get("queue", 0.0) + c.get("compute", 0.0) for c in row.calls_raw])
            else:
                row.name += " chained"
                row.compute = sync.compute
            row.calls_raw = None
            out.append(row)
    return out


def _timed_steps(eng, ids: list[int], opts: DecodeOptions) -> tuple[list, list[float]]:
    """Decode ``ids`` for real; every step and the time its consumer received it."""
    steps, stamps = [], []
    for st in stream_generate(eng.pm, eng.tokenizer, ids, opts):
        stamps.append(time.perf_counter())
        steps.append(st)
    return steps, stamps


def _profile_shape(eng, ids, max_tokens, s, n, branches, width, chain, compiled) -> ProfileRow | None:
    clock = PhaseClock()
    opts = DecodeOptions(
        mode="ptp",
        max_tokens=max_tokens,
        sampling=s,
        drafter=ShapeDrafter(n, branches, width),
        clock=clock,
        chain=chain,
        compiled=compiled,
    )
    steps, stamps = _timed_steps(eng, ids, opts)
    rows = 1 + n + sum(w for _, w in branches)
    # Call k (k >= 1) took stamps[k] - stamps[k-1] of wall time (one clock entry and one step per call).
    full = [k for k, c in enumerate(clock.calls) if c.get("rows") == rows and 1 <= k < len(stamps)]
    if not full:
        return None
    calls = [clock.calls[k] for k in full]
    med = {k: _median_ms([c.get(k, 0.0) for c in calls]) for k in PHASES}
    total = _median_ms([stamps[k] - stamps[k - 1] for k in full])
    tpc = sum(len(st.tokens) for st in steps) / max(1, len(steps))
    toks = [t for st in steps for t in st.tokens]
    name = f"ptp {1 + n}+{rows - 1 - n}"
    host = _median_ms([sum(c.get(k, 0.0) for k in ON_PATH) for c in calls])
    return ProfileRow(name, rows, len(full), med, total, tpc, toks, calls_raw=[{**c} for c in calls], host_on_path=host)


def profile_default(
    eng, ids: list[int], max_tokens: int, s: SamplingSettings, compiled: bool = True, chain: bool | None = None
) -> ProfileRow | None:
    """The default drafter's PTP calls on ``ids`` (what ``ptp-generate`` runs), medians over its calls (not its
    autoregressive bursts); None when it made no PTP call. ``chain``: building ahead as this machine learnt it
    (None), or always (True: what a device where it pays would run)."""
    clock = PhaseClock()
    opts = DecodeOptions(
        mode="ptp",
        max_tokens=max_tokens,
        sampling=s,
        drafting=DraftingConfig(budget=eng.budget_for(s)),
        clock=clock,
        chain=chain,
        compiled=compiled,
    )
    steps, stamps = _timed_steps(eng, ids, opts)
    calls = [c for c in clock.calls if "rows" in c]  # (a burst's loop turn plans and leaves no "rows" tag)
    ptp = [k for k, st in enumerate(steps) if st.rows > 1 and k >= 1]
    if not calls or not ptp:
        return None
    med = {k: _median_ms([c.get(k, 0.0) for c in calls]) for k in PHASES}
    host = _median_ms([sum(c.get(k, 0.0) for k in ON_PATH) for c in calls])
    chained = sum(1 for c in calls if "build" not in c)
    why = Counter(c.get("why", "?") for c in calls if "build" in c)
    rows = round(statistics.median(c["rows"] for c in calls))
    tpc = sum(len(steps[k].tokens) for k in ptp) / len(ptp)
    total = _median_ms([stamps[k] - stamps[k - 1] for k in ptp])
    toks = [t for st in steps for t in st.tokens]  # (bursts included: compared with AR like every PTP row)
    compute = _median_ms([c.get("queue", 0.0) + c.get("compute", 0.0) for c in calls])
    name = "ptp default" if chain is None else "ptp default, built ahead always"
    row = ProfileRow(name, rows, len(calls), med, total, tpc, toks, compute, host_on_path=host)
    row.chained, row.why = chained, dict(why.most_common())
    row.ms_per_token = 1000 * (stamps[-1] - stamps[0]) / max(1, len(toks) - len(steps[0].tokens))
    return row


def run_profile(
    eng, ids: list[int], max_tokens: int, s: SamplingSettings, rounds: int = 2, compiled: bool | None = None
) -> tuple[str, dict]:
    """Profile everything ``rounds`` times, interleaved (noise hits all kinds alike); keep each kind's best round.
    ``compiled=False``: our steps and calls as the eager reference runs them."""
    best: dict[str, ProfileRow] = {}
    order: list[str] = []
    compiled = compiled_by_default() if compiled is None else compiled
    bank = bank_for(eng.pm, compiled)
    if bank is not None:
        bank.entries.clear()
    for _ in range(rounds):
        rows = [profile_mlx_lm(eng.pm.base, eng.tokenizer, ids, max_tokens)]
        rows += profile_ar(eng, ids, max_tokens, s, compiled)
        if eng.has_adapter:
            rows += profile_ptp(eng, ids, max_tokens, s, compiled=compiled)
            for chain in (None, True):  # (as learnt here, and always: the chained share where it pays)
                default = profile_default(eng, ids, max_tokens, s, compiled, chain)
                rows += [default] if default is not None else []
        for r in rows:
            if r.name not in best:
                order.append(r.name)
            if r.name not in best or r.total < best[r.name].total:
                best[r.name] = r
    rows = [best[k] for k in order]
    ar_ms = best["ar (pipelined)"].total
    want = best["ar (pipelined)"].tokens
    diverged = [r.name for r in rows if r.name.startswith("ptp ") and r.tokens != want]
    header = (
        f"ptp-bench --profile | {len(ids)} prompt tokens | {max_tokens} new tokens | {_describe(s)} | "
        f"median ms per call, best of {rounds} interleaved rounds | ar step {ar_ms:.2f} ms | "
        f"mlx-lm step {best['mlx-lm'].total:.2f} ms | host on path = host phases while nothing is queued "
        f"(plan, build, read+trim, update) | wall - compute: compute in parentheses = steps queued back to back"
    )
    text = profile_table(rows, ar_ms, header)
    text += "\nlossless: " + (f"DIFFERS from ar: {', '.join(diverged)}" if diverged else "every PTP shape == ar")
    if "ptp default" in best:
        text += "\n" + default_lines(best["ptp default"], best.get("ptp default, built ahead always"))
        text += "\n" + choice_for(eng.pm).describe()  # (learnt across this run's answers: decode/chain_odds.py)
        text += "\n" + tree_menu(getattr(eng.budget_for(s), "shapes", None))
    host = {r.name: round(r.host_on_path, 3) for r in rows}
    entries = 0 if bank is None else len(bank.entries)
    prims = call_primitives(eng, ids, SHAPES, s, compiled)
    text += "\n" + primitives_table(prims, len(eng.pm.base.layers), compiled, entries)
    doc = {"ar_step_ms": ar_ms, "rows": [r.to_json() for r in rows], "diverged": diverged, "host_on_path": host}
    return text, {**doc, "compiled": compiled, "primitives": prims, "compile_bank_entries": entries}
