"""PTP on the stock mlx-lm model: modules patched in place, so every family keeps its own forward pass.

A PTP pass (docs/method.md, sections 2-3) differs from a plain pass in four places, and each is a small module
installed into the stock model object (as mlx-lm's tuner installs its LoRA layers):

- ``TokenEmbedding`` wraps ``embed_tokens``: auxiliary rows (the u-embedding) enter after the token rows, as input
  embeddings, so family-specific embedding scaling applies to both;
- ``GatedLoRALinear`` wraps every linear projection of attention and MLP: it adds the active adapter's low-rank
  delta on auxiliary rows only (a 0/1 row gate), so token rows stay bit-identical to the base model;
- ``RowRoPE`` wraps each attention's rope: every row gets its own position (an auxiliary predicting the token at
  ``p`` sits at ``p - 1``), applied per contiguous segment with the family's own RoPE variant;
- the layer caches are views of one ``model.kv.KVState``: their ``make_mask`` hands the window mask (plus the
  sliding window, where the model asks for one) to attention through mlx-lm's own mask path; always trimmable.

With no PTP call in progress (``PTPContext.plan`` is None) every wrapper is a pass-through, so autoregressive
decoding and PTP verify rows run exactly the same code: the family's own attention, norms, MLP, RoPE variant,
embedding scaling, soft-capping and tied or untied head.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from ..errors import UserError
from . import block, cpu_math
from .fused import FusedGate
from .kv import KVState, in_our_pass, mark_pass
from .rope import table_rope, uses_table
from .shape import CallPlan, FixedPlan, PassKind

# Families whose PTP pass is verified token for token against autoregressive decoding by the test suite
# (tests/test_families.py). mlx-lm maps "mistral" onto its llama module.
SUPPORTED_MODEL_TYPES = ("gemma3", "gemma3_text", "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3")


class UnsupportedModel(UserError):
    """The model cannot run PTP decoding (its family or cache kind is not verified): exit code 2."""


def check_model_type(model_type: str | None) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported for PTP (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
            "use --mode ar to decode it without PTP"
        )


class PTPContext:
    """What the installed modules read during one PTP call; inactive (all pass-through) otherwise."""

    def __init__(self):
        self.plan: CallPlan | FixedPlan | None = None  # (or training's BatchPlan: ``shape.PassKind``)
        self.aux: mx.array | None = None  # [1, n_aux, hidden] u-embedding rows
        # lora(key, x) -> delta or None; None when no LoRA runs in this call
        self.lora: Callable[[tuple[int, str], mx.array], mx.array | None] | None = None

    def begin(self, plan: CallPlan | FixedPlan, aux: mx.array | None, lora) -> None:
        if self.plan is not None:
            raise RuntimeError("a PTP call is already in progress on this model")
        self.plan, self.aux, self.lora = plan, aux, lora

    def end(self) -> None:
        self.plan, self.aux, self.lora = None, None, None


class TokenEmbedding(nn.Module):
    """``embed_tokens`` with the call's auxiliary rows appended after the token rows."""

    def __init__(self, embedding: nn.Module, ctx: PTPContext):
        super().__init__()
        self.embedding = embedding
        self._ctx = ctx

    def __call__(self, ids: mx.array) -> mx.array:
        mark_pass(False)  # every pass starts here; one over our K/V state says so next (``LayerKV.make_mask``)
        aux = self._ctx.aux
        if aux is not None and ids.size == 0:  # auxiliary rows only (training); quantized lookups reject empty ids
            e = self.embedding
            return aux.astype(e.scales.dtype if hasattr(e, "scales") else e.weight.dtype)
        h = self.embedding(ids)
        if aux is None:
            return h
        return mx.concatenate([h, aux.astype(h.dtype)], axis=1)

    def as_linear(self, x: mx.array) -> mx.array:
        w = getattr(self.embedding, "weight", None)
        if type(self.embedding) is nn.Embedding and w.dtype == x.dtype == mx.float32 and in_our_pass():
            linear = cpu_math.fused_op("linear")  # the tied head as one node (kernels/linear.cpp), MLX's very product
            if linear is not None:
                return linear(x, w, [w.shape[0]])[0]
        return self.embedding.as_linear(x)


