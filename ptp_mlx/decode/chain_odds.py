"""What the call queue learns about chained calls within an answer (``pipeline.py``): whether the host has time
for a second build while a call computes (``spare``), and how often the read confirms each kind of guess
(``Confirmed``), so the builds go to the outcomes likeliest to run them (docs/method.md, section 5)."""

from __future__ import annotations

from ..drafting.protocol import Guess

SPARE = 1.2  # a second build needs this many times a build's time left over while the call computes
FADE = 0.8  # the weight the running estimates (a build's time, the time left over, confirm counts) keep per call
CONFIRMED_PRIOR = 2.0  # pseudo-guesses at a rate of one half before a kind of guess has been judged


def fade(old: float | None, new: float) -> float:
    """A running estimate: ``new`` folded into ``old`` (None: none yet) at weight ``1 - FADE``."""
    return new if old is None else FADE * old + (1 - FADE) * new


def spare(left: float | None, build: float | None) -> bool:
    """Whether the host has time for another build while a call computes: ``left`` (seconds the read waited for
    the call after one build) at least ``SPARE`` times ``build`` (seconds a build takes). On a GPU the call's whole
    compute is left over; on MLX's CPU backend ``async_eval`` returns near the end of the graph and the build shares
    the cores with the compute, so a second build would mostly delay the read (nothing measured yet: no)."""
    return left is not None and build is not None and left >= SPARE * build


class Confirmed:
    """How often the read confirmed guesses of each kind: ``(source of the call, source of the guessed plan)``, a
    faded count of the guesses judged (whether built or not: the read tells for every outcome that happened) and of
    those the drafter's real plan matched. After prompt lookup's chain falls, the adapter's guess is rarely the next
    call (lookup finds another match, or a burst follows), while the chain that continues the copied text is nearly
    always right when every draft stands; so the build goes to the outcomes likeliest to run it, not merely to
    happen."""

    def __init__(self) -> None:
        self.seen: dict[tuple, list[float]] = {}  # key -> [confirmed, judged]

    def rate(self, key: tuple) -> float:
        hit, n = self.seen.get(key, (0.0, 0.0))
        return (hit + 0.5 * CONFIRMED_PRIOR) / (n + CONFIRMED_PRIOR)

    def weigh(self, source: str | None, guesses: list[Guess | None], likely: list[float] | None) -> list[float]:
        """Each outcome's chance (``likely``; None: all alike) times its guess's confirm rate."""
        return [
            (likely[g] if likely is not None and g < len(likely) else 1.0)
            * (self.rate((source, x.plan.source)) if x is not None else 1.0)
            for g, x in enumerate(guesses)
        ]

    def judge(self, source: str | None, guess: Guess, hit: bool) -> None:
        entry = self.seen.setdefault((source, guess.plan.source), [0.0, 0.0])
        entry[0], entry[1] = FADE * entry[0] + hit, FADE * entry[1] + 1.0
