"""Prompt lookup drafts: text that repeats the prompt or itself is drafted for free (docs/method.md, section 5).

The latest n tokens (n = 4, 3, 2) are looked up where they occurred before in the prompt and the answer so far;
the tokens that followed them there become a candidate chain of drafts. Drafts are only ever verified by the exact
rule, so the output does not change. ``LookupProposer`` is a peer of the adapter's ``ChainDrafter``: it offers its
chain with the accepted drafts it expects (from the hit rate it has observed), and the policy of
``drafting/policy.py`` picks between the offers. Either way the call still drafts the adapter's branches after the
verified chain, so adapter drafts continue where the lookup stops.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from .protocol import DraftSession
from .rows import Pace

NGRAMS = (4, 3, 2)
FOLLOWERS = 8  # tokens kept per n-gram's first n - 1 tokens that ended it (``next_tokens``)
ALTERNATIVES = 3  # continuations kept per n-gram, each with a different next token (side strands of a tree)
# How long the match behind a chain is (the latest tokens that equal those before the copied text, up to 16) sorts
# its drafts' chances: a chain copied after a long match is likelier to go on as the text did. Hit rates are kept
# per class of match length: 2, 3, 4-5, 6-9, 10 or more tokens.
MATCH_CLASSES = (3, 4, 6, 10)  # the first length of each class after the first
MAX_MATCH = 16
CLASS_PRIOR = 2.0  # pseudo-drafts at the overall rate before a class has its own observations
# A chain after a match of the longest class is offered this many times ``max_draft`` tokens long (its drafts stood
# 95% of the time on development prompts: the budget verifies as many of them as pay)
LONG_CHAIN = 2


@dataclass(frozen=True)
class LookupOffer:
    """A lookup chain for the next call: its ``drafts``, the observed chance ``rate`` that a lookup draft stands
    given the ones before it did, and the accepted drafts that rate makes ``expected``. ``earlier``: the drafts are
    copied from before the current turn (an earlier turn of a chat, ``DraftSession.turn_start``)."""

    drafts: tuple[int, ...]
    rate: float
    earlier: bool = False

    @property
    def expected(self) -> float:
        return sum(self.rate**k for k in range(1, len(self.drafts) + 1))


class LookupProposer:
    """Prompt-lookup chains from the prompt and the answer so far, with their observed hit rate and pace."""

    source = "lookup"

    def __init__(
        self, prompt_ids: list[int] | None = None, max_draft: int = 7, prior: tuple[float, float] = (1.0, 1.0)
    ):
        self.history = list(prompt_ids or [])
        self._own_history = prompt_ids is not None  # else ``begin`` starts it from the prompt
        self.max_draft = max_draft
        self.hits, self.misses = prior  # per-draft outcomes of verified lookup drafts (leading ones only)
        # n-gram -> latest start among n-grams followed by at least max_draft tokens (a match right behind the
        # current position would offer only a stub of a continuation and hide the earlier, longer one)
        self._index: dict[tuple[int, ...], int] = {}
        # n-gram -> the latest starts whose continuations begin with different tokens (most recent first)
        self._alts: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # n-grams ending at positions < _indexed are in the index
        # an n-gram's first n - 1 tokens -> the tokens that ended it in the index, latest first (``next_tokens``)
        self._follow: dict[tuple[int, ...], list[int]] = {}
        self.pace = Pace()  # what lookup calls delivered in this answer (discarded burst steps charged too)
        self.turn_start = 0  # history before this position is an earlier turn (its copies are offered ``earlier``)
        self._matched: tuple[int, int | None] | None = None  # (history length, ``_match`` of it)
        # per class of match length (``MATCH_CLASSES``): hits and misses of the chains matched that long
        self.class_hits = [0.0] * (len(MATCH_CLASSES) + 1)
        self.class_misses = [0.0] * (len(MATCH_CLASSES) + 1)

    def begin(self, session: DraftSession) -> None:
        self.turn_start = session.turn_start
        if not self._own_history:
            self.history, self._index, self._alts, self._indexed = list(session.prompt), {}, {}, 0
            self._follow = {}
            self._matched = None

    @property
    def rate(self) -> float:
        """Observed chance that a lookup draft is accepted, given the ones before it were."""
        return self.hits / (self.hits + self.misses)

    def class_rate(self, k: int) -> float:
        """The hit rate of chains whose match is of length class ``k``, drawn to the overall rate while it has few
        observations of its own."""
        h, m = self.class_hits[k], self.class_misses[k]
        return (h + CLASS_PRIOR * self.rate) / (h + m + CLASS_PRIOR)

    @staticmethod
    def match_class(h: list[int], at: int) -> int:
        """The length class of the match behind the continuation at ``at``: how many of ``h``'s latest tokens equal
        those just before ``at`` (up to ``MAX_MATCH``)."""
        n, top = 0, min(MAX_MATCH, at)
        while n < top and h[at - 1 - n] == h[len(h) - 1 - n]:
            n += 1
        return sum(1 for c in MATCH_CLASSES if n >= c)

    def _reindex(self) -> None:
        h = self.history
        upto = len(h) - self.max_draft + 1
        for end in range(self._indexed, upto):  # n-grams h[end-n:end], each followed by h[end:end+max_draft]
            for n in NGRAMS:
                if end >= n:
                    key = tuple(h[end - n : end])
                    self._index[key] = end - n
                    starts = [s for s in self._alts.get(key, []) if h[s + n] != h[end]]
                    self._alts[key] = [end - n, *starts][:ALTERNATIVES]
                    x, pre = key[-1], key[:-1]
                    self._follow[pre] = [x, *(t for t in self._follow.get(pre, ()) if t != x)][:FOLLOWERS]
        self._indexed = max(self._indexed, upto)

    def candidates(self) -> list[int]:
        """The continuation of the longest recent n-gram match, or []."""
        offer = self.offer()
        return [] if offer is None else list(offer.drafts)

    def _match(self, h: list[int]) -> int | None:
        """Where the continuation of ``h``'s longest recent n-gram match starts in ``h``, or None. ``h`` is the
        history, perhaps with tokens appended that the index has not seen: their n-grams are scanned here, latest
        first, as ``_reindex`` would have indexed them."""
        upto = len(h) - self.max_draft + 1
        for n in NGRAMS:
            if len(h) <= n:
                continue
            key = tuple(h[-n:])
            start = next(
                (e - n for e in range(upto - 1, max(self._indexed, n) - 1, -1) if tuple(h[e - n : e]) == key), None
            )
            if start is None:
                start = self._index.get(key)
            if start is not None and start + n < len(h):
                return start + n
        return None

    def guess_after(self, drafts: tuple[int, ...]) -> LookupOffer | None:
        """The lookup chain the next call would get if every one of ``drafts`` (this call's lookup chain) stands and
        the exact token after them is the copied text's next one as well, with the rate those hits make; None when
        the copied text has no next token or that history offers no chain. Nothing here changes the proposer."""
        self._reindex()
        h = self.history
        at = self._match(h)
        if at is None or tuple(h[at : at + len(drafts)]) != tuple(drafts) or at + len(drafts) >= len(h):
            return None
        ext = h + list(drafts) + [h[at + len(drafts)]]
        nxt = self._match(ext)
        if nxt is None:
            return None
        # the rate once ``drafts`` stood (``observe``: their hits count overall and in their own match's class)
        now, then, m = self.match_class(h, at), self.match_class(ext, nxt), len(drafts)
        hits, misses = self.hits + m, self.misses
        ch, cm = self.class_hits[then], self.class_misses[then]
        if then == now:
            ch += m
        rate = (ch + CLASS_PRIOR * hits / (hits + misses)) / (ch + cm + CLASS_PRIOR)
        return LookupOffer(tuple(ext[nxt : nxt + self._length(then)]), rate, nxt < self.turn_start)

    def next_tokens(self, h: list[int], limit: int) -> list[int]:
        """Tokens that followed ``h``'s latest 3, then 2, then 1 tokens before (latest first, each once, at most
        ``limit``): were the next token one of them, lookup would match the n-gram it ends (``offer_after``).
        ``h``: the history, perhaps with tokens appended (a call's drafts that may stand)."""
        self._reindex()
        out: list[int] = []
        for n in NGRAMS:
            if len(h) < n:
                continue
            pre = tuple(h[len(h) - n + 1 :])
            tail = [
                h[e] for e in range(len(h) - 1, max(self._indexed - 1, n - 1) - 1, -1) if tuple(h[e - n + 1 : e]) == pre
            ]
            for x in tail + self._follow.get(pre, []):
                if x not in out:
                    out.append(x)
                    if len(out) >= limit:
                        return out
        return out

    def offer_after(self, h: list[int]) -> LookupOffer | None:
        """The chain ``offer`` would make once the history is ``h`` (the history with tokens appended), at the
        rates as they are; nothing here changes the proposer."""
        self._reindex()
        at = self._match(h)
        if at is None:
            return None
        k = self.match_class(h, at)
        return LookupOffer(tuple(h[at : at + self._length(k)]), self.class_rate(k), at < self.turn_start)

    def _current(self) -> int | None:
        """``_match`` of the history as it is (kept until the history grows: the policy asks more than once per
        plan, after every read, on the host's critical path)."""
        if self._matched is None or self._matched[0] != len(self.history):
            self._reindex()
            self._matched = (len(self.history), self._match(self.history))
        return self._matched[1]

    def offer(self) -> LookupOffer | None:
        """The lookup chain in hand for the next call, or None, at the hit rate of its match's length class."""
        at = self._current()
        if at is None:
            return None
        k = self.match_class(self.history, at)
        return LookupOffer(tuple(self.history[at : at + self._length(k)]), self.class_rate(k), at < self.turn_start)

    def _length(self, k: int) -> int:
        """How many tokens a chain after a match of class ``k`` offers."""
        return self.max_draft * (LONG_CHAIN if k == len(MATCH_CLASSES) else 1)

    def alternatives(self) -> list[LookupOffer]:
        """Other continuations of the n-gram the chain in hand was matched on, each starting with a token of its own
        (the text continued the same words differently elsewhere): side strands for a token tree, at half the hit
        rate for their first token's."""
        main = self._current()
        h, out = self.history, []
        for n in NGRAMS:
            starts = self._alts.get(tuple(h[-n:])) if len(h) > n else None
            if starts:
                for s in starts:
                    if s + n != main and s + n < len(h):
                        cont = tuple(h[s + n : s + n + self.max_draft])
                        out.append(LookupOffer(cont, self.rate, s < self.turn_start))
                break
        return out

    def ready(self, worth: float = 0.9) -> bool:
        """A lookup chain expected to land at least ``worth`` drafts is in hand: reason to end an autoregressive
        burst early (which wastes the step already queued, and the call costs more than a plain step)."""
        if self.pace.behind():
            return False  # lookup calls have delivered less than plain steps in this answer: let bursts run
        offer = self.offer()
        if offer is not None and offer.expected >= worth:
            self.pace.cost += 1.0  # the queued step the caller now discards is charged to lookup
            return True
        return False

    def observe(self, proposed: int, accepted: int, cost: float) -> None:
        """A call verified ``proposed`` lookup drafts, ``accepted`` of them stood, at ``cost`` plain steps."""
        self._count(proposed, accepted)
        self.pace.add(accepted + 1, cost)

    def _count(self, proposed: int, accepted: int) -> None:
        self.hits += accepted
        self.misses += accepted < proposed
        at = self._current()  # (the history is still the one the verified chain was matched in: ``emitted`` is next)
        if at is not None:
            k = self.match_class(self.history, at)
            self.class_hits[k] += accepted
            self.class_misses[k] += accepted < proposed

    @contextmanager
    def as_if_observed(self, proposed: int, accepted: int):
        """The hit rates as ``observe`` will leave them once a call of ``proposed`` lookup drafts is read with
        ``accepted`` of them standing, for the duration (a guess made before that read: ``offer_after``)."""
        kept = self.hits, self.misses, list(self.class_hits), list(self.class_misses)
        self._count(proposed, accepted)
        try:
            yield self
        finally:
            self.hits, self.misses, self.class_hits, self.class_misses = kept

    def emitted(self, tokens: list[int]) -> None:
        self.history.extend(tokens)