class GatedLoRALinear(nn.Module):
    """A base linear layer (float or quantized) plus the active adapter's delta on auxiliary rows only.

    The LoRA weights live in the adapter (``ptp_model.PTPAdapter``), not here, so one base model serves several
    adapters (an inference copy and a training copy, or two adapters under test) without being re-patched.
    """

    def __init__(self, linear: nn.Module, ctx: PTPContext, key: tuple[int, str]):
        super().__init__()
        self.linear = linear
        self._ctx = ctx
        self._key = key
        self.group = None  # a ``model.fused.FusedGroup`` once the projections are fused with an adapter

    def __call__(self, x: mx.array) -> mx.array:
        lora, group = self._ctx.lora, self.group
        if isinstance(lora, FusedGate):  # a fused adapter's pass: its groups add the delta in the same matmul
            if group is not None and lora.owner == group.owner:
                return group(self._key[1], x, lora)
            lora = lora.fallback
        y = self.linear(x) if group is None else group(self._key[1], x, None)
        if lora is None:
            return y
        d = lora(self._key, x)
        return y if d is None else y + d.astype(y.dtype)


# RoPE modules whose ``__call__`` hands ``offset`` straight to ``mx.fast.rope`` (which takes one offset per batch
# entry): for them every row can get its own position in one call. Others (e.g. dynamic NTK, whose base depends
# on the offset) are applied per contiguous segment of rows.
_BATCHED_ROPE = ("RoPE", "Llama3RoPE", "SuScaledRoPE", "YarnRoPE")


class RowRoPE(nn.Module):
    """The module's own RoPE applied to every row at its position in the call (token rows get exactly the
    values a plain pass gives them: same kernel, same integer positions)."""

    def __init__(self, rope: nn.Module, ctx: PTPContext):
        super().__init__()
        self.rope = rope
        self._ctx = ctx
        self._batched = type(rope).__name__ in _BATCHED_ROPE

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        plan = self._ctx.plan
        if plan is None:
            return self.rope(x, offset=offset)
        if plan.kind is PassKind.BATCHED:  # training: many sequences, one position per row of each
            if not self._batched:
                raise UnsupportedModel(
                    f"{type(self.rope).__name__} takes one offset per call: train one sequence a pass"
                )
            B, H, R, D = x.shape
            y = self.rope(x.transpose(0, 2, 1, 3).reshape(B * R, H, 1, D), offset=plan.positions)
            return y.reshape(B, R, H, D).transpose(0, 2, 1, 3)
        if plan.kind is PassKind.FIXED:  # a fixed-shape call (decode/fixed.py): positions are an array
            if not self._batched:
                raise UnsupportedModel(f"{type(self.rope).__name__} takes one offset per call: no fixed-shape call")
            if uses_table(self.rope):  # MLX's CPU backend: one cos/sin table per call for every layer
                return table_rope(self.rope, x, plan.positions, plan.tables)
            return mx.swapaxes(self.rope(mx.swapaxes(x, 0, 2), offset=plan.positions), 0, 2)
        segs = plan.segments
        if len(segs) == 1:
            return self.rope(x, offset=segs[0][2])
        if self._batched and x.shape[0] == 1:
            # Rows as batch entries: [1, H, L, D] -> [L, H, 1, D], one offset per row; one kernel call per
            # layer instead of one per segment (graph building is host time every call pays).
            return mx.swapaxes(self.rope(mx.swapaxes(x, 0, 2), offset=plan.positions), 0, 2)
        return mx.concatenate([self.rope(x[:, :, s:e], offset=p) for s, e, p in segs], axis=2)


class StaticKV:
    """A teacher's K/V as constants (training): the student's auxiliary K/V are appended without mutating them;
    the mask is the training plan's."""

    def __init__(self, ctx: PTPContext, keys: mx.array, values: mx.array):
        self._ctx = ctx
        self.keys, self.values, self.offset = keys, values, keys.shape[2]

    def update_and_fetch(self, k: mx.array, v: mx.array):
        return mx.concatenate([self.keys, k], axis=2), mx.concatenate([self.values, v], axis=2)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        return self._ctx.plan.mask(window_size)


# Canonical order of projection names in adapter configs; other names follow alphabetically.
PROJECTION_ORDER = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj")
PROJECTION_ORDER += ("down_proj",)


