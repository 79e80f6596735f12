"""Bad input to ``ptp-convert``: each case exits 2 with one ``error:`` line, prints nothing on stdout and leaves
nothing behind (no output folder, no temporary folder)."""

from __future__ import annotations

import builtins

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from ptp_mlx.convert.cli import main as cli_main  # noqa: E402
from ptp_mlx.convert.ptp import convert_ptp  # noqa: E402
from test_convert_support import make_ptp_module, save_hf_folder, save_lightning, tiny_hf_model  # noqa: E402

from ptp_mlx.testing import make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """A valid reference checkpoint, its HF config folder and its converted MLX base model."""
    d = tmp_path_factory.mktemp("ref")
    lit = make_ptp_module("binary", tie=True)
    ckpt = save_lightning(lit, d / "last.ckpt")
    cfg_dir = save_hf_folder(lit.model.model.base_model.model, d / "hf")
    convert_ptp(ckpt, d / "conv", config=cfg_dir)
    return {"lit": lit, "sd": lit.state_dict(), "ckpt": ckpt, "cfg": cfg_dir, "base": d / "conv" / "model"}


@pytest.fixture
def outs(tmp_path):
    d = tmp_path / "outs"
    d.mkdir()
    return d


def fails(capsys, args: list, outs) -> str:
    """Run the CLI expecting bad input; return the error line."""
    rc = cli_main([str(a) for a in args])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2, err
    assert len(errors) == 1 and out == ""
    assert list(outs.iterdir()) == [], "something was left behind"
    return errors[0]


def ptp_args(src, outs, ref, *extra):
    return ["ptp", src, "--config", ref["cfg"], "--out", outs / "res", *extra]


def save_sd(sd, path):
    torch.save(sd, str(path))
    return path


def test_truncated_checkpoint(ref, outs, tmp_path, capsys):
    data = ref["ckpt"].read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    assert "truncated or corrupt" in fails(capsys, ptp_args(tmp_path / "cut.ckpt", outs, ref), outs)


def test_truncated_safetensors(ref, outs, tmp_path, capsys):
    from safetensors.torch import save_file

    save_file({k: v.clone() for k, v in ref["sd"].items()}, str(tmp_path / "full.safetensors"))
    data = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 1000])
    assert "truncated or corrupt" in fails(capsys, ptp_args(tmp_path / "cut.safetensors", outs, ref), outs)


def test_truncated_hf_weights(outs, tmp_path, capsys):
    src = save_hf_folder(tiny_hf_model(), tmp_path / "hf")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:5000])
    assert "truncated or corrupt" in fails(capsys, ["hf", src, "--out", outs / "res"], outs)


def test_not_a_checkpoint(ref, outs, tmp_path, capsys):
    # (fixed bytes: random ones start like a pickle, \x80, or a safetensors header, "{" at byte 8, 2 times in 256)
    (tmp_path / "x.bin").write_bytes(b"not a weight file, nor anything else " * 8)
    assert "unknown file format" in fails(capsys, ptp_args(tmp_path / "x.bin", outs, ref), outs)


def test_wrong_shapes(ref, outs, tmp_path, capsys):
    sd = dict(ref["sd"])
    key = "model.model.base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight"
    sd[key] = torch.zeros(3, 64)  # rank 3 where every other factor has rank 4
    msg = fails(capsys, ptp_args(save_sd(sd, tmp_path / "a.pt"), outs, ref), outs)
    assert "wrong shape" in msg and key in msg
    sd = dict(ref["sd"])
    key = "model.model.base_model.model.model.layers.0.mlp.up_proj.base_layer.weight"
    sd[key] = torch.zeros(100, 64)
    msg = fails(capsys, ptp_args(save_sd(sd, tmp_path / "b.pt"), outs, ref), outs)
    assert f"wrong shape for {key}: [100, 64]" in msg


def test_missing_keys(ref, outs, tmp_path, capsys):
    sd = {k: v for k, v in ref["sd"].items() if "layers.1.self_attn.v_proj.lora_B" not in k}
    msg = fails(capsys, ptp_args(save_sd(sd, tmp_path / "a.pt"), outs, ref), outs)
    assert "missing keys (1): layers.1.v_proj.lora_B" in msg
    sd = {k: v for k, v in ref["sd"].items() if not k.endswith("model.norm.weight")}
    msg = fails(capsys, ptp_args(save_sd(sd, tmp_path / "b.pt"), outs, ref), outs)
    assert "missing keys (1): model.norm.weight" in msg
    sd = {k: v for k, v in ref["sd"].items() if "u_embed" not in k}
    assert "missing keys" in fails(capsys, ptp_args(save_sd(sd, tmp_path / "c.pt"), outs, ref), outs)


