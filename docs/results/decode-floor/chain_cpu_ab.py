"""Building ahead on this 2-core CPU, three ways, A/B in one process: PTP with every call built after the read
(never), with the next call built while this one computes (always), and the same with ptp-sgemm's second thread
off while the host builds (solo: the compute on one core, the build on the other, instead of three threads on
two cores). ``linger``: microseconds ptp-sgemm's second thread spins after a product (``PTP_MLX_SGEMM_LINGER_US``;
the default 1000). AR and each variant on every held-out prompt, ``rounds`` times (``interleave.py``).

Usage: ``python docs/results/decode-floor/chain_cpu_ab.py [rounds] [linger_us]`` from the repository root."""

import sys

from interleave import interleave

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
import ptp_mlx.decode.pipeline as pl
from ptp_mlx import blas
from ptp_mlx.decode.chain_odds import choice_for
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
linger = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
eng = Engine.load()
lib = blas._libs["kernel"]
lib.ptp_sgemm_set_linger(linger * 1000)
solo = [False]


def one_thread_while(f):
    def run(*args, **kw):
        if not solo[0]:
            return f(*args, **kw)
        lib.ptp_sgemm_set_threads(1, 0, 0)
        try:
            return f(*args, **kw)
        finally:
            lib.ptp_sgemm_set_threads(2, 0, 0)

    return run


pl.CallQueue.chain = one_thread_while(pl.CallQueue.chain)
pl.CallQueue.start_after_burst = one_thread_while(pl.CallQueue.start_after_burst)


def setting(forced: bool | None, one_thread: bool):
    def setup() -> None:
        choice.forced, solo[0] = forced, one_thread

    return setup


choice = choice_for(eng.pm)
VARIANTS = {
    "ar": ("ar", setting(None, False)),
    "never": ("ptp", setting(False, False)),
    "always": ("ptp", setting(True, False)),
    "always solo": ("ptp", setting(True, True)),
}
for r, (tot, _) in enumerate(interleave(eng, VARIANTS, rounds, SamplingSettings(temperature=0.0, seed=0))):
    line = "  ".join(f"PTP {k} {tot['ar'] / tot[k]:.3f}x AR" for k in list(VARIANTS)[1:])
    print(f"round {r + 1} (linger {linger} us): AR {tot['ar']:.2f}s  {line}", flush=True)
