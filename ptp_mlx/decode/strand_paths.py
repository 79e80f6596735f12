"""Paths through a token tree's strands as outcomes of the call built ahead (docs/method.md, section 5, "Pipelined
calls"): the call after a tree call is built for every outcome of it, and where the path takes a strand that hangs
off the chain, that outcome is one more row of the build's tables. The device tells which outcome happened (the
chain's accepted count, or a strand and how many of its tokens stood, from the call's exact tokens), and the call
built for it moves the strand's K/V rows next to the chain's in its own graph (``fixed.move_rows``), as the host's
``KVState.copy_rows`` would after the read. A path through a strand of a strand is no outcome here: the build is
dropped and the host moves the rows, as before."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..drafting.protocol import Drafter, Guess


@dataclass
class StrandPaths:
    """The outcomes of a tree call beyond its chain's ``n + 1``: index ``outcomes[(strand, accepted)]`` (a path
    through ``strand`` with ``accepted`` drafts on it; one strand's paths are consecutive). Per outcome, the chain's
    first: ``accepted`` drafts on its path, ``last_row`` (the token row whose exact token the call emits last),
    ``moves`` (rows, relative to the call's offset, the strand's K/V rows move from and to: equal for the chain's)
    and ``lengths`` (its strand's tokens; 0 for the chain's). ``index``: the outcome as the device computes it."""

    outcomes: dict[tuple[int, int], int] = field(default_factory=dict)
    accepted: list[int] = field(default_factory=list)
    last_row: list[int] = field(default_factory=list)
    moves: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    lengths: list[int] = field(default_factory=list)
    index: mx.array | None = None

    def rows(self, guesses: list[Guess | None], n: int) -> int:
        """The rows a build serving ``guesses`` moves: its longest strand's (0: it serves no path through one)."""
        return max((self.lengths[g] for g in range(n + 1, len(guesses)) if guesses[g] is not None), default=0)


def strand_paths(
    drafter: Drafter, call, max_new: int, ctx: int, guesses: list[Guess | None], by_token: list[Guess | None]
) -> StrandPaths:
    """The paths through ``call``'s strands that hang off its chain, each guessed by ``drafter.guess_strand`` and
    appended to ``guesses`` (None where the answer ends first or nothing can be told; ``by_token`` gains None)."""
    plan, n = call.plan, len(call.plan.drafts)
    paths = StrandPaths(accepted=list(range(n + 1)), last_row=list(range(n + 1)), lengths=[0] * (n + 1))
    paths.moves[0].extend([1] * (n + 1))
    paths.moves[1].extend([1] * (n + 1))
    roots = [k for k, st in enumerate(plan.strands) if st.parent < 0]
    for k in roots:
        st, row = plan.strands[k], plan.strand_row(k)
        for m in range(1, len(st.tokens) + 1):
            a = st.at + m
            paths.outcomes[(k, a)] = len(guesses)
            paths.accepted.append(a)
            paths.last_row.append(row + m - 1)
            paths.moves[0].append(row)
            paths.moves[1].append(st.at + 1)
            paths.lengths.append(len(st.tokens))
            i = call.i + 1 + a
            guess = None
            if i < max_new:
                guess = drafter.guess_strand(plan, k, a, i, max_new - i, ctx - (call.offset + 1 + a))
                if guess is not None and (guess.plan.burst or (guess.plan.strands and not guess.strand_src)):
                    guess = None
            guesses.append(guess)
            by_token.append(None)
    if paths.outcomes:
        paths.index = _index(call, roots, paths)
    return paths


def _index(call, roots: list[int], paths: StrandPaths) -> mx.array:
    """The outcome of ``call`` on the device (int32 []): the chain's accepted count ``c``, or, where the exact token
    after ``c`` drafts is the first token of a strand hanging there (the first such strand, as the host's walk
    takes it), that strand's outcome for the number of its tokens that stood."""
    plan, out = call.plan, call.out
    longest = max(len(plan.strands[k].tokens) for k in roots)
    at = np.array([plan.strands[k].at for k in roots], np.int32)
    first = np.array([plan.strands[k].tokens[0] for k in roots], np.int32)
    rows = np.array([plan.strand_row(k) for k in roots], np.int32)
    rest = np.full((len(roots), max(1, longest - 1)), -1, np.int32)  # each strand's later tokens (-1: none)
    for j, k in enumerate(roots):
        rest[j, : len(plan.strands[k].tokens) - 1] = plan.strands[k].tokens[1:]
    base = np.array([paths.outcomes[(k, plan.strands[k].at + 1)] for k in roots], np.int32)
    c, targets = out.accepted, out.targets
    took = (c == mx.array(at)) & (mx.take(targets, mx.array(at)) == mx.array(first))  # bool [strands]
    # (token row of a strand's j-th later token's check: the exact token after its j-th token; -1 never matches)
    after = np.minimum(rows[:, None] + np.arange(rest.shape[1])[None], targets.shape[0] - 1)
    stood = (mx.take(targets, mx.array(after)) == mx.array(rest)).astype(mx.int32)
    m = 1 + mx.sum(mx.cumprod(stood, axis=1), axis=1)  # int32 [strands]: tokens of each strand that stood
    j = mx.argmax(took.astype(mx.int32))
    return mx.where(mx.any(took), mx.take(mx.array(base) - 1 + m, j), c).astype(mx.int32)
