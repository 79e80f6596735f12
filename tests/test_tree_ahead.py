"""Token trees built ahead of the read (``TreeDrafter.guess``, ``decode/pipeline.py``): the next call is built with
the adapter's tree, priced on the probabilities seen so far per slot and rank, its tokens gathered on the device
from the call's argmax and runner-ups; after the read it runs when the budget keeps it. The answer stays plain
decoding's, token for token."""

from collections import Counter

import pytest

import ptp_mlx.decode.ahead as ahead
import ptp_mlx.decode.pipeline as pipeline
from ptp_mlx.drafting.budget import Budget
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.protocol import CallResult, DraftPlan, Guess, Strand
from ptp_mlx.drafting.rows import reach
from ptp_mlx.drafting.strands import TreeCosts
from ptp_mlx.drafting.topk_tree import SlotCandidates, grow, layout, tree_value
from ptp_mlx.drafting.tree import TreeDrafter
from ptp_mlx.model.ptp import PTPModel
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.testing.decoding import PROMPTS, SETTINGS, WINDOW, ar, assert_same, with_seed

CANDS = SlotCandidates(((10, 11, 12), (20, 21, 22), (30, 31, 32)), ((0.6, 0.3, 0.1), (0.5, 0.4, 0.1), (0.7, 0.2, 0.1)))


def test_a_guess_puts_the_reads_argmax_and_runner_ups_in_its_placeholders():
    plan = DraftPlan((0, 0), ((2, 3),), strands=(Strand(0, (0, 0)), Strand(1, (0,), parent=0)))
    g = Guess(plan, [1, 2], ((1, 2), (2, 0), (2, 1)))
    res = CallResult([5], 0, aux_tokens=[7, 8, 9], alts=[[(70, 0.1)], [(80, 0.1), (81, 0.05)], [(90, 0.2)]])
    real = g.realize(res)
    assert real.drafts == (8, 9) and real.branches == plan.branches
    assert [st.tokens for st in real.strands] == [(81, 9), (90,)]
    assert [(st.at, st.parent) for st in real.strands] == [(0, -1), (1, 0)]
    short = CallResult([5], 0, aux_tokens=[7, 8, 9], alts=[[], [], []])
    assert g.realize(short).strands[0].tokens[0] == -1  # (a rank the read lacks: never confirmed, pipeline.py)


def test_a_trees_value_is_the_sum_of_its_nodes_chances():
    p = reach([0.6, 0.5, 0.7], 1.0)
    nodes = grow(3, p, CANDS, 1.0, 12, 10)
    strands, _ = layout(nodes)
    c = TreeCosts(lambda r: 1.0, lambda w: 0.5 * max(0, w - 1), 4, 64, 100)
    assert tree_value(3, p, CANDS, 1.0, strands, c) == pytest.approx(sum(v.p for v in nodes))
    # a window at a strand's end adds its last token's chance times the window's value
    windowed = strands[:1] + (Strand(strands[1].at, strands[1].tokens, 3, parent=strands[1].parent),) + strands[2:]
    last = nodes[[i for i, v in enumerate(nodes) if v.token == strands[1].tokens[-1]][0]].p
    assert tree_value(3, p, CANDS, 1.0, windowed, c) == pytest.approx(sum(v.p for v in nodes) + last * 1.0)
    assert tree_value(3, p, CANDS, 1.0, (Strand(0, (99,)),), c) == 0.0  # a token no slot offers


def test_the_budget_keeps_the_tree_built_ahead_unless_the_read_finds_a_much_better_one():
    b = Budget(CostCurve([1, 64], [1.0, 1.0]), max_width=4)
    now = b.rows_for([10, 20, 30], [0.6, 0.5, 0.7], 100, 64, candidates=CANDS)
    assert now.strands
    # built ahead: the same chain and branches, the tree without its last strand: kept, it saves host time
    built = DraftPlan(now.drafts, now.branches, strands=now.strands[:-1], source="ptp")
    kept = b.rows_for([10, 20, 30], [0.6, 0.5, 0.7], 100, 64, pending=built, candidates=CANDS)
    assert kept.strands == built.strands
    # built ahead with tokens the read made worthless (no slot offers them): the tree chosen now
    wrong = DraftPlan(now.drafts, now.branches, strands=(Strand(0, (99, 98)),), source="ptp")
    assert b.rows_for([10, 20, 30], [0.6, 0.5, 0.7], 100, 64, pending=wrong, candidates=CANDS).strands == now.strands


