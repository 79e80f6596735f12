"""What calls cost, learnt from the calls themselves (docs/method.md, section 5, "Costs learnt online").

The probed curve (``cost.py``) is a prior: one measurement, taken once, possibly while the machine was busy.
``LearnedCost`` answers what ``CostCurve`` answers (a call of ``rows`` rows relative to one plain step) and folds in
the measured seconds of every call and every plain step of every answer, so a wrong curve is corrected within a
few calls, in either direction, and one that drifts (a laptop that throttles, another app) follows. Once the
curve has moved far enough from what is on disk it is written back (atomically) for the next start.

Per width (exact up to 16, then buckets) it keeps the last ``WINDOW`` calls' log-seconds; the estimate is their
median, the prior counting as one more sample until three calls are in (or one call ran far faster than it says):
robust to the first call of a shape, which compiles, and to a call slowed by another process, and it flips after a
sudden change once most of the window has seen it. A width never seen takes the prior's shape of the cost
beyond one step, scaled by the correction of the nearest seen widths' cost beyond one step (interpolated in log), so
one wrong point corrects its neighbours too, and a narrow width is not priced by a wide call's whole-cost ratio.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from pathlib import Path

import numpy as np

from .cost import CostCurve

WINDOW = 7  # calls per width the median is taken over
PRIOR_UNTIL = 3  # the prior counts as a sample until this many calls of a width are in
DISPROVED = 1.5  # ... unless a call of the width ran this many times faster than the prior says (see _estimate)
MAX_ROWS = 64  # the table the budget reads (wider calls extrapolate from its last two widths)
SAVE_FACTOR = 1.15  # write back once some well-observed width moved this much from what is on disk
SAVE_MIN_CALLS = 3
STALE_CALLS = 64  # calls without a plain step before the budget asks for a short burst to re-measure one
EXCESS_FLOOR = 0.01  # the least a row beyond the first costs, relative to a step, where the prior says less
OPTIMISM = 0.1  # what an exploring call prices a row of a width barely measured at (relative to a step)


def bucket(rows: int) -> int:
    """The width whose estimate a call of ``rows`` rows feeds: itself up to 16, then a few wider buckets."""
    if rows <= 16:
        return max(1, rows)
    for b in (20, 24, 32, 48):
        if rows <= b:
            return b
    return MAX_ROWS


class LearnedCost:
    """A cost curve corrected online by measured times (``observe``); ``cost(rows)`` as ``CostCurve``.

    ``step_seconds``: the probe's plain step (None: learnt from the first call, at the prior's ratio). ``path``:
    where the curve lives on disk (None: never written); ``record``: the probe's own record, kept beside the
    corrected curve in the file."""

    def __init__(
        self,
        prior: CostCurve,
        step_seconds: float | None = None,
        path: Path | None = None,
        record: dict | None = None,
        source: str = "probed",
    ):
        self.prior, self.path, self.record, self.source = prior, path, dict(record or {}), source
        self._step_prior = math.log(step_seconds) if step_seconds else None
        self.samples: dict[int, deque] = {}  # bucket -> recent log-seconds (bucket 1: plain steps)
        self.ceiling: dict[int, float] = {}  # bucket -> the fastest uncompiled call's log-seconds (an upper bound)
        self.since_step = 0  # PTP calls since the last plain step was measured
        self.observed = 0
        self._prior_table = np.array([prior(w) for w in range(MAX_ROWS + 1)])
        # (the prior's cost beyond one step, at least ``EXCESS_FLOOR`` a row: a flat or busy prior still has a shape
        # to scale; what ``_rebuild`` corrects for widths never measured)
        rows = np.arange(MAX_ROWS + 1)
        self._prior_excess = np.maximum(self._prior_table - 1.0, EXCESS_FLOOR * np.maximum(rows - 1, 1))
        self._stale = True  # the table waits for its next reader (a plain step of a burst only marks it)
        self._saved = self._table.copy()  # (the prior bounded: never below a step, never falling with width)

    # -- what the budget reads -------------------------------------------------------------------------------------
    @property
    def _table(self) -> np.ndarray:
        if self._stale:
            self._rebuild()
        return self._table_

    def __call__(self, rows: int) -> float:
        if rows <= MAX_ROWS:
            return float(self._table[max(1, rows)])
        slope = self._table[MAX_ROWS] - self._table[MAX_ROWS - 1]
        return float(self._table[MAX_ROWS] + slope * (rows - MAX_ROWS))

    @property
    def step_seconds(self) -> float | None:
        """The estimated seconds of a plain step (measured steps, else the probe's; as of the last rebuild)."""
        if self._stale:
            self._rebuild()
        return self._step

    @property
    def stale_step(self) -> bool:
        """True when no plain step has been measured for a long while (the budget then re-measures one)."""
        return self.since_step >= STALE_CALLS

    def explored(self, rows: int) -> bool:
        """Whether calls of ``rows`` rows were measured often enough for the prior to have stopped counting."""
        return len(self.samples.get(bucket(rows), ())) >= PRIOR_UNTIL

    def optimistic(self, rows: int) -> float:
        """The price an exploring call sees: a width barely measured costs at most ``1 + OPTIMISM`` a row, so a
        curve that is far too pessimistic gets measured (and corrected) instead of never drafting."""
        cost = self(rows)
        return cost if self.explored(rows) else min(cost, 1.0 + OPTIMISM * (rows - 1))

    def curve(self) -> CostCurve:
        """The corrected curve at every width up to ``MAX_ROWS``."""
        widths = list(range(1, MAX_ROWS + 1))
        return CostCurve(widths, [float(self._table[w]) for w in widths])

    def to_dict(self) -> dict:
        """The corrected curve, where it came from (probed, cached, corrected) and how far learning moved it."""
        return {
            **self.curve().to_dict(),
            "source": self.source,
            "moved": round(self.moved(), 3),
            "calls": self.observed,
        }

    def moved(self) -> float:
        """How far learning moved the curve from the prior: the largest factor at any width, up or down."""
        ratio = self._table[1:] / self._prior_table[1:]
        return float(np.exp(np.abs(np.log(ratio)).max()))

    # -- what decoding tells it ------------------------------------------------------------------------------------
    def observe(self, rows: int, seconds: float, cold: bool = False) -> None:
        """One call of ``rows`` rows (1: a plain step) took ``seconds``. ``cold``: it ran its shape uncompiled
        (eagerly, or tracing it), so its time is no price, but a bound: the compiled call is no slower. It caps the
        width's estimate until the width has calls of its own (a curve far too pessimistic is corrected by the
        first call that explores it, not the third)."""
        if not seconds > 0:
            return
        b = bucket(rows)
        if self._step_prior is None:  # no probe: the first call sets the scale at the prior's ratio
            if cold:
                return
            self._step_prior = math.log(seconds / self.prior(rows))
        # A wide bucket holds several widths: each call is scaled to the bucket's own width by the prior's shape.
        at_b = math.log(seconds) + (math.log(self.prior(b) / self.prior(rows)) if b != rows else 0.0)
        if cold:
            if b > 1:
                self.ceiling[b] = min(self.ceiling.get(b, at_b), at_b)
                self._stale = True
            return
        self.samples.setdefault(b, deque(maxlen=WINDOW)).append(at_b)
        self.since_step = 0 if b == 1 else self.since_step + 1
        self.observed += 1
        # (rebuilt when next read: a burst's plain steps, one per token, only mark it; the write-back is weighed
        # after drafting calls, whose widths are what it counts)
        self._stale = True
        if b > 1 and self._should_save():
            self.save()

    def _prior_log(self, b: int) -> float:
        return self._step_prior + math.log(self.prior(b))

    def _estimate(self, b: int) -> float | None:
        """Log-seconds of a call in bucket ``b``: the median of its recent calls (and the prior, while few)."""
        if self._step_prior is None:
            return None
        xs = list(self.samples.get(b, ()))
        cap = self.ceiling.get(b) if len(xs) < PRIOR_UNTIL else None
        if not xs:
            if b == 1:
                return self._step_prior
            return None if cap is None else min(cap, self._prior_log(b))
        prior = self._prior_log(b) if cap is None else min(cap, self._prior_log(b))
        # Timing noise is one-sided (another process, a cache miss only ever slow a call down), so a call much
        # faster than the prior disproves it: the prior stops counting at once (a curve probed on a busy machine,
        # or far too pessimistic, is corrected by a width's first compiled call instead of its third).
        if len(xs) < PRIOR_UNTIL and min(xs) > prior - math.log(DISPROVED):
            xs.append(prior)
        est = statistics.median(xs)  # (a handful of floats: pure Python, a hundredth of numpy's time per call)
        return est if cap is None else min(est, cap)

    def _rebuild(self) -> None:
        """The relative table from the estimates: measured widths as measured, the others the prior's excess over
        one step times the interpolated correction of the measured widths' excess; never below one step, never
        falling with width."""
        step = self._estimate(1)
        seen = sorted(b for b in set(self.samples) | set(self.ceiling) if b > 1)
        table = self._prior_table.copy()
        if step is not None and seen:
            # Corrected on what a call costs beyond one step (its rows, the host's work around it), not on its
            # whole cost: a width past the measured ones is priced from the nearest measured excess, and a narrow
            # width below them no longer inherits the wide calls' ratio on the step it shares with a plain one
            # (held-out prompts on this CPU: only 5-6 row lookup calls measured, at 2.5 steps; a 2-row call,
            # 1.36-1.40 steps in the loop, was priced at 2.65 and never made, so never measured).
            measured = np.array([math.exp(self._estimate(b) - step) - 1.0 for b in seen])
            log_corr = np.log(np.maximum(measured, EXCESS_FLOOR * (np.array(seen) - 1)) / self._prior_excess[seen])
            widths = np.arange(2, MAX_ROWS + 1)
            table[2:] = 1.0 + self._prior_excess[2:] * np.exp(np.interp(widths, seen, log_corr))
        table[1] = 1.0
        self._table_ = np.maximum.accumulate(np.maximum(table, 1.0))
        # (read by the budget several times per call: kept, as every estimate only changes here)
        self._step = None if step is None else math.exp(step)
        self._stale = False

    # -- on disk ---------------------------------------------------------------------------------------------------
    def _should_save(self) -> bool:
        if self.path is None:
            return False
        counted = [b for b, xs in self.samples.items() if b > 1 and len(xs) >= SAVE_MIN_CALLS]
        return any(max(self._table[b] / self._saved[b], self._saved[b] / self._table[b]) > SAVE_FACTOR for b in counted)

    def save(self) -> None:
        """Write the corrected curve where the probed one was (a temporary file, then a rename)."""
        if self.path is None:
            return
        curve, step = self.curve(), self.step_seconds
        doc = {
            **curve.to_dict(),
            "seconds": [step * r for r in curve.rel] if step else None,
            "source": "corrected",
            "moved": round(self.moved(), 3),
            "calls_observed": self.observed,
            "probe": self.record.get("probe", self.record),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{id(self)}.tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.path)
        self._saved = self._table.copy()
        self.source = "corrected"


GUARD_CALLS = 8  # the PTP calls the pace guard looks back over
GUARD_MIN = 3  # calls before it judges
# PTP's calls must beat plain decoding's pace by this much (a negative margin): what drafting costs outside its calls'
# own measured time (planning before a call, the burst's pipeline restarted after it) is not in the window. Measured
# on the held-out prompts against 0.03 (within 3% of plain counted as keeping pace), interleaved in one process
# (docs/results/guard/): greedy PTP / our AR 1.025 -> 1.060 and 1.041 -> 1.051, T 0.7 0.964 -> 0.968 and
# 0.989 -> 0.978 (this VM's noise: about 1.5%).
GUARD_MARGIN = -0.05


class PaceGuard:
    """ "Never below plain decoding", measured: the tokens per second of the last PTP calls against the measured
    pace of plain steps. A call slowed by compiling its shape counts at most ``spike`` times its expected cost."""

    def __init__(self, calls: int = GUARD_CALLS, spike: float = 3.0):
        self.window: deque = deque(maxlen=calls)  # (tokens, seconds)
        self.spike = spike

    def add(self, tokens: int, seconds: float, expected: float | None) -> None:
        if expected is not None and expected > 0:
            seconds = min(seconds, self.spike * expected)
        self.window.append((tokens, seconds))

    def behind(self, step_seconds: float | None) -> bool:
        """True when the recent PTP calls delivered fewer tokens per second than plain steps do, less the margin."""
        if step_seconds is None or len(self.window) < GUARD_MIN:
            return False
        tokens = sum(t for t, _ in self.window)
        seconds = sum(s for _, s in self.window)
        return tokens / seconds < (1.0 - GUARD_MARGIN) / step_seconds

    def clear(self) -> None:
        self.window.clear()
