"""Drafters as peers behind one policy (docs/method.md, section 5), as llama.cpp chains its drafters.

The adapter's ``ChainDrafter`` (or ``TreeDrafter``) and the ``LookupProposer`` each offer drafts for the next call
with the accepted drafts they expect; ``DraftPolicy`` picks the better offer and fits it to this machine's cost
with the budget it shares with the chain drafter (given to both when they are made). Neither peer reads the
other: the policy talks to each through its public verbs.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

from .budget_policy import BudgetPolicy
from .chain import ChainDrafter, outcome_probs
from .lookup import LookupOffer, LookupProposer
from .protocol import CallResult, Drafter, DraftPlan, DraftSession, Guess, chain_accepted
from .rows import reach
from .strands import StrandOffer

TOKEN_GUESSES = 4  # tokens an adapter call may emit whose lookup chains are built ahead (``guess_by_token``)


class DraftPolicy(Drafter):
    """The adapter's chain drafter and, optionally, prompt lookup: per call the offer expected to land more
    drafts is verified (``DraftPlan.source`` says whose), and the call drafts the adapter's branches either way."""

    def __init__(self, budget: BudgetPolicy, chain: ChainDrafter, lookup: LookupProposer | None = None):
        self.budget, self.chain, self.lookup = budget, chain, lookup
        self.lookup_conf: list[float] = []  # the confidences the last lookup plan was priced by
        self.pending_lookup: DraftPlan | None = None  # the lookup call built ahead for the next plan (``chained``)

    @property
    def runner_up(self) -> bool:
        return self.chain.runner_up

    @property
    def reads_top_prob(self) -> bool:
        return self.chain.reads_top_prob

    def begin(self, session: DraftSession) -> None:
        if self.lookup is not None:
            self.lookup.begin(session)
        self.chain.begin(session)

    def plan(self, i: int, remaining: int, room: int) -> DraftPlan:
        # The better offer is the chain; the other peer's drafts, and lookup's other continuations, may stand beside
        # it as side strands of a token tree (where the budget builds trees and their rows pay).
        offer = self.lookup.offer() if self.lookup is not None else None
        trees = offer is not None and self.budget.builds_trees
        others = self._lookup_strands(self.lookup.alternatives(), 0.5) if trees else []
        if offer is not None and offer.expected > self.chain.expected(i):
            beside = self._chain_strand(i) + others if trees else []
            # fitted to this machine's cost, preferring the lookup call already built ahead (no tree beside it then)
            plan = self._fit_lookup(offer, remaining, room, beside, pending=self.pending_lookup)
            self.pending_lookup = None
            if plan is not None:
                self.chain.chained(None)  # (what was built ahead for the adapter's call is dropped)
                self.lookup_conf = self._lookup_conf(offer)
                return plan
        beside = self._lookup_strands([offer], 1.0) + others if trees else []
        return self.chain.plan(i, remaining, room, beside)

    @staticmethod
    def _lookup_strands(offers: list[LookupOffer], first: float) -> list[StrandOffer]:
        """Lookup continuations as strands (a strand is verified exactly under every rule), each token at the hit
        rate (its first at ``first`` times it: another continuation than the one the text repeated last)."""
        return [
            StrandOffer(
                0, o.drafts, (min(0.99, o.rate * first),) + (min(0.99, o.rate),) * (len(o.drafts) - 1), "lookup"
            )
            for o in offers
        ]

    def _chain_strand(self, i: int) -> list[StrandOffer]:
        """The adapter's drafts in hand as a strand beside a lookup chain."""
        drafts, conf = self.chain.drafts, self.chain.confidences(i)
        if not drafts:
            return []
        r = self.budget.ratio
        return [StrandOffer(0, tuple(drafts), tuple(min(0.99, c * r) for c in conf), "ptp")]

    def guess(self, plan: DraftPlan, accepted: int, i: int, remaining: int, room: int) -> Guess | None:
        # After a lookup chain, when all of it stands: the chain that continues the copied text (the policy's
        # choice between the peers needs the adapter's drafts, read only after the call: a guess the read may
        # not confirm). Otherwise (a lookup chain cut short, or the adapter's call) the adapter's next call from
        # the branch the call drafted there, guessed ahead where its budget can tell it.
        if self.lookup is not None and plan.source == self.lookup.source and accepted == len(plan.drafts):
            offer = self.lookup.guess_after(plan.drafts)
            nxt = self._fit_lookup(offer, remaining, room) if offer is not None else None
            return Guess(nxt, None) if nxt is not None else None
        return self.chain.guess(plan, accepted, i, remaining, room)

    def guess_strand(
        self, plan: DraftPlan, strand: int, accepted: int, i: int, remaining: int, room: int
    ) -> Guess | None:
        # After a path through a strand: the adapter's next call from the strand's branch (a lookup chain's
        # continuation is told only when the lookup chain itself stands whole: ``guess``)
        return self.chain.guess_strand(plan, strand, accepted, i, remaining, room)

    def guess_by_token(self, plan: DraftPlan, accepted: int, i: int, remaining: int, room: int) -> Guess | None:
        # After the adapter's call, or a lookup chain cut short: prompt lookup's chain once the call's exact token
        # extends the history, for each token whose n-gram lookup would match (the adapter's guess stands beside
        # it in its own build; after the read the policy weighs the two as ever). A lookup chain that stands whole
        # goes on as the copied text does (``guess``). A lookup call's read moves lookup's hit rates before the
        # next plan (``update``): its outcome's rates price the chains here.
        lookup = self.lookup
        if lookup is None or (plan.source == lookup.source and accepted == len(plan.drafts)):
            return None
        h = lookup.history + list(plan.drafts[:accepted])
        plans: dict[int, DraftPlan] = {}
        with lookup.as_if_observed(len(plan.drafts), accepted) if plan.source == lookup.source else nullcontext():
            for x in lookup.next_tokens(h, TOKEN_GUESSES):
                offer = lookup.offer_after(h + [x])
                nxt = self._fit_lookup(offer, remaining, room, preview=True) if offer is not None else None
                if nxt is not None and not nxt.burst and not nxt.strands:
                    plans[x] = nxt
        if not plans:
            return None
        first = next(iter(plans.values()))  # (the likeliest token's shape: one build serves one shape)
        same = {x: p for x, p in plans.items() if (len(p.drafts), p.branches, p.strict) == _shape(first)}
        return Guess(first, None, by_token=same)

    def guess_start(self, i: int, remaining: int, room: int) -> DraftPlan | None:
        # A lookup chain in hand (what ends a burst early): the chain it continues with if the burst's last token,
        # not read yet, is the copied text's next one (the read tells; a wrong guess is dropped, never queued).
        if self.lookup is not None and self.ready():
            offer = self.lookup.guess_after(())
            return None if offer is None else self._fit_lookup(offer, remaining, room, preview=True)
        return self.chain.guess_start(i, remaining, room)

    def likely(self, plan: DraftPlan) -> list[float] | None:
        if self.lookup is not None and plan.source == self.lookup.source:
            return outcome_probs(self.lookup_conf[: len(plan.drafts)], self.budget.ratio)
        return self.chain.likely(plan)

    def _lookup_conf(self, offer: LookupOffer) -> list[float]:
        return [min(0.99, offer.rate / self.budget.ratio)] * len(offer.drafts)

    def _fit_lookup(
        self, offer: LookupOffer, remaining: int, room: int, beside=(), pending: DraftPlan | None = None,
        preview: bool = False,
    ) -> DraftPlan | None:  # fmt: skip
        """The budget's rows for a lookup chain (it sees the hit rate as confidences), with ``beside`` offered as
        side strands (``pending``: the lookup call built ahead, preferred; ``preview``: the choice only, nothing
        noted), or None without drafts."""
        conf = self._lookup_conf(offer)
        drafts = self._paying(list(offer.drafts), conf)
        plan = self.budget.rows_for(
            drafts,
            conf[: len(drafts)],
            remaining,
            room,
            self.chain.step,
            beside,
            pending,
            preview=preview,
            source=self.lookup.source,
        )
        return replace(plan, source=self.lookup.source, strict=offer.earlier) if plan.drafts else None

    def _paying(self, drafts: list[int], conf: list[float]) -> list[int]:
        """A chain longer than ``max_draft`` (after a long match, ``lookup.LONG_CHAIN``) cut where its expected tokens
        per cost are best at this machine's curve (the budget verifies every draft likely enough to stand, whatever
        its rows cost); a shorter one as it is."""
        short = self.lookup.max_draft
        if len(drafts) <= short:
            return drafts
        p = reach(conf, self.budget.ratio)
        value = 1.0 + sum(p[1 : short + 1])
        best, best_n = value / self.budget.curve(1 + short), short
        for n in range(short + 1, len(drafts) + 1):
            value += p[n]
            if value / self.budget.curve(1 + n) > best:
                best, best_n = value / self.budget.curve(1 + n), n
        return drafts[:best_n]

    def update(self, plan: DraftPlan, result: CallResult) -> None:
        if self.lookup is not None and plan.source == self.lookup.source:
            self.lookup.observe(len(plan.drafts), chain_accepted(plan, result), self.budget.curve(plan.rows))
        self.chain.update(plan, result)

    def commit(self, plan: DraftPlan, i: int) -> DraftPlan | None:
        # The adapter's call built ahead runs unless prompt lookup now offers more (what ``plan`` would weigh); a
        # lookup chain built ahead (the copy's continuation, or the chain for the token the read revealed) runs
        # where lookup's chain is now that one (``_commit_lookup``).
        if self.lookup is not None:
            if plan.source == self.lookup.source:
                return self._commit_lookup(plan, i)
            offer = self.lookup.offer()
            if offer is not None and offer.expected > self.chain.expected(i):
                return None
        out = self.chain.commit(plan, i)
        if out is not None:
            self.pending_lookup = None
        return out

    def _commit_lookup(self, plan: DraftPlan, i: int) -> DraftPlan | None:
        """A lookup chain planned ahead of the read, as its rows were fitted then, where lookup's chain after the
        read verifies the same drafts (the read's token is the one it was planned for), still beats the adapter's
        and is not refused: re-fitting it after the read (0.13 ms on the path here, 0.5 ms beside trees) would
        change its rows only by what the read moved the calibration, never the tokens (every plan is lossless)."""
        offer = self.lookup.offer()
        if offer is None or plan.strands or offer.expected <= self.chain.expected(i):
            return None
        if tuple(offer.drafts[: len(plan.drafts)]) != tuple(plan.drafts) or plan.strict != offer.earlier:
            return None
        refuses = getattr(self.budget, "refuses", None)  # (an adaptive budget's pace guard; a fixed one has none)
        if plan.burst or not plan.drafts or (refuses is not None and refuses(self.lookup.source)):
            return None
        self.chain.chained(None)  # (what was built ahead for the adapter's call is dropped)
        self.lookup_conf = self._lookup_conf(offer)
        self.pending_lookup = None
        took = getattr(self.budget, "took", None)
        if took is not None:
            took(plan)
        return plan

    def chained(self, plan: DraftPlan | None) -> None:
        self.chain.chained(plan if plan is not None and plan.source != self.lookup_source else None)
        lookup = plan is not None and self.lookup is not None and plan.source == self.lookup.source
        self.pending_lookup = plan if lookup else None

    @property
    def lookup_source(self) -> str | None:
        return self.lookup.source if self.lookup is not None else None

    def timed(self, rows: int, tokens: int, seconds: float, cold: bool = False, source: str | None = None) -> None:
        self.budget.record(rows, tokens, seconds, cold, source)  # (the budget the chain drafter shares: told once)

    def catch_up(self) -> None:
        self.chain.catch_up()

    def emitted(self, tokens: list[int]) -> None:
        if self.lookup is not None:
            self.lookup.emitted(tokens)
        self.chain.emitted(tokens)

    def ready(self) -> bool:
        # Only when the budget would verify the chain now: a burst ended for a chain the budget then refuses
        # (measured slower than plain decoding, or its rows not worth it) restarts at once, and each such restart
        # wasted the queued step and the pipelining (bursts at half the plain pace on a chat's second turn).
        if self.lookup is None:
            return False
        offer = self.lookup.offer()
        if offer is None:
            return False
        conf = self._lookup_conf(offer)
        fit = self.budget.rows_for(
            list(offer.drafts),
            conf,
            len(offer.drafts) + 1,
            64,
            self.chain.step,
            preview=True,
            source=self.lookup.source,
        )
        return bool(fit.drafts) and self.lookup.ready()


