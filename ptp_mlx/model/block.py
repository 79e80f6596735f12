"""A decoder layer of a fixed-shape pass as one primitive on MLX's CPU backend (``kernels/block.cpp``).

Why: a plain step of the default model was 449 computing nodes (15 a layer: four projection groups, two norms, two
RoPEs, two K/V writes, two adds, attention, SwiGLU), and on the CPU every node costs a few microseconds to replay
and again to dispatch on the stream thread: about a third of a step. In a fixed-shape pass (``decode/fixed.py``:
the compiled plain steps and PTP calls) over our K/V state, a llama-style layer is one node here instead.

The layer keeps its family's module path everywhere else (prefill, mlx-lm's own caches, training, other devices,
other families), and the primitive runs the kernels the per-op primitives run on the same values in the same order,
so a layer computed either way has the same bits (``tests/test_block.py``). It applies only where every per-op
primitive it stands for would run: float32, the extension built, none of them switched off; ``PTP_MLX_BLOCK=0``
keeps the per-op graph.

A layer qualifies by its structure, checked once: llama's (and so mistral's), qwen2's and qwen3's
``TransformerBlock`` (pre-norm RMS norms, qwen3's per-head q and k norms, q|k|v and gate|up fused groups, a table
RoPE, SwiGLU). Its class is swapped for a subclass whose call tries the primitive first (the module tree, its
parameters and every other call stay as they were).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from .cpu_math import fused_op
from .fused import FusedGate
from .kv import LayerKV
from .rope import table_for, uses_table
from .shape import PassKind

# mlx-lm modules whose TransformerBlock is x + attn(norm(x)), then + mlp(norm(.)), with llama's attention and MLP.
_FAMILIES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")
_PER_OP = ("attention", "swiglu", "rms_norm", "rope_table", "linear")  # the primitives a block stands for
_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)))
_GROUPS += (("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))
_SUBCLASSES: dict[type, type] = {}


def qualifies(layer: nn.Module) -> bool:
    """Whether ``layer`` has the structure ``kernels/block.cpp`` computes."""
    cls = type(layer)
    if cls.__name__ != "TransformerBlock" or cls.__module__ not in _FAMILIES:
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if attn is None or mlp is None or any(type(n) is not nn.RMSNorm for n in norms):
        return False
    if type(mlp).__name__ != "MLP":  # (a sliding-window layer gets its window in the mask it is handed)
        return False
    qk = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]  # qwen3's per-head norms, both or neither
    if any(n is not None and type(n) is not nn.RMSNorm for n in qk) or (qk[0] is None) != (qk[1] is None):
        return False
    return all(
        hasattr(p, n)
        for p, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj")))
        for n in names
    )


@functools.cache
def _placeholder() -> mx.array:
    """An evaluated array for the slots a layer does not use (its gate without a LoRA, its q and k norms outside
    qwen3): the primitive holds it, as it holds evaluated weights, so it adds nothing to the call's graph."""
    a = mx.zeros((1,), dtype=mx.float32)
    mx.eval(a)  # sync: once per process, so that the primitive can hold it
    return a


def _primitive():
    """The extension's ``block``, or None where it or any per-op primitive it stands for is off (its bits are
    theirs)."""
    fn = fused_op("block")
    return None if fn is None or any(fused_op(n) is None for n in _PER_OP) else fn


def block_layers(model) -> int:
    """How many of ``model``'s layers a fixed pass computes as one primitive here (0 where the primitive is off):
    part of the cost curve's key."""
    if _primitive() is None:
        return 0
    return sum(bool(getattr(type(layer), "_ptp_block", False)) for layer in model.layers)


def install(layers) -> None:
    """Give every qualifying layer the one-primitive path (idempotent)."""
    for layer in layers:
        cls = type(layer)
        if getattr(cls, "_ptp_block", False) or not qualifies(layer):
            continue
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"__call__": _call_for(cls), "_ptp_block": True})
        layer.__class__ = _SUBCLASSES[cls]


def _call_for(stock: type):
    """The subclass's call: the primitive where it applies, else the family's own ``stock`` call."""

    def __call__(self, x, mask=None, cache=None):
        out = layer_block(self, x, mask, cache)
        return out if out is not None else stock.__call__(self, x, mask, cache)

    return __call__


def _groups(layer) -> list | None:
    """The layer's four fused groups, or None where its projections are not fused that way."""
    found = []
    for parent, names in _GROUPS:
        g = getattr(getattr(getattr(layer, parent), names[0]), "group", None)
        if g is None or g.names != names or not g.plain:
            return None
        found.append(g)
    return found


def layer_block(layer, x: mx.array, mask, cache) -> mx.array | None:
    """The layer's output as one primitive, writing its K/V rows into ``cache``'s state; None where the layer takes
    its module path (not a fixed pass over our state, another dtype, a LoRA form the primitive does not run)."""
    if not isinstance(cache, LayerKV) or not isinstance(mask, mx.array) or x.dtype != mx.float32:
        return None
    if mask.dtype not in (mx.float32, mx.bool_):
        return None
    st = cache._state
    p, attn = st.pass_, layer.self_attn
    ctx = getattr(attn.rope, "_ctx", None)
    plan = None if ctx is None else ctx.plan
    if p is None or plan is None or plan.kind is not PassKind.FIXED or x.ndim != 3 or x.shape[0] != 1:
        return None
    rope = attn.rope.rope
    fn = _primitive()
    if fn is None or not uses_table(rope):
        return None
    groups = _groups(layer)
    lora = ctx.lora
    if groups is None or (lora is not None and not isinstance(lora, FusedGate)):
        return None
    gated = lora is not None
    if gated and any(g.owner != lora.owner or (g.B is not None and g.gated is None) for g in groups):
        return None  # another adapter's groups, or a LoRA the per-op path runs as a graph: keep that path
    rows = x.shape[1]
    gate = _placeholder()
    if gated:
        gate = lora.gate if lora.gate is not None else mx.ones((rows,))
    i = cache._i
    cos, sin = table_for(rope, plan.positions, plan.tables, x.dtype)
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    kv_heads, q_heads = attn.n_kv_heads, attn.n_heads
    head = groups[0].outs[1] // kv_heads
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if qn is not None and (qn.eps != kn.eps or qn.weight.dtype != mx.float32 or kn.weight.dtype != mx.float32):
        return None
    arrays = [x, st.keys[i], st.values[i], p.start, cos, sin, mask, n1.weight, n2.weight, gate]
    arrays += [_placeholder()] * 2 if qn is None else [qn.weight, kn.weight]
    ints = [q_heads, kv_heads, head, rope.dims, int(rope.traditional), p.bucket, int(qn is not None)]
    for g in groups:
        with_lora = gated and g.B is not None
        arrays.append(g.W)
        if g.bias is not None:
            arrays.append(g.bias)
        if with_lora:
            arrays += [g.B16, g.spans]
        ints += [g.out, g.B16.shape[0] if with_lora else 0, int(g.bias is not None)]
    floats = [float(n1.eps), float(n2.eps), float(attn.scale), float(qn.eps) if qn is not None else 0.0]
    out, st.keys[i], st.values[i] = fn(arrays, ints, floats)
    return out
