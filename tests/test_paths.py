"""Atomic outputs: all or nothing, and ordinary permissions (not the 0600/0700 of mkstemp/mkdtemp)."""

import os
import stat

import pytest

from ptp_mlx.paths import atomic_dir, atomic_write_bytes


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_atomic_outputs_follow_the_umask(tmp_path):
    mask = os.umask(0o022)  # the process umask, read as the module does
    os.umask(mask)
    atomic_write_bytes(tmp_path / "f.txt", b"x")
    with atomic_dir(tmp_path / "d") as d:
        (d / "inside").write_text("y")
    assert _mode(tmp_path / "f.txt") == 0o666 & ~mask  # not mkstemp's 0600
    assert _mode(tmp_path / "d") == 0o777 & ~mask  # not mkdtemp's 0700
    assert (tmp_path / "f.txt").read_bytes() == b"x" and (tmp_path / "d" / "inside").read_text() == "y"


def test_failed_atomic_dir_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "d") as d:
        (d / "half").write_text("z")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(tmp_path / "d") as d:
        (d / "a").write_text("1")
    with pytest.raises(FileExistsError):
        with atomic_dir(tmp_path / "d"):
            pass
    assert (tmp_path / "d" / "a").read_text() == "1"


@pytest.mark.parametrize("keep", [None, "1"])
def test_the_default_models_gguf_is_dropped_after_conversion_unless_asked(tmp_path, monkeypatch, keep):
    from ptp_mlx import gguf as gguf_mod
    from ptp_mlx import models

    src = tmp_path / "home" / "downloads" / "SmolLM2.gguf"
    src.parent.mkdir(parents=True)
    src.write_bytes(b"GGUF")
    monkeypatch.setenv("PTP_MLX_HOME", str(tmp_path / "home"))
    if keep:
        monkeypatch.setenv("PTP_MLX_KEEP_GGUF", keep)
    else:
        monkeypatch.delenv("PTP_MLX_KEEP_GGUF", raising=False)
    monkeypatch.setattr(models, "default_gguf", lambda log: src)

    def convert(g, out, dtype, overwrite):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(gguf_mod, "convert_gguf", convert)
    out = models.ensure_default_model("float32", log=lambda m: None)
    assert (out / "config.json").exists()
    assert src.exists() == bool(keep)
