"""Token trees from the adapter's drafts (docs/method.md, section 5, "Token trees"): the chain, plus a tree of the
adapter's top tokens per slot (``topk_tree``), which the budget verifies where its rows pay."""

from __future__ import annotations

from .chain import ChainDrafter
from .protocol import CallResult
from .topk_tree import SlotCandidates


class TreeDrafter(ChainDrafter):
    """The chain drafter that also keeps the auxiliary runner-ups of every draft in hand and offers the top tokens
    of each slot to the budget (``candidates``), which may verify a tree of them beside the chain."""

    alts: list[list[tuple[int, float]]] = []  # runner-ups of each draft in hand, best first, with probabilities

    @property
    def runner_up(self) -> bool:
        return self.greedy  # (its tree is greedy decoding's: ``candidates``)

    def candidates(self, i: int) -> SlotCandidates | None:
        # Greedy decoding only: sampling, a runner-up stands when the uniform of its slot falls in its bin, and the
        # adapter's probabilities at T 1 without the uniforms misprice the tree (measured on held-out prompts at
        # T 0.7: the tree took rows from the branches, PTP fell from 1.09x to 0.98x our AR;
        # docs/results/trees/topk/).
        if not self.greedy or not self.alts or len(self.alts) != len(self.drafts):
            return None
        conf = self.confidences(i)  # (sharpened by their uniforms where sampling in probability order)
        return SlotCandidates(
            tuple((d, *(t for t, _ in a)) for d, a in zip(self.drafts, self.alts, strict=True)),
            tuple((c, *(q for _, q in a)) for c, a in zip(conf, self.alts, strict=True)),
        )

    def _took(self, result: CallResult, rows: tuple[int, int] | None) -> None:
        self.alts = []
        if rows is not None and result.alts and rows[1] > 1:
            r, w = rows
            self.alts = [list(a) for a in result.alts[r + 1 : r + w]]
