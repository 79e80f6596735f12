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

from ..drafting.protocol import CallResult, DraftPlan, RunnerUps
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

    def tag(self, key: str, value: float | str) -> None:
        self.calls[-1][key] = value


class _NoClock:
    def start(self) -> None:
        pass

    def mark(self, name: str) -> None:
        pass

    def tag(self, key: str, value: float | str) -> None:
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
    ahead: bool = False  # queued from a build made while the PTP call before it computed (``decode/pipeline.py``)

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
    # after a token tree: (src, dst, rows), the K/V rows the call moves before its pass (int32 [rows] to read, int32
    # [] where the first goes, computed on the device; rows already in place where the path took no strand), or None
    move: tuple[mx.array, mx.array, int] | None = None


def tree_rows(plan: DraftPlan) -> list[tuple[int, int, int]]:
    """``(row, parent row, depth)`` of every token row of ``plan``'s call after ``last`` and the chain: each strand's
    tokens in order, the first following the row ``plan.follows`` names (the chain's row ``at``, or a token of
    its parent strand)."""
    out, r = [], 1 + len(plan.drafts)
    for j, st in enumerate(plan.strands):
        parent = plan.follows(j)
        for k in range(len(st.tokens)):
            out.append((r, parent, st.at + 1 + k))
            parent, r = r, r + 1
    return out


def call_shape(plan: DraftPlan, runner_up: bool = False, reads_top_prob: bool = False) -> CallShape:
    """The shape of the call that runs ``plan``: token rows ``[last, drafts, strands...]`` (a strand's first token
    follows the chain's row ``at``, each next one the one before), the chain's branches, then the strands' branches
    (each sees its strand's path)."""
    n = len(plan.drafts)
    parents = tuple(range(-1, n)) + tuple(p for _, p, _ in tree_rows(plan))
    windows = [WindowShape(1 + d, w) for d, w in plan.branches]
    r = 1 + n
    for st in plan.strands:
        r += len(st.tokens)
        if st.width:
            windows.append(WindowShape(1 + st.depth, st.width, via=r - 1))
    return CallShape(parents, tuple(windows), runner_up and bool(windows), reads_top_prob and bool(windows))


def call_uniforms(sess: DecodeSession, plan: DraftPlan, i: int) -> tuple[np.ndarray, np.ndarray]:
    """The uniforms of a call that runs ``plan`` from generated position ``i``: token rows (float32 [n_tok]) and
    auxiliary rows (float32 [n_aux]; the adapter's reserved one under greedy decoding)."""
    u, n = sess.uniforms, len(plan.drafts)
    widths = list(plan.branches) + [(st.depth, st.width) for st in plan.strands if st.width]  # (depth, rows)
    if sess.greedy_u is not None:
        aux_u = np.full(sum(w for _, w in widths), sess.greedy_u, np.float32)
    else:
        aux_u = np.concatenate([u.take(i + d, w) for d, w in widths]) if widths else np.zeros(0, np.float32)
    row_u = u.take(i, n + 1)
    if plan.strands:  # a row's u is that of the position it predicts: a strand row at depth e predicts i + e
        row_u = np.concatenate([row_u, *(u.take(i + e, 1) for _, _, e in tree_rows(plan))])
    return row_u, aux_u


def _prefixes(plan: DraftPlan) -> list[list[int]]:
    """Per token row, the drafts on its path after ``last`` (what a logits hook counts for that row)."""
    out = [list(plan.drafts[:j]) for j in range(len(plan.drafts) + 1)]
    for j, st in enumerate(plan.strands):
        out += [plan.path_drafts(j, k + 1) for k in range(len(st.tokens))]
    return out


