"""A tiny real model whose chat template defines tool calls, for tests of the tool round trip (tests only).

The template is Qwen's shape: the tools as JSON in a system block, calls as ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` (mlx-lm infers its ``json_tools`` parser from it), ``role: "tool"`` results.
The weights are crafted, not random: every block's output projections are zero, so a position's logits depend on
its own token only (a bigram model), and the head maps the generation prompt's last token to ``<tool_call>``, that
to one call, the call to ``</tool_call>`` and that to the end of the turn. Greedy decoding therefore answers every
chat with the same tool call; the tokenizer is the byte-level one of ``ptp_mlx.testing`` plus three added tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from . import SPECIALS, save_byte_tokenizer, tiny_config

TOOL_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_TEXT = json.dumps(TOOL_CALL)
ADDED = ["<tool_call>", "</tool_call>", CALL_TEXT]
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    'Call a tool as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in message.tool_calls %}{% set tool_call = tc.function %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>tool\n{{ message.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _save_tokenizer(out: Path):
    return save_byte_tokenizer(out, TOOL_TEMPLATE, ADDED)  # ADDED get ids 259, 260, 261


def make_tool_model(out: Path, seed: int = 0) -> Path:
    """Write the tool-calling tiny model folder (see the module docstring). Returns ``out``."""
    from mlx_lm.utils import _get_classes as get_model_classes

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fast = _save_tokenizer(out)
    vocab = len(SPECIALS) + 256 + len(ADDED)
    cfg = {**tiny_config(vocab_size=vocab), "tie_word_embeddings": False}
    Model, Args = get_model_classes(cfg)
    mx.random.seed(seed)
    model = Model(Args.from_dict(cfg))
    newline = fast.convert_tokens_to_ids("Ċ")  # the byte-level symbol of "\n": the generation prompt ends with it
    chain = [newline, *fast.convert_tokens_to_ids(["<tool_call>", CALL_TEXT, "</tool_call>"]), 2]  # 2: <|im_end|>
    hidden = cfg["hidden_size"]
    emb = mx.random.normal((vocab, hidden)) * 0.02
    head = mx.random.normal((vocab, hidden)) * 0.02
    for k, (t, nxt) in enumerate(zip(chain[:-1], chain[1:], strict=True)):
        emb[t] = mx.zeros((hidden,))
        emb[t, k] = 1.0  # after RMSNorm: sqrt(hidden) along dimension k
        head[nxt, k] = 5.0  # the next token's logit: about 40, every other about 0
    new = dict(tree_flatten(model.parameters()))
    for name, v in new.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            new[name] = mx.zeros_like(v)  # the blocks add nothing: the residual stream is the token's embedding
    new.update({"model.embed_tokens.weight": emb, "lm_head.weight": head})
    model.load_weights(list(new.items()))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
