"""One fused PTP call (docs/method.md, sections 4-5): verify the drafts in hand (a chain, or a token tree with
sibling strands), draft the next ones in the same pass, accept, and keep only the accepted path in the cache.

``ptp_call`` is shared by decoding (``generate._ptp_calls``), the budget's cost probe and ``ptp-bench
--profile``; a ``PhaseClock`` splits its time into phases.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .budget import Plan
from .ptp_model import PTPModel, Window
from .sampler import SamplingSettings, pick


class PhaseClock:
    """Splits each PTP call into phases (``ptp-bench --profile``): ``mark(name)`` ends the phase ``name``."""

    def __init__(self) -> None:
        self.calls: list[dict[str, float]] = []
        self._t = 0.0

    def start(self) -> None:
        self.calls.append({})
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.calls[-1][name] = self.calls[-1].get(name, 0.0) + now - self._t
        self._t = now

    def tag(self, key: str, value: float) -> None:
        self.calls[-1][key] = value


class _NoClock:
    def start(self) -> None:
        pass

    def mark(self, name: str) -> None:
        pass

    def tag(self, key: str, value: float) -> None:
        pass


NO_CLOCK = _NoClock()


@dataclass
class CallOut:
    """What one PTP call settled: the emitted ``block``, the drafts it ``accepted`` (the alternative counts as
    one), the auxiliary rows' argmax and confidence, their runner-up tokens and confidences, and the index of
    the alternative strand that landed (None: the chain)."""

    block: list[int]
    accepted: int
    aux_tokens: list[int]
    aux_conf: list[float]
    second: list[tuple[int, float]]
    alt: int | None = None
    aux_mode: list[float] | None = None  # each row's top probability at the decoding temperature (``mode_mass``)
    logprobs: list | None = None  # the block's ``TokenLogprob``s when the hook asks for them


def ptp_call(
    pm: PTPModel,
    cache,
    last: int,
    plan: Plan,
    u,
    i: int,
    s: SamplingSettings,
    greedy_u,
    clock=NO_CLOCK,
    runner_up: bool = False,
    mode_mass: bool = False,
    hook=None,
) -> CallOut:
    """One fused PTP call: verify ``plan.drafts`` after ``last`` (and the alternatives to the first draft,
    ``plan.alts``, as sibling strands: a token tree), draft ``plan.branches``, then keep only the accepted path
    in the cache. ``runner_up``: also read each auxiliary row's second-best token (for the next call's tree).
    Returns a ``CallOut``."""
    # Accept rule: a draft stands iff it equals pick(u, teacher logits) at its position; the first
    # mismatch is replaced by that exact token, so every emitted token is the autoregressive one.
    offset = cache[0].offset
    n, branches, alts = len(plan.drafts), plan.branches, plan.alts
    # 1. One forward pass: token rows [last, q_1..q_n, alternatives], then the auxiliary windows (built lazily).
    tokens = mx.array([last] + plan.drafts + [a for a, _ in alts])
    parents = list(range(-1, n)) + [0] * len(alts) if alts else None  # alternatives follow ``last`` like q_1
    windows = [Window(offset + 1 + d, w) for d, w in branches]
    windows += [Window(offset + 2, w, via=n + 1 + k) for k, (_, w) in enumerate(alts) if w]
    widths = [(d, w) for d, w in branches] + [(1, w) for _, w in alts if w]  # (depth, rows) of each window
    aux_u = None
    if windows:
        aux_u = mx.array(
            np.full(sum(w for _, w in widths), greedy_u, np.float32)
            if greedy_u is not None
            else np.concatenate([u.take(i + d, w) for d, w in widths])
        )
    logits = pm(tokens, aux_u, windows, cache, parents=parents)
    n_tok = n + 1 + len(alts)
    row_u = u.take(i, n + 1)
    if alts:  # a row's u is that of the position it predicts: an alternative predicts what q_1 would
        row_u = np.concatenate([row_u, np.repeat(u.take(i + 1, 1), len(alts))])
    rows = logits[:n_tok]
    if hook is not None:  # penalties and logit_bias: a row counts the drafts before it (ptp_mlx/logits.py)
        rows = hook.rows(rows, [plan.drafts[:j] for j in range(n + 1)] + [[a] for a, _ in alts])
    targets = pick(mx.array(row_u), rows, s.temperature, s.top_k, s.top_p, check=False, order=s.order)
    scored = hook.score(rows, targets) if hook is not None else None
    outs, mode = [targets], None
    if windows:
        aux = logits[n_tok:].astype(mx.float32)
        top = mx.argmax(aux, axis=-1)
        lse = mx.logsumexp(aux, axis=-1)
        outs += [top, mx.exp(mx.max(aux, axis=-1) - lse)]
        if mode_mass:  # the adapter's estimate of the mode's mass under the sampler's temperature
            t = s.temperature
            mode = mx.exp(mx.max(aux, axis=-1) / t - mx.logsumexp(aux / t, axis=-1))
        if runner_up:
            rest = mx.where(mx.arange(aux.shape[-1])[None] == top[:, None], -mx.inf, aux)  # the max of the rest
            outs += [mx.argmax(rest, axis=-1), mx.exp(mx.max(rest, axis=-1) - lse)]
    clock.mark("build")
    extra = ([] if mode is None else [mode]) + (scored or [])
    mx.eval(*outs, *extra)  # sync: one host read per call for targets, next drafts (and logprobs)
    clock.mark("compute")
    targets_l = targets.tolist()
    aux_l = [o.tolist() for o in outs[1:]] + [[]] * (5 - len(outs))
    if min(targets_l) < 0:
        raise ValueError("cannot sample: the model produced non-finite logits")
    # 2. Accept the leading drafts that equal the exact tokens; if the first draft fell, an alternative may stand.
    c = 0
    while c < n and plan.drafts[c] == targets_l[c]:
        c += 1
    keep, block, alt = offset + 1 + c, targets_l[: c + 1], None
    if c == 0 and alts:
        hit = [k for k, (a, _) in enumerate(alts) if a == targets_l[0]]
        if hit:
            alt = hit[0]
            block, keep = [targets_l[0], targets_l[n + 1 + alt]], offset + 2
            # Compact: the alternative's K/V row moves next to ``last``; the other strands are trimmed below.
            src = offset + n + 1 + alt
            for layer_cache in cache:
                layer_cache.keys[..., offset + 1, :] = layer_cache.keys[..., src, :]
                layer_cache.values[..., offset + 1, :] = layer_cache.values[..., src, :]
    # 3. Trim the cache back to the accepted path: [last, q_1..q_c] (or [last, alternative]) stay.
    for layer_cache in cache:
        layer_cache.trim(layer_cache.offset - keep)
    clock.mark("read+trim")
    second = list(zip(aux_l[2], aux_l[3], strict=True))
    mode_l = None if mode is None else mode.tolist()
    block_rows = list(range(c + 1)) if alt is None else [0, n + 1 + alt]
    lps = hook.read(scored, block_rows, block) if scored is not None else None
    return CallOut(block, c if alt is None else 1, aux_l[0], aux_l[1], second, alt, mode_l, lps)
