"""What a call costs by rows on this machine: the ``CostCurve`` the budget weighs rows with, and the probe that
measures it (once per machine, model and adapter shape; cached as JSON)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .protocol import Plan

PROBE_WIDTHS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class CostCurve:
    """Forward time of a pass with ``w`` rows relative to one row, interpolated between probed widths."""

    widths: list[int] = field(default_factory=lambda: [1, 64])
    rel: list[float] = field(default_factory=lambda: [1.0, 1.0])

    def __call__(self, rows: int) -> float:
        return float(np.interp(rows, self.widths, self.rel))

    def to_dict(self) -> dict:
        return {"widths": list(self.widths), "relative": list(self.rel)}

    @classmethod
    def linear(cls, per_row: float = 1.0) -> CostCurve:
        return cls([1, 64], [1.0, 1.0 + 63 * per_row])


def measure_cost_curve(
    pm, widths=PROBE_WIDTHS, context: int = 256, repeats: int = 3, aux: bool = False, time_budget: float = 8.0
) -> tuple[CostCurve, list[float]]:
    """Time passes of each width on top of a ``context``-token cache. Returns the curve and seconds.

    Widths are probed narrow to wide; once ``time_budget`` seconds are spent (a slow machine or BLAS), the
    wider ones are extrapolated linearly from the last two measured, so a first start never waits minutes.

    ``aux=False`` times plain token passes (the machine's forward cost). ``aux=True`` times real calls the
    way decoding makes them, so the budget pays what decoding pays: width 1 is a pipelined autoregressive
    step (graph building hidden behind the previous pass), wider ones are whole PTP calls (``ptp_call``: one
    token row plus ``w - 1`` auxiliary rows through the adapter, the pick, the drafts' argmax and
    confidence, the host read and the cache trim).
    """
    import mlx.core as mx

    from ..decode.ar import ar_calls
    from ..decode.call import ptp_call
    from ..decode.fixed import bank_for
    from ..decode.session import DecodeSession
    from ..sampler import SamplingSettings, UniformStream

    real = aux and pm.adapter is not None
    bank = bank_for(pm)  # the calls decoding makes: compiled fixed-shape ones (or their eager reference)
    greedy, u = SamplingSettings(), UniformStream(0)

    cache = pm.make_cache()
    mx.eval(pm(mx.zeros((context,), dtype=mx.int32), cache=cache))
    sess = DecodeSession(pm, cache, u, greedy, pm.config.greedy_u, bank=bank)
    secs: list[float] = []
    start = time.perf_counter()
    for w in widths:
        if len(secs) >= 2 and time.perf_counter() - start > time_budget:
            w0, w1 = widths[len(secs) - 2], widths[len(secs) - 1]
            slope = max(0.0, (secs[-1] - secs[-2]) / (w1 - w0))
            secs.append(secs[-1] + slope * (w - w1))
            continue
        if real and w == 1:
            steps = list(ar_calls(pm, cache, 0, u, greedy, repeats + 3, bank=bank))
            best = min(rec.time for _, rec in steps[1:-1])  # the first and last steps are not pipelined
            cache.trim_to(context)  # the steps left their tokens in the cache
        else:
            best = float("inf")
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                if real:
                    ptp_call(sess, 0, Plan([], [(0, w - 1)]), 0)
                else:
                    mx.eval(pm(mx.zeros((w,), dtype=mx.int32), cache=cache))  # sync: we are timing the pass
                best = min(best, time.perf_counter() - t0)
                cache.trim_to(context)
        secs.append(best)
    rel = [s / secs[0] for s in secs]
    return CostCurve(list(widths), rel), secs


def cached_cost_curve(pm, key: str, cache_dir: Path, log=None) -> CostCurve:
    """The measured PTP-call curve for this machine, model and adapter shape, measured once, cached as JSON."""
    path = Path(cache_dir) / f"cost-curve-{key}.json"
    if path.exists():
        try:
            d = json.loads(path.read_text())
            return CostCurve(d["widths"], d["relative"])
        except (json.JSONDecodeError, KeyError):
            pass
    if log:
        log("measuring this machine's PTP cost curve once (a few seconds)...")
    curve, secs = measure_cost_curve(pm, aux=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**curve.to_dict(), "seconds": secs}))
    tmp.replace(path)
    return curve
