"""Which of the adapter's top tokens stands when sampling in probability order, by where the slot's uniform falls
(issue 43: pricing a sampled tree). A measurement, not a decoder.

Sampled answers (T, top-p, probability order, seeded) to development prompts (never the held-out ones) are the exact
continuations, and their uniforms are known (``UniformStream(seed)``). At every position one auxiliary window, fed
the uniforms of the positions it predicts (as decoding feeds a branch), gives each slot's top-k tokens with their
probabilities at T 1 and at the decoding temperature. The adapter's own estimate of the verifier's bins in
probability order is then ``[c_r, c_r + m_r)`` for rank ``r`` (``m_r`` its probability at T, ``c_r`` the sum of the
ranks before it; top-p ignored). Printed: each rank's hit rate when ``u`` falls inside its estimated bin and when
not, the "coupled" token (the rank whose estimated bin holds ``u``), and chains and two-token trees per slot.

    python docs/results/trees/sampled_oracle.py [--prompts 24] [--tokens 96] [--temp 0.7] [--top-p 0.95]
        [--out arrays.npz | --load arrays.npz]
"""

# ruff: noqa: I001  (ptp_mlx first: it loads the BLAS before anything imports mlx)
from __future__ import annotations

import argparse
import time
from pathlib import Path

import ptp_mlx  # noqa: F401
import mlx.core as mx
import numpy as np

from ptp_mlx.adapter import load_adapter, shipped_adapter
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.model.ptp import PTPModel
from ptp_mlx.model.shape import Window
from ptp_mlx.models import load
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import SamplingSettings, UniformStream
from ptp_mlx.train.windows import student_logits, teacher_kv
from tree_oracle import spread_prompts  # (run as a script from this folder: its neighbour)

DEV = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "prompts" / "dev_prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temp", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--file", default=str(DEV))
    ap.add_argument("--out", default=None)
    ap.add_argument("--load", default=None)
    args = ap.parse_args()
    if args.load:
        d = np.load(args.load)
        return analyse(d["toks"], d["p1"], d["pt"], d["u"], d["labels"])
    base, tok = load(None)
    adapter, _ = load_adapter(shipped_adapter(), base)
    pm = PTPModel(base, adapter)
    chosen = spread_prompts(args.file, args.prompts)
    W, K = args.width, args.k
    out = {k: [] for k in ("toks", "p1", "pt", "u", "labels")}
    t0 = time.perf_counter()
    for n, r in enumerate(chosen):
        ids = encode_prompt(tok, r["turns"][0])
        s = SamplingSettings(args.temp, 0, args.top_p, 100 + n, order="prob")
        opts = DecodeOptions(mode="ar", max_tokens=args.tokens, sampling=s)
        ans = [t for st in stream_generate(pm, tok, ids, opts) for t in st.tokens]
        us = UniformStream(s.seed).take(0, len(ans) + W)
        seq = ids + ans
        kv = teacher_kv(pm, seq)
        for s0 in range(0, len(ans) - 1, 32):
            ps = list(range(s0, min(s0 + 32, len(ans) - 1)))  # answer index a: the window's slot 0 predicts a
            windows = [Window(len(ids) + a, W) for a in ps]
            u = np.concatenate([us[a : a + W] for a in ps]).astype(np.float32)
            lg = student_logits(pm, adapter, kv, windows, u).astype(mx.float32)
            top = mx.argpartition(-lg, K, axis=-1)[:, :K]
            tl = mx.take_along_axis(lg, top, axis=-1)
            order = mx.argsort(-tl, axis=-1)
            top, tl = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(tl, order, axis=-1)
            p1 = mx.exp(tl - mx.logsumexp(lg, axis=-1, keepdims=True))
            pt = mx.exp(tl / args.temp - mx.logsumexp(lg / args.temp, axis=-1, keepdims=True))
            mx.eval(top, p1, pt)  # sync: host analysis
            shape = (len(ps), W, K)
            top, p1, pt = (np.array(x).reshape(shape) for x in (top, p1, pt))
            for i, a in enumerate(ps):
                lab = np.full(W, -1)
                m = min(W, len(ans) - a)
                lab[:m] = ans[a : a + m]
                for key, val in (("toks", top[i]), ("p1", p1[i]), ("pt", pt[i])):
                    out[key].append(val[1:])
                out["u"].append(us[a + 1 : a + W])
                out["labels"].append(lab[1:])
        print(
            f"{r.get('id') or r.get('question_id')}: {len(ans)} tokens ({time.perf_counter() - t0:.0f} s)", flush=True
        )
    arrays = {k: np.array(v) for k, v in out.items()}
    if args.out:
        np.savez(args.out, **arrays)
    analyse(**arrays)


def analyse(toks, p1, pt, u, labels) -> None:
    n, D, K = toks.shape
    rank = np.full((n, D), -1)
    for k in range(K):
        rank[toks[:, :, k] == labels] = k
    valid = labels >= 0
    lo = np.concatenate([np.zeros((n, D, 1)), np.cumsum(pt, axis=-1)[:, :, :-1]], axis=-1)  # estimated bin starts
    inside = (u[:, :, None] >= lo) & (u[:, :, None] < lo + pt)
    coupled = np.where(inside.any(-1), inside.argmax(-1), -1)  # the rank whose estimated bin holds u
    print(f"{n} windows, {D} draft slots, top {K}; slot 1 exact token in the top {K}: {(rank[:, 0] >= 0).mean():.3f}")
    for j in range(min(D, 3)):
        v = valid[:, j]
        print(f"slot {j + 1}:")
        for r in range(K):
            hit = rank[:, j] == r
            a, b = inside[:, j, r] & v, ~inside[:, j, r] & v
            print(
                f"  rank {r}: hit {hit[v].mean():.3f} | u in its bin ({a.mean():.3f} of slots): {hit[a].mean():.3f}"
                f" | not: {hit[b].mean():.3f} | mean p1 {p1[:, j, r][v].mean():.3f} pT {pt[:, j, r][v].mean():.3f}"
            )
        c = (coupled[:, j] >= 0) & v
        print(
            f"  coupled token: hit {(rank[:, j] == coupled[:, j])[c].mean():.3f} when u falls in a top-{K} bin"
            f" ({c.mean():.3f} of slots); argmax or coupled: {((rank[:, j] == 0) | (rank[:, j] == coupled[:, j]))[v].mean():.3f}"
        )

    # Chains: the argmax at every slot; the coupled token at every slot; a two-way tree (argmax and coupled
    # token per slot, each path of them): expected accepted drafts per window.
    def depth(ok: np.ndarray) -> float:
        return float(np.cumprod(ok, axis=1).sum(axis=1).mean())

    arg_ok = (rank == 0) & valid
    cpl_ok = (rank == coupled) & (coupled >= 0) & valid
    print(
        f"chain of argmax: {depth(arg_ok):.3f}  chain of coupled: {depth(cpl_ok):.3f}"
        f"  both per slot (a tree of up to 2^d paths): {depth(arg_ok | cpl_ok):.3f}"
    )


if __name__ == "__main__":
    main()
