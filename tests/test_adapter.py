"""Adapter folders (issue 3, item 2): round trip, and one clear ``UserError`` for every way a folder can fail
to fit the base model."""

import dataclasses
import json
import os

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from ptp_mlx.adapter import CONFIG, WEIGHTS, load_adapter, make_config, read_config, save_adapter, shipped_adapter
from ptp_mlx.errors import UserError
from ptp_mlx.model.ptp import PTPAdapter
from ptp_mlx.testing import make_tiny_model, randomize_adapter


@pytest.fixture(scope="module")
def base(tiny):
    return tiny[0]


def make(base, kind="binary", rank=4, **kw) -> PTPAdapter:
    mx.random.seed(0)
    ad = PTPAdapter(base, rank, 1.0 / rank, kind, **kw)
    randomize_adapter(ad)
    return ad


def saved(base, path, kind="binary", rank=4, **kw):
    ad = make(base, kind, rank, **kw)
    cfg = make_config(base, ad, rank, 1.0 / rank, window=4, name="tiny", acceptance_histogram=[3, 2, 1])
    save_adapter(ad, cfg, path)
    return ad, cfg


def weights(ad) -> dict:
    return {k: v for k, v in tree_flatten(ad.parameters()) if not k.endswith(".scale")}


@pytest.mark.parametrize("kind", ["binary", "linear_interpolation"])
def test_round_trip(base, tmp_path, kind):
    ad, cfg = saved(base, tmp_path / "ad", kind)
    assert sorted(p.name for p in (tmp_path / "ad").iterdir()) == sorted([CONFIG, WEIGHTS])
    got, got_cfg = load_adapter(tmp_path / "ad", base)
    assert got_cfg.raw == cfg
    assert got_cfg.u_embedding == kind and got_cfg.base_model["fingerprint"] and got_cfg.window == 4
    a, b = weights(ad), weights(got)
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    assert got.layers[0]["q_proj"].scale == pytest.approx(0.25)
    # Saving onto an existing folder replaces it atomically.
    save_adapter(got, cfg, tmp_path / "ad")
    assert load_adapter(tmp_path / "ad", base)[1].raw == cfg


def test_round_trip_partial_targets(base, tmp_path):
    ad, _ = saved(base, tmp_path / "ad", targets=("q_proj", "v_proj"), layers=[1])
    got, cfg = load_adapter(tmp_path / "ad", base)
    assert cfg.target_modules == ("q_proj", "v_proj") and cfg.layers == (1,)
    assert got.layers[0] == {} and set(got.layers[1]) == {"q_proj", "v_proj"}
    assert weights(got).keys() == weights(ad).keys()


def test_other_base_model(base, tmp_path):
    saved(base, tmp_path / "ad")
    # Same dimensions, other weights: caught by the fingerprint.
    other, _ = mlx_lm.load(str(make_tiny_model(tmp_path / "other", seed=1)))
    with pytest.raises(UserError, match="made for another base model.*fingerprint"):
        load_adapter(tmp_path / "ad", other)
    # Other dimensions.
    small, _ = mlx_lm.load(str(make_tiny_model(tmp_path / "small", hidden=32)))
    with pytest.raises(UserError, match="made for another base model \\(tiny\\): hidden_size is 64 there but 32 here"):
        load_adapter(tmp_path / "ad", small)
    deeper, _ = mlx_lm.load(str(make_tiny_model(tmp_path / "deep", layers=3)))
    with pytest.raises(UserError, match="num_hidden_layers is 2 there but 3 here"):
        load_adapter(tmp_path / "ad", deeper)
    # Without the fingerprint check, same dimensions load fine, other dimensions still do not.
    load_adapter(tmp_path / "ad", other, check_fingerprint=False)
    with pytest.raises(UserError, match="hidden_size"):
        load_adapter(tmp_path / "ad", small, check_fingerprint=False)


def rewrite_weights(path, fn):
    w = dict(mx.load(str(path / WEIGHTS)))
    fn(w)
    mx.save_safetensors(str(path / WEIGHTS), w)


def rewrite_config(path, fn):
    cfg = json.loads((path / CONFIG).read_text())
    fn(cfg)
    (path / CONFIG).write_text(json.dumps(cfg))


