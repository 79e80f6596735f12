"""Paths through a token tree's strands as outcomes of the call built ahead (docs/method.md, section 5, "Pipelined
calls"): the call after a tree call is built for every outcome of it, and where the path takes strands, that
outcome is one more row of the build's tables. The device tells which outcome happened (the chain's accepted count,
or the last strand the path took and how many of its tokens stood, from the call's exact tokens), and the call built
for it moves the strands' K/V rows next to the chain's in its own graph (``fixed.move_rows``), as the host's
``KVState.copy_rows`` would after the read."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..drafting.protocol import Drafter, DraftPlan, Guess


@dataclass
class StrandPaths:
    """The outcomes of a tree call beyond its chain's ``n + 1``: index ``outcomes[(strand, accepted)]`` (a path whose
    last strand is ``strand``, with ``accepted`` drafts on it; one strand's paths are consecutive). Per outcome, the
    chain's first: ``accepted`` drafts on its path, ``last_row`` (the token row whose exact token the call emits
    last), ``sources`` (the token rows, relative to the call's offset, of the path's strand tokens in order: their
    K/V rows move to ``dst`` on; none for the chain's) and ``dst``. ``index``: the outcome as the device computes it."""

    outcomes: dict[tuple[int, int], int] = field(default_factory=dict)
    accepted: list[int] = field(default_factory=list)
    last_row: list[int] = field(default_factory=list)
    sources: list[list[int]] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    index: mx.array | None = None

    def rows(self, guesses: list[Guess | None], n: int) -> int:
        """The rows a build serving ``guesses`` moves: its longest path's strand tokens (0: it serves no path through
        a strand)."""
        return max((len(self.sources[g]) for g in range(n + 1, len(guesses)) if guesses[g] is not None), default=0)

    def move_table(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Per outcome the ``rows`` K/V rows to read (int32 [outcomes, rows]: the path's strand rows, then the rows
        already in place after them) and where the first goes (int32 [outcomes]); relative to the call's offset."""
        src = np.zeros((len(self.dst), rows), np.int32)
        for g, (rs, d) in enumerate(zip(self.sources, self.dst, strict=True)):
            rs = rs[:rows]
            src[g] = rs + [d + k for k in range(len(rs), rows)]
        return src, np.array(self.dst, np.int32)


def _line(plan: DraftPlan, j: int) -> list[int] | None:
    """The strands from the chain to strand ``j``, ``j`` last; None where one is not followed by the next at a
    depth its tokens reach (a layout no path takes)."""
    line = [j]
    while plan.strands[line[0]].parent >= 0:
        line.insert(0, plan.strands[line[0]].parent)
        if len(line) > len(plan.strands):
            return None
    for p, q in zip(line, line[1:], strict=False):
        if not 1 <= plan.strands[q].at - plan.strands[p].at <= len(plan.strands[p].tokens):
            return None
    return line


def strand_paths(
    drafter: Drafter, call, max_new: int, ctx: int, guesses: list[Guess | None], by_token: list[Guess | None]
) -> StrandPaths:
    """The paths through ``call``'s strands, each guessed by ``drafter.guess_strand`` and appended to ``guesses``
    (None where the answer ends first or nothing can be told; ``by_token`` gains None)."""
    plan, n = call.plan, len(call.plan.drafts)
    paths = StrandPaths(
        accepted=list(range(n + 1)), last_row=list(range(n + 1)), sources=[[] for _ in range(n + 1)], dst=[1] * (n + 1)
    )
    lines = {}
    for j, st in enumerate(plan.strands):
        line = _line(plan, j)
        if line is None:
            continue
        lines[j] = line
        before = []  # the rows of the strands before ``j`` on the path
        for p, q in zip(line, line[1:], strict=False):
            row_p = plan.strand_row(p)
            before += list(range(row_p, row_p + plan.strands[q].at - plan.strands[p].at))
        row = plan.strand_row(j)
        for m in range(1, len(st.tokens) + 1):
            a = st.at + m
            paths.outcomes[(j, a)] = len(guesses)
            paths.accepted.append(a)
            paths.last_row.append(row + m - 1)
            paths.sources.append(before + list(range(row, row + m)))
            paths.dst.append(plan.strands[line[0]].at + 1)
            i = call.i + 1 + a
            guess = None
            if i < max_new:
                guess = drafter.guess_strand(plan, j, a, i, max_new - i, ctx - (call.offset + 1 + a))
                if guess is not None and (guess.plan.burst or (guess.plan.strands and not guess.strand_src)):
                    guess = None
            guesses.append(guess)
            by_token.append(None)
    if paths.outcomes:
        paths.index = _index(call, lines, paths)
    return paths


def _index(call, lines: dict[int, list[int]], paths: StrandPaths) -> mx.array:
    """The outcome of ``call`` on the device (int32 []): the chain's accepted count ``c``, or, where the path goes on
    into strands (as the host's walk takes it: at each line's end, the strand that hangs there and starts with the
    exact token), the last strand's outcome for the number of its tokens that stood. Strands are taken level by
    level (those hanging off the chain, then their strands, ...), each level in one vectorized step."""
    plan, out = call.plan, call.out
    # (the graph counts a strand hung after the chain's last draft as the chain going on: the chain's count is at
    # most its drafts, as the host reads it)
    c, targets = mx.minimum(out.accepted, len(plan.drafts)), out.targets
    last = targets.shape[0] - 1
    depth = {j: len(line) - 1 for j, line in lines.items()}
    o = c
    prev: list[int] = []  # the strands of the level before, and their reached / stood arrays
    reached = stood = None
    for level in range(max(depth.values()) + 1):
        js = [j for j in lines if depth[j] == level]
        sts = [plan.strands[j] for j in js]
        longest = max(len(st.tokens) for st in sts)
        rows = np.array([plan.strand_row(j) for j in js], np.int32)
        first = mx.array(np.array([st.tokens[0] for st in sts], np.int32))
        if level == 0:  # after the chain's ``c`` drafts, the exact token at row ``c``
            at = np.array([st.at for st in sts], np.int32)
            here = (c == mx.array(at)) & (mx.take(targets, mx.array(at)) == first)
        else:  # after the parent's tokens up to the strand's depth, all of them stood and no more
            pos = np.array([prev.index(st.parent) for st in sts], np.int32)
            need = np.array([st.at - plan.strands[st.parent].at for st in sts], np.int32)
            prow = np.array([plan.strand_row(st.parent) for st in sts], np.int32) + need - 1
            here = mx.take(reached, mx.array(pos)) & (mx.take(stood, mx.array(pos)) == mx.array(need))
            here = here & (mx.take(targets, mx.array(prow)) == first)
        rest = np.full((len(js), max(1, longest - 1)), -1, np.int32)  # each strand's later tokens (-1: none)
        for k, st in enumerate(sts):
            rest[k, : len(st.tokens) - 1] = st.tokens[1:]
        # (the exact token after a strand's k-th token checks its (k+1)-th; -1 never matches)
        after = np.minimum(rows[:, None] + np.arange(rest.shape[1])[None], last)
        same = (mx.take(targets, mx.array(after)) == mx.array(rest)).astype(mx.int32)
        m = 1 + mx.sum(mx.cumprod(same, axis=1), axis=1)  # int32 [strands]: tokens of each strand that stood
        base = mx.array(np.array([paths.outcomes[(j, st.at + 1)] for j, st in zip(js, sts, strict=True)], np.int32))
        # (the host takes the first strand that matches: one path, one strand a level, whatever strands repeat)
        k = mx.argmax(here.astype(mx.int32))
        here = here & (mx.arange(len(js)) == k)
        o = mx.where(mx.any(here), mx.take(base - 1 + m, k), o)  # (a deeper level's strand is the path's last)
        prev, reached, stood = js, here, m
    return o.astype(mx.int32)
