"""ptp-mlx's CPU primitives: a fused projection group and its gated LoRA (``gated_linear.cpp``), a layer's
attention over our K/V state (``attention.cpp``), SwiGLU, RMS norm and a table RoPE (``rowwise.cpp``), what a
call reads from its auxiliary rows' logits (``heads.cpp``) and the sampler's passes over a row (``picks.cpp``),
each one MLX primitive on the CPU.

Each source says why. They are one MLX C++ extension, built at first use with CMake and nanobind (the
nanobind whose internals MLX's own bindings were built with, so arrays pass between the two) into
``<PTP_MLX_HOME>/kernels/cpu_ops-<hash>-<cpu>.so``; the hash covers the sources, MLX's and nanobind's
versions and the Python, the CPU key what ``-march=native`` targets. Only Linux (where MLX runs on the CPU and
``ptp_mlx/blas.py`` placed the sgemm both use); with no compiler, CMake or nanobind, or where the built module
does not pass its own check, decoding keeps the graph form with one notice (``PTP_MLX_GATED=0`` skips it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import NO_COMPILER, NO_COMPILER_NOTICE, cpu_key, find_compiler, kernel_dir, notice_once, shared_path

SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in ("gated_linear.cpp", "attention.cpp", "rowwise.cpp", "heads.cpp", "linear.cpp", "block.cpp", "picks.cpp")
)
HEADERS = tuple(Path(__file__).with_name(n) for n in ("cpu_ops.h", "simd16.h"))
MODULE = "_ptp_cpu_ops"
FLAGS = ["-O3", "-march=native"]
CMAKE = """cmake_minimum_required(VERSION 3.18)
project(ptp_gated_linear LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
find_package(Python 3.10 COMPONENTS Interpreter Development.Module REQUIRED)
find_package(nanobind CONFIG REQUIRED)
find_package(MLX CONFIG REQUIRED)
nanobind_add_module({module} NB_STATIC NOMINSIZE NB_DOMAIN mlx {sources})
target_link_libraries({module} PRIVATE mlx)
target_compile_options({module} PRIVATE {flags})
set_target_properties({module} PROPERTIES BUILD_RPATH "{mlx_lib}")
"""

_state: dict = {"module": None, "tried": False, "why": ""}


def _versions() -> tuple[str, str] | None:
    try:
        import mlx.core as mx
        import nanobind
    except ImportError:
        return None
    return mx.__version__, nanobind.__version__


@dataclass(frozen=True)
class ModuleSpec:
    """One MLX C++ extension this package builds at first use: its sources, headers, module name, compile flags,
    the prefix of its library's name and whether it is built on Linux only (CPU kernels) or wherever MLX runs."""

    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    module: str
    flags: tuple[str, ...]
    prefix: str
    linux_only: bool = True

    def library_name(self) -> str | None:
        versions = _versions()
        if versions is None:
            return None
        tag = "|".join([*versions, sys.version, " ".join(self.flags)])
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in self.sources + self.headers) + tag.encode())
        cpu = cpu_key() if "-march=native" in self.flags else platform.machine()
        return f"{self.prefix}-{digest.hexdigest()[:12]}-{cpu}.so"


CPU_OPS = ModuleSpec(SOURCES, HEADERS, MODULE, tuple(FLAGS), "cpu_ops")


def library_name() -> str | None:
    return CPU_OPS.library_name()


def _cxx() -> str | None:
    """The C++ compiler CMake would take: ``$CXX``, else the first of c++, g++, clang++ on ``PATH``."""
    for name in os.environ.get("CXX", "").split()[:1] + ["c++", "g++", "clang++"]:
        if shutil.which(name):
            return name
    return None


def _cmake() -> str | None:
    """The system's cmake, else the one the ``cmake`` wheel (a Linux dependency) brings."""
    found = shutil.which("cmake")
    if found:
        return found
    try:
        from cmake import CMAKE_BIN_DIR
    except ImportError:
        return None
    path = Path(CMAKE_BIN_DIR) / "cmake"
    return str(path) if path.is_file() else None


