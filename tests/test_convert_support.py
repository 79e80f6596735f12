"""Builders shared by the converter tests (tiny Hugging Face models, reference-layout PTP checkpoints, a
PyTorch reference forward of the gated PTP model: docs/method.md, sections 2, 3 and 8), and the tests that check
that reference forward against transformers and PEFT themselves. Needs torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from ptp_mlx.testing import save_byte_tokenizer, tiny_config  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_PREFIX = "model.model.base_model.model."


def hf_config(tie: bool = False, rope_theta: float = 5000.0, **kw):
    from transformers import LlamaConfig

    c = {**tiny_config(**kw), "rope_theta": rope_theta}  # not mlx-lm's default: a dropped theta shows
    return LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        max_position_embeddings=c["max_position_embeddings"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"],
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_hf_model(seed: int = 0, tie: bool = False, **kw):
    """A random fp32 ``LlamaForCausalLM`` with peaked next-token distributions."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config(tie=tie, **kw)).float().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.5)
        if not tie:
            model.lm_head.weight.normal_(0, 0.5)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.8, 1.2)  # non-trivial norm weights catch a dropped or misplaced norm
    return model


def save_hf_folder(model, out: Path, safe: bool = True) -> Path:
    out = Path(out)
    model.save_pretrained(str(out))
    if not safe:  # the classic pickle layout (transformers 5 only writes safetensors)
        for f in out.glob("*.safetensors"):
            f.unlink()
        torch.save(model.state_dict(), str(out / "pytorch_model.bin"))
    save_byte_tokenizer(out)
    return out


class UEmbed(torch.nn.Module):
    """The reference ``u_embed`` module's parameters and forward (binary or linear_interpolation)."""

    def __init__(self, kind: str, hidden: int):
        super().__init__()
        self.kind = kind
        if kind == "binary":
            self.u_adapter = torch.nn.Linear(32, hidden)
        else:
            self.embedding = torch.nn.Embedding(3, hidden)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        u = u.to(torch.float32)
        if self.kind == "binary":
            bits = (u.view(torch.int32)[..., None] >> torch.arange(31, -1, -1, dtype=torch.int32)) & 1
            return self.u_adapter(bits.to(torch.float32))
        x = 2.0 * u
        lower = torch.floor(x).long()
        upper = torch.clamp(lower + 1, max=2)
        frac = (x - lower.to(torch.float32))[..., None]
        return self.embedding(lower) * (1 - frac) + self.embedding(upper) * frac


class Mixed(torch.nn.Module):
    """Stands in for the reference MixedTransformerModel: ``.model`` (PEFT) and ``.u_embed``."""

    def __init__(self, peft_model, kind: str, hidden: int):
        super().__init__()
        self.model = peft_model
        self.u_embed = UEmbed(kind, hidden)


class Lit(torch.nn.Module):
    """Stands in for the Lightning module: ``.model``."""

    def __init__(self, mixed):
        super().__init__()
        self.model = mixed


def make_ptp_module(kind: str, rank: int = 4, seed: int = 0, tie: bool = False, alpha: float | None = None):
    """HF Llama + PEFT LoRA on all 7 linear layers (PEFT's default alpha unless given) + u-embedding."""
    from peft import LoraConfig, get_peft_model

    hf = tiny_hf_model(seed=seed, tie=tie)
    kw = {} if alpha is None else {"lora_alpha": alpha}
    peft_model = get_peft_model(hf, LoraConfig(r=rank, target_modules=TARGETS, **kw))
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)  # PEFT starts B at zero: make the LoRA matter
        lit = Lit(Mixed(peft_model, kind, hf.config.hidden_size))
        for p in lit.model.u_embed.parameters():
            p.normal_(0, 0.5)
    return lit.eval()


def save_lightning(lit, path: Path, **extra) -> Path:
    torch.save(
        {"state_dict": lit.state_dict(), "epoch": 1, "global_step": 10, "pytorch-lightning_version": "2.4.0", **extra},
        str(path),
    )
    return Path(path)


# ---------------------------------------------------------------------------------------- reference forward


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    f = pos[:, None].to(torch.float32) * inv[None]
    emb = torch.cat([f, f], -1)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def ptp_rows(n_tok: int, windows: list[tuple[int, int]]):
    """Positions, gate and boolean mask of one pass: token rows then windows (ctx_len, n), docs/method.md, section 3."""
    n_aux = sum(n for _, n in windows)
    rows = n_tok + n_aux
    pos = list(range(n_tok))
    mask = np.zeros((rows, rows), dtype=bool)
    mask[:n_tok, :n_tok] = np.tril(np.ones((n_tok, n_tok), dtype=bool))
    r = n_tok
    for ctx, n in windows:
        for j in range(n):
            pos.append(ctx + j - 1)  # the auxiliary predicting absolute position p sits at p - 1
            mask[r + j, :ctx] = True  # the real context before its window
            mask[r + j, r : r + j + 1] = True  # its own window, causally
        r += n
    gate = torch.tensor([0.0] * n_tok + [1.0] * n_aux)
    return torch.tensor(pos), gate, torch.tensor(mask)


