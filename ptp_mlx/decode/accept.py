"""Acceptance rules: ``exact`` (the default everywhere: a draft stands only if it is the exact sample) and opt-in
lenient rules that also accept a draft the verifying model finds likely enough (docs/method.md, section 4).

Under every rule each row is verified given the tokens before it in the block (the drafts, as fed), and the first
row whose draft is not accepted emits that row's exact pick. A lenient answer is not the model's exact sample for
its uniforms: it is labelled wherever it is shown.

- ``entropy``: accept draft ``x`` if ``p(x) >= max(floor, min(eps, delta * exp(-H)))``, with ``p`` and the entropy
  ``H`` of the verifying row (softmax at the sampling temperature, T 1 when greedy) (Medusa-2's typical acceptance; the PTP
  authors report 4.40 tokens per call at unchanged mean base-model probability on Vicuna-7B at T 0.7). In an
  uncertain row the bar ``delta * exp(-H)`` falls towards zero, so almost any draft would stand; ``floor`` (0 by
  default: the published rule) keeps a least probability every accepted draft needs;
- ``threshold``: accept ``x`` if ``p(x) >= tau``.

Either rule takes ``lookup=0``: prompt-lookup drafts (text copied from the prompt or the answer) are then verified
by the exact rule, and only the adapter's own drafts are accepted leniently (a copied span that the model would
not have continued that way is where a lenient rule changes what a passage question answers).

Either rule also takes a pivot guard for lookup drafts. A row split between two continuations the text offers (the
city a passage names for one person, or the one it names for another) is a "pivot": the choice is the answer, so it
is left to the exact rule; a row whose exact pick the text does not offer (a rephrasing of what lookup copies)
still takes the copy. ``pivot=1``: a lookup draft stands leniently only where the row's exact pick is neither a token
of the context (the prompt and the answer so far) nor a number (a token with a digit: a copied number in place of a
computed one, a sum's, changes the answer); ``pivot=2``: only where the context never has the row's own token
followed by that exact pick (the text offers the pick after the same token the draft was copied after) and the pick
is not a number. The
adapter's own drafts are not guarded (their calls are built ahead, before the tokens that would update the context
are known).

A threshold above 1 accepts nothing the exact rule does not: the strictest setting of each rule is exact decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

KINDS = ("exact", "entropy", "threshold")
DEFAULTS = {
    "entropy": {"eps": 0.3, "delta": 0.09, "floor": 0.0, "lookup": 1.0, "pivot": 0.0},
    "threshold": {"tau": 0.3, "lookup": 1.0, "pivot": 0.0},
}


@dataclass(frozen=True)
class AcceptRule:
    """One acceptance rule and its parameters (frozen: part of the compiled call's key)."""

    kind: str = "exact"
    eps: float = 0.3
    delta: float = 0.09
    floor: float = 0.0
    tau: float = 0.3
    lookup: float = 1.0  # 1: lookup drafts are accepted by the same rule; 0: by the exact rule only
    pivot: float = 0.0  # lookup drafts refused leniency where the context offers the exact pick: 1 as a token, 2 after
    # the row's own token (0: no guard)

    @property
    def lenient(self) -> bool:
        return self.kind != "exact"

    def for_source(self, source: str | None, strict: bool = False) -> AcceptRule:
        """The rule a call whose drafts come from ``source`` ("ptp", "lookup", ...) is verified under (the pivot
        guard is kept for lookup chains only: ``guarded``). ``strict`` (``DraftPlan.strict``): the drafts are a copy
        of an earlier turn of a chat, verified exactly under every rule (lookup offers the previous answer after
        the same template header, and the model's row finds it likely once the first words agree)."""
        if strict:
            return EXACT
        if source == "lookup":
            return EXACT if not self.lookup else self
        return replace(self, pivot=0.0) if self.pivot else self

    @property
    def guarded(self) -> bool:
        """Whether a call under this rule reads the context's tokens (``pivot``; ``offered`` of ``accepts``)."""
        return self.lenient and bool(self.pivot)

    @property
    def label(self) -> str:
        """How an answer decoded under this rule is labelled (``exact`` or ``lenient ...``)."""
        extra = ("" if self.lookup else " lookup=exact") + (
            f" pivot={self.pivot:g}" if self.pivot and self.lookup else ""
        )
        if self.kind == "entropy":
            floor = f" floor={self.floor:g}" if self.floor else ""
            return f"lenient entropy eps={self.eps:g} delta={self.delta:g}{floor}{extra}"
        if self.kind == "threshold":
            return f"lenient threshold tau={self.tau:g}{extra}"
        return "exact"

    @classmethod
    def parse(cls, text: str) -> AcceptRule:
        """``exact``, ``entropy``, ``entropy:eps=0.3,delta=0.09,floor=0.05``, ``threshold``, ``threshold:tau=0.2`` (or
        ``threshold:0.2``); either lenient rule also takes ``lookup=0`` and ``pivot=1`` or ``pivot=2``. Raises ``ValueError`` naming what is wrong."""
        kind, _, params = (text or "").strip().partition(":")
        kind = kind.strip().lower()
        if kind not in KINDS:
            raise ValueError(f"unknown acceptance rule {kind!r} (known: {', '.join(KINDS)})")
        if kind == "exact":
            if params.strip():
                raise ValueError("the exact rule takes no parameters")
            return cls()
        values, given = dict(DEFAULTS[kind]), set()
        for part in filter(None, (p.strip() for p in params.split(","))):
            name, eq, val = part.partition("=")
            if not eq and kind == "threshold":  # threshold:0.2
                name, val = "tau", name
            name = name.strip()
            if name not in values:
                raise ValueError(f"the {kind} rule has no parameter {name!r} (it has: {', '.join(values)})")
            if name in given:
                raise ValueError(f"{kind} rule: {name} is given twice")
            given.add(name)
            try:
                values[name] = float(val)
            except ValueError:
                raise ValueError(f"{kind} rule: {name} must be a number, got {val.strip()!r}") from None
            if not 0 <= values[name] < float("inf"):
                raise ValueError(f"{kind} rule: {name} must be a finite number >= 0, got {val.strip()!r}")
            if name == "lookup" and values[name] not in (0.0, 1.0):
                raise ValueError(f"{kind} rule: lookup must be 0 or 1, got {val.strip()!r}")
            if name == "pivot" and values[name] not in (0.0, 1.0, 2.0):
                raise ValueError(f"{kind} rule: pivot must be 0, 1 or 2, got {val.strip()!r}")
        return cls(kind, **values)

    def accepts(
        self,
        rows: mx.array,
        drafts: mx.array,
        temperature: float,
        picks: mx.array | None = None,
        offered: mx.array | None = None,
        inputs: mx.array | None = None,
    ) -> mx.array:
        """bool [n]: whether row ``j`` (logits [n, vocab], the verifying rows) accepts ``drafts[j]`` besides an
        exact match (a lenient rule's; the exact rule never calls it). A ``guarded`` rule also takes the rows'
        exact ``picks`` (int32 [n]), their own tokens ``inputs`` (int32 [n]: the token each row was fed) and
        ``offered`` (``ContextTokens.array``) and refuses a row whose pick the context offers."""
        ok = self._likely(rows, drafts, temperature)
        if self.guarded:
            if picks is None or offered is None or inputs is None:
                raise ValueError("a rule with a pivot guard needs the rows' exact picks, tokens and the context")
            hit = mx.take(offered, context_index(self.pivot, inputs, picks))
            if self.pivot == 2:  # or the pick is a number (the [vocab] table after the pairs' slots)
                hit = hit | mx.take(offered, picks.astype(mx.uint32) + mx.array(PAIR_TABLE, dtype=mx.uint32))
            ok = ok & ~hit
        return ok

    def _likely(self, rows: mx.array, drafts: mx.array, temperature: float) -> mx.array:
        t = temperature if temperature > 0 else 1.0
        x = rows.astype(mx.float32) / t
        logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        p = mx.exp(mx.take_along_axis(logp, drafts[:, None].astype(mx.int32), axis=-1)[:, 0])
        if self.kind == "threshold":
            return p >= self.tau
        probs = mx.exp(logp)
        entropy = -mx.sum(mx.where(probs > 0, probs * logp, 0.0), axis=-1)
        bar = mx.minimum(self.eps, self.delta * mx.exp(-entropy))
        return p >= (mx.maximum(bar, self.floor) if self.floor else bar)


EXACT = AcceptRule()
# The lenient rule to offer when a user asks for lenient acceptance without naming one (the chat's switch): the
# published entropy rule with the token guard on lookup drafts (README, "Lenient acceptance": inside exact decoding's
# task-accuracy interval on both task draws measured, where the pair guard was at its edge on one).
SUGGESTED = "entropy:pivot=1"
PAIR_TABLE = 1 << 18  # slots of the hashed table of token pairs (``pivot=2``): a few collisions in 260k slots
_MIX = 0x9E3779B1


def context_index(pivot: float, inputs, picks):
    """Where ``ContextTokens`` records the pick (``pivot=1``: its id) or the pair (row token, pick) (``pivot=2``: a
    hash into ``PAIR_TABLE`` slots), for mlx or numpy arrays alike (uint32 arithmetic, wrapping)."""
    if isinstance(picks, mx.array):
        if pivot == 1:
            return picks.astype(mx.uint32)
        mixed = inputs.astype(mx.uint32) * mx.array(_MIX, dtype=mx.uint32)
        return (mixed ^ picks.astype(mx.uint32)) & mx.array(PAIR_TABLE - 1, dtype=mx.uint32)
    picks = np.asarray(picks, dtype=np.uint32)
    if pivot == 1:
        return picks
    mixed = np.asarray(inputs, dtype=np.uint32) * np.uint32(_MIX)
    return (mixed ^ picks) & np.uint32(PAIR_TABLE - 1)
