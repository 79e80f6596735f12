"""File locations shared by every command (docs/conventions.md, "Files")."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import platformdirs

from .errors import UserError

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


class OutputPathError(UserError, OSError):
    """An output path that cannot be written: bad input (exit 2), and still an ``OSError`` for callers that
    catch those (the chat app turns a failed save into a notice)."""


# errno values that mean "this path cannot be written" (bad input), not "writing failed" (disk full, I/O error)
_BAD_PATH = {errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT}


def _missing_parents(p: Path) -> tuple[list[Path], Path]:
    """The folders above ``p`` that do not exist (deepest first), and the nearest folder-or-file above it that does
    (what ``mkdir(parents=True)`` would start from)."""
    missing, a = [], Path(p).parent
    while not a.exists() and a.parent != a:
        missing.append(a)
        a = a.parent
    return missing, a


def creation_problem(p: Path) -> str | None:
    """Why ``p`` (a file or a folder, with any missing parents) cannot be created, in words, or None when it can
    as far as a probe in its nearest existing ancestor can tell. Creates nothing that stays."""
    a = _missing_parents(p)[1]
    if not a.is_dir():
        return f"cannot create it ({a} is not a folder)"
    try:  # the only sure test of writability (root, read-only mounts, /proc) is to write
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.probe-", dir=a)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"not writable (cannot create files in {a}: {e.strerror or e})"
    return None


def _output_problem(p: Path) -> str | None:
    """Why ``p`` cannot be written as a file, in words, or None when it can (as far as a probe can tell)."""
    if p.is_dir():
        return "is a folder"
    if p.exists() and not p.is_file():
        return "is not a regular file"
    return creation_problem(p)


def check_output_file(path: str | Path, flag: str = "") -> Path:
    """Refuse, before any slow work, an output file path that cannot be written (``flag`` names the option in
    the message: ``--json emptydir: is a folder``). Creates nothing. Returns the path, ``~`` expanded."""
    p = Path(path).expanduser()
    problem = _output_problem(p)
    if problem:
        raise OutputPathError(f"{flag + ' ' if flag else ''}{path}: {problem}")
    return p


def _write_error(target: Path, e: OSError) -> OSError:
    """``e`` restated for ``target`` (never the temporary name): bad paths become ``OutputPathError``."""
    if e.errno in _BAD_PATH:
        return OutputPathError(f"{target}: {_output_problem(target) or e.strerror or e}")
    return OSError(e.errno, e.strerror, str(target))


@contextmanager
def _cleanup_new_parents(target: Path) -> Iterator[None]:
    """On failure, remove the folders above ``target`` that did not exist on entry (only those, only if empty)."""
    new = _missing_parents(target)[0]  # (deepest first)
    try:
        yield
    except BaseException:
        for d in new:
            try:
                d.rmdir()
            except OSError:
                pass  # not created after all, or not empty: someone else's now
        raise


@contextmanager
def atomic_dir(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a folder in a temporary sibling and rename it to ``target`` only on success.

    On failure nothing is left: neither the temporary folder nor the parent folders this call created."""
    target = Path(target)
    parent = target.parent
    with _cleanup_new_parents(target):
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _write_error(target, e) from None
        if target.exists() and not overwrite:
            raise FileExistsError(f"output folder already exists: {target} (pass --overwrite to replace it)")
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        except OSError as e:
            raise _write_error(target, e) from None
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
    """Write a file through a temporary sibling and rename it.

    A path that cannot be written raises ``OutputPathError`` (a ``UserError``) naming ``target``; nothing is left
    behind, new parent folders included."""
    target = Path(target)
    with _cleanup_new_parents(target):
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
        except OSError as e:
            raise _write_error(target, e) from None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; the result should read like a normal file
            os.replace(tmp, target)
        except BaseException as e:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if isinstance(e, OSError):
                raise _write_error(target, e) from None
            raise
