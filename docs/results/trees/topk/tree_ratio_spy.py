"""The adapter's trees, predicted against stood: wraps ``ptp-bench`` and sums, over every call that verified a
tree, its tokens' predicted chances and those that stood (``TreeDrafter._calibrate``), with the budget's
``tree_ratio`` after each.

Usage: ``python docs/results/trees/topk/tree_ratio_spy.py --prompts ptp_mlx/data/heldout_prompts.jsonl
--max-tokens 128 --temp 0.7 --top-p 0.95 --methods ar,ptp`` (any ``ptp-bench`` arguments)."""

import atexit
import sys

from ptp_mlx.bench.cli import main
from ptp_mlx.drafting import budget, tree

_calibrate = tree.TreeDrafter._calibrate
log: list[tuple[float, float, float]] = []


def calibrate(self, plan, result, cands):
    b = self.budget
    e0, h0 = b.tree_expected, b.tree_hits
    _calibrate(self, plan, result, cands)
    log.append((b.tree_expected - budget.TREE_KEEP * e0, b.tree_hits - budget.TREE_KEEP * h0, b.tree_ratio))


@atexit.register
def report() -> None:
    if log:
        e, h = sum(x[0] for x in log), sum(x[1] for x in log)
        mean = sum(x[2] for x in log) / len(log)
        print(f"SPY trees {len(log)} expected {e:.1f} hits {h:.0f} ratio-last {log[-1][2]:.2f} mean-ratio {mean:.2f}")


if __name__ == "__main__":
    tree.TreeDrafter._calibrate = calibrate
    sys.exit(main(sys.argv[1:]))
