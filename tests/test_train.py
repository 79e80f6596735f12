"""Distillation on a tiny random model: pregenerate, a few training steps, resume equivalence."""

import argparse
import json

import mlx.core as mx
import numpy as np

from ptp_mlx.train.data import is_validation, read_prompts, read_records
from ptp_mlx.train.pregenerate import pregenerate
from ptp_mlx.train.train import add_train_args, train
from ptp_mlx.train.validate import evaluate


def _args(run, **kw):
    p = argparse.ArgumentParser()
    add_train_args(p)
    a = p.parse_args(["--data", "x", "--run", str(run)])
    for k, v in {
        "steps": 6,
        "rank": 4,
        "alpha": 8.0,
        "window": 4,
        "windows_per_seq": 4,
        "seqs_per_step": 2,
        "lr": 3e-3,
        "warmup": 2,
        "save_every": 3,
        "eval_every": 3,
        **kw,
    }.items():
        setattr(a, k, v)
    return a


def _prompts(tmp_path, n=6):
    f = tmp_path / "prompts.jsonl"
    f.write_text(
        "\n".join(json.dumps({"id": f"p-{i}", "category": "c", "turns": [f"say {i} {i}"]}) for i in range(1, n + 1))
    )
    return f


def test_split_is_stable(tmp_path):
    f = _prompts(tmp_path, 12)
    train_ids = {p["id"] for p in read_prompts(f, "train")}
    val_ids = {p["id"] for p in read_prompts(f, "val")}
    assert val_ids == {"p-5", "p-10"} and not train_ids & val_ids and len(train_ids) == 10
    assert is_validation("x-0") and not is_validation("x-3")


def test_pregenerate_writes_bins_that_reproduce_tokens(tiny, tmp_path):
    from ptp_mlx.sampler import SamplingSettings, pick

    model, tok = tiny
    out = tmp_path / "teacher.jsonl"
    s = SamplingSettings(0.7, 50, 0.95)
    n = pregenerate(model, tok, _prompts(tmp_path, 3), out, n=4, sampling=s, max_new=12, split="all")
    recs = read_records(out)
    assert n == len(recs) == 12 and recs[0]["greedy"] and not recs[1]["greedy"]
    # Resumable: a second run adds nothing.
    assert pregenerate(model, tok, _prompts(tmp_path, 3), out, n=4, sampling=s, max_new=12, split="all") == 0
    # Every stored bin reproduces its token through the exact sampler (u at the bin's middle).
    rec = recs[1]
    toks = rec["tokens"]
    logits = model(mx.array(toks[:-1])[None])[0, rec["start"] - 1 :].astype(mx.float32)
    mid = (np.array(rec["left"]) + np.array(rec["right"])) / 2
    got = pick(mx.array(mid.astype(np.float32)), logits, 0.7, 50, 0.95).tolist()
    assert got == toks[rec["start"] :]


def _predictable_records(n=12, length=40):
    # A teacher that repeats a fixed cycle: trivially predictable continuations.
    cyc = [10, 20, 30, 40, 50, 60]
    recs = []
    for i in range(n):
        toks = [1, 5 + i % 3] + [cyc[(i + j) % len(cyc)] for j in range(length)]
        recs.append({"tokens": toks, "start": 2, "left": [0.0] * length, "right": [1.0] * length, "category": "c"})
    return recs


def test_training_lowers_loss_and_raises_acceptance(tiny, tmp_path):
    from ptp_mlx.model.ptp import PTPAdapter, PTPModel

    model, _ = tiny
    recs = _predictable_records()
    a = _args(tmp_path / "run", steps=40, eval_every=40, save_every=40)
    mx.random.seed(0)
    before = evaluate(PTPModel(model), PTPAdapter(model, 4, 2.0, "binary"), recs[:4], 4, 4, 0)["mean_accepted"]
    train(model, recs, recs[:4], a, log=lambda m: None)
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "train.log").read_text().splitlines() if '"loss"' in x]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    state = json.loads((tmp_path / "run" / "last" / "state.json").read_text())
    best = state["best"]
    assert best["mean_accepted"] > before + 1.0
    assert (tmp_path / "run" / "best" / "adapter_config.json").exists()
    # The per-mode histograms (all records here are sampled) and slot accuracies agree with the histogram.
    assert best["histograms"] == {"sampled": best["histogram"]}
    assert len(best["slot_accuracy"]) == 4
    hist = np.array(best["histogram"])
    assert best["slot_accuracy"][1] >= hist[1:].sum() / hist.sum() - 1e-9  # first draft right whenever >= 1 accepted


