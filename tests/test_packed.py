"""Weights read from their codes (ptp_mlx/kernels/packed.c, packed.py): the codes are found only where they give
back every float bit for bit, a product over them equals the float product bit for bit at every width and
offset, cached codes that do not agree are found again, and decoding is token for token the same either way."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from ptp_mlx import blas
from ptp_mlx.kernels import packed
from ptp_mlx.model.layers import weight_matrices
from ptp_mlx.sampler import SamplingSettings


def quantized(shape, bits: int, seed: int = 0) -> np.ndarray:
    """float32 [N, K] as a Q4_1 (bits 4: d and m float16, codes 0..15) or Q8_0 (bits 8: d float16, codes
    -128..127) file dequantizes: one rounding of ``q * d + m``."""
    rng = np.random.default_rng(seed)
    N, K = shape
    G = N * K // 32
    d = (rng.uniform(0.001, 0.05, G)).astype(np.float16).astype(np.float32)
    if bits == 4:
        m = (-rng.uniform(0, 0.5, G)).astype(np.float16).astype(np.float32)
        q = rng.integers(0, 16, (G, 32)).astype(np.float32)
        q[:, 3], q[:, 17] = 0, 15  # as a Q4_1 quantizer gives: its group's minimum is code 0, its maximum 15
        w = (q * d[:, None]).astype(np.float32) + m[:, None]
    else:
        q = rng.integers(-127, 128, (G, 32)).astype(np.float32)
        q[:, 5] = 127 * np.where(rng.random(G) < 0.5, 1, -1)  # a Q8_0 quantizer's: the largest magnitude is 127
        w = (q * d[:, None]).astype(np.float32)
    return np.ascontiguousarray(w.astype(np.float32).reshape(N, K))


def lib_or_skip():
    lib = blas.kernel()
    if lib is None or not lib.ptp_sgemm_packs():
        pytest.skip("ptp-sgemm reads codes on its AVX-512 path only; this process has another")
    return packed.registry()


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_give_back_every_float(bits):
    w = quantized((48, 96), bits)
    found = packed.find_codes(w)
    assert found is not None and found[0] == (4 if bits == 4 else 8)
    back = packed.decode(found[0], found[1], 96)
    assert np.array_equal(back.view(np.uint32), w.view(np.uint32))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_gguf_round_trip_is_read_back_as_codes(bits):
    """What the cost sweep's random models hold (``gguf_round_trip``): within half a step of the weights, and codes."""
    w = np.random.default_rng(2).standard_normal((24, 128)).astype(np.float32)
    q = packed.gguf_round_trip(w, bits)
    step = np.ptp(w.reshape(-1, 32), axis=1) / 15 if bits == 4 else np.abs(w.reshape(-1, 32)).max(axis=1) / 127
    assert np.all(np.abs(q - w).reshape(-1, 32) <= 0.51 * step[:, None] + 1e-3 * np.abs(w).reshape(-1, 32))
    found = packed.find_codes(q)
    assert found is not None and found[0] == bits
    assert np.array_equal(packed.decode(bits, found[1], 128).view(np.uint32), q.view(np.uint32))


def test_matrices_that_are_not_codes_are_left_alone():
    rng = np.random.default_rng(1)
    assert packed.find_codes(rng.standard_normal((16, 64)).astype(np.float32)) is None
    w = quantized((16, 64), 4)
    w[3, 5] = np.nextafter(w[3, 5], np.float32(1))  # one value off its grid: the whole matrix stays floats
    assert packed.find_codes(w) is None
    assert packed.find_codes(quantized((16, 48), 4)[:, :40].copy()) is None  # K not a multiple of 32


def _product(lib, M, x, w_ptr, N, K, out, beta=0.0):
    lib.cblas_sgemm(101, 111, 112, M, N, K, 1.0, x.ctypes.data, K, w_ptr, K, beta, out.ctypes.data, N)


def bfloat16s(w: np.ndarray) -> np.ndarray:
    """``w`` rounded to bfloat16 numbers, as float32 (MLX's rounding, as ``model/fused.py`` holds A)."""
    return np.array(mx.array(w).astype(mx.bfloat16).astype(mx.float32))


