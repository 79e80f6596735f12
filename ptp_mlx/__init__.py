"""ptp-mlx: lossless Parallel Token Prediction for local language models on MLX."""

from .blas import setup_blas

# Must run before anything imports mlx: see blas.py.
BLAS = setup_blas()

__version__ = "0.1.0"
