"""Plain compiled steps queued back to back for ten seconds: ms per step, and the host's time building each.

``python docs/results/kernel/step_loop.py`` (``PTP_MLX_SGEMM_LINGER_US`` and the other ``PTP_MLX_*`` switches apply;
``--perf OUT`` records ``perf record -g`` over the timed loop only). Runs of different settings are only comparable
when interleaved in one script: this VM's phases move a step by 10%."""

import argparse
import os
import subprocess
import time

# isort: off
import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS and the kernel ptp_mlx loads)
import mlx.core as mx
# isort: on

from ptp_mlx.decode.ar import prefill
from ptp_mlx.decode.fixed import bank_for
from ptp_mlx.engine import Engine
from ptp_mlx.generate import decoding_settings
from ptp_mlx.sampler import SamplingSettings

ap = argparse.ArgumentParser()
ap.add_argument("--seconds", type=float, default=10.0)
ap.add_argument("--perf")
args = ap.parse_args()
eng = Engine.load(log=lambda m: None, measure_cost=False)
pm = eng.pm
ids = list(eng.tokenizer.encode("Write a short story about a lighthouse keeper who finds a message in a bottle. " * 8))
s = decoding_settings(pm, SamplingSettings())
bank = bank_for(pm, True)
cache = pm.make_cache()
prefill(pm.base, ids[:-1], cache)
mx.eval(cache.arrays())
snap = cache.snapshot()


def step():
    return bank.ar_step(cache, s, mx.array([ids[-1]], dtype=mx.int32), mx.array([0.5], dtype=mx.float32))


for _ in range(10):  # compiled and warm
    nxt = step()
    mx.eval(nxt, cache.arrays())
    cache.restore(snap)
perf = None
if args.perf:
    perf = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-o", args.perf, "-p", str(os.getpid())])
    time.sleep(1)
t0, n, built = time.perf_counter(), 0, 0.0
while time.perf_counter() - t0 < args.seconds:
    a = time.perf_counter()
    nxt = step()
    built += time.perf_counter() - a
    mx.eval(nxt, cache.arrays())  # sync: one step at a time, as a step whose token the next one needs
    cache.restore(snap)
    n += 1
print(f"steps {n} ms/step {1e3 * (time.perf_counter() - t0) / n:.2f} build ms {1e3 * built / n:.2f}")
if perf is not None:
    perf.send_signal(2)
    perf.wait()