def test_unexpected_keys_are_listed(ref, outs, tmp_path, capsys):
    sd = dict(ref["sd"])
    sd["model.teacher_head.weight"] = torch.zeros(2)
    sd["model.model.base_model.model.lm_head.lora_A.default.weight"] = torch.zeros(4, 64)
    msg = fails(capsys, ptp_args(save_sd(sd, tmp_path / "a.pt"), outs, ref), outs)
    assert "unexpected keys (2)" in msg
    assert "model.teacher_head.weight" in msg and "lm_head.lora_A.default.weight" in msg
    sd = dict(ref["sd"])
    sd["model.model.base_model.model.model.layers.0.self_attn.gate_bias"] = torch.zeros(2)
    msg = fails(capsys, ptp_args(save_sd(sd, tmp_path / "b.pt"), outs, ref), outs)
    assert "unexpected keys (1): model.model.base_model.model.model.layers.0.self_attn.gate_bias" in msg


class Payload:
    """Unpickling this creates a file: the code a malicious checkpoint would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_pickle_with_code_payload_is_refused(ref, outs, tmp_path, capsys, zipped):
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.ckpt"
    torch.save({"state_dict": ref["sd"], "callbacks": Payload(marker)}, str(src), _use_new_zipfile_serialization=zipped)
    msg = fails(capsys, ptp_args(src, outs, ref), outs)
    assert "refusing to load" in msg and "--trust-pickle" in msg
    assert not marker.exists(), "the payload ran"
    # The user can still opt in for a file they trust.
    assert cli_main([str(a) for a in ptp_args(src, outs, ref, "--trust-pickle")]) == 0
    assert marker.exists() and (outs / "res" / "adapter").is_dir()


def test_hf_bin_with_code_payload_is_refused(outs, tmp_path, capsys):
    src = save_hf_folder(tiny_hf_model(), tmp_path / "hf", safe=False)
    marker = tmp_path / "pwned"
    sd = torch.load(str(src / "pytorch_model.bin"), weights_only=True)
    torch.save({**sd, "extra": Payload(marker)}, str(src / "pytorch_model.bin"))
    assert "refusing to load" in fails(capsys, ["hf", src, "--out", outs / "res"], outs)
    assert not marker.exists()


def test_base_model_mismatch(ref, outs, tmp_path, capsys):
    from safetensors.torch import save_file

    adapter_only = {k: v.contiguous() for k, v in ref["sd"].items() if "lora_" in k or "u_embed" in k}
    save_file(adapter_only, str(tmp_path / "adapter.safetensors"))
    other = make_tiny_model(tmp_path / "wide", hidden=96, heads=6, kv_heads=2)
    msg = fails(capsys, ["ptp", tmp_path / "adapter.safetensors", "--base", other, "--out", outs / "res"], outs)
    assert "base-model mismatch" in msg
    # Same shapes, other weights: a full checkpoint names its own base.
    same_shape = make_tiny_model(tmp_path / "same", seed=5)
    msg = fails(capsys, ["ptp", ref["ckpt"], "--base", same_shape, "--out", outs / "res"], outs)
    assert "base-model mismatch" in msg and "differs" in msg
    # An adapter-only file needs a base model.
    msg = fails(capsys, ["ptp", tmp_path / "adapter.safetensors", "--out", outs / "res"], outs)
    assert "--base" in msg


def test_hyper_parameters_that_contradict_the_tensors(ref, outs, capsys):
    msg = fails(capsys, ptp_args(ref["ckpt"], outs, ref, "--u-embedding", "linear_interpolation"), outs)
    assert "holds binary weights" in msg
    assert "rank 4" in fails(capsys, ptp_args(ref["ckpt"], outs, ref, "--rank", "8"), outs)


def test_missing_config_source(ref, outs, capsys):
    assert "--config" in fails(capsys, ["ptp", ref["ckpt"], "--out", outs / "res"], outs)


def test_unwritable_output_path(ref, outs, tmp_path, capsys):
    blocker = outs / "file.txt"
    blocker.write_text("not a folder")
    rc = cli_main([str(a) for a in ptp_args(ref["ckpt"], outs, ref)[:-2] + ["--out", blocker / "res"]])
    err = capsys.readouterr().err
    assert rc == 2 and "error: cannot write" in err
    assert sorted(p.name for p in outs.iterdir()) == ["file.txt"]


def test_existing_output_needs_overwrite(ref, outs, capsys):
    (outs / "res").mkdir()
    (outs / "res" / "keep").write_text("x")
    rc = cli_main([str(a) for a in ptp_args(ref["ckpt"], outs, ref)])
    assert rc == 2 and "--overwrite" in capsys.readouterr().err
    assert (outs / "res" / "keep").exists()
    assert cli_main([str(a) for a in ptp_args(ref["ckpt"], outs, ref, "--overwrite")]) == 0
    assert not (outs / "res" / "keep").exists() and (outs / "res" / "adapter").is_dir()
    assert sorted(p.name for p in outs.iterdir()) == ["res"]


def test_failure_after_writing_started_leaves_nothing(outs, tmp_path, capsys):
    """The tokenizer is read inside the atomic folder: a corrupt one fails there, and nothing remains."""
    src = save_hf_folder(tiny_hf_model(), tmp_path / "hf")
    (src / "tokenizer.json").write_text("{ not json")
    assert "tokenizer" in fails(capsys, ["hf", src, "--out", outs / "res"], outs)
