"""The next PTP call, built for every outcome of this one while it computes (docs/method.md, section 5,
"Pipelined calls").

A call's inputs depend on what it accepted, which the host learns only when it reads the call. When the drafter
can tell the next call's rows before that read (``Drafter.guess``: a fixed budget, whose next call has the same
shape whatever is accepted; prompt lookup, whose chain continues the copied text when every draft stands), the
next call is one fixed-shape call whose inputs are gathered on the device from this call's outputs by its
accepted count ``c``: its token rows (the exact token at ``c``, then the drafts of branch ``c``, or the host's
guessed drafts for outcome ``c``), its uniforms (a table with one row per outcome) and its cache offset (this
call's plus ``1 + c``). Outcomes the drafter cannot tell get no row of their own: if one happens the call is
dropped. Its graph is built while this call computes; after the read it is queued at once
if the drafter's real plan is the guessed one for the outcome that happened, and dropped otherwise (the call is
then built as ever). Either way the same call runs on the same rows, so the output is unchanged.

The chained call writes the cache from row ``offset + 1 + c`` on, past every row the current call keeps, so it
needs no copy of the state; the state before it is kept by value only until the read decides (a dropped call
gives it back), and let go before the call is queued, so its writes stay in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..drafting.protocol import CallResult, Drafter, Guess, Plan
from .call import ChainInputs, PendingCall, build_call, call_shape, call_uniforms
from .session import DecodeSession


@dataclass
class Chained:
    """The call after ``call``, built for each of its outcomes (``guesses[g]``: the drafter's plan when ``g``
    drafts stand; None where the answer ends first). ``before``: the cache's state before the build."""

    call: PendingCall
    guesses: list[Guess | None]
    before: tuple | None
    rows: int


def build_chained(sess: DecodeSession, drafter: Drafter, call: PendingCall, max_new: int, ctx: int) -> Chained | None:
    """Build the call after ``call`` (built, not read) for all its outcomes at once, or None where that does not
    apply: the eager legacy pass, a logits hook, a token tree (a landed alternative moves K/V rows on the host),
    a drafter that cannot tell, or outcomes whose next calls differ in shape."""
    plan, cache = call.plan, sess.cache
    if sess.bank is None or sess.hook is not None or plan.alts:
        return None
    n = len(plan.drafts)
    guesses: list[Guess | None] = []
    for g in range(n + 1):
        i = call.i + 1 + g
        if i >= max_new:  # the answer ends with this outcome: no next call to build for it
            guesses.append(None)
            continue
        guess = drafter.guess(plan, g, i, max_new - i, ctx - (call.offset + 1 + g))
        if guess is not None and (guess.plan.burst or guess.plan.alts):
            guess = None
        # (None: this outcome's next call is not known ahead; if it happens, the build is dropped)
        guesses.append(guess)
    known = [x for x in guesses if x is not None]
    if not known:
        return None
    nxt = known[0].plan
    if any(x.plan.branches != nxt.branches or len(x.plan.drafts) != len(nxt.drafts) for x in known):
        return None  # one outcome's next call has another shape: no single build serves them all
    if any(x.plan.strict != nxt.strict for x in known):
        return None  # or another acceptance rule (``Plan.strict``)
    on_device = {x.draft_rows is not None for x in known}
    if len(on_device) > 1 or (True in on_device and nxt.drafts and call.out.aux_top is None):
        return None  # drafts from this call's rows for some outcomes, known tokens for others: not one gather
    if sess.rule.for_source(nxt.source, strict=nxt.strict).guarded:
        return None  # a pivot rule reads the context, which this call's block may still change
    # Per outcome g: the next call's draft rows (in this call's auxiliary rows) and its uniforms.
    m = len(nxt.drafts)
    per_outcome = np.zeros((n + 1, m), np.int32)  # outcome g's draft rows here, or its drafts (host tokens)
    row_u, aux_u = call_uniforms(sess, nxt, 0)
    row_table = np.zeros((n + 1, row_u.size), np.float32)
    aux_table = np.zeros((n + 1, aux_u.size), np.float32)
    for g, x in enumerate(guesses):
        if x is not None:
            per_outcome[g] = x.plan.drafts if x.draft_rows is None else x.draft_rows
            row_table[g], aux_table[g] = call_uniforms(sess, nxt, call.i + 1 + g)
    c = call.out.accepted  # int32 []: the outcome, known on the device only
    rows = [mx.take(call.out.targets, c.reshape(1)).astype(mx.int32)]
    if m:
        picked = mx.take(mx.array(per_outcome), c, axis=0)  # int32 [m]: outcome c's draft rows (or its drafts)
        rows.append(picked if known[0].draft_rows is None else mx.take(call.out.aux_top, picked).astype(mx.int32))
    inputs = ChainInputs(
        tokens=mx.concatenate(rows) if m else rows[0],
        row_u=mx.take(mx.array(row_table), c, axis=0),
        aux_u=mx.take(mx.array(aux_table), c, axis=0),
        offset=mx.array(call.offset + 1, dtype=mx.int32) + c,
        bound=call.offset + 1 + n,
    )
    before = cache.snapshot()
    built = build_call(sess, 0, nxt, -1, chain=inputs)
    return Chained(built, guesses, before, call_shape(nxt).rows)


def confirm_chained(chained: Chained, result: CallResult, plan: Plan | None, i: int, cache) -> PendingCall | None:
    """The chained call, if ``plan`` (the drafter's real next plan after ``result``, None: the answer ended) is
    the one guessed for the outcome that happened; it then starts at generated position ``i`` and the state
    before it is let go (its writes stay in place). None: the chained call is dropped, the cache is back at the
    accepted path, and ``plan`` is built as usual."""
    guess = chained.guesses[result.accepted] if result.alt is None else None
    keep = cache.offset - chained.rows  # ``finish_call`` kept the accepted path plus the chained call's rows
    ok = guess is not None and plan is not None and not plan.burst and not plan.alts
    ok = ok and plan.branches == guess.plan.branches
    ok = ok and tuple(plan.drafts) == guess.drafts(result.aux_tokens) and plan.source == guess.plan.source
    ok = ok and plan.strict == guess.plan.strict
    if not ok:
        drop_chained(chained, cache, keep)
        return None
    chained.before = None
    call = chained.call
    call.plan, call.offset, call.i = plan, keep, i  # the same rows; the host now knows the drafts it verifies
    return call


def chained_plan(chained: Chained | None, result: CallResult) -> Plan | None:
    """The plan built ahead for the outcome ``result`` reports, or None (nothing built for it)."""
    if chained is None or result.alt is not None:
        return None
    guess = chained.guesses[result.accepted]
    return None if guess is None else guess.plan


def drop_chained(chained: Chained, cache, keep: int) -> None:
    """Give the cache back its state before the chained build, trimmed to ``keep`` rows."""
    if chained.before is not None:
        cache.restore(chained.before)
        chained.before = None
    cache.trim_to(keep)
