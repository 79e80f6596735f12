"""Distillation at scale: many sequences in one pass equal one pass per sequence; bins of both CDF orders
recorded at generation; the training clock and the rows-per-step size."""

import functools
import json

import mlx.core as mx
import numpy as np
import pytest

from ptp_mlx.model.ptp import PTPAdapter, PTPModel
from ptp_mlx.testing import make_tiny_model, randomize_adapter
from ptp_mlx.train.batch import accumulate, step_items, weighted_ce_sum
from ptp_mlx.train.data import read_records
from ptp_mlx.train.pregenerate import pregenerate
from ptp_mlx.train.windows import loss_fn, make_windows, slot_weights, teacher_kv


def _records(model, tok, tmp_path, n_prompts=4, per_prompt=3, max_new=14):
    from ptp_mlx.sampler import SamplingSettings

    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"id": f"p-{i}", "turns": [f"tell {i} " * (i + 1)]}) for i in range(n_prompts)))
    out = tmp_path / "teacher.jsonl"
    pregenerate(model, tok, f, out, n=per_prompt, sampling=SamplingSettings(0.9, 0, 1.0), max_new=max_new, split="all")
    return read_records(out)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("order", ["id", "prob"])
def test_batched_loss_and_grad_equal_one_pass_per_sequence(tmp_path, family, order):
    import mlx.nn as nn
    import mlx_lm

    model, tok = mlx_lm.load(str(make_tiny_model(tmp_path / "m", family=family)))
    records = _records(model, tok, tmp_path)
    adapter = PTPAdapter(model, 4, 2.0, "binary")
    randomize_adapter(adapter, 0.1)
    pm = PTPModel(model, adapter)
    weights = slot_weights("decay:0.7", 4)

    rng = np.random.default_rng(3)
    items = step_items(pm, [dict(r) for r in records], 5, 4, rng, weights, order)
    grad_b = nn.value_and_grad(adapter, lambda ad, kv, mb: weighted_ce_sum(ad, pm, kv, mb))
    # micro-batches of 2 sequences: padding, filler windows and the gradient sum all take part
    loss_b, g_b, rows = accumulate(grad_b, adapter, pm, items, 4, 2)

    rng = np.random.default_rng(3)
    batch = []
    for rec in [dict(r) for r in records]:
        kv = teacher_kv(pm, rec["tokens"], rec, order)
        windows, u, labels, valid = make_windows(rec, 5, 4, rng)
        batch.append((kv, windows, u, labels, valid))
    loss_s, g_s = nn.value_and_grad(adapter, lambda ad, b: loss_fn(ad, pm, b, weights))(adapter, batch)

    full = sum(len(b[1]) * 4 for b in batch)
    assert sum(len(it[2]) for it in items) < full  # windows were cut after their last scored slot
    assert rows >= sum(len(it[2]) for it in items)
    assert abs(loss_b.item() - loss_s.item()) < 1e-4 * max(1.0, abs(loss_s.item()))
    from mlx.utils import tree_flatten

    fb, fs = dict(tree_flatten(g_b)), dict(tree_flatten(g_s))
    assert fb.keys() == fs.keys()
    for k in fs:
        scale = float(mx.abs(fs[k]).max().item()) + 1e-6
        assert float(mx.abs(fb[k] - fs[k]).max().item()) < 1e-3 * scale, k


def test_pregenerate_records_both_orders_and_training_reads_them(tiny, tmp_path):
    from ptp_mlx.bins import bins
    from ptp_mlx.sampler import SamplingSettings

    model, tok = tiny
    records = _records(model, tok, tmp_path, n_prompts=2)
    pm = PTPModel(model)
    for rec in records:
        assert len(rec["left_prob"]) == len(rec["left"]) == len(rec["tokens"]) - rec["start"]
        if rec["greedy"]:
            assert set(rec["left_prob"]) == {0.0} and set(rec["right_prob"]) == {1.0}
            continue
        # the recorded probability-order bins are those a teacher pass gives, and they contain a u that picks it
        logits = pm.base(mx.array(rec["tokens"])[None])[0]
        s = SamplingSettings.from_dict(rec["settings"])
        lo, hi = bins(logits[rec["start"] - 1 : -1], mx.array(rec["tokens"][rec["start"] :]), s, "prob")
        assert np.allclose(np.array(lo), rec["left_prob"], atol=2e-6)
        assert np.allclose(np.array(hi), rec["right_prob"], atol=2e-6)
        assert all(a < b for a, b in zip(rec["left_prob"], rec["right_prob"], strict=True))


def _args(run, **kw):
    import argparse

    from ptp_mlx.train.train import add_train_args

    p = argparse.ArgumentParser()
    add_train_args(p)
    a = p.parse_args(["--data", "x", "--run", str(run), "--rank", "4", "--alpha", "8", "--window", "4"])
    a.windows_per_seq, a.lr, a.warmup, a.save_every = 4, 3e-3, 2, 3
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_train_rows_per_step_minutes_and_clock(tiny, tmp_path):
    from ptp_mlx.train.train import train

    model, tok = tiny
    records = _records(model, tok, tmp_path, n_prompts=3)
    run = tmp_path / "run"
    # 400 steps asked: far more than 0.02 minutes of training holds on any machine (a step takes 20+ ms here)
    a = _args(run, rows_per_step=40, micro_rows=16, steps=400, minutes=0.02, eval_every=1000, cdf_order="prob")
    a.eval_minutes = 0.005
    train(model, records, records[:2], a)
    lines = [json.loads(x) for x in (run / "train.log").read_text().splitlines()]
    steps = [x for x in lines if "step" in x and "rows" in x]
    evals = [x["eval"] for x in lines if "eval" in x]
    # 40 rows asked: 3 sequences of 4 windows of 4 (48 rows at most; windows past a sequence's end are cut)
    assert steps and all(0 < x["rows"] <= 48 for x in steps) and max(x["rows"] for x in steps) > 16
    assert len(steps) < 400  # --minutes sized the run
    assert evals and all("rows_per_second" in e and e["train_rows"] > 0 for e in evals)
    state = json.loads((run / "last" / "state.json").read_text())
    assert state["seconds"] == pytest.approx(sum(x["seconds"] for x in steps), rel=0.05, abs=0.05)
    cfg = json.loads((run / "best" / "adapter_config.json").read_text())
    assert cfg["cdf_order"] == "prob" and cfg["training"]["seqs_per_step"] == 3


@pytest.mark.parametrize("draft", ["argmax", "coupled"])
def test_batched_evaluation_equals_one_pass_per_record(tiny, tmp_path, monkeypatch, draft):
    import ptp_mlx.train.validate as validate

    model, tok = tiny
    records = _records(model, tok, tmp_path, n_prompts=3)
    adapter = PTPAdapter(model, 4, 2.0, "binary")
    randomize_adapter(adapter, 0.3)
    pm = PTPModel(model, adapter)
    monkeypatch.setattr(validate, "_predictions", functools.partial(validate._predictions, micro_seqs=2))
    batched = validate.evaluate(pm, adapter, [dict(r) for r in records], 4, 3, 0, "prob", draft)
    monkeypatch.setattr(validate, "batched_rope", lambda m: False)
    single = validate.evaluate(pm, adapter, [dict(r) for r in records], 4, 3, 0, "prob", draft)
    assert batched["histogram"] == single["histogram"] and sum(single["histogram"]) == 3 * len(records)
    assert batched["slot_accuracy"] == single["slot_accuracy"]
