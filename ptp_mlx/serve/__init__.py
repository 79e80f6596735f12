"""``ptp-serve``: an OpenAI-compatible HTTP server decoding with PTP.

``schema`` parses requests and shapes responses, ``stops`` cuts text at stop strings, ``worker`` is the one thread
that owns MLX, ``app`` is the FastAPI application and ``cli`` the command.
"""