def build_call(
    sess: DecodeSession,
    last: int | None,
    plan: DraftPlan,
    i: int | None,
    tokens: mx.array | None = None,
    chain: ChainInputs | None = None,
) -> PendingCall:
    """The lazy graph of one fused PTP call (docs/method.md, section 5): token rows ``[last, plan.drafts,
    strands]`` (or ``tokens``, the same row ids as an array the host has not read), then the auxiliary
    windows of ``plan.branches`` and the strands' branches. The cache receives every row.

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
    shape = call_shape(plan, sess.runner_up, sess.reads_top_prob)
    if chain is not None:
        src, dst, moved = chain.move if chain.move is not None else (None, None, 0)
        inputs = CallInputs(
            chain.tokens, chain.row_u, chain.aux_u, offset=chain.offset, bound=chain.bound, move_src=src, move_dst=dst
        )
        out = sess.bank.call(cache, CallSpec(shape, s, rule, moved), inputs)
        return PendingCall(plan, None, None, shape, out, row_u=chain.row_u, settings=s)
    if tokens is None:
        tokens = mx.array([last, *plan.drafts, *(t for st in plan.strands for t in st.tokens)], dtype=mx.int32)
    n_aux = shape.n_aux
    row_u, aux_u = (mx.array(x) for x in call_uniforms(sess, plan, i))
    prefixes = _prefixes(plan) if hook is not None else None
    inputs = CallInputs(tokens, row_u, aux_u, offered=offered, hook=hook, prefixes=prefixes)
    if sess.bank is not None:
        out = sess.bank.call(cache, CallSpec(shape, s, rule), inputs)
        return PendingCall(plan, offset, i, shape, out, hook, row_u, s)
    # 1. One forward pass: token rows [last, q_1..q_n, strands], then the auxiliary windows (built lazily).
    windows = [Window(offset + w.ctx, w.n, None if w.via is None else w.via) for w in shape.windows]
    logits = pm(tokens, aux_u if n_aux else None, windows, cache, parents=None if shape.chain else list(shape.parents))
    out = outputs_head(CallSpec(shape, s, rule), logits, inputs)
    return PendingCall(plan, offset, i, shape, out, hook, row_u, s)


def finish_call(cache: KVState, call: PendingCall, clock=NO_CLOCK, then: int = 0, on_strand=None) -> CallResult:
    """Wait for ``call``'s compute, read it, accept, and trim the cache back to the accepted path (plus the
    ``then`` rows of a chained call built on it, which start right after that path). ``on_strand(strand,
    accepted, copies)``: called when the path took a strand of a token tree, before its K/V rows move (``copies``:
    ``(from, to, rows)`` of the cache); it returns the ``then`` of a call chained on that very outcome, which moves
    the rows in its own graph (the host then copies nothing), or None: the chained call is dropped
    (``CallQueue.read``) and the host moves the rows."""
    # Accept rule: a draft stands iff it equals pick(u, teacher logits) at its position (or, under an opt-in
    # lenient rule, its row finds it likely enough); the first row that does not accept its draft emits its exact
    # token. Under the exact rule every emitted token is the autoregressive one.
    plan, offset, o = call.plan, call.offset, call.out
    n = len(plan.drafts)
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

    # 2. Accept the leading drafts that equal the exact tokens; where the chain stopped, a strand that follows its
    # row and starts with the exact token there takes the path on, token by token, and where that strand stops, a
    # strand that follows its row there, and so on.
    # (the graph counts leading rows that each follow the row before: a strand hung after the chain's last draft
    # continues that count; the host walks strands itself)
    c = min(int(o.accepted.item()), n)
    path, strand = list(range(c + 1)), None  # token rows on the accepted path, the last one emits its exact token
    block = list(plan.drafts[:c])
    if plan.strands:
        line, depth = -1, c  # the line the path is on (-1: the chain) and the drafts on it so far
        copies = []  # (from row, to row, rows) of the cache: each strand's K/V rows that stood, next to the path's
        while True:
            t = exact(path[-1])
            k = next(
                (k for k, st in enumerate(plan.strands) if st.parent == line and st.at == depth and st.tokens[0] == t),
                None,
            )
            if k is None:
                break
            st, row = plan.strands[k], plan.strand_row(k)
            m = 1
            while m < len(st.tokens) and st.tokens[m] == exact(row + m - 1):
                m += 1
            if row != len(path):
                copies.append((offset + row, offset + len(path), m))
            block += list(st.tokens[:m])
            path += list(range(row, row + m))
            strand, line, depth = k, k, st.at + m
        # Compact (the rest is trimmed below), unless the call chained on this outcome moves the rows in its graph
        kept = None
        if strand is not None and on_strand is not None:
            kept = on_strand(strand, len(path) - 1, copies)
            then = 0 if kept is None else kept
        if kept is None:
            for src, dst, m in copies:
                cache.copy_rows(src, dst, m)
    block.append(exact(path[-1]))
    keep = offset + len(path)
    # 3. Trim the cache back to the accepted path: [last, q_1..q_c, strand tokens that stood] stay.
    cache.trim_to(keep + then)
    clock.mark("read+trim")

    def read(a):
        return [] if a is None else a.tolist()

    alts = RunnerUps(read(o.alt), read(o.alt_conf))  # (paired only for the rows a drafter asks for)
    top_l = None if o.top_prob is None else o.top_prob.tolist()
    lps = None
    if o.scored is not None:
        lps = call.hook.read(o.scored, path, block)
    accepted = len(path) - 1
    return CallResult(
        block=block,
        accepted=accepted,
        aux_tokens=read(o.aux_top),
        aux_conf=read(o.aux_conf),
        alts=alts,
        strand=strand,
        aux_top_prob=top_l,
        logprobs=lps,
        resolved=bool(settled),
    )


def ptp_call(sess: DecodeSession, last: int, plan: DraftPlan, i: int, clock=NO_CLOCK) -> CallResult:
    """One fused PTP call: verify ``plan.drafts`` after ``last`` (and ``plan.strands`` beside them: a token
    tree), draft ``plan.branches``, then keep only the accepted path
    in the cache."""
    call = build_call(sess, last, plan, i)
    clock.mark("build")
    return finish_call(sess.cache, call, clock)
