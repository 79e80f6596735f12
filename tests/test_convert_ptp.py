"""``ptp-convert ptp``: reference-layout PyTorch checkpoints -> MLX model + gated adapter, checked for logits
parity on token and auxiliary rows against a PyTorch reference, and for exact PTP decoding afterwards."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from ptp_mlx.convert.cli import main as cli_main  # noqa: E402
from ptp_mlx.convert.ptp import convert_ptp  # noqa: E402
from test_convert_support import (  # noqa: E402
    make_ptp_module,
    reference_logits,
    save_hf_folder,
    save_lightning,
)

from ptp_mlx.adapter import load_adapter  # noqa: E402
from ptp_mlx.generate import DecodeOptions, stream_generate  # noqa: E402
from ptp_mlx.model.ptp import PTPModel, Window  # noqa: E402
from ptp_mlx.prompt import encode_prompt  # noqa: E402
from ptp_mlx.sampler import SamplingSettings  # noqa: E402

TOKENS = [5, 70, 80, 90, 100, 33, 44, 55, 66, 77]
WINDOWS = [(4, 3), (7, 4), (10, 2)]  # (real tokens seen, auxiliaries): overlapping contexts, separate windows
KINDS = ["binary", "linear_interpolation"]


@pytest.fixture(scope="module", params=KINDS)
def converted(request, tmp_path_factory):
    """(kind, torch module, checkpoint, HF config folder, conversion output) for one u-embedding kind."""
    kind = request.param
    d = tmp_path_factory.mktemp(f"ptp-{kind}")
    lit = make_ptp_module(kind, tie=kind == "binary")  # tied and untied heads, one each
    ckpt = save_lightning(lit, d / "last.ckpt")
    cfg_dir = save_hf_folder(lit.model.model.base_model.model, d / "hf")
    out = d / "out"
    convert_ptp(ckpt, out, config=cfg_dir)
    return kind, lit, ckpt, cfg_dir, out


def load_pm(model_dir, adapter_dir) -> tuple[PTPModel, object]:
    base, tok = mlx_lm.load(str(model_dir))
    adapter, cfg = load_adapter(adapter_dir, base)
    return PTPModel(base, adapter, cfg), tok


def mlx_logits(pm: PTPModel, u: np.ndarray) -> np.ndarray:
    return np.array(pm(mx.array(TOKENS), mx.array(u), [Window(c, n) for c, n in WINDOWS]))


def uniforms() -> np.ndarray:
    u = np.random.default_rng(0).random(sum(n for _, n in WINDOWS)).astype(np.float32)
    u[:3] = [0.0, 0.5, np.nextafter(np.float32(1), np.float32(0))]  # bin edges of both u-embeddings
    return u


def test_logits_parity_token_and_auxiliary_rows(converted):
    kind, lit, _, _, out = converted
    pm, _ = load_pm(out / "model", out / "adapter")
    assert pm.config.u_embedding == kind
    u = uniforms()
    ref = reference_logits(lit, TOKENS, WINDOWS, u)
    got = mlx_logits(pm, u)
    scale = np.abs(ref).max()
    n = len(TOKENS)
    tok_err, aux_err = np.abs(ref[:n] - got[:n]).max() / scale, np.abs(ref[n:] - got[n:]).max() / scale
    print(f"\n{kind}: logit scale {scale:.2f}, max rel diff token rows {tok_err:.2e}, auxiliary rows {aux_err:.2e}")
    assert tok_err < 1e-4 and aux_err < 1e-4
    # Not vacuous: the LoRA moves the auxiliary rows well beyond the tolerance.
    bare = copy.deepcopy(lit)
    with torch.no_grad():
        for name, p in bare.named_parameters():
            if "lora_B" in name:
                p.zero_()
    assert np.abs(reference_logits(bare, TOKENS, WINDOWS, u)[n:] - ref[n:]).max() / scale > 1e-2


@pytest.mark.parametrize(
    "sampling", [SamplingSettings(), SamplingSettings(temperature=0.9, top_p=0.95, seed=7)], ids=["greedy", "sampled"]
)
def test_ptp_decoding_with_converted_adapter_is_exact(converted, sampling):
    _, _, _, _, out = converted
    pm, tok = load_pm(out / "model", out / "adapter")
    prompt = encode_prompt(tok, "convert me")
    runs = {}
    for mode in ("ar", "ptp"):
        steps = list(
            stream_generate(pm, tok, prompt, DecodeOptions(mode=mode, max_tokens=40, sampling=sampling), eos_ids=set())
        )
        runs[mode] = [t for s in steps for t in s.tokens]
    assert len(runs["ar"]) == 40
    assert runs["ptp"] == runs["ar"]


def test_adapter_only_safetensors_onto_base(converted, tmp_path):
    """An adapter-only file (LoRA + u-embedding keys only) converts onto --base and gives the same logits."""
    from safetensors.torch import save_file

    _, lit, _, _, out = converted
    sd = {k: v.contiguous() for k, v in lit.state_dict().items() if "lora_" in k or "u_embed" in k}
    src = save_file(sd, str(tmp_path / "adapter.safetensors")) or tmp_path / "adapter.safetensors"
    res = tmp_path / "res"
    assert cli_main(["ptp", str(src), "--base", str(out / "model"), "--out", str(res)]) == 0
    assert not (res / "model").exists() and (res / "adapter" / "adapter_config.json").exists()
    u = uniforms()
    a, _ = load_pm(out / "model", out / "adapter")
    b, _ = load_pm(out / "model", res / "adapter")
    assert np.array_equal(mlx_logits(a, u), mlx_logits(b, u))


def test_full_checkpoint_onto_matching_base(converted, tmp_path):
    _, _, ckpt, _, out = converted
    res = tmp_path / "res"
    convert_ptp(ckpt, res, base=out / "model")
    assert not (res / "model").exists()
    load_pm(out / "model", res / "adapter")


def test_plain_state_dict_with_legacy_keys(converted, tmp_path):
    """``student.`` prefix and the legacy ``u_adapter`` module name, as a plain ``.pt`` state dict."""
    kind, lit, _, cfg_dir, out = converted
    legacy = {}
    for k, v in lit.state_dict().items():
        k = "student." + k[len("model.") :]
        k = k.replace(".u_embed.", ".u_adapter.")  # binary becomes student.u_adapter.u_adapter.*
        legacy[k] = v
    torch.save(legacy, str(tmp_path / "legacy.pt"))
    res = tmp_path / "res"
    summary = convert_ptp(tmp_path / "legacy.pt", res, config=cfg_dir)
    assert "legacy keys renamed" in summary.info["source"]
    u = uniforms()
    a, _ = load_pm(out / "model", out / "adapter")
    b, _ = load_pm(res / "model", res / "adapter")
    assert np.array_equal(mlx_logits(a, u), mlx_logits(b, u))


def test_train_yaml_sets_alpha_and_window(tmp_path):
    """LoRA alpha and the window come from train.yaml beside the checkpoint; --alpha overrides it."""
    lit = make_ptp_module("linear_interpolation", alpha=16)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt = save_lightning(lit, run / "checkpoints" / "last.ckpt")
    cfg_dir = save_hf_folder(lit.model.model.base_model.model, tmp_path / "hf")
    (run / "train.yaml").write_text(
        "model:\n  model:\n    model_id: some/model\n    lora_config:\n      r: 4\n      lora_alpha: 16\n"
        "      target_modules: all-linear\ndata:\n  train_completion_len: 8\n"
    )
    hist = torch.tensor([0.5, 0.25, 0.125, 0.125] + [0.0] * 17, dtype=torch.float64)
    torch.save(hist, str(run / "checkpoints" / "correct_count_hist.pt"))  # where the reference caches it
    convert_ptp(ckpt, tmp_path / "a", config=cfg_dir)
    cfg = json.loads((tmp_path / "a" / "adapter" / "adapter_config.json").read_text())
    assert (cfg["scale"], cfg["window"], cfg["base_model"]["name"]) == (4.0, 8, "some/model")
    assert cfg["acceptance_histogram"] == hist.tolist()
    pm, _ = load_pm(tmp_path / "a" / "model", tmp_path / "a" / "adapter")
    u = uniforms()
    ref = reference_logits(lit, TOKENS, WINDOWS, u)
    assert np.abs(mlx_logits(pm, u) - ref).max() < 1e-4 * np.abs(ref).max()
    convert_ptp(ckpt, tmp_path / "b", config=cfg_dir, alpha=2.0)
    assert json.loads((tmp_path / "b" / "adapter" / "adapter_config.json").read_text())["scale"] == 0.5


def test_dry_run_lists_the_mapping(converted, tmp_path, capsys):
    _, _, ckpt, cfg_dir, _ = converted
    out = tmp_path / "never"
    assert cli_main(["ptp", str(ckpt), "--config", str(cfg_dir), "--out", str(out), "--dry-run"]) == 0
    stdout, stderr = capsys.readouterr()
    assert (
        "model.model.base_model.model.model.layers.1.mlp.up_proj.lora_B.default.weight -> "
        "adapter/layers.1.up_proj.B  [128, 4] float32"
    ) in stdout
    assert (
        "model.model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight -> "
        "model/model.layers.0.self_attn.q_proj.weight"
    ) in stdout
    assert "LoRA rank 4" in stderr and "scale 2" in stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_checkpoint_trained_from_scratch_without_peft(tmp_path):
    """The reference's scaling runs train the whole model: keys ``model.model.model.*``, no LoRA."""
    from test_convert_support import Lit, Mixed, tiny_hf_model

    hf = tiny_hf_model(seed=4)
    lit = Lit(Mixed(hf, "linear_interpolation", hf.config.hidden_size)).eval()
    assert "model.model.model.layers.0.mlp.up_proj.weight" in lit.state_dict()
    ckpt = save_lightning(lit, tmp_path / "scratch.ckpt")
    summary = convert_ptp(ckpt, tmp_path / "out", config=save_hf_folder(hf, tmp_path / "hf"))
    assert "LoRA rank 0 on no modules" in summary.info["adapter"]
    pm, _ = load_pm(tmp_path / "out" / "model", tmp_path / "out" / "adapter")
    got = mlx_logits(pm, uniforms())
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0].numpy()
    assert np.abs(got[: len(TOKENS)] - want).max() < 1e-4 * np.abs(want).max()
    assert np.isfinite(got).all()


def test_config_without_dtype_field(converted, tmp_path):
    """A base config written from a bare config object (no torch_dtype / dtype field) converts all the same."""
    kind, lit, ckpt, cfg_dir, _ = converted
    bare = tmp_path / "hf"
    bare.mkdir()
    for f in cfg_dir.iterdir():
        if f.is_file():
            (bare / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bare / "config.json").read_text())
    for k in ("torch_dtype", "dtype", "transformers_version"):
        cfg.pop(k, None)
    (bare / "config.json").write_text(json.dumps(cfg))
    convert_ptp(ckpt, tmp_path / "out", config=bare)
    pm, _ = load_pm(tmp_path / "out" / "model", tmp_path / "out" / "adapter")
    u = uniforms()
    ref = reference_logits(lit, TOKENS, WINDOWS, u)
    assert np.abs(ref - mlx_logits(pm, u)).max() / np.abs(ref).max() < 1e-4
