"""Converters to MLX folders (imported as ``ptp_mlx.convert``)."""