def test_wrong_shapes(base, tmp_path):
    saved(base, tmp_path / "ad")
    key = "layers.0.q_proj.A"
    rewrite_weights(tmp_path / "ad", lambda w: w.update({key: mx.zeros((3, 64))}))
    with pytest.raises(UserError, match=r"layers.0.q_proj.A has shape \(3, 64\), expected \(4, 64\)"):
        load_adapter(tmp_path / "ad", base)
    # A config whose rank disagrees with the weights.
    saved(base, tmp_path / "ad2")
    rewrite_config(tmp_path / "ad2", lambda c: c.update(rank=8))
    with pytest.raises(UserError, match="has shape"):
        load_adapter(tmp_path / "ad2", base)


def test_unknown_and_missing_keys(base, tmp_path):
    saved(base, tmp_path / "a")
    rewrite_weights(tmp_path / "a", lambda w: w.update({"layers.0.lm_head.A": mx.zeros((4, 64))}))
    with pytest.raises(UserError, match=r"does not match its config: unknown keys \['layers.0.lm_head.A'\]"):
        load_adapter(tmp_path / "a", base)
    saved(base, tmp_path / "b")
    rewrite_weights(tmp_path / "b", lambda w: w.pop("u_embed.u_adapter.bias"))
    with pytest.raises(UserError, match=r"missing keys \['u_embed.u_adapter.bias'\]"):
        load_adapter(tmp_path / "b", base)
    # Weights of the other u-embedding kind than the config says.
    saved(base, tmp_path / "c", kind="linear_interpolation")
    rewrite_config(tmp_path / "c", lambda c: c.update(u_embedding="binary"))
    with pytest.raises(UserError, match="does not match its config"):
        load_adapter(tmp_path / "c", base)


def test_bad_config(base, tmp_path):
    saved(base, tmp_path / "ad")
    rewrite_config(tmp_path / "ad", lambda c: c.update(u_embedding="sawtooth"))
    with pytest.raises(UserError, match="unknown u-embedding kind 'sawtooth'.*known: binary, linear_interpolation"):
        load_adapter(tmp_path / "ad", base)
    rewrite_config(tmp_path / "ad", lambda c: c.update(u_embedding="binary", target_modules=["q_proj", "embed"]))
    with pytest.raises(UserError, match="bad adapter config.*unknown LoRA target modules"):
        load_adapter(tmp_path / "ad", base)
    rewrite_config(tmp_path / "ad", lambda c: (c.update(target_modules=["q_proj"]), c.pop("rank")))
    with pytest.raises(UserError, match="bad adapter config.*rank"):
        load_adapter(tmp_path / "ad", base)
    rewrite_config(tmp_path / "ad", lambda c: c.update(format="something-else"))
    with pytest.raises(UserError, match="is not a ptp-mlx-adapter config"):
        read_config(tmp_path / "ad")
    (tmp_path / "ad" / CONFIG).write_text("{not json")
    with pytest.raises(UserError, match="corrupt"):
        load_adapter(tmp_path / "ad", base)
    with pytest.raises(UserError, match="not an adapter folder"):
        load_adapter(tmp_path / "nowhere", base)


