"""The Textual chat (imported as ``ptp_mlx.app``)."""
