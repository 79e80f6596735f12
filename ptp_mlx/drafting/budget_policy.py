"""``BudgetPolicy``: what a drafter asks of a budget (docs/method.md, section 5). The adaptive ``Budget``
(``budget.py``) and ``FixedBudget`` (``fixed_budget.py``) implement it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .cost import CostCurve
from .protocol import DraftPlan
from .strands import StrandOffer
from .topk_tree import SlotCandidates


class BudgetPolicy(Protocol):
    """What a drafter asks of a budget: rows per call, what calls cost, and what was observed."""

    curve: CostCurve  # relative cost of a call by rows
    calibrate: bool  # whether it learns from observed acceptance (and may turn to bursts)
    burst_len: int  # the next autoregressive burst's length
    builds_trees: bool  # whether ``rows_for`` weighs side strands (``offers``: a token tree)
    shape_only: bool  # whether ``rows_for`` depends only on how many drafts are in hand (not on their confidences)
    max_width: int

    @property
    def ratio(self) -> float:
        """Observed / predicted acceptance (1.0 when it does not calibrate)."""
        ...

    @property
    def tree_ratio(self) -> float:
        """Observed / predicted tokens of the adapter's trees (1.0 when it does not calibrate)."""
        ...

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
        """The rows of the next call for ``drafts`` in hand with ``confidences`` (``pending``: the shape built ahead
        for it; ``preview``: the choice without side effects; ``candidates``: the drafter's top tokens per slot, a
        token tree's nodes; ``source``: whose drafts, ``DraftPlan.source``: "ptp", the adapter's, a branch of the
        call before)."""
        ...

    def observe(self, confidences: list[float], accepted: int) -> None:
        """One call's verified drafts' confidences and how many leading ones stood."""
        ...

    def observe_tree(self, expected: float, hits: float) -> None:
        """One call's adapter tree: its tokens' predicted chances (summed) and how many stood."""
        ...

    def relax(self, keep: float = 0.5) -> None:
        """An autoregressive burst ran: fade the evidence."""
        ...

    def record(self, rows: int, tokens: int, seconds: float, cold: bool = False, source: str | None = None) -> None:
        """One call's measured wall time (``rows`` 1: a plain step) and the tokens it emitted (``cold``: it
        compiled a shape; ``source``: whose drafts the call verified, ``DraftPlan.source``)."""
        ...
