"""What the call queue learns about chained calls within an answer (``pipeline.py``): whether the host has time
for a second build while a call computes (``spare``), and how often the read confirms each kind of guess
(``Confirmed``), so the builds go to the outcomes likeliest to run them (docs/method.md, section 5)."""

from __future__ import annotations

import json
from pathlib import Path

from ..drafting.protocol import Guess
from ..paths import atomic_write_bytes

SPARE = 1.2  # a second build needs this many times a build's time left over while the call computes
FADE = 0.8  # the weight the running estimates (a build's time, the time left over, confirm counts) keep per call
CONFIRMED_PRIOR = 2.0  # pseudo-guesses at a rate of one half before a kind of guess has been judged


def fade(old: float | None, new: float) -> float:
    """A running estimate: ``new`` folded into ``old`` (None: none yet) at weight ``1 - FADE``."""
    return new if old is None else FADE * old + (1 - FADE) * new


def spare(left: float | None, build: float | None) -> bool:
    """Whether the host has time for another build while a call computes: ``left`` (seconds the read waited for
    the call after one build) at least ``SPARE`` times ``build`` (seconds a build takes). On a GPU the call's whole
    compute is left over; on a CPU the build shares the cores with the compute (on two cores, both busy), so a second
    build would mostly delay the read (nothing measured yet: no)."""
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
        return _rate(self.seen.get(key, (0.0, 0.0)))

    def weigh(self, source: str | None, guesses: list[Guess | None], likely: list[float] | None) -> list[float]:
        """Each outcome's chance (``likely``; None: all alike) times its guess's confirm rate."""
        return [
            (likely[g] if likely is not None and g < len(likely) else 1.0)
            * (self.rate((source, x.plan.source)) if x is not None else 1.0)
            for g, x in enumerate(guesses)
        ]

    def judge(self, source: str | None, guess: Guess, hit: bool) -> None:
        _judge(self.seen.setdefault((source, guess.plan.source), [0.0, 0.0]), hit)


def _rate(counts) -> float:
    """A confirm rate from fading counts ``[confirmed, judged]``: one half before any judgement."""
    return (counts[0] + 0.5 * CONFIRMED_PRIOR) / (counts[1] + CONFIRMED_PRIOR)


def _judge(counts: list[float], hit: bool) -> None:
    counts[0], counts[1] = FADE * counts[0] + hit, FADE * counts[1] + 1.0


EXPLORE = 16  # one call in this many is built the other way round than the choice, so both ways stay measured
LEARN = 4  # reads each way before the choice is made (until then the calls alternate)
SLOW_FADE = 0.9  # the weight ``ChainChoice``'s time estimates keep per sample (noisier than the per-answer ones)


NOISE = 2.0  # standard errors by which building ahead must be measured to pay before it is chosen
# A choice measured beyond ``CLEAR`` times that margin (either way) explores ``BACK_OFF`` times less often: where a
# device computes, a build ahead saves a call's whole host time and nearly always pays, and one call in 16 built
# after the read only to re-measure it cost the profile's prompt 6% of its chained calls (device-like simulation,
# docs/results/decode-floor/2026-12-07b/).
CLEAR = 4.0
BACK_OFF = 4


def _slow(old: float | None, new: float) -> float:
    return new if old is None else SLOW_FADE * old + (1 - SLOW_FADE) * new


class _Faded:
    """A running mean of noisy samples with its spread, each sample's weight fading by ``SLOW_FADE`` per sample."""

    def __init__(self) -> None:
        self.w = self.mean = self.m2 = 0.0

    def add(self, x: float) -> None:
        self.w = SLOW_FADE * self.w + 1.0
        d = x - self.mean
        self.mean += d / self.w
        self.m2 = SLOW_FADE * self.m2 + d * (x - self.mean)

    def var_of_mean(self) -> float:
        """The variance of ``mean`` (the samples' spread over the weight they carry)."""
        return max(self.m2, 0.0) / self.w**2 if self.w else 0.0

    def to_list(self) -> list[float]:
        return [self.w, self.mean, self.m2]

    def load(self, xs) -> None:
        self.w, self.mean, self.m2 = (float(x) for x in xs)


