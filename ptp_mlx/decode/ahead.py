"""The next PTP call built before the host reads the one computing (chained calls: docs/method.md, section 5,
"Pipelined calls"; ``pipeline.py``'s ``CallQueue`` decides when): for every outcome of that call by kind
(``build_chained``; on an autoregressive burst's last step: ``after_burst.py``), then confirmed by the read
(``confirm_chained``) or dropped (``drop_chained``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from ..drafting.protocol import CallResult, Drafter, DraftPlan, Guess
from .call import ChainInputs, PendingCall, build_call, call_shape, call_uniforms
from .chain_odds import Confirmed
from .fixed import ALTS
from .release import park, prepare, restore
from .session import DecodeSession
from .shape import CallSpec
from .strand_paths import StrandPaths, strand_paths

# The chance a kind's outcomes need (``Drafter.likely``) for a build beside the likeliest (where time is spare:
# ``CallQueue``). Device-like simulation (docs/results/decode-floor/2026-12-06g/): 0.05 chains more calls than 0.15
# or 0.25 with no more host time on the path (an unused build is let go after the next call is queued: ``park``).
OTHER_KIND_MIN = 0.05
# The chance a build of plans by the token the call emits (``Drafter.guess_by_token``: lookup chains after an
# adapter call or a lookup chain cut short) needs, each outcome's weighed by how often such plans were the real
# next one after calls like it. Device-like simulation (docs/results/decode-floor/2026-12-07b/): 0.1 chains 82% of
# the default drafter's calls on held-out prompts (the profile's prompt 86%), 0.25 80-81%; the unused builds are
# let go after the next call is queued (``park``).
TOKEN_MIN = 0.1


@dataclass
class Build:
    """One build of the call after the one computing, for the outcomes of one kind (``guesses[g]``, None for the
    others), and the cache's state after it (None: the state the cache holds, the likeliest kind's build)."""

    call: PendingCall
    guesses: list[Guess | None]
    rows: int
    state: tuple | None
    cut: object | None = None  # its cut, prepared while the call before it computes (``release.prepare``)


@dataclass
class Chained:
    """The call after ``call``, built for each of its outcomes (``guesses[g]``: the drafter's plan when ``g``
    drafts stand; None where the answer ends first, or where ``others`` hold it). ``before``: the cache's state
    before the build."""

    call: PendingCall
    guesses: list[Guess | None]
    before: tuple | None
    rows: int
    token: mx.array | None = None  # the lazy token a call after a burst was built on
    others: list[Build] = field(default_factory=list)  # builds for outcomes of other kinds (compiled graphs only)
    every: list[Guess | None] = field(default_factory=list)  # each outcome's guess, built or not (``Confirmed``)
    by_token: list[Guess | None] = field(default_factory=list)  # each outcome's plans by token, built or not
    source: str | None = None  # the source of the call it was built after (``Confirmed``)
    # after a token tree: the outcome index of a path whose last strand is k, with ``accepted`` drafts on it, keyed
    # ``(k, accepted)``; outcomes 0..n are the chain's (``accepted`` drafts of it stood)
    strand_outcomes: dict[tuple[int, int], int] = field(default_factory=dict)
    cut: object | None = None  # the cut of ``call``, prepared while the call before it computes (``release.prepare``)

    def outcome(self, result: CallResult) -> int | None:
        """The index of ``result``'s outcome in the guesses (None: a path this build has no outcome for)."""
        if result.strand is None:
            return result.accepted
        return self.strand_outcomes.get((result.strand, result.accepted))

    def pick(self, outcome: int | None) -> Build | None:
        """The build of ``guess``'s plan for ``outcome`` (this one's own, its ``state`` None; or one of
        ``others``), or None where none was built for it."""
        return next((b for b in self.builds(outcome) if b.guesses[outcome].by_token is None), None)

    def builds(self, outcome: int | None) -> list[Build]:
        """Every build for ``outcome`` (an index of ``outcome``; None: none): ``pick``'s, then one by the token the
        call emits (``Drafter.guess_by_token``), if made."""
        if outcome is None:
            return []
        own = [Build(self.call, self.guesses, self.rows, None, self.cut)] if self.guesses[outcome] is not None else []
        return own + [o for o in self.others if o.guesses[outcome] is not None]

    def token_plan(self, result: CallResult) -> DraftPlan | None:
        """The plan built ahead for the token ``result`` emitted (``Drafter.guess_by_token``), or None."""
        for b in self.builds(result.accepted) if result.strand is None else ():
            table = b.guesses[result.accepted].by_token
            if table is not None and result.block[-1] in table:
                return table[result.block[-1]]
        return None