def _run(cmd: list[str], cwd: Path) -> str:
    """Run a build step; "" or a one-line reason."""
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{Path(cmd[0]).name} failed to run: {type(e).__name__}"
    if r.returncode == 0:
        return ""
    text = (r.stderr + "\n" + r.stdout).splitlines()
    first = next((x for x in text if "error" in x.lower()), "") or (text[0] if text else "")
    return f"{Path(cmd[0]).name} failed: {first.strip()[:200]}"


def build(force: bool = False, spec: ModuleSpec = CPU_OPS) -> tuple[str | None, str]:
    """The path of the built module (``spec``: the CPU primitives by default), building it if needed, and ""; or
    None and a one-line reason.

    The build happens in a private temporary folder and the module is renamed into place, so a reader only
    ever sees a complete one; a failed toolchain is recorded beside it and not retried at every start."""
    if spec.linux_only and not sys.platform.startswith("linux"):
        return None, "built on Linux only (elsewhere MLX runs on its GPU)"
    missing = [p.name for p in spec.sources + spec.headers if not p.is_file()]
    if missing:
        return None, f"{', '.join(missing)} missing from the installed package"
    name = spec.library_name()
    if name is None:
        return None, "nanobind is not installed"
    target, shared = kernel_dir() / name, shared_path(name)
    if not force:
        for path in (target, shared):
            if path is not None and path.is_file():
                return str(path), ""
    # A process with its own PTP_MLX_HOME (each test has one) builds into the default cache root, where the
    # next such process finds it: eleven seconds once, not per process.
    target = shared or target
    if _cxx() is None:
        return None, NO_COMPILER if find_compiler() is None else "no C++ compiler found (c++, g++ or clang++)"
    if shutil.which("make") is None:
        return None, "no make found (the build program CMake's default generator runs)"
    cmake = _cmake()
    if cmake is None:
        return None, "no cmake found"
    failed = target.with_suffix(".failed")
    if failed.is_file() and not force:  # (recorded once; `python -m ptp_mlx.kernels --force` tries again)
        return None, failed.read_text(errors="replace").strip() + "; `python -m ptp_mlx.kernels --force` retries"
    import mlx.core
    import nanobind

    # (the folder of mlx.core's own module: ``mlx`` is a namespace package, and a folder named mlx on sys.path,
    # such as MLX's own JIT cache in /tmp when a script runs from there, would join its path first)
    mlx_root = Path(mlx.core.__file__).resolve().parent
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=target.parent))
    except OSError as e:
        return None, f"cannot write {target.parent}: {e.strerror or type(e).__name__}"
    try:
        (work / "CMakeLists.txt").write_text(
            CMAKE.format(
                module=spec.module,
                sources=" ".join(f'"{p.resolve()}"' for p in spec.sources),
                flags=" ".join(spec.flags),
                mlx_lib=mlx_root / "lib",
            )
        )
        configure = [
            cmake, "-S", str(work), "-B", str(work / "build"), "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}", f"-Dnanobind_ROOT={nanobind.cmake_dir()}",
            f"-DMLX_ROOT={mlx_root}",
        ]  # fmt: skip
        reason = _run(configure, work) or _run([cmake, "--build", str(work / "build"), "-j", "2"], work)
        built = sorted((work / "build").glob(f"{spec.module}*.so")) if not reason else []
        if not reason and not built:
            reason = "cmake built no module"
        if reason:
            try:
                failed.write_text(reason + "\n")
            except OSError:
                pass
            return None, reason
        tmp = target.with_name(f".{name}.tmp-{os.getpid()}")
        shutil.copyfile(built[0], tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        return str(target), ""
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _self_check(mod) -> str:
    """The module's own check against the graph form on a small case: "" or why it cannot be used."""
    import mlx.core as mx

    x = mx.arange(24, dtype=mx.float32).reshape(1, 3, 8) / 7
    W = mx.cos(mx.arange(6 * 8, dtype=mx.float32)).reshape(6, 8)
    B = mx.sin(mx.arange(2 * 4, dtype=mx.float32)).reshape(2, 4)
    gate = mx.array([0.0, 1.0, 1.0])
    spans = mx.array([[0, 4], [0, 4]], dtype=mx.int32)
    want = x @ W[:4].T + ((x @ W[4:].T) * gate[None, :, None]) @ B
    got = mod.gated_linear(x, W, B, gate, spans, 4)
    if not mx.allclose(got, want, atol=1e-5).item():  # a sync, once per process
        return "its self-check disagreed with the graph form"
    q = mx.sin(mx.arange(1 * 4 * 3 * 8, dtype=mx.float32)).reshape(1, 4, 3, 8)
    k = mx.cos(mx.arange(1 * 2 * 5 * 8, dtype=mx.float32)).reshape(1, 2, 5, 8)
    v = mx.sin(mx.arange(1 * 2 * 5 * 8, dtype=mx.float32) * 0.3).reshape(1, 2, 5, 8)
    sees = mx.arange(5)[None] <= mx.arange(2, 5)[:, None]  # causal: rows at positions 2, 3, 4
    kk, vv = mx.repeat(k, 2, axis=1), mx.repeat(v, 2, axis=1)
    scores = mx.where(sees, (q * 0.5) @ mx.swapaxes(kk, -1, -2), -float("inf"))
    want = mx.softmax(scores, axis=-1) @ vv
    got = mod.attention(q, k, v, 0.5, sees)
    if not mx.allclose(got, want, atol=1e-5).item():  # a sync, once per process
        return "its attention's self-check disagreed with the graph form"
    g = mx.linspace(-30, 30, 37).reshape(1, 37)
    x = mx.cos(mx.arange(37, dtype=mx.float32)).reshape(1, 37)
    if not mx.allclose(mod.swiglu(g, x), g * mx.sigmoid(g) * x, atol=1e-5).item():  # a sync, once per process
        return "its SwiGLU's self-check disagreed with the graph form"
    return ""


def load(spec: ModuleSpec, check) -> tuple[object | None, str]:
    """``spec``'s module, built if needed, loaded and checked (``check(module)``: "" or why it cannot be used), and
    ""; or None and a one-line reason (any failure: these modules are never required)."""
    try:
        path, why = build(spec=spec)
        if path is None:
            return None, why
        found = importlib.util.spec_from_file_location(spec.module, path)
        mod = importlib.util.module_from_spec(found)
        found.loader.exec_module(mod)
        why = check(mod)
        return (None, why) if why else (mod, "")
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def module():
    """The loaded extension (``gated_linear(x, W, B, gate, spans, out, bias=None)``), or None, with one notice
    the first time it cannot be had."""
    if _state["tried"]:
        return _state["module"]
    _state["tried"] = True
    if os.environ.get("PTP_MLX_GATED", "").strip().lower() in ("0", "off", "no", "false"):
        return None
    mod, why = load(CPU_OPS, _self_check)  # (never required: any failure is the notice, and the graph form runs)
    if mod is not None:
        _state["module"] = mod
        return mod
    _state["why"] = why
    if why == NO_COMPILER:  # (one notice for every CPU part a compiler would have built)
        notice_once("no-compiler", NO_COMPILER_NOTICE)
        return None
    print(
        f"notice: ptp-mlx's CPU primitives not built ({why}); the adapter's LoRA, attention, norms and heads run as "
        "graph nodes (slower)",
        file=sys.stderr,
    )
    return None


def gated_state() -> str:
    """``"in use"``, ``"off (<why>)"`` or ``"not tried"``: what a report records."""
    if not _state["tried"]:
        return "not tried"
    return "in use" if _state["module"] is not None else f"off ({_state['why'] or 'PTP_MLX_GATED=0'})"
