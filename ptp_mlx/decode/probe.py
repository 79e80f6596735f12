"""The cost probe: what a call of each width costs on this machine, measured once with decoding's own calls
(``measure_cost_curve``) and cached per machine, model and adapter shape (``cached_cost_curve``), as the prior of
the learnt costs (``drafting/learn.py``). It lives on the decode floor because it runs decode's calls."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlx.core as mx

from ..drafting.cost import PROBE_WIDTHS, CostCurve, check_probe, extrapolate
from ..drafting.learn import LearnedCost
from ..drafting.protocol import DraftPlan
from ..sampler import SamplingSettings, UniformStream
from .ar import ar_calls
from .call import ptp_call
from .fixed import bank_for
from .session import DecodeSession


def measure_cost_curve(
    pm, widths=PROBE_WIDTHS, context: int = 256, repeats: int = 3, aux: bool = False, time_budget: float = 20.0
) -> tuple[CostCurve, dict]:
    """Time passes of each width on top of a ``context``-token cache. Returns the curve and the probe's record.

    Each width is timed ``repeats`` times after one untimed call (the first call of a shape compiles); its cost is
    the fastest, its spread how far the median lies above it. The probe then checks what it saw before anything
    trusts it (``check_probe``): a width above 1 cheaper than one row, or cheaper than a narrower width, beyond the
    noise, is timed again (width 1 too) up to ``RETRIES`` times, then bounded. Once ``time_budget`` seconds are spent
    (a slow machine or BLAS) the wider widths are extrapolated, never with a per-row slope below the mean slope
    measured on this machine. The record keeps the timings, their spread, the load average and what was re-measured,
    bounded or extrapolated.

    ``aux=False`` times plain token passes (the machine's forward cost). ``aux=True`` times real calls the
    way decoding makes them, so the budget pays what decoding pays: width 1 is a pipelined autoregressive
    step (graph building hidden behind the previous pass), wider ones are whole PTP calls (``ptp_call``: one
    token row plus ``w - 1`` auxiliary rows through the adapter, the pick, the drafts' argmax and
    confidence, the host read and the cache trim).
    """
    real = aux and pm.adapter is not None
    bank = bank_for(pm)  # the calls decoding makes: compiled fixed-shape ones (or their eager reference)
    greedy, u = SamplingSettings(), UniformStream(0)

    cache = pm.make_cache()
    mx.eval(pm(mx.zeros((context,), dtype=mx.int32), cache=cache))
    sess = DecodeSession(pm, cache, u, greedy, pm.config.greedy_u, bank=bank)

    def timings(w: int, n: int) -> list[float]:
        if real and w == 1:
            steps = list(ar_calls(sess, 0, n + 3))
            cache.trim_to(context)  # the steps left their tokens in the cache
            return [rec.time for _, rec in steps[1:-1]]  # the first and last steps are not pipelined
        out = []
        for k in range(n + 1):
            t0 = time.perf_counter()
            if real:
                ptp_call(sess, 0, DraftPlan([], [(0, w - 1)]), 0)
            else:
                mx.eval(pm(mx.zeros((w,), dtype=mx.int32), cache=cache))  # sync: we are timing the pass
            if k:  # (the first call of a shape compiles it)
                out.append(time.perf_counter() - t0)
            cache.trim_to(context)
        return out

    load = _load_average()
    start = time.perf_counter()
    samples: dict[int, list[float]] = {}
    for w in widths:
        if len(samples) >= 2 and time.perf_counter() - start > time_budget:
            break
        samples[w] = timings(w, repeats)
    record = check_probe(samples, lambda w: timings(w, repeats))
    secs = extrapolate(list(widths), record)
    record.update(
        widths=list(widths),
        seconds=secs,
        repeats=repeats,
        context=context,
        load_before=load,
        load_after=_load_average(),
    )
    return CostCurve(list(widths), [x / secs[0] for x in secs]), record


def cached_cost_curve(pm, key: str, cache_dir: Path, log=None, recalibrate: bool = False):
    """This machine's PTP-call costs for this model and adapter shape (a ``LearnedCost``: corrected online by every
    call, written back when it moves), from ``cache_dir/cost-curve-<key>.json``; probed once when the file is
    missing, unreadable or ``recalibrate`` asks."""
    path = Path(cache_dir) / f"cost-curve-{key}.json"
    if path.exists() and not recalibrate:
        try:
            d = json.loads(path.read_text())
            prior = CostCurve(d["widths"], d["relative"])
            step = (d.get("seconds") or [None])[0]
            return LearnedCost(prior, step, path, d, d.get("source", "cached"))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            pass
    if log:
        log("measuring this machine's PTP cost curve once (about 20 seconds)...")
    curve, record = measure_cost_curve(pm, aux=True)
    doc = {**curve.to_dict(), "seconds": record["seconds"], "source": "probed", "probe": record}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)
    return LearnedCost(curve, record["seconds"][0], path, doc, "probed")


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None