def test_resume_equals_uninterrupted(tiny, tmp_path, monkeypatch):
    import pytest

    import ptp_mlx.train.train as tr

    model, _ = tiny
    recs = _predictable_records()
    full = tmp_path / "full"
    train(model, recs, [], _args(full, steps=6), log=lambda m: None)
    part = tmp_path / "part"
    real_checkpoint = tr._checkpoint

    def checkpoint_then_die(run, adapter, opt, state):
        real_checkpoint(run, adapter, opt, state)
        raise KeyboardInterrupt  # the session is stopped right after the step-3 checkpoint

    monkeypatch.setattr(tr, "_checkpoint", checkpoint_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(model, recs, [], _args(part, steps=6), log=lambda m: None)
    monkeypatch.setattr(tr, "_checkpoint", real_checkpoint)
    a = _args(part, steps=6)
    a.resume = True
    train(model, recs, [], a, log=lambda m: None)
    w1 = mx.load(str(full / "last" / "adapter.safetensors"))
    w2 = mx.load(str(part / "last" / "adapter.safetensors"))
    assert set(w1) == set(w2)
    for k in w1:
        assert mx.array_equal(w1[k], w2[k]), k


def test_batched_pregenerate_matches_one_prompt_at_a_time(tiny, tmp_path):
    """Left-padded batches of prompts give each prompt the tokens and bins it gets on its own."""
    from ptp_mlx.sampler import SamplingSettings

    model, tok = tiny
    s = SamplingSettings(0.7, 50, 0.95)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"id": f"q-{i}", "category": "c", "turns": ["x" * (i * 3 + 1)]}) for i in range(1, 6))
    )
    one, many = tmp_path / "one.jsonl", tmp_path / "many.jsonl"
    pregenerate(model, tok, prompts, one, n=3, sampling=s, max_new=10, split="all")
    pregenerate(model, tok, prompts, many, n=3, sampling=s, max_new=10, split="all", batch_prompts=4)
    key = lambda r: (r["prompt_id"], r["greedy"], r["tokens"])  # noqa: E731
    a, b = sorted(read_records(one), key=key), sorted(read_records(many), key=key)
    assert len(a) == len(b) == 15
    for ra, rb in zip(a, b, strict=True):
        assert ra["prompt_id"] == rb["prompt_id"] and ra["tokens"] == rb["tokens"]
        np.testing.assert_allclose(ra["left"], rb["left"], atol=1e-5)
        np.testing.assert_allclose(ra["right"], rb["right"], atol=1e-5)


def test_prompt_builder_reads_wheels_and_splits_every_source(tmp_path):

    import pytest

    from ptp_mlx.errors import UserError
    from ptp_mlx.train.corpora import build_prompts

    cb, gs = _fake_wheels(tmp_path)
    out = tmp_path / "prompts.jsonl"
    n = build_prompts(out, cb, gs, n_math=40)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert n == len(rows) == 30 + 20 + 40 + 250
    assert {r["category"] for r in rows} == {"instruction", "math_reasoning", "coding"}
    assert not any("Hola" in r["turns"][0] for r in rows)
    for src in ("chat", "news", "math", "code"):
        ids = [r["id"] for r in rows if r["source"] == src]
        assert 0 < sum(is_validation(i) for i in ids) < len(ids)
    assert build_prompts(tmp_path / "again.jsonl", cb, gs, n_math=40) == n
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()  # seeded: reproducible
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(UserError):
        build_prompts(tmp_path / "x.jsonl", tmp_path / "bad.whl", None)
    assert not (tmp_path / "x.jsonl").exists()


def test_init_starts_from_an_adapter_and_reload_picks_up_new_records(tiny, tmp_path):
    import pytest

    from ptp_mlx.errors import UserError

    model, _ = tiny
    recs = _predictable_records()
    first = tmp_path / "first"
    train(model, recs, [], _args(first, steps=3), log=lambda m: None)
    # With a zero learning rate, a run started from --init keeps exactly the weights it loaded.
    second = tmp_path / "second"
    train(model, recs, [], _args(second, steps=1, lr=0.0, init=first / "last"), log=lambda m: None)
    w1 = mx.load(str(first / "last" / "adapter.safetensors"))
    w2 = mx.load(str(second / "last" / "adapter.safetensors"))
    assert set(w1) == set(w2) and all(mx.array_equal(w1[k], w2[k]) for k in w1)
    lines = []
    train(
        model,
        recs[:4],
        [],
        _args(tmp_path / "third", steps=4, init=first / "last", reload_every=2),
        log=lines.append,
        reload=lambda: recs,
    )
    assert any("initialised from" in x for x in lines)
    assert any("12 teacher records" in x for x in lines)  # re-read at step 2: all 12 records now
    w3 = mx.load(str(tmp_path / "third" / "last" / "adapter.safetensors"))
    assert set(w3) == set(w1) and any(not mx.array_equal(w1[k], w3[k]) for k in w1)
    with pytest.raises(UserError, match="does not match"):
        train(model, recs, [], _args(tmp_path / "bad", steps=1, rank=2, init=first / "last"), log=lambda m: None)
    with pytest.raises(UserError, match="no adapter.safetensors"):
        train(model, recs, [], _args(tmp_path / "bad2", steps=1, init=tmp_path / "nowhere"), log=lambda m: None)