def test_bfloat16_values_are_read_back_from_their_halves():
    w = bfloat16s(np.random.default_rng(3).standard_normal((24, 64)).astype(np.float32))
    rows = packed.halves(w)
    assert rows is not None and rows.shape == (24, 128) and rows.dtype == np.uint8
    assert np.array_equal(packed.decode(16, rows, 64).view(np.uint32), w.view(np.uint32))
    w[2, 7] = np.nextafter(w[2, 7], np.float32(9))  # one value that is not a bfloat16: left as floats
    assert packed.halves(w) is None
    assert packed.halves(bfloat16s(np.ones((4, 40), np.float32))) is None  # K not a multiple of 32


@pytest.mark.parametrize("bits,lora", [(4, "floats"), (8, "floats"), (4, "halves")])
def test_products_over_codes_equal_the_float_products_bit_for_bit(bits, lora):
    """Two entries side by side, then a LoRA's A rows: floats, or bfloat16 values registered as halves."""
    reg = lib_or_skip()
    lib = reg.lib
    lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                                     ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    K = 192
    first, second = quantized((200, K), bits, 2), quantized((100, K), bits, 3)
    extra = np.random.default_rng(4).standard_normal((24, K)).astype(np.float32)  # a LoRA's A rows
    if lora == "halves":
        extra = bfloat16s(extra)
    W = np.ascontiguousarray(np.concatenate([first, second, extra]))
    arr = mx.array(W)
    mx.eval(arr)
    view = np.asarray(memoryview(arr))
    for part, lo, hi in ((first, 0, 200), (second, 200, 300)):
        b, rows = packed.find_codes(part)
        assert reg.register(arr, view[lo:hi], b, rows)
    if lora == "halves":
        assert reg.register(arr, view[300:], 16, packed.halves(view[300:]))
    try:
        rng = np.random.default_rng(5)
        hits = lib.ptp_sgemm_packed_hits()
        for M in (1, 2, 3, 4, 5, 7, 8, 9, 12):
            x = rng.standard_normal((M, K)).astype(np.float32)
            # whole matrix (two entries side by side, then floats), one entry from a row offset, a short run
            for r0, N in ((0, 324), (37, 100), (210, 50), (0, 200)):
                ptr = view.ctypes.data + r0 * K * 4
                for beta in (0.0, 1.0):
                    want = rng.standard_normal((M, N)).astype(np.float32)
                    got = want.copy()
                    lib.ptp_sgemm_packed_enable(0)
                    _product(lib, M, x, ptr, N, K, want, beta)
                    lib.ptp_sgemm_packed_enable(1)
                    _product(lib, M, x, ptr, N, K, got, beta)
                    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (M, r0, N, beta)
        assert lib.ptp_sgemm_packed_hits() > hits  # (the codes were read, not only the floats)
        if lora == "halves":  # the A rows alone: read from their halves, the floats' bits
            x, want = rng.standard_normal((3, K)).astype(np.float32), np.zeros((3, 24), np.float32)
            got, hits = want.copy(), lib.ptp_sgemm_packed_hits()
            _product(lib, 3, x, view.ctypes.data + 300 * K * 4, 24, K, got)
            assert lib.ptp_sgemm_packed_hits() == hits + 1
            lib.ptp_sgemm_packed_enable(0)
            _product(lib, 3, x, view.ctypes.data + 300 * K * 4, 24, K, want)
            lib.ptp_sgemm_packed_enable(1)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        one = rng.standard_normal((1, K)).astype(np.float32)
        rows8 = np.concatenate([one, rng.standard_normal((7, K)).astype(np.float32)])
        a, b = np.zeros((1, 300), np.float32), np.zeros((8, 300), np.float32)
        _product(lib, 1, one, view.ctypes.data, 300, K, a)
        _product(lib, 8, rows8, view.ctypes.data, 300, K, b)
        assert np.array_equal(a[0].view(np.uint32), b[0].view(np.uint32))  # a row alone = that row among eight
    finally:
        lib.ptp_sgemm_packed_enable(1)
        for lo in (0, 200, 300):
            reg.unregister(view[lo:].ctypes.data)


def test_cached_codes_are_read_back_and_checked(tmp_path):
    w = quantized((64, 64), 4, 7)
    found = packed._cached_codes(w, tmp_path)
    assert found is not None and len(list(tmp_path.glob("*-q4.npy"))) == 1
    again = packed._cached_codes(w, tmp_path)
    assert again[0] == 4 and np.array_equal(np.asarray(again[1]), found[1])
    path = next(tmp_path.glob("*-q4.npy"))
    bad = np.asarray(found[1]).copy()
    bad[0, 0] ^= 1  # a code of the first row changed: the file no longer gives back the floats
    np.save(path, bad)
    fixed = packed._cached_codes(w, tmp_path)
    assert np.array_equal(np.asarray(fixed[1]), found[1])
    none = packed._cached_codes(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32), tmp_path)
    assert none is None and len(list(tmp_path.glob("*-none"))) == 1


