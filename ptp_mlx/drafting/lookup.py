"""Prompt lookup drafts: text that repeats the prompt or itself is drafted for free (docs/method.md, section 5).

The latest n tokens (n = 4, 3, 2) are looked up where they occurred before in the prompt and the answer so far;
the tokens that followed them there become a candidate chain of drafts. Drafts are only ever verified by the exact
rule, so the output does not change; the drafter only decides which chain a call verifies: the lookup chain when
its expected accepted drafts (from the hit rate it has observed) beat the adapter's own chain, else the adapter's.
Either way the call still drafts the adapter's branches after the verified chain, so adapter drafts continue
where the lookup stops.
"""

from __future__ import annotations

from .budget import Pace
from .chain import ChainDrafter
from .protocol import CallResult, Drafter, DraftSession, Guess, Plan

NGRAMS = (4, 3, 2)


class LookupDrafter(Drafter):
    """Prompt-lookup chains beside the adapter's ``ChainDrafter`` (``source`` of a plan: "lookup" or "ptp")."""

    def __init__(
        self,
        inner: ChainDrafter,
        prompt_ids: list[int] | None = None,
        max_draft: int = 7,
        prior: tuple[float, float] = (1.0, 1.0),
    ):
        self.inner = inner
        self.history = list(prompt_ids or [])
        self._own_history = prompt_ids is not None  # else ``begin`` starts it from the prompt
        self.max_draft = max_draft
        self.hits, self.misses = prior  # per-draft outcomes of verified lookup drafts (leading ones only)
        # n-gram -> latest start among n-grams followed by at least max_draft tokens (a match right behind the
        # current position would offer only a stub of a continuation and hide the earlier, longer one)
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions < _indexed are in the index
        self.pace = Pace()  # what lookup calls delivered in this answer (discarded burst steps charged too)

    def begin(self, session: DraftSession) -> None:
        if not self._own_history:
            self.history, self._index, self._indexed = list(session.prompt), {}, 0
        self.inner.begin(session)

    @property
    def runner_up(self) -> bool:
        return self.inner.runner_up

    @property
    def mode_mass(self) -> bool:
        return self.inner.mode_mass

    @property
    def rate(self) -> float:
        """Observed chance that a lookup draft is accepted, given the ones before it were."""
        return self.hits / (self.hits + self.misses)

    def _reindex(self) -> None:
        h = self.history
        upto = len(h) - self.max_draft + 1
        for end in range(self._indexed, upto):  # n-grams h[end-n:end], each followed by h[end:end+max_draft]
            for n in NGRAMS:
                if end >= n:
                    self._index[tuple(h[end - n : end])] = end - n
        self._indexed = max(self._indexed, upto)

    def candidates(self) -> list[int]:
        """The continuation of the longest recent n-gram match, or []."""
        self._reindex()
        h = self.history
        for n in NGRAMS:
            if len(h) > n:
                start = self._index.get(tuple(h[-n:]))
                if start is not None and start + n < len(h):
                    return h[start + n : start + n + self.max_draft]
        return []

    def ready(self, worth: float = 0.9) -> bool:
        """A lookup chain expected to land at least ``worth`` drafts is in hand: reason to end an autoregressive
        burst early (which wastes the step already queued, and the call costs more than a plain step)."""
        if self.pace.behind():
            return False  # lookup calls have delivered less than plain steps in this answer: let bursts run
        look = self.candidates()
        r = self.rate
        if look and sum(r**k for k in range(1, len(look) + 1)) >= worth:
            self.pace.cost += 1.0  # the queued step the caller now discards is charged to lookup
            return True
        return False

    def plan(self, i: int, remaining: int, room: int) -> Plan:
        look = self.candidates()
        if look:
            budget = self.inner.budget
            r = self.rate
            if sum(r**k for k in range(1, len(look) + 1)) > self.inner.expected(i):
                # The budget fits the lookup chain to this machine's cost (it sees the hit rate as confidences).
                conf = [min(0.99, r / budget.ratio)] * len(look)
                alt = budget.plan(look, conf, remaining, room, self.inner.step)
                if alt.drafts:
                    alt.source = "lookup"
                    return alt
        return self.inner.plan(i, remaining, room)

    def guess(self, plan: Plan, accepted: int, i: int, remaining: int, room: int) -> Guess | None:
        # The adapter's next call, guessed ahead; when a lookup chain wins instead, the guess is not confirmed
        # and that call is built after the read (a synchronous call).
        return self.inner.guess(plan, accepted, i, remaining, room)

    def update(self, plan: Plan, result: CallResult) -> None:
        if plan.source == "lookup":
            self.hits += result.accepted
            self.misses += result.accepted < len(plan.drafts)
            self.pace.add(result.accepted + 1, self.inner.budget.curve(plan.rows))
        self.inner.update(plan, result)

    def emitted(self, tokens: list[int]) -> None:
        self.history.extend(tokens)