def build_chained(
    sess: DecodeSession, drafter: Drafter, call: PendingCall, max_new: int, ctx: int, kinds: int = 1,
    confirmed: Confirmed | None = None,
) -> Chained | None:  # fmt: skip
    """Build the call after ``call`` (built, not read) for all its outcomes at once, or None where that does not
    apply: the eager pass (``CallPlan``, no compile bank), a logits hook, or a drafter that cannot tell any
    outcome's next call. Where outcomes' next calls differ in shape (``_kind``), one build per kind serves the
    likeliest kinds (``Drafter.likely``, each outcome's chance weighed by how often guesses like its own were
    confirmed after calls like this one: ``confirmed``): the likeliest's, and up to ``kinds - 1`` more whose
    outcomes are likely enough and whose graphs are compiled already (the unused builds are let go unrun).
    After a token tree, the outcomes include each path through its strands (``StrandPaths``): a build whose kind
    such a path's guess shares serves it too, moving the strands' K/V rows in its own graph; a path no build serves
    drops it (``CallQueue.read``: the rows then move on the host, in the state before this build)."""
    plan, cache = call.plan, sess.cache
    if sess.bank is None or sess.hook is not None:
        return None
    n = len(plan.drafts)
    guesses: list[Guess | None] = []
    by_token: list[Guess | None] = []
    for g in range(n + 1):
        i = call.i + 1 + g
        if i >= max_new:  # the answer ends with this outcome: no next call to build for it
            guesses.append(None)
            by_token.append(None)
            continue
        guess = drafter.guess(plan, g, i, max_new - i, ctx - (call.offset + 1 + g))
        if guess is not None and (guess.plan.burst or (guess.plan.strands and not guess.strand_src)):
            guess = None
        # (None: this outcome's next call is not known ahead; if it happens, the build is dropped)
        guesses.append(guess)
        # (time to spare: the plans that hang on the token the call emits, for a build of their own)
        by_token.append(
            drafter.guess_by_token(plan, g, i, max_new - i, ctx - (call.offset + 1 + g)) if kinds > 1 else None
        )
    # (time to spare: the paths through a tree's strands, each guessed, several milliseconds of host time where a
    # tree is wide)
    paths = strand_paths(drafter, call, max_new, ctx, guesses, by_token) if plan.strands and kinds > 1 else None
    chained, before = None, cache.snapshot()
    chance = drafter.likely(plan)
    if paths is not None and paths.outcomes:  # (a path through a strand joins a build of its kind, makes none)
        chance = (list(chance)[: n + 1] if chance is not None else [1.0] * (n + 1)) + [0.0] * len(paths.outcomes)
    likely = confirmed.weigh(plan.source, guesses, chance) if confirmed is not None else chance
    own = _by_kind(guesses, likely)
    # (the likeliest kind first, on the cache as it is; then the likeliest kind of plans by token, if likely
    # enough to be the real plan: an unused build costs its cut, made as it is built, ``release.prepare``)
    tokens = [] if confirmed is None else _by_kind(by_token, confirmed.weigh(plan.source, by_token, chance), TOKEN_MIN)
    order = own[:1] + tokens[:1] + own[1:]
    limit = kinds + (len(order) > len(own))
    # (time to spare: the kind most paths through the strands guess, of those no build above serves; its graph is
    # compiled as it is built if need be, as the likeliest kind's is)
    extra = _strand_kind(guesses, n, order[:limit]) if paths is not None and kinds > 1 else None
    if extra is not None:
        order, limit = [*order[:limit], extra], limit + 1
    for mine in order:
        if chained is not None and len(chained.others) + 1 >= limit:
            break
        if chained is None:  # (a build by token only where its graph is compiled: it may well go unused)
            built = _build_kind(sess, call, mine, n, compiled_only=all(mine is not k for k in own), paths=paths)
            if built is not None:
                chained = Chained(
                    built[0], mine, before, built[1], every=guesses, by_token=by_token, source=plan.source,
                    strand_outcomes=paths.outcomes if paths is not None else {},
                    cut=prepare(cache.snapshot(), before, call),
                )  # fmt: skip
            continue
        after = cache.snapshot()
        cache.restore(before)
        built = _build_kind(sess, call, mine, n, compiled_only=mine is not extra, paths=paths)
        if built is not None:
            state = cache.snapshot()
            chained.others.append(Build(built[0], mine, built[1], state, prepare(state, before, call)))
        cache.restore(after)
    return chained


