"""Whether the next call is built while this one computes (``decode/chain_odds.ChainChoice``): learnt from the calls'
own times, on a fake clock here; and a learnt answer is the autoregressive one whichever way its calls were built."""

from __future__ import annotations

import json

from ptp_mlx.decode.chain_odds import BACK_OFF, EXPLORE, LEARN, ChainChoice, choice_at, choice_for

LEARNING = 2 * (LEARN + 1)  # calls until both ways are measured (the first build ahead has no wait to compare with)


def _feed(choice: ChainChoice, wait: float, build: float, wait_after: float, saving: float, hit: bool, calls: int):
    """``calls`` calls on a machine where a read waits ``wait`` with nothing built, ``wait_after`` after ``build``
    seconds of building ahead; a build after the read takes ``saving``; the read confirms a build ahead or not."""
    ahead = []
    for _ in range(calls):
        on = choice.use()
        ahead.append(on)
        if on:
            choice.read_waited(wait_after, build)
            choice.judge(hit)
        else:
            choice.read_waited(wait, None)
            choice.built_on_path(saving)
    return ahead


def test_until_both_ways_are_measured_the_calls_alternate():
    choice = ChainChoice()
    assert choice.pays() is None and "being learnt" in choice.describe()
    ahead = _feed(choice, 0.005, 0.003, 0.003, 0.0013, True, LEARNING)
    assert ahead[: 2 * LEARN] == [True, False] * LEARN
    assert choice.pays() is not None


def test_a_gpu_like_machine_builds_ahead_a_busy_cpu_does_not():
    # GPU: the build runs while the device computes (the read then waits the rest): it pays even at a 30% hit rate.
    gpu = ChainChoice()
    _feed(gpu, 0.010, 0.0015, 0.0085, 0.0015, False, LEARNING)
    for k in range(200):
        gpu.judge(k % 10 < 3)
    assert gpu.pays() is True
    ahead = _feed(gpu, 0.010, 0.0015, 0.0085, 0.0015, True, 3 * EXPLORE * BACK_OFF)
    assert sum(not a for a in ahead) == 3  # only the exploring calls skip it (measured clearly: rarely)
    assert gpu.describe().startswith("building ahead: on")
    # This CPU (measured 2026-12-05): the build delays the compute by most of its time, a read confirms 2 in 3.
    cpu = ChainChoice()
    ahead = _feed(cpu, 0.005, 0.003, 0.0033, 0.0013, True, LEARNING)
    for k in range(30):
        cpu.judge(k % 3 != 0)
    assert cpu.pays() is False
    ahead = _feed(cpu, 0.005, 0.003, 0.0033, 0.0013, True, 3 * EXPLORE * BACK_OFF)
    assert sum(ahead) == 3 and cpu.describe().startswith("building ahead: off")


def test_a_choice_measured_clearly_explores_less_often():
    """Both ways stay measured: one call in ``EXPLORE`` is built the other way round while the gain is within a few
    standard errors of the choice's margin, one in ``EXPLORE * BACK_OFF`` once it is far beyond."""
    choice = ChainChoice()
    _feed(choice, 0.010, 0.0015, 0.0085, 0.0015, True, LEARNING)
    clear = _feed(choice, 0.010, 0.0015, 0.0085, 0.0015, True, 4 * EXPLORE * BACK_OFF)
    assert sum(not a for a in clear) == 4
    close = ChainChoice()  # (the builds after the read spread: building ahead gains a few standard errors' worth)
    for k in range(LEARNING + 4 * EXPLORE * BACK_OFF):
        if close.use():
            close.read_waited(0.0085, 0.0015)
            close.judge(True)
        else:
            close.read_waited(0.010, None)
            close.built_on_path(0.003 + (0.003 if k % 4 < 2 else -0.003))
    margin = close._margin()
    assert margin is not None and 2.0 * margin[1] < margin[0] < 8.0 * margin[1], margin
    late = [close.use() for _ in range(2 * EXPLORE * BACK_OFF)]
    assert sum(not a for a in late) == 2 * BACK_OFF


def test_the_choice_follows_a_machine_that_changes():
    choice = ChainChoice()
    _feed(choice, 0.010, 0.0015, 0.0085, 0.0015, True, LEARNING)
    assert choice.pays() is True
    # The cores get busy (another job): the builds now delay the reads; the exploring calls keep measuring both ways.
    _feed(choice, 0.005, 0.003, 0.004, 0.0013, False, 40 * EXPLORE)
    assert choice.pays() is False
    _feed(choice, 0.010, 0.0015, 0.0085, 0.0015, True, 80 * EXPLORE)
    assert choice.pays() is True