def test_corrupt_or_truncated_weights(base, tmp_path):
    saved(base, tmp_path / "ad")
    f = tmp_path / "ad" / WEIGHTS
    data = f.read_bytes()
    for broken in (data[: len(data) // 2], data[:5], b"", b"\x00" * 64 + data[64:]):
        f.write_bytes(broken)
        with pytest.raises(UserError, match="cannot read .*adapter.safetensors"):
            load_adapter(tmp_path / "ad", base)
    f.unlink()
    with pytest.raises(UserError, match="cannot read"):
        load_adapter(tmp_path / "ad", base)


def test_shipped_adapter_absent_for_unknown_model():
    assert shipped_adapter("no-such-model") is None


def test_engine_primes_its_budget_per_decoding_mode(base):
    """Greedy and sampled decoding use the acceptance the adapter measured for each mode."""
    from ptp_mlx.engine import Engine
    from ptp_mlx.model.ptp import PTPModel
    from ptp_mlx.sampler import SamplingSettings

    ad = PTPAdapter(base, 2, 1.0, "binary")
    hists = {"greedy": [1, 1, 2, 4], "sampled": [6, 1, 1, 0]}
    cfg = make_config(base, ad, 2, 1.0, 4, acceptance_histogram=[7, 2, 3, 4], acceptance_histograms=hists)
    eng = Engine(pm=PTPModel(base, ad, cfg, fuse=True), tokenizer=None, model_path="tiny")
    eng.budget = eng.make_budget(measure=False)
    greedy, sampled = eng.budget_for(SamplingSettings(0.0)), eng.budget_for(SamplingSettings(0.7, 50, 0.95))
    assert greedy.survival[:4] == pytest.approx([1.0, 7 / 8, 6 / 8, 4 / 8])
    assert sampled.survival[:4] == pytest.approx([1.0, 2 / 8, 1 / 8, 0.0])
    # older adapters: one histogram for both modes
    eng.pm.config = dataclasses.replace(eng.pm.config, acceptance_histograms={})
    eng.budget = eng.make_budget(measure=False)
    assert eng.budget_for(SamplingSettings(0.0)) is eng.budget


def test_the_engine_keeps_whether_building_ahead_pays_beside_its_cost_curve(base, monkeypatch):
    """The learnt choice of building calls ahead (``ChainChoice``) lives where the cost curve does, under the same
    key (machine, model, adapter shape), read at the start, learnt again with ``--recalibrate``."""
    import ptp_mlx.engine as engine_mod
    from ptp_mlx.decode.chain_odds import choice_for
    from ptp_mlx.drafting.cost import CostCurve
    from ptp_mlx.engine import Engine
    from ptp_mlx.model.ptp import PTPModel

    seen = {}

    def cached(pm, key, cache_dir, log=None, recalibrate=False):
        seen.update(key=key, dir=cache_dir)
        return CostCurve()

    monkeypatch.setattr(engine_mod, "cached_cost_curve", cached)
    ad = PTPAdapter(base, 2, 1.0, "binary")
    eng = Engine(pm=PTPModel(base, ad, make_config(base, ad, 2, 1.0, 4), fuse=True), tokenizer=None, model_path="t")
    eng.budget = eng.make_budget(measure=True)
    choice = choice_for(eng.pm)
    assert choice.path == seen["dir"] / f"chain-choice-{seen['key']}.json"
    choice.save()
    eng.budget = eng.make_budget(measure=True)
    assert choice_for(eng.pm) is not choice and choice_for(eng.pm).source == "kept"
    eng.budget = eng.make_budget(measure=True, recalibrate=True)
    assert choice_for(eng.pm).source == "new"


def test_adapter_follows_the_model(tiny_model_dir, base, tmp_path, monkeypatch):
    """Without --adapter, a model gets the adapter whose recorded fingerprint is its own (a converted copy of a
    model keeps its adapter), and nothing when none matches."""
    import shutil

    from ptp_mlx.engine import Engine

    home = tmp_path / "home"
    monkeypatch.setenv("PTP_MLX_HOME", str(home))
    assert Engine.load(str(tiny_model_dir), measure_cost=False).pm.adapter is None
    saved(base, home / "adapters" / "tiny-ptp")
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)  # the same weights under another name
    notes = []
    eng = Engine.load(str(copy), log=notes.append, measure_cost=False)
    assert eng.pm.adapter is not None and eng.adapter_path == str(home / "adapters" / "tiny-ptp")
    assert any("made for this model" in n for n in notes)
    assert Engine.load(str(copy), adapter="none", measure_cost=False).pm.adapter is None


def test_adapter_follows_its_model_into_another_float_dtype(tmp_path):
    """A bf16 or fp16 conversion of the model an adapter was made for (the default dtype on a GPU) gets that
    adapter: the exact fingerprint differs, the dtype-tolerant signature matches; another model's does not."""
    import shutil

    import mlx.core as mx
    import mlx_lm

    from ptp_mlx.adapter import adapter_for
    from ptp_mlx.testing import save_random_adapter

    src = make_tiny_model(tmp_path / "f32")
    root = tmp_path / "home" / "adapters"
    save_random_adapter(src, root / "tiny")
    for dtype in (mx.bfloat16, mx.float16):
        dst = tmp_path / f"conv-{dtype}"
        shutil.copytree(src, dst)
        w = mx.load(str(src / "model.safetensors"))
        mx.save_safetensors(str(dst / "model.safetensors"), {k: v.astype(dtype) for k, v in w.items()})
        model, _ = mlx_lm.load(str(dst))
        load_adapter(root / "tiny", model)  # accepted
        os.environ["PTP_MLX_HOME"] = str(tmp_path / "home")
        try:
            assert adapter_for(model) == root / "tiny"
        finally:
            os.environ.pop("PTP_MLX_HOME")
    other, _ = mlx_lm.load(str(make_tiny_model(tmp_path / "other", seed=5)))
    with pytest.raises(UserError, match="fingerprint"):
        load_adapter(root / "tiny", other)
