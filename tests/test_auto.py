"""``ptp-train auto``: end to end on tiny models of two families (installed adapter found by ``ptp-generate
--model``, equal to plain decoding), resumption after Ctrl-C in every phase (the same adapter as an uninterrupted
run), and bad inputs refused in one line before anything is written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from ptp_mlx.testing import make_tiny_model
from ptp_mlx.train import auto
from ptp_mlx.train.cli import main

TOY = ["--minutes", "6", "--max-prompts", "4", "--steps", "6", "--rows-per-step", "128", "--rank", "4",
       "--bench-prompts", "1", "--bench-tokens", "12"]  # fmt: skip


def _cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)


def _no_temp_files(*roots: Path) -> None:
    for root in roots:
        if root.exists():
            left = [p for p in root.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]
            assert not left, left


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_auto_end_to_end_installs_an_adapter_that_generate_uses(tmp_path, family):
    m = make_tiny_model(tmp_path / "m", family=family, varied=True)
    r = _cli("-m", "ptp_mlx.train.cli", "auto", "--model", str(m), "--run", str(tmp_path / "run"), *TOY,
             "--install-anyway")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    verdict = r.stdout.strip().splitlines()
    assert len(verdict) == 1 and verdict[0].startswith("verdict: ") and "installed in" in verdict[0]
    assert "plan (" in r.stderr and "estimates" in r.stderr  # the phases' times, up front
    home = Path(os.environ["PTP_MLX_HOME"])
    (inst,) = list((home / "adapters").iterdir())
    cfg = json.loads((inst / "adapter_config.json").read_text())
    assert cfg["cdf_order"] == "prob" and cfg["training"]["slot_weights"] == "decay:0.7"
    assert cfg["training"]["steps"] == 6 and cfg["rank"] == 4
    bench = json.loads((tmp_path / "run" / "bench.json").read_text())
    assert bench["compared"] == 2 and bench["identical"] + bench["near_ties"] == 2
    for temp in ("0", "0.7"):
        args = ["-m", "ptp_mlx.generate_cli", "--model", str(m), "--prompt", "count to ten", "--max-tokens", "40",
                "--temp", temp, "--top-k", "50", "--top-p", "0.95", "--seed", "3"]  # fmt: skip
        ptp, ar = _cli(*args), _cli(*args, "--mode", "ar")
        assert ptp.returncode == 0 and ar.returncode == 0, ptp.stderr[-2000:]
        assert f"using the adapter made for this model: {inst}" in ptp.stderr
        assert "mean accepted" in ptp.stderr and "accepted per call" in ptp.stderr  # PTP mode ran
        assert ptp.stdout == ar.stdout
    _no_temp_files(tmp_path / "run", home)


def _weights(run: Path) -> dict:
    return mx.load(str(run / "adapter" / "adapter.safetensors"))


def test_interrupted_in_every_phase_resumes_to_the_same_adapter(tmp_path, monkeypatch, capsys):
    m = make_tiny_model(tmp_path / "m", family="llama", varied=True)
    argv = ["auto", "--model", str(m), *TOY, "--no-install"]
    assert main([*argv, "--run", str(tmp_path / "ref")]) == 0
    ref = _weights(tmp_path / "ref")

    run = tmp_path / "run"
    from ptp_mlx.train import pregenerate as pg
    from ptp_mlx.train import train as tr

    calls = {"n": 0}
    real_many, real_ckpt = pg._complete_many, tr._checkpoint

    def many(*a, **k):  # Ctrl-C inside pregenerate, after two batches of held-out prompts were written
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_many(*a, **k)

    def ckpt(run_dir, adapter, opt, state):  # Ctrl-C inside training, after the step-3 checkpoint
        real_ckpt(run_dir, adapter, opt, state)
        if Path(run_dir) == run / "train" and state["step"] == 3 and not calls.get("trained"):
            calls["trained"] = True
            raise KeyboardInterrupt

    monkeypatch.setattr(pg, "_complete_many", many)
    monkeypatch.setattr(tr, "_checkpoint", ckpt)
    seen = []
    for name in auto.PHASES:
        fn = getattr(auto, f"_{name}")

        def stop(*a, _fn=fn, _name=name, **k):  # Ctrl-C as each phase starts, once
            if _name not in seen:
                seen.append(_name)
                raise KeyboardInterrupt
            return _fn(*a, **k)

        monkeypatch.setattr(auto, f"_{name}", stop)
    stops = []
    for _ in range(20):
        capsys.readouterr()
        rc = main([*argv, "--run", str(run)])
        err = capsys.readouterr().err
        if rc == 0:
            break
        assert rc == 130, err
        line = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(line) == 1 and "run the same command again to resume" in line[0]
        stops.append(line[0].split("during ")[1].split(";")[0])
        _no_temp_files(run)
        for p in auto.PHASES[auto.PHASES.index(stops[-1]) :]:
            assert not (run / "phases" / f"{p}.json").exists()  # the stopped phase and later ones: not marked
    assert rc == 0
    # every phase was interrupted at its start, pregenerate and train in their middle too
    assert stops == ["prompts", "probe", "pregenerate", "pregenerate", "train", "train", "eval", "bench", "install"]
    assert calls["n"] > 3 and calls["trained"]
    got = _weights(run)
    assert got.keys() == ref.keys()
    for k in ref:
        assert mx.abs(got[k] - ref[k]).max().item() < 1e-6, k
    assert not (Path(os.environ["PTP_MLX_HOME"]) / "adapters").exists()  # --no-install


def _one_error(r) -> str:
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    return lines[0]


def test_bad_inputs_one_line_exit_2_nothing_written(tmp_path):
    run = tmp_path / "run"
    base = ["-m", "ptp_mlx.train.cli", "auto", "--run", str(run), "--minutes", "5"]
    assert "model folder not found" in _one_error(_cli(*base, "--model", str(tmp_path / "nope")))
    ssm = make_tiny_model(tmp_path / "ssm", family="mamba")
    assert "not supported for PTP" in _one_error(_cli(*base, "--model", str(ssm)))
    m = make_tiny_model(tmp_path / "m")
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"id": "a-1", "turns": ["hello"]}\n{"id": "a-2", "turns": ["hi"\n')
    assert f"{bad}:2" in _one_error(_cli(*base, "--model", str(m), "--prompts", str(bad)))
    notpl = make_tiny_model(tmp_path / "notpl")
    cfg = json.loads((notpl / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (notpl / "tokenizer_config.json").write_text(json.dumps(cfg))
    (notpl / "chat_template.jinja").unlink(missing_ok=True)
    assert "no chat template" in _one_error(_cli(*base, "--model", str(notpl)))
    assert not run.exists()


def test_no_disk_space_refused_before_anything(tmp_path, monkeypatch, capsys):
    import shutil

    m = make_tiny_model(tmp_path / "m")
    monkeypatch.setattr(auto.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 2**20, 2**20))
    assert main(["auto", "--model", str(m), "--run", str(tmp_path / "run"), "--minutes", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "too little disk space" in err
    assert not (tmp_path / "run").exists()


def test_slower_verdict_is_not_installed_unless_asked(tmp_path):
    bench = {"settings": {"greedy": {"mlx-lm": 10.0, "ptp": 8.0}}, "speedup": 0.8, "identical": 2, "compared": 2}
    a = auto.argparse.Namespace(no_install=False, install_anyway=False, model=None)
    info = auto._install(a, auto.RunFolder(tmp_path), "f" * 16, bench)
    assert info["installed"] is None and "slower" in info["why"]
    line = auto.verdict_line({"mean_accepted": 1.5}, bench, info)
    assert line.startswith("verdict: slower, 0.80x") and "not installed" in line


def test_installed_adapter_comes_before_a_shipped_one(tmp_path, monkeypatch):
    import mlx_lm

    from ptp_mlx import adapter as adapter_mod
    from ptp_mlx.testing import save_random_adapter

    m = make_tiny_model(tmp_path / "m")
    shipped = tmp_path / "shipped"
    save_random_adapter(m, shipped / "tiny", seed=1)
    monkeypatch.setattr(adapter_mod, "shipped_adapters_dir", lambda: shipped)
    base, _ = mlx_lm.load(str(m))
    assert adapter_mod.adapter_for(base) == shipped / "tiny"
    assert adapter_mod.adapter_for(base, shipped=False) is None
    mine = Path(os.environ["PTP_MLX_HOME"]) / "adapters" / "m-1234"
    save_random_adapter(m, mine, seed=2)
    assert adapter_mod.adapter_for(base) == mine


def test_one_auto_per_run_folder(tmp_path, capsys):
    import fcntl

    m = make_tiny_model(tmp_path / "m")
    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running auto holds it
        assert main(["auto", "--model", str(m), "--run", str(run), "--minutes", "5"]) == 2
    assert "another ptp-train auto is running" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == [".lock"]


def test_not_installed_over_a_better_adapter_unless_asked(tmp_path):
    bench = {"settings": {}, "speedup": 1.3, "identical": 2, "compared": 2}
    ev = {"mean_accepted": 1.2, "previous": {"adapter": "shipped", "mean_accepted": 2.0}}
    a = auto.argparse.Namespace(no_install=False, install_anyway=False, model=str(tmp_path / "m"))
    info = auto._install(a, auto.RunFolder(tmp_path / "run"), "f" * 16, bench, ev)
    assert info["installed"] is None and "scores higher" in info["why"]
    (tmp_path / "run" / "adapter").mkdir(parents=True)
    (tmp_path / "run" / "adapter" / "adapter_config.json").write_text("{}")
    a.install_anyway = True
    info = auto._install(a, auto.RunFolder(tmp_path / "run"), "f" * 16, bench, ev)
    assert Path(info["installed"]).name == "m-ffffffff"
    assert (Path(info["installed"]) / "adapter_config.json").is_file()
