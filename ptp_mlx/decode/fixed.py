"""The fixed-shape call: one pure function of arrays per ``CallShape``, run eagerly or under ``mx.compile``.

A call's graph depends only on its shape, the attention bucket (``model.kv.round_up``: keys read, a multiple of 256)
and the sampling settings; everything that changes from call to call is an input array: the token ids, the
uniforms, the cache offset (int32) and the K/V buffers. So one traced graph serves every call of that shape and
bucket, and ``mx.compile`` replays it in C++ without running Python per operation (docs/method.md, section 5,
"Compiled calls"). Positions, the u-embedding, the mask and the accepted count are computed in the graph. The eager
call is the same function, not compiled: the reference the compiled one is tested against.

The autoregressive step is the same idea with one token row (``ar_step``).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache, partial

import mlx.core as mx
import numpy as np

from ..model import cpu_math
from ..model.block import block_layers
from ..model.kv import FixedPass, KVState, kv_shapes, round_up
from ..model.shape import CallShape, FixedPlan
from ..sampler import SamplingSettings, may_leave_unresolved, pick_with
from .shape import CallInputs, CallOutputs, CallSpec


@lru_cache(maxsize=1024)
def topology(shape: CallShape) -> tuple[mx.array, mx.array]:
    """A shape's ``block`` (bool [rows, rows]: which of the call's rows each row sees) and ``rel_pos`` (int32 [rows])
    as the arrays its graph takes: inputs, not constants, so every shape with the same ``graph_key`` (row counts)
    shares one compiled graph, whatever its tree and windows."""
    return mx.array(shape.block), mx.array(shape.rel_pos)


def _mask_fn(
    block: mx.array, rel_pos: mx.array, offset: mx.array, bucket: int, dtype
) -> Callable[[int | None], mx.array]:
    """Additive masks [rows, bucket] for the call, built in the graph from the offset and the shape's ``block`` and
    ``rel_pos`` (``topology``)."""
    rows = block.shape[0]
    col = mx.arange(bucket, dtype=mx.int32)
    rel = col - offset
    inside = (rel >= 0) & (rel < rows)
    relc = mx.clip(rel, 0, rows - 1)
    sees = mx.where(inside[None], mx.take(block, relc, axis=1), (col < offset)[None])
    memo: dict[int | None, mx.array] = {}

    def mask_for(window_size: int | None) -> mx.array:
        if window_size not in memo:
            m = sees
            if window_size is not None:  # sliding window: keys within that many positions of the row's own
                col_pos = mx.where(inside, offset + mx.take(rel_pos, relc), col)
                m = m & (col_pos[None] > (offset + rel_pos)[:, None] - window_size)
            memo[window_size] = mx.where(m, mx.array(0, dtype), mx.array(-np.inf, dtype))
        return memo[window_size]

    return mask_for


def outputs_head(spec: CallSpec, logits: mx.array, inputs: CallInputs) -> CallOutputs:
    """Exact picks, the accepted count and the auxiliary rows' drafts from a call's logits [rows, vocab]. With a
    logits ``hook`` (eager calls), row ``j``'s logits are processed counting ``prefixes[j]`` (the drafts before it).
    ``offered``: bool [vocab], the context's tokens (a ``guarded`` rule's)."""
    shape, s, rule, tokens, hook = spec.shape, spec.settings, spec.rule, inputs.tokens, inputs.hook
    n_tok, n = shape.n_tok, shape.n_drafts
    rows = logits[:n_tok]
    if hook is not None:  # penalties and logit_bias: a row counts the drafts before it (ptp_mlx/logits.py)
        rows = hook.rows(rows, inputs.prefixes)
    # (fast: a row the likeliest tokens cannot settle reads UNRESOLVED, and ``finish_call`` resolves the one it
    # emits from ``target_logits``; under a hook the rows' scores need the exact token in the graph)
    fast = hook is None
    targets = pick_with(inputs.row_u, rows, s, check=False, fast=fast)
    # Accepted: the leading drafts equal to the exact token at their position (docs/method.md, section 4).
    # Under a lenient ``rule`` a draft also stands when its verifying row finds it likely enough (decode/accept.py).
    ok = tokens[1 : n + 1] == targets[:n] if n else None
    if n and rule.lenient:  # (the exact rule adds nothing to the graph)
        ok = ok | rule.accepts(rows[:n], tokens[1 : n + 1], s.temperature, targets[:n], inputs.offered, tokens[:n])
    accepted = mx.sum(mx.cumprod(ok.astype(mx.int32))) if n else mx.array(0)
    out = CallOutputs(targets=targets, accepted=accepted.astype(mx.int32))
    if fast and may_leave_unresolved(s, rows.shape[-1]):
        out.target_logits = rows
    if hook is not None:
        out.scored = hook.score(rows, targets)
    if shape.windows:
        aux = logits[n_tok:].astype(mx.float32)
        head = cpu_math.fused_op("aux_head")
        if head is not None:  # one node on the CPU (kernels/heads.cpp): the same reads, ties to the lower id
            inv_t = 1.0 / s.temperature if shape.reads_top_prob else 0.0
            out.aux_top, out.aux_conf, alt, alt_conf, top_prob = head(aux, ALTS if shape.runner_up else 0, inv_t)
            if shape.reads_top_prob:
                out.top_prob = top_prob
            if shape.runner_up:
                out.alt, out.alt_conf = alt, alt_conf
            return out
        top = mx.argmax(aux, axis=-1)
        best = mx.max(aux, axis=-1)
        # (the drafts' confidences only price rows: the CPU's exp is dear, the fused one is close enough)
        logsumexp = cpu_math.logsumexp if cpu_math.enabled() else mx.logsumexp
        lse = logsumexp(aux, axis=-1)
        out.aux_top, out.aux_conf = top, mx.exp(best - lse)
        if shape.reads_top_prob:  # the adapter's top probability at the sampler's temperature
            t = s.temperature
            out.top_prob = mx.exp(best / t - logsumexp(aux / t, axis=-1))
        if shape.runner_up:
            alt, alt_logit = runner_ups(aux, top)
            out.alt, out.alt_conf = alt, mx.exp(alt_logit - lse[:, None])
    return out


ALTS = 3  # runner-ups each auxiliary row returns (a token tree's candidates: docs/method.md, section 5)
_BLOCK = 128  # vocabulary block of the runner-ups' search


def runner_ups(aux: mx.array, top: mx.array) -> tuple[mx.array, mx.array]:
    """Each row's ``ALTS`` likeliest tokens after ``top`` (its argmax), best first, and their logits: int32 and
    float32 [rows, ALTS]. One pass over the vocabulary (block maxima), then a search inside the ``ALTS + 1`` best
    blocks, which hold the row's ``ALTS + 1`` largest logits: a third of the cost of masking and re-reducing
    the whole row per runner-up on the CPU."""
    k, b = ALTS + 1, _BLOCK
    n, vocab = aux.shape
    nb = -(-vocab // b)
    if nb * b != vocab:
        aux = mx.concatenate([aux, mx.full((n, nb * b - vocab), -mx.inf, dtype=aux.dtype)], axis=-1)
    blocks, kb = aux.reshape(n, nb, b), min(k, nb)
    best = mx.argpartition(-mx.max(blocks, axis=-1), kb - 1, axis=-1)[:, :kb]  # [n, kb] the blocks to search
    cand = mx.take_along_axis(blocks, best[:, :, None], axis=1).reshape(n, kb * b)
    ids = (best[:, :, None] * b + mx.arange(b, dtype=best.dtype)[None, None]).reshape(n, kb * b)
    cand = mx.where(ids == top[:, None], -mx.inf, cand)  # the argmax is the chain's draft, not a runner-up
    pick = mx.argpartition(-cand, k - 1, axis=-1)[:, :k]
    order = mx.argsort(-mx.take_along_axis(cand, pick, axis=-1), axis=-1)[:, :ALTS]
    pick = mx.take_along_axis(pick, order, axis=-1)
    return mx.take_along_axis(ids, pick, axis=-1).astype(mx.int32), mx.take_along_axis(cand, pick, axis=-1)


def graph_args(spec: CallSpec, inputs: CallInputs, offset: mx.array) -> list[mx.array]:
    """The arrays ``call_graph`` takes before the K/V buffers: ``tokens``, ``row_u``, ``aux_u``, ``offset`` (int32
    []), the shape's ``block`` and ``rel_pos`` (``topology``) and, under a ``guarded`` rule, ``offered``."""
    block, rel_pos = topology(spec.shape)
    guarded = [inputs.offered] if spec.rule.guarded else []
    move = [inputs.move_src, inputs.move_dst] if spec.move else []
    return [inputs.tokens, inputs.row_u, inputs.aux_u, offset, block, rel_pos, *guarded, *move]


