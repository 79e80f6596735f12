"""Token trees from the adapter's drafts (docs/method.md, section 5, "Token trees"): the chain, plus the runner-up
of each draft in hand as a one-token side strand at its slot, which the budget verifies where its row pays."""

from __future__ import annotations

from .chain import ChainDrafter
from .protocol import CallResult
from .strands import StrandOffer


class TreeDrafter(ChainDrafter):
    """The chain drafter that also keeps the auxiliary runner-up of every draft in hand and offers each to the
    budget (``StrandOffer``), which may verify it beside the draft it could replace (``DraftPlan.strands``)."""

    seconds: list[tuple[int, float]] = []  # runner-up of each draft in hand and its confidence

    @property
    def runner_up(self) -> bool:
        return True

    def offers(self, i: int) -> list[StrandOffer]:
        r = self.budget.ratio
        return [StrandOffer(d, (tok,), (min(0.99, conf * r),), "ptp") for d, (tok, conf) in enumerate(self.seconds)]

    def _took(self, result: CallResult, rows: tuple[int, int] | None) -> None:
        self.seconds = []
        if rows is not None and result.second and rows[1] > 1:
            r, w = rows
            self.seconds = list(result.second[r + 1 : r + w])
