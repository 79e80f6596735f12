"""The BLAS MLX really calls on Linux: an optimised one from the package index, never silently the reference one."""

import subprocess
import sys

import pytest

PROBE = (
    "import ptp_mlx, mlx.core as mx; from ptp_mlx import blas; "
    "a = mx.ones((64, 64)); mx.eval(a @ a); print(blas.state['blas']); print(blas.provider_of_sgemm())"
)
linux_cpu_wheel = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's Linux CPU wheel only")


def _probe(monkeypatch, env: dict) -> list[str]:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()


@linux_cpu_wheel
def test_mlx_calls_an_optimised_blas_by_default(monkeypatch):
    monkeypatch.delenv("PTP_MLX_BLAS", raising=False)
    name, provider = _probe(monkeypatch, {})
    if name == "default":
        pytest.skip("this MLX does not use the reference BLAS")
    assert name != "reference", "no optimised BLAS was found (the mkl wheel is a Linux x86_64 dependency)"
    # The first cblas_sgemm in the global scope is what MLX binds to: ptp-sgemm where it was built (it forwards
    # the wide products to the library), else the library we loaded.
    assert provider is not None and "mlx_cpu.libs" not in provider
    if name.startswith("ptp-sgemm("):
        assert "/kernels/sgemm-" in provider and name.split("+", 1)[1].startswith(("mkl:", "openblas:"))
    else:
        assert provider.endswith(name.split(":", 1)[1].rsplit("/", 1)[-1])


@linux_cpu_wheel
def test_without_the_kernel_mlx_calls_the_library_itself(monkeypatch):
    name, provider = _probe(monkeypatch, {"PTP_MLX_SGEMM": "0"})
    if name == "default":
        pytest.skip("this MLX does not use the reference BLAS")
    assert not name.startswith("ptp-sgemm") and name != "reference"
    assert provider.endswith(name.split(":", 1)[1].rsplit("/", 1)[-1])


@linux_cpu_wheel
def test_blas_none_keeps_the_reference_blas(monkeypatch):
    name, provider = _probe(monkeypatch, {"PTP_MLX_BLAS": "none"})
    assert name in ("reference", "default")
    assert provider in (None, "None") or "mlx_cpu.libs" in provider


@linux_cpu_wheel
def test_a_missing_requested_library_is_named_in_the_notice(monkeypatch, tmp_path):
    monkeypatch.setenv("PTP_MLX_BLAS", str(tmp_path / "nope.so"))
    code = (
        "import ptp_mlx; from ptp_mlx import blas; import mlx.core; "
        "blas.warn_if_slow(); blas.warn_if_slow(); print(blas.state['blas'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    if out.stdout.strip() == "default":
        pytest.skip("this MLX does not use the reference BLAS")
    assert out.stdout.strip() == "reference"
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no such file" in lines[0] and "nope.so" in lines[0]  # said once, with the cause


def test_cost_curve_stops_probing_when_its_time_is_spent(tiny_model_dir):
    """A slow machine extrapolates the wide widths instead of timing them (first start in seconds)."""
    import mlx_lm

    from ptp_mlx.decode.probe import measure_cost_curve
    from ptp_mlx.drafting.cost import PROBE_WIDTHS
    from ptp_mlx.model.ptp import PTPModel

    base, _ = mlx_lm.load(str(tiny_model_dir))
    pm = PTPModel(base, None, None)
    calls = []
    real = pm.__call__

    class Counting:
        def __getattr__(self, k):
            return getattr(pm, k)

        def __call__(self, *a, **kw):
            calls.append(a[0].shape)
            return real(*a, **kw)

    curve, record = measure_cost_curve(Counting(), repeats=1, time_budget=0.0)
    secs = record["seconds"]
    assert len(secs) == len(PROBE_WIDTHS) and curve.rel[0] == 1.0
    # The context prefill, then two widths timed (2 passes each, more for a width the checks re-measured); the rest
    # inferred.
    assert len(calls) == 1 + 2 * 2 + 2 * len(record["remeasured"])
    assert record["extrapolated"] == list(PROBE_WIDTHS[2:])
    assert all(b >= a for a, b in zip(secs[1:], secs[2:], strict=False))  # extrapolation never decreases cost


@linux_cpu_wheel
def test_training_commands_say_it_too(monkeypatch, tmp_path):
    monkeypatch.setenv("PTP_MLX_BLAS", str(tmp_path / "nope.so"))
    cmd = [sys.executable, "-m", "ptp_mlx.train.cli", "pregenerate", "--prompts", str(tmp_path / "p.jsonl")]
    out = subprocess.run(cmd + ["--out", str(tmp_path / "t.jsonl")], capture_output=True, text=True, timeout=120)
    from ptp_mlx import blas

    if blas.state["blas"] == "default":
        pytest.skip("this MLX does not use the reference BLAS")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and sum("slow reference BLAS" in x for x in lines) == 1, out.stderr
    assert lines[-1].startswith("error:")  # then the bad input is still reported as usual