def _shape(plan: DraftPlan) -> tuple:
    return len(plan.drafts), plan.branches, plan.strict


@dataclass(frozen=True)
class DraftingConfig:
    """How an answer drafts, in one place: the adaptive budget (``budget``, default a flat cost curve) or a fixed
    one of ``num_draft_tokens`` drafts per call; runner-up siblings (``trees``, where the budget builds them);
    prompt-lookup chains beside the adapter's (``lookup``); ``step``: "fused", or "simple" (draft, then verify)."""

    num_draft_tokens: int | None = None
    budget: BudgetPolicy | None = None
    trees: bool = True
    lookup: bool = True
    step: str = "fused"


def make_drafter(config: DraftingConfig, width: int) -> Drafter:
    """The default drafter of an adapter with ``width``-row windows, composed from ``config``."""
    from .budget import Budget
    from .cost import CostCurve
    from .fixed_budget import FixedBudget
    from .tree import TreeDrafter

    if config.num_draft_tokens:
        budget: BudgetPolicy = FixedBudget(config.num_draft_tokens, width)
    else:
        budget = config.budget or Budget(CostCurve(), max_width=width)
    kind = TreeDrafter if config.trees and budget.builds_trees else ChainDrafter
    chain = kind(budget, config.step)
    if not config.lookup:
        return chain
    return DraftPolicy(budget, chain, LookupProposer(max_draft=width - 1))
