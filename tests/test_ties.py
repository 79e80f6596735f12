"""Near-tie classification (issue 18): a divergence between PTP and plain decoding is a float near-tie only when
the other token was within a stated tolerance of being chosen; anything else is a logic error."""

import mlx.core as mx
import numpy as np

from ptp_mlx.bench.report import check_doc
from ptp_mlx.bench.run import Divergence
from ptp_mlx.sampler import SamplingSettings, pick
from ptp_mlx.ties import EDGE_TOL, LOGIT_TOL, MASS_TOL, classify


def test_greedy_logit_gap():
    logits = mx.array([0.0, 5.0, 5.0 - LOGIT_TOL / 2, 1.0])
    assert classify(logits, 1, 2, 0.3, SamplingSettings(0.0)).near_tie
    t = classify(logits, 1, 3, 0.3, SamplingSettings(0.0))
    assert not t.near_tie and t.kind == "logit gap" and abs(t.distance - 4.0) < 1e-9


def test_sampled_bin_edge():
    p = np.array([0.1, 0.2, 0.3, 0.4])
    logits = mx.array(np.log(p).astype(np.float32))
    s = SamplingSettings(1.0)
    edge = float(np.cumsum(p)[1])  # between tokens 1 and 2
    u = edge - EDGE_TOL / 3
    assert int(pick(mx.array(u), logits, 1.0)) == 1
    tie = classify(logits, 1, 2, u, s)
    assert tie.near_tie and tie.kind == "bin edge" and tie.distance < EDGE_TOL
    far = classify(logits, 1, 3, u, s)  # token 3's bin starts 0.3 away
    assert not far.near_tie and far.distance > 0.29


def test_sampled_top_p_cut_off():
    # Sorted masses before each token: 0, 0.4, 0.7, 0.9 (+/- a hair): with top_p 0.7 token 2 sits at the cut.
    p = np.array([0.4, 0.3, 0.2 + 1e-7, 0.1 - 1e-7])
    logits = mx.array(np.log(p).astype(np.float32))
    s = SamplingSettings(1.0, 0, 0.9 - MASS_TOL / 10)
    u = 0.97
    kept = int(pick(mx.array(u), logits, 1.0, 0, s.top_p))
    tie = classify(logits, kept, 3, u, s)
    assert kept != 3 and tie.near_tie and tie.kind == "top-p cut-off"
    assert not classify(logits, kept, 3, u, SamplingSettings(1.0, 0, 0.5)).near_tie


def test_lossless_check_fails_only_on_real_divergences():
    tie = Divergence("q", 0, 0, 5, 1, 2, 10, 10, near_tie=True, tie="float near-tie (bin edge 1e-07)")
    bug = Divergence("q", 0, 1, 3, 1, 7, 10, 10, near_tie=False, tie="NOT a near-tie (bin edge 0.2)")
    ok = check_doc("lossless", "ar", "ptp", 3, 2, [tie], True)
    assert ok["ok"] and ok["near_ties"] == 1
    assert not check_doc("lossless", "ar", "ptp", 3, 1, [tie, bug], True)["ok"]