@pytest.fixture
def spy(monkeypatch):
    """Counts chained calls queued ("hit") and dropped ("miss"), with a tree or a chain, and checks that a queued
    call's token rows, gathered on the device before the read, are the ones its plan verifies on the host."""
    seen = Counter()
    confirm, build = pipeline.confirm_chained, ahead.build_call
    gathered = {}

    def built(sess, last, plan, i, tokens=None, chain=None):
        call = build(sess, last, plan, i, tokens=tokens, chain=chain)
        if chain is not None:
            gathered[id(call)] = chain.tokens
        return call

    def counted(chained, result, plan, i, cache, *more):
        hit = chained.pick(chained.outcome(result))
        built = hit.call if hit is not None else chained.call  # (the build for this outcome's kind)
        call = confirm(chained, result, plan, i, cache, *more)
        kind = "tree" if built.plan.strands else "chain"
        seen[f"{'hit' if call is not None else 'miss'} {kind}"] += 1
        if call is not None:
            rows = [result.block[-1], *plan.drafts, *(t for st in plan.strands for t in st.tokens)]
            assert gathered[id(built)].tolist() == rows
        return call

    monkeypatch.setattr(ahead, "build_call", built)  # (the chained builds: decode/ahead.py)
    monkeypatch.setattr(pipeline, "confirm_chained", counted)
    return seen


def _drafter() -> TreeDrafter:
    return TreeDrafter(Budget(CostCurve([1, 64], [1.0, 1.0]), max_width=WINDOW, calibrate=True))


def test_trees_built_ahead_run_and_stay_exact(varied, pm_sticky, pm_random, spy):
    """Free rows, greedy: calls built ahead with a tree run when the read keeps them, on the tokens their plans
    verify; token for token the plain answer."""
    _, tok = varied
    for pm in (pm_sticky, pm_random):
        for k, prompt in enumerate(PROMPTS[:3]):
            ids = encode_prompt(tok, prompt)
            s = with_seed(SETTINGS["greedy"], 40 + k)
            assert_same(pm, tok, ids, s, 40, {"drafter": _drafter()})
    assert spy["hit tree"] >= 3, spy


@pytest.mark.parametrize("max_tokens", [2, 5, 9])
def test_trees_built_ahead_with_eos_and_max_tokens(varied, pm_sticky, spy, max_tokens):
    _, tok = varied
    s = with_seed(SETTINGS["greedy"], 3)
    ids = encode_prompt(tok, PROMPTS[0])
    full = ar(pm_sticky, tok, ids, s, 32, eos=set())[0]
    assert_same(pm_sticky, tok, ids, s, max_tokens, {"drafter": _drafter()}, eos=set())
    eos = {full[min(max_tokens, len(full) - 1)]}  # an end token inside some block
    steps = assert_same(pm_sticky, tok, ids, s, 32, {"drafter": _drafter()}, eos=eos)
    assert steps[-1].finish_reason in ("stop", "length")


def test_sampling_in_id_order_builds_no_tree_ahead(varied, pm_sticky, spy):
    """Sampling in vocabulary-id order the adapter offers no tree (``TreeDrafter.candidates``: its probabilities
    cannot price the ranks blind to the uniforms): sampled answers build chains ahead only."""
    _, tok = varied
    for name in ("T1.0", "T0.7-k20-p0.9"):
        s = with_seed(SETTINGS[name], 5)
        assert_same(pm_sticky, tok, encode_prompt(tok, PROMPTS[1]), s, 32, {"drafter": _drafter()})
    assert spy["hit tree"] == spy["miss tree"] == 0 and spy["hit chain"] > 0, spy


@pytest.fixture(scope="module")
def pm_prob(varied, pm_sticky):
    model, _ = varied
    return PTPModel(model, pm_sticky.adapter, {"window": WINDOW, "cdf_order": "prob"}, fuse=True)


@pytest.mark.parametrize("name", ["T1.0", "T0.7-k20-p0.9", "T1.0-k50-p0.8"])
def test_sampling_in_probability_order_builds_trees_ahead_exactly(varied, pm_prob, spy, name):
    """Sampling in probability order, the uniforms price the ranks: trees are built ahead (the tokens each queued
    call verifies are its plan's, ``spy``) and the answer is plain sampling's, token for token."""
    _, tok = varied
    for k, prompt in enumerate(PROMPTS[:3]):
        for seed in (0, 1):
            s = with_seed(SETTINGS[name], 10 * k + seed)
            assert_same(pm_prob, tok, encode_prompt(tok, prompt), s, 32, {"drafter": _drafter()})
    assert spy["hit tree"] > 0, spy


