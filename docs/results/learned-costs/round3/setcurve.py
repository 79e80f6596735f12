"""Plant a wrong cost curve: low (every width above 1 at 0.8 of a row) or high (each extra row 10 steps)."""

import glob
import json
import os
import sys

mode = sys.argv[1]
for f in glob.glob(os.path.expanduser("~/.cache/ptp-mlx/cost-curves/cost-curve-*.json")):
    d = json.load(open(f))
    step = d["seconds"][0] / d["relative"][0]
    rel = [1.0 if w == 1 else (0.8 if mode == "low" else 1.0 + 10.0 * (w - 1)) for w in d["widths"]]
    d.update(relative=rel, seconds=[r * step for r in rel], source="probed", moved=1.0, calls_observed=0)
    json.dump(d, open(f, "w"))
    print("planted", mode, f, rel[:5])
