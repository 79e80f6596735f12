"""``--num-draft-tokens N``: the fixed budget, the same rows every call (docs/method.md, section 5), beside the
adaptive ``Budget`` of ``budget.py``; both implement ``BudgetPolicy`` (``budget_policy.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .cost import CostCurve
from .protocol import DraftPlan
from .rows import fit_rows, simple_rows
from .strands import StrandOffer


@dataclass
class FixedBudget:
    """``--num-draft-tokens N``: every call verifies up to ``N`` drafts and drafts ``N`` more for each possible
    outcome, so the next call has ``N`` drafts whatever is accepted. It never decodes autoregressive bursts."""

    num_draft: int
    max_width: int = 8
    curve: CostCurve = field(default_factory=CostCurve)  # (flat: a fixed budget does not weigh rows)
    calibrate: bool = False
    ratio: float = 1.0
    tree_ratio: float = 1.0
    burst_len: int = 0
    builds_trees: bool = False
    shape_only: bool = True  # the same rows whatever the drafts' confidences

    def __post_init__(self):
        if not 1 <= self.num_draft <= self.max_width - 1:
            raise ValueError(f"--num-draft-tokens must be between 1 and {self.max_width - 1} for this adapter")

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
        candidates=None,
        source: str | None = None,
    ) -> DraftPlan:
        k = self.num_draft  # (the same rows every call: ``pending`` is always its shape, ``preview`` changes nothing)
        if step == "simple":
            n, branches = simple_rows(drafts, k + 1, remaining, room)
        else:
            n = min(k, len(drafts))
            n, branches = fit_rows(n, [(d, k + 1) for d in range(n + 1)], remaining, room, 2)
        return DraftPlan(drafts[:n], branches)

    def observe(self, confidences: list[float], accepted: int) -> None:
        pass

    def observe_tree(self, expected: float, hits: float) -> None:
        pass

    def relax(self, keep: float = 0.5) -> None:
        pass

    def record(self, rows: int, tokens: int, seconds: float, cold: bool = False, source: str | None = None) -> None:
        pass  # (a fixed budget does not weigh rows)
