"""File locations shared by every command (docs/conventions.md, "Files")."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import platformdirs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """The one cache root: ``$PTP_MLX_HOME`` or the platform's user cache dir."""
    env = os.environ.get("PTP_MLX_HOME")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("ptp-mlx"))


def data_root() -> Path:
    """Where user data (saved chats) lives: ``$PTP_MLX_DATA``, else ``$PTP_MLX_HOME/data``, else the platform's
    user data dir."""
    data = os.environ.get("PTP_MLX_DATA")
    if data:
        return Path(data).expanduser()
    env = os.environ.get("PTP_MLX_HOME")
    return Path(env).expanduser() / "data" if env else Path(platformdirs.user_data_dir("ptp-mlx"))


def shipped_adapters_dir() -> Path:
    return Path(__file__).parent / "adapters"


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it: done once, at import, not per write
    os.umask(mask)
    return mask


_UMASK = _read_umask()


@contextmanager
def atomic_dir(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a folder in a temporary sibling and rename it to ``target`` only on success."""
    target = Path(target)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not overwrite:
        raise FileExistsError(f"output folder already exists: {target} (pass --overwrite to replace it)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp makes 0700; the result should read like a normal folder
    try:
        yield tmp
        if target.exists():
            old = parent / f".{target.name}.old-{os.getpid()}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(target: Path, data: bytes) -> None:
    """Write a file through a temporary sibling and rename it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; the result should read like a normal file
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
