"""``python -m ptp_mlx.kernels [--force]``: build ptp-sgemm (again, with ``--force``) and print its path, or why not."""

import sys

from . import build

path, why = build(force="--force" in sys.argv)
print(path or why)
sys.exit(0 if path else 1)
