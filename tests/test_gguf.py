"""``ptp-convert gguf``: bad input (missing, truncated, unknown architecture) and logits parity on a tiny GGUF
written here with the ``gguf`` package (llama.cpp's Q/K row order, Q4_1 and Q8_0 weights) against
transformers' own GGUF loader. The real default model's parity lives in test_gguf_default.py (slow)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from ptp_mlx.convert.cli import main as cli_main

from ptp_mlx.gguf import convert_gguf
from ptp_mlx.testing import CHAT_TEMPLATE, SPECIALS

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, THETA = 64, 128, 2, 4, 2, 5000.0
TOKENS = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 2, 50]


def byte_vocab() -> list[str]:
    from tokenizers import pre_tokenizers

    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt"]


def llama_cpp_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face -> llama.cpp row order of q/k (what convert_hf_to_gguf.py does)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_tiny_gguf(path: Path, arch: str = "llama", quantized: bool = True, seed: int = 0) -> Path:
    """A random tiny Llama in GGUF: Q4_1 linear layers, Q8_0 embedding, f32 norms, byte-level BPE vocabulary."""
    gguf = pytest.importorskip("gguf")

    rng = np.random.default_rng(seed)
    vocab = byte_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name, shape, scale=0.1, kind=gguf.GGMLQuantizationType.Q4_1):
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            a = llama_cpp_rows(a, HEADS if "attn_q" in name else KV_HEADS)
        if quantized and len(shape) == 2:
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, a)

    tensor("token_embd.weight", (len(vocab), HIDDEN), 0.5, gguf.GGMLQuantizationType.Q8_0)
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", (HIDDEN,), 0.1)
        tensor(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN))
        tensor(f"blk.{i}.attn_k.weight", (HIDDEN // HEADS * KV_HEADS, HIDDEN))
        tensor(f"blk.{i}.attn_v.weight", (HIDDEN // HEADS * KV_HEADS, HIDDEN))
        tensor(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN))
        tensor(f"blk.{i}.ffn_norm.weight", (HIDDEN,), 0.1)
        tensor(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN))
        tensor(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN))
        tensor(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN))
    tensor("output_norm.weight", (HIDDEN,), 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def outs(tmp_path):
    d = tmp_path / "outs"
    d.mkdir()
    return d


def fails(capsys, args, outs) -> str:
    rc = cli_main(["gguf", *map(str, args)])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and out == "", err
    assert list(outs.iterdir()) == [], "something was left behind"
    return errors[0]


def test_missing_gguf(outs, tmp_path, capsys):
    assert "not found" in fails(capsys, [tmp_path / "nope.gguf", "--out", outs / "m"], outs)


def test_truncated_gguf(outs, tmp_path, capsys):
    data = write_tiny_gguf(tmp_path / "t.gguf").read_bytes()
    for n in (len(data) - 100, 600, 3):  # inside the tensor data, inside the metadata, inside the magic
        (tmp_path / "cut.gguf").write_bytes(data[:n])
        msg = fails(capsys, [tmp_path / "cut.gguf", "--out", outs / "m"], outs)
        assert "truncated" in msg or "not a GGUF" in msg


def test_unknown_architecture(outs, tmp_path, capsys):
    src = write_tiny_gguf(tmp_path / "m.gguf", arch="mamba")
    assert "unknown architecture 'mamba'" in fails(capsys, [src, "--out", outs / "m"], outs)


def test_not_a_gguf(outs, tmp_path, capsys):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(100))
    assert "not a GGUF" in fails(capsys, [tmp_path / "x.gguf", "--out", outs / "m"], outs)


def test_unwritable_output(tmp_path, capsys):
    src = write_tiny_gguf(tmp_path / "m.gguf")
    (tmp_path / "file").write_text("x")
    assert cli_main(["gguf", str(src), "--out", str(tmp_path / "file" / "m")]) == 2
    assert "error: cannot write" in capsys.readouterr().err


def test_dry_run_and_dtypes(tmp_path, capsys):
    src = write_tiny_gguf(tmp_path / "m.gguf")
    assert cli_main(["gguf", str(src), "--dry-run", "--dtype", "quantized"]) == 0
    out = capsys.readouterr().out
    assert "blk.1.attn_q.scales -> model.layers.1.self_attn.q_proj.scales" in out
    convert_gguf(src, tmp_path / "q", dtype="quantized")
    convert_gguf(src, tmp_path / "f", dtype="float32")
    q, _ = mlx_lm.load(str(tmp_path / "q"))
    f, _ = mlx_lm.load(str(tmp_path / "f"))
    assert q.model.layers[0].self_attn.q_proj.bits == 4 and q.model.embed_tokens.bits == 8
    lq, lf = np.array(q(mx.array([TOKENS]))[0]), np.array(f(mx.array([TOKENS]))[0])
    assert np.abs(lq - lf).max() < 1e-2 * np.abs(lf).max()  # same weights; only the matmul kernels differ
    convert_gguf(src, tmp_path / "b", dtype="bfloat16")
    b, _ = mlx_lm.load(str(tmp_path / "b"))
    assert b.model.layers[1].mlp.down_proj.weight.dtype == mx.bfloat16


def test_tiny_gguf_logits_match_transformers(tmp_path):
    """Q/K un-permutation and float32 dequantization agree with transformers' GGUF loader."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    src = write_tiny_gguf(tmp_path / "m.gguf")
    convert_gguf(src, tmp_path / "f", dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([TOKENS])).logits[0].numpy()
    model, _ = mlx_lm.load(str(tmp_path / "f"))
    got = np.array(model(mx.array([TOKENS]))[0])
    rel = np.abs(got - want).max() / np.abs(want).max()
    print(f"\ntiny GGUF vs transformers: max rel logit diff {rel:.2e}")
    assert rel < 1e-4
