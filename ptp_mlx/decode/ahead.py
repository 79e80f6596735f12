"""The next PTP call, built while this one computes (docs/method.md, section 5, "Pipelined calls").

A call's inputs depend on what it accepted, which the host learns only when it reads the call. For drafters that
can tell the next call's rows before that read (``Drafter.guess``: a fixed budget's shape, the drafts being rows of
this call's output), the next call is built for each likely outcome while this one computes: its token rows are
gathered on the device from this call's exact tokens and auxiliary argmax, never read by the host. After the read,
the build of the outcome that happened is queued at once if the drafter's real plan is the guessed one (same
rows, same drafts); otherwise it is dropped and the call is built as ever. Either way the same call runs on the
same rows, so the output is unchanged.

Building never mutates a state another build starts from: the cache writes through fresh array handles
(``model.kv.KVState``), so each build starts from this call's state and keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..drafting.protocol import CallResult, Drafter, Guess, Plan
from .call import PendingCall, build_call
from .session import DecodeSession


@dataclass
class Ahead:
    """The next call built for one outcome of the current call: ``accepted`` drafts standing."""

    accepted: int
    guess: Guess
    call: PendingCall
    state: tuple  # the cache's snapshot after the build


def build_ahead(
    sess: DecodeSession, drafter: Drafter, call: PendingCall, max_new: int, ctx: int, limit: int
) -> dict[int, Ahead]:
    """Build the call after ``call`` (queued, not read) for up to ``limit`` of its outcomes, fewest accepted
    drafts first; the cache is left as it was."""
    plan, cache = call.plan, sess.cache
    out: dict[int, Ahead] = {}
    if limit <= 0 or plan.alts or call.out.aux_top is None:  # (a landed alternative moves K/V rows on the host)
        return out
    state = cache.snapshot()
    try:
        for g in range(len(plan.drafts) + 1):
            i, offset = call.i + 1 + g, call.offset + 1 + g
            if len(out) >= limit or i >= max_new:
                break
            guess = drafter.guess(plan, g, i, max_new - i, ctx - offset)
            if guess is None or guess.plan.burst or guess.plan.alts:
                continue
            cache.trim_to(offset)  # the path that stands when g drafts are accepted (its rows are in the state)
            # The next call's token rows: the exact token at g, then its drafts, gathered on the device.
            rows = [call.out.targets[g : g + 1].astype(mx.int32)]
            if guess.draft_rows:
                rows.append(call.out.aux_top[mx.array(guess.draft_rows, dtype=mx.int32)].astype(mx.int32))
            tokens = mx.concatenate(rows) if len(rows) > 1 else rows[0]
            nxt = build_call(sess, 0, guess.plan, i, tokens)
            out[g] = Ahead(g, guess, nxt, cache.snapshot())
            cache.restore(state)
    finally:
        cache.restore(state)
    return out


def take_ahead(ahead: dict[int, Ahead], result: CallResult, plan: Plan, cache) -> PendingCall | None:
    """The call built ahead for what ``result`` accepted, if ``plan`` (the drafter's real next plan) is the one
    that was guessed; it then becomes the cache's state. None: build ``plan`` as usual."""
    a = ahead.get(result.accepted) if result.alt is None else None
    if a is None or plan.burst or plan.alts or plan.branches != a.guess.plan.branches:
        return None
    if plan.drafts != [result.aux_tokens[j] for j in a.guess.draft_rows] or a.call.offset != cache.offset:
        return None
    cache.restore(a.state)
    a.call.plan = plan  # the same rows; the host now knows the drafts it verifies
    return a.call


def ahead_default() -> int:
    """Outcomes to build ahead by default: one on a GPU, where ``mx.async_eval`` returns at once and the build
    overlaps the whole call; none on MLX's CPU backend, where it returns only near the end of a large graph, so a
    build ahead overlaps just the tail and competes with the compute for the same cores (measured no faster:
    docs/results/profile/issue23/)."""
    return 1 if mx.default_device() == mx.gpu else 0


def ahead_limit(limit: int, built: int, t_built: float, t_wait: float) -> int:
    """How many outcomes to build ahead next time: one more while the host still waited for the call after its
    builds, one fewer (down to 1) when it did not wait at all (the builds outlasted the compute)."""
    per = t_built / built if built else 0.0
    if built >= limit and t_wait > per:
        return min(limit + 1, 8)
    return max(1, limit - 1) if t_wait < 0.1 * per else limit