def _build_kind(
    sess: DecodeSession, call: PendingCall, guesses: list[Guess | None], n: int, compiled_only: bool = False,
    paths: StrandPaths | None = None,
) -> tuple[PendingCall, int] | None:  # fmt: skip
    """The call after ``call`` for the outcomes ``guesses`` name (all of one kind) and its rows, or None where it
    cannot be built ahead (``compiled_only``: nor where its graph is not compiled yet). ``paths``: the outcomes
    after ``n + 1`` (paths through a strand) and the outcome as the device computes it."""
    known = [x for x in guesses if x is not None]
    nxt = known[0].plan
    if known[0].draft_rows is not None and nxt.drafts and call.out.aux_top is None:
        return None  # drafts from this call's rows, which it does not output
    if nxt.strands and call.out.alt is None:
        return None  # a tree of this call's runner-ups, which it does not output
    rule = sess.rule.for_source(nxt.source, strict=nxt.strict)
    if rule.guarded:
        return None  # a pivot rule reads the context, which this call's block may still change
    shape = call_shape(nxt, sess.runner_up, sess.reads_top_prob)
    rows = shape.rows
    # the next call's largest offset: past any path through a strand, whichever build serves it (the read trims the
    # cache to the path plus the likeliest build's rows before it knows which build runs)
    last = call.offset + 1 + (max(paths.accepted) if paths is not None and paths.outcomes else n)
    # rows a path through a strand moves (0: this build serves none, and its outcome is the chain's accepted count)
    moved = paths.rows(guesses, n) if paths is not None and paths.outcomes else 0
    paths = paths if moved else None
    spec = CallSpec(shape, sess.settings, rule, moved)
    if compiled_only and not sess.bank.compiled_for(spec, last + rows):
        return None
    # Per outcome g: the next call's draft rows (in this call's auxiliary rows) and its uniforms.
    m = len(nxt.drafts)
    tree = sum(len(st.tokens) for st in nxt.strands)  # a tree's tokens: this call's (row, rank) each
    outcomes = len(guesses)
    accepted = paths.accepted if paths is not None else list(range(n + 1))
    per_outcome = np.zeros((outcomes, m + tree), np.int32)  # outcome g's draft rows here, or its drafts (host tokens)
    row_u, aux_u = call_uniforms(sess, nxt, 0)
    row_table = np.zeros((outcomes, row_u.size), np.float32)
    aux_table = np.zeros((outcomes, aux_u.size), np.float32)
    drawn_u: dict[int, tuple] = {}  # (outcomes with as many drafts on their paths start at one position)
    for g, x in enumerate(guesses):
        if x is not None:
            per_outcome[g, :m] = x.plan.drafts if x.draft_rows is None else x.draft_rows
            if tree:  # flat indices into [argmax | runner-ups] per auxiliary row (``table`` below)
                per_outcome[g, m:] = [row * (1 + ALTS) + rank for row, rank in x.strand_src]
            a = accepted[g]
            if a not in drawn_u:
                drawn_u[a] = call_uniforms(sess, nxt, call.i + 1 + a)
            row_table[g], aux_table[g] = drawn_u[a]
    # int32 []: the outcome, known on the device only (its token row, its accepted drafts; the chain's count at most
    # its drafts, as the host reads it: the graph counts a strand hung after the last draft as the chain going on)
    c = mx.minimum(call.out.accepted, n) if paths is None else paths.index
    row = c if paths is None else mx.take(mx.array(paths.last_row, dtype=mx.int32), c)
    # (an UNRESOLVED target fed as 0: the read settles it on the host and drops this call, ``confirm_chained``)
    tokens = [mx.maximum(mx.take(call.out.targets, row.reshape(1)), 0).astype(mx.int32)]
    if known[0].by_token is not None:  # the drafts of the token the call emits (none guessed for it: dropped)
        tokens.append(_by_token(guesses, m, c, tokens[0]))
    elif m:
        picked = mx.take(mx.array(per_outcome), c, axis=0)  # int32 [m]: outcome c's draft rows (or its drafts)
        if tree:  # the drafts and the tree's tokens, from this call's argmax and runner-ups
            table = mx.concatenate([call.out.aux_top[:, None], call.out.alt], axis=1).reshape(-1)
            idx = mx.concatenate([picked[:m] * (1 + ALTS), picked[m:]])
            tokens.append(mx.take(table, idx).astype(mx.int32))
        elif known[0].draft_rows is None:
            tokens.append(picked)
        else:
            tokens.append(mx.take(call.out.aux_top, picked).astype(mx.int32))
    move = None
    if moved:  # the strand's K/V rows move in the chained call's graph (its buffers hold ``moved`` more rows)
        sess.cache.reserve(moved, sess.bank.shapes)
        src, dst = paths.move_table(moved)
        src = mx.take(mx.array(src + call.offset), c, axis=0)  # int32 [moved]: the rows to read
        move = (src, mx.take(mx.array(dst + call.offset), c), moved)
    drawn = c if paths is None else mx.take(mx.array(accepted, dtype=mx.int32), c)  # drafts on the path
    inputs = ChainInputs(
        tokens=mx.concatenate(tokens) if len(tokens) > 1 else tokens[0],
        row_u=mx.take(mx.array(row_table), c, axis=0),
        aux_u=mx.take(mx.array(aux_table), c, axis=0),
        offset=mx.array(call.offset + 1, dtype=mx.int32) + drawn,
        bound=last,
        move=move,
    )
    return build_call(sess, None, nxt, None, chain=inputs), rows


