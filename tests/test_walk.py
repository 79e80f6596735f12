"""The path through a token tree (``ptp_mlx/decode/walk.py``): the host's ``walk`` after the read and the graph's
``end_row`` before it agree on every tree, ties of equal tokens included."""

import mlx.core as mx
import numpy as np

from ptp_mlx.decode.walk import end_row, row_depths, row_parents, walk
from ptp_mlx.drafting.protocol import DraftPlan, Strand


def random_plan(rng, vocab: int) -> DraftPlan:
    """A random tree over a tiny vocabulary (equal tokens at siblings are frequent): a chain of 0-4 drafts, strands
    off the chain and strands of strands."""
    n = int(rng.integers(0, 5))
    strands: list[Strand] = []
    for _ in range(int(rng.integers(0, 5))):
        length = int(rng.integers(1, 4))
        tokens = tuple(int(t) for t in rng.integers(0, vocab, length))
        if strands and rng.random() < 0.4:
            parent = int(rng.integers(0, len(strands)))
            p = strands[parent]
            at = int(rng.integers(p.at + 1, p.depth + 1))
            strands.append(Strand(at, tokens, parent=parent))
        else:
            strands.append(Strand(int(rng.integers(0, n + 1)), tokens))
    return DraftPlan(tuple(int(t) for t in rng.integers(0, vocab, n)), (), strands=tuple(strands))


def test_the_graph_finds_the_row_the_host_walk_ends_at():
    rng = np.random.default_rng(0)
    took = deep = 0
    for _ in range(3000):
        vocab = int(rng.integers(2, 5))
        plan = random_plan(rng, vocab)
        n_tok = len(row_parents(plan))
        tokens = [0, *plan.drafts, *(t for st in plan.strands for t in st.tokens)]
        targets = [int(t) for t in rng.integers(0, vocab, n_tok)]
        c = 0
        while c < len(plan.drafts) and plan.drafts[c] == targets[c]:  # (the graph's leading-chain count)
            c += 1
        path, strand, moves, block = walk(plan, c, lambda r, t=targets: t[r])
        got = end_row(plan, mx.array(tokens, dtype=mx.int32), mx.array(targets, dtype=mx.int32))
        assert got.item() == path[-1], (plan, targets, path)
        assert row_depths(plan)[path[-1]] == len(path) - 1 and len(block) == len(path) - 1
        took += strand is not None
        deep += strand is not None and plan.strands[strand].parent >= 0
    assert took > 300 and deep > 30, (took, deep)  # (strands, and strands of strands, took the path)
