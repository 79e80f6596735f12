"""ptp-gated-linear (ptp_mlx/kernels/gated_linear.cpp): a fused group and its gated LoRA in one primitive.

Token rows must be bit for bit the plain product (MLX's own ``x @ W[:N].T``, or ``addmm`` with a bias), auxiliary
rows the graph form's delta to rounding, in eager and compiled calls; the fused model uses it; and where it
cannot be built, decoding keeps the graph form with one notice."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import ptp_mlx  # noqa: F401  (the sgemm before MLX)

# isort: split
import mlx.core as mx

from ptp_mlx import blas
from ptp_mlx.kernels import extension
from ptp_mlx.model.fused import _spans

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="built on Linux only")


@pytest.fixture(scope="module")
def gl():
    mod = extension.module()
    if mod is None:
        pytest.skip(f"ptp-gated-linear not available here: {extension._state['why']}")
    return mod


def _group(rng, k_in: int, outs: list[int], rank: int):
    """A fused matrix [sum(outs) + R, in] and its block-diagonal B [R, sum(outs)] (rank per projection)."""
    n = sum(outs)
    W = rng.standard_normal((n + rank * len(outs), k_in)).astype(np.float32) * 0.05
    B = np.zeros((rank * len(outs), n), np.float32)
    col = 0
    for p, o in enumerate(outs):
        B[p * rank : (p + 1) * rank, col : col + o] = rng.standard_normal((rank, o)) * 0.05
        col += o
    return mx.array(W), mx.array(B), n


@pytest.fixture(params=["ptp-sgemm", "forwarded"])
def served(request):
    """The products by ptp-sgemm (the LoRA's A rows folded into the projection's call) and, where that library is
    loaded, with it switched off (every product forwarded to the BLAS: A in a call of its own)."""
    lib = blas.kernel()
    if request.param == "forwarded":
        if lib is None:
            pytest.skip("ptp-sgemm is not loaded: every product is forwarded already")
        lib.ptp_sgemm_enable(0)
    yield request.param
    if lib is not None:
        lib.ptp_sgemm_enable(1)


@linux
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layout", ["tokens first", "interleaved"])
@pytest.mark.parametrize("b_dtype", ["float32", "bfloat16"])
def test_token_rows_are_the_plain_product_and_aux_rows_the_graph_delta(gl, served, rows, with_bias, layout, b_dtype):
    """Auxiliary rows together after the token rows or in any order; A computed folded into the projection's
    call or alone; B as float32 or as bfloat16 (what the fused model passes: the graph form then uses the same
    values widened)."""
    rng = np.random.default_rng(rows)
    W, B, n = _group(rng, 96, [40, 24, 24], 8)
    B_in = B.astype(getattr(mx, b_dtype))
    B = B_in.astype(mx.float32)
    bias = mx.array(rng.standard_normal(n).astype(np.float32)) if with_bias else None
    x = mx.array(rng.standard_normal((1, rows, 96)).astype(np.float32))
    tokens = (lambda i: i < (rows + 1) // 2) if layout == "tokens first" else (lambda i: i % 3 == 0)
    gate = mx.array([0.0 if tokens(i) else 1.0 for i in range(rows)])
    plain = x @ W[:n].T if bias is None else mx.addmm(bias, x, W[:n].T)
    z, a = mx.split(x @ W.T, [n], axis=-1)
    graph = (z if bias is None else z + bias) + (a * gate[None, :, None]) @ B
    for run in (gl.gated_linear, mx.compile(gl.gated_linear)):
        y = run(x, W, B_in, gate, _spans(B), n, bias)
        assert y.shape == (1, rows, n)
        for i in range(rows):
            if gate[i].item() == 0:
                assert mx.array_equal(y[0, i], plain[0, i]).item(), f"token row {i} is not the plain product"
            else:
                assert mx.allclose(y[0, i], graph[0, i], atol=1e-5, rtol=1e-5).item(), f"aux row {i}"
                assert not mx.array_equal(y[0, i], plain[0, i]).item()  # the delta is there


@linux
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_parts_are_the_groups_columns_bit_for_bit(gl, rows):
    """``gated_linear_parts``: one output per projection, each exactly its columns of the group's output (the
    gate as the call passes it, [1, rows, 1]); a layer's group is then one node, with no split after it."""
    rng = np.random.default_rng(10 + rows)
    W, B, n = _group(rng, 96, [40, 24, 24], 8)
    bias = mx.array(rng.standard_normal(n).astype(np.float32))
    x = mx.array(rng.standard_normal((1, rows, 96)).astype(np.float32))
    gate = mx.array([[[0.0 if i < (rows + 1) // 2 else 1.0] for i in range(rows)]])
    for b in (None, bias):
        whole = gl.gated_linear(x, W, B, gate.reshape(-1), _spans(B), n, b)
        parts = gl.gated_linear_parts(x, W, B, gate, _spans(B), [40, 24, 24], b)
        assert [p.shape for p in parts] == [(1, rows, 40), (1, rows, 24), (1, rows, 24)]
        for p, (lo, hi) in zip(parts, ((0, 40), (40, 64), (64, 88)), strict=True):
            assert np.array_equal(np.array(p).view(np.uint32), np.array(whole[..., lo:hi]).view(np.uint32))
    with pytest.raises(ValueError, match="every output width is positive"):
        gl.gated_linear_parts(x, W, B, gate, _spans(B), [88, 0], None)


@linux
@pytest.mark.parametrize("rows", [3, 9, 70])
@pytest.mark.parametrize("b_dtype", ["float32", "bfloat16"])
def test_the_delta_on_two_threads_is_the_delta_on_one_bit_for_bit(gl, rows, b_dtype, monkeypatch):
    """The delta's columns split between ptp-sgemm's two threads (at a multiple of 16 near the middle) give every
    element the bits one thread gives: spans of odd widths, rank rows of one projection whose spans differ at their
    edges (zeros there) on both sides of the split, more than 16 ranks to a span (two blocks of them), and more than
    64 auxiliary rows (taken in slices)."""
    rng = np.random.default_rng(30 + rows)
    W, B, n = _group(rng, 64, [40, 72, 8], 20)
    b = np.array(B)
    b[0, :5] = 0  # (the first projection's first rank starts later)
    b[21, 40:47], b[22, 100:112] = 0, 0  # (the second's: one starts later, one ends sooner; the split is at 48)
    B = mx.array(b)
    B_in = B.astype(getattr(mx, b_dtype))
    x = mx.array(rng.standard_normal((1, rows, 64)).astype(np.float32))
    gate = mx.array([0.0 if i % 4 == 0 else 1.0 for i in range(rows)])
    both = gl.gated_linear(x, W, B_in, gate, _spans(B), n)
    monkeypatch.setenv("PTP_MLX_DELTA_THREADS", "1")
    one = gl.gated_linear(x, W, B_in, gate, _spans(B), n)
    assert np.array_equal(np.array(both).view(np.uint32), np.array(one).view(np.uint32))
    z, a = mx.split(x @ W.T, [n], axis=-1)
    graph = z + (a * gate[None, :, None]) @ B_in.astype(mx.float32)
    assert mx.allclose(both, graph, atol=1e-5, rtol=1e-5).item()


@linux
def test_a_strided_input_and_a_fractional_gate(gl):
    rng = np.random.default_rng(7)
    W, B, n = _group(rng, 32, [16, 16], 4)
    xt = mx.array(rng.standard_normal((32, 4)).astype(np.float32)).T[None]  # a transposed view, [1, 4, 32]
    gate = mx.array([0.0, 0.5, 1.0, 2.0])
    y = gl.gated_linear(xt, W, B, gate, _spans(B), n)
    z, a = mx.split(xt @ W.T, [n], axis=-1)
    assert mx.allclose(y, z + (a * gate[None, :, None]) @ B, atol=1e-5).item()


@linux
def test_bad_operands_are_one_clear_error(gl):
    W, B, n = _group(np.random.default_rng(0), 16, [8], 2)
    with pytest.raises(ValueError, match="one gate per row"):
        gl.gated_linear(mx.zeros((1, 3, 16)), W, B, mx.zeros((2,)), _spans(B), n)
    with pytest.raises(ValueError, match="float32"):
        gl.gated_linear(mx.zeros((1, 3, 16), mx.float16), W, B, mx.zeros((3,)), _spans(B), n)


def test_spans_mark_where_each_rank_row_is_not_zero():
    B = np.zeros((3, 10), np.float32)
    B[0, 2:5] = 1
    B[1, 7] = -1  # row 2 stays zero
    assert np.array(_spans(mx.array(B))).tolist() == [[2, 5], [7, 8], [0, 0]]


@linux
def test_without_cmake_decoding_keeps_the_graph_form_with_one_notice(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PTP_MLX_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(extension, "shared_path", lambda name: None)
    monkeypatch.setattr(extension, "_cmake", lambda: None)
    monkeypatch.setattr(extension, "_state", {"module": None, "tried": False, "why": ""})
    assert extension.build() == (None, "no cmake found")
    assert extension.module() is None and extension.module() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "notice: ptp-mlx's CPU primitives not built (no cmake found); the adapter's LoRA, attention, norms and heads "
        "run as graph nodes (slower)"
    ]
    assert extension.gated_state() == "off (no cmake found)"


@linux
def test_the_fused_default_model_runs_its_groups_as_one_primitive(gl, default_model_dir):
    from ptp_mlx.engine import Engine

    engine = Engine.load(measure_cost=False)  # the default model with its shipped adapter
    groups = {m.group for layer in engine.pm.base.layers for m in _patched(layer)}
    assert groups and all(g.gated is gl for g in groups if g is not None)


def _patched(layer):
    from ptp_mlx.model.layers import projection_modules

    return [m for mods in projection_modules(layer) for m in mods.values()]


@linux
def test_cmake_comes_from_the_wheel_where_the_system_has_none(monkeypatch):
    pytest.importorskip("cmake")
    monkeypatch.setattr(extension.shutil, "which", lambda name: None)
    path = extension._cmake()
    assert path is not None and path.endswith("cmake")


@linux
def test_mlx_is_found_by_its_core_module_not_a_folder_named_mlx(tmp_path, monkeypatch):
    """``mlx`` is a namespace package: a folder named mlx first on sys.path (MLX's own JIT cache, /tmp/mlx, when a
    script runs from /tmp) joins its path, and CMake was pointed there (the build failed)."""
    (tmp_path / "mlx").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PTP_MLX_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(extension, "shared_path", lambda name: None)
    monkeypatch.setattr(extension, "kernel_dir", lambda: tmp_path / "kernels")
    seen = []
    monkeypatch.setattr(extension, "_run", lambda cmd, cwd: seen.append(cmd) or "stopped here")
    assert extension.build() == (None, "stopped here")
    root = next(a for a in seen[0] if a.startswith("-DMLX_ROOT="))
    assert root == f"-DMLX_ROOT={Path(mx.__file__).resolve().parent}"


@linux
def test_a_recorded_failure_says_how_to_retry(tmp_path, monkeypatch):
    monkeypatch.setattr(extension, "shared_path", lambda name: None)
    monkeypatch.setattr(extension, "kernel_dir", lambda: tmp_path)
    monkeypatch.setattr(extension, "_cmake", lambda: "cmake")
    (tmp_path / extension.library_name()).with_suffix(".failed").write_text("cmake failed: no MLX\n")
    path, why = extension.build()
    assert path is None and why == "cmake failed: no MLX; `python -m ptp_mlx.kernels --force` retries"