def test_teacher_forced_windows_reproduce_the_document(tiny, tmp_path):
    """Corpus records: every u that make_windows draws inside a token's bin makes the exact sampler return that
    very token, so the document is the sample those u produce; out-of-support tokens end their window."""
    import mlx.core as mx
    import numpy as np

    from ptp_mlx.sampler import SamplingSettings, pick
    from ptp_mlx.train.teacher_forced import build, documents, teacher_forced_record
    from ptp_mlx.train.windows import make_windows

    model, tok = tiny
    text = next(doc for _, _, _, doc in documents(True, None, None))
    for s in (SamplingSettings(1.0), SamplingSettings(0.7, 20, 0.9)):
        rec = teacher_forced_record(model, tok, "Write some Python.", text, s, 96)
        start, toks = rec["start"], rec["tokens"]
        logits = model(mx.array(toks[:-1])[None])[0].astype(mx.float32)
        empty = {start + i for i, (lo, r) in enumerate(zip(rec["left"], rec["right"], strict=True)) if r <= lo}
        rng = np.random.default_rng(0)
        windows, u, labels, valid = make_windows(rec, 40, 4, rng)
        checked = 0
        for w_i, w in enumerate(windows):
            for j in range(4):
                r = w_i * 4 + j
                q = w.ctx_len + j  # the token this slot predicts
                if any(w.ctx_len <= e <= q for e in empty):  # no u makes that token: the window ends there
                    assert not valid[r]
                if not valid[r]:
                    continue
                got = int(pick(mx.array(u[r]), logits[q - 1], s.temperature, s.top_k, s.top_p))
                assert got == labels[r] == toks[q]
                checked += 1
        assert checked > (30 if s.top_k == 0 else 3)  # a random tiny model keeps few text tokens in its top-k
    # The command's builder streams documents, skips what is written, keeps the validation split out.
    out = tmp_path / "corpus.jsonl"
    assert build(model, tok, out, limit=3, max_tokens=32) == 3
    assert build(model, tok, out, limit=2, max_tokens=32) == 2
    ids = [r["prompt_id"] for r in map(json.loads, out.read_text().splitlines())]
    assert len(set(ids)) == 5 and not any(i[-1] in "05" for i in ids)


