"""Fast BLAS on Linux CPU.

The Linux ``mlx[cpu]`` wheel links netlib's reference BLAS, which makes wide forward passes (the ones PTP
relies on) as expensive as many narrow ones. MLX only calls ``cblas_sgemm``/``cblas_dgemm``, so loading an
optimised library that exports them into the global symbol scope *before* MLX is imported makes MLX use it.
This module must therefore run before the first ``import mlx`` (``ptp_mlx/__init__.py`` calls it first).

Where the library comes from, in order: ``PTP_MLX_BLAS`` (a path, or ``none``); Intel's ``mkl`` wheel, a
Linux x86_64 dependency of ptp-mlx (self-contained: it needs nothing from the system); Debian/Ubuntu's
single-threaded OpenBLAS (``libopenblas0-serial``), for machines the wheel does not cover (aarch64).

In front of that library sits ptp-sgemm (``ptp_mlx/kernels``, built at first use with the system C compiler):
it takes the products of decoding and of prefill chunks (at most 256 rows), where a BLAS's packing makes k rows cost far more
than one, computes them batch-invariantly, and forwards every other call to the library above (or, where none
was found, to MLX's bundled reference BLAS). It is loaded into the global scope first, so MLX's ``cblas_sgemm``
resolves to it while every other BLAS/LAPACK symbol still resolves to the library. ``PTP_MLX_SGEMM=0`` skips
it; ``PTP_MLX_BLAS`` (a path, or ``none``) skips it too; ``PTP_MLX_SGEMM_THREADS=1`` keeps it to one thread
(default: two where there are two cores). No compiler or a failed build: one notice on stderr,
and MLX calls the library directly as before.
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
FIX_HINT = "pip install mkl (Linux x86_64) or apt-get install libopenblas0-serial"

state = {"blas": "default", "warned": False, "error": "", "kernel_path": None, "malloc": "default"}
_libs: dict[str, ctypes.CDLL] = {}  # what was loaded stays loaded (and referenced) for the process's life


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


def _load_kernel() -> ctypes.CDLL | None:
    """Build (at first use) and load ptp-sgemm into the global scope; None, with one notice, if it cannot be."""
    if os.environ.get("PTP_MLX_SGEMM", "").strip().lower() in ("0", "off", "no", "false"):
        return None
    why = ""
    try:  # a kernel that cannot be used must never stop MLX from working: any failure is the notice
        from . import kernels

        path, why = kernels.build()
        if path is not None:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            lib.ptp_sgemm_info.restype = ctypes.c_char_p
            lib.ptp_sgemm_taken.restype = lib.ptp_sgemm_forwarded.restype = ctypes.c_ulonglong
            lib.ptp_sgemm_set_fallback.argtypes = [ctypes.c_void_p]
            # A second thread sharing each product's columns, where there is a second core: every step (mlx-lm's
            # too) measured about 25% faster here (docs/method.md, section 10). PTP_MLX_SGEMM_THREADS=1: one.
            threads = os.environ.get("PTP_MLX_SGEMM_THREADS", "").strip()
            n = int(threads) if threads.isdigit() else (2 if (os.cpu_count() or 1) >= 2 else 1)
            if n >= 2:
                lib.ptp_sgemm_set_threads(n, 0, 0)
            # How long the second thread lingers after a product before it sleeps (PTP_MLX_SGEMM_LINGER_US; 0: it
            # sleeps after its spin, as before): waking it costs more than its spinning, yielding, on two cores.
            lib.ptp_sgemm_set_linger.restype = ctypes.c_longlong
            lib.ptp_sgemm_set_linger.argtypes = [ctypes.c_longlong]
            linger = os.environ.get("PTP_MLX_SGEMM_LINGER_US", "").strip()
            if linger.isdigit():
                lib.ptp_sgemm_set_linger(int(linger) * 1000)
            state["kernel_path"] = path
            _libs["kernel"] = lib
            return lib
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    from . import kernels  # (light: no numpy, no mlx)

    if why == kernels.NO_COMPILER:  # (one notice for every CPU part a compiler would have built)
        kernels.notice_once("no-compiler", kernels.NO_COMPILER_NOTICE)
    else:
        print(f"notice: ptp-sgemm kernel not built ({why}); MLX uses the BLAS's sgemm for every width", file=sys.stderr)
    return None


def _reference_sgemm() -> int | None:
    """Address of ``cblas_sgemm`` in the reference BLAS MLX bundles: the kernel's fallback where nothing better
    was found (the kernel still serves the decode widths, the reference BLAS the rest)."""
    for p in sys.path:
        for path in sorted(glob.glob(os.path.join(p or ".", "mlx_cpu.libs", "libblas*.so*"))):
            try:
                lib = ctypes.CDLL(path)
                _libs["reference"] = lib
                return ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value
            except (OSError, AttributeError):
                continue
    return None


def kernel():
    """The loaded ptp-sgemm library (a ``ctypes.CDLL``: ``ptp_sgemm_enable``, ``ptp_sgemm_taken``, ...), or None."""
    return _libs.get("kernel")


def kernel_library() -> str | None:
    """The path of the loaded ptp-sgemm library, or None."""
    return state["kernel_path"]


def setup_blas() -> str:
    """Preload an optimised BLAS when MLX would otherwise use the reference one, with ptp-sgemm in front of it.

    Returns a short name of the BLAS in use (``"mkl:<path>"``, ``"openblas:<path>"``, ``"reference"`` or
    ``"default"`` where MLX brings its own fast one, as on macOS), prefixed with ``"ptp-sgemm(<isa>)+"`` when
    the kernel takes the decode widths (``"ptp-sgemm(avx512)+mkl:<path>"``). With the kernel but no optimised
    library, ``"ptp-sgemm(<isa>)+reference"``: decoding's widths are fast, only prefill is slow, so that is not
    ``is_slow()``.
    """
    if "mlx.core" in sys.modules or not sys.platform.startswith("linux"):
        return state["blas"]
    if state["blas"] != "default":
        return state["blas"]
    _keep_buffers_on_heap()
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
    # First into the global scope, so that MLX's cblas_sgemm binds to the kernel and nothing else does.
    ker = None if choice else _load_kernel()
    threads = f",{_threads} threads" if ker and (_threads := ker.ptp_sgemm_set_threads(0, 0, 0)) > 1 else ""
    prefix = f"ptp-sgemm({ker.ptp_sgemm_info().decode()}{threads})+" if ker else ""
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
        _libs["blas"] = lib
        if ker:
            ker.ptp_sgemm_set_fallback(ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p))
        state["blas"] = f"{prefix}{kind}:{path}"
        return state["blas"]
    fallback = _reference_sgemm() if ker else None
    if ker and fallback:
        ker.ptp_sgemm_set_fallback(fallback)
        state["blas"] = f"{prefix}reference"
    elif ker:  # no reference BLAS to be found either: the kernel's own plain loops serve the other calls
        state["blas"] = f"{prefix}builtin"
    else:
        state["blas"] = "reference"
    return state["blas"]


def _keep_buffers_on_heap() -> None:
    """Keep MLX's CPU buffers on glibc's heap instead of a fresh ``mmap`` each.

    MLX's CPU allocator keeps no cache, and glibc serves every request from 128 KiB up (one row of logits
    already) with a new mapping that it unmaps on free, so each decode call page-faults and the kernel zeroes
    every page of its larger buffers again. With the thresholds raised, freed buffers are reused: a 16-row PTP
    call measured 2.0-2.1 plain steps instead of 2.2-2.4 here (docs/results/kernel/). Applies to the whole
    process (mlx-lm's steps too). ``PTP_MLX_MALLOC=default`` leaves glibc's settings alone."""
    if os.environ.get("PTP_MLX_MALLOC", "").strip().lower() in ("0", "off", "default"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    if mallopt(m_mmap_threshold, 256 << 20) and mallopt(m_trim_threshold, 1 << 30):
        state["malloc"] = "heap"


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
