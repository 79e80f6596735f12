"""ptp-sgemm, a ``cblas_sgemm`` for the few-row products of PTP decoding (``sgemm.c`` says why and how).

Built at first use with the system C compiler into ``<PTP_MLX_HOME>/kernels/sgemm-<hash>-<cpu>.so``: the hash
covers the source and the flags, the CPU key the machine ``-march=native`` targets. ``ptp_mlx/blas.py`` loads it
before MLX is imported, so this module imports nothing heavy (no numpy, no mlx).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("sgemm.c")
INCLUDED = (Path(__file__).with_name("packed.c"),)  # #included by sgemm.c: part of the build's hash
# -ffp-contract=off: the portable C path must not fuse a*b+c in some specialisations and not others (the
# SIMD paths spell their fused multiply-adds out). -march=native is dropped where the compiler rejects it.
FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-pthread"]
NATIVE = "-march=native"
COMPILERS = ("cc", "gcc", "clang")
NO_COMPILER = "no C compiler found (cc, gcc or clang)"
# What a process without a compiler is told, once, whichever of ptp-mlx's CPU parts asks first (``notice_once``).
NO_COMPILER_NOTICE = (
    f"notice: {NO_COMPILER}: ptp-mlx's CPU kernels are not built, so MLX's BLAS computes every product and attention, "
    "norms and the adapter's LoRA run as graph nodes (slower); install gcc or clang, then `python -m ptp_mlx.kernels`"
)
_noticed: set[str] = set()


def notice_once(key: str, text: str) -> None:
    """Print ``text`` to stderr unless a notice under ``key`` was printed already in this process."""
    if key not in _noticed:
        _noticed.add(key)
        print(text, file=sys.stderr)


def find_compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else the first of cc, gcc, clang on ``PATH``."""
    env = os.environ.get("CC", "").strip()
    if env and shutil.which(env.split()[0]):
        return env.split()[0]
    for name in COMPILERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def cpu_key() -> str:
    """A short name for what ``-march=native`` targets: the architecture and the CPU's model and features."""
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 16)
        first = text.split("\n\n", 1)[0]
        ident += "".join(
            line for line in first.splitlines() if line.split(":")[0].strip() in ("model name", "flags", "Features")
        )
    except OSError:
        pass
    return f"{platform.machine()}-{hashlib.sha256(ident.encode()).hexdigest()[:10]}"


def library_name() -> str:
    text = SOURCE.read_bytes() + b"".join(p.read_bytes() for p in INCLUDED)
    digest = hashlib.sha256(text + " ".join(FLAGS + [NATIVE]).encode()).hexdigest()[:12]
    return f"sgemm-{digest}-{cpu_key()}.so"


def kernel_dir() -> Path:
    from ..paths import cache_root

    return cache_root() / "kernels"


def shared_path(name: str) -> Path | None:
    """Where the default cache root keeps build ``name``, when this process has its own ``PTP_MLX_HOME`` (each
    test has one); None otherwise. Builds are content-addressed by their names, so interchangeable."""
    if not os.environ.get("PTP_MLX_HOME"):
        return None
    try:
        import platformdirs
    except ImportError:
        return None
    return Path(platformdirs.user_cache_dir("ptp-mlx")) / "kernels" / name


def _shared_copy(name: str) -> Path | None:
    """The same build in the default cache root, if it is there: such a process then needs no compile of its own."""
    path = shared_path(name)
    return path if path is not None and path.is_file() else None


def _compile(cc: str, out: Path) -> str:
    """Compile to ``out``; returns "" or a one-line reason."""
    for extra in ([NATIVE], []):
        cmd = [cc, *FLAGS, *extra, "-o", str(out), str(SOURCE)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{Path(cc).name} failed to run: {type(e).__name__}"
        if r.returncode == 0:
            return ""
        first = next((x for x in r.stderr.splitlines() if "error" in x.lower()), "") or r.stderr.strip()[:200]
        reason = f"{Path(cc).name} failed: {first.strip()}"
    return reason


def build(force: bool = False) -> tuple[str | None, str]:
    """The path of the built library, building it if needed, and "" ; or None and a one-line reason.

    Concurrent builders each compile to a private temporary file and rename it into place, so a reader only
    ever sees a complete library."""
    if not SOURCE.is_file():
        return None, f"{SOURCE.name} is missing from the installed package"
    name = library_name()
    target = kernel_dir() / name
    if not force:
        for path in (target, _shared_copy(name)):
            if path is not None and path.is_file():
                return str(path), ""
    cc = find_compiler()
    if cc is None:
        return None, NO_COMPILER
    failed = target.with_suffix(".failed")  # a broken toolchain is not retried at every start
    if failed.is_file() and not force:
        reason = failed.read_text(errors="replace").strip()
        if reason.startswith(Path(cc).name + " "):
            return None, reason
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=target.parent)
        os.close(fd)
    except OSError as e:
        return None, f"cannot write {target.parent}: {e.strerror or type(e).__name__}"
    try:
        reason = _compile(cc, Path(tmp))
        if reason:
            try:
                failed.write_text(reason + "\n")
            except OSError:
                pass
            return None, reason
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        try:
            failed.unlink()
        except OSError:
            pass
        return str(target), ""
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