def test_teacher_files_and_prompt_splits_fail_clearly(tiny_model_dir, tmp_path, capsys):
    """ptp-train's bad inputs: one error line, exit 2, the file and line named; a cut-off last line is skipped."""
    from ptp_mlx.train.cli import main
    from ptp_mlx.train.data import read_records

    good = {"tokens": [1, 2, 3], "start": 1, "left": [0.0, 0.0], "right": [1.0, 1.0]}
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps(good) + "\n" + "{not json\n" + json.dumps(good) + "\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "turns": ["hi"]}) + "\n" for i in (0, 5, 10)))
    cases = [
        (["train", "--model", str(tiny_model_dir), "--data", str(data), "--run", str(tmp_path / "r")], "t.jsonl:2"),
        (
            ["train", "--model", str(tiny_model_dir), "--data", str(tmp_path / "nope.jsonl"), "--run", str(tmp_path)],
            "not found",
        ),
        (
            ["pregenerate", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o")],
            "no prompts of split 'train'",
        ),
    ]
    for argv, msg in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and msg in err[0], err
    assert not (tmp_path / "r").exists() and not (tmp_path / "o").exists()
    data.write_text(json.dumps(good) + "\n" + json.dumps(good)[:10])  # an interrupted writer
    notes = []
    assert len(read_records(data, log=notes.append)) == 1 and "cut-off last line" in notes[0]


def test_slot_weights_parse_and_reject_bad_specs():
    import pytest

    from ptp_mlx.errors import UserError
    from ptp_mlx.train.windows import slot_weights

    assert slot_weights(None, 3).tolist() == [1, 1, 1]
    assert np.allclose(slot_weights("decay:0.5", 4), [1, 0.5, 0.25, 0.125])
    assert slot_weights("2,1", 4).tolist() == [2, 1, 1, 1]
    for bad in ("decay:x", "1,-1", "0,0", "nan"):
        with pytest.raises(UserError):
            slot_weights(bad, 4)


def test_probability_order_training_records_its_order(tiny, tmp_path):
    """A run in probability order with slot weights: sampled records are re-binned from the teacher pass and the
    adapter's config records the order, so decoding with it samples in that order."""
    from ptp_mlx.adapter import read_config
    from ptp_mlx.bins import bins
    from ptp_mlx.sampler import SamplingSettings

    model, _ = tiny
    recs = _predictable_records(n=6, length=16)
    s = SamplingSettings(1.0)
    for r in recs:  # real id-order bins under T 1.0, as pregenerate would write them
        logits = model(mx.array(r["tokens"])[None])[0]
        lo, hi = bins(logits[r["start"] - 1 : -1], mx.array(r["tokens"][r["start"] :]), s)
        r.update(left=np.array(lo).tolist(), right=np.array(hi).tolist(), settings=s.as_dict())
    id_bins = [list(r["left"]) for r in recs]
    a = _args(tmp_path / "run", steps=4, eval_every=4, save_every=4, cdf_order="prob", slot_weights="decay:0.7")
    train(model, recs, recs[:2], a, log=lambda m: None)
    cfg = read_config(tmp_path / "run" / "best")
    assert cfg["cdf_order"] == "prob" and cfg["training"]["slot_weights"] == "decay:0.7"
    rebinned = [r for r in recs if r.get("order") == "prob"]
    assert rebinned and any(r["left"] != b for r, b in zip(recs, id_bins, strict=True) if r.get("order") == "prob")


def test_ptp_train_eval_scores_an_adapter_on_a_held_out_file(tiny_model_dir, tmp_path, capsys):
    """``ptp-train eval``: one JSON line with tokens per window and slot accuracy for greedy and sampled apart;
    a missing file is one error line and exit 2."""
    from ptp_mlx.testing import save_random_adapter
    from ptp_mlx.train.cli import main

    ad = save_random_adapter(tiny_model_dir, tmp_path / "ad", window=4)
    recs = _predictable_records(n=4, length=12)
    recs[0]["greedy"] = True
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in recs))
    argv = ["eval", "--model", str(tiny_model_dir), "--adapter", str(ad), "--val", str(val), "--window", "4"]
    assert main(argv) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["records"] == 4 and ev["cdf_order"] == "id" and 1.0 <= ev["mean_accepted"] <= 4.0
    assert set(ev["slot_accuracy_by_mode"]) == {"greedy", "sampled"} and len(ev["slot_accuracy"]) == 4
    assert sum(ev["histogram"]) == sum(ev["histograms"]["greedy"]) + sum(ev["histograms"]["sampled"])
    assert main([*argv[:-3], str(tmp_path / "missing.jsonl"), "--window", "4"]) == 2
    assert "not found" in capsys.readouterr().err


def test_study_tables_and_plots_runs_from_their_logs(tmp_path, capsys):
    from ptp_mlx.train.cli import main

    def ev(step, secs, g, s_):
        return {
            "step": step,
            "cpu_seconds": secs,
            "mean_accepted": 1.5,
            "histogram": [a + b for a, b in zip(g, s_, strict=True)],
            "histograms": {"greedy": g, "sampled": s_},
            "slot_accuracy": [0.7, 0.4, 0.2],
            "slot_accuracy_by_mode": {"greedy": [0.8, 0.5, 0.2], "sampled": [0.6, 0.3, 0.1]},
        }

    for name, order in (("a", "id"), ("b", "prob")):
        run = tmp_path / "runs" / name
        (run / "best").mkdir(parents=True)
        lines = [
            {"step": 1, "loss": 3.0},
            {"eval": ev(50, 360, [5, 5, 0], [8, 2, 0])},
            {"eval": ev(100, 720, [4, 4, 2], [6, 4, 0])},
        ]
        (run / "train.log").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (run / "best" / "adapter_config.json").write_text(
            json.dumps({"rank": 16, "cdf_order": order, "training": {"window": 8}})
        )
    (tmp_path / "runs" / "empty").mkdir()  # a run that has not validated yet is left out
    base = tmp_path / "base.json"
    base.write_text(json.dumps(ev(0, 0, [5, 5, 0], [5, 5, 0])))
    out = tmp_path / "study"
    assert main(["study", "--runs", str(tmp_path / "runs"), "--out", str(out), "--baseline", str(base)]) == 0
    md = (out / "study.md").read_text()
    assert md.count("\n") == 5 and "| b | scratch | 16 | 8 | binary | prob |" in md
    runs = json.loads((out / "study.json").read_text())
    assert [r["name"] for r in runs] == ["shipped", "a", "b"]
    assert runs[1]["last"]["cpu_hours"] == 0.2 and runs[1]["last"]["tokens_per_window_greedy"] == 1.8
    assert (out / "study.png").stat().st_size > 1000
    assert main(["study", "--runs", str(tmp_path / "nope"), "--out", str(out)]) == 2


