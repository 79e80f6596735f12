"""``ptp-convert hf``: a Hugging Face folder built here -> MLX folder that mlx_lm.load opens, with logits parity."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from ptp_mlx.convert.cli import main as cli_main  # noqa: E402
from ptp_mlx.convert.hf import convert_hf  # noqa: E402
from test_convert_support import save_hf_folder, tiny_hf_model  # noqa: E402

TOKENS = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 2, 50]


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(seed=3)


@pytest.fixture(scope="module")
def hf_logits(hf_model):
    with torch.no_grad():
        return hf_model(torch.tensor([TOKENS])).logits[0].numpy()


def mlx_logits(folder) -> np.ndarray:
    model, _ = mlx_lm.load(str(folder))
    return np.array(model(mx.array([TOKENS]))[0].astype(mx.float32))


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch_bin"])
def test_hf_logits_parity(hf_model, hf_logits, tmp_path, safe, capsys):
    src = save_hf_folder(hf_model, tmp_path / "hf", safe=safe)
    assert any(src.glob("*.safetensors" if safe else "pytorch_model*.bin"))
    out = tmp_path / "mlx"
    assert cli_main(["hf", str(src), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "size on disk" in err and "mapped" in err
    got = mlx_logits(out)
    rel = np.abs(got - hf_logits).max() / np.abs(hf_logits).max()
    print(f"\nhf ({'safetensors' if safe else 'bin'}): max rel logit diff {rel:.2e}")
    assert rel < 1e-4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == 5000.0  # transformers 5's rope_parameters spelled out for mlx-lm
    assert (out / "tokenizer.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_hf_quantize_and_dtype(hf_model, hf_logits, tmp_path):
    src = save_hf_folder(hf_model, tmp_path / "hf")
    convert_hf(src, tmp_path / "q", quantize_bits=4, q_group_size=32)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 32
    model, _ = mlx_lm.load(str(tmp_path / "q"))
    assert model.model.layers[0].self_attn.q_proj.bits == 4
    got = np.array(model(mx.array([TOKENS]))[0])
    assert np.corrcoef(got.ravel(), hf_logits.ravel())[0, 1] > 0.95  # 4-bit: close, not equal

    convert_hf(src, tmp_path / "bf16", dtype="bfloat16")
    model, _ = mlx_lm.load(str(tmp_path / "bf16"))
    assert model.model.layers[0].mlp.up_proj.weight.dtype == mx.bfloat16


def test_hf_dry_run(hf_model, tmp_path, capsys):
    src = save_hf_folder(hf_model, tmp_path / "hf")
    assert cli_main(["hf", str(src), "--out", str(tmp_path / "x"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.down_proj.weight -> model.layers.1.mlp.down_proj.weight  [64, 128] float32" in out
    assert not (tmp_path / "x").exists()
