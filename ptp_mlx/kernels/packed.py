"""Packed weights for ptp-sgemm: the codes of float32 matrices that came from a quantized file (``packed.c``).

A model converted from a quantized GGUF to float32 (the default model) holds, in every group of 32 values along
a row, at most 16 (Q4_1) or 256 (Q8_0) distinct values: ``w = q * d + m`` for an integer code ``q`` and a scale
``d`` and offset ``m`` per group, each a float16 value, so ``q * d`` is exact in float32 and ``w`` is one
rounding of ``q * d + m``. ``find_codes`` recovers ``q``, ``d`` and ``m`` from the floats alone and checks that
they give back every value bit for bit; ptp-sgemm then computes products over that matrix from its codes (4.5 or
8.25 bits a weight instead of 32), with each weight rebuilt exactly, so every result keeps its bits. A matrix
where any group fails the check is left as it is.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import weakref
from pathlib import Path

import numpy as np

GROUP = 32
# (bits, how each group's offset is found): Q4_1's offset is its group's minimum (code 0); Q8_0 is symmetric
# (w = d * c, c in -128..127), written here as code c + 128 with offset -128 d.
FORMATS = (4, 8)
_NEIGHBOURS = 3  # float16 steps either side of the estimated scale that are tried
SAMPLE_ROWS = 4  # rows checked first: a matrix whose first rows are not codes is passed over at once


def _fp16_candidates(est: np.ndarray) -> list[np.ndarray]:
    """float16 values near ``est`` (as float32), nearest first, for every group at once."""
    base = est.astype(np.float16)
    out = [base.astype(np.float32)]
    up, down = base, base
    for _ in range(_NEIGHBOURS):
        up = np.nextafter(up, np.float16(np.inf))
        down = np.nextafter(down, np.float16(-np.inf))
        out += [up.astype(np.float32), down.astype(np.float32)]
    return out


def _fit(g: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(codes uint8 [G, 32], d [G], m [G]) with ``fma(codes, d, m) == g`` bit for bit for every group of ``g``
    [G, 32] float32, or None where some group has no such form."""
    qmax = (1 << bits) - 1
    if bits == 4:
        m = g.min(axis=1)
        est = (g.max(axis=1) - m) / np.float32(qmax)
    else:
        est = np.abs(g).max(axis=1) / np.float32(127)
    codes = np.zeros(g.shape, np.uint8)
    d_out = np.zeros(g.shape[0], np.float32)
    m_out = np.zeros(g.shape[0], np.float32)
    todo = np.ones(g.shape[0], bool)
    for d in _fp16_candidates(est):
        idx = np.flatnonzero(todo)
        if idx.size == 0:
            break
        dd = d[idx]
        mm = m[idx] if bits == 4 else np.float32(-128) * dd
        ok_d = np.isfinite(dd) & (dd > 0)
        safe = np.where(ok_d, dd, np.float32(1))
        q = np.rint((g[idx] - mm[:, None]) / safe[:, None])
        q = np.clip(q, 0, qmax).astype(np.float32)
        back = (q * safe[:, None]).astype(np.float32) + mm[:, None]  # q * d is exact: one rounding, as an fma's
        ok = ok_d & np.all(back == g[idx], axis=1)
        hit = idx[ok]
        codes[hit] = q[ok].astype(np.uint8)
        d_out[hit], m_out[hit] = dd[ok], mm[ok]
        todo[hit] = False
    # a constant group (d = 0 estimated): every code 0 and d 1 give m exactly
    const = todo & (g.max(axis=1) == g.min(axis=1))
    if bits == 4 and const.any():
        codes[const], d_out[const], m_out[const] = 0, 1.0, g[const, 0]
        todo &= ~const
    return None if todo.any() else (codes, d_out, m_out)


