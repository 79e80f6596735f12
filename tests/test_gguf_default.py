"""The real default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers' own GGUF loading (issue 2):
greedy argmax agreement over 64-token continuations, and tokenizer parity. Slow: torch, the real model."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torch]
torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402

from ptp_mlx.generate import DecodeOptions, stream_generate  # noqa: E402
from ptp_mlx.model.ptp import PTPModel  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
]
TEXTS = [
    "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "Grüße aus Köln, 世界! naïve café — 🤖🚀 Ελληνικά русский عربى",
    "def f(x):\n    return {'a': [x**2, 0x1F]}  # comment\n\nclass A(B):\n\tpass\n",
    "tabs\tbetween\t\twords\n\tand leading\t\n   spaces   at the end   ",
    "3.14159 1,234,567 2024-01-02 <|endoftext|> <|im_end|>",
]


@pytest.fixture(scope="module")
def gguf_path(default_model_dir):
    """The cached GGUF (requesting the real default model keeps the real cache root, see conftest)."""
    from ptp_mlx.models import default_gguf

    return default_gguf()


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory):
    """Converted here with the current converter (the cached folder may predate it)."""
    from ptp_mlx.gguf import convert_gguf

    out = tmp_path_factory.mktemp("smol") / "f32"
    convert_gguf(gguf_path, out, dtype="float32")
    return out


def test_default_gguf_argmax_parity_with_transformers(gguf_path, converted):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    model, tok = mlx_lm.load(str(converted))
    pm = PTPModel(model)
    worst_rel, worst_gap = 0.0, np.inf
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        steps = stream_generate(pm, tok, ids, DecodeOptions(mode="ar", max_tokens=64), eos_ids=set())
        cont = [t for s in steps for t in s.tokens]
        assert len(cont) == 64
        seq = ids + cont
        with torch.no_grad():
            want = ref(torch.tensor([seq])).logits[0].numpy()
        got = np.array(model(mx.array([seq]))[0])
        rows = slice(len(ids) - 1, len(seq) - 1)  # the rows that predict each continuation token
        ref_arg = want[rows].argmax(-1)
        top2 = np.sort(want[rows], -1)[:, -2:]
        worst_gap = min(worst_gap, float((top2[:, 1] - top2[:, 0]).min()))
        worst_rel = max(worst_rel, float(np.abs(got - want).max() / np.abs(want).max()))
        bad = np.nonzero(ref_arg != np.array(cont))[0]
        assert bad.size == 0, (
            f"{prompt!r}: first divergence at continuation position {bad[0]}, "
            f"transformers top-1/top-2 gap there {top2[bad[0], 1] - top2[bad[0], 0]:.3g}"
        )
    print(
        f"\ndefault GGUF vs transformers: max rel logit diff {worst_rel:.2e}, smallest top-1/top-2 gap "
        f"{worst_gap:.3g} over {len(PROMPTS)} x 64 greedy positions"
    )
    assert worst_rel < 1e-4


def test_default_gguf_tokenizer_parity_with_transformers(gguf_path, converted):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(converted))
    theirs = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for text in TEXTS:
        a = ours.encode(text, add_special_tokens=False)
        b = theirs.encode(text, add_special_tokens=False)
        assert a == b, text
        assert ours.decode(a) == text
    msgs = [{"role": "user", "content": TEXTS[2]}, {"role": "assistant", "content": TEXTS[1]}]
    assert ours.apply_chat_template(msgs, tokenize=False) == theirs.apply_chat_template(msgs, tokenize=False)
    assert ours.eos_token == theirs.eos_token and ours.bos_token == theirs.bos_token
