"""How many drafts a token tree of the adapter's top-k tokens could land, teacher-forced (issue 43).

Plain greedy answers to development prompts (never the held-out ones) are the exact continuations. At every
position of each answer, one auxiliary window (what a call's branch drafts for the next call) gives each slot's
top-k tokens and probabilities. A tree node is a tuple of ranks, one per slot (``(0, 0, 0)``: the chain's third
draft; ``(1,)``: the runner-up at slot 1; ``(1, 0)``: then slot 2's top token). A node stands when each of its
tokens is the exact one, so a prefix-closed tree's accepted drafts are the number of its nodes that stand.

Printed: each node's measured rate of standing, the best static tree of R nodes (the R most frequent nodes; every
prefix of a node is at least as frequent) and a dynamic tree (per window, the R nodes with the highest product of
the adapter's probabilities, with the same R), against the chain of the same depth. A measurement, not a decoder.

    python docs/results/trees/tree_oracle.py [--file prompts.jsonl] [--prompts 24] [--tokens 96] [--width 8] [--k 4]
        [--out arrays.npz | --load arrays.npz]
"""

# ruff: noqa: I001  (ptp_mlx first: it loads the BLAS before anything imports mlx)
from __future__ import annotations

import argparse
import heapq
import json
import time
from collections import Counter
from pathlib import Path

import ptp_mlx  # noqa: F401
import mlx.core as mx
import numpy as np

from ptp_mlx.adapter import load_adapter, shipped_adapter
from ptp_mlx.model.ptp import PTPModel
from ptp_mlx.model.shape import Window
from ptp_mlx.models import load
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.train.windows import GREEDY_U, student_logits, teacher_kv

DEV = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "prompts" / "dev_prompts.jsonl"


def spread_prompts(path: str, n: int) -> list[dict]:
    """The first ``n`` prompts of a JSONL file taken from its categories in turn."""
    by_cat: dict[str, list[dict]] = {}
    for r in (json.loads(line) for line in open(path)):
        by_cat.setdefault(r["category"], []).append(r)
    return [r for grp in zip(*by_cat.values(), strict=False) for r in grp][:n]


def greedy_answer(base, ids: list[int], n: int, eos: int | None) -> list[int]:
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(ids), base, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(tok))
        if tok == eos:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--file", default=str(DEV), help="prompts (JSONL with turns; default: the development prompts)")
    ap.add_argument("--out", default=None, help="save the top-k arrays (.npz) for later analysis")
    ap.add_argument("--load", default=None, help="analyse arrays saved by --out instead of running the model")
    args = ap.parse_args()
    if args.load:
        d = np.load(args.load)
        return analyse(d["toks"], d["probs"], d["labels"])
    base, tok = load(None)
    adapter, _ = load_adapter(shipped_adapter(), base)
    pm = PTPModel(base, adapter)
    chosen = spread_prompts(args.file, args.prompts)
    W, K = args.width, args.k
    toks, probs, labels = [], [], []
    t0 = time.perf_counter()
    for r in chosen:
        ids = encode_prompt(tok, r["turns"][0])
        ans = greedy_answer(base, ids, args.tokens, getattr(tok, "eos_token_id", None))
        seq = ids + ans
        kv = teacher_kv(pm, seq)
        for s in range(0, len(ans) - 1, 32):
            ps = [len(ids) + p for p in range(s, min(s + 32, len(ans) - 1))]
            windows = [Window(p, W) for p in ps]
            u = np.full(len(ps) * W, GREEDY_U, np.float32)
            lg = student_logits(pm, adapter, kv, windows, u).astype(mx.float32)
            pr = mx.softmax(lg, axis=-1)
            top = mx.argpartition(-pr, K, axis=-1)[:, :K]
            tp = mx.take_along_axis(pr, top, axis=-1)
            order = mx.argsort(-tp, axis=-1)
            top, tp = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(tp, order, axis=-1)
            mx.eval(top, tp)  # sync: host analysis
            top, tp = np.array(top).reshape(len(ps), W, K), np.array(tp).reshape(len(ps), W, K)
            for i, p in enumerate(ps):
                lab = np.full(W, -1)
                n = min(W, len(seq) - p)
                lab[:n] = seq[p : p + n]
                toks.append(top[i, 1:])
                probs.append(tp[i, 1:])
                labels.append(lab[1:])
        print(
            f"{r.get('id') or r.get('question_id')}: {len(ans)} tokens ({time.perf_counter() - t0:.0f} s)", flush=True
        )
    toks, probs, labels = np.array(toks), np.array(probs), np.array(labels)
    if args.out:
        np.savez(args.out, toks=toks, probs=probs, labels=labels)
    analyse(toks, probs, labels)


