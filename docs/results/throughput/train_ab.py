"""Training throughput, one pass per sequence (before) against the batched pass (after), alternated in one
process on the same steps so the machine's load affects both alike. Prints windows/s for each."""

# ruff: noqa: I001  (ptp_mlx first: it loads the fast BLAS before mlx)
import sys
import time

import ptp_mlx  # noqa: F401
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from ptp_mlx.adapter import load_adapter
from ptp_mlx.models import load
from ptp_mlx.paths import shipped_adapters_dir
from ptp_mlx.ptp_model import PTPModel
from ptp_mlx.train.batch import accumulate, step_items, weighted_ce_sum
from ptp_mlx.train.data import read_records
from ptp_mlx.train.windows import loss_fn, make_windows, slot_weights, teacher_kv

recs = read_records(sys.argv[1])
seqs = int(sys.argv[2]) if len(sys.argv) > 2 else 8
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
base, _ = load(None)
adapter, _ = load_adapter(shipped_adapters_dir() / "SmolLM2-135M-Instruct", base)
pm = PTPModel(base, adapter)
w = slot_weights("decay:0.7", 8)
g_single = nn.value_and_grad(adapter, lambda ad, b: loss_fn(ad, pm, b, w))
g_batch = nn.value_and_grad(adapter, lambda ad, kv, mb: weighted_ce_sum(ad, pm, kv, mb))
res = {"before": [], "after-1seq": [], "after-batched": []}
for r in range(rounds):
    rng = np.random.default_rng(r)
    idx = rng.choice(len(recs), size=seqs, replace=False)
    step = [dict(recs[int(i)]) for i in idx]
    sides = ["before", "after-1seq", "after-batched"]
    for side in sides if r % 2 == 0 else sides[::-1]:
        rng2 = np.random.default_rng([r, 1])
        t0 = time.perf_counter()
        if side == "before":
            batch, n_win = [], 0
            for rec in step:
                kv = teacher_kv(pm, rec["tokens"], rec, "prob")
                windows, u, labels, valid = make_windows(rec, 16, 8, rng2)
                batch.append((kv, windows, u, labels, valid))
                n_win += len(windows)
            loss, grads = g_single(adapter, batch)
        else:
            items = step_items(pm, step, 16, 8, rng2, w, "prob")
            loss, grads, rows = accumulate(g_batch, adapter, pm, items, 8, 1 if side == "after-1seq" else seqs)
            n_win = sum(1 for it in items for _ in it[1])
        mx.eval(loss, grads)
        dt = time.perf_counter() - t0
        res[side].append(n_win / dt)
        print(
            f"round {r} {side}: {n_win} windows in {dt:.2f} s = {n_win / dt:.1f} windows/s, loss {loss.item():.4f}",
            flush=True,
        )
for k, v in res.items():
    print(f"{k}: median {np.median(v):.1f} windows/s over {len(v)} steps of {seqs} sequences")
