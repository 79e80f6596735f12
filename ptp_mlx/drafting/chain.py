"""The adapter's own drafts: after each call, the auxiliary branch of the path that stood (docs/method.md, §5)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .budget import ADAPTER
from .budget_policy import BudgetPolicy
from .protocol import CallResult, Drafter, DraftPlan, DraftSession, Guess, chain_accepted
from .rows import Pace, reach, u_factor
from .strands import StrandOffer
from .topk_tree import SlotCandidates


def outcome_probs(confidences: list[float], ratio: float) -> list[float]:
    """``P(c == g)``, g = 0..n: exactly ``g`` leading drafts of ``confidences`` (scaled by ``ratio``) stand."""
    p = reach(confidences, ratio)
    return [float(p[g] - (p[g + 1] if g + 1 < len(p) else 0.0)) for g in range(len(p))]


class ChainDrafter(Drafter):
    """A chain of the adapter's drafts per call, its rows chosen by a budget.

    ``plan`` asks the budget for the call's rows (or an autoregressive burst, when calls have delivered fewer
    tokens than plain steps would have); ``update`` takes the next drafts from the call's auxiliary outputs.
    """

    def __init__(self, budget: BudgetPolicy, step: str = "fused"):
        self.budget, self.step = budget, step
        self.drafts: list[int] = []
        self.conf: list[float] = []
        self.pace = Pace()  # what the adapter's calls really delivered since the last burst
        # Sampling in probability order (the adapter's CDF order): the uniforms of the drafted positions are
        # known, and a draft can only be right if its u falls inside the mode's bin (``u_factor``).
        self.uniforms = None
        self.top_prob: list[float] = []  # each draft's top probability at the decoding temperature
        self.planned: list[float] = []  # the confidences the last plan used (what the budget calibrates on)
        self.pending: DraftPlan | None = None  # the next call's plan as already built ahead (``chained``)
        self._memo_for: DraftPlan | None = None  # the plan whose outcomes' previews ``_memo`` holds (``guess``)
        self._memo: dict[tuple[int, int, int], DraftPlan] = {}
        self.fresh = False  # the drafts in hand follow the last block emitted (the call's own, not a burst's)
        self.greedy = True  # the answer decodes greedily (``begin``)
        self.temperature = 0.0
        self.later: list = []  # bookkeeping put off until the next call is queued (``catch_up``)

    def catch_up(self) -> None:
        while self.later:
            self.later.pop(0)()

    def begin(self, session: DraftSession) -> None:
        s = session.settings
        # Sampling in probability order, its drafts' uniforms sharpen their confidences (``u_factor``).
        self.uniforms = session.uniforms if s.order == "prob" and not s.greedy else None
        self.greedy = s.greedy
        self.temperature = s.temperature

    @property
    def reads_top_prob(self) -> bool:
        return self.uniforms is not None

    def confidences(self, i: int) -> list[float]:
        """The drafts' confidences for a call at generated position ``i`` (draft k predicts position i+1+k),
        sharpened by their uniforms when sampling in probability order."""
        if self.uniforms is None or len(self.top_prob) != len(self.conf):
            return self.conf
        us = self.uniforms.take(i + 1, len(self.conf))
        return [c * u_factor(float(x), m) for c, x, m in zip(self.conf, us, self.top_prob, strict=True)]

    def expected(self, i: int) -> float:
        """Expected accepted drafts of the chain in hand, for a call at generated position ``i``."""
        return sum(reach(self.confidences(i), self.budget.ratio)[1:])

    def offers(self, i: int) -> list[StrandOffer]:
        """Side strands this drafter offers for a call at generated position ``i`` (a chain: none;
        ``TreeDrafter``: its runner-ups)."""
        return []

    def candidates(self, i: int) -> SlotCandidates | None:
        """The top tokens per slot of the drafts in hand, for the budget's token tree (a chain: none;
        ``TreeDrafter``: the argmax and its runner-ups)."""
        return None

    def prior_candidates(self, conf: list[float]) -> SlotCandidates | None:
        """Placeholder top tokens per slot of a branch not read yet, priced by its drafts' prior ``conf`` and what
        was seen so far (a chain: none; ``TreeDrafter``: a tree built ahead, ``guess``)."""
        return None

    def plan(self, i: int, remaining: int, room: int, offers: Sequence[StrandOffer] = ()) -> DraftPlan:
        """The next call's rows (``offers``: side strands other peers offer beside this drafter's own)."""
        self.catch_up()  # (a plan reads what the last read's bookkeeping changes)
        conf = self.planned = self.confidences(i)
        if self.budget.calibrate and self.pace.behind():
            # Drafting calls delivered fewer tokens than plain steps would have in the same time: decode
            # plainly for a while, whatever the predictions say.
            plan = DraftPlan([], [], burst=min(self.budget.burst_len, remaining))
        else:
            plan = self.budget.rows_for(
                self.drafts,
                conf,
                remaining,
                room,
                self.step,
                [*self.offers(i), *offers],
                self.pending,
                candidates=self.candidates(i),
                source=ADAPTER,
            )
        self.pending = None
        if plan.burst:
            self.budget.relax()  # each autoregressive burst fades the evidence, so drafting is tried again later
            self.pace = Pace()
        elif plan.drafts:
            plan = replace(plan, source=ADAPTER)
        return plan

    def guess(
        self, plan: DraftPlan, accepted: int, i: int, remaining: int, room: int, strand: int | None = None
    ) -> Guess | None:
        """The next call if ``accepted`` drafts stand (on the path through ``strand``, if given), before the read:
        its drafts are that path's branch, slots 1.. (as ``update`` takes them). A budget whose rows depend only on
        the number of drafts (``FixedBudget``) knows it; the adaptive one guesses it from its prior confidences
        (``preview``), and after the read prefers the shape so built unless another is worth its host time
        (``chained``)."""
        if self.step != "fused" and not self.budget.shape_only:
            return None
        rows = plan.branch_rows(accepted, strand)
        r, w = rows if rows is not None else (0, 1)
        n = w - 1
        if self.budget.shape_only and not self.budget.calibrate:
            nxt = self.budget.rows_for([0] * n, [1.0] * n, remaining, room, self.step)
        elif self.budget.calibrate and not self.pace.behind() and hasattr(self.budget, "prior_confidences"):
            nxt = self._previewed(plan, n, remaining, room)
        else:
            return None
        # (the outcomes whose branches start at the same row get the same guess: one object, made once a build; a
        # tree's paths through its strands are many)
        key = ("guess", id(nxt), r)
        memo = self._memo if self._memo_for is plan else None
        if memo is not None and key in memo:
            return memo[key]
        src = self.strand_sources(nxt, r) if nxt.strands else ()
        if nxt.burst or src is None:
            out = None
        else:
            drafted = replace(nxt, source=ADAPTER) if nxt.drafts else nxt
            out = Guess(drafted, [r + 1 + k for k in range(len(nxt.drafts))], src)
        if memo is not None:
            memo[key] = out
        return out

    def guess_strand(
        self, plan: DraftPlan, strand: int, accepted: int, i: int, remaining: int, room: int
    ) -> Guess | None:
        return self.guess(plan, accepted, i, remaining, room, strand)

    def _previewed(self, plan: DraftPlan, n: int, remaining: int, room: int) -> DraftPlan:
        """The budget's choice on prior confidences for a branch of ``n`` drafts, once per build: the outcomes of
        the call running ``plan`` whose branches are as wide ask the same question (tokens and rows left beyond
        ``_unbound`` bind no choice: those are asked alike), and a tree's preview costs about 0.6 ms here."""
        if self._memo_for is not plan:
            self._memo_for, self._memo = plan, {}
        most_tokens, most_rows = self._unbound()
        key = (n, min(remaining, most_tokens), min(room, most_rows))
        if key not in self._memo:
            conf = self.budget.prior_confidences(n)
            self._memo[key] = self.budget.rows_for(
                [0] * n, conf, remaining, room, self.step, preview=True, candidates=self.prior_candidates(conf),
                source=ADAPTER,
            )  # fmt: skip
        return self._memo[key]

    def _unbound(self) -> tuple[int, int]:
        """Tokens and rows left beyond which neither binds a guess's choice: its drafts (fewer than ``max_width``)
        and their tree reach no further than the branch they came from, each branch drafts at most ``max_width``
        past its own start, and ``rows_for`` never uses more than ``max_rows`` rows."""
        b = self.budget
        return 2 * b.max_width + 4, getattr(b, "max_rows", 1 << 30)

    def strand_sources(self, plan: DraftPlan, row: int) -> tuple[tuple[int, int], ...] | None:
        """Each strand token of a guessed tree (``prior_candidates``' placeholders) as ``(auxiliary row, rank)`` of
        the call before, whose branch starts at auxiliary row ``row`` (``Guess.strand_src``); None: not told."""
        return None

    def chained(self, plan: DraftPlan | None) -> None:
        self.pending = plan

    def commit(self, plan: DraftPlan, i: int) -> DraftPlan | None:
        # The adaptive budget's guess (its usual shape after a branch of this width) runs unless the budget would
        # not draft now (its pace guard, a stale step) or the drafts are not the ones in hand.
        took = getattr(self.budget, "took", None)
        if took is None or self.step != "fused" or plan.source not in (None, ADAPTER) or plan.burst:
            return None
        if (self.budget.calibrate and self.pace.behind()) or self.budget.refuses(ADAPTER):
            return None
        if list(plan.drafts) != list(self.drafts[: len(plan.drafts)]):
            return None
        if any(t < 0 for st in plan.strands for t in st.tokens):
            return None  # a tree's placeholder the read had no token for (``Guess.realize``): never a real plan
        self.planned = self.confidences(i)  # (what the budget calibrates on after the read: ``update``)
        self.pending = None
        took(plan)
        return plan

    def guess_start(self, i: int, remaining: int, room: int) -> DraftPlan | None:
        """After a burst no drafts are in hand (``emitted`` dropped them): the budget's priming call, as previewed."""
        if self.step != "fused" or (self.budget.calibrate and self.pace.behind()):
            return None
        nxt = self.budget.rows_for([], [], remaining, room, self.step, preview=True, source=ADAPTER)
        return None if nxt.burst or nxt.drafts or nxt.strands or not nxt.branches else nxt

    def likely(self, plan: DraftPlan) -> list[float] | None:
        return outcome_probs(self.planned[: len(plan.drafts)], self.budget.ratio)

    def timed(self, rows: int, tokens: int, seconds: float, cold: bool = False, source: str | None = None) -> None:
        self.budget.record(rows, tokens, seconds, cold, source)

    def update(self, plan: DraftPlan, result: CallResult) -> None:
        self.catch_up()  # (what the read before put off comes first)
        own = plan.source in (None, ADAPTER)  # the adapter's calls; another drafter's chain (lookup) is not evidence
        if own:  # the budget calibrates on the adapter's own chain drafts only (a strand starts where the chain fell)
            self.budget.observe(self.planned[: len(plan.drafts)], chain_accepted(plan, result))
        if own:  # the adapter's calls: their real pace
            self.pace.add(result.accepted + 1, self.budget.curve(plan.rows))
        self.drafts, self.conf, self.top_prob, self.planned = [], [], [], []
        rows = plan.branch_rows(result.accepted, result.strand)
        if rows is not None:  # slot 0 predicts the exact token just emitted: the drafts start at slot 1
            r, w = rows
            self.drafts, self.conf = result.aux_tokens[r + 1 : r + w], result.aux_conf[r + 1 : r + w]
            self.top_prob = result.aux_top_prob[r + 1 : r + w] if result.aux_top_prob else []
        self.fresh = True
        self._took(result, rows)

    def emitted(self, tokens: list[int]) -> None:
        # A call's own block comes right after ``update``; any other (a burst's tokens) moves the answer past the
        # positions the drafts in hand predict: they are dropped, not verified (they would fail, and the budget
        # would calibrate on them).
        if self.fresh:
            self.fresh = False
            return
        self.drafts, self.conf, self.top_prob = [], [], []
        self._took(CallResult([], 0), None)

    def _took(self, result: CallResult, rows: tuple[int, int] | None) -> None:
        """Hook for what else a drafter keeps from the branch it took (``TreeDrafter``: the runner-up)."""