def call_graph(pm, spec: CallSpec, bucket: int, *arrays: mx.array) -> tuple[mx.array, ...]:
    """One PTP call as a pure function of arrays: those of ``graph_args`` (``tokens`` int32 [n_tok], ``row_u``
    float32 [n_tok], ``aux_u`` float32 [n_aux], ``offset`` int32 [], ``block`` bool [rows, rows], ``rel_pos`` int32
    [rows], under a ``guarded`` rule ``offered``, bool [vocab]), then the K/V buffers (keys of every layer, then
    values). Returns the outputs' arrays (``_OUT_FIELDS`` order, the ones the shape wants) followed by the written
    buffers. Only ``spec.shape.graph_key`` fixes the graph: the rows' tree and windows come in ``block`` and
    ``rel_pos``."""
    tokens, row_u, aux_u, offset, block, rel_pos, *kv = arrays
    offered, kv = (kv[0], kv[1:]) if spec.rule.guarded else (None, kv)
    if spec.move:  # a strand's rows that stood move next to the chain's, before the pass reads them
        src, dst, kv = kv[0], kv[1], kv[2:]
        kv = [move_rows(b, src, dst) for b in kv]
    inputs = CallInputs(tokens, row_u, aux_u, offset=offset, offered=offered)
    out, st = _call(pm, spec, bucket, inputs, kv, (block, rel_pos))
    return (*_pack(out), *st.keys, *st.values)