def test_the_cost_of_building_ahead_compares_calls_of_as_many_rows():
    # Measured on held-out prompts here: the calls built ahead were mostly wide lookup chains, the others narrow
    # priming calls; one mean wait over both made building ahead look 3.4 ms cheaper than free, and it was turned on
    # where it lost. Here a build ahead adds 0.5 ms to a read of any width, whatever the mix of widths each way.
    choice = ChainChoice()
    for k in range(400):
        on = choice.use()
        narrow = k % 5 != 0 if not on else k % 5 == 0  # (built ahead: mostly wide calls; the others mostly narrow)
        shape, wait = ((1, 2, False), 0.004) if narrow else ((6, 2, True), 0.012)
        if on:
            choice.read_waited(wait - 0.001, 0.0015, shape)
            choice.judge(True)
        else:
            choice.read_waited(wait, None, shape)
            choice.built_on_path(0.0004)
    assert abs(choice.extra - 0.0005) < 1e-4
    assert choice.pays() is False  # (it saves 0.4 ms a confirmed call and costs 0.5)


def test_a_gain_within_the_noise_of_the_calls_does_not_build_ahead():
    # The same mean gain (two reads in three confirmed, 1 ms saved each, 0.1 ms added): measured steadily it is taken,
    # measured through reads that spread by 1.5 ms either way (a busy 2-core CPU) it is not.
    def learnt(spread: float) -> bool | None:
        choice = ChainChoice()
        for k in range(300):
            if choice.use():
                choice.read_waited(0.008 + (spread if k % 4 < 2 else -spread), 0.0001, (1, 2, True))
                choice.judge(k % 3 != 0)
            else:
                choice.read_waited(0.008, None, (1, 2, True))
                choice.built_on_path(0.001)
        return choice.pays()

    assert learnt(0.0) is True
    assert learnt(0.0015) is False


def test_one_choice_per_model_kept_across_answers():
    class Model:
        pass

    a, b = Model(), Model()
    assert choice_for(a) is choice_for(a) and choice_for(a) is not choice_for(b)


def test_a_set_choice_holds_whatever_is_measured():
    """``ptp-bench --free-rows`` sets building ahead on, as a GPU would learn it."""
    choice = ChainChoice()
    choice.forced = True
    assert all(_feed(choice, 0.005, 0.003, 0.0033, 0.0013, False, 3 * EXPLORE))
    assert choice.describe() == "building ahead: on (set, not learnt)"


class _Model:
    pass


def test_the_choice_is_kept_on_disk_and_read_back_by_the_next_process(tmp_path):
    """A machine learns the choice once (``choice_at``: beside the cost curve), not in every process: written at the
    end of each answer that measured reads (``flush``), read back by the next start with the same margin, so that
    start builds ahead (or not) from its first call instead of alternating."""
    path = tmp_path / "cost-curves" / "chain-choice-k.json"
    first = choice_at(_Model(), path)
    assert first.source == "new" and not path.exists()
    first.flush()
    assert not path.exists()  # (nothing measured yet)
    _feed(first, 0.010, 0.0015, 0.0085, 0.0015, True, LEARNING)
    assert first.pays() is True and not path.exists()  # (not on the tokens' path: at the answer's end)
    first.flush()
    assert path.exists()
    pm = _Model()
    again = choice_at(pm, path)
    assert choice_for(pm) is again and again.source == "kept" and "kept in" in again.describe()
    assert again.pays() is True and abs(again._margin()[0] - first._margin()[0]) < 0.01 * first._margin()[0]
    assert all(_feed(again, 0.010, 0.0015, 0.0085, 0.0015, True, EXPLORE - 1))  # (no learning again: built ahead)
    assert choice_at(_Model(), path, fresh=True).pays() is None  # (--recalibrate learns it again)


def test_a_cpu_like_choice_learnt_off_is_kept_off(tmp_path):
    path = tmp_path / "chain-choice-k.json"
    cpu = choice_at(_Model(), path)
    _feed(cpu, 0.005, 0.003, 0.0033, 0.0013, True, LEARNING)
    for k in range(30):
        cpu.judge(k % 3 != 0)
    _feed(cpu, 0.005, 0.003, 0.0033, 0.0013, True, 2 * EXPLORE)
    cpu.flush()
    assert cpu.pays() is False and choice_at(_Model(), path).pays() is False


def test_an_unreadable_or_unwritable_file_only_means_learning_again(tmp_path):
    path = tmp_path / "chain-choice-k.json"
    path.write_text("{not json")
    choice = choice_at(_Model(), path)
    assert choice.source == "new" and choice.pays() is None
    _feed(choice, 0.010, 0.0015, 0.0085, 0.0015, True, LEARNING)
    choice.flush()
    assert json.loads(path.read_text())["choice"] is True  # (written over)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    choice = choice_at(_Model(), blocked / "chain-choice-k.json")  # (its folder is a file: never writable)
    _feed(choice, 0.010, 0.0015, 0.0085, 0.0015, True, LEARNING)
    choice.flush()
    assert choice.pays() is True and choice.path is None  # (this process only, no error)


def test_a_set_choice_is_never_written(tmp_path):
    path = tmp_path / "chain-choice-k.json"
    choice = choice_at(_Model(), path)
    choice.forced = True
    _feed(choice, 0.010, 0.0015, 0.0085, 0.0015, True, LEARNING)
    choice.flush()
    assert not path.exists()