@torch.no_grad()
def reference_logits(
    lit, tokens: list[int], windows: list[tuple[int, int]], u: np.ndarray, gate_all: bool = False
) -> np.ndarray:
    """Gated PTP forward in plain PyTorch from the checkpoint's own tensors.

    The LoRA delta is added on auxiliary rows only (``gate_all`` adds it everywhere, for checking against PEFT).
    """
    sd = lit.state_dict()
    peft = lit.model.model
    cfg = peft.base_model.model.config
    scale = peft.peft_config["default"].lora_alpha / peft.peft_config["default"].r
    H, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = H // nh
    theta = getattr(cfg, "rope_parameters", None) or {}
    theta = theta.get("rope_theta") or cfg.rope_theta

    def w(name):
        return sd[PEFT_PREFIX + name]

    pos, gate, mask = ptp_rows(len(tokens), windows)
    if gate_all:
        gate = torch.ones_like(gate)

    def lin(x, name):
        y = x @ w(f"{name}.base_layer.weight").T
        a, b = w(f"{name}.lora_A.default.weight"), w(f"{name}.lora_B.default.weight")
        return y + gate[:, None] * scale * ((x @ a.T) @ b.T)

    parts = [w("model.embed_tokens.weight")[torch.tensor(tokens, dtype=torch.long)]]
    if windows:
        parts.append(lit.model.u_embed(torch.tensor(u, dtype=torch.float32)))
    h = torch.cat(parts, 0)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        x = _rms(h, w(f"{p}.input_layernorm.weight"), cfg.rms_norm_eps)
        q = lin(x, f"{p}.self_attn.q_proj").view(-1, nh, hd).transpose(0, 1)
        k = lin(x, f"{p}.self_attn.k_proj").view(-1, nkv, hd).transpose(0, 1)
        v = lin(x, f"{p}.self_attn.v_proj").view(-1, nkv, hd).transpose(0, 1)
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        att = (q @ k.transpose(1, 2)) / hd**0.5
        att = att.masked_fill(~mask[None], float("-inf")).softmax(-1)
        o = (att @ v).transpose(0, 1).reshape(-1, H)
        h = h + lin(o, f"{p}.self_attn.o_proj")
        x = _rms(h, w(f"{p}.post_attention_layernorm.weight"), cfg.rms_norm_eps)
        g, up = lin(x, f"{p}.mlp.gate_proj"), lin(x, f"{p}.mlp.up_proj")
        h = h + lin(torch.nn.functional.silu(g) * up, f"{p}.mlp.down_proj")
    h = _rms(h, w("model.norm.weight"), cfg.rms_norm_eps)
    head = w("model.embed_tokens.weight") if cfg.tie_word_embeddings else w("lm_head.weight")
    return (h @ head.T).numpy()


# ---------------------------------------------------------------------------------------- self-checks


@pytest.mark.parametrize("kind", ["binary", "linear_interpolation"])
def test_reference_forward_matches_transformers_and_peft(kind):
    """The test's reference is itself right: LoRA off = transformers, LoRA on every row = PEFT."""
    lit = make_ptp_module(kind)
    peft = lit.model.model
    tokens = [5, 70, 80, 90, 100, 33, 44, 55]
    with torch.no_grad():
        with peft.disable_adapter():
            plain = peft(torch.tensor([tokens])).logits[0].numpy()
        lora = peft(torch.tensor([tokens])).logits[0].numpy()
    scale = np.abs(plain).max()
    assert np.abs(reference_logits(lit, tokens, [], np.zeros(0)) - plain).max() < 1e-5 * scale
    assert np.abs(reference_logits(lit, tokens, [], np.zeros(0), gate_all=True) - lora).max() < 1e-5 * scale
    assert np.abs(plain - lora).max() > 1e-2 * scale  # the LoRA is not a no-op


def test_reference_layout_keys():
    """The saved state dict has the key names of docs/method.md, section 8."""
    keys = set(make_ptp_module("binary").state_dict())
    assert f"{PEFT_PREFIX}model.embed_tokens.weight" in keys
    assert f"{PEFT_PREFIX}model.layers.1.self_attn.q_proj.base_layer.weight" in keys
    assert f"{PEFT_PREFIX}model.layers.1.mlp.down_proj.lora_A.default.weight" in keys
    assert f"{PEFT_PREFIX}model.layers.1.mlp.down_proj.lora_B.default.weight" in keys
    assert f"{PEFT_PREFIX}lm_head.weight" in keys
    assert {"model.u_embed.u_adapter.weight", "model.u_embed.u_adapter.bias"} <= keys
    assert "model.u_embed.embedding.weight" in set(make_ptp_module("linear_interpolation").state_dict())
