"""The call queue: the PTP calls in flight for one answer (``CallQueue``), and the next call built for every
outcome of the one computing, so it is queued the moment the read confirms it (chained calls: docs/method.md,
section 5, "Pipelined calls").

A call's inputs depend on what it accepted, which the host learns only when it reads the call. When the drafter
can tell the next call's rows before that read (``Drafter.guess``: a fixed budget, whose next call has the same
shape whatever is accepted; prompt lookup, whose chain continues the copied text when every draft stands), the
next call is one fixed-shape call whose inputs are gathered on the device from this call's outputs by its
accepted count ``c``: its token rows (the exact token at ``c``, then the drafts of branch ``c``, or the host's
guessed drafts for outcome ``c``), its uniforms (a table with one row per outcome) and its cache offset (this
call's plus ``1 + c``). Outcomes whose next calls differ in shape get one such call per kind: the likeliest
outcomes' (``Drafter.likely``), and another kind likely enough whose graph is compiled already (the adaptive
budget guesses the shape it usually chooses after a branch of that width: ``ShapeMemory.usual``); an outcome the
drafter cannot tell gets none: if it happens the builds are dropped. Each is built while this call computes;
after the read the one for the outcome that happened is queued at once if the drafter commits to it
(``Drafter.commit``: no planning after the read) or its plan after the read is the one guessed, and every build is
dropped otherwise (the call is then built as ever). Either way the same call
runs on the same rows, so the output is unchanged. Whether building ahead pays is learnt per machine
(``chain_odds.ChainChoice``: on this 2-core CPU the build delays the compute it overlaps, and it does not).

The chained call writes the cache from row ``offset + 1 + c`` on, past every row the current call keeps, so it
needs no copy of the state; the state before it is kept by value only until the read decides (a dropped call
gives it back), and let go before the call is queued, so its writes stay in place.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import mlx.core as mx

from ..drafting.protocol import CallResult, Drafter, DraftPlan, Guess
from .after_burst import build_after_burst, confirm_after_burst
from .ahead import Chained, _matches, build_chained, confirm_chained, drop_chained
from .call import NO_CLOCK, PendingCall, build_call, finish_call
from .chain_odds import ChainChoice, Confirmed, choice_for, fade, spare
from .session import DecodeSession


class Verdict(NamedTuple):
    """What a read found of the call built ahead for it, judged once the next call is queued (``catch_up``): never
    the builds themselves (an unused one must go before the next call is queued)."""

    source: str | None  # the source of the call read
    result: CallResult
    plan: DraftPlan  # the drafter's real next plan
    guess: Guess | None  # the guess for the outcome that happened, built or not
    tokens: Guess | None  # the plans by the token emitted, if guessed
    realized: DraftPlan | None  # ``guess`` as the read realized it, where already done
    ran: bool  # a build ahead runs as the next call


MAX_KINDS = 2  # builds of the call after the one computing, one per kind of next call (``ahead._kind``)


class CallQueue:
    """The PTP calls in flight for one answer, and the one owner of their offsets in the cache.

    At most one call is queued and not yet read (``running``). While it computes, the call after it may be built
    for every outcome (``chain``: ``chained``); after an autoregressive burst, the first call may be built on the
    burst's last step (``start_after_burst``: ``started``). The read (``read``) decides: ``confirm`` /
    ``confirm_start`` make the built call the next ``running`` one when the drafter's real plan is the one it was
    built for, and give the cache its state back otherwise. ``abandon`` leaves the cache at the accepted path
    whatever is in flight (an answer closed early, or failed)."""

    def __init__(self, sess: DecodeSession, drafter: Drafter, max_new: int, ctx: int, chain: bool | None = None):
        self.sess, self.drafter, self.max_new, self.ctx = sess, drafter, max_new, ctx
        # (with a logits hook a call's rows depend on committed tokens)
        self.chains = (chain is None or bool(chain)) and sess.hook is None
        # chain None: built ahead where that pays on this machine, as measured (``ChainChoice``); True: always
        self.choice: ChainChoice | None = choice_for(sess.pm) if chain is None and self.chains else None
        self._ahead_s: float | None = None  # seconds spent building ahead while the running call computes
        self.running: PendingCall | None = None
        self.chained: Chained | None = None
        self.started: Chained | None = None
        self.build_s: float | None = None  # seconds one chained build takes (running estimate)
        self.left_s: float | None = None  # seconds a read waits for its call after one build (running estimate)
        self._built = 0  # builds made while the running call computes (0: none)
        self._plan_s = 0.0  # seconds the drafter took to plan the call about to be built
        # a read and its outcome's guess, realized (``_guess_realized``)
        self._realized: tuple[CallResult, DraftPlan | None] | None = None
        # why the next call is built after the read rather than queued from a build ahead (``ptp-bench --profile``)
        self.why = "the answer's first call"
        self.confirmed = Confirmed()  # how often each kind of guess was the real next plan (``build_chained``)
        self.grave: list = []  # builds not used, let go once the next call is queued (``release.park``, ``bury``)
        self.done: PendingCall | None = None  # the call read last, likewise let go in ``bury``
        self._verdict: Verdict | None = None  # the last read's, judged in ``catch_up``
        # after a path through a strand whose call built ahead moves the rows itself: the host's copies, made only if
        # that call is dropped after all (``(from, to, rows)`` of the cache; ``finish_call``)
        self._moves: list[tuple[int, int, int]] = []

    @property
    def end(self) -> int:
        """Where the accepted path ends in the cache: rows of a built call not yet decided on do not count."""
        cache = self.sess.cache
        if self.started is not None:
            return self.started.call.offset
        return cache.offset - (self.chained.rows if self.chained is not None else 0)

    def plan(self, i: int) -> DraftPlan:
        """The drafter's plan for the call from generated position ``i``, timed: planning on the path is what a
        committed build ahead saves too (``Drafter.commit``), counted with the build that follows (``build``)."""
        t0 = time.perf_counter()
        plan = self.drafter.plan(i, self.max_new - i, self.ctx - self.end)
        self._plan_s = time.perf_counter() - t0
        return plan

    def build(self, last: int, plan: DraftPlan, i: int, on_path: bool = True) -> None:
        """Build the call that verifies ``plan`` after ``last`` (the next one to queue; ``on_path`` False: while the
        device computes something else, the prompt's prefill)."""
        t0 = time.perf_counter()
        self.running = build_call(self.sess, last, plan, i)
        if self.choice is not None and on_path:  # (planning and building on the path: what a build ahead saves)
            self.choice.built_on_path(time.perf_counter() - t0 + self._plan_s)
        self._plan_s = 0.0

    def bury(self) -> None:
        """Let go of the builds not used (``release.park``): called once the next call is queued, off the path where
        a device computes."""
        self.grave.clear()
        self.done = None

    def _ahead(self) -> bool:
        """Whether to build ahead now: always where asked (``chain=True``), else where it pays (``ChainChoice``)."""
        return self.chains and (self.choice is None or self.choice.use())

    def submit(self) -> float:
        """Queue the running call's compute; returns the seconds queueing took (MLX's dispatch of its kernels: on
        its CPU backend a graph of more than about 100 kernels returns from ``async_eval`` only near its end)."""
        t0 = time.perf_counter()
        mx.async_eval(*self.running.arrays)
        return time.perf_counter() - t0

    def chain(self) -> None:
        """Build the call after the running one for every outcome, while it computes (none where that does not
        apply: ``build_chained``)."""
        self._ahead_s = None
        self.bury()  # (the call just queued writes its buffers in place already: nothing here holds them)
        self.catch_up()  # (the guesses, and whether to build them, read what the last read's bookkeeping changes)
        if self.running is not None and not self._ahead():
            self.why = "building ahead off" if self.chains else "building ahead does not apply"
        elif self.running is not None:
            t0 = time.perf_counter()
            kinds = MAX_KINDS if spare(self.left_s, self.build_s) else 1
            self.chained = build_chained(
                self.sess, self.drafter, self.running, self.max_new, self.ctx, kinds, self.confirmed
            )
            if self.chained is not None:
                self._built = 1 + len(self.chained.others)
                self.build_s = fade(self.build_s, (time.perf_counter() - t0) / self._built)
            else:
                self.why = "no outcome's next call told ahead"
            self._ahead_s = time.perf_counter() - t0  # (the guesses' time too, built or not)

    def start_after_burst(self, token: mx.array, i: int) -> None:
        """Build the first call after a burst on its last step's ``token`` (lazy), which ends at position ``i``."""
        if self._ahead():
            self.started = build_after_burst(self.sess, self.drafter, token, i, self.max_new, self.ctx)
        if self.started is None:
            self.why = "after a burst: nothing built" if self.chains else "building ahead does not apply"

    @property
    def started_plan(self) -> DraftPlan | None:
        """The plan the call built after a burst was built for (None: none was)."""
        return None if self.started is None else self.started.guesses[0].plan

    def chained_plan(self, result: CallResult) -> DraftPlan | None:
        """The plan built ahead for the outcome ``result`` reports (None: nothing was built for it)."""
        built = self.chained is not None and self.chained.pick(self.chained.outcome(result)) is not None
        return self._guess_realized(result) if built else None

    def token_plan(self, result: CallResult) -> DraftPlan | None:
        """The plan built ahead for the token ``result`` emitted (``Drafter.guess_by_token``), or None."""
        return self.chained.token_plan(result) if self.chained is not None else None

    def guessed_plan(self, result: CallResult) -> DraftPlan | None:
        """The plan guessed ahead for the outcome ``result`` reports, built or not (an outcome of a kind no build
        served: the drafter may still commit to it and skip planning; None: none was guessed)."""
        return self._guess_realized(result)

    def _guess_realized(self, result: CallResult) -> DraftPlan | None:
        """The guess for the outcome ``result`` reports (a build's is the same object), with the read's tokens put in
        its placeholders: once per read (``confirm`` compares it too)."""
        if self._realized is None or self._realized[0] is not result:
            o = self.chained.outcome(result) if self.chained is not None else None
            every = self.chained.every if o is not None else []
            guess = every[o] if o is not None and o < len(every) else None
            self._realized = (result, None if guess is None else guess.realize(result))
        return self._realized[1]

    def read(self, clock=NO_CLOCK) -> tuple[DraftPlan, CallResult]:
        """Wait for the running call, read it and keep its accepted path (and the chained call's rows after it)."""
        call, self.running = self.running, None
        then = 0 if self.chained is None else self.chained.rows

        def unchain(strand: int, accepted: int, copies: list[tuple[int, int, int]]) -> int | None:
            # The path took a strand of this token tree: a call built for that very path moves the strand's K/V rows
            # in its own graph (the host's copies are kept for the case it is dropped after all); otherwise the
            # call chained on the other outcomes cannot run, and the rows move in the state before it was built.
            chained = self.chained
            if chained is not None and chained.pick(chained.strand_outcomes.get((strand, accepted))) is not None:
                self._moves = copies
                return chained.rows
            self.chained = None
            if chained is not None:
                drop_chained(chained, self.sess.cache, grave=self.grave)
                self.why = "the path took a strand of the tree"
            return None

        t0 = time.perf_counter()
        result = finish_call(self.sess.cache, call, clock, then=then, on_strand=unchain)
        if self.choice is not None:
            # (a call queued from a build ahead was queued before this turn's yield: its read waits less than one
            # queued just now, whether or not the next is built meanwhile; compared only with its own kind)
            kind = (call.shape.n_tok, call.shape.n_aux, call.ahead)
            self.choice.read_waited(time.perf_counter() - t0, self._ahead_s, kind)
        self._ahead_s = None
        if self._built:  # (the wait as if one build had been made: the others' time counts as left over)
            left = time.perf_counter() - t0 + (self._built - 1) * (self.build_s or 0.0)
            self.left_s, self._built = fade(self.left_s, left), 0
        # (the call read goes with the builds not used, once the next is queued: letting go of its outputs, a tree's
        # logits among them, freed memory on the path, 0.02-0.03 ms a read on this CPU)
        self.done = call
        return call.plan, result

    def confirm(self, result: CallResult, plan: DraftPlan | None, i: int) -> bool:
        """After a read: the chained call becomes the running one if ``plan`` (None: the answer ended) is the one it
        was built for; otherwise it is dropped. True when a call is ready to submit."""
        if self.chained is not None:
            chained, self.chained = self.chained, None
            o = chained.outcome(result)
            guess = chained.every[o] if o is not None and chained.every else None
            built = guess is not None and chained.pick(o) is not None
            realized = self._realized[1] if self._realized is not None and self._realized[0] is result else None
            self._realized = None
            self.running = confirm_chained(chained, result, plan, i, self.sess.cache, realized, self.grave)
            self._moved(self.running is None)
            if self.running is not None:
                self._plan_s = 0.0  # (no build follows: this plan's time is no build's)
            else:
                self.why = "no build for that outcome" if not built else "the plan after the read differs"
            if plan is not None and not result.resolved:  # (the answer went on: judged once the next is queued)
                tokens = chained.by_token[result.accepted] if result.strand is None and chained.by_token else None
                self._verdict = Verdict(chained.source, result, plan, guess, tokens, realized, self.running is not None)
        return self.running is not None

    def catch_up(self) -> None:
        """The bookkeeping of the last read put off until the next call is queued (``decode/ptp.py``; off the path
        where a device computes): whether building ahead paid and how often each kind of guess was the real plan
        (read by the next ``chain``, which catches up first too), and the drafter's (``Drafter.catch_up``)."""
        v, self._verdict = self._verdict, None
        if v is not None:
            if self.choice is not None:
                self.choice.judge(v.ran)
            if v.guess is not None:
                # (the running call may be another build's: a lookup chain for the token the read revealed)
                realized = v.realized or v.guess.realize(v.result)
                self.confirmed.judge(v.source, v.guess, v.plan is realized or _matches(v.plan, realized))
            if v.tokens is not None:  # (plans by token: judged apart)
                self.confirmed.judge(v.source, v.tokens, _matches(v.plan, v.tokens.realize(v.result)))
        self.drafter.catch_up()

    def confirm_start(self, plan: DraftPlan | None, last: int) -> bool:
        """After a burst: the call built on its last step becomes the running one if ``plan`` is its plan and
        ``last`` the token it was built on; otherwise it is dropped. True when a call is ready to submit."""
        started, self.started = self.started, None
        self.running = confirm_after_burst(started, plan, self.sess.cache, last, self.grave)
        if self.running is not None:
            self._plan_s = 0.0  # (no build follows: this plan's time is no build's)
        else:
            self.why = "after a burst: " + ("the plan differs" if started is not None else "nothing built")
        if self.choice is not None and plan is not None:
            self.choice.judge(self.running is not None)
        return self.running is not None

    def _moved(self, dropped: bool) -> None:
        """After the read's verdict on a call built for a path through a strand: where it was dropped, the host
        moves the strand's K/V rows (in the state before it, given back); where it runs, it moves them itself."""
        moves, self._moves = self._moves, []
        for src, dst, n in moves if dropped else ():
            self.sess.cache.copy_rows(src, dst, n)

    def abandon(self) -> None:
        """Leave the cache at the accepted path: calls built or queued and never read give their rows back."""
        cache = self.sess.cache
        if self.started is not None:  # built on a burst that was never finished: the state before it comes back
            drop_chained(self.started, cache, self.started.call.offset)
        if self.chained is not None:  # chained on a call never read, or never decided on
            keep = self.running.offset if self.running is not None else cache.offset - self.chained.rows
            drop_chained(self.chained, cache, keep)
            self._moved(True)
        elif self.running is not None:  # queued but never read (the consumer stopped first): its rows leave
            cache.trim_to(self.running.offset)
        self.running = self.chained = self.started = None
        self.bury()
        self.catch_up()
        if self.choice is not None:  # (the answer is over: what it measured is kept for the next process)
            self.choice.flush()
