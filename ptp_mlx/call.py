"""One fused PTP call (docs/method.md, sections 4-5): verify the drafts in hand (a chain, or a token tree with
sibling strands), draft the next ones in the same pass, accept, and keep only the accepted path in the cache.

A call is built (``build_call``: the lazy graph, nothing computed) and then finished (``finish_call``: wait for
the compute, read, accept, trim), so decoding can queue a call and build the next one while it computes.
``ptp_call`` does both; it is shared by the budget's cost probe and ``ptp-bench --profile``; a ``PhaseClock``
splits a call's time into phases.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .drafting.protocol import CallResult, Plan
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
class PendingCall:
    """A built PTP call: its plan, its position (``offset``: the cache length before it, where an abandoned call is
    trimmed back to), and the lazy arrays its host read needs."""

    plan: Plan
    offset: int
    i: int
    outs: list[mx.array]  # exact tokens of the token rows; then (with windows) the auxiliary rows' argmax,
    # confidence, and (runner_up) their runner-up and its confidence
    mode: mx.array | None = None
    hook: object | None = None  # the answer's ``LogitsHook`` (penalties, logit_bias, logprobs), if any
    scored: list[mx.array] | None = None  # what the hook reads back for logprobs

    @property
    def arrays(self) -> list[mx.array]:
        return self.outs + ([] if self.mode is None else [self.mode]) + (self.scored or [])


def build_call(
    pm: PTPModel,
    cache,
    last: int,
    plan: Plan,
    u,
    i: int,
    s: SamplingSettings,
    greedy_u,
    runner_up: bool = False,
    mode_mass: bool = False,
    tokens: mx.array | None = None,
    hook=None,
) -> PendingCall:
    """The lazy graph of one fused PTP call (docs/method.md, section 5): token rows ``[last, plan.drafts,
    alternatives]`` (or ``tokens``, the same row ids as an array the host has not read), then the auxiliary
    windows of ``plan.branches`` and the alternatives' branches. The cache receives every row."""
    offset = cache[0].offset
    n, branches, alts = len(plan.drafts), plan.branches, plan.alts
    # 1. One forward pass: token rows [last, q_1..q_n, alternatives], then the auxiliary windows (built lazily).
    if tokens is None:
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
    return PendingCall(plan, offset, i, outs, mode, hook, scored)


def finish_call(cache, call: PendingCall, clock=NO_CLOCK) -> CallResult:
    """Wait for ``call``'s compute, read it, accept, and trim the cache back to the accepted path."""
    # Accept rule: a draft stands iff it equals pick(u, teacher logits) at its position; the first
    # mismatch is replaced by that exact token, so every emitted token is the autoregressive one.
    plan, offset, outs = call.plan, call.offset, call.outs
    n, alts = len(plan.drafts), plan.alts
    mx.eval(*call.arrays)  # sync: one host read per call for targets and next drafts (and logprobs)
    clock.mark("compute")
    targets_l = outs[0].tolist()
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
    mode_l = None if call.mode is None else call.mode.tolist()
    lps = None
    if call.scored is not None:
        lps = call.hook.read(call.scored, list(range(c + 1)) if alt is None else [0, n + 1 + alt], block)
    return CallResult(block, c if alt is None else 1, aux_l[0], aux_l[1], second, alt, mode_l, lps)


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
) -> CallResult:
    """One fused PTP call: verify ``plan.drafts`` after ``last`` (and the alternatives to the first draft,
    ``plan.alts``, as sibling strands: a token tree), draft ``plan.branches``, then keep only the accepted path
    in the cache. ``runner_up``: also read each auxiliary row's second-best token (for the next call's tree)."""
    call = build_call(pm, cache, last, plan, u, i, s, greedy_u, runner_up, mode_mass, hook=hook)
    clock.mark("build")
    return finish_call(cache, call, clock)