def test_a_first_start_says_it_looks_for_codes_once_and_other_weights_cost_nothing(tmp_path, monkeypatch):
    """``pack_model`` tells its log once when codes are looked for (a cache miss), not when they are read back, and
    passes matrices that are not codes over on their first rows (no hash, no search, no cache file)."""
    lib_or_skip()
    monkeypatch.setenv("PTP_MLX_HOME", str(tmp_path))
    ws = [mx.array(quantized((96, 64), 4, seed)) for seed in (11, 12)]
    plain = mx.array(np.random.default_rng(3).standard_normal((96, 64)).astype(np.float32))
    said: list[str] = []
    try:
        assert packed.pack_model([*ws, plain], log=said.append) == 2
        assert len(said) == 1 and "codes" in said[0]
        packed.unpack_model(ws)
        assert packed.pack_model([*ws, plain], log=said.append) == 2 and len(said) == 1  # read back: silent
        assert len(list((tmp_path / "packed").glob("*"))) == 2  # nothing kept for the plain matrix
    finally:
        packed.unpack_model(ws)


@pytest.fixture(scope="module")
def quantized_model_dir(tmp_path_factory):
    """A tiny model whose every matrix is a Q4_1 file's floats (the embedding a Q8_0's), and an adapter."""
    from ptp_mlx.testing import make_tiny_model, save_random_adapter

    d = tmp_path_factory.mktemp("packed")
    model = make_tiny_model(d / "model", varied=True, seed=5)
    weights = dict(tree_flatten(mx.load(str(model / "model.safetensors"))))
    for i, (k, v) in enumerate(sorted(weights.items())):
        if v.ndim == 2 and v.shape[1] % 32 == 0:
            weights[k] = mx.array(quantized(v.shape, 8 if "embed" in k else 4, i))
    mx.save_safetensors(str(model / "model.safetensors"), weights, metadata={"format": "mlx"})
    return model, save_random_adapter(model, d / "adapter")


def test_switched_off_nothing_is_registered(monkeypatch, quantized_model_dir):
    import mlx_lm

    reg = lib_or_skip()
    model, _ = mlx_lm.load(str(quantized_model_dir[0]))
    monkeypatch.setenv("PTP_MLX_PACKED", "0")
    assert packed.pack_model(weight_matrices(model)) == 0
    monkeypatch.setenv("PTP_MLX_PACKED", "1")
    before = set(reg.kept)
    assert packed.pack_model(weight_matrices(model)) == 2 * 7 + 1  # seven projections a layer and the tied embedding
    for ptr in set(reg.kept) - before:
        reg.unregister(ptr)


@pytest.fixture(scope="module")
def quantized_engine(quantized_model_dir):
    from ptp_mlx.engine import Engine

    model, adapter = quantized_model_dir
    return Engine.load(str(model), str(adapter), measure_cost=False)


@pytest.mark.parametrize("mode", ["ar", "ptp"])
@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_decoding_from_codes_is_token_for_token_decoding_from_floats(quantized_engine, mode, temp):
    reg = lib_or_skip()
    eng = quantized_engine
    assert (
        packed.pack_model(weight_matrices(eng.pm.base)) == 0 and len(reg.kept) >= 2 * 7 + 1
    )  # registered at load, once
    s = SamplingSettings(temperature=temp, seed=11) if temp else SamplingSettings()
    out = {}
    hits = reg.lib.ptp_sgemm_packed_hits()
    for on in (0, 1):
        reg.lib.ptp_sgemm_packed_enable(on)
        try:
            out[on] = [t for st in eng.generate("abc def", mode=mode, sampling=s, max_tokens=24) for t in st.tokens]
        finally:
            reg.lib.ptp_sgemm_packed_enable(1)
    assert reg.lib.ptp_sgemm_packed_hits() > hits
    assert out[1] == out[0] and len(out[0]) > 0


def test_the_bench_header_names_the_matrices_read_from_codes():
    from ptp_mlx.bench.report import _gated_tag

    assert _gated_tag({"gated_linear": "in use", "packed_matrices": 211}) == " + cpu-ops + 211 matrices from codes"
    assert "codes" not in _gated_tag({"gated_linear": "in use", "packed_matrices": 0})
    assert "codes" not in _gated_tag({})  # a JSON written before the field existed


