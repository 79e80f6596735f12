"""Synchronous calls of fixed shapes, timed interleaved in one process with an environment switch either way (read
per call by the CPU primitives), on one cache of ``CTX`` rows trimmed back after each call.

    python docs/results/decode-floor/2026-12-07/call_ab.py VAR A,B SHAPES N

e.g. ``PTP_MLX_DELTA_THREADS 1,2 1tok+2aux,1tok+6aux,3tok 300``. Shapes: ``1tok`` (a plain step), ``Ntok`` (N token
rows), ``1tok+Kaux`` (one token row and a branch of K auxiliary rows)."""

import os
import statistics
import sys
import time

import ptp_mlx  # noqa: F401  (the sgemm before MLX)

# isort: split
import mlx.core as mx

from ptp_mlx.decode.ar import ar_calls
from ptp_mlx.decode.call import ptp_call
from ptp_mlx.decode.fixed import bank_for
from ptp_mlx.decode.session import DecodeSession
from ptp_mlx.drafting.protocol import DraftPlan
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings, UniformStream

CTX = 256
var, vals, names, n = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), int(sys.argv[4])


def plan_of(name: str) -> DraftPlan | None:
    tok, _, aux = name.partition("+")
    k = int(tok.removesuffix("tok"))
    if name == "1tok":
        return None
    return DraftPlan(list(range(5, 4 + k)), [(0, int(aux.removesuffix("aux")))] if aux else [])


eng = Engine.load()
pm = eng.pm
cache = pm.make_cache()
mx.eval(pm(mx.zeros((CTX,), dtype=mx.int32), cache=cache))
sess = DecodeSession(pm, cache, UniformStream(0), SamplingSettings(), pm.config.greedy_u, bank=bank_for(pm))


def one(plan: DraftPlan | None) -> float:
    t0 = time.perf_counter()
    if plan is None:
        list(ar_calls(sess, 0, 1))
    else:
        ptp_call(sess, 0, plan, 0)
    dt = time.perf_counter() - t0
    cache.trim_to(CTX)
    return dt


plans = {k: plan_of(k) for k in names}
for k in names:
    for _ in range(3):
        one(plans[k])
res: dict[tuple[str, str], list[float]] = {(v, k): [] for v in vals for k in names}
for r in range(n):
    for k in names:
        for v in vals if r % 2 == 0 else vals[::-1]:
            os.environ[var] = v
            res[(v, k)].append(one(plans[k]))
for k in names:
    a, b = (statistics.median(res[(v, k)]) * 1e3 for v in vals)
    print(f"{k:10s} {var}={vals[0]}: {a:.2f} ms  {vals[1]}: {b:.2f} ms  ratio {a / b:.3f}")