def _by_token(guesses: list[Guess | None], m: int, c: mx.array, token: mx.array) -> mx.array:
    """The drafts planned for ``token`` (lazy: the call's exact token) at outcome ``c`` (lazy), from the tables of
    ``guesses``' ``by_token`` (each outcome's tokens and their plans' drafts); a token none was planned for gets
    the first one's, never queued (its plan is not the real one: ``Guess.realize``)."""
    width = max(len(x.by_token) for x in guesses if x is not None)
    table = np.full((len(guesses), width), -1, np.int32)
    drafts = np.zeros((len(guesses), width, m), np.int32)
    for g, x in enumerate(guesses):
        for j, (t, p) in enumerate(x.by_token.items() if x is not None else ()):
            table[g, j], drafts[g, j] = t, p.drafts
    j = mx.argmax((mx.take(mx.array(table), c, axis=0) == token).astype(mx.int32))
    return mx.take(mx.take(mx.array(drafts), c, axis=0), j, axis=0)


def _kind(guess: Guess) -> tuple:
    """What one build must share across outcomes: the shape, the acceptance rule (``DraftPlan.strict``) and where the
    drafts come from (this call's rows, or tokens the host knows: not one gather). Kept on the guess (asked for
    every outcome of every kind: a tree's paths through its strands are many)."""
    kind = guess.__dict__.get("_kind")
    if kind is None:
        p = guess.plan
        tree = tuple((st.at, len(st.tokens), st.width, st.parent) for st in p.strands)
        kind = len(p.drafts), p.branches, p.strict, guess.draft_rows is None, tree, guess.by_token is not None
        guess.__dict__["_kind"] = kind
    return kind


def _strand_kind(guesses: list[Guess | None], n: int, taken: list[list[Guess | None]]) -> list[Guess | None] | None:
    """The kind (``_kind``) of the most paths through a strand (outcomes after ``n + 1``) whose guesses no kind in
    ``taken`` serves, as ``_by_kind`` lists it; None where there is none."""
    served = {_kind(next(x for x in k if x is not None)) for k in taken}
    left = [x if g > n and x is not None and _kind(x) not in served else None for g, x in enumerate(guesses)]
    kinds = _by_kind(left, None) if any(x is not None for x in left) else []
    return kinds[0] if kinds else None


