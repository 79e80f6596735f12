"""The outcome of a tree call as the device tells it (``decode/strand_paths.py``), against the host's walk of the
same exact tokens (``decode/call.finish_call``): which strand the path ends in, how many drafts stand on it, and the
K/V rows the call built for that path moves."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from ptp_mlx.decode.strand_paths import strand_paths
from ptp_mlx.drafting.protocol import DraftPlan, Strand
from ptp_mlx.testing import RandomTreeDrafter


def host_walk(plan: DraftPlan, targets: list[int]) -> tuple[int | None, int, list[int]]:
    """The path as ``finish_call`` walks it: ``(last strand or None, drafts on the path, token rows on it)``."""
    n = len(plan.drafts)
    c = next((j for j in range(n) if plan.drafts[j] != targets[j]), n)
    path, strand, line, depth = list(range(c + 1)), None, -1, c
    while True:
        t = targets[path[-1]]
        k = next(
            (k for k, st in enumerate(plan.strands) if st.parent == line and st.at == depth and st.tokens[0] == t),
            None,
        )
        if k is None:
            return strand, len(path) - 1, path
        st, row = plan.strands[k], plan.strand_row(k)
        m = 1
        while m < len(st.tokens) and st.tokens[m] == targets[row + m - 1]:
            m += 1
        path += list(range(row, row + m))
        strand, line, depth = k, k, st.at + m


def _tree_parents(plan: DraftPlan) -> list[int]:
    from ptp_mlx.decode.call import tree_rows

    return [p for _, p, _ in tree_rows(plan)]


class Guessing:
    def guess_strand(self, plan, strand, accepted, i, remaining, room):
        return None


def _call(plan: DraftPlan, targets: list[int]):
    # ``accepted`` as the graph counts it: leading token rows that each follow the row before and stand (a strand
    # hung after the chain's last draft goes on with the count; the host reads at most the chain's drafts)
    tokens = [0, *plan.drafts, *(t for st in plan.strands for t in st.tokens)]
    parents = [-1, *range(len(plan.drafts))] + [p for p in _tree_parents(plan)]
    c = 0
    while c + 1 < len(tokens) and parents[c + 1] == c and tokens[c + 1] == targets[c]:
        c += 1
    out = SimpleNamespace(accepted=mx.array(c, dtype=mx.int32), targets=mx.array(targets, dtype=mx.int32))
    return SimpleNamespace(plan=plan, out=out, i=0, offset=0)


def test_the_device_takes_the_path_the_host_walks_and_moves_its_rows():
    rng = np.random.default_rng(0)
    truth = [int(x) for x in rng.integers(3, 9, 40)]
    seen = {"chain": 0, "strand": 0, "nested": 0}
    for seed in range(600):
        drafter = RandomTreeDrafter(truth, width=5, seed=seed, p_right=0.6, vocab=9)
        plan = drafter.plan(0, 30, 64)
        if not plan.strands:
            continue
        rows = 1 + len(plan.drafts) + sum(len(st.tokens) for st in plan.strands)
        # exact tokens: mostly the ones the tree's rows guess, so that paths go deep
        targets = [int(x) for x in rng.integers(3, 9, rows)]
        for r in range(rows):
            if rng.random() < 0.6:
                nxt = [t for k, st in enumerate(plan.strands) for t in st.tokens[:1] if plan.follows(k) == r]
                nxt += [plan.drafts[r]] if r < len(plan.drafts) else []
                targets[r] = nxt[int(rng.integers(len(nxt)))] if nxt else targets[r]
        strand, accepted, path = host_walk(plan, targets)
        guesses, by_token = [None] * (len(plan.drafts) + 1), [None] * (len(plan.drafts) + 1)
        paths = strand_paths(Guessing(), _call(plan, targets), 100, 1000, guesses, by_token)
        got = paths.index.item()
        if strand is None:
            assert got == accepted, (plan, targets)
            seen["chain"] += 1
            continue
        o = paths.outcomes[(strand, accepted)]
        assert got == o, (plan, targets, strand, accepted)
        root = strand
        while plan.strands[root].parent >= 0:
            root = plan.strands[root].parent
        cut = plan.strands[root].at + 1
        assert paths.sources[o] == path[cut:] and paths.dst[o] == cut and paths.accepted[o] == accepted
        assert paths.last_row[o] == path[-1]
        seen["nested" if plan.strands[strand].parent >= 0 else "strand"] += 1
    assert min(seen.values()) >= 10, seen


def test_the_move_table_reads_the_path_then_the_rows_in_place():
    plan = DraftPlan([5, 6], [], strands=(Strand(0, (7, 8), 0), Strand(1, (9,), 0, parent=0)))
    paths = strand_paths(Guessing(), _call(plan, [7, 1, 1, 8, 9, 1]), 100, 1000, [None] * 3, [None] * 3)
    o = paths.outcomes[(1, 2)]  # chain stops at 0, strand 0's first token stands, then strand 1's
    assert paths.sources[o] == [3, 5] and paths.dst[o] == 1
    src, dst = paths.move_table(3)
    assert src[o].tolist() == [3, 5, 3] and dst[o] == 1  # (then the row already in place after them: 1 + 2)
    assert src[0].tolist() == [1, 2, 3] and dst[0] == 1  # the chain's outcomes move nothing
