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

from ..drafting.protocol import CallResult, DraftPlan
from ..model.kv import KVState
from ..model.shape import CallShape, Window, WindowShape
from ..sampler import UNRESOLVED, SamplingSettings, resolve
from .fixed import outputs_head
from .session import DecodeSession
from .shape import CallInputs, CallOutputs, CallSpec


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
    trimmed back to), its shape and its outputs (lazy arrays until ``finish_call`` reads them)."""

    plan: DraftPlan
    offset: int | None  # None: a chained call, whose offset follows the read of the call before it
    i: int | None  # the generated position of its first exact token (None: a chained call, likewise)
    shape: CallShape
    out: CallOutputs
    hook: object | None = None  # the answer's ``LogitsHook`` (penalties, logit_bias, logprobs), if any
    row_u: mx.array | None = None  # float32 [n_tok]: the token rows' uniforms (to resolve a target on the host)
    settings: SamplingSettings | None = None

    @property
    def arrays(self) -> list[mx.array]:
        return self.out.arrays()


@dataclass
class ChainInputs:
    """A call's inputs as arrays computed on the device from the call before it (``decode/pipeline.py``): nothing
    here has been read by the host."""

    tokens: mx.array  # int32 [n_tok]: the exact token the call before emitted last, then the drafts
    row_u: mx.array  # float32 [n_tok]: the token rows' uniforms
    aux_u: mx.array  # float32 [n_aux]: the auxiliary rows' uniforms
    offset: mx.array  # int32 []: the cache length before the call
    bound: int  # the largest value ``offset`` can take


def call_shape(plan: DraftPlan, runner_up: bool = False, reads_top_prob: bool = False) -> CallShape:
    """The shape of the call that runs ``plan``: token rows ``[last, drafts, alternatives]`` (alternatives follow
    ``last`` like ``q_1``), the chain's branches, then the alternatives' branches (each sees its strand)."""
    n, alts = len(plan.drafts), plan.alts
    parents = tuple(range(-1, n)) + (0,) * len(alts)
    windows = [WindowShape(1 + d, w) for d, w in plan.branches]
    windows += [WindowShape(2, w, via=n + 1 + k) for k, (_, w) in enumerate(alts) if w]
    return CallShape(parents, tuple(windows), runner_up and bool(windows), reads_top_prob and bool(windows))


def call_uniforms(sess: DecodeSession, plan: DraftPlan, i: int) -> tuple[np.ndarray, np.ndarray]:
    """The uniforms of a call that runs ``plan`` from generated position ``i``: token rows (float32 [n_tok]) and
    auxiliary rows (float32 [n_aux]; the adapter's reserved one under greedy decoding)."""
    u, n, alts = sess.uniforms, len(plan.drafts), plan.alts
    widths = list(plan.branches) + [(1, w) for _, w in alts if w]  # (depth, rows) of each window
    if sess.greedy_u is not None:
        aux_u = np.full(sum(w for _, w in widths), sess.greedy_u, np.float32)
    else:
        aux_u = np.concatenate([u.take(i + d, w) for d, w in widths]) if widths else np.zeros(0, np.float32)
    row_u = u.take(i, n + 1)
    if alts:  # a row's u is that of the position it predicts: an alternative predicts what q_1 would
        row_u = np.concatenate([row_u, np.repeat(u.take(i + 1, 1), len(alts))])
    return row_u, aux_u


def build_call(
    sess: DecodeSession,
    last: int | None,
    plan: DraftPlan,
    i: int | None,
    tokens: mx.array | None = None,
    chain: ChainInputs | None = None,
) -> PendingCall:
    """The lazy graph of one fused PTP call (docs/method.md, section 5): token rows ``[last, plan.drafts,
    alternatives]`` (or ``tokens``, the same row ids as an array the host has not read), then the auxiliary
    windows of ``plan.branches`` and the alternatives' branches. The cache receives every row.

    With the session's ``bank`` the call is the fixed-shape one of ``decode/fixed.py`` (eager under a logits hook);
    otherwise the pass of ``PTPModel.__call__`` (a model whose RoPE takes one offset per call): the same rows,
    masks and outputs. ``i``: the generated position of the
    call's first exact token (where its uniforms start). ``chain``: every input already on the device (a chained
    call of ``decode/pipeline.py``: no ``last`` nor ``i``, and its ``offset`` is known once the call before it is
    read)."""
    pm, cache, s, hook = sess.pm, sess.cache, sess.settings, sess.hook
    rule = sess.rule.for_source(plan.source, plan.strict)  # (``lookup=0``: lookup chains verified exactly)
    offered = sess.context.array() if rule.guarded and sess.context is not None else None
    offset = cache.offset
    n, alts = len(plan.drafts), plan.alts
    shape = call_shape(plan, sess.runner_up, sess.reads_top_prob)
    if chain is not None:
        inputs = CallInputs(chain.tokens, chain.row_u, chain.aux_u, offset=chain.offset, bound=chain.bound)
        out = sess.bank.call(cache, CallSpec(shape, s, rule), inputs)
        return PendingCall(plan, None, None, shape, out, row_u=chain.row_u, settings=s)
    if tokens is None:
        tokens = mx.array([last, *plan.drafts, *(a for a, _ in alts)], dtype=mx.int32)
    n_aux = shape.n_aux
    row_u, aux_u = (mx.array(x) for x in call_uniforms(sess, plan, i))
    prefixes = [list(plan.drafts[:j]) for j in range(n + 1)] + [[a] for a, _ in alts] if hook is not None else None
    inputs = CallInputs(tokens, row_u, aux_u, offered=offered, hook=hook, prefixes=prefixes)
    if sess.bank is not None:
        out = sess.bank.call(cache, CallSpec(shape, s, rule), inputs)
        return PendingCall(plan, offset, i, shape, out, hook, row_u, s)
    # 1. One forward pass: token rows [last, q_1..q_n, alternatives], then the auxiliary windows (built lazily).
    windows = [Window(offset + w.ctx, w.n, None if w.via is None else w.via) for w in shape.windows]
    logits = pm(tokens, aux_u if n_aux else None, windows, cache, parents=None if shape.chain else list(shape.parents))
    out = outputs_head(CallSpec(shape, s, rule), logits, inputs)
    return PendingCall(plan, offset, i, shape, out, hook, row_u, s)


def finish_call(cache: KVState, call: PendingCall, clock=NO_CLOCK, then: int = 0) -> CallResult:
    """Wait for ``call``'s compute, read it, accept, and trim the cache back to the accepted path (plus the
    ``then`` rows of a chained call built on it, which start right after that path)."""
    # Accept rule: a draft stands iff it equals pick(u, teacher logits) at its position (or, under an opt-in
    # lenient rule, its row finds it likely enough); the first row that does not accept its draft emits its exact
    # token. Under the exact rule every emitted token is the autoregressive one.
    plan, offset, o = call.plan, call.offset, call.out
    n, alts = len(plan.drafts), plan.alts
    mx.eval(*call.arrays)  # sync: one host read per call for targets and next drafts (and logprobs)
    clock.mark("compute")
    targets_l = o.targets.tolist()
    if -1 in targets_l:
        raise ValueError("cannot sample: the model produced non-finite logits")
    settled = []

    def exact(r: int) -> int:
        # A target the call's fast pick left UNRESOLVED (its u beyond the likeliest tokens): the full sort, from
        # the same logits. Only the emitted rows are settled; a chained call built on it is dropped.
        if targets_l[r] == UNRESOLVED:
            targets_l[r] = resolve(float(call.row_u[r].item()), o.target_logits[r], call.settings)
            settled.append(r)
        return targets_l[r]

    # 2. Accept the leading drafts that equal the exact tokens; if the first draft fell, an alternative may stand.
    c = int(o.accepted.item())
    keep, block, alt = offset + 1 + c, list(plan.drafts[:c]) + [exact(c)], None
    if c == 0 and alts:
        hit = [k for k, (a, _) in enumerate(alts) if a == targets_l[0]]
        if hit:
            alt = hit[0]
            block, keep = [targets_l[0], exact(n + 1 + alt)], offset + 2
            # Compact: the alternative's K/V row moves next to ``last``; the other strands are trimmed below.
            cache.copy_row(offset + n + 1 + alt, offset + 1)
    # 3. Trim the cache back to the accepted path: [last, q_1..q_c] (or [last, alternative]) stay.
    cache.trim_to(keep + then)
    clock.mark("read+trim")

    def read(a):
        return [] if a is None else a.tolist()

    second = list(zip(read(o.second), read(o.second_conf), strict=True))
    top_l = None if o.top_prob is None else o.top_prob.tolist()
    lps = None
    if o.scored is not None:
        lps = call.hook.read(o.scored, list(range(c + 1)) if alt is None else [0, n + 1 + alt], block)
    accepted = c if alt is None else 1
    return CallResult(
        block=block,
        accepted=accepted,
        aux_tokens=read(o.aux_top),
        aux_conf=read(o.aux_conf),
        second=second,
        alt=alt,
        aux_top_prob=top_l,
        logprobs=lps,
        resolved=bool(settled),
    )


def ptp_call(sess: DecodeSession, last: int, plan: DraftPlan, i: int, clock=NO_CLOCK) -> CallResult:
    """One fused PTP call: verify ``plan.drafts`` after ``last`` (and the alternatives to the first draft,
    ``plan.alts``, as sibling strands: a token tree), draft ``plan.branches``, then keep only the accepted path
    in the cache."""
    call = build_call(sess, last, plan, i)
    clock.mark("build")
    return finish_call(sess.cache, call, clock)
