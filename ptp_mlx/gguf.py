"""GGUF (llama.cpp) -> MLX model folder for Llama-family models.

The folder holds ``config.json``, ``model.safetensors`` and the tokenizer files, and opens with
``mlx_lm.load`` unchanged. Quantized tensors that MLX reads natively (Q4_0, Q4_1, Q8_0 as affine
``weight/scales/biases`` triples) stay MLX quantized layers, or are dequantized to a float dtype.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .conversion import FLOAT_DTYPES, Mapping, Summary, check_output, dir_size, dtype_name, progress
from .errors import UserError
from .paths import atomic_dir

SUPPORTED_ARCHS = {"llama"}
DTYPES = ("auto", "quantized", *FLOAT_DTYPES)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def default_dtype() -> str:
    """fp32 on CPU (BLAS-backed, several times faster than 4-bit there); bf16 on a GPU (cheap wide passes)."""
    return "bfloat16" if mx.default_device() == mx.gpu else "float32"


def _meta_int(meta: dict, key: str, default: Any = None) -> Any:
    if key not in meta:
        return default
    v = meta[key]
    return v.item() if hasattr(v, "item") else v


def map_name(name: str) -> str:
    """llama.cpp tensor name -> Hugging Face / mlx-lm name (``blk.3.attn_q.scales`` -> ...)."""
    parts = name.split(".")
    suffix = parts[-1]
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{suffix}"
    if parts[0] == "rope_freqs":
        raise UserError("this GGUF scales RoPE frequencies (rope_freqs, Llama 3.1 style), which is not supported")
    raise UserError(f"unknown GGUF tensor {name!r}: not a Llama-family layout")


def unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (rows only, so packed weights, scales and biases alike)."""
    rows, cols = w.shape
    head_dim = rows // n_head
    return w.reshape(n_head, head_dim // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"not a GGUF file (bad magic): {path}")
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # MLX raises ValueError/RuntimeError on truncated or corrupt files
        raise UserError(f"cannot read GGUF {path} (truncated or corrupt?): {e}") from None
    return weights, meta


def build_config(meta: dict, has_output: bool, quant: dict | None) -> dict:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UserError(f"unknown architecture {arch!r} in GGUF (supported: {', '.join(sorted(SUPPORTED_ARCHS))})")
    a = arch
    n_head = _meta_int(meta, f"{a}.attention.head_count")
    hidden = _meta_int(meta, f"{a}.embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens", [])
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": _meta_int(meta, f"{a}.block_count"),
        "intermediate_size": _meta_int(meta, f"{a}.feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": _meta_int(meta, f"{a}.attention.head_count_kv", n_head),
        "head_dim": _meta_int(meta, f"{a}.rope.dimension_count", hidden // n_head),
        "rms_norm_eps": float(_meta_int(meta, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": _meta_int(meta, f"{a}.vocab_size", len(tokens)),
        "rope_theta": float(_meta_int(meta, f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _meta_int(meta, f"{a}.context_length", 2048),
        "tie_word_embeddings": not has_output,
        "bos_token_id": _meta_int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta_int(meta, "tokenizer.ggml.eos_token_id"),
    }
    if None in (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], n_head):
        raise UserError("GGUF metadata lacks the Llama hyper-parameters (block_count, embedding_length, ...)")
    if quant:
        cfg["quantization"] = quant
        cfg["quantization_config"] = quant
    return cfg


def convert_weights(weights: dict[str, mx.array], cfg: dict, dtype: str) -> tuple[dict[str, mx.array], dict | None]:
    """Rename, un-permute and optionally dequantize. Returns the MLX weights and the quantization config."""
    out: dict[str, mx.array] = {}
    quant: dict | None = None
    heads = {"self_attn.q_proj": cfg["num_attention_heads"], "self_attn.k_proj": cfg["num_key_value_heads"]}
    bases = sorted({k.rsplit(".", 1)[0] for k in weights})
    for base in progress(bases, "converting", total=len(bases)):
        new_base = map_name(base + ".weight").rsplit(".", 1)[0]
        n_head = next((h for s, h in heads.items() if new_base.endswith(s)), None)
        w = weights[base + ".weight"]
        if base + ".scales" in weights:  # affine-quantized triple
            scales, biases = weights[base + ".scales"], weights[base + ".biases"]
            in_dim = cfg["intermediate_size"] if new_base.endswith("down_proj") else cfg["hidden_size"]
            bits, group = _quant_params(w, scales, in_dim)
            if n_head:
                w, scales, biases = (unpermute_rows(t, n_head) for t in (w, scales, biases))
            if dtype == "quantized":
                out[new_base + ".weight"], out[new_base + ".scales"], out[new_base + ".biases"] = w, scales, biases
                if quant is None or bits == 4:
                    quant = {"group_size": group, "bits": bits}
            else:
                # Dequantize in float32: the GGUF's fp16 scales and mins times the codes, as llama.cpp and
                # transformers do. Dequantizing with fp16 scales rounds every weight to fp16 on the way.
                deq = mx.dequantize(
                    w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group, bits=bits
                )
                out[new_base + ".weight"] = deq.astype(FLOAT_DTYPES[dtype])
        else:
            if n_head:
                w = unpermute_rows(w, n_head)
            if dtype == "quantized":  # float tensors of a quantized model: fp16 matrices, fp32 norms
                out[new_base + ".weight"] = w.astype(mx.float16 if w.ndim > 1 else mx.float32)
            else:
                out[new_base + ".weight"] = w.astype(FLOAT_DTYPES[dtype])
        mx.eval([v for k, v in out.items() if k.startswith(new_base + ".")])
    return out, quant


def _quant_params(w: mx.array, scales: mx.array, in_dim: int) -> tuple[int, int]:
    """Bits and group size of an affine-quantized weight whose input width is ``in_dim``."""
    bits, rem = divmod(w.shape[1] * 32, in_dim)
    if rem or bits not in (2, 3, 4, 5, 6, 8) or in_dim % scales.shape[1]:
        raise UserError(f"unexpected quantized shapes {w.shape} / {scales.shape} for input width {in_dim}")
    return bits, in_dim // scales.shape[1]


def build_tokenizer(meta: dict, out_dir: Path) -> None:
    """Byte-level BPE tokenizer from the GGUF vocabulary and merges, saved as transformers files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise UserError(f"unsupported GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} (only byte-level BPE 'gpt2')")
    if "tokenizer.ggml.tokens" not in meta or "tokenizer.ggml.merges" not in meta:
        raise UserError("the GGUF lacks its tokenizer (tokenizer.ggml.tokens / tokenizer.ggml.merges)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = np.array(meta.get("tokenizer.ggml.token_type", np.ones(len(tokens))))
    try:
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    except Exception as e:  # tokenizers raises a bare Exception on an inconsistent vocabulary
        raise UserError(f"the GGUF's tokenizer is inconsistent: {e}") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i in np.nonzero(types == 3)[0]]
    tok.add_special_tokens(special)

    def name(key: str) -> str | None:
        i = _meta_int(meta, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=name("tokenizer.ggml.bos_token_id"),
        eos_token=name("tokenizer.ggml.eos_token_id"),
        unk_token=name("tokenizer.ggml.unknown_token_id"),
        pad_token=name("tokenizer.ggml.padding_token_id"),
        additional_special_tokens=special,
        clean_up_tokenization_spaces=False,
        model_max_length=_meta_int(meta, f"{meta.get('general.architecture')}.context_length", 2048),
    )
    if "tokenizer.chat_template" in meta:
        fast.chat_template = meta["tokenizer.chat_template"]
    fast.save_pretrained(str(out_dir))


def convert_gguf(
    src: Path, out: Path | None, dtype: str = "auto", overwrite: bool = False, dry_run: bool = False
) -> Summary:
    """Convert ``src`` (GGUF) into the MLX folder ``out`` atomically. Returns the summary (and the mapping)."""
    dtype = default_dtype() if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r} ({', '.join(DTYPES)})")
    out = check_output(out, overwrite, dry_run)
    weights, meta = read_gguf(Path(src))
    cfg = build_config(meta, has_output="output.weight" in weights, quant=None)
    if meta.get("tokenizer.ggml.model") != "gpt2":  # checked again when the tokenizer is built
        raise UserError(f"unsupported GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} (only byte-level BPE 'gpt2')")
    folded = dtype != "quantized"
    summary = Summary(
        "gguf",
        [
            Mapping(k, None, tuple(v.shape), dtype_name(v), "folded into the dequantized weight")
            if folded and k.endswith((".scales", ".biases"))
            else Mapping(k, map_name(k), tuple(v.shape), dtype_name(v))
            for k, v in sorted(weights.items())
        ],
        out=out,
    )
    summary.info["model"] = (
        f"{meta.get('general.name', Path(src).stem)}: {cfg['num_hidden_layers']} layers, hidden "
        f"{cfg['hidden_size']}, vocabulary {cfg['vocab_size']}"
    )
    summary.info["dtype"] = dtype
    if dry_run:
        return summary
    with atomic_dir(out, overwrite=overwrite) as tmp:
        new, quant = convert_weights(weights, cfg, dtype)
        cfg = build_config(meta, has_output="output.weight" in weights, quant=quant)
        mx.save_safetensors(str(tmp / "model.safetensors"), new, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        build_tokenizer(meta, tmp)
    summary.written = {k: (tuple(v.shape), dtype_name(v)) for k, v in new.items()}
    if quant:
        summary.info["quantization"] = f"{quant['bits']}-bit affine, group {quant['group_size']} (embedding may differ)"
    summary.bytes = dir_size(out)
    return summary