def _fake_wheels(tmp_path):
    import zipfile

    cb = tmp_path / "chatterbot_corpus-1.3.3-py2.py3-none-any.whl"
    with zipfile.ZipFile(cb, "w") as z:
        convs = "\n".join(f"- - What is thing number {i}?\n  - It is {i}." for i in range(30))
        z.writestr("chatterbot_corpus/data/english/things.yml", "categories:\n- things\nconversations:\n" + convs)
        z.writestr("chatterbot_corpus/data/spanish/x.yml", "conversations:\n- - Hola que tal amigo mio\n  - bien\n")
    gs = tmp_path / "gensim.whl"
    with zipfile.ZipFile(gs, "w") as z:
        text = "\n".join(
            f"Reporters in Canberra met Anna Bell {i} times. " + " ".join(["word"] * 50) for i in range(20)
        )
        z.writestr("gensim/test/test_data/lee_background.cor", text)
    return cb, gs


def test_user_task_prompts_cover_what_users_ask(tmp_path):
    """``ptp-train prompts --user-tasks``: questions, summaries and RAG over the passages, translation both ways
    (chatterbot's Spanish into English), chats of several turns; every source split for validation."""
    from ptp_mlx.train.corpora import build_prompts
    from ptp_mlx.train.user_tasks import names, sentences

    assert names("The talks in Canberra ended. Anna Bell said the President left.") == ["Canberra", "Anna Bell"]
    assert sentences("One. Two? Three!") == ["One.", "Two?", "Three!"]
    cb, gs = _fake_wheels(tmp_path)
    out = tmp_path / "prompts.jsonl"
    n = build_prompts(out, cb, gs, n_math=40, user_tasks=True)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    cats = {r["category"] for r in rows}
    assert {"qa", "summarization", "rag", "translation", "conversation"} <= cats and n == len(rows)
    assert n > 30 + 20 + 40 + 250  # the plain file's prompts and more
    assert any("Hola que tal amigo mio" in r["turns"][0] for r in rows if r["source"] == "to-en")
    assert any("Canberra" in r["turns"][0] or "Anna Bell" in r["turns"][0] for r in rows if r["source"] == "passage-qa")
    chats = [r for r in rows if r["category"] == "conversation"]
    assert chats and all(2 <= len(r["turns"]) <= 3 for r in chats)
    for src in {r["source"] for r in rows}:
        ids = [r["id"] for r in rows if r["source"] == src]
        assert len(ids) < 5 or 0 < sum(is_validation(i) for i in ids) < len(ids), src
    assert build_prompts(tmp_path / "again.jsonl", cb, gs, n_math=40, user_tasks=True) == n
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()  # seeded: reproducible


def test_pregenerate_answers_a_chat_turn_by_turn(tiny, tmp_path):
    """A prompt of several turns is completed after the teacher's own greedy answer to each earlier turn."""
    from ptp_mlx.prompt import encode_prompt
    from ptp_mlx.sampler import SamplingSettings

    model, tok = tiny
    s = SamplingSettings(0.7, 50, 0.95)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    one.write_text(json.dumps({"id": "c-1", "category": "c", "turns": ["tell me a story"]}))
    two.write_text(json.dumps({"id": "c-1", "category": "c", "turns": ["tell me a story", "shorter please"]}))
    pregenerate(model, tok, one, tmp_path / "a.jsonl", n=1, sampling=s, max_new=8, split="all")
    pregenerate(model, tok, two, tmp_path / "b.jsonl", n=2, sampling=s, max_new=8, split="all")
    first = read_records(tmp_path / "a.jsonl")[0]  # the greedy answer to the first turn alone
    answer = tok.decode([t for t in first["tokens"][first["start"] :] if t not in set(tok.eos_token_ids)])
    chat = [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "shorter please"},
    ]
    recs = read_records(tmp_path / "b.jsonl")
    assert len(recs) == 2 and all(r["tokens"][: r["start"]] == encode_prompt(tok, chat) for r in recs)
