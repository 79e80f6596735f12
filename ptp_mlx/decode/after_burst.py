"""The first PTP call after an autoregressive burst, built while the burst's last step computes
(``build_after_burst``), then queued where the read confirms it (``confirm_after_burst``) or dropped: a chained call
of ``ahead.py`` whose one outcome is the burst's last token (docs/method.md, section 5, "Pipelined calls")."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx

from ..drafting.protocol import Drafter, DraftPlan, Guess
from .ahead import Chained, drop_chained
from .call import PendingCall, build_call, call_shape
from .session import DecodeSession


def build_after_burst(sess: DecodeSession, drafter: Drafter, token: mx.array, i: int, max_new: int, ctx: int):
    """The PTP call after an autoregressive burst, built while the burst's last step computes (``token``: that
    step's output, lazy), or None where the drafter cannot tell it (``Drafter.guess_start``). Its rows are
    ``[token]``, the guess's drafts (a lookup chain that assumes ``token`` is the copied text's next one: the read
    tells) and the branches: nothing the host has not read but the token itself, so its offset is known."""
    cache = sess.cache
    if sess.bank is None or sess.hook is not None or i >= max_new:
        return None
    plan = drafter.guess_start(i, max_new - i, ctx - cache.offset)
    if plan is None or plan.strands or plan.burst:
        return None
    if plan.drafts and sess.rule.for_source(plan.source, strict=plan.strict).guarded:
        return None  # a pivot rule reads the context, which the token still to be read extends
    before = cache.snapshot()
    tokens = mx.maximum(token.reshape(1), 0).astype(mx.int32)
    if plan.drafts:
        tokens = mx.concatenate([tokens, mx.array(plan.drafts, dtype=mx.int32)])
    built = build_call(sess, None, plan, i, tokens=tokens)
    return Chained(built, [Guess(plan, None)], before, call_shape(plan).rows, token)


def confirm_after_burst(
    chained: Chained, plan: DraftPlan | None, cache, last: int, grave: list | None = None
) -> PendingCall | None:
    """The call built after a burst, if ``plan`` (the drafter's real plan, the burst's tokens read) is the one it
    was built for and ``last`` (the burst's last token, as read) the token it was built on (not a token the host
    resolved: sampler.py, ``UNRESOLVED``); otherwise None, the call dropped and the cache back at the burst's end."""
    guess = chained.guesses[0].plan
    ok = plan is not None and not plan.burst and not plan.strands and list(plan.drafts) == list(guess.drafts)
    ok = ok and int(chained.token.item()) == last  # (computed: the burst's last step was read)
    ok = ok and plan.branches == guess.branches and plan.source == guess.source and plan.strict == guess.strict
    if not ok:
        drop_chained(chained, cache, chained.call.offset, grave)
        return None
    chained.before = None
    return replace(chained.call, plan=plan)