@pytest.mark.parametrize("name", ["greedy", "T1.0"])
def test_calls_built_ahead_are_committed_without_planning_and_stay_exact(varied, pm_sticky, pm_random, spy, name,
                                                                          monkeypatch):  # fmt: skip
    """After a read whose outcome has a call built ahead, the adaptive drafter commits to it (``Drafter.commit``):
    no planning on the path, the built call queued at once; the answer is the plain one, token for token."""
    _, tok = varied
    seen = Counter()
    commit, plan = TreeDrafter.commit, TreeDrafter.plan

    def counted_commit(self, p, i):
        out = commit(self, p, i)
        seen["committed" if out is not None else "refused"] += 1
        return out

    def counted_plan(self, *a, **k):
        seen["planned"] += 1
        return plan(self, *a, **k)

    monkeypatch.setattr(TreeDrafter, "commit", counted_commit)
    monkeypatch.setattr(TreeDrafter, "plan", counted_plan)
    for pm in (pm_sticky, pm_random):
        for k, prompt in enumerate(PROMPTS[:3]):
            s = with_seed(SETTINGS[name], 50 + k)
            assert_same(pm, tok, encode_prompt(tok, prompt), s, 40, {"drafter": _drafter()})
    assert seen["committed"] >= 3, seen
    # every committed call is the one queued (its plan is the build's own), and none of them was planned
    assert spy["hit tree"] + spy["hit chain"] >= seen["committed"], (seen, spy)


def test_a_guess_is_the_same_whatever_tokens_and_rows_are_left_beyond_what_binds_it():
    """``ChainDrafter._previewed`` asks the budget once per branch width and build: beyond ``_unbound`` the tokens
    and rows left change no preview (a tree's included), so outcomes that differ only there share one."""
    d = _drafter()
    d.budget.max_rows = 40
    d.rank_prob = [[0.3, 0.1, 0.05]] * 8
    for _ in range(3):
        d.budget.shapes.note_after(4, 3, ((0, 2), (3, 4)))
    most_tokens, most_rows = d._unbound()
    seen_tree = False
    for n in range(d.budget.max_width):
        conf = d.budget.prior_confidences(n)

        def preview(remaining, room, conf=conf, n=n):
            return d.budget.rows_for(
                [0] * n, conf, remaining, room, preview=True, candidates=d.prior_candidates(conf), source="ptp"
            )

        want = preview(most_tokens, most_rows)
        seen_tree |= bool(want.strands)
        for remaining in (most_tokens, most_tokens + 1, most_tokens + 17, 500):
            for room in (most_rows, most_rows + 3, 4096):
                assert preview(remaining, room) == want, (n, remaining, room)
        plan = DraftPlan((0,) * n, ((n, 2),))
        first = d._previewed(plan, n, 300, 4096)
        assert first == want and d._previewed(plan, n, 299, 999) is first  # (asked once)
    assert seen_tree  # (trees were previewed, not only chains)


def test_every_call_built_after_the_read_says_why(varied, pm_sticky, pm_random):
    """``CallQueue.why``: each call built on the path (not queued from a build ahead) is tagged with the reason
    (``ptp-bench --profile`` counts them), building ahead on or off."""
    from ptp_mlx.decode.call import PhaseClock
    from ptp_mlx.generate import DecodeOptions, stream_generate

    _, tok = varied
    reasons = {
        "the answer's first call", "building ahead off", "building ahead does not apply",
        "no outcome's next call told ahead", "the path took a strand of the tree", "no build for that outcome",
        "the plan after the read differs", "after a burst: the plan differs", "after a burst: nothing built",
    }  # fmt: skip
    for chain in (True, False):
        whys = Counter()
        for pm, (k, prompt) in ((pm, kp) for pm in (pm_sticky, pm_random) for kp in enumerate(PROMPTS[:3])):
            clock = PhaseClock()
            s = with_seed(SETTINGS["greedy"], 60 + k)
            opts = DecodeOptions(mode="ptp", max_tokens=40, sampling=s, drafter=_drafter(), chain=chain, clock=clock)
            list(stream_generate(pm, tok, encode_prompt(tok, prompt), opts))
            calls = [c for c in clock.calls if "rows" in c]
            assert all(("why" in c) == ("build" in c) for c in calls)
            # (the answer's first call is built while the prompt's last prefill chunk computes: no build phase)
            assert "prefill" in calls[0] and "build" not in calls[0], calls[0]
            whys.update(c["why"] for c in calls if "build" in c)
        assert set(whys) <= reasons and "the answer's first call" not in whys, whys
        if not chain:  # every call after the first: nothing is ever built ahead
            assert set(whys) == {"building ahead does not apply"}, whys
