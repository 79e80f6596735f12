"""The PTP model: an mlx-lm Llama-family model plus a gated LoRA and a u-embedding (method doc 2-3).

One forward pass takes real token rows followed by auxiliary rows. Auxiliary rows embed a uniform ``u``
instead of a token, carry explicit RoPE positions (the auxiliary predicting the token at absolute position
``p`` sits at position ``p - 1``), see only the real context before their window plus their own window
causally, and are the only rows the LoRA touches. Token rows are therefore exactly the base model, and the
same pass and KV cache serve as the exact teacher.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu

U_EMBEDDING_KINDS = ("binary", "linear_interpolation")
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS


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

    def __call__(self, x: mx.array) -> mx.array:
        return self.scale * ((x @ self.A.T) @ self.B.T)


def linear_dims(layer, name: str) -> tuple[int, int]:
    """(in, out) of a base linear layer, quantized or not."""
    mod = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
    out_dim = mod.weight.shape[0]
    in_dim = mod.weight.shape[1] * (32 // mod.bits if hasattr(mod, "bits") else 1)
    return in_dim, out_dim


class PTPAdapter(nn.Module):
    """Trainable PTP parameters: the u-embedding and one LoRA per targeted linear layer."""

    def __init__(self, base, rank: int, scale: float, u_embedding: str, targets=ALL_TARGETS, layers=None):
        super().__init__()
        n_layers = len(base.model.layers)
        self.layer_ids = list(range(n_layers)) if layers is None else sorted(int(i) for i in layers)
        if any(not 0 <= i < n_layers for i in self.layer_ids):
            raise ValueError(f"LoRA layer ids {self.layer_ids} out of range for a {n_layers}-layer model")
        unknown = set(targets) - set(ALL_TARGETS)
        if unknown:
            raise ValueError(f"unknown LoRA target modules {sorted(unknown)} (known: {', '.join(ALL_TARGETS)})")
        self.targets = tuple(t for t in ALL_TARGETS if t in targets)
        self.u_embed = UEmbedding(u_embedding, base.args.hidden_size)
        self.layers = [
            {t: LoRA(*linear_dims(base.model.layers[i], t), rank, scale) for t in self.targets}
            if i in self.layer_ids
            else {}
            for i in range(n_layers)
        ]


# Projections that read the same input: their LoRA ``A`` matrices stack into one matmul when fused.
INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


class FusedLoRA:
    """Inference form of one layer's LoRAs: per input group one stacked ``A`` and one block-diagonal ``B``
    with the scale folded in, so a group costs two matmuls instead of two per projection (decoding on CPU is
    bound by per-op overhead; method doc section 10). Training keeps the plain per-projection modules."""

    def __init__(self, loras: dict[str, LoRA], dtype):
        # Keyed by the full INPUT_GROUPS entry; holds the projections of that group that carry a LoRA.
        self.groups: dict[tuple[str, ...], tuple[tuple[str, ...], mx.array, mx.array, list[int]]] = {}
        for group in INPUT_GROUPS:
            names = tuple(n for n in group if n in loras)
            if not names:
                continue
            A = mx.concatenate([loras[n].A for n in names], axis=0)
            outs = [loras[n].B.shape[0] for n in names]
            ranks = [loras[n].A.shape[0] for n in names]
            B = np.zeros((sum(outs), sum(ranks)), dtype=np.float32)
            o = r = 0
            for n, do, dr in zip(names, outs, ranks, strict=True):
                B[o : o + do, r : r + dr] = np.array(loras[n].B.astype(mx.float32)) * loras[n].scale
                o, r = o + do, r + dr
            splits = list(np.cumsum(outs)[:-1])
            self.groups[group] = (names, A.astype(dtype), mx.array(B).astype(dtype), splits)

    def deltas(self, group: tuple[str, ...], x: mx.array, gate: mx.array | None) -> dict[str, mx.array]:
        entry = self.groups.get(group)
        if entry is None:
            return {}
        names, A, B, splits = entry
        a = x @ A.T
        if gate is not None:  # zero rows in rank space: token rows then get an exact zero delta
            a = a * gate
        full = a @ B.T
        parts = mx.split(full, splits, axis=-1) if splits else [full]
        return dict(zip(names, parts, strict=True))


@dataclass(frozen=True)
class Window:
    """A run of ``n`` auxiliary rows that sees the first ``ctx_len`` real tokens (absolute count).

    Its auxiliary ``j`` predicts the token at absolute position ``ctx_len + j`` and sits at RoPE position
    ``ctx_len + j - 1``.
    """

    ctx_len: int
    n: int


def build_mask(offset: int, n_tok: int, windows: list[Window]) -> mx.array:
    """Boolean mask [rows, offset + rows]: token rows causal, auxiliary rows per method doc section 3."""
    n_aux = sum(w.n for w in windows)
    rows = n_tok + n_aux
    local = np.zeros((rows, rows), dtype=bool)
    local[:n_tok, :n_tok] = np.tril(np.ones((n_tok, n_tok), dtype=bool))
    vis = np.empty(rows, dtype=np.int64)  # how many real-token columns each row sees
    vis[:n_tok] = offset + 1 + np.arange(n_tok)
    r = n_tok
    for w in windows:
        vis[r : r + w.n] = w.ctx_len
        local[r : r + w.n, r : r + w.n] = np.tril(np.ones((w.n, w.n), dtype=bool))
        r += w.n
    cols = np.arange(offset + n_tok)
    real = cols[None, :] < vis[:, None]
    full = np.concatenate([real, np.zeros((rows, n_aux), dtype=bool)], axis=1)
    full[:, offset:] |= local
    return mx.array(full)


class PTPModel:
    """Base model + optional adapter with a mixed token/auxiliary forward pass."""

    def __init__(self, base, adapter: PTPAdapter | None = None, adapter_config: dict | None = None, fuse: bool = False):
        self.base = base
        self.adapter = adapter
        self.adapter_config = adapter_config or {}
        self.args = base.args
        self._fused = None
        if fuse and adapter is not None:  # inference only: fused copies do not follow later weight updates
            dtype = base.model.embed_tokens.weight.dtype
            dtype = mx.float32 if dtype not in (mx.float32, mx.float16, mx.bfloat16) else dtype
            self._fused = [FusedLoRA(d, dtype) if d else {} for d in adapter.layers]

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        return self.base.model.embed_tokens(tokens)

    def head(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.base.model.embed_tokens.as_linear(h)
        return self.base.lm_head(h)

    def __call__(
        self,
        tokens: mx.array,
        u: mx.array | None = None,
        windows: list[Window] | None = None,
        cache=None,
        adapter: PTPAdapter | None = None,
    ) -> mx.array:
        """Logits [rows, vocab] for ``tokens`` (1-D) followed by the auxiliaries of ``windows``.

        ``u`` holds one uniform per auxiliary row, in window order. The cache (a list of mlx-lm ``KVCache``)
        receives every row; callers trim what was not accepted.
        """
        adapter = adapter or self.adapter
        windows = windows or []
        n_tok = int(tokens.shape[0])
        offset = cache[0].offset if cache is not None else 0
        parts = [self.embed_tokens(tokens[None])] if n_tok else []
        if windows:
            if adapter is None:
                raise ValueError("auxiliary rows need a PTP adapter")
            parts.append(adapter.u_embed(u)[None].astype(parts[0].dtype if parts else mx.float32))
        h = mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        segments = [(0, n_tok, offset)] if n_tok else []
        r = n_tok
        for w in windows:
            segments.append((r, r + w.n, w.ctx_len - 1))
            r += w.n
        mask = build_mask(offset, n_tok, windows) if windows or n_tok > 1 else None
        if mask is not None and mask.shape[0] > 1 and not windows:
            mask = "causal"  # the same kernel path mlx-lm takes for plain causal passes
        rows = h.shape[1]
        gate = None
        if windows and n_tok:
            gate = (mx.arange(rows) >= n_tok).astype(h.dtype)[None, :, None]
        for i, layer in enumerate(self.base.model.layers):
            if adapter is None or not windows:
                lora = {}
            else:
                lora = self._fused[i] if (self._fused is not None and adapter is self.adapter) else adapter.layers[i]
            h = self._block(layer, h, mask, cache[i] if cache is not None else None, segments, gate, lora)
        return self.head(self.base.model.norm(h))[0]

    @staticmethod
    def _deltas(lora, names: tuple[str, ...], x: mx.array, gate: mx.array | None) -> dict[str, mx.array]:
        # Gate: the LoRA delta is multiplied by 0 on token rows and 1 on auxiliary rows. Adding an exact zero
        # leaves token rows bit-identical to the base model, with fewer ops than slicing and concatenating.
        if isinstance(lora, FusedLoRA):
            return lora.deltas(names, x, gate)
        out = {}
        for n in names:
            if n in lora:
                d = lora[n](x).astype(x.dtype)
                out[n] = d if gate is None else d * gate
        return out

    @staticmethod
    def _lin(mod, x: mx.array, delta: mx.array | None) -> mx.array:
        y = mod(x)
        return y if delta is None else y + delta

    def _block(self, layer, x, mask, cache, segments, gate, lora):
        attn = layer.self_attn
        B, L, _ = x.shape
        xn = layer.input_layernorm(x)
        d = self._deltas(lora, INPUT_GROUPS[0], xn, gate) if lora else {}
        q = self._lin(attn.q_proj, xn, d.get("q_proj"))
        k = self._lin(attn.k_proj, xn, d.get("k_proj"))
        v = self._lin(attn.v_proj, xn, d.get("v_proj"))
        q = q.reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = self._rope(attn.rope, q, segments)
        k = self._rope(attn.rope, k, segments)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
        d = self._deltas(lora, INPUT_GROUPS[1], o, gate) if lora else {}
        h = x + self._lin(attn.o_proj, o, d.get("o_proj"))
        hn = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        d = self._deltas(lora, INPUT_GROUPS[2], hn, gate) if lora else {}
        g = self._lin(mlp.gate_proj, hn, d.get("gate_proj"))
        up = self._lin(mlp.up_proj, hn, d.get("up_proj"))
        m = swiglu(g, up)
        d = self._deltas(lora, INPUT_GROUPS[3], m, gate) if lora else {}
        return h + self._lin(mlp.down_proj, m, d.get("down_proj"))

    @staticmethod
    def _rope(rope, x: mx.array, segments) -> mx.array:
        # Each segment has contiguous positions, so one RoPE call per segment keeps token rows bit-exact.
        if len(segments) == 1:
            s, e, pos = segments[0]
            return rope(x, offset=pos)
        return mx.concatenate([rope(x[:, :, s:e], offset=pos) for s, e, pos in segments], axis=2)