def find_codes(w: np.ndarray) -> tuple[int, np.ndarray] | None:
    """(bits, packed rows uint8 [N, K/32 * gbytes]) for a float32 [N, K] matrix whose every group of 32 values
    is exactly a 4- or 8-bit affine code (``packed.c`` gives the layout), else None."""
    if w.dtype != np.float32 or w.ndim != 2 or w.shape[1] % GROUP or not np.all(np.isfinite(w)):
        return None
    N, K = w.shape
    g = np.ascontiguousarray(w).reshape(-1, GROUP)
    for bits in FORMATS:
        if bits == 4 and not _at_most_16(g):
            continue
        fit = _fit(g, bits)
        if fit is None:
            continue
        codes, d, m = fit
        if bits == 4:
            body = (codes[:, :16] | (codes[:, 16:] << 4)).astype(np.uint8)
        else:
            body = codes
        dm = np.stack([d, m], axis=1).astype(np.float32).view(np.uint8)
        rows = np.concatenate([body, dm], axis=1).reshape(N, -1)
        return bits, np.ascontiguousarray(rows)
    return None


def halves(w: np.ndarray) -> np.ndarray | None:
    """Packed rows uint8 [N, 2K] ("16 bits": each value's high half) for a float32 [N, K] matrix (K a multiple of
    32) whose every value is a bfloat16 number, else None."""
    if w.dtype != np.float32 or w.ndim != 2 or w.shape[1] % GROUP or not w.flags.c_contiguous:
        return None
    u = w.view(np.uint32)
    if np.any(u & 0xFFFF):
        return None
    return np.ascontiguousarray((u >> 16).astype(np.uint16)).view(np.uint8)


def decode(bits: int, rows: np.ndarray, K: int) -> np.ndarray:
    """The float32 rows that packed ``rows`` stand for (``fma(code, d, m)``; ``q * d`` is exact, so the product
    then the sum rounds as the fma does; 16 bits: the high halves, widened)."""
    if bits == 16:
        r = np.ascontiguousarray(rows).view(np.uint16).astype(np.uint32) << 16
        return r.view(np.float32).reshape(np.asarray(rows).shape[0], K)
    gb = bits * 4 + 8
    g = np.asarray(rows).reshape(-1, gb)
    if bits == 4:
        body = g[:, :16]
        codes = np.concatenate([body & 15, body >> 4], axis=1)
    else:
        codes = g[:, :32]
    dm = np.ascontiguousarray(g[:, bits * 4 :]).view(np.float32)
    w = (codes.astype(np.float32) * dm[:, :1]).astype(np.float32) + dm[:, 1:]
    return w.reshape(np.asarray(rows).shape[0], K)


def gguf_round_trip(w: np.ndarray, bits: int) -> np.ndarray:
    """``w`` (float32 [N, K], K a multiple of 32) quantized as a GGUF file holds it (bits 4: Q4_1, the group's
    minimum as offset; bits 8: Q8_0, symmetric) and converted back to float32, as the default model's weights
    were: a random-weight model of its shape then reads from codes too (``ptp-bench --cost-sweep``)."""
    N, K = w.shape
    g = np.asarray(w, np.float32).reshape(-1, GROUP)
    if bits == 4:
        m = g.min(axis=1).astype(np.float16).astype(np.float32)
        d = ((g.max(axis=1) - m) / np.float32(15)).astype(np.float16).astype(np.float32)
        qmax, lo = 15, 0
    else:
        d = (np.abs(g).max(axis=1) / np.float32(127)).astype(np.float16).astype(np.float32)
        m, qmax, lo = np.float32(-128) * d, 255, 1  # code 0 (-128) unused, as a Q8_0 quantizer leaves it
    d = np.where(d > 0, d, np.float32(1))
    q = np.clip(np.rint((g - m[:, None]) / d[:, None]), lo, qmax).astype(np.float32)
    return np.ascontiguousarray(((q * d[:, None]).astype(np.float32) + m[:, None]).reshape(N, K))


def _at_most_16(g: np.ndarray) -> bool:
    """Whether every group holds at most 16 distinct values (sorted rows: count the steps)."""
    s = np.sort(g, axis=1)
    return bool(np.all((np.diff(s, axis=1) != 0).sum(axis=1) < 16))


