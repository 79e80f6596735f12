"""What building ahead costs and saves per call on this machine, by regression over real decoding: every PTP call's
time (read to read, as the budget measures it) against its rows (one fixed effect per width), whether the next
call was built ahead while it computed, and whether it was itself queued from such a build. Building ahead is
switched per block of ``block`` calls (``ChainChoice.use`` replaced), so both ways share prompts and drift.

Usage: ``python docs/results/decode-floor/chain_cost.py [block] [rounds]`` from the repository root (greedy,
held-out prompts, 128 tokens)."""

import json
import sys
import time

import numpy as np

import ptp_mlx.decode.pipeline as pl  # (ptp_mlx before MLX: the kernel binds first)
from ptp_mlx.decode.chain_odds import ChainChoice
from ptp_mlx.drafting.policy import DraftPolicy
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

block = int(sys.argv[1]) if len(sys.argv) > 1 else 1
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
flags = {"ahead": 0, "sync": 0, "chain_s": 0.0}
rec: list[tuple] = []
count = [0]


def use(self) -> bool:
    count[0] += 1
    return (count[0] // block) % 2 == 0


_build, _chain, _timed = pl.CallQueue.build, pl.CallQueue.chain, DraftPolicy.timed


def build(self, *a):
    flags["sync"] = 1
    return _build(self, *a)


def chain(self):
    t0 = time.perf_counter()
    _chain(self)
    flags["ahead"], flags["chain_s"] = int(self.chained is not None), time.perf_counter() - t0


def timed(self, rows, tokens, seconds, cold=False, source=None):
    if rows > 1 and not cold:
        rec.append((rows, seconds, flags["ahead"], flags["sync"], flags["chain_s"]))
    flags.update(ahead=0, sync=0, chain_s=0.0)
    return _timed(self, rows, tokens, seconds, cold, source)


ChainChoice.use, pl.CallQueue.build, pl.CallQueue.chain, DraftPolicy.timed = use, build, chain, timed
S = SamplingSettings(seed=0)
eng = Engine.load()
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]


def run(p):
    list(eng.generate([{"role": "user", "content": p["turns"][0]}], max_tokens=128, mode="ptp", sampling=S))


run(prompts[0])  # warm-up: the shapes compile
rec.clear()
for _ in range(rounds):
    for p in prompts:
        run(p)
a = np.array(rec)
widths = sorted(set(a[:, 0].astype(int)))
X = np.column_stack([(a[:, 0] == w).astype(float) for w in widths] + [a[:, 2], 1 - a[:, 3]])
y = a[:, 1] * 1e3
coef, *_ = np.linalg.lstsq(X, y, rcond=None)
res = y - X @ coef
se = np.sqrt(np.diag(np.linalg.pinv(X.T @ X)) * res.var() * len(a) / (len(a) - X.shape[1]))
print(f"{len(a)} warm PTP calls: {int(a[:, 2].sum())} built the next one ahead, {int(len(a) - a[:, 3].sum())} chained")
for w, c, s in zip(widths, coef, se, strict=False):
    print(f"  {w:2d} rows: {c:6.2f} ms +- {s:.2f} ({int((a[:, 0] == w).sum())} calls)")
print(f"building the next call ahead while it computes: {coef[-2]:+.2f} +- {se[-2]:.2f} ms on this call")
print(f"queued from a build ahead (no build after the read): {coef[-1]:+.2f} +- {se[-1]:.2f} ms on this call")
print(f"a build ahead takes {1e3 * np.median(a[a[:, 2] == 1, 4]):.2f} ms (median, beside the compute)")
