"""Whether the next call is built while this one computes (``decode/chain_odds.ChainChoice``): learnt from the calls'
own times, on a fake clock here; and a learnt answer is the autoregressive one whichever way its calls were built."""

from __future__ import annotations

from ptp_mlx.decode.chain_odds import EXPLORE, LEARN, ChainChoice, choice_for

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
    ahead = _feed(gpu, 0.010, 0.0015, 0.0085, 0.0015, True, 3 * EXPLORE)
    assert sum(not a for a in ahead) == 3  # only the exploring calls skip it
    assert gpu.describe().startswith("building ahead: on")
    # This CPU (measured 2026-12-05): the build delays the compute by most of its time, a read confirms 2 in 3.
    cpu = ChainChoice()
    ahead = _feed(cpu, 0.005, 0.003, 0.0033, 0.0013, True, LEARNING)
    for k in range(30):
        cpu.judge(k % 3 != 0)
    assert cpu.pays() is False
    ahead = _feed(cpu, 0.005, 0.003, 0.0033, 0.0013, True, 3 * EXPLORE)
    assert sum(ahead) == 3 and cpu.describe().startswith("building ahead: off")


def test_the_choice_follows_a_machine_that_changes():
    choice = ChainChoice()
    _feed(choice, 0.010, 0.0015, 0.0085, 0.0015, True, LEARNING)
    assert choice.pays() is True
    # The cores get busy (another job): the builds now delay the reads; the exploring calls keep measuring both ways.
    _feed(choice, 0.005, 0.003, 0.004, 0.0013, False, 40 * EXPLORE)
    assert choice.pays() is False
    _feed(choice, 0.010, 0.0015, 0.0085, 0.0015, True, 80 * EXPLORE)
    assert choice.pays() is True


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
