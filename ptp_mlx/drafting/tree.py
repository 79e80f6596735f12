"""Token trees from the adapter's drafts (docs/method.md, section 5, "Token trees"): the chain, plus the
runner-up of its first draft as a sibling strand when the budget finds its row worth the cost."""

from __future__ import annotations

from .chain import ChainDrafter
from .protocol import CallResult


class TreeDrafter(ChainDrafter):
    """The chain drafter that also keeps the auxiliary runner-up for the first draft and offers it to the
    budget, which may verify it beside ``q_1`` (``DraftPlan.alts``)."""

    second: tuple[int, float] | None = None  # runner-up of the first draft and its confidence

    @property
    def runner_up(self) -> bool:
        return True

    def _second(self) -> tuple[int, float] | None:
        return self.second

    def _took(self, result: CallResult, rows: tuple[int, int] | None) -> None:
        self.second = None
        if rows is not None and result.second and rows[1] > 1:
            self.second = result.second[rows[0] + 1]
