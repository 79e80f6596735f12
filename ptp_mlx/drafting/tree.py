"""Token trees from the adapter's drafts (docs/method.md, section 5, "Token trees"): the chain, plus a tree of the
adapter's top tokens per slot (``topk_tree``), which the budget verifies where its rows pay."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from .chain import ChainDrafter
from .protocol import CallResult, DraftPlan, chain_accepted
from .rows import rank_u_factors, reach
from .strands import TreeCosts
from .topk_tree import SlotCandidates, tree_value

_RANKS = 8  # a placeholder token of a tree built ahead: slot * _RANKS + rank (``guess``)
_FADE = 0.95  # how much of its running mean a rank's prior probability keeps per read


class TreeDrafter(ChainDrafter):
    """The chain drafter that also keeps the auxiliary runner-ups of every draft in hand and offers the top tokens
    of each slot to the budget (``candidates``), which may verify a tree of them beside the chain."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.alts: list[list[tuple[int, float]]] = []  # runner-ups of each draft in hand, best first, with probs
        # per slot of a branch (its drafts: slot 1 first), the running mean probability of each runner-up rank:
        # what a tree built ahead of the read is priced by (``guess``)
        self.rank_prob: list[list[float]] = []
        self.priced: SlotCandidates | None = None  # the candidates the last plan was priced with (unscaled)

    @property
    def runner_up(self) -> bool:
        return self.greedy or self.uniforms is not None  # (its tree: greedy, or sampling in probability order)

    def candidates(self, i: int) -> SlotCandidates | None:
        # Greedy decoding, or sampling in probability order, where each slot's uniform is known and prices the
        # ranks (``rank_u_factors``). Sampling in id order, no tree: the adapter's probabilities at T 1, blind to
        # the uniforms, mispriced it (measured on held-out prompts at T 0.7 before the uniforms priced it: the tree
        # took rows from the branches, PTP fell from 1.09x to 0.98x our AR; docs/results/trees/topk/).
        if not self.runner_up or not self.alts or len(self.alts) != len(self.drafts):
            return None
        conf = self.confidences(i)  # (sharpened by their uniforms where sampling in probability order)
        probs = [tuple(q for _, q in a) for a in self.alts]
        if self.uniforms is not None:
            if len(self.top_prob) != len(self.drafts):
                return None
            us = self.uniforms.take(i + 1, len(self.drafts))
            probs = [
                tuple(q * f for q, f in zip(a, rank_u_factors(float(u), m, [c0, *a], self.temperature), strict=True))
                for a, u, m, c0 in zip(probs, us, self.top_prob, self.conf, strict=True)
            ]
        tokens = tuple((d, *(t for t, _ in a)) for d, a in zip(self.drafts, self.alts, strict=True))
        self.priced = SlotCandidates(tokens, tuple((c, *a) for c, a in zip(conf, probs, strict=True)))
        k = self.budget.tree_ratio
        return SlotCandidates(tokens, tuple((c, *(q * k for q in a)) for c, a in zip(conf, probs, strict=True)))

    def prior_candidates(self, conf: list[float]) -> SlotCandidates | None:
        # Slot j's token of rank k is the placeholder j * _RANKS + k (``guess`` maps it to its auxiliary row).
        if not self.runner_up or len(self.rank_prob) < len(conf) or not conf:
            return None  # (runner-ups not seen yet at every slot)
        n, k = len(conf), self.budget.tree_ratio
        return SlotCandidates(
            tuple(tuple(j * _RANKS + r for r in range(1 + len(self.rank_prob[j]))) for j in range(n)),
            tuple((conf[j], *(q * k for q in self.rank_prob[j])) for j in range(n)),
        )

    def strand_sources(self, plan: DraftPlan, row: int) -> tuple[tuple[int, int], ...] | None:
        # A guessed tree's placeholder ``j * _RANKS + k``: rank k of the branch's slot j + 1, auxiliary row
        # ``row + 1 + j`` of the call before (``prior_candidates``).
        return tuple((row + 1 + t // _RANKS, t % _RANKS) for st in plan.strands for t in st.tokens)

    def commit(self, plan: DraftPlan, i: int) -> DraftPlan | None:
        out = super().commit(plan, i)
        if out is not None and out.strands:
            # (the committed tree's tokens priced as a plan prices them, for ``_calibrate``: once it is queued)
            self.later.append(partial(self.candidates, i))
        return out

    def update(self, plan: DraftPlan, result: CallResult) -> None:
        self.catch_up()  # (what the read before put off comes first)
        later = None
        if plan.source in (None, "ptp") and any(st.source == "ptp" for st in plan.strands) and self.priced is not None:
            # (once the next call is queued: 0.05-0.07 ms of a 64-row tree's read on the critical path here; what it
            # reads is taken now, and nothing before then reads what it changes, ``tree_ratio``)
            n = len(plan.drafts)
            later = partial(self._calibrate, plan, result, self.priced, self.planned[:n], self.budget.ratio)
        self.priced = None
        super().update(plan, result)
        if later is not None:
            self.later.append(later)

    def _calibrate(
        self, plan: DraftPlan, result: CallResult, cands: SlotCandidates, planned: list[float], ratio: float
    ) -> None:
        """Fold one verified tree into the budget's ``tree_ratio``: its nodes' chances as they were priced (before
        that ratio; ``planned``: the chain's confidences, ``ratio``: the budget's acceptance ratio, both as the read
        found them) against the adapter's tree tokens that stood on the path."""
        n = len(plan.drafts)
        p = reach(planned, ratio)
        # (another peer's strand: no chance of its own here, and its tokens no hits)
        mine = tuple(st if st.source == "ptp" else replace(st, tokens=(-1,) * len(st.tokens)) for st in plan.strands)
        none = TreeCosts(lambda r: 1.0, lambda w: 0.0, 0, 0, 0)
        expected = tree_value(n, p, cands, ratio, mine, none)
        hits, s = 0, result.strand
        if s is not None and all(plan.strands[k].source == "ptp" for k in _lineage(plan, s)):
            hits = result.accepted - chain_accepted(plan, result)
        self.budget.observe_tree(expected, hits)

    def _took(self, result: CallResult, rows: tuple[int, int] | None) -> None:
        self.alts = []
        if rows is not None and result.alts and rows[1] > 1:
            r, w = rows
            self.alts = [list(a) for a in result.alts[r + 1 : r + w]]
            for j, a in enumerate(self.alts):
                probs = [q for _, q in a]
                if j >= len(self.rank_prob):
                    self.rank_prob.append(probs)
                elif len(probs) == len(self.rank_prob[j]):
                    self.rank_prob[j] = [
                        _FADE * m + (1 - _FADE) * q for m, q in zip(self.rank_prob[j], probs, strict=True)
                    ]


def _lineage(plan: DraftPlan, s: int) -> list[int]:
    """Strand ``s`` and the strands it hangs from, up to the chain."""
    out = [s]
    while plan.strands[out[-1]].parent >= 0:
        out.append(plan.strands[out[-1]].parent)
    return out