class Registry:
    """The codes this process registered with ptp-sgemm. Each entry keeps the float32 array it stands for alive
    as long as it is registered, so its memory can never be freed and reused under the codes."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.ptp_sgemm_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.ptp_sgemm_unpack.argtypes = [ctypes.c_void_p]
        lib.ptp_sgemm_packed_hits.restype = ctypes.c_ulonglong
        self.kept: dict[int, tuple] = {}

    def register(self, array, view: np.ndarray, bits: int, rows: np.ndarray) -> bool:
        """Register ``rows`` (the codes of ``view``, a zero-copy numpy view of the float32 ``array``)."""
        ptr = view.ctypes.data
        if not self.lib.ptp_sgemm_pack(ptr, view.shape[0], view.shape[1], bits, rows.ctypes.data):
            return False
        self.kept[ptr] = (array, rows, bits)
        return True

    def unregister(self, ptr: int) -> None:
        """Forget the matrix at ``ptr``: products over it read its floats again."""
        self.lib.ptp_sgemm_unpack(ptr)  # (before the arrays can be freed)
        self.kept.pop(ptr, None)


_registry: list[Registry] = []


def registry() -> Registry | None:
    """The process's registry, where ptp-sgemm is loaded and computes products from codes (its AVX-512 path)."""
    from .. import blas

    lib = blas.kernel()
    if lib is None or not hasattr(lib, "ptp_sgemm_packs") or not lib.ptp_sgemm_packs():
        return None
    if not _registry:
        _registry.append(Registry(lib))
    return _registry[0]


def packed_count() -> int:
    """How many matrices ptp-sgemm reads from 4- or 8-bit codes now (0 where it cannot; bfloat16 halves not
    counted)."""
    reg = _registry[0] if _registry else None
    return 0 if reg is None else sum(1 for kept in reg.kept.values() if kept[2] in FORMATS)


def registered(matrices) -> int:
    """How many of ``matrices`` ptp-sgemm reads from 4- or 8-bit codes (a model's own, whatever else the process
    registered: what its cost curve depends on)."""
    reg = _registry[0] if _registry else None
    if reg is None:
        return 0
    n = 0
    for w in matrices:
        kept = reg.kept.get(np.asarray(memoryview(w)).ctypes.data)
        n += kept is not None and kept[2] in FORMATS
    return n


def enabled() -> bool:
    """Whether models register their codes: unless ``PTP_MLX_PACKED=0``."""
    return os.environ.get("PTP_MLX_PACKED", "1").lower() not in ("0", "false", "no", "off")


def _cached_codes(view: np.ndarray, folder: Path, notice=lambda: None) -> tuple[int, np.ndarray] | None:
    """``find_codes(view)``, kept in ``folder`` under the matrix's content hash (a later start reads it);
    ``notice()`` is called before codes are looked for."""
    key = hashlib.sha1(memoryview(np.ascontiguousarray(view)).cast("B")).hexdigest()
    key += f"-{view.shape[0]}x{view.shape[1]}"
    for bits in FORMATS:
        path = folder / f"{key}-q{bits}.npy"
        if path.is_file():
            try:
                rows = np.load(path, mmap_mode="r")
            except (OSError, ValueError):
                break
            if _agrees(view, bits, rows):
                return bits, rows
            break  # a file that does not give back the floats: found again below
    if (folder / f"{key}-none").is_file():
        return None
    notice()
    found = find_codes(view)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{key}-q{found[0]}.npy" if found else f"{key}-none"
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        with os.fdopen(fd, "wb") as f:
            if found:
                np.save(f, found[1])
        os.replace(tmp, folder / name)
    except OSError:
        pass  # no cache: the next start finds the codes again
    return found


