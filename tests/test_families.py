"""PTP on the stock mlx-lm model of every supported family, as a user would run it (issue 12).

For each family: a tiny random model built from mlx-lm's own classes, an adapter from a few ``ptp-train`` steps,
then ``ptp-generate --mode ptp`` must print byte for byte what ``--mode ar`` prints, greedy and sampled, with the
adaptive budget and with ``--num-draft-tokens``; ``--mode ar --no-chat`` must equal ``mlx_lm.generate``. An
oracle drafter (every draft right) exercises long accepted blocks on each family as well. An SSM (mamba) is
refused by every PTP command with one line and exit 2.
"""

import json

import mlx.core as mx
import mlx_lm
import pytest

from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.generate_cli import main as generate_main
from ptp_mlx.model.ptp import PTPModel
from ptp_mlx.sampler import SamplingSettings
from ptp_mlx.testing import PTP_FAMILIES, OracleDrafter, make_tiny_model
from ptp_mlx.train.cli import main as train_main

PROMPTS = ["hello world", "The quick brown fox", "count: 1 2 3"]


def _prompts_file(path):
    with open(path, "w") as f:
        for i, p in enumerate(PROMPTS):
            f.write(json.dumps({"question_id": f"p{i}", "category": "writing", "turns": [p]}) + "\n")
    return path