def move_rows(buf: mx.array, src: mx.array, dst: mx.array) -> mx.array:
    """A K/V buffer ([batch, heads, rows, dim]) with its rows ``src`` (int32 [n]) written at ``dst`` on (int32 []):
    read before any is written (the rows may overlap), as ``KVState.copy_rows`` does on the host."""
    return mx.slice_update(buf, mx.take(buf, src, axis=2), dst.reshape(1), axes=(2,))


def _call(pm, spec: CallSpec, bucket: int, inputs: CallInputs, kv, topo=None) -> tuple[CallOutputs, KVState]:
    """The call's graph at ``inputs.offset`` (an int32 array) over the K/V buffers ``kv`` (keys, then values);
    ``topo``: the shape's ``(block, rel_pos)`` arrays (default ``topology(spec.shape)``)."""
    shape, offset, L = spec.shape, inputs.offset, len(kv) // 2
    block, rel_pos = topo if topo is not None else topology(shape)
    p = FixedPass(offset, bucket, _mask_fn(block, rel_pos, offset, bucket, pm.dtype))
    st = KVState.traced(kv[:L], kv[L:], p)
    positions = offset + rel_pos
    aux = pm.adapter.u_embed(inputs.aux_u)[None] if shape.windows else None
    lora = pm.lora_for(shape.gate()) if shape.windows else None
    pm.ctx.begin(FixedPlan(positions), aux, lora)
    try:
        logits = pm.base(inputs.tokens[None], cache=st)[0]
    finally:
        pm.ctx.end()
    return outputs_head(spec, logits, inputs), st


_OUT_FIELDS = ("targets", "accepted", "aux_top", "aux_conf", "alt", "alt_conf", "top_prob", "target_logits")


def _pack(out: CallOutputs) -> list[mx.array]:
    return [getattr(out, f) for f in _OUT_FIELDS if getattr(out, f) is not None]


def _unpack(shape: CallShape, arrays) -> CallOutputs:
    names = ["targets", "accepted"]
    if shape.windows:
        names += ["aux_top", "aux_conf"] + (["top_prob"] if shape.reads_top_prob else [])
        names += ["alt", "alt_conf"] if shape.runner_up else []
    names = [f for f in _OUT_FIELDS if f in names] + (["target_logits"] if len(arrays) > len(names) else [])
    return CallOutputs(**dict(zip(names, arrays, strict=True)))


def ar_graph(pm, bucket: int, s: SamplingSettings, token, u, offset, *kv):
    """One autoregressive step as a pure function: ``token`` int32 [1], ``u`` float32 [1], ``offset`` int32 [] and
    the K/V buffers -> the next token (int32 [1]; ``UNRESOLVED`` where the fast pick cannot settle it), its
    logits [1, vocab] when the settings may leave it unresolved (``resolve`` reads them), and the written
    buffers."""
    logits, st = _ar_logits(pm, bucket, mx.maximum(token, 0), offset, kv)  # (a token fed unresolved: dropped)
    t = pick_with(u, logits, s, check=False, fast=True)
    extra = [logits] if may_leave_unresolved(s, logits.shape[-1]) else []
    return (t, *extra, *st.keys, *st.values)