def _agrees(view: np.ndarray, bits: int, rows: np.ndarray) -> bool:
    """Whether cached codes have the matrix's shape and give back its first, middle and last rows bit for bit."""
    N, K = view.shape
    if rows.dtype != np.uint8 or rows.shape != (N, K // GROUP * (bits * 4 + 8)):
        return False
    pick = sorted({0, N // 2, N - 1})
    back = decode(bits, np.asarray(rows[pick]), K)
    return bool(np.array_equal(back.view(np.uint32), view[pick].view(np.uint32)))


def pack_model(matrices, cache: bool = True, log=None) -> int:
    """Register with ptp-sgemm the codes of every float32 matrix in ``matrices`` (``model.layers.weight_matrices``)
    that has them; returns how many. ``cache``: keep what was found under ``PTP_MLX_HOME/packed`` (not for
    throw-away weights). ``log``: told once when codes are looked for rather than read from the cache (a first
    start: a few seconds for the default model). Nothing where ptp-sgemm cannot read codes, on another device, or with
    ``PTP_MLX_PACKED=0``. Results keep their bits either way; products over registered matrices read less."""
    from ..paths import cache_root

    folder = cache_root() / "packed"
    told = []

    def notice() -> None:
        if log is not None and not told:
            told.append(True)
            log("finding the weights' 4-bit codes once (a few seconds; kept under PTP_MLX_HOME/packed)...")

    def codes(view: np.ndarray) -> tuple[int, np.ndarray] | None:
        if find_codes(view[:SAMPLE_ROWS]) is None:
            return None  # not codes (a model that never was a quantized file): no hashing, no search, no cache file
        return _cached_codes(view, folder, notice) if cache else find_codes(view)

    return _register_each(matrices, codes)


def pack_halves(matrices) -> int:
    """Register with ptp-sgemm, at 16 bits a value, every float32 matrix in ``matrices`` whose values are all
    bfloat16 numbers (a fused group's adapter ``A`` rows, held at that precision: ``model/fused.py``); returns how
    many. Found in one pass over the bits, so nothing is cached. Nothing where ptp-sgemm cannot read codes or
    with ``PTP_MLX_PACKED=0``; products keep their bits either way."""

    def bf16(view: np.ndarray) -> tuple[int, np.ndarray] | None:
        rows = halves(view)
        return None if rows is None else (16, rows)

    return _register_each(matrices, bf16)


def _register_each(matrices, find) -> int:
    """Register each float32 matrix of ``matrices`` for which ``find(view)`` gives ``(bits, packed rows)`` (``view``:
    a zero-copy numpy view, the very memory MLX hands to cblas_sgemm); how many. Nothing where ptp-sgemm cannot
    read codes, on another device, or with ``PTP_MLX_PACKED=0``."""
    import mlx.core as mx

    reg = registry() if enabled() and mx.default_device() == mx.cpu else None
    n = 0
    for w in matrices if reg is not None else ():
        if w.dtype != mx.float32 or w.ndim != 2:
            continue
        mx.eval(w)
        view = np.asarray(memoryview(w))
        if not view.flags.c_contiguous or view.ctypes.data in reg.kept:
            continue
        found = find(view)
        if found is not None and reg.register(w, view, found[0], found[1]):
            n += 1
    return n


def release_with(owner, matrices) -> None:
    """Unregister ``matrices`` once ``owner`` (the model they belong to) is collected: the registry holds each
    registered array, so without this a process that loads model after model (a server, the trainer's benches,
    the tests) would keep every one of them in memory. Their addresses are taken now: the finalizer may run on
    another thread (or at exit), where the arrays' stream is not known, so it calls nothing of MLX's."""
    reg = _registry[0] if _registry else None
    if reg is not None:
        ptrs = [p for p in (np.asarray(memoryview(w)).ctypes.data for w in matrices) if p in reg.kept]
        weakref.finalize(owner, _forget, reg, ptrs)


def _forget(reg: Registry, ptrs: list[int]) -> None:
    for ptr in ptrs:
        if ptr in reg.kept:
            reg.unregister(ptr)


def unpack_model(matrices) -> None:
    """Unregister the codes of ``matrices`` (what ``pack_model`` registered): their arrays can then be freed."""
    reg = _registry[0] if _registry else None
    for w in matrices if reg is not None else ():
        ptr = np.asarray(memoryview(w)).ctypes.data
        if ptr in reg.kept:
            reg.unregister(ptr)