def _by_kind(
    guesses: list[Guess | None], likely: list[float] | None, least: float | None = None
) -> list[list[Guess | None]]:
    """``guesses`` split by kind (``_kind``), the kind whose outcomes are likeliest to happen first (``likely[g]``:
    P(g drafts stand); None: all alike); after the first, only kinds at least ``OTHER_KIND_MIN`` likely (``least``:
    every kind at least that likely). Each list keeps its kind's guesses in place and None elsewhere (a read that
    reports an outcome of no build drops them)."""
    weight: dict[tuple, float] = {}
    for g, x in enumerate(guesses):
        if x is not None:
            p = likely[g] if likely is not None and g < len(likely) else 1.0
            weight[_kind(x)] = weight.get(_kind(x), 0.0) + p + 1e-9
    kinds = sorted(weight, key=weight.get, reverse=True)
    if least is not None:
        kinds = [k for k in kinds if likely is None or weight[k] >= least]
    kinds = kinds[:1] + [k for k in kinds[1:] if likely is None or weight[k] >= OTHER_KIND_MIN]
    return [[x if x is not None and _kind(x) == k else None for x in guesses] for k in kinds]


def confirm_chained(
    chained: Chained, result: CallResult, plan: DraftPlan | None, i: int, cache, realized: DraftPlan | None = None,
    grave: list | None = None,
) -> PendingCall | None:  # fmt: skip
    """The chained call, if ``plan`` (the drafter's real next plan after ``result``, None: the answer ended) is
    the one guessed for the outcome that happened (in the likeliest kind's build or another's); it then starts at
    generated position ``i`` and the state before it is let go (its writes stay in place), with every other build.
    None: the chained call is dropped, the cache is back at the accepted path, and ``plan`` is built as usual.
    ``realized``: that build's plan as ``result`` realizes it, where the caller has it already; ``grave``: where
    the builds not used are kept until the next call is queued (``park``)."""
    keep = cache.offset - chained.rows  # ``finish_call`` kept the accepted path plus the likeliest build's rows
    c = chained.outcome(result)
    live = c is not None and plan is not None and not plan.burst and not result.resolved
    hit = None
    for b in chained.builds(c) if live else ():
        guess = b.guesses[c]
        # (a tree's strands: the read's argmax and runner-ups in its placeholders; a plan committed to is that
        # object; ``realized``: the guess in ``every``, realized already)
        mine = realized if realized is not None and c < len(chained.every) and guess is chained.every[c] else None
        if plan is mine or _matches(plan, mine or guess.realize(result)):
            hit = b
            break
    if hit is None:
        drop_chained(chained, cache, keep, grave)
        return None
    unused = [(o.call, o.state, o.cut) for o in chained.others if o is not hit]
    if hit.state is not None:  # another kind's build: the cache takes the state after it, past the accepted path
        unused.append((chained.call, cache.snapshot(), chained.cut))
        cache.restore(hit.state)
        cache.trim_to(keep + hit.rows)
    restore(hit.cut, chained.before)  # (every build was cut as it was made: the one that runs reads its buffers again)
    park(grave, unused)  # (they hold none of its buffers: they go once it is queued)
    if grave is not None and hit.cut is not None:  # (its cut goes off the path too: its node handles)
        grave.append(hit.cut)
    chained.cut = None
    # (let go of the state before and of every other build now, so the call's writes stay in place)
    chained.before, chained.others = None, []
    return replace(hit.call, plan=plan, offset=keep, i=i, ahead=True)  # the same rows; the host knows what they verify


def drop_chained(chained: Chained, cache, keep: int | None = None, grave: list | None = None) -> None:
    """Give the cache back its state before the chained build, trimmed to ``keep`` rows (None: as it was then); the
    builds go to ``grave`` (``park``)."""
    if chained.before is not None:
        park(
            grave, [(chained.call, cache.snapshot(), chained.cut), *((o.call, o.state, o.cut) for o in chained.others)]
        )
    chained.others, chained.cut = [], None
    if chained.before is not None:
        cache.restore(chained.before)
        chained.before = None
    if keep is not None:
        cache.trim_to(keep)


def _matches(plan: DraftPlan | None, built: DraftPlan) -> bool:
    """Whether ``plan`` (the drafter's real next plan) is the one a guess realized as ``built``."""
    ok = plan is not None and not plan.burst
    ok = ok and plan.branches == built.branches and plan.drafts == built.drafts and plan.strands == built.strands
    ok = ok and plan.source == built.source and plan.strict == built.strict and all(t >= 0 for t in built.drafts)
    return ok and all(t >= 0 for st in built.strands for t in st.tokens)  # (every placeholder had its token)
