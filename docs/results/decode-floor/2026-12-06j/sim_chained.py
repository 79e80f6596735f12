"""``device_sim.py`` with the budget's credit for a call built ahead (``drafting/shapes.py``: ``CHAINED``, in plain
steps) set from the environment, as a learnt credit (host seconds a build ahead saves over a device's step) would set
it: ``CH=0.35 python docs/results/decode-floor/2026-12-06j/sim_chained.py metal 14``."""

import os
import runpy
import sys

import ptp_mlx.drafting.shapes as shapes
import ptp_mlx.drafting.tree_budget as tree_budget

credit = float(os.environ.get("CH", "0.15"))
shapes.CHAINED = tree_budget.CHAINED = credit
print("CHAINED", credit)
sys.argv = ["device_sim.py", *sys.argv[1:]]
runpy.run_path("docs/results/decode-floor/device_sim.py", run_name="__main__")
