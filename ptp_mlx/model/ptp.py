"""The PTP model: a stock mlx-lm model plus a gated LoRA and a u-embedding (docs/method.md, sections 2-3).

One forward pass takes real token rows followed by auxiliary rows. Auxiliary rows embed a uniform ``u``
instead of a token, carry their own RoPE positions (the auxiliary predicting the token at absolute position
``p`` sits at position ``p - 1``), see only the real context before their window plus their own window
causally, and are the only rows the LoRA touches. The pass is the stock model's own ``__call__`` with the
modules of ``layers.py`` installed, so token rows are exactly the base model and the same pass and KV cache
serve as the exact teacher, in every supported family.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..adapter_config import U_EMBEDDING_KINDS, AdapterConfig
from .fused import FusedGate, FusedLoRA, fuse_projections
from .kv import KVState
from .layers import (
    PROJECTION_ORDER,
    StaticKV,
    UnsupportedModel,
    install,
    language_model,
    linear_dims,
    make_cache,
    projection_modules,
    projections,
    token_embedding,
)
from .shape import CallPlan, Window
from .stock_cache import StockCache

__all__ = ["LoRA", "PTPAdapter", "PTPModel", "UEmbedding", "U_EMBEDDING_KINDS", "Window"]


# The Llama-style projection names: the targets a PyTorch PTP checkpoint can name (``convert/ptp_layout.py`` checks
# against them). Other families name theirs differently (phi3: qkv_proj, gate_up_proj); ``PTPAdapter`` takes whatever
# the model's blocks hold, in ``layers.PROJECTION_ORDER``, of which these are the separate (unfused) ones.
ALL_TARGETS = tuple(n for n in PROJECTION_ORDER if n not in ("qkv_proj", "gate_up_proj"))


class UEmbedding(nn.Module):
    """Embeds a float32 uniform ``u`` into the hidden size (names follow the reference ``u_embed`` module)."""

    def __init__(self, kind: str, hidden: int):
        super().__init__()
        if kind not in U_EMBEDDING_KINDS:
            raise ValueError(f"unknown u-embedding kind {kind!r} (known: {', '.join(U_EMBEDDING_KINDS)})")
        self.kind = kind
        if kind == "binary":
            self.u_adapter = nn.Linear(32, hidden, bias=True)
        else:
            self.embedding = nn.Embedding(3, hidden)

    def __call__(self, u: mx.array) -> mx.array:
        u = u.astype(mx.float32)
        if self.kind == "binary":
            # The 32 bits of u (float32 reinterpreted as int32), most significant first, as 0/1 features.
            bits = mx.right_shift(u.view(mx.int32)[..., None], mx.arange(31, -1, -1, dtype=mx.int32)) & 1
            return self.u_adapter(bits.astype(mx.float32))
        x = 2.0 * u
        i = mx.clip(mx.floor(x), 0, 1).astype(mx.int32)
        frac = (x - i.astype(mx.float32))[..., None]
        return (1.0 - frac) * self.embedding(i) + frac * self.embedding(i + 1)


class LoRA(nn.Module):
    """Low-rank delta ``scale * B(A(x))`` with PEFT orientation: ``A`` is [r, in], ``B`` is [out, r]."""

    def __init__(self, in_dim: int, out_dim: int, rank: int, scale: float):
        super().__init__()
        bound = 1.0 / np.sqrt(in_dim)
        self.A = mx.random.uniform(-bound, bound, (rank, in_dim))
        self.B = mx.zeros((out_dim, rank))
        self.scale = scale

    def __call__(self, x: mx.array, gate: mx.array | None = None) -> mx.array:
        a = x @ self.A.T
        if gate is not None:  # zero rows in rank space: token rows then get an exact zero delta
            a = a * gate
        return self.scale * (a @ self.B.T)


def hidden_size(base) -> int:
    return int(token_embedding(base)(mx.array([[0]])).shape[-1])


class PTPAdapter(nn.Module):
    """Trainable PTP parameters: the u-embedding and one LoRA per targeted projection of each chosen block.

    Keys: ``layers.{i}.{projection}.{A,B}`` and ``u_embed.*`` (the adapter file format).
    """

    def __init__(self, base, rank: int, scale: float, u_embedding: str, targets=None, layers=None):
        super().__init__()
        n_layers = len(base.layers)
        self.layer_ids = list(range(n_layers)) if layers is None else sorted(int(i) for i in layers)
        if any(not 0 <= i < n_layers for i in self.layer_ids):
            raise ValueError(f"LoRA layer ids {self.layer_ids} out of range for a {n_layers}-layer model")
        known = list(projections(base.layers[0]))
        if targets is None:
            targets = known
        unknown = set(targets) - set(known)
        if unknown:
            raise ValueError(f"unknown LoRA target modules {sorted(unknown)} (this model has: {', '.join(known)})")
        self.targets = tuple(t for t in known if t in targets)
        self.u_embed = UEmbedding(u_embedding, hidden_size(base))
        self.layers = []
        for i in range(n_layers):
            if i not in self.layer_ids:
                self.layers.append({})
                continue
            projs = projections(base.layers[i])
            self.layers.append({t: LoRA(*linear_dims(projs[t]), rank, scale) for t in self.targets})


class PTPModel:
    """A stock mlx-lm model (patched in place by ``layers.install``) plus an optional adapter.

    ``pm(tokens, u, windows, cache)`` runs one mixed pass; ``pm.base(...)`` is the plain model and behaves
    exactly as before patching. Unsupported families may still be wrapped without an adapter for plain
    autoregressive decoding (nothing is patched then).
    """

    def __init__(self, base, adapter: PTPAdapter | None = None, adapter_config=None, fuse: bool = False):
        self.base = base
        self.adapter = adapter
        cfg = adapter_config
        self.config: AdapterConfig = cfg if isinstance(cfg, AdapterConfig) else AdapterConfig.from_dict(cfg or {})
        self.args = language_model(base).args
        try:
            self.ctx = install(base)
        except UnsupportedModel:
            if adapter is not None:
                raise
            self.ctx = None  # plain autoregressive decoding only, with the stock caches
        self._fused = None
        # The model's activation dtype (fixed-shape calls build their additive masks in it).
        self.dtype = None if self.ctx is None else token_embedding(base)(mx.array([0])).dtype
        self._grouped = False  # projections fused with the adapter's A (model/fused.py)
        if fuse and self.ctx is not None:  # inference only: fused copies do not follow later weight updates
            # (with no adapter too: a plain pass's groups are one node each, and a layer one (model/block.py))
            blocks = [projection_modules(layer) for layer in base.layers]
            self._grouped = fuse_projections(blocks, adapter, self.dtype, id(self))
            if not self._grouped and adapter is not None:  # a quantized base: stacked LoRA matmuls beside the base ones
                self._fused = FusedLoRA(adapter, self.dtype)

    def lora_matrices(self) -> list[mx.array]:
        """Each fused group's adapter ``A`` rows (views of the group's matrix, held at ``fused.LORA_STORAGE``
        precision on the CPU), for ptp-sgemm to read at that precision (``kernels/packed.pack_halves``)."""
        groups = {}
        for layer in self.base.layers if self._grouped else ():
            for mods in projection_modules(layer):
                for m in mods.values():
                    g = getattr(m, "group", None)
                    if g is not None and g.gated is not None and g.W.shape[0] > g.out:
                        groups[id(g)] = g
        return [g.W[g.out :] for g in groups.values()]

    def lora_for(self, gate: mx.array | None, adapter: PTPAdapter | None = None):
        """The ``lora(key, x)`` callable of one pass with this row gate (the fused form for the model's own
        adapter when it has one)."""
        adapter = adapter or self.adapter
        if self._fused is not None and adapter is self.adapter:
            return self._fused.bind(gate)

        def lora(key, x, layers=adapter.layers):
            mod = layers[key[0]].get(key[1])
            return None if mod is None else mod(x, gate).astype(x.dtype)

        return FusedGate(gate, id(self), lora) if self._grouped and adapter is self.adapter else lora

    def make_cache(self) -> KVState | StockCache:
        """A fresh cache: the PTP ``KVState``, or mlx-lm's own caches (``StockCache``) for a model PTP does not
        patch; both answer ``offset``, ``can_trim_to`` and ``trim_to``."""
        if self.ctx is None:
            return StockCache.for_model(self.base)
        return make_cache(self.base, self.ctx)

    def __call__(
        self,
        tokens: mx.array,
        u: mx.array | None = None,
        windows: list[Window] | None = None,
        cache=None,
        adapter: PTPAdapter | None = None,
        parents: list[int] | None = None,
    ) -> mx.array:
        """Logits [rows, vocab] for ``tokens`` (1-D) followed by the auxiliaries of ``windows``.

        ``u`` holds one uniform per auxiliary row, in window order. ``parents`` makes the token rows a tree
        (``shape.CallPlan``; default a chain). The cache (from ``make_cache``) receives every row; callers trim
        (and, after a tree, compact) what was not accepted.
        """
        windows = list(windows or [])
        if cache is None:
            cache = self.make_cache()
        tree = parents is not None and list(parents) != list(range(-1, len(parents) - 1))
        if not windows and not tree:
            return self.base(tokens[None], cache=cache)[0]
        if self.ctx is None or not (isinstance(cache, KVState) or all(isinstance(c, StaticKV) for c in cache)):
            raise ValueError("auxiliary rows and token trees need the caches of PTPModel.make_cache()")
        n_tok = int(tokens.shape[0])
        plan = CallPlan.of_windows(cache[0].offset, n_tok, windows, parents)
        aux, lora = None, None  # a tree of token rows alone: the plan's mask and positions, no adapter
        if windows:
            adapter = adapter or self.adapter
            if adapter is None:
                raise ValueError("auxiliary rows need a PTP adapter")
            aux = adapter.u_embed(u)[None]
            # Gate: the LoRA delta is multiplied by 0 on token rows and 1 on auxiliary rows (in rank space).
            # Adding an exact zero leaves token rows bit-identical to the base model.
            lora = self.lora_for(plan.shape.gate(), adapter)

        self.ctx.begin(plan, aux, lora)
        try:
            return self.base(tokens[None], cache=cache)[0]
        finally:
            self.ctx.end()
