"""Atomic outputs: all or nothing, and ordinary permissions (not the 0600/0700 of mkstemp/mkdtemp)."""

import errno
import os
import stat
from pathlib import Path

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


def test_failed_atomic_dir_removes_the_parents_it_made(tmp_path):
    """Only the folders this call created go, and only when empty: an existing parent stays."""
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "deep" / "a" / "d"):
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "keep").mkdir()
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "keep" / "new" / "d"):
        raise RuntimeError("interrupted")
    assert [p.name for p in tmp_path.iterdir()] == ["keep"] and list((tmp_path / "keep").iterdir()) == []


def test_atomic_write_names_the_target_not_the_temporary_file(tmp_path, monkeypatch):
    from ptp_mlx.errors import UserError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "afile").write_text("")
    for target, why in (("emptydir", "emptydir: is a folder"), ("afile/x.json", "(afile is not a folder)")):
        with pytest.raises(UserError) as e:
            atomic_write_bytes(Path(target), b"x")
        assert isinstance(e.value, OSError)  # (callers that catch OSError, the chat app's save, still do)
        assert why in str(e.value) and ".tmp-" not in str(e.value)

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError) as e:
        atomic_write_bytes(Path("new/sub/x.json"), b"x")
    assert not isinstance(e.value, UserError)  # a failure while running (exit 1), not bad input
    assert "new/sub/x.json" in str(e.value) and ".tmp-" not in str(e.value)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "emptydir"]
    assert list((tmp_path / "emptydir").iterdir()) == []


def test_check_output_file(tmp_path, monkeypatch):
    from ptp_mlx.errors import UserError
    from ptp_mlx.paths import check_output_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "afile").write_text("")
    cases = [
        ("emptydir", "--json emptydir: is a folder"),
        ("afile/x.json", "--json afile/x.json: cannot create it (afile is not a folder)"),
        ("afile/sub/x.json", "--json afile/sub/x.json: cannot create it (afile is not a folder)"),
    ]
    if Path("/proc").is_dir():
        cases.append(("/proc/x.json", "--json /proc/x.json: not writable"))
    for path, msg in cases:
        with pytest.raises(UserError) as e:
            check_output_file(path, "--json")
        assert str(e.value).startswith(msg), str(e.value)
    assert check_output_file("new/sub/x.json", "--json") == Path("new/sub/x.json")
    assert check_output_file("afile", "--json") == Path("afile")  # an existing file is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "emptydir"]  # nothing created
