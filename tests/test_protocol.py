"""The drafting protocol (``ptp_mlx/drafting/protocol.py``): a drafter is one class against one abstract base, a
plan is frozen, and no drafting code reads another object's private state."""

import ast
import dataclasses
from pathlib import Path

import pytest

from ptp_mlx.drafting.protocol import Drafter, DraftPlan, Strand
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.testing.decoding import PROMPTS, SETTINGS, assert_same, with_seed

ROOT = Path(__file__).resolve().parents[1] / "ptp_mlx"


class _RepeatDrafter(Drafter):
    """A new drafter is one class against one protocol: it drafts the latest token repeated (right in runs of a
    repeated token), learns the history from ``begin`` and ``emitted``, and runs one auxiliary branch per call
    for the mere exercise of the rows (its drafts ignore them)."""

    def __init__(self, n: int = 2):
        self.n, self.history, self.calls, self.hits = n, [], 0, 0

    def begin(self, session):
        self.history = list(session.prompt)

    def plan(self, i, remaining, room):
        n = max(0, min(self.n, remaining - 1, room - 3))
        return DraftPlan([self.history[-1]] * n, [(0, 2)] if room >= n + 3 else [], source="repeat")

    def update(self, plan, result):
        self.calls += 1
        self.hits += result.accepted

    def emitted(self, tokens):
        self.history.extend(tokens)


@pytest.mark.parametrize("name", ["greedy", "T1.0-k50-p0.8"])
def test_a_drafter_defined_here_decodes_exactly(varied, pm_sticky, name):
    _, tok = varied
    for k, prompt in enumerate(PROMPTS):
        s = with_seed(SETTINGS[name], 20 + k)
        ids = encode_prompt(tok, prompt)
        drafter = _RepeatDrafter()
        steps = assert_same(pm_sticky, tok, ids, s, 20, {"drafter": drafter})
        out = [t for st in steps for t in st.tokens]
        # every call reported back; the history saw every block (a block may run past the output's end: EOS)
        assert drafter.calls == len(steps) and drafter.history[len(ids) : len(ids) + len(out)] == out


def test_a_drafter_without_plan_or_update_fails_at_construction():
    class NoPlan(Drafter):
        def update(self, plan, result):
            pass

    class NoUpdate(Drafter):
        def plan(self, i, remaining, room):
            return DraftPlan([], [], burst=1)

    with pytest.raises(TypeError, match="abstract method.*plan"):
        NoPlan()
    with pytest.raises(TypeError, match="abstract method.*update"):
        NoUpdate()
    assert NoUpdate.__abstractmethods__ == {"update"}


def test_a_plan_is_frozen():
    plan = DraftPlan([1, 2], [(0, 2), [1, 3]], strands=[Strand(0, [7])])
    assert plan.drafts == (1, 2) and plan.branches == ((0, 2), (1, 3)) and plan.strands == (Strand(0, (7,)),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.source = "lookup"
    assert dataclasses.replace(plan, source="lookup").source == "lookup" and plan.source is None
    assert plan.rows == 1 + 2 + 5 + 1 and hash(plan) == hash(
        DraftPlan((1, 2), ((0, 2), (1, 3)), strands=(Strand(0, (7,)),))
    )


def _private_reads(path: Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` or ``cls`` (dunders and ``_replace`` aside), with line numbers."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                out.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return out


def test_no_drafting_code_reads_another_objects_private_state():
    files = sorted((ROOT / "drafting").glob("*.py")) + [ROOT / "generate.py", *sorted((ROOT / "decode").glob("*.py"))]
    found = [hit for f in files for hit in _private_reads(f)]
    assert found == []
    # The peers do not know each other: lookup imports no drafter; only the policy composes them.
    for peer, other in (("lookup", "chain"), ("chain", "lookup"), ("lookup", "tree"), ("chain", "policy")):
        tree = ast.parse((ROOT / "drafting" / f"{peer}.py").read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert other not in {(m or "").split(".")[-1] for m in mods}, (peer, other)


def test_the_private_read_check_finds_one(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f(d):\n    return d._drafts + self_like._n\n")
    assert _private_reads(f) == ["x.py:2: ._drafts", "x.py:2: ._n"]


def test_a_path_without_its_own_branch_takes_the_deepest_chain_branch_it_passed_moved_on():
    """``branch_rows``: the path's own branch first (the chain's at its depth, a whole strand's window); else the
    deepest chain branch at or above where the path left the chain, its rows moved on past the emitted block
    (an auxiliary row guesses its position given the context before its window and the uniforms), while at
    least one draft is left in it; else none."""
    plan = DraftPlan(
        [5, 6, 7],
        [(0, 4), (2, 3)],
        strands=(Strand(1, (9, 8), width=3), Strand(0, (4,)), Strand(2, (3, 2, 1), parent=0)),
    )
    # auxiliary rows: branch (0, 4) at 0..3, (2, 3) at 4..6, strand 0's window at 7..9
    assert plan.branch_rows(0) == (0, 4) and plan.branch_rows(2) == (4, 3)  # the chain's own
    assert plan.branch_rows(1) == (1, 3)  # no branch at depth 1: depth 0's, moved on by one
    assert plan.branch_rows(3) == (5, 2)  # all three stood: depth 2's, moved on by one
    assert plan.branch_rows(3, strand=0) == (7, 3)  # the whole strand stood: its window
    assert plan.branch_rows(2, strand=0) == (2, 2)  # it fell inside: left the chain at 1, depth 0's moved on by 2
    assert plan.branch_rows(1, strand=1) == (1, 3)  # a window-less strand off the chain's first row
    assert plan.branch_rows(4, strand=2) is None  # left the chain at 1: depth 0's has no draft left past 4
    assert DraftPlan([5], []).branch_rows(1) is None


def test_runner_ups_pair_only_the_rows_asked_for_and_read_like_lists():
    """A call's runner-ups (``CallResult.alts``) are paired row by row as asked: the same rows, slices, lengths and
    tokens by rank as the list of pairs they stand for; a guessed tree realized from either is the same plan."""
    from ptp_mlx.drafting.protocol import CallResult, Guess, RunnerUps

    tokens, probs = [[7, 8], [9, 10], [11, 12]], [[0.2, 0.1], [0.3, 0.05], [0.25, 0.2]]
    pairs = [list(zip(t, q, strict=True)) for t, q in zip(tokens, probs, strict=True)]
    alts = RunnerUps(tokens, probs)
    assert len(alts) == 3 and bool(alts) and not RunnerUps([], [])
    assert alts[1] == pairs[1] and alts[1:] == pairs[1:] and list(alts) == pairs and alts == pairs
    assert [alts.token(r, k) for r, k in ((0, 1), (2, 2), (2, 3), (5, 1), (1, 0))] == [7, 12, -1, -1, -1]
    with pytest.raises(ValueError):
        RunnerUps([[1]], [])
    plan = DraftPlan((0, 0), ((2, 2),), source="ptp", strands=(Strand(0, (0, 0)), Strand(1, (0,), parent=0)))
    guess = Guess(plan, [0, 1], strand_src=((0, 1), (1, 2), (2, 3)))
    got = [guess.realize(CallResult([5], 0, [1, 2, 3], [0.5] * 3, a)) for a in (alts, pairs)]
    assert got[0] == got[1] and got[0].drafts == (1, 2)
    assert [st.tokens for st in got[0].strands] == [(7, 10), (-1,)]
