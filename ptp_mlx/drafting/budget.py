"""How many drafts to verify and how wide each draft branch is, per call (docs/method.md, section 5).

The cost of a pass grows with its rows in a machine-specific way (flat on a GPU or with a fast BLAS up to
some width, linear with the reference BLAS). The adaptive ``Budget`` spends rows only while the expected number
of tokens they buy, per unit of measured cost, keeps rising, so PTP degrades towards plain decoding when drafts
are poor. ``FixedBudget`` (``--num-draft-tokens N``) spends the same rows every call. Both implement
``BudgetPolicy`` (``budget_policy.py``), the one interface drafters use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .cost import CostCurve
from .learn import PaceGuard
from .protocol import DraftPlan
from .rows import fit_rows, reach, simple_rows
from .shapes import ShapeMemory
from .strands import StrandOffer
from .topk_tree import SlotCandidates
from .tree_budget import tree_call, tree_nodes

AR_BURST = 16  # tokens decoded autoregressively when drafting does not pay, before the budget is asked again
TREE_PRIOR = 4.0  # pseudo-tokens at ratio 1 before a tree's tokens have been seen to stand or fall
TREE_KEEP = 0.97  # how much of its evidence the trees' calibration keeps per call that verified a tree
MAX_BURST = 64  # the longest burst after repeated failed probes (a calibrating budget backs off up to this)
TRIAL_CALLS = 2  # PTP calls tried after a burst before the pace guard may call for the next one
ADAPTER = "ptp"  # ``DraftPlan.source`` of the adapter's own drafts
EXPLORE_BURST = 4  # plain steps decoded to re-measure a plain step's time when none was measured for long


@dataclass
class Budget:
    """Chooses ``(n_verify, branches)`` for a fused call.

    ``survival[k]`` is the prior probability that at least ``k`` drafts of a fresh branch are accepted
    (from the adapter's acceptance histogram); draft confidences sharpen it for the drafts in hand.

    With ``calibrate``, ``observe`` learns how often verified drafts really land compared with their
    confidences, and scales both the confidences and the prior by that ratio: drafts that do worse in
    decoding than on the validation windows make the budget draft less (down to plain autoregressive bursts).
    """

    curve: CostCurve
    max_width: int = 8
    survival: list[float] = field(default_factory=lambda: [1.0] + [0.5**k for k in range(1, 16)])
    max_rows: int = 64
    min_prob: float = 0.02
    calibrate: bool = False
    prior_weight: float = 8.0  # pseudo-drafts at ratio 1 before any observation
    hits: float = 0.0  # verified drafts accepted (each given that the drafts before it were)
    expected: float = 0.0  # sum of those drafts' confidences
    burst_len: int = AR_BURST  # the next burst's length (calibrating budgets back off when probes fail)
    landed: bool = True  # some draft was accepted since the last burst
    builds_trees: bool = True  # it weighs the strands peers offer (``offers``) as a token tree
    shape_only: bool = False  # its rows follow the drafts' confidences
    guard: PaceGuard = field(default_factory=PaceGuard)  # the adapter's calls' measured pace against plain steps'
    lookup_guard: PaceGuard = field(default_factory=PaceGuard)  # prompt lookup's calls' (``_guard``)
    behind_before: bool = False  # the last burst was the guard's, PTP measured slower than plain decoding
    explore_due: bool = False  # after a burst: the next call the curve prices out may be measured instead
    trials: int = 0  # PTP calls still allowed after a burst before the pace guard is heeded again
    shapes: ShapeMemory = field(default_factory=ShapeMemory)  # the call shapes used so far (each one compiled)
    tree_expected: float = 0.0  # the adapter's tree tokens predicted to stand, over the calls that verified a tree
    tree_hits: float = 0.0  # and those that stood (``tree_ratio``)

    @property
    def ratio(self) -> float:
        """Observed / predicted acceptance of verified drafts (1.0 until observed), bounded to [0.25, 2]."""
        if not self.calibrate:
            return 1.0
        r = (self.prior_weight + self.hits) / (self.prior_weight + self.expected)
        return min(2.0, max(0.25, r))

    def observe(self, confidences: list[float], accepted: int) -> None:
        """Record one call: the confidences of the drafts it verified and how many leading ones stood."""
        if not self.calibrate:
            return
        for j, c in enumerate(confidences[: accepted + 1]):  # drafts after the first miss tell nothing
            self.expected += float(c)
            self.hits += 1.0 if j < accepted else 0.0
        if accepted > 0:
            self.landed = True
            if not self.behind_before:  # (drafts that land but cost more than they bring keep the back-off)
                self.burst_len = AR_BURST

    @property
    def tree_ratio(self) -> float:
        """Stood / predicted tokens of the adapter's trees (1.0 until observed, or when it does not calibrate),
        bounded to [0.25, 1.5]: it scales the runner-ups' chances, so a tree the adapter's probabilities overprice
        (sampling, where its bins only estimate the verifier's) buys fewer rows."""
        if not self.calibrate:
            return 1.0
        r = (TREE_PRIOR + self.tree_hits) / (TREE_PRIOR + self.tree_expected)
        return min(1.5, max(0.25, r))

    def observe_tree(self, expected: float, hits: float) -> None:
        """Record one call that verified the adapter's tree: its tokens' predicted chances (summed) and how many
        stood; older calls fade (``TREE_KEEP``), so the ratio follows the text and the decoding mode."""
        if self.calibrate:
            self.tree_expected = TREE_KEEP * self.tree_expected + expected
            self.tree_hits = TREE_KEEP * self.tree_hits + hits

    @classmethod
    def from_histogram(cls, curve: CostCurve, hist: list[float] | None, max_width: int, **kw) -> Budget:
        if hist and sum(hist) > 0:
            h = np.asarray(hist, dtype=np.float64) / float(sum(hist))
            surv = [float(h[k:].sum()) for k in range(len(h))] + [0.0]
        else:
            surv = [1.0] + [0.5**k for k in range(1, max_width + 1)]
        return cls(curve=curve, max_width=max_width, survival=surv, **kw)

    def relax(self, keep: float = 0.5) -> None:
        """Fade the observations (called once per autoregressive burst), so a budget that stopped drafting
        drifts back towards its prior and probes again instead of never drafting for the rest of a session.
        Probes cost (a call that only primes drafts is dearer than a plain step), so when no draft landed since
        the last burst the next burst is twice as long (up to ``MAX_BURST``): text where drafts fail is re-probed
        rarely, and the first accepted draft resets the length."""
        behind = self.behind()
        if self.calibrate and (not self.landed or (behind and self.behind_before)):
            self.burst_len = min(MAX_BURST, 2 * self.burst_len)
        self.behind_before = behind
        self.explore_due = not behind
        # Drafting is tried again after the burst, by ``TRIAL_CALLS`` calls judged with the window as it was (not
        # cleared: a window emptied at every burst let 3 losing calls through per burst, 10% of plain decoding's
        # pace on held-out prompts here); good trials lift it, losing ones make the next burst twice as long.
        self.trials = TRIAL_CALLS
        self.landed = False
        self.hits *= keep
        self.expected *= keep

    def record(self, rows: int, tokens: int, seconds: float, cold: bool = False, source: str | None = None) -> None:
        """One call's measured time: the cost curve learns from it (when it is a ``LearnedCost``; a ``cold`` call,
        whose time holds running its shape uncompiled, only as an upper bound), and a PTP call's tokens per second
        feed the pace guard of its drafter (``source``: prompt lookup's, or the adapter's), cold or not: a shape
        compiled for one call is a cost the answer paid, and a budget that keeps meeting new shapes must see it (a
        warm call slowed by a stray spike is capped)."""
        expected = None
        if rows > 1 and not cold:  # (a plain step reads nothing: a learnt curve rebuilds only when read)
            step = getattr(self.curve, "step_seconds", None)
            expected = self.curve(rows) * step if step else None
        learn = getattr(self.curve, "observe", None)
        if learn is not None:
            learn(rows, seconds, cold=cold)
        if rows > 1:
            self._guard(source).add(tokens, seconds, expected)
            self.trials = max(0, self.trials - 1)

    def behind(self, source: str | None = None) -> bool:
        """True when the latest PTP calls of the drafter ``source`` names (prompt lookup, or else the adapter), as
        measured, were slower than plain steps (``PaceGuard``)."""
        return self.calibrate and self._guard(source).behind(getattr(self.curve, "step_seconds", None))

    def _guard(self, source: str | None) -> PaceGuard:
        """Each drafter's calls are judged on their own pace: the adapter's losing calls (text it drafts badly, a
        curve that priced its rows too low) turned every call into bursts, prompt lookup's chains at a 0.8-0.95 hit
        rate with them (held-out greedy, one run in six: 103 lookup drafts accepted against 180-250), and lookup
        chains that fall do not stop the adapter's."""
        return self.lookup_guard if source is not None and source.startswith("lookup") else self.guard

    def _no_drafting(self, source: str | None = None) -> int:
        """A burst's length when this call must not draft (0: it may): the calls of the drafter ``source`` names
        measured slower than plain decoding, or no plain step measured for long (a short one re-measures its
        pace)."""
        if self.behind(source) and self.trials <= 0:
            return self.burst_len
        return EXPLORE_BURST if self.calibrate and getattr(self.curve, "stale_step", False) else 0

    def refuses(self, source: str | None = None) -> bool:
        """Whether the next call of the drafter ``source`` names must not draft (``_no_drafting``)."""
        return self._no_drafting(source) > 0

    def took(self, plan: DraftPlan) -> None:
        """A plan made ahead of the read (a guess ``ChainDrafter.commit`` runs) is the next call: its shape and
        tree are noted as used (not as chosen after a read: ``ShapeMemory.usual`` learns only from real choices, or
        the guesses, which take the usual shape, would only ever confirm themselves)."""
        self.shapes.note(len(plan.drafts), plan.branches)
        if plan.strands:
            self.shapes.note_tree(len(plan.drafts), plan.branches, plan.strands)

    def survive(self, k: int, r: float | None = None) -> float:
        """P(at least ``k`` drafts of a fresh branch stand): the prior, scaled by the ratio ``r`` (default the
        calibration's) once per draft."""
        s = self.survival[k] if k < len(self.survival) else 0.0
        r = self.ratio if r is None else r
        return min(1.0, s * r**k)  # k drafts in a row: the per-draft ratio k times

    def rows_for(
        self,
        drafts: list[int],
        confidences: list[float],
        remaining: int,
        room: int,
        step: str = "fused",
        offers: Sequence[StrandOffer] = (),
        pending: DraftPlan | None = None,
        preview: bool = False,
        candidates: SlotCandidates | None = None,
        source: str | None = None,
    ) -> DraftPlan:
        """The whole choice of rows for the next call, fitted to ``remaining`` tokens and ``room`` rows.

        ``step="simple"`` alternates a drafting call (one branch) and a verifying call (no branch). ``offers``:
        side strands peers offer (``drafting/strands.py``), verified beside the chain as a token tree when the
        expected tokens they add are worth their rows at this machine's cost. ``pending``: the shape already built
        for this call (a chained call, ``decode/pipeline.py``), preferred as a known shape that costs no host time.
        ``preview``: the choice only (no exploring call, nothing noted): what ``ChainDrafter.guess`` asks.
        ``candidates``: the adapter's top tokens per slot of the drafts in hand (``topk_tree``): the token tree
        beside the chain whose rows pay (a chained call is given up for it only when the tree is worth more than
        the host time the chained call saves). ``source``: whose drafts (``DraftPlan.source``). Prompt lookup's are
        judged by their own calls' pace (``_guard``); for the adapter's ("ptp": a branch of the call before) the
        shape chosen is remembered by how many were in hand, and a preview (a guess ahead of the read, which has
        not seen their confidences) takes the shape usually chosen then (``ShapeMemory.usual``).
        """
        room = min(room, self.max_rows)
        burst = self._no_drafting(source)
        own = source == ADAPTER
        if burst:
            return DraftPlan([], [], burst=min(burst, remaining))
        trees = candidates is not None and step == "fused" and remaining >= 2  # (a preview's rows leave it room)
        if step == "simple":
            n, branches = simple_rows(drafts, self.max_width, remaining, room)
        else:
            tree = tree_nodes(self, confidences, candidates, remaining) if trees else None
            n, branches = self.choose(confidences, room, tree=tree)
            n, branches = fit_rows(min(n, len(drafts)), branches, remaining, room, 2)
            first = n, branches  # (the allocation with rows left for a tree)
            usual = self.shapes.usual(len(drafts)) if own and preview else None
            if usual is not None and self._fits(usual[0], usual[1], n, len(drafts), remaining, room):
                n, branches = usual[0], list(usual[1])
            if n or branches or pending is not None:  # a shape used before, unless a new one is worth its tracing
                n, branches = self._known(n, branches, len(drafts), confidences, remaining, room, pending)
        if n == 0 and not branches:
            if preview:
                return DraftPlan([], [], burst=min(self.burst_len, remaining))
            explore = self._explore(drafts, confidences, remaining, room) if step == "fused" else None
            if explore is not None:
                return explore
            return DraftPlan([], [], burst=min(self.burst_len, remaining))  # (only a calibrating budget backs off)
        plan = DraftPlan(drafts[:n], branches)
        if preview and not trees:
            return plan
        if step == "fused" and not preview:
            self.shapes.note(n, branches)
        chained = pending is not None and (n, tuple(branches)) == (len(pending.drafts), pending.branches)
        if (offers or candidates) and step == "fused" and remaining >= 2:
            alt = DraftPlan(drafts[: first[0]], first[1]) if trees and first != (n, branches) else None
            plan = tree_call(
                self, plan, confidences, offers, remaining, room, candidates, chained, alt, pending, preview
            )
        if own and not preview and step == "fused":
            self.shapes.note_after(len(drafts), len(plan.drafts), plan.branches)
        return plan

    @staticmethod
    def _fits(k: int, br, n: int, in_hand: int, remaining: int, room: int) -> bool:
        """Whether shape ``(k, br)`` may stand in for the choice of ``n`` drafts: within the drafts in hand and the
        rows left. A shape that verifies none of the drafts worth verifying (a priming call) is no substitute: its
        branch's value is the next call's verifying, which would again prefer the priming shape, and drafts were
        never verified (measured: an answer of priming calls only, at plain decoding's pace)."""
        if k > in_hand or (n >= 1 and k == 0):
            return False
        widths = [w for _, w in br]
        if k < remaining and 1 + k + sum(widths) <= room and max(widths, default=0) <= remaining - k + 1:
            return True  # (what ``fit_rows`` would leave unchanged, told without building its lists)
        return fit_rows(k, list(br), remaining, room, 2) == (k, list(br))

    def _known(self, n: int, branches, in_hand: int, confidences, remaining: int, room: int, pending=None):
        def fits(k: int, br) -> bool:
            return self._fits(k, br, n, in_hand, remaining, room)

        built = (len(pending.drafts), tuple(pending.branches)) if pending is not None else None
        p = reach(confidences, self.ratio)
        k, br = self.shapes.prefer(n, branches, p, self.survive, self.curve, fits, built)
        return k, list(br)

    def prior_confidences(self, n: int) -> list[float]:
        """Per-draft confidences the prior expects of a fresh branch's first ``n`` drafts (``survival``): what a
        guess ahead of the read prices drafts it has not seen by."""
        return [min(0.99, self.survive(k + 1, 1.0) / max(self.survive(k, 1.0), 1e-9)) for k in range(n)]

    def _explore(self, drafts: list[int], confidences: list[float], remaining: int, room: int) -> DraftPlan | None:
        """Once per burst, the call the budget would make if the widths it has barely measured were cheap
        (``LearnedCost.optimistic``), when it uses such a width: measuring it corrects a curve that is too
        pessimistic, which would otherwise never be drafted against and never corrected."""
        optimistic = getattr(self.curve, "optimistic", None)
        if not (self.calibrate and self.explore_due and optimistic):
            return None
        self.explore_due = False
        n, branches = self.choose(confidences, room, cost=optimistic)
        n, branches = fit_rows(min(n, len(drafts)), branches, remaining, room, 2)
        plan = DraftPlan(drafts[:n], branches)
        if (n or branches) and not self.curve.explored(plan.rows):
            return plan
        return None

    def choose(self, confidences: list[float], room: int, cost=None, tree=None) -> tuple[int, list[tuple[int, int]]]:
        """Drafts to verify and ``[(d, width), ...]`` branches, within ``room`` rows in total, at ``cost`` (a call's
        price by rows; default this budget's curve). ``tree(n)``: the chances of a token tree's nodes beside a chain
        of ``n`` drafts, best first; a node competes with branch rows for the call's rows (the rows it wins are left
        free for ``tree_budget.tree_call``)."""
        cost = cost or self.curve
        r = self.ratio
        p_reach = reach(confidences, r)
        n = sum(1 for x in p_reach[1:] if x >= self.min_prob)
        rows = 1 + n
        if rows > room:
            n = max(0, room - 1)
            rows = 1 + n
        value = 1.0 + sum(p_reach[1 : n + 1])
        # (plain floats and tables made once: this runs after every read, on the host's critical path)
        p = p_reach[: n + 1]
        p_end = [p[d] - (p[d + 1] if d < n else 0.0) for d in range(n + 1)]  # P(c == d)
        s_tab = [self.survive(k, r) for k in range(self.max_width + 1)]
        widths = [0] * (n + 1)
        top = min(room, self.max_rows)
        nodes, k = (tree(n) if tree is not None else []), 0
        # Greedy allocation: add the row with the best marginal value while it improves value per cost.
        while True:
            best, best_d, best_add = 0.0, -1, 0
            for d in range(n + 1):
                w = widths[d]
                if w >= self.max_width:
                    continue
                # a branch's first slot is the exact token: it needs two rows to draft
                per_row = p_end[d] * s_tab[1] / 2 if w == 0 else p_end[d] * s_tab[w]
                if per_row > best:
                    best, best_d, best_add = per_row, d, 2 if w == 0 else 1
            if k < len(nodes) and nodes[k] > best:  # a tree node is worth more than any branch row
                if rows + 1 > top or (value + nodes[k]) / cost(rows + 1) < value / cost(rows):
                    break
                value, rows, k = value + nodes[k], rows + 1, k + 1
                continue
            if best_d < 0 or rows + best_add > top:
                break
            new_value = value + best * best_add
            if new_value / cost(rows + best_add) < value / cost(rows):
                break
            widths[best_d] += best_add
            rows += best_add
            value = new_value
        return n, [(d, w) for d, w in enumerate(widths) if w > 0]
