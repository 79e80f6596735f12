"""Batch invariance on the real default model (issue 41, docs/method.md section 10): the logits of k token rows
computed in one fixed-shape pass equal, bit for bit, the same rows computed by k one-row passes, for every k the
decoders use (2..24). It holds because every op of the pass computes a row the same way whatever the other rows
are: the matmuls (ptp-sgemm, or MKL where the kernel is not built), attention over the constant-shape bucket of
keys with an additive mask (the same reduction length for one row and for k), and per-row norms and softmaxes."""

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from ptp_mlx import blas
from ptp_mlx.model.ptp import PTPModel
from ptp_mlx.testing.decoding import chain_logits

pytestmark = pytest.mark.slow

PREFIX = "The quick brown fox jumps over the lazy dog. Then it ran to the river, where"


@pytest.fixture(scope="module")
def setup(default_model_dir):
    base, tok = mlx_lm.load(str(default_model_dir))
    pm = PTPModel(base, None, None)
    assert pm.ctx is not None, "the default model must be one PTP patches"
    ids = list(tok.encode(PREFIX))
    state = pm.make_cache()
    base(mx.array(ids)[None], cache=state)
    mx.eval(state.arrays())
    return pm, state, ids


def test_k_rows_equal_k_one_row_passes_bit_for_bit(setup):
    pm, state, ids = setup
    start = state.offset
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(100, 20000, size=24)]
    alone = []
    for t in tokens:  # the reference: one row at a time
        alone.append(chain_logits(pm, state, [t])[0])
    state.trim_to(start)
    alone = np.stack(alone)
    for k in range(2, 25):
        wide = chain_logits(pm, state, tokens[:k])
        state.trim_to(start)
        same = [np.array_equal(wide[j].view(np.uint32), alone[j].view(np.uint32)) for j in range(k)]
        gap = float(np.abs(wide - alone[:k]).max())
        bad = [j for j, s in enumerate(same) if not s]
        assert not bad, f"k={k}: rows {bad} differ (max gap {gap:.2e}; BLAS {blas.state['blas']})"


def test_a_prefills_rows_are_the_same_whatever_its_chunks(setup, monkeypatch):
    """A prompt's K/V rows (and so every later logit) do not depend on how ``decode/ar.py`` chunks its prefill, up
    to ptp-sgemm's row limit (256): a prompt of 200 rows in one pass, in the default 128-row chunks and in 64-row
    chunks, bit for bit."""
    from ptp_mlx.decode import ar

    pm = setup[0]
    lib = blas.kernel()
    if lib is None or lib.ptp_sgemm_max_m() < 200:
        pytest.skip("ptp-sgemm does not take 200-row products here (the BLAS's rows are not batch-invariant)")
    ids = [(7 * i + 3) % 5000 + 50 for i in range(201)]
    got = []
    for chunk in (256, ar.PREFILL_CHUNK, 64):
        monkeypatch.setattr(ar, "PREFILL_CHUNK", chunk)
        state = pm.make_cache()
        ar.prefill(pm.base, ids[:-1], state)
        got.append([np.array(a) for a in state.arrays()])
    assert ar.PREFILL_CHUNK == 64 and len(got[0]) == 2 * len(pm.base.layers)
    for other in got[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(got[0], other, strict=True))


def test_the_prefill_chunk_is_the_cpus_choice_only(monkeypatch):
    """128-row chunks where MLX computes on the CPU (measured there); 512 elsewhere, as before (not measured on a
    GPU)."""
    from ptp_mlx.decode import ar

    seen = []

    def model(x, cache):
        seen.append(x.shape[1])

    for device, want in ((mx.Device(mx.cpu), [128] * 4 + [88]), (mx.Device(mx.gpu), [512, 88])):
        seen.clear()
        monkeypatch.setattr(ar.mx, "default_device", lambda d=device: d)
        ar.prefill(model, list(range(600)), [])
        assert seen == want, device