def _ar_logits(pm, bucket: int, token, offset, kv) -> tuple[mx.array, KVState]:
    L = len(kv) // 2
    p = FixedPass(offset, bucket, _mask_fn(*topology(_AR_SHAPE), offset, bucket, pm.dtype))
    st = KVState.traced(kv[:L], kv[L:], p)
    pm.ctx.begin(FixedPlan(offset.reshape(1)), None, None)  # no auxiliary rows: a plain pass, positions an array
    try:
        return pm.base(token.reshape(1, 1), cache=st)[0], st
    finally:
        pm.ctx.end()


_AR_SHAPE = CallShape((-1,))


def _what(spec: CallSpec) -> tuple:
    """A PTP call's entry key in the bank, the bucket aside: keyed by the shape's row counts (its tree and windows
    are inputs, so shapes alike share one graph), the settings and a lenient rule."""
    key = ("ptp", spec.shape.graph_key, spec.settings) + ((spec.move,) if spec.move else ())
    return key if not spec.rule.lenient else (*key, spec.rule)


class CompileBank:
    """The compiled calls of one model: one entry per (shape, bucket, sampling settings); at most ``limit`` entries
    (the least recently used goes first: a long-lived server meets many settings).

    An entry's first ``compile_after - 1`` calls run the same function eagerly (bit for bit the compiled result), and
    the call that reaches ``compile_after`` traces and compiles it: where tracing costs several eager calls (MLX's
    per-op graph), a shape a one-shot answer meets once is never traced; where a layer is one node (ptp-block on
    the CPU, ``bank_for``) tracing costs about one eager call, and a shape compiles at its first call. A shape
    already compiled for another attention bucket is one that recurs (the context grew past a bucket): it compiles
    at its first call in the new bucket, without the eager call first (about 0.7 plain steps saved per shape each
    time an answer's context crosses a bucket, on this CPU)."""

    def __init__(self, pm, compiled: bool = True, limit: int = 256, compile_after: int = 2):
        self.pm, self.compiled, self.limit, self.compile_after = pm, compiled, limit, compile_after
        self.entries: OrderedDict[tuple, Callable] = OrderedDict()
        self.uses: dict[tuple, int] = {}  # calls of each entry not compiled yet
        self.recurring: set[tuple] = set()  # what entries compile (their key without the bucket), for some bucket
        self.shapes: list | None = None  # per layer one row's K/V shapes (``kv_shapes``), learned once
        # Calls that ran eagerly or traced (a shape not compiled yet): slower than the shape's steady cost, so the
        # budget does not learn costs from them (generate.py reads the count around each call).
        self.cold = 0

    def _fn(self, what: tuple, bucket: int, make: Callable) -> Callable:
        """The entry for ``what`` (the call's kind, shape and settings) at attention ``bucket``; ``make()`` builds its
        function when it has none yet."""
        key = (what, bucket)
        fn = self.entries.get(key)
        if fn is not None:
            self.entries.move_to_end(key)
            return fn
        self.cold += 1
        uses = self.uses.get(key, 0) + 1
        if self.compiled and uses < self.compile_after and what not in self.recurring:
            self.uses[key] = uses
            return make()
        self.uses.pop(key, None)
        fn = mx.compile(make()) if self.compiled else make()
        self.entries[key] = fn
        if len(self.recurring) > 4 * self.limit:  # (a long-lived server meets many settings: forget, stay bounded)
            self.recurring.clear()
        self.recurring.add(what)
        if len(self.entries) > self.limit:
            self.entries.popitem(last=False)
        return fn

    def _prepare(self, state: KVState, rows: int, at: tuple[mx.array, int] | None = None) -> tuple[int, mx.array, int]:
        """The attention bucket, the offset array and the state's offset after the call (``at``: the offset as
        an array the host has not read, with an upper bound for it: the buffers and the bucket hold the bound)."""
        if self.shapes is None:
            self.shapes = kv_shapes(self.pm.base)
        offset, start = (mx.array(state.offset, dtype=mx.int32), state.offset) if at is None else at
        state.reserve(max(0, start + rows - state.offset), self.shapes)
        return round_up(start + rows), offset, start + rows

    def call(self, state: KVState, spec: CallSpec, inputs: CallInputs) -> CallOutputs:
        """Queue one call on ``state`` (nothing is computed yet): the state gains all ``spec.shape.rows`` rows, as
        an eager pass's does; the caller trims back to the accepted path once it has read the outputs. With a
        logits ``inputs.hook`` (row ``j`` processed counting ``inputs.prefixes[j]``), the same function runs
        eagerly: the host decides the processed rows per call. ``inputs.offset``: the call's offset as an int32
        array computed on the device (a chained call, ``decode/pipeline.py``), with its upper bound ``inputs.bound``;
        the state's offset then becomes ``bound + rows`` until the caller trims it."""
        shape = spec.shape
        at = None if inputs.offset is None else (inputs.offset, inputs.bound)
        bucket, offset, end = self._prepare(state, shape.rows, at)
        if inputs.hook is not None:
            if at is not None:
                raise ValueError("a call under a logits hook cannot be chained")
            keys, values = state.take_buffers()
            out, st = _call(self.pm, spec, bucket, replace(inputs, offset=offset), keys + values)
            del keys, values
            state.put_buffers(st.keys, st.values, end)
            return out
        fn = self._fn(_what(spec), bucket, lambda: partial(call_graph, self.pm, spec, bucket))
        keys, values = state.take_buffers()  # the state lets go of the buffers: the call writes them in place
        res = fn(*graph_args(spec, inputs, offset), *keys, *values)
        del keys, values
        L = len(state)
        state.put_buffers(res[-2 * L : -L], res[-L:], end)
        return _unpack(shape, res[: -2 * L])

    def compiled_for(self, spec: CallSpec, end: int) -> bool:
        """Whether a call of ``spec`` that ends at cache row ``end`` runs a graph compiled already (a call built
        only in case it is needed must not count towards compiling, nor run eagerly: ``decode/pipeline.py``)."""
        return (_what(spec), round_up(end)) in self.entries

    def ar_step(self, state: KVState, s: SamplingSettings, token: mx.array, u: mx.array, with_logits: bool = False):
        """Queue one autoregressive step (the state gains ``token``'s row); returns the next token, lazy (it may
        read ``UNRESOLVED``: sampler.py, ``pick(fast=True)``), and with ``with_logits`` also the logits
        [1, vocab] that ``resolve`` settles it from (None where the settings never leave a token unresolved)."""
        bucket, offset, _ = self._prepare(state, 1)
        fn = self._fn(("ar", s), bucket, lambda: partial(ar_graph, self.pm, bucket, s))
        keys, values = state.take_buffers()
        res = fn(token, u, offset, *keys, *values)
        del keys, values
        L = len(state)
        state.put_buffers(res[-2 * L : -L], res[-L:], state.offset + 1)
        if not with_logits:
            return res[0]
        return res[0], (res[1] if len(res) > 2 * L + 1 else None)

    def ar_logits(self, state: KVState, token: mx.array) -> mx.array:
        """The same step's logits [1, vocab], eagerly (a logits hook processes them on the host's terms)."""
        bucket, offset, _ = self._prepare(state, 1)
        keys, values = state.take_buffers()
        logits, st = _ar_logits(self.pm, bucket, token, offset, keys + values)
        del keys, values
        state.put_buffers(st.keys, st.values, state.offset + 1)
        return logits


