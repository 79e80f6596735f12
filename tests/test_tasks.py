"""Task accuracy of acceptance rules (ptp_mlx/bench/tasks.py, ``ptp-bench --tasks``): the generated set, the answer
check, the interval, and the command on the tiny model (exact first, a lenient rule at its strictest setting
gives exact's answers, bad input is one line and exit 2 with nothing written)."""

import json

import pytest

from ptp_mlx.bench import cli
from ptp_mlx.bench.tasks import KINDS, Task, is_right, make_openers, make_tasks, wilson


def test_the_set_is_the_same_every_time_and_covers_every_kind():
    a, b = make_tasks(70, seed=0), make_tasks(70, seed=0)
    assert a == b and make_tasks(70, seed=1) != a
    assert {t.kind for t in a} == set(KINDS) and len({t.prompt for t in a}) > 50
    for t in a:
        assert t.answer and t.answer not in t.others
        if t.kind.startswith("passage-"):  # the answer and the wrong candidate are both in the passage
            assert t.answer in t.prompt and all(o in t.prompt for o in t.others)


def test_openers_are_other_items_of_each_kind():
    tasks = make_tasks(70, seed=0)
    openers = make_openers(tasks, seed=0)
    assert openers == make_openers(tasks, seed=0) and openers != make_openers(tasks, seed=1)
    for t, o in zip(tasks, openers, strict=True):
        assert o.kind == t.kind and o.answer != t.answer and o.prompt != t.prompt


def test_answer_check():
    city = Task("passage-city", "...", "Oslo", ("Lima",))
    assert is_right(city, "Maria lives in Oslo.") and is_right(city, "OSLO")
    assert not is_right(city, "Maria lives in Oslo and Noah in Lima.")  # the passage repeated is not an answer
    assert not is_right(city, "Osloville") and not is_right(city, "")
    num = Task("sum", "...", "1200")
    assert is_right(num, "It is 1,200.") and not is_right(num, "12000") and not is_right(num, "120")


def test_wilson_interval():
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.404, abs=1e-3) and hi == pytest.approx(0.596, abs=1e-3)
    assert wilson(0, 10)[0] == 0.0 and 0 < wilson(0, 10)[1] < 0.35 and wilson(10, 10)[1] == 1.0
    assert wilson(0, 0) == (0.0, 1.0)


def test_cli_tasks_table_json_and_plot(tiny_model_dir, adapter_dir, tmp_path, capsys):
    argv = ["--model", str(tiny_model_dir), "--adapter", str(adapter_dir), "--max-tokens", "6", "--tasks", "7"]
    argv += ["--rules", "entropy:eps=2,delta=2;threshold:0.5", "--json", str(tmp_path / "t.json")]
    rc = cli.main(argv + ["--plot", str(tmp_path / "t.png")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "lenient rules are not the exact sample" in out.splitlines()[0]
    doc = json.loads((tmp_path / "t.json").read_text())["tasks"]
    rules = doc["rules"]
    assert [r["rule"] for r in rules] == ["exact", "lenient entropy eps=2 delta=2", "lenient threshold tau=0.5"]
    assert all(r["items"] == 7 and 0 <= r["ci95"][0] <= r["accuracy"] <= r["ci95"][1] <= 1 for r in rules)
    # Above 1 the entropy rule accepts nothing the exact rule does not: exact decoding, answer for answer.
    assert rules[1]["same_answer"] == 1.0 and rules[1]["lost"] == rules[1]["gained"] == 0
    assert rules[1]["tokens_per_call"] == rules[0]["tokens_per_call"]
    assert len(doc["items"]) == 7 and all(len(it["right"]) == 3 for it in doc["items"])
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_tasks_follow_ups(tiny_model_dir, adapter_dir, tmp_path, capsys):
    """``--follow-ups``: each item is a chat's second turn; the strictest lenient setting is still exact's answers."""
    argv = ["--model", str(tiny_model_dir), "--adapter", str(adapter_dir), "--max-tokens", "6", "--tasks", "4"]
    argv += ["--follow-ups", "--rules", "entropy:eps=2,delta=2", "--json", str(tmp_path / "t.json")]
    assert cli.main(argv) == 0
    assert "--tasks 4 --follow-ups" in capsys.readouterr().out.splitlines()[0]
    doc = json.loads((tmp_path / "t.json").read_text())["tasks"]
    assert doc["settings"]["follow_ups"] is True and doc["rules"][1]["same_answer"] == 1.0


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--tasks", "0"], "--tasks"),
        (["--follow-ups"], "--follow-ups"),
        (["--tasks", "3", "--rules", "exact;lax"], "--rules"),
        (["--tasks", "3", "--rules", "threshold:tau=x"], "--rules"),
    ],
)
def test_cli_tasks_bad_input(tiny_model_dir, adapter_dir, tmp_path, capsys, extra, msg):
    argv = ["--model", str(tiny_model_dir), "--adapter", str(adapter_dir), "--json", str(tmp_path / "t.json")]
    rc = cli.main(argv + extra)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and msg in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t.json").exists()
