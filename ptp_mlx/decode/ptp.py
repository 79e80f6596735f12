"""The PTP decoding loop, beside ``ar.py``'s plain one: each call verifies the drafts in hand and drafts again for
the likely outcomes (docs/method.md, section 5). Both take a ``DecodeSession`` and yield ``([tokens],
CallRecord)`` per call; ``generate.py`` turns them into responses.

Rows of a call: [last accepted token, drafts q_1..q_n | branch d auxiliaries ...]. Branch d assumes the first d
drafts are accepted. After the call, c = number of leading drafts equal to the exact token at their position; the
call emits the exact tokens at positions 0..c and branch c (if present) gives the next drafts, its first slot being
the exact token just emitted. The calls in flight, and their offsets, belong to the ``CallQueue``
(``pipeline.py``): a call is queued before the host reads it, and the next one, when the drafter can tell its rows,
is built for the likely outcomes meanwhile and queued right after the read, before this call's block is handed out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from ..drafting.protocol import Drafter
from .ar import Shifted, ar_calls
from .call import NO_CLOCK
from .pipeline import CallQueue
from .session import CallRecord, DecodeSession


@dataclass(frozen=True)
class AnswerLimits:
    """Where one answer stops: ``max_new`` tokens, a context of ``ctx`` rows, or a token of ``eos``."""

    max_new: int
    ctx: int
    eos: frozenset[int] = frozenset()


def ptp_calls(
    sess: DecodeSession, drafter: Drafter, last: int, limits: AnswerLimits, chain: bool | None = None, clock=NO_CLOCK
) -> Iterator[tuple[list[int], CallRecord]]:
    """PTP decoding after ``last`` (fed, not yet in the cache), with ``drafter`` (begun on the answer's history).

    ``chain``: the next call built for every outcome of this one while it computes (False: every call built after
    the read, the profile's synchronous reference; None: where that pays on this machine, as measured:
    ``chain_odds.ChainChoice``). ``clock``: a ``PhaseClock`` splits every call into phases."""
    max_new, ctx = limits.max_new, limits.ctx
    queue = CallQueue(sess, drafter, max_new, ctx, chain)
    i = 0  # index of the next token to emit, in the uniform stream
    plan = None  # the next call's plan, when planned before its call is built
    cold_before = -1  # the bank's cold count before the previous iteration (a call built then runs now)
    carried = 0.0  # the previous iteration's time queueing this one's call (chained): this call's cost, not that one's
    try:
        while i < max_new:
            t_start = time.perf_counter()
            cold_start = _cold(sess.bank)
            clock.start()
            if queue.running is None and queue.started is not None:
                # The call built while the burst's last step computed, queued if the drafter commits to it or its
                # plan is that call's.
                built = queue.started_plan
                plan = drafter.commit(built, i) if built is not None else None
                if plan is None:
                    drafter.chained(built)
                    plan = queue.plan(i)
                if queue.confirm_start(plan, last):
                    clock.mark("update")
                    queue.submit()
                    clock.mark("queue")
            if queue.running is None:
                # The answer's first call is planned and built while the prompt's last chunk computes (when the
                # prefill left it in flight): off the path like a chained call's build.
                ahead = sess.prefilling is not None
                # 1. The drafter (and its budget) chooses what to verify and which branches to draft.
                if plan is None:
                    plan = queue.plan(i)
                if plan.burst:
                    sess.settle()
                    last, done = yield from _burst(sess, drafter, last, i, plan.burst, queue)
                    i, plan = i + done, None
                    continue
                clock.mark("chain" if ahead else "plan")
                # 2. One call: verify, draft (queued now; read, accepted and trimmed by ``CallQueue.read``).
                queue.build(last, plan, i, on_path=not ahead)
                if not ahead:
                    clock.tag("why", queue.why)
                clock.mark("chain" if ahead else "build")
                if sess.settle():  # (the prompt's time ends here: this call's own starts)
                    clock.mark("prefill")
                    t_start = time.perf_counter()
                queue.submit()  # (on MLX's CPU backend a graph of over ~100 kernels returns only near its end)
                clock.mark("queue")
            # The next call, for every outcome of this one, built while it computes.
            queue.chain()
            clock.mark("chain")
            plan, out = queue.read(clock)
            # 3. The next drafts come from the branch of the path that stood, its first slot the exact token.
            drafter.update(plan, out)
            drafter.emitted(out.block)
            if sess.context is not None:
                sess.context.add(out.block)
            block, c, rows, last, call_source = out.block, out.accepted, plan.rows, out.block[-1], plan.source
            strand_rows = sum(len(st.tokens) for st in plan.strands)
            n = len(plan.drafts) + strand_rows
            source = (
                plan.strands[out.strand].source + "-strand" if out.strand is not None else plan.source if n else None
            )
            i += len(block)
            plan = None
            if i < max_new and not limits.eos.intersection(block):
                # The next call: the one already built for this outcome where the drafter commits to it (no
                # planning on the path), else planned now (preferring the built one); chained on this one, it is
                # queued before the yield.
                built = queue.chained_plan(out)
                guessed = built or queue.guessed_plan(out)  # (guessed, not built: committing skips the planning)
                plan = drafter.commit(guessed, i) if guessed is not None else None
                token = queue.token_plan(out) if plan is None else None  # (a lookup chain for the token emitted)
                plan = plan or (drafter.commit(token, i) if token is not None else None)
                if plan is None:
                    drafter.chained(token or built)  # (else the adapter's call built)
                    plan = queue.plan(i)
            ready = queue.confirm(out, plan, i)
            clock.mark("update")
            # Each call is charged its own queueing (MLX's dispatch of its kernels; on its CPU backend a graph of more
            # than about 100 kernels, as before ptp-block, returns from ``async_eval`` only near its end).
            queued = queue.submit() if ready else 0.0
            if ready:
                clock.mark("queue")
            queue.catch_up()  # (what the read's bookkeeping put off: the next call is queued, or about to be planned)
            clock.tag("rows", rows)
            t = time.perf_counter() - t_start - queued + carried
            carried = queued
            # What the call cost, as measured (the budget learns costs, and its pace guard watches): cold when a
            # shape ran uncompiled in this call or the one built before it.
            drafter.timed(rows, len(block), t, cold=_cold(sess.bank) != cold_before, source=call_source)
            cold_before = cold_start
            yield block, CallRecord(t, n, c, rows, source, out.logprobs, strand_rows)
    finally:
        queue.abandon()


def _cold(bank) -> int:
    """How many calls of ``bank`` so far ran a shape uncompiled (eagerly or tracing it); 0 without a bank."""
    return bank.cold if bank is not None else 0


def _burst(sess: DecodeSession, drafter: Drafter, last: int, i: int, length: int, queue: CallQueue):
    """Drafting does not pay here (poor drafts or costly rows): decode a pipelined autoregressive burst of up to
    ``length`` tokens from position ``i`` instead. Same uniforms, same tokens; the cache again ends just before the
    last token. Returns ``(last, done)``. The first call after it is built on the last step's token while that step
    computes (``CallQueue.start_after_burst``)."""
    stop = []
    end = [i + length]  # where the call after the burst starts (sooner when the burst is told to stop)
    shifted = replace(sess, uniforms=Shifted(sess.uniforms, i))
    burst = ar_calls(
        shifted, last, length, then=lambda token: queue.start_after_burst(token, end[0]), stop=lambda: bool(stop)
    )
    done, cold = 0, [_cold(sess.bank)] * 3
    for block, info in burst:
        last = block[-1]
        done += 1
        cold = cold[1:] + [_cold(sess.bank)]
        # (the first step of a burst is not pipelined behind another: not a plain step's pace; nor is a step that
        # ran, or followed, an uncompiled one, nor the step read after the burst was told to stop)
        if done > 1 and cold[0] == cold[-1] and not stop:
            drafter.timed(1, 1, info.time)
        drafter.emitted(block)
        if sess.context is not None:
            sess.context.add(block)
        if done == 1:  # (the burst's second step is queued: builds dropped before it go now)
            queue.bury()
        yield block, info
        if done < length - 1 and not stop and drafter.ready():
            # A draft worth a call is in hand: the burst ends after the step already queued, whose token is read
            # and kept (not dropped: it was computed anyway), and the drafter plans with it. (Past ``length - 1``
            # the step queued is the burst's last anyway, and the next call may already be built on it.)
            stop.append(True)
            end[0] = i + done + 1  # (the step queued is the burst's last)
    return last, done
