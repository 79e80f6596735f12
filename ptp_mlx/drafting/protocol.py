"""The drafting protocol: a ``DraftPlan`` per call, a ``CallResult`` back, and the ``Drafter`` lifecycle.

The lifecycle follows llama.cpp's speculative decoding: ``begin`` once per answer, then per PTP call ``plan``
(what to verify and which auxiliary branches to draft) and ``update`` (learn from what the call settled), and
``emitted`` for every block the answer gains (autoregressive bursts included). The decoding loop talks to
drafters only through this protocol.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..sampler import SamplingSettings, UniformStream


@dataclass(frozen=True)
class Strand:
    """A side strand of a token tree: ``tokens`` verified one after another, the first following the row at depth
    ``at`` (the number of drafts on the path to it) of the chain (``parent`` -1; ``at`` 0: the last accepted token,
    ``d``: draft ``q_d``) or of an earlier strand (``parent``: its index in ``DraftPlan.strands``), beside what
    that line has next; each next token follows the one before. ``width`` auxiliary rows after its last token (0:
    none) draft the next call's tokens when all of it stands. ``source``: who offered it ("ptp": the adapter's
    runner-ups, "lookup": a prompt-lookup continuation)."""

    at: int
    tokens: tuple[int, ...]
    width: int = 0
    source: str = "ptp"
    parent: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        if not self.tokens or self.at < 0 or self.width < 0 or self.parent < -1:
            raise ValueError("a strand has at least one token, at >= 0, width >= 0 and parent >= -1")

    @classmethod
    def trusted(cls, at: int, tokens: tuple[int, ...], width: int = 0, source: str = "ptp", parent: int = -1):
        """A strand from values already checked (a tree's layout: ints in a tuple, ``at`` and ``parent`` in range),
        without ``__post_init__``'s conversion and checks (``topk_tree.layout``: the trees the budget weighs, many a
        call where rows are cheap)."""
        st = object.__new__(cls)
        st.__dict__.update(at=at, tokens=tokens, width=width, source=source, parent=parent)
        return st

    @property
    def rows(self) -> int:
        return len(self.tokens) + self.width

    @property
    def depth(self) -> int:
        """Drafts on the path to its last token (its window's branch depth)."""
        return self.at + len(self.tokens)


@dataclass(frozen=True)
class DraftPlan:
    """The rows of one PTP call: verify ``drafts`` (a prefix of those in hand) and draft ``branches``
    ``((d, width), ...)`` (branch d assumes d drafts accepted). ``burst > 0`` means: decode that many tokens
    autoregressively instead (drafting does not pay).

    Frozen, its sequences stored as tuples: a plan is made once (by a drafter, or ``dataclasses.replace`` of
    another) and read by everyone after, so no party can change what another planned."""

    drafts: tuple[int, ...]
    branches: tuple[tuple[int, int], ...]
    burst: int = 0
    source: str | None = None  # who proposed the drafts: "ptp" (the adapter) or "lookup" (prompt lookup)
    # True: the drafts are verified by the exact rule whatever the answer's rule (a lookup chain copied from an
    # earlier turn of a chat: a lenient rule would let the previous answer stand for this one's)
    strict: bool = False
    # Token tree: side strands beside the chain (``Strand``), verified in the same call, each with its own
    # auxiliary branch (or none) for the drafts after it.
    strands: tuple[Strand, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafts", tuple(self.drafts))
        object.__setattr__(self, "branches", tuple((int(d), int(w)) for d, w in self.branches))
        object.__setattr__(self, "strands", tuple(self.strands))
        for k, st in enumerate(self.strands):
            if st.parent == -1 and st.at > len(self.drafts):
                raise ValueError("a strand follows a row of the chain (at <= number of drafts)")
            if st.parent >= k or (
                st.parent >= 0 and not self.strands[st.parent].at < st.at <= self.strands[st.parent].depth
            ):
                raise ValueError("a strand follows a token of an earlier strand (parent's at < at <= its depth)")

    @property
    def rows(self) -> int:
        return 1 + len(self.drafts) + sum(w for _, w in self.branches) + sum(st.rows for st in self.strands)

    @property
    def tree(self) -> bool:
        return bool(self.strands)

    def strand_row(self, k: int) -> int:
        """The token row of strand ``k``'s first token (token rows: ``[last, drafts, strands in order]``)."""
        return 1 + len(self.drafts) + sum(len(st.tokens) for st in self.strands[:k])

    def follows(self, k: int) -> int:
        """The token row strand ``k``'s first token follows."""
        st = self.strands[k]
        if st.parent < 0:
            return st.at
        return self.strand_row(st.parent) + st.at - self.strands[st.parent].at - 1

    def root(self, k: int) -> int:
        """The strand that leaves the chain on the way to strand ``k`` (``k`` itself when it hangs off the chain)."""
        while self.strands[k].parent >= 0:
            k = self.strands[k].parent
        return k

    def path_drafts(self, k: int, m: int) -> list[int]:
        """The tokens after ``last`` on the path through strand ``k``'s first ``m`` tokens."""
        st = self.strands[k]
        before = (
            list(self.drafts[: st.at])
            if st.parent < 0
            else self.path_drafts(st.parent, st.at - self.strands[st.parent].at)
        )
        return before + list(st.tokens[:m])

    def branch_rows(self, accepted: int, strand: int | None = None) -> tuple[int, int] | None:
        """``(first auxiliary row, width)`` of the rows that draft the next call after the path that stood
        (``accepted`` drafts of the chain, or, with ``strand``, that many drafts on the path through that strand),
        or None; the drafts are its rows 1.. (row 0 guessed the token the call emits). The path's own branch
        where it has one (the chain's at depth ``accepted``, a strand's when the whole strand stood), else the
        rows of a chain branch it passed that follow the emitted block (``moved_branch``). Auxiliary rows are laid
        out as the chain's branches in order, then each strand's branch."""
        r = 0
        for d, w in self.branches:
            if d == accepted and strand is None:
                return r, w
            r += w
        for k, st in enumerate(self.strands):
            if k == strand and st.width and accepted == st.depth:
                return r, st.width
            r += st.width
        moved = self.moved_branch(accepted, strand)
        if moved is None:
            return None
        r, w, d = moved
        return r + accepted - d, w - (accepted - d)

    def moved_branch(self, accepted: int, strand: int | None = None) -> tuple[int, int, int] | None:
        """For a path without a branch of its own: ``(first auxiliary row, width, depth)`` of the deepest chain
        branch at or above the depth where the path left the chain that still has rows past the block the call
        emits (``accepted + 1`` tokens), or None. Row ``s`` of a branch at depth ``d`` guesses position ``d + 1 +
        s`` from the context before its window and the uniforms, not from the tokens between, so its rows past the
        block guess the next tokens as its own path's would have (docs/method.md, section 5, "Branches after a
        strand"; measured there: taken whether or not its rows for the block guessed the block's tokens)."""
        left = accepted if strand is None else self.strands[self.root(strand)].at
        r, found = 0, None
        for d, w in self.branches:
            if d <= left and w - (accepted - d) >= 2 and (found is None or d > found[2]):
                found = (r, w, d)
            r += w
        return found


class RunnerUps(Sequence):
    """Each auxiliary row's runner-ups ``[(token, probability), ...]``, best first, made from the read's two lists
    only for the rows asked for (a drafter reads a branch's few rows of a call's many: pairing them all took
    0.03-0.05 ms a read of 64 rows on the critical path, on a CPU whose compute had pushed them out of the caches)."""

    __slots__ = ("_tokens", "_probs")

    def __init__(self, tokens: list[list[int]], probs: list[list[float]]):
        if len(tokens) != len(probs):
            raise ValueError("runner-ups: one list of probabilities per row of tokens")
        self._tokens, self._probs = tokens, probs

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [list(zip(t, q, strict=True)) for t, q in zip(self._tokens[k], self._probs[k], strict=True)]
        return list(zip(self._tokens[k], self._probs[k], strict=True))

    def token(self, row: int, rank: int) -> int:
        """Row ``row``'s runner-up of rank ``rank`` (1: the best after the argmax), -1 where there is none."""
        tokens = self._tokens[row] if row < len(self._tokens) else ()
        return tokens[rank - 1] if 0 < rank <= len(tokens) else -1

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"RunnerUps({list(self)!r})"


@dataclass
class CallResult:
    """What one PTP call settled: the emitted ``block``, the drafts it ``accepted`` (on the path that stood: the
    chain's, then strands'), the auxiliary rows' argmax and confidence, their runner-up tokens and confidences,
    and the index of the last strand the path took (None: the chain alone)."""

    block: list[int]
    accepted: int
    aux_tokens: list[int] = field(default_factory=list)
    aux_conf: list[float] = field(default_factory=list)
    # per auxiliary row, its runner-ups ``(token, probability)``, best first (the argmax excluded; ``RunnerUps``)
    alts: Sequence[list[tuple[int, float]]] = field(default_factory=list)
    strand: int | None = None
    aux_top_prob: list[float] | None = None  # each row's top probability at the decoding temperature
    logprobs: list | None = None  # the block's ``TokenLogprob``s when the answer's logits hook asks for them
    resolved: bool = False  # the emitted token was settled on the host (sampler.py ``resolve``), not in the call


def chain_accepted(plan: DraftPlan, result: CallResult) -> int:
    """How many of ``plan``'s chain drafts stood in ``result`` (a strand that took the path on starts where the
    chain fell)."""
    return result.accepted if result.strand is None else plan.strands[plan.root(result.strand)].at


@dataclass
class Guess:
    """The next call's rows as a drafter can tell them before the current call is read: ``plan`` and where its
    drafts come from: ``draft_rows``, the current call's auxiliary rows whose argmax tokens they are (the plan's
    drafts are then placeholders), or, with ``draft_rows`` None, the plan's own drafts (tokens the host already
    knows: a prompt-lookup continuation). ``strand_src``: for a token tree built ahead, each strand token's
    ``(auxiliary row, rank)`` in the current call (rank 0: the row's argmax, ``r``: its ``r``-th runner-up); the
    plan's strand tokens are then placeholders too."""

    plan: DraftPlan
    draft_rows: list[int] | None
    strand_src: tuple[tuple[int, int], ...] = ()
    # the plan for each token the current call may emit at this outcome (``Drafter.guess_by_token``: all of one
    # shape, ``plan`` one of them); the build picks the drafts by the token the call computes
    by_token: dict[int, DraftPlan] | None = None

    def drafts(self, aux_tokens: list[int]) -> tuple[int, ...]:
        """The guessed call's drafts once the current call's auxiliary argmax tokens are read."""
        if self.draft_rows is None:
            return tuple(self.plan.drafts)
        return tuple(aux_tokens[j] for j in self.draft_rows)

    def realize(self, result: CallResult) -> DraftPlan:
        """The guessed plan with the tokens the current call's read (``result``) put in its placeholders (by the
        token it emitted: drafts of -1, never a real plan's, where none was guessed for that token)."""
        if self.by_token is not None:
            nxt = self.by_token.get(result.block[-1])
            return nxt if nxt is not None else replace(self.plan, drafts=(-1,) * len(self.plan.drafts))
        drafts = self.drafts(result.aux_tokens)
        if not self.strand_src:
            return _with_tokens(self.plan, drafts, self.plan.strands)

        alts = result.alts
        if not isinstance(alts, RunnerUps):
            alts = RunnerUps([[t for t, _ in a] for a in alts], [[q for _, q in a] for a in alts])
        aux = result.aux_tokens
        flat = [aux[row] if rank == 0 else alts.token(row, rank) for row, rank in self.strand_src]  # (-1: none)
        # (the guessed tree's strands with their tokens put in: its layout was checked when it was made)
        strands, at = [], 0
        for st in self.plan.strands:
            m = len(st.tokens)
            strands.append(Strand.trusted(st.at, tuple(flat[at : at + m]), st.width, st.source, st.parent))
            at += m
        return _with_tokens(self.plan, drafts, tuple(strands))


def _with_tokens(plan: DraftPlan, drafts: tuple[int, ...], strands: tuple[Strand, ...]) -> DraftPlan:
    """``plan`` with its placeholders' tokens put in, without ``DraftPlan.__post_init__``'s conversion and checks:
    its layout was checked when the guess was made, and the tokens are ints in tuples (a read's lists). On the
    critical path after every read of a call built ahead."""
    new = object.__new__(DraftPlan)
    new.__dict__.update(plan.__dict__, drafts=drafts, strands=strands)
    return new


@dataclass
class DraftSession:
    """What a drafter learns when an answer starts: the prompt, the answer's uniforms and its sampling settings.
    ``turn_start``: where the prompt's current turn starts (a chat's last user message; 0: all of it is)."""

    prompt: list[int]
    uniforms: UniformStream
    settings: SamplingSettings
    turn_start: int = 0


class Drafter(ABC):
    """What a PTP call verifies. Subclass it: ``plan`` and ``update`` are abstract (a subclass without them cannot
    be constructed: ``TypeError`` names what is missing); the optional parts have defaults."""

    @property
    def runner_up(self) -> bool:
        """Whether calls should read each auxiliary row's runner-ups (``CallResult.alts``)."""
        return False

    @property
    def reads_top_prob(self) -> bool:
        """Whether calls should read each auxiliary row's top probability (``CallResult.aux_top_prob``)."""
        return False

    def begin(self, session: DraftSession) -> None:
        """A new answer starts (called once, before the first ``plan``)."""
        return None  # (optional: nothing to learn by default)

    @abstractmethod
    def plan(self, i: int, remaining: int, room: int) -> DraftPlan:
        """The next call's rows, for generated position ``i``, ``remaining`` tokens wanted and ``room`` rows
        left in the context."""

    @abstractmethod
    def update(self, plan: DraftPlan, result: CallResult) -> None:
        """Learn from the call that ran ``plan`` (the next drafts, acceptance statistics)."""

    def guess(self, plan: DraftPlan, accepted: int, i: int, remaining: int, room: int) -> Guess | None:
        """The plan this drafter will make after the call running ``plan`` accepts ``accepted`` drafts (the next
        call then starts at generated position ``i``, with ``remaining`` tokens wanted and ``room`` rows left), if
        it can tell before that call is read; None otherwise. Decoding builds the guessed call while the current
        one computes and queues it the moment the read confirms it (``ptp_mlx/decode/pipeline.py``)."""
        return None

    def guess_strand(
        self, plan: DraftPlan, strand: int, accepted: int, i: int, remaining: int, room: int
    ) -> Guess | None:
        """As ``guess``, after the path through ``plan``'s token tree ended in strand ``strand``, with ``accepted``
        drafts on it in all (``plan.strands[strand].at`` and the strand's tokens that stood). The call built for it
        moves the strands' K/V rows next to the chain's in its own graph."""
        return None

    def guess_by_token(self, plan: DraftPlan, accepted: int, i: int, remaining: int, room: int) -> Guess | None:
        """As ``guess``, for plans that depend on the exact token the call emits after ``accepted`` drafts (which
        only the call computes): a ``Guess`` whose ``by_token`` holds the plan for each token likely enough, all of
        one shape, or None. Built where the host has time to spare beside ``guess``'s build; the read tells which
        token came and whether its plan is the real one."""
        return None

    def guess_start(self, i: int, remaining: int, room: int) -> DraftPlan | None:
        """The plan of the call that follows an autoregressive burst (at generated position ``i``), told before
        the burst's last token is read, if this drafter can; None otherwise. It must need no token the host has
        not read (no drafts in hand: the burst moved past them). The call is built while that step computes and
        queued if ``plan`` then returns the same."""
        return None

    def likely(self, plan: DraftPlan) -> list[float] | None:
        """``P(c == g)`` for g = 0..len(plan.drafts): how likely the call running ``plan`` (the latest planned)
        accepts ``g`` drafts, as this drafter priced them; None: no idea. When the guessed next calls differ in
        shape by outcome, the one build ahead serves the likeliest shape."""
        return None

    def emitted(self, tokens: list[int]) -> None:
        """Tokens the answer gained (every block, autoregressive bursts included)."""
        return None  # (optional: nothing to keep by default)

    def chained(self, plan: DraftPlan | None) -> None:
        """The plan of the call already built for the outcome that happened (``decode/pipeline.py``; None: none):
        the next ``plan`` may prefer it, as it costs no host time on the path."""
        return None  # (optional: a drafter that cannot use it plans as ever)

    def commit(self, plan: DraftPlan, i: int) -> DraftPlan | None:
        """After a read, instead of ``plan``-ning: the call already built for the outcome that happened
        (``plan``: its plan as realized by the read; the call starts at generated position ``i``) runs as this
        drafter's next call, if the drafter would draft now at all; it notes the plan as its own and returns it.
        None: plan as ever (``chained``, then ``plan``). Committing keeps the planning off the path (the call is
        queued at once); every plan is lossless, so the tokens are the same either way."""
        return None  # (optional: a drafter that does not commit plans after every read)

    def catch_up(self) -> None:
        """Bookkeeping ``update`` and ``commit`` put off (calibrations no decision before the next call is queued
        reads): called once the next call is queued (``decode/ptp.py``, off the critical path where a device
        computes), or before it is planned, whichever comes first. It must not change what ``commit`` decides."""
        return None  # (optional: nothing put off by default)

    def timed(self, rows: int, tokens: int, seconds: float, cold: bool = False, source: str | None = None) -> None:
        """A call of ``rows`` rows (1: a plain step of a burst) emitted ``tokens`` in ``seconds`` of measured wall
        time (what a budget learns costs from). ``cold``: it ran (or followed) a shape not compiled yet, so its
        time holds tracing: no price of its width, but a cost the answer paid. ``source``: whose drafts the call
        verified (its plan's ``source``)."""
        return None  # (optional: nothing to learn by default)

    def ready(self) -> bool:
        """During an autoregressive burst: whether a draft worth a call is in hand (ends the burst early)."""
        return False
