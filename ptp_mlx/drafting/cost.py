"""What a call costs by rows on this machine: the ``CostCurve`` the budget weighs rows with, and the probe that
measures it (once per machine, model and adapter shape; cached as JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Every width up to 16 (steps where the kernels switch show: the budget then prefers shapes just below one), sparser
# beyond.
PROBE_WIDTHS = (*range(1, 17), 20, 24, 32, 48, 64)
MIN_NOISE = 0.05  # relative spread below which two timings are taken to differ
RETRIES = 2  # re-measurements of a width whose timing breaks a check, before it is bounded instead


@dataclass
class CostCurve:
    """Forward time of a pass with ``w`` rows relative to one row, interpolated between probed widths."""

    widths: list[int] = field(default_factory=lambda: [1, 64])
    rel: list[float] = field(default_factory=lambda: [1.0, 1.0])
    # rows -> price, filled on use (the budget prices many widths after every read, on the host's critical path);
    # a curve's points are set when it is made, never changed after
    _prices: dict = field(default_factory=dict, repr=False, compare=False)

    def __call__(self, rows: int) -> float:
        price = self._prices.get(rows)
        if price is None:
            price = self._prices[rows] = float(np.interp(rows, self.widths, self.rel))
        return price

    def to_dict(self) -> dict:
        return {"widths": list(self.widths), "relative": list(self.rel)}

    @classmethod
    def linear(cls, per_row: float = 1.0) -> CostCurve:
        return cls([1, 64], [1.0, 1.0 + 63 * per_row])


def _spread(xs: list[float]) -> float:
    best = min(xs)
    return float(np.median(xs)) / best - 1.0 if best > 0 else 0.0


def check_probe(samples: dict[int, list[float]], retime) -> dict:
    """Check a probe's timings (``{width: seconds}``, narrow to wide) and re-measure, with ``retime(w)``, what
    breaks a check: a width above 1 cheaper than width 1 beyond the noise, or cheaper than a narrower width beyond
    it. What still breaks one after ``RETRIES`` is bounded (priced as width 1, or as the narrower width). Returns
    the record: best seconds per measured width, spread, noise, and the widths re-measured and bounded."""
    remeasured: list[int] = []
    bounded: list[int] = []
    for _ in range(RETRIES + 1):
        noise = max(MIN_NOISE, *(_spread(xs) for xs in samples.values()))
        best = {w: min(xs) for w, xs in samples.items()}
        ws = sorted(best)
        bad = [w for w in ws[1:] if best[w] < best[ws[0]] * (1 - noise)]
        bad += [b for a, b in zip(ws[1:], ws[2:], strict=False) if best[b] < best[a] * (1 - noise) and b not in bad]
        if not bad:
            break
        if _ == RETRIES:
            bounded = bad
            break
        for w in [ws[0], *bad]:  # width 1 too: a slow first step makes every other width look cheap
            samples[w] = samples[w] + retime(w)
            remeasured.append(w)
    best = {w: min(xs) for w, xs in samples.items()}
    ws = sorted(best)
    fixed, top = {}, 0.0
    for w in ws:  # the bound: never below one row, never below a narrower width
        top = max(top, best[w], best[ws[0]])
        fixed[w] = top
    return {
        "measured": {str(w): fixed[w] for w in ws},
        "spread": {str(w): round(_spread(samples[w]), 4) for w in ws},
        "noise": round(max(MIN_NOISE, *(_spread(xs) for xs in samples.values())), 4),
        "remeasured": remeasured,
        "bounded": bounded,
    }


def extrapolate(widths: list[int], record: dict) -> list[float]:
    """Seconds at every width: the measured ones, then the rest extrapolated from the last two measured with a
    per-row slope never below the mean slope over every measured width above 1 (the floor this machine showed)."""
    measured = {int(w): s for w, s in record["measured"].items()}
    ws = sorted(measured)
    last = ws[-1]
    first = next((w for w in ws if w > 1), ws[0])
    first = first if first < last else ws[0]
    floor = max(0.0, (measured[last] - measured[first]) / (last - first)) if last > first else 0.0
    local = (measured[ws[-1]] - measured[ws[-2]]) / (ws[-1] - ws[-2]) if len(ws) >= 2 else 0.0
    slope = max(local, floor)
    record["extrapolated"] = [w for w in widths if w not in measured]
    record["floor_slope"] = floor
    return [measured[w] if w in measured else measured[last] + slope * (w - last) for w in widths]