def batched_rope(model: nn.Module) -> bool:
    """Whether every layer's RoPE takes one offset per row (needed to train many sequences in one pass)."""
    return all(
        type(getattr(r, "rope", r)).__name__ in _BATCHED_ROPE for r in (lay.self_attn.rope for lay in model.layers)
    )


def language_model(model: nn.Module) -> nn.Module:
    """The text model inside a multimodal wrapper (gemma3), or the model itself."""
    return getattr(model, "language_model", None) or model


def model_type(model: nn.Module) -> str | None:
    return getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)


def token_embedding(model: nn.Module) -> nn.Module:
    """The base token embedding module (unwrapped)."""
    e = language_model(model).model.embed_tokens
    return e.embedding if isinstance(e, TokenEmbedding) else e


def projections(layer: nn.Module) -> dict[str, nn.Module]:
    """The linear projections of one decoder block (attention, then MLP), by name, unwrapped."""
    found: dict[str, nn.Module] = {}
    for parent in (layer.self_attn, layer.mlp):
        for name, mod in parent.children().items():
            if isinstance(mod, GatedLoRALinear):
                mod = mod.linear
            if isinstance(mod, (nn.Linear, nn.QuantizedLinear)):
                if name in found:
                    raise UnsupportedModel(f"projection name {name!r} appears twice in one block")
                found[name] = mod
    rank = {n: i for i, n in enumerate(PROJECTION_ORDER)}
    return dict(sorted(found.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def weight_matrices(model: nn.Module) -> list[mx.array]:
    """The weight matrices a pass multiplies by: every block's projections (views of a fused group come out one
    by one), the head and the tied embedding (``kernels/packed.py`` registers their codes)."""
    found = []
    for layer in model.layers:
        if hasattr(layer, "self_attn") and hasattr(layer, "mlp"):
            found += [m.weight for m in projections(layer).values() if type(m) is nn.Linear]
    lm = language_model(model)
    head = getattr(lm, "lm_head", None)
    if type(head) is nn.Linear:
        found.append(head.weight)
    emb = token_embedding(model) if hasattr(getattr(lm, "model", None), "embed_tokens") else None
    if type(emb) is nn.Embedding:
        found.append(emb.weight)
    return found


def projection_modules(layer: nn.Module) -> list[dict[str, GatedLoRALinear]]:
    """The patched projections of one block: the attention's, then the MLP's, by name."""
    parents = (layer.self_attn, layer.mlp)
    return [{n: m for n, m in p.children().items() if isinstance(m, GatedLoRALinear)} for p in parents]


def linear_dims(mod: nn.Module) -> tuple[int, int]:
    """(input, output) features of a linear layer, quantized or not."""
    w = mod.weight
    bits = getattr(mod, "bits", None)
    return (w.shape[1] * 32 // bits if bits else w.shape[1]), w.shape[0]


def install(model: nn.Module) -> PTPContext:
    """Patch ``model`` in place for PTP (idempotent) and return its context. Refuses unverified families."""
    ctx = getattr(model, "_ptp_ctx", None)
    if ctx is not None:
        return ctx
    check_model_type(model_type(model))
    ctx = PTPContext()
    inner = language_model(model).model
    inner.embed_tokens = TokenEmbedding(inner.embed_tokens, ctx)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        attn.rope = RowRoPE(attn.rope, ctx)
        for parent in (attn, layer.mlp):
            for name, mod in list(parent.children().items()):
                if isinstance(mod, (nn.Linear, nn.QuantizedLinear)):
                    setattr(parent, name, GatedLoRALinear(mod, ctx, (i, name)))
    cpu_math.install(model.layers)  # attention and SwiGLU over our K/V state with a fast exp on the CPU
    block.install(model.layers)  # a fixed pass's llama-style layer as one primitive on the CPU (model/block.py)
    object.__setattr__(model, "_ptp_ctx", ctx)  # a plain attribute, not a module parameter
    return ctx


def make_cache(model: nn.Module, ctx: PTPContext) -> KVState:
    """The model's K/V state (``model/kv.py``; sliding-window layers keep every row, the window applied by the
    mask); refuses cache kinds PTP cannot rewind (SSM state, chunked, ...)."""
    for c in make_prompt_cache(model):
        if type(c) not in (KVCache, RotatingKVCache):
            raise UnsupportedModel(f"model type {model_type(model)!r} uses a {type(c).__name__}, which PTP cannot trim")
    return KVState(len(model.layers), ctx)
