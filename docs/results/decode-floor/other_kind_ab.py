"""``OTHER_KIND_MIN`` on this CPU, A/B in one process (``interleave.py``): PTP with building ahead forced on at 0.15
(before) and 0.05 (now), and the learnt choice at 0.05, against AR, on every held-out prompt, ``rounds`` times.

Usage: ``python docs/results/decode-floor/other_kind_ab.py [rounds]`` from the repository root."""

import sys

from interleave import interleave

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
import ptp_mlx.decode.ahead as ah
from ptp_mlx.decode.chain_odds import choice_for
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
eng = Engine.load()
choice = choice_for(eng.pm)


def setting(forced: bool | None, other_kind_min: float):
    def setup() -> None:
        choice.forced, ah.OTHER_KIND_MIN = forced, other_kind_min

    return setup


VARIANTS = {
    "ar": ("ar", setting(None, 0.15)),
    "always 0.15": ("ptp", setting(True, 0.15)),
    "always 0.05": ("ptp", setting(True, 0.05)),
    "learnt 0.05": ("ptp", setting(None, 0.05)),
}
for r, (tot, _) in enumerate(interleave(eng, VARIANTS, rounds, SamplingSettings(temperature=0.0, seed=0))):
    print(f"round {r + 1}: " + "  ".join(f"{k} {tot['ar'] / tot[k]:.3f}x" for k in VARIANTS), flush=True)
