"""Tiny real models for tests and examples: a random Llama with a byte-level tokenizer, saved as a real
mlx-lm folder (config.json, model.safetensors, tokenizer files), so tests exercise the real loading path
without any download."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_config(
    vocab_size: int = 259, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, context: int = 512
) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "max_position_embeddings": context,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def save_byte_tokenizer(out: Path) -> None:
    """Byte-level BPE without merges: 3 special tokens then the 256 byte symbols (vocabulary 259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_syms = list(pre_tokenizers.ByteLevel.alphabet())
    byte_syms.sort()
    vocab = {t: i for i, t in enumerate(SPECIALS + byte_syms)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS[1],
        eos_token=SPECIALS[2],
        unk_token=SPECIALS[0],
        pad_token=SPECIALS[0],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def make_tiny_model(out: Path, seed: int = 0, **cfg_kw) -> Path:
    """Write a random tiny Llama folder that ``mlx_lm.load`` opens. Returns ``out``."""
    from mlx_lm.models import llama

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(**cfg_kw)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    # Larger-than-default embeddings give peaked, varied next-token distributions.
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * 0.5
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_byte_tokenizer(out)
    return out


def randomize_adapter(adapter, scale: float = 0.05, seed: int = 0) -> None:
    """Give every LoRA ``B`` random values so the adapter changes the auxiliary rows (tests only)."""
    mx.random.seed(seed)
    for layer in adapter.layers:
        for lora in layer.values():
            lora.B = mx.random.normal(lora.B.shape) * scale
    mx.eval(adapter.parameters())
