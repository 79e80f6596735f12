"""Fast BLAS on Linux CPU.

The Linux ``mlx[cpu]`` wheel links netlib's reference BLAS, which makes wide forward passes (the ones PTP
relies on) as expensive as many narrow ones. MLX only calls ``cblas_sgemm``/``cblas_dgemm``, so loading an
optimised library that exports them into the global symbol scope *before* MLX is imported makes MLX use it.
This module must therefore run before the first ``import mlx`` (``ptp_mlx/__init__.py`` calls it first).

Where the library comes from, in order: ``PTP_MLX_BLAS`` (a path, or ``none``); Intel's ``mkl`` wheel, a
Linux x86_64 dependency of ptp-mlx (self-contained: it needs nothing from the system); Debian/Ubuntu's
single-threaded OpenBLAS (``libopenblas0-serial``), for machines the wheel does not cover (aarch64).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import os
import sys

# Debian/Ubuntu single-threaded OpenBLAS: two threads on two cores collapse (docs/method.md, section 10).
SYSTEM_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-serial/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
# Kept for callers that listed the candidates before the wheel existed.
CANDIDATES = SYSTEM_CANDIDATES

FIX_HINT = "pip install mkl (Linux x86_64) or apt-get install libopenblas0-serial"

state = {"blas": "default", "warned": False, "error": ""}


def _mlx_uses_reference_blas() -> bool:
    """True when the installed MLX is the Linux CPU wheel that bundles netlib's BLAS."""
    try:
        files = importlib.metadata.distribution("mlx-cpu").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    if any("mlx_cpu.libs/libblas" in str(f) for f in files):
        return True
    return any(glob.glob(os.path.join(p, "mlx_cpu.libs", "libblas*.so*")) for p in sys.path if p)


def mkl_library() -> str | None:
    """Path of ``libmkl_rt`` from the installed ``mkl`` wheel, if any."""
    try:
        dist = importlib.metadata.distribution("mkl")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        name = os.path.basename(str(f))
        if name.startswith("libmkl_rt.so"):
            path = os.path.realpath(str(dist.locate_file(f)))
            if os.path.exists(path):
                return path
    return None


def _candidates(choice: str) -> list[tuple[str, str]]:
    """``(kind, path)`` pairs to try, best first."""
    if choice:
        return [("mkl" if "mkl" in os.path.basename(choice) else "openblas", choice)]
    out = []
    mkl = mkl_library()
    if mkl:
        out.append(("mkl", mkl))
    out += [("openblas", p) for p in SYSTEM_CANDIDATES]
    return out


def setup_blas() -> str:
    """Preload an optimised BLAS when MLX would otherwise use the reference one.

    Returns a short name of the BLAS in use (``"mkl:<path>"``, ``"openblas:<path>"``, ``"reference"`` or
    ``"default"`` where MLX brings its own fast one, as on macOS).
    """
    if "mlx.core" in sys.modules or not sys.platform.startswith("linux"):
        return state["blas"]
    if state["blas"] != "default":
        return state["blas"]
    if not _mlx_uses_reference_blas():
        return state["blas"]
    choice = os.environ.get("PTP_MLX_BLAS", "")
    if choice.lower() == "none":
        state["blas"] = "reference"
        return state["blas"]
    # One thread each: MLX runs its own CPU stream thread, and BLAS threads on top of it oversubscribe.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
    os.environ.setdefault("MKL_INTERFACE_LAYER", "LP64")  # MLX passes 32-bit integers
    for kind, path in _candidates(choice):
        if not os.path.exists(path):
            if choice:
                state["error"] = f"PTP_MLX_BLAS={choice}: no such file"
            continue
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            lib.cblas_sgemm  # noqa: B018 - must export the standard CBLAS name MLX calls
        except (OSError, AttributeError) as e:
            state["error"] = f"could not load {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            continue
        state["blas"] = f"{kind}:{path}"
        return state["blas"]
    state["blas"] = "reference"
    return state["blas"]


def is_slow() -> bool:
    """True when decoding runs on MLX's reference BLAS (wide passes cost about as much as many narrow ones)."""
    return state["blas"] == "reference"


def slow_notice() -> str:
    """The one-line notice about the slow BLAS (with the reason a requested library failed, if one did)."""
    why = f" ({state['error']})" if state["error"] else ""
    return f"notice: MLX is using its slow reference BLAS{why}: PTP will rarely draft; fix: {FIX_HINT}"


def warn_if_slow() -> None:
    """Say once on stderr that only the slow reference BLAS is available."""
    if is_slow() and not state["warned"] and os.environ.get("PTP_MLX_BLAS") != "none":
        state["warned"] = True
        print(slow_notice(), file=sys.stderr)


def provider_of_sgemm() -> str | None:
    """The file that provides ``cblas_sgemm`` to MLX (the first definition in the global scope), or None.

    Lets tests check that the BLAS in use is not the reference one without timing anything."""
    if not sys.platform.startswith("linux"):
        return None

    class _DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    try:
        libc = ctypes.CDLL(None)
        addr = ctypes.cast(libc.cblas_sgemm, ctypes.c_void_p).value
        info = _DlInfo()
        libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        if not libc.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)):
            return None
        return info.dli_fname.decode() if info.dli_fname else None
    except (AttributeError, OSError):
        return None
