"""The answer's first PTP call built while the prompt's last prefill chunk computes, or after the whole prefill was
waited for (as before 2026-12-06, seventh session), A/B in one process with our AR beside (``interleave.py``: every
held-out prompt answered by each in turn, ``rounds`` times, greedy, 128 tokens, every answer checked against AR's).
Reports the whole answers' wall time (prefill included: what the change moves) and the decoding steps' time.

Usage: ``python docs/results/decode-floor/prefill_ab.py [rounds]`` from the repository root."""

import sys

from interleave import interleave

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
import ptp_mlx.generate as gen
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
eng = Engine.load()
prefill = gen.prefill
waited = [False]


def maybe_waited(model, tokens, cache, wait=True):
    return prefill(model, tokens, cache, wait=wait or waited[0])


def setting(wait: bool):
    def setup() -> None:
        waited[0] = wait

    return setup


gen.prefill = maybe_waited
VARIANTS = {"ar": ("ar", setting(False)), "ptp waited": ("ptp", setting(True)), "ptp beside": ("ptp", setting(False))}
for r, (steps, wall) in enumerate(interleave(eng, VARIANTS, rounds, SamplingSettings(temperature=0.0, seed=0))):
    print(f"round {r + 1}: " + "  ".join(f"{k} wall {wall[k]:.2f} s steps {steps[k]:.2f} s" for k in VARIANTS))
    print("  PTP against AR (wall): " + "  ".join(f"{k} {wall['ar'] / wall[k]:.3f}x" for k in VARIANTS if k != "ar"))
    gain = wall["ptp waited"] / wall["ptp beside"], steps["ptp waited"] / steps["ptp beside"]
    print(f"  beside against waited: wall {gain[0]:.4f}x, steps {gain[1]:.4f}x", flush=True)
print("lossless: every answer equals AR's")
