"""Every lossless test on the eager reference too (issue 29): the suite runs with compiled fixed-shape calls (the
default); this runs the files that compare PTP with plain decoding token for token once more with
``PTP_MLX_EAGER=1``, where every call and step is the same function uncompiled. Greedy, sampled (top-k, top-p, full
vocabulary, both CDF orders), trees, lookup, bursts, EOS and max tokens inside a block, all eight families, the
prompt cache across turns, penalties, grammars and logprobs, and the fixed-shape calls themselves."""

import os
import subprocess
import sys
from pathlib import Path

LOSSLESS = [
    "test_decode.py",
    "test_families.py",
    "test_logits.py",
    "test_cdf_order.py",
    "test_pipeline.py",
    "test_fixed.py",
    "test_budget.py",
    "test_lookup.py",
]


def test_lossless_files_pass_on_the_eager_reference(tmp_path):
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PTP_MLX_EAGER": "1", "PTP_MLX_HOME": str(tmp_path / "home")}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(here / f) for f in LOSSLESS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail


def test_the_switch_reaches_the_bank(monkeypatch):
    from ptp_mlx.decode.fixed import compiled_by_default

    monkeypatch.setenv("PTP_MLX_EAGER", "1")
    assert not compiled_by_default()
    monkeypatch.delenv("PTP_MLX_EAGER")
    assert compiled_by_default()