def distil(model_dir, tmp, steps: int = 2):
    """A real adapter for ``model_dir`` from ``ptp-train pregenerate`` + a few ``ptp-train train`` steps."""
    prompts = _prompts_file(tmp / "prompts.jsonl")
    teacher = tmp / "teacher.jsonl"
    rc = train_main(
        ["pregenerate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(teacher)]
        + ["--split", "all", "--per-prompt", "2", "--max-tokens", "24"]
    )
    assert rc == 0
    rc = train_main(
        ["train", "--model", str(model_dir), "--data", str(teacher), "--run", str(tmp / "run"), "--steps", str(steps)]
        + ["--rank", "4", "--window", "4", "--windows-per-seq", "4", "--out", str(tmp / "adapter")]
    )
    assert rc == 0
    return tmp / "adapter"


@pytest.fixture(scope="module", params=PTP_FAMILIES)
def family(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_model(tmp / "model", family=request.param, varied=True, seed=3)
    return request.param, model_dir, distil(model_dir, tmp)


def cli(capsys, argv) -> str:
    rc = generate_main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


SAMPLING = {"greedy": [], "sampled": ["--temp", "0.7", "--seed", "5"]}


@pytest.mark.parametrize("setting", list(SAMPLING))
def test_ptp_equals_ar_byte_for_byte(family, setting, capsys):
    name, model_dir, adapter = family
    common = ["--model", str(model_dir), "--adapter", str(adapter), "--prompt", PROMPTS[0], "--max-tokens", "48"]
    common += SAMPLING[setting]
    want = cli(capsys, common + ["--mode", "ar"])
    assert len(want) > 10  # something was generated (a tiny random model may well print only newlines)
    for extra in ([], ["--num-draft-tokens", "1"], ["--num-draft-tokens", "3"]):
        got = cli(capsys, common + ["--mode", "ptp"] + extra)
        assert got == want, f"{name} {setting} {extra}: PTP output differs from AR"


def test_ar_equals_mlx_lm_generate(family, capsys):
    name, model_dir, adapter = family
    got = cli(capsys, ["--model", str(model_dir), "--mode", "ar", "--no-chat", "--prompt", PROMPTS[1]])
    model, tok = mlx_lm.load(str(model_dir))
    want = mlx_lm.generate(model, tok, PROMPTS[1], max_tokens=256)
    assert got == want + "\n", name


def test_oracle_accepts_every_draft(family):
    """Every draft right: long accepted blocks through each family's verify rows, cache trims included."""
    name, model_dir, _ = family
    model, tok = mlx_lm.load(str(model_dir))
    pm = PTPModel(model)
    ids = list(tok.encode(PROMPTS[2]))
    for s in (SamplingSettings(0.0), SamplingSettings(0.9, 0, 1.0, 4)):
        want = [t for st in stream_generate(pm, tok, ids, DecodeOptions(max_tokens=40, sampling=s)) for t in st.tokens]
        opts = DecodeOptions(mode="ptp", max_tokens=40, sampling=s, drafter=OracleDrafter(want + [0] * 8, width=6))
        steps = list(stream_generate(pm, tok, ids, opts, eos_ids=set()))
        got = [t for st in steps for t in st.tokens]
        assert got[: len(want)] == want, name
        assert max(st.accepted for st in steps) == 5, name


def test_token_rows_are_the_stock_model(family):
    """Token rows of a mixed pass are the base model's: bit for bit whatever the LoRA holds (the gate adds exact
    zeros), and equal to a plain pass of those rows up to the BLAS's row-count rounding."""
    from ptp_mlx.adapter import load_adapter
    from ptp_mlx.model.ptp import Window

    name, model_dir, adapter_dir = family
    model, tok = mlx_lm.load(str(model_dir))
    ad, cfg = load_adapter(adapter_dir, model)
    zero, _ = load_adapter(adapter_dir, model)
    for layer in zero.layers:
        for lora in layer.values():
            lora.B = mx.zeros_like(lora.B)
    pm, pm0 = PTPModel(model, ad, cfg, fuse=True), PTPModel(model, zero, cfg)
    ids = list(tok.encode("a longer context, longer than the sliding window of the tiny models"))
    ctx, rows = mx.array(ids[:-3]), mx.array(ids[-3:])
    n = len(ids) - 3
    u, windows = mx.array([0.3, 0.6, 0.9, 0.1]), [Window(n + 1, 2), Window(n + 3, 2)]
    out = []
    for p in (pm, pm0, pm):
        cache = p.make_cache()
        p(ctx, cache=cache)
        out.append(p(rows, u, windows, cache) if len(out) < 2 else p(rows, cache=cache))
    mixed, mixed0, plain = out
    assert mx.array_equal(mixed[:3], mixed0[:3]), name
    assert not mx.array_equal(mixed[3:], mixed0[3:]), name  # the LoRA does act on the auxiliary rows
    assert mx.allclose(mixed[:3], plain, atol=1e-4, rtol=1e-4), name
    assert not mx.array_equal(mixed[3:5], mixed[5:7]), name  # the windows see different contexts


def test_mamba_is_refused(tmp_path, capsys):
    model_dir = make_tiny_model(tmp_path / "mamba", family="mamba")
    prompts = _prompts_file(tmp_path / "p.jsonl")
    runs = [
        (generate_main, ["--model", str(model_dir), "--mode", "ptp", "--prompt", "hi"]),
        (generate_main, ["--model", str(model_dir), "--adapter", str(tmp_path), "--prompt", "hi"]),
        (train_main, ["train", "--model", str(model_dir), "--data", str(prompts), "--run", str(tmp_path / "r")]),
        (
            train_main,
            ["pregenerate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "t")],
        ),
    ]
    for fn, argv in runs:
        assert fn(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'mamba' is not supported for PTP" in err[0] and "llama" in err[0], err
    assert not (tmp_path / "r").exists() and not (tmp_path / "t").exists()
    # plain autoregressive decoding still runs it through mlx-lm
    assert generate_main(["--model", str(model_dir), "--mode", "ar", "--prompt", "hi", "--max-tokens", "4"]) == 0


def test_quantized_base_decodes_exactly(tmp_path, capsys):
    """A 4-bit base (mlx-lm's own quantization): PTP over QuantizedLinear layers, byte-identical to AR."""
    from mlx_lm.convert import convert

    src = make_tiny_model(tmp_path / "float", family="qwen3", varied=True, seed=4)
    q = tmp_path / "q4"
    convert(str(src), mlx_path=str(q), quantize=True, q_bits=4, q_group_size=32)
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4
    adapter = distil(q, tmp_path)
    capsys.readouterr()  # the converter's own messages
    for sampling in SAMPLING.values():
        common = ["--model", str(q), "--adapter", str(adapter), "--prompt", PROMPTS[0], "--max-tokens", "40"]
        common += sampling
        want = cli(capsys, common + ["--mode", "ar"])
        for extra in ([], ["--num-draft-tokens", "3"]):
            assert cli(capsys, common + ["--mode", "ptp"] + extra) == want
