"""``python -m ptp_mlx.kernels [--force]``: build ptp-sgemm, the CPU primitives (ptp-gated-linear, attention,
norms, heads) and ptp-graph (again, with ``--force``) and print their paths, or why not. The exit status is
ptp-sgemm's: the others are extras on top."""

import sys

from . import build

force = "--force" in sys.argv
path, why = build(force=force)
print(path or why)
import ptp_mlx  # noqa: E402,F401  (loads the sgemm just built before MLX, as every start does)

from .extension import build as build_module  # noqa: E402
from .graph_tools import GRAPH  # noqa: E402

gated, gated_why = build_module(force=force)
print(gated or f"the CPU primitives not built: {gated_why}")
graph, graph_why = build_module(force=force, spec=GRAPH)
print(graph or f"ptp-graph not built: {graph_why}")
sys.exit(0 if path else 1)
