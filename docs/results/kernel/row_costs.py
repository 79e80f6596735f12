"""Where a PTP call's extra time goes: token rows, auxiliary rows, and the adapter's LoRA (issue 41).

Times, on the cost sweep's random-weight model of the default model's shape (context 128, compiled fixed-shape
calls as the compile bank runs them, each synchronised), a plain step and PTP calls of a few shapes, interleaved,
median of ``--repeats``. ``--no-lora`` makes the calls skip the adapter's LoRA (the auxiliary rows keep their
u-embedding and outputs): the difference is what the LoRA costs. A measurement, not a decoder: nothing here is
used by ptp-mlx.

    python docs/results/kernel/row_costs.py [--no-lora] [--repeats 14]
"""

from __future__ import annotations

import argparse
import time

from ptp_mlx.bench.sweep import call_timers, random_model
from ptp_mlx.drafting.protocol import DraftPlan
from ptp_mlx.model import ptp as model_ptp

# name -> (drafts, branches): token rows are 1 + drafts, auxiliary rows the branches' widths
SHAPES = {
    "1+0": (0, []),
    "2 tok": (1, []),
    "1 tok + 1 aux": (0, [(0, 1)]),
    "4 tok": (3, []),
    "1 tok + 3 aux": (0, [(0, 3)]),
    "2 tok + 2 aux": (1, [(1, 2)]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--repeats", type=int, default=14)
    args = ap.parse_args()
    if args.no_lora:
        model_ptp.PTPModel.lora_for = lambda self, gate, adapter=None: None
    step, call_for = call_timers(random_model("135m"))
    cases = {"plain step": step, **{k: call_for(DraftPlan([5] * n, br)) for k, (n, br) in SHAPES.items()}}
    for fn in cases.values():
        fn(), fn()  # compile and warm
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: 1000 * sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"row_costs.py{' --no-lora' if args.no_lora else ''}: median ms (x plain step)")
    print("  ".join(f"{k} {v:.1f} ({v / med['plain step']:.2f})" for k, v in med.items()))


if __name__ == "__main__":
    main()
