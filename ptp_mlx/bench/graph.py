"""How many primitives one call runs: the lazy graph of a call, counted without evaluating it (``ptp-bench
--profile``).

A call of a small model costs what its primitives cost (a kernel launch each on a GPU; docs/method.md, section 10),
so the profile counts them for mlx-lm's step, our autoregressive step and every PTP shape: the nodes of the graph
``mx.export_to_dot`` writes, split into compute primitives and views (reshapes, broadcasts, slices, transposes:
no kernel on a GPU). A compiled call's graph is what ``mx.compile`` replays, elementwise chains fused. On the CPU
the ``mx.fast`` operations appear as their fallbacks.
"""

from __future__ import annotations

import collections
import os
import re
import tempfile

import mlx.core as mx

VIEWS = frozenset(
    "Broadcast Reshape Squeeze ExpandDims Slice Transpose AsStrided Split Flatten Unflatten StopGradient View "
    "Depends BroadcastAxes".split()
)


def primitives(*outs: mx.array) -> tuple[int, int]:
    """(compute primitives, views) in the lazy graph of ``outs``; nothing is evaluated."""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *outs)
        with open(path) as f:
            counts = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.read()))
    finally:
        os.unlink(path)
    views = sum(v for k, v in counts.items() if k in VIEWS)
    return sum(counts.values()) - views, views


def call_primitives(eng, ids: list[int], shapes, s, compiled: bool = True) -> dict[str, tuple[int, int]]:
    """Primitives of one call of each kind on a cache prefilled with ``ids[:-1]``: mlx-lm's step (its cache, the
    argmax of its log-probabilities), our autoregressive step and a PTP call of each ``(drafts, branches)`` shape
    (``compiled``: as the compile bank runs them, else the same functions eagerly)."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..decode.ar import prefill
    from ..decode.call import build_call
    from ..decode.fixed import bank_for
    from ..decode.session import DecodeSession
    from ..drafting.protocol import DraftPlan
    from ..generate import decoding_settings
    from ..sampler import UniformStream

    pm = eng.pm
    s = decoding_settings(pm, s)
    last = ids[-1]
    out: dict[str, tuple[int, int]] = {}
    stock = make_prompt_cache(pm.base)
    prefill(pm.base, ids[:-1], stock)
    logits = pm.base(mx.array([[last]]), cache=stock)[0, -1]
    tok = mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1)
    out["mlx-lm"] = primitives(tok, *[a for c in stock for a in (c.keys, c.values)])
    bank = bank_for(pm, compiled)
    cache = pm.make_cache()
    prefill(pm.base, ids[:-1], cache)
    mx.eval(cache.arrays())
    if bank is not None:
        snap = cache.snapshot()
        nxt = bank.ar_step(cache, s, mx.array([last], dtype=mx.int32), mx.array([0.5], dtype=mx.float32))
        out["ar"] = primitives(nxt, *cache.arrays())
        mx.eval(nxt, cache.arrays())  # sync: the next graph must not include this one
        cache.restore(snap)
    if pm.adapter is None:
        return out
    greedy_u = pm.config.greedy_u if s.greedy else None
    for n, branches in shapes:
        snap = cache.snapshot()
        plan = DraftPlan([int(t) for t in ids[:n]], [tuple(b) for b in branches])
        call = build_call(DecodeSession(pm, cache, UniformStream(s.seed), s, greedy_u, bank=bank), last, plan, 0)
        out[f"ptp {1 + n}+{plan.rows - 1 - n}"] = primitives(*call.arrays, *cache.arrays())
        mx.eval(call.arrays, cache.arrays())
        cache.restore(snap)
    return out
