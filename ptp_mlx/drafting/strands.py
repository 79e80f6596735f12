"""Which side strands other peers offer a call's token tree beside its chain (docs/method.md, section 5, "Token
trees"; the adapter's own top-k tree is ``topk_tree``).

Peers offer strands (``StrandOffer``): a prompt-lookup continuation beside the adapter's chain, the adapter's chain
beside a lookup chain, or lookup's other continuations of the same words (``DraftPolicy``). A strand at ``at`` can
only take the path on where the chain stops there: its value is the chance the chain reaches row ``at`` and its
draft ``q_{at+1}`` falls while the strand's first token is the exact one, times the tokens it then adds.
``choose_strands`` keeps the offers whose rows pay at the budget's cost, best first, as the budget's greedy
allocation does for branches: a node is worth the probability of reaching it.

What the PTP coupling allows: every row of the tree is verified exactly (its token against the exact pick at its
parent with the uniform of its position), so any strand may stand and the accepted path is always the exact
sample. A lookup continuation carries its own text, so it may be several tokens long; only a strand's own window
(rows that see its path) drafts the next call after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .protocol import Strand

MAX_STRANDS = 4  # side strands per call (the menu of tree shapes stays small: the compile bank's entries)
MAX_STRAND_TOKENS = 7  # tokens per strand


@dataclass(frozen=True)
class StrandOffer:
    """A strand a peer offers: ``tokens`` after the chain's row ``at``, each with the chance ``hits[k]`` that it
    stands given the path before it did (calibrated by the offering peer), and who offers it."""

    at: int
    tokens: tuple[int, ...]
    hits: tuple[float, ...]
    source: str

    def aligned(self, drafts: Sequence[int]) -> StrandOffer | None:
        """The same offer hung where it leaves the chain ``drafts`` (tokens it shares with the chain are the chain's
        rows already), or None when nothing is left of it."""
        at, k = self.at, 0
        while at + k < len(drafts) and k < len(self.tokens) and self.tokens[k] == drafts[at + k]:
            k += 1
        if k == len(self.tokens):
            return None
        return StrandOffer(at + k, self.tokens[k:], self.hits[k:], self.source)


@dataclass(frozen=True)
class TreeCosts:
    """What ``choose_strands`` weighs offers by: ``cost(rows)`` (a call's price in plain steps), ``window(w)`` (the
    next call's expected accepted drafts from a ``w``-row window that follows a path which stood), the widest
    window, and the rows and tokens left."""

    cost: Callable[[int], float]
    window: Callable[[int], float]
    max_width: int
    room: int
    remaining: int


def choose_strands(
    drafts: Sequence[int],
    p_reach: Sequence[float],
    value: float,
    rows: int,
    offers: Sequence[StrandOffer],
    c: TreeCosts,
    taken: set[tuple[int, int]] = frozenset(),
) -> tuple[Strand, ...]:
    """The strands worth verifying beside a chain of ``drafts`` (``p_reach[m]``: P(at least m of them stand),
    calibrated) in a call of ``rows`` rows whose expected tokens are ``value``: each offer's best length and
    window, kept while expected tokens per cost rise, best offers first. ``taken``: ``(at, first token)`` of
    strands the call already has off the chain (the adapter's tree)."""
    n = len(drafts)
    firsts: set[tuple[int, int]] = set(taken)
    scored = []
    for offer in offers:
        o = offer.aligned(drafts)
        if o is None or o.at > n or (o.at, o.tokens[0]) in firsts:
            continue
        firsts.add((o.at, o.tokens[0]))
        # P(the chain ends at row ``at`` and the strand's first token is the exact one there)
        p_stop = 1.0 - (p_reach[o.at + 1] / p_reach[o.at] if o.at < n and p_reach[o.at] > 0 else 0.0)
        p_first = float(p_reach[o.at]) * min(p_stop, float(o.hits[0]))
        if p_first > 0:
            scored.append((p_first, o))
    scored.sort(key=lambda x: -x[0])
    chosen: list[Strand] = []
    for p_first, o in scored:
        if len(chosen) >= MAX_STRANDS:
            break
        best = _best_strand(o, p_first, value, rows, c)
        if best is not None:
            strand, gain = best
            chosen.append(strand)
            value, rows = value + gain, rows + strand.rows
    return tuple(sorted(chosen, key=lambda st: st.at))  # (laid out by row: fewer distinct tree shapes)


def _best_strand(o: StrandOffer, p_first: float, value: float, rows: int, c: TreeCosts):
    """``(Strand, expected tokens it adds)`` with the length and window that give the best tokens per cost, or None
    when no length beats the call without it."""
    best, best_score = None, value / c.cost(rows)
    most = min(len(o.tokens), MAX_STRAND_TOKENS, c.remaining - 1 - o.at, c.room - rows)
    # No length pays when even every token standing, with the widest window, at one more row's price does not
    # (prices never fall with rows): the common case where rows are dear, told in one comparison.
    if most < 1 or (value + p_first * (most + c.window(c.max_width))) / c.cost(rows + 1) <= best_score:
        return None
    p_all, gain = p_first, 0.0
    for k in range(1, most + 1):
        if k > 1:
            p_all *= float(o.hits[k - 1])
        gain += p_all  # the k-th token stands (the path's tokens up to it did)
        for w in [0, *range(2, c.max_width + 1)]:
            if rows + k + w > c.room or o.at + k + w > c.remaining:
                break
            g = gain + (p_all * c.window(w) if w else 0.0)
            score = (value + g) / c.cost(rows + k + w)
            if score > best_score:
                best, best_score = (Strand(o.at, o.tokens[:k], w, o.source), g), score
    return best
