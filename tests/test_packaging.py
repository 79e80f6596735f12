"""app/ and convert/ install as ptp_mlx.app and ptp_mlx.convert, never as top-level packages."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_subpackages():
    import ptp_mlx.app
    import ptp_mlx.convert

    assert Path(ptp_mlx.app.__file__).parent == ROOT / "app"
    assert Path(ptp_mlx.convert.__file__).parent == ROOT / "convert"


@pytest.mark.slow
def test_wheel_layout(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0 and ("No module named" in r.stderr or "invalid command 'bdist_wheel'" in r.stderr):
        pytest.skip("setuptools/wheel not available for an offline build")
    assert r.returncode == 0, r.stderr
    wheel = next(tmp_path.glob("ptp_mlx-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert "app" not in tops and "convert" not in tops and "tests" not in tops
    assert "ptp_mlx/app/__init__.py" in names and "ptp_mlx/gguf.py" in names
    assert "ptp_mlx/sampler.py" in names
    assert "ptp_mlx/drafting/protocol.py" in names


def test_every_subpackage_is_listed_for_the_wheel():
    """setuptools installs only the packages pyproject.toml lists: a new subpackage must be listed there."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(("ptp_mlx", *p.parent.relative_to(ROOT / "ptp_mlx").parts)).rstrip(".")
        for p in (ROOT / "ptp_mlx").rglob("__init__.py")
    }
    assert found <= listed, found - listed