def test_a_models_count_is_its_own_codes_only():
    """The cost curve's key counts the model's own matrices read from codes: neither another model's codes nor
    the adapter's bfloat16 rows (a process that loads several models keeps each one's cached curve)."""
    reg = lib_or_skip()
    mine, other = mx.array(quantized((64, 96), 4, 11)), mx.array(quantized((64, 96), 4, 12))
    lora = mx.array(np.array(mx.array(np.ones((16, 96), np.float32) / 3).astype(mx.bfloat16).astype(mx.float32)))
    assert packed.registered([mine, lora]) == 0
    try:
        assert packed.pack_model([mine, other], cache=False) == 2 and packed.pack_halves([lora]) == 1
        assert packed.registered([mine, lora]) == 1 and packed.registered([other]) == 1
        assert packed.packed_count() >= 2
    finally:
        packed.unpack_model([mine, other, lora])
    assert packed.registered([mine, other]) == 0 and reg is not None


def test_a_models_codes_are_forgotten_with_it():
    """``release_with``: once the model that owns registered matrices is collected, they are unregistered (the
    registry no longer keeps them in memory)."""
    import gc

    lib_or_skip()

    class Owner:
        pass

    owner, w, lora = Owner(), mx.array(quantized((64, 96), 4, 13)), mx.array(np.full((16, 96), 0.5, np.float32))
    assert packed.pack_model([w], cache=False) == 1 and packed.pack_halves([lora]) == 1
    packed.release_with(owner, [w, lora])
    assert packed.registered([w]) == 1
    del owner
    gc.collect()
    assert packed.registered([w]) == 0 and packed.pack_halves([lora]) == 1  # (forgotten: registered anew)
    packed.unpack_model([lora])


def test_the_cost_sweep_prices_the_same_weights_from_codes_then_as_floats(monkeypatch):
    """``ptp-bench --cost-sweep`` gives two lines a shape: calls reading the weights from codes, then the same calls
    with the weights read as floats (the codes let go in between)."""
    from ptp_mlx.bench import sweep

    lib_or_skip()
    w = mx.array(quantized((64, 96), 8, 5))
    seen = []
    monkeypatch.setattr(sweep, "price", lambda pm, context, repeats: seen.append(packed.registered([w])) or {})
    try:
        assert packed.pack_model([w], cache=False) == 1
        assert [name for name, _ in sweep._prices(None, [w], True, 128, 1, "135m")] == ["135m", "135m (floats)"]
        assert seen == [1, 0]
        assert [name for name, _ in sweep._prices(None, [w], False, 128, 1, "135m")] == ["135m"]
    finally:
        packed.unpack_model([w])


def test_a_matrix_forgotten_while_a_product_reads_its_codes_waits_for_it():
    """``ptp_sgemm_unpack`` returns only once no product still reads the codes it found (the caller frees them
    next): products run on another thread while the codes are forgotten and then overwritten with garbage, and
    every product still equals the float product (a model released while a step of it computed crashed at exit)."""
    import threading
    import time

    reg = lib_or_skip()
    lib = reg.lib
    lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                                     ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    N, K, M = 4096, 1024, 8
    arr = mx.array(quantized((N, K), 4, 7))
    mx.eval(arr)
    view = np.asarray(memoryview(arr))
    bits, rows = packed.find_codes(view)
    x = np.random.default_rng(8).standard_normal((M, K)).astype(np.float32)
    want = np.zeros((M, N), np.float32)
    lib.ptp_sgemm_packed_enable(0)
    _product(lib, M, x, view.ctypes.data, N, K, want)
    lib.ptp_sgemm_packed_enable(1)
    outs = [np.zeros((M, N), np.float32) for _ in range(40)]
    assert reg.register(arr, view, bits, rows)
    hits = lib.ptp_sgemm_packed_hits()
    started = threading.Event()

    def products():
        for out in outs:
            started.set()
            _product(lib, M, x, view.ctypes.data, N, K, out)  # (ctypes lets go of the GIL meanwhile)

    worker = threading.Thread(target=products)
    worker.start()
    try:
        started.wait()
        time.sleep(0.002)
        reg.unregister(view.ctypes.data)
        rows[:] = 0xFF  # (the codes freed and reused: NaN scales for any product that still read them)
    finally:
        worker.join()
    assert lib.ptp_sgemm_packed_hits() > hits  # (products read the codes before they were forgotten)
    for out in outs:
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
