"""Small helpers of the budgets (``budget.py``, ``fixed_budget.py``) and the drafters: what drafting calls really
delivered (``Pace``), the chance that leading drafts stand (``reach``, ``u_factor``), and fitting a choice of rows
to the tokens and context left (``fit_rows``, ``simple_rows``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pace:
    """What drafting calls really delivered: tokens, and their cost in plain steps (the measured curve).

    Predictions can be optimistic (validation acceptance is higher than live acceptance); a drafter whose calls
    are ``behind`` plain decoding after a few of them should stop drafting for a while."""

    tokens: float = 0.0
    cost: float = 0.0
    calls: int = 0

    def add(self, tokens: float, cost: float) -> None:
        self.tokens += tokens
        self.cost += cost
        self.calls += 1

    def behind(self, min_calls: int = 3) -> bool:
        return self.calls >= min_calls and self.tokens < self.cost


def u_factor(u: float, mode: float) -> float:
    """How much a known uniform changes a draft's chance, sampling in probability order (the mode's bin is
    ``[0, mode)``): an adapter's draft is mostly the mode, right only when ``u`` lands in its bin. Measured on
    the held-out set with the shipped adapter (slot 1: right 58% of the time when ``u < mode``, 20% when not,
    3% when ``u > 2 mode``; docs/results/study/)."""
    if u < mode:
        return 1.4
    return 0.6 if u < 2 * mode else 0.1


def rank_u_factors(u: float, mode: float, probs: list[float], temperature: float) -> list[float]:
    """How much a known uniform changes each runner-up's chance, sampling in probability order: the adapter's own
    estimate of the verifier's bins is ``[c_r, c_r + m_r)`` for rank ``r`` (``mode``: its top probability at the
    decoding temperature; ``probs``: the argmax's then the runner-ups' probabilities at T 1, so ``m_r = mode *
    (probs[r] / probs[0]) ** (1 / T)``). Measured teacher-forced on development prompts at T 0.7
    (``docs/results/trees/sampled_oracle.py``): a runner-up whose estimated bin holds ``u`` stood about 1.8 times as
    often as its probability says (slot 1, rank 1: 24% against 13%), and one whose bin does not about 0.9 times."""
    out, lo = [], mode
    for q in probs[1:]:
        m = mode * (q / max(probs[0], 1e-30)) ** (1.0 / max(temperature, 1e-3))
        out.append(1.8 if lo <= u < lo + m else 0.9)
        lo += m
    return out


def reach(confidences: list[float], ratio: float = 1.0) -> list[float]:
    """P(at least m drafts accepted), m = 0..n, from the drafts' confidences scaled by ``ratio`` (plain floats: a
    few per call, priced after every read on the host's critical path)."""
    out = [1.0]
    for c in confidences:
        out.append(out[-1] * min(0.99, float(c) * ratio))
    return out


def fit_rows(n: int, branches: list[tuple[int, int]], remaining: int, room: int, min_width: int):
    """Clip a choice to the tokens still wanted and the rows the context has left."""
    n = max(0, min(n, remaining - 1, room - 1))
    used = 1 + n
    fitted = []
    for d, w in branches:
        if d > n:
            continue
        w = min(w, remaining - d + 1, room - used)
        if w >= min_width:
            fitted.append((d, w))
            used += w
    return n, fitted


def simple_rows(drafts: list[int], width: int, remaining: int, room: int) -> tuple[int, list[tuple[int, int]]]:
    """The rows of a ``step="simple"`` call, for either budget: a verifying call of the drafts in hand (no branch),
    or, without drafts, a drafting call of one ``width``-row branch."""
    n, branches = (len(drafts), []) if drafts else (0, [(0, width)])
    return fit_rows(n, branches, remaining, room, 1)
