"""``device_sim.py`` with ``ahead.TOKEN_MIN`` set from the environment (``TM``).

Usage: ``TM=0.25 python docs/results/decode-floor/2026-12-07b/token_min_sim.py metal 14 [temperature]``."""

import os
import runpy
import sys

import ptp_mlx  # noqa
import ptp_mlx.decode.ahead as ah

ah.TOKEN_MIN = float(os.environ["TM"])
sys.argv = ["device_sim.py"] + sys.argv[1:]
runpy.run_path("docs/results/decode-floor/device_sim.py", run_name="__main__")
