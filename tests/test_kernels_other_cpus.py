"""The C and C++ sources on CPUs this machine is not: aarch64 Linux (and any CPU without the x86 paths) runs
ptp-sgemm's portable path, the branch ``-DPTP_PORTABLE_ONLY`` selects here. Built that way on this machine, the
library must agree with numpy and keep every row's bits whatever the row count; and every source must compile for
aarch64 Linux (``zig cc``, from the ``ziglang`` wheel of the test extra, cross-compiles with no system toolchain)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from ptp_mlx import kernels

SRC = Path(kernels.__file__).parent
ROW, NO, TR = 101, 111, 112


def _zig() -> list[str] | None:
    try:
        import ziglang  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "ziglang"]


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """sgemm.c built with ``-DPTP_PORTABLE_ONLY`` (no x86 intrinsics compiled in), as a private library."""
    cc = kernels.find_compiler()
    if cc is None:
        pytest.skip("no C compiler found (cc, gcc or clang)")
    out = tmp_path_factory.mktemp("portable") / "sgemm-portable.so"
    cmd = [cc, *kernels.FLAGS, "-DPTP_PORTABLE_ONLY", "-o", str(out), str(kernels.SOURCE)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    lib = ctypes.CDLL(str(out))
    lib.ptp_sgemm_info.restype = ctypes.c_char_p
    lib.ptp_sgemm_use.argtypes = [ctypes.c_char_p]
    lib.cblas_sgemm.argtypes = [*[ctypes.c_int] * 6, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.cblas_sgemm.argtypes += [ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


def _gemm(lib, a: np.ndarray, b: np.ndarray, tb: int, beta: float = 0.0, c: np.ndarray | None = None):
    m, k = a.shape
    n = b.shape[0] if tb == TR else b.shape[1]
    c = np.zeros((m, n), np.float32) if c is None else c.copy()
    lib.cblas_sgemm(ROW, NO, tb, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, b.shape[1], beta, c.ctypes.data, n)
    return c


def test_the_portable_only_build_runs_the_portable_path_alone(portable):
    assert portable.ptp_sgemm_info() == b"portable"
    assert not portable.ptp_sgemm_use(b"avx512") and not portable.ptp_sgemm_use(b"avx2")


@pytest.mark.parametrize("tb", [TR, NO])
def test_the_portable_only_build_agrees_with_numpy(portable, tb):
    rng = np.random.default_rng(3)
    for m, n, k in ((1, 577, 65), (5, 63, 577), (13, 17, 3), (24, 129, 576)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((n, k) if tb == TR else (k, n)).astype(np.float32)
        c0 = rng.standard_normal((m, n)).astype(np.float32)
        for beta in (0.0, 1.0):
            got = _gemm(portable, a, b, tb, beta, c0).astype(np.float64)
            b64 = b.astype(np.float64).T if tb == TR else b.astype(np.float64)
            want = a.astype(np.float64) @ b64 + beta * c0
            bound = np.abs(a.astype(np.float64)) @ np.abs(b64) + np.abs(c0)
            assert (np.abs(got - want) <= 4e-7 * (k + 2) * bound).all(), (m, n, k, tb, beta)


def test_the_portable_only_build_keeps_each_rows_bits_whatever_the_rows(portable):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((384, 576)).astype(np.float32)
    x = rng.standard_normal((24, 576)).astype(np.float32)
    alone = np.concatenate([_gemm(portable, x[j : j + 1], w, TR) for j in range(24)])
    for k in (2, 5, 16, 24):
        assert np.array_equal(_gemm(portable, x[:k], w, TR), alone[:k]), k


def test_every_c_source_compiles_for_aarch64_linux(tmp_path):
    zig = _zig()
    if zig is None:
        pytest.skip("ziglang is not installed (pip install -e '.[test]')")
    if not sys.platform.startswith("linux"):  # (the CPU kernels are Linux-only; nanobind is a Linux dependency)
        pytest.skip("the CPU kernels are built on Linux only")
    lib = tmp_path / "sgemm-aarch64.so"
    flags = ["-target", "aarch64-linux-gnu", *kernels.FLAGS]
    done = subprocess.run([*zig, "cc", *flags, "-o", str(lib), str(kernels.SOURCE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert lib.read_bytes()[:4] == b"\x7fELF" and lib.read_bytes()[18] == 183  # e_machine EM_AARCH64
    import mlx.core
    import nanobind

    # (the headers the extension's own build uses: MLX's next to mlx.core, nanobind's, the Python's)
    mlx_include = Path(mlx.core.__file__).resolve().parent / "include"
    inc = [f"-I{d}" for d in (mlx_include, nanobind.include_dir(), sysconfig.get_paths()["include"])]
    for src in sorted(SRC.glob("*.cpp")):
        cmd = [*zig, "c++", "-target", "aarch64-linux-gnu", "-std=c++20", "-O3", "-fPIC", "-w", "-c", *inc]
        done = subprocess.run([*cmd, str(src), "-o", str(tmp_path / f"{src.stem}.o")], capture_output=True, text=True)
        assert done.returncode == 0, (src.name, done.stderr[-2000:])
