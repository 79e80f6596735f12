"""Fast BLAS on Linux CPU.

The Linux ``mlx[cpu]`` wheel links netlib's reference BLAS, which makes wide forward passes (the ones PTP
relies on) as expensive as many narrow ones. MLX only calls ``cblas_sgemm``/``cblas_dgemm``, so loading an
optimised library that exports them into the global symbol scope *before* MLX is imported makes MLX use it.
This module must therefore run before the first ``import mlx`` (``ptp_mlx/__init__.py`` calls it first).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import os
import sys

# Debian/Ubuntu single-threaded OpenBLAS first: two threads on two cores collapse (docs/method.md, section 10).
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-serial/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

state = {"blas": "default", "warned": False}


def _mlx_uses_reference_blas() -> bool:
    """True when the installed MLX is the Linux CPU wheel that bundles netlib's BLAS."""
    try:
        files = importlib.metadata.distribution("mlx-cpu").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    if any("mlx_cpu.libs/libblas" in str(f) for f in files):
        return True
    return any(glob.glob(os.path.join(p, "mlx_cpu.libs", "libblas*.so*")) for p in sys.path if p)


def setup_blas() -> str:
    """Preload an optimised BLAS when MLX would otherwise use the reference one.

    Returns a short name of the BLAS in use (``"openblas:<path>"``, ``"reference"`` or ``"default"``).
    ``PTP_MLX_BLAS`` may name a library to load, or ``none`` to keep MLX's own.
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
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    for path in ([choice] if choice else []) + list(CANDIDATES):
        if path and os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            state["blas"] = f"openblas:{path}"
            return state["blas"]
    state["blas"] = "reference"
    return state["blas"]


def warn_if_slow() -> None:
    """Say once on stderr that only the slow reference BLAS is available."""
    if state["blas"] == "reference" and not state["warned"] and os.environ.get("PTP_MLX_BLAS") != "none":
        state["warned"] = True
        print(
            "notice: MLX is using the slow reference BLAS; install an optimised one "
            "(Debian/Ubuntu: apt-get install libopenblas0-serial) for much faster multi-token passes",
            file=sys.stderr,
        )