def analyse(toks: np.ndarray, probs: np.ndarray, labels: np.ndarray, sizes=(4, 7, 8, 12, 16, 24, 32, 48, 64)) -> None:
    n, D, K = toks.shape
    rank = np.full((n, D), -1)  # the exact token's rank among the top k, -1 when outside
    for k in range(K):
        rank[toks[:, :, k] == labels] = k
    freq: Counter = Counter()
    for row in rank:
        path = []
        for r in row:
            if r < 0:
                break
            path.append(int(r))
            freq[tuple(path)] += 1
    print(f"\n{n} windows, {D} draft slots, top {K}")
    chain = [freq[(0,) * d] / n for d in range(1, D + 1)]
    print("chain: P(depth d stands) " + " ".join(f"{x:.3f}" for x in chain), f"E = {sum(chain):.3f}")
    best = sorted(freq.items(), key=lambda kv: -kv[1])
    print("most frequent nodes:", ", ".join(f"{k}:{v / n:.3f}" for k, v in best[:24]))
    for R in sizes:
        static = sum(v for _, v in best[:R]) / n
        dyn = np.mean([_dynamic_depth(probs[i], rank[i], R) for i in range(n)])
        print(f"R={R:3d}: chain(depth {min(R, D)}) {sum(chain[:R]):.3f}  static tree {static:.3f}  dynamic {dyn:.3f}")
    # Calibration of each rank's probability given that the path before it stood, by what that path was: the chain
    # (argmax at every earlier slot), a runner-up at the slot just before ("after_alt"), or a runner-up earlier
    # and argmaxes since ("alt_then_top"). A ratio near 1: the product of the path's probabilities is the node's
    # chance.
    stats: dict = {}
    for i in range(n):
        for j in range(1, D):
            if (rank[i, :j] < 0).any():
                break
            kind = "after_alt" if rank[i, j - 1] > 0 else ("chain" if (rank[i, :j] == 0).all() else "alt_then_top")
            for r in range(K):
                st = stats.setdefault((kind, r), [0, 0.0, 0])
                st[0] += rank[i, j] == r
                st[1] += probs[i, j, r]
                st[2] += 1
    for (kind, r), (hit, conf, m) in sorted(stats.items()):
        print(f"given {kind:12s} rank {r}: hit {hit / m:.3f} predicted {conf / m:.3f} (n {m})")
    # Calibration of the top-1 and runner-up probabilities.
    for k in range(min(K, 3)):
        p = probs[:, :, k].ravel()
        hit = (toks[:, :, k] == labels).ravel()
        bins = np.digitize(p, [0.1, 0.3, 0.5, 0.7, 0.9])
        print(
            f"rank {k} calibration:",
            " ".join(
                f"[{b}] p={p[bins == b].mean():.2f} hit={hit[bins == b].mean():.2f} n={int((bins == b).sum())}"
                for b in range(6)
                if (bins == b).any()
            ),
        )


def _dynamic_depth(p: np.ndarray, rank: np.ndarray, R: int) -> int:
    """Accepted drafts of the tree of the R nodes with the highest path probability (best-first expansion)."""
    D, K = p.shape
    heap = [(-float(p[0, k]), (k,)) for k in range(K)]
    heapq.heapify(heap)
    chosen = set()
    while heap and len(chosen) < R:
        negv, node = heapq.heappop(heap)
        chosen.add(node)
        if len(node) < D:
            for k in range(K):
                heapq.heappush(heap, (negv * float(p[len(node), k]), (*node, k)))
    depth = 0
    for d in range(1, D + 1):
        if tuple(int(x) for x in rank[:d]) in chosen and rank[d - 1] >= 0:
            depth = d
        else:
            break
    return depth


if __name__ == "__main__":
    main()