def compiled_by_default() -> bool:
    """Compiled calls, unless ``PTP_MLX_EAGER=1`` asks for the eager reference everywhere (CI runs the lossless
    tests both ways)."""
    return os.environ.get("PTP_MLX_EAGER", "").lower() not in ("1", "true", "yes")


def bank_for(pm, compiled: bool | None = None) -> CompileBank | None:
    """The model's bank of fixed-shape calls (compiled, or the eager reference), or None where the fixed-shape
    call does not apply: a model PTP does not patch, or a RoPE that takes one offset per call (those stay on the
    eager pass of ``PTPModel.__call__``)."""
    from ..model.layers import batched_rope

    if pm.ctx is None or not batched_rope(pm.base):
        return None
    compiled = compiled_by_default() if compiled is None else compiled
    banks = pm.__dict__.setdefault("_banks", {})
    if compiled not in banks:
        # With ptp-block a new shape's eager call costs about what its tracing does (1.3-2 compiled calls each on
        # this CPU, 2026-12-07): compiling at the first call saves the eager one (held-out prompts, 24 answers: 41
        # calls ran a shape uncompiled instead of 78; 0.997-1.058x in five interleaved A/Bs).
        after = 1 if block_layers(pm.base) else 2
        banks[compiled] = CompileBank(pm, compiled, compile_after=after)
        if compiled:  # (built once per machine, here rather than at the first build let go inside an answer)
            from ..kernels.graph_tools import module as graph_tools

            graph_tools()
    return banks[compiled]
