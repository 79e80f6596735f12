"""``python -m ptp_mlx.kernels [--force]``: build ptp-sgemm and the CPU primitives (ptp-gated-linear, attention,
norms, heads; again, with ``--force``) and
print their paths, or why not. The exit status is ptp-sgemm's: the primitives are an extra on top."""

import sys

from . import build

force = "--force" in sys.argv
path, why = build(force=force)
print(path or why)
import ptp_mlx  # noqa: E402,F401  (loads the sgemm just built before MLX, as every start does)

from .extension import build as build_gated  # noqa: E402

gated, gated_why = build_gated(force=force)
print(gated or f"the CPU primitives not built: {gated_why}")
sys.exit(0 if path else 1)