class ChainChoice:
    """Whether building the next call while this one computes pays on this machine, learnt from the calls' own
    times across answers (one per model: ``choice_for``). A build ahead saves, when the read confirms it, the build
    a call made after the read puts on the path (``saving``, measured on those builds); it costs what it adds
    before the read (``extra``: the build and the read's wait after it, less the wait of a read with nothing built,
    ``wait``), confirmed or not. So it pays when the confirm rate times ``saving`` beats ``extra``. On a GPU the
    build runs while the device computes (``extra`` about 0: it pays); on a CPU whose cores all compute, the build
    delays the compute by about its own time (2026-12-05, this 2-core machine: held-out greedy 3.7-5% faster
    without building ahead, three paired runs; 2026-12-06: 1-3% in four of five). Until both ways are measured, the
    calls alternate; then building ahead is chosen only where it is measured to pay beyond the noise of what was
    measured (``NOISE`` standard errors: per-call times on a busy CPU spread by more than the effect). Kept on
    disk beside the cost curve (``path``: ``PTP_MLX_HOME/cost-curves/chain-choice-<key>.json``, ``choice_at``), so
    a machine learns it once, not in every process: written back at the end of every answer that measured a read
    (``flush``, off the tokens' path)."""

    def __init__(self, path: Path | None = None) -> None:
        # seconds a read waits for a call of each kind (token rows, auxiliary rows, whether it was queued from a build
        # ahead: then before the turn's yield, so its read waits less) when nothing was built meanwhile
        # (per shape: the calls built ahead and the others are not the same mix of shapes, and one mean over both
        # made ``extra`` below nonsense, -3.4 ms on held-out prompts here, which turned building ahead on where it
        # lost 2-3%; per width alone still -0.4 to -1 ms: a lookup chain's token rows cost less than as many of the
        # adapter's auxiliary rows)
        self.wait: dict[tuple[int, int, bool], float] = {}
        self._extra = _Faded()  # seconds a build ahead adds before the read (build + wait - ``wait``)
        self._saving = _Faded()  # seconds a call built after the read spends building on the path
        self.judged = [0.0, 0.0]  # builds ahead the read confirmed, and judged (fading counts)
        self.calls = 0
        self.reads = [0, 0]  # reads measured with nothing built ahead, and after a build ahead
        self.forced: bool | None = None  # set: that choice, whatever is measured (``ptp-bench --free-rows``: a GPU's)
        self.path = path  # where it is kept (None: this process only)
        self.source = "new"  # or "kept" (read from ``path``)
        self._saved = 0  # the reads measured when last written

    def rate(self) -> float:
        """How often the read confirmed a build ahead (one half before any was judged)."""
        return _rate(self.judged)

    @property
    def extra(self) -> float | None:
        return self._extra.mean if self._extra.w else None

    @property
    def saving(self) -> float | None:
        return self._saving.mean if self._saving.w else None

    def pays(self) -> bool | None:
        """The choice as measured so far (None: not measured both ways yet): the confirm rate times ``saving`` beats
        ``extra`` by ``NOISE`` standard errors of that difference."""
        margin = self._margin()
        return None if margin is None else margin[0] > NOISE * margin[1]

    def _margin(self) -> tuple[float, float] | None:
        """What building ahead is measured to gain per call (seconds) and that figure's standard error; None
        until both ways are measured."""
        if min(self.reads) < LEARN or self.saving is None or self.extra is None:
            return None
        r = self.rate()
        noise = (self._extra.var_of_mean() + r * r * self._saving.var_of_mean()) ** 0.5
        return r * self.saving - self.extra, noise

    def use(self) -> bool:
        """Whether the next call is built ahead: the choice, the other way one call in ``EXPLORE`` (every other
        call while it is being learnt; ``BACK_OFF`` times less often where the choice is clear)."""
        self.calls += 1
        if self.forced is not None:
            return self.forced
        margin = self._margin()
        if margin is None:
            return self.calls % 2 == 1
        gain, noise = margin
        every = EXPLORE * (BACK_OFF if abs(gain) > CLEAR * NOISE * noise else 1)
        return (gain > NOISE * noise) != (self.calls % every == 0)

    def read_waited(self, seconds: float, built: float | None, kind: tuple = ()) -> None:
        """A read of a call of ``kind`` (token rows, auxiliary rows, queued from a build ahead) waited ``seconds``
        for it after ``built`` seconds of building ahead (None: none); compared with reads of that kind only."""
        if built is None:
            self.wait[kind] = _slow(self.wait.get(kind), seconds)
            self.reads[0] += 1
        elif kind in self.wait:
            self._extra.add(built + seconds - self.wait[kind])
            self.reads[1] += 1

    def built_on_path(self, seconds: float) -> None:
        self._saving.add(seconds)

    def judge(self, hit: bool) -> None:
        _judge(self.judged, hit)

    def describe(self) -> str:
        """One line for ``ptp-bench --profile``."""
        if self.forced is not None:
            return f"building ahead: {'on' if self.forced else 'off'} (set, not learnt)"
        on = self.pays()
        kept = f"; kept in {self.path}, read from it at the start" if self.source == "kept" else ""
        if on is None:
            return f"building ahead: being learnt (not measured both ways yet{kept})"
        return (
            f"building ahead: {'on' if on else 'off'} (learnt over {sum(self.reads)} reads: confirmed "
            f"{self.rate():.0%}, saves {1e3 * self.saving:.2f} ms when confirmed, adds {1e3 * self.extra:.2f} ms "
            f"before the read{kept})"
        )

    # -- on disk ---------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": 1,
            "wait": [[list(k), v] for k, v in self.wait.items()],
            "extra": self._extra.to_list(),
            "saving": self._saving.to_list(),
            "judged": list(self.judged),
            "reads": list(self.reads),
            "calls": self.calls,
            "choice": self.pays(),
        }

    def load(self, d: dict) -> None:
        """The measurements of ``to_dict`` (a file of another version or shape raises ``ValueError``)."""
        if d.get("version") != 1:
            raise ValueError("another version")
        self.wait = {tuple(k): float(v) for k, v in d["wait"]}  # (JSON keeps the kinds' ints and bools)
        self._extra.load(d["extra"])
        self._saving.load(d["saving"])
        self.judged = [float(x) for x in d["judged"]][:2]
        self.reads = [int(x) for x in d["reads"]][:2]
        self.calls = int(d["calls"])
        self.source, self._saved = "kept", sum(self.reads)

    def save(self) -> None:
        """Write the measurements to ``path`` (a temporary file, then a rename); a path that cannot be written
        leaves the choice in this process only (it is a cache, never required)."""
        try:
            atomic_write_bytes(self.path, json.dumps(self.to_dict()).encode())
        except Exception:  # (an unwritable PTP_MLX_HOME: OutputPathError, a full disk)
            self.path = None
            return
        self._saved = sum(self.reads)

    def flush(self) -> None:
        """At an answer's end: write the measurements back if it measured any read (a choice set is never kept)."""
        if self.path is not None and self.forced is None and sum(self.reads) != self._saved:
            self.save()


def choice_for(pm) -> ChainChoice:
    """The model's ``ChainChoice``, kept across answers (like its compile bank)."""
    return pm.__dict__.setdefault("_chain_choice", ChainChoice())


def choice_at(pm, path: Path, fresh: bool = False) -> ChainChoice:
    """The model's ``ChainChoice`` kept at ``path`` (the machine's, model's and adapter's cost-curve key): read from
    it unless ``fresh`` (``--recalibrate``) or unreadable, written back there as it learns."""
    choice = ChainChoice(Path(path))
    if not fresh and choice.path.exists():
        try:
            choice.load(json.loads(choice.path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            choice = ChainChoice(Path(path))  # (unreadable: learnt again, then written over)
    pm.__dict__["_chain_choice"] = choice
    return choice
