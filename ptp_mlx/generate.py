"""One streaming generator for autoregressive and PTP decoding.

Every consumer (``ptp-generate``, the chat, the bench, the tests) iterates ``stream_generate`` and gets one
``GenerationStep`` per model call: the accepted block of tokens and its text, how many drafts were proposed
and accepted, and timing. Token ``g`` of the answer is always ``pick(u[g], P_base(. | prefix))`` for the
seeded uniform stream ``u``, so ``mode="ptp"`` returns exactly what ``mode="ar"`` returns.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .budget import Budget, CostCurve, FixedBudget, Plan
from .lookup import LookupDrafter
from .ptp_model import PTPModel, Window
from .sampler import SamplingSettings, UniformStream, pick

PREFILL_CHUNK = 512


class _Shifted:
    """The uniform stream seen from index ``start`` (an autoregressive burst inside a PTP run)."""

    def __init__(self, u: UniformStream, start: int):
        self.u, self.start = u, start

    def __getitem__(self, i: int) -> float:
        return self.u[self.start + i]


@dataclass
class GenerationStep:
    """What one model call produced."""

    tokens: list[int]  # the accepted block (EOS excluded)
    text: str  # text delta for the block
    proposed: int = 0  # drafts verified in this call (0 for autoregressive)
    accepted: int = 0  # drafts accepted; the call emitted accepted + 1 tokens unless it stopped
    rows: int = 1  # rows in the forward pass (verify + auxiliaries)
    step_time: float = 0.0  # seconds for this call
    elapsed: float = 0.0  # seconds since prefill ended (all decoding calls so far)
    generated: int = 0  # tokens generated so far, this block included
    prompt_tokens: int = 0
    prompt_time: float = 0.0  # seconds of prefill
    finish_reason: str | None = None  # "stop" (EOS), "length" (max tokens / context) or None
    peak_memory: float = 0.0  # GB
    source: str | None = None  # who proposed the accepted drafts: "ptp" (chain), "alt" (sibling), "lookup"; None: none


@dataclass
class DecodeOptions:
    mode: str = "ar"  # "ar" or "ptp"
    step: str = "fused"  # "fused" or "simple" (two calls: draft, then verify)
    max_tokens: int = 256
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    budget: Budget | None = None  # default: a flat cost curve with the adapter's width
    num_draft_tokens: int | None = None  # a fixed budget (mlx-lm's flag): up to N drafts every call, no AR bursts
    lookup: bool = True  # also draft by prompt lookup (ptp_mlx/lookup.py)
    trees: bool = True  # let the adaptive budget verify the runner-up of the first draft as a sibling strand
    drafter: object | None = None  # default: ChainDrafter (the adapter's own drafts); tests inject others
    clock: object | None = None  # a PhaseClock splits every PTP call into phases (ptp-bench --profile)


class ContextFull(ValueError):
    pass


@dataclass
class PromptCache:
    """A conversation's KV cache and the tokens it holds, carried from one answer to the next (as
    ``mlx_lm.chat`` does): the next prompt prefills only what follows their longest common prefix."""

    cache: list | None = None
    tokens: list[int] = field(default_factory=list)
    reused: int = 0  # prompt tokens the last answer did not have to prefill
    lease: list | None = field(default=None, repr=False)  # the cache the latest answer took

    def take(self, pm: PTPModel, prompt_ids: list[int]) -> tuple[list, int]:
        """A cache holding a prefix of ``prompt_ids[:-1]`` and that prefix's length (0: a fresh cache)."""
        cache, self.cache = self.cache, None  # invalid while a generation works on it
        if cache is None or cache[0].offset != len(self.tokens):  # (a failed call leaves rows it did not trim)
            cache, keep = pm.make_cache(), 0
        else:
            keep = 0
            limit = min(len(self.tokens), len(prompt_ids) - 1)
            while keep < limit and self.tokens[keep] == prompt_ids[keep]:
                keep += 1
            for c in cache:  # trim: drop what the new prompt does not share (the end of the last answer, at least)
                c.trim(c.offset - keep)
        self.lease = cache
        return cache, keep

    def store(self, cache: list, seq: list[int]) -> None:
        """Record ``cache`` as holding ``seq[:offset]``, unless a later answer has taken the cache over since."""
        if self.lease is cache:
            self.cache, self.tokens = cache, seq[: cache[0].offset]


def encode_prompt(tokenizer, prompt: str | Sequence[dict], chat: bool = True) -> list[int]:
    """Token ids for a prompt string or a list of chat messages (chat template when the tokenizer has one)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer.encode(messages[-1]["content"] if not isinstance(prompt, str) else prompt))


def _prefill(model, tokens: list[int], cache) -> None:
    for s in range(0, len(tokens), PREFILL_CHUNK):
        model(mx.array(tokens[s : s + PREFILL_CHUNK])[None], cache=cache)
        mx.eval([c.state for c in cache])  # sync per chunk: bounds memory on long prompts


def _peak_gb() -> float:
    return mx.get_peak_memory() / 1e9


def stream_generate(
    pm: PTPModel,
    tokenizer,
    prompt_ids: Sequence[int],
    opts: DecodeOptions,
    eos_ids: set[int] | None = None,
    uniforms: UniformStream | None = None,
    prompt_cache: PromptCache | None = None,
) -> Iterator[GenerationStep]:
    """Yield one ``GenerationStep`` per model call until EOS, ``max_tokens`` or the context limit.

    With ``prompt_cache``, the prompt continues from that cache (only the new tokens are prefilled) and the
    cache is left holding the prompt and the answer for the next turn.
    """
    s = opts.sampling.validate()
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise ValueError("empty prompt")
    ctx = getattr(pm.args, "max_position_embeddings", None) or 1 << 30
    if len(prompt_ids) >= ctx:
        raise ContextFull(f"prompt is {len(prompt_ids)} tokens but the model's context is {ctx}")
    if opts.mode == "ptp" and pm.adapter is None and opts.drafter is None:
        raise ValueError("PTP decoding needs an adapter (use mode='ar' without one)")
    eos = set(eos_ids if eos_ids is not None else getattr(tokenizer, "eos_token_ids", None) or [])
    u = uniforms or UniformStream(s.seed)
    max_new = min(opts.max_tokens, ctx - len(prompt_ids))
    detok = tokenizer.detokenizer
    detok.reset()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    if prompt_cache is not None:
        cache, reused = prompt_cache.take(pm, prompt_ids)
        prompt_cache.reused = reused
    else:
        cache, reused = pm.make_cache(), 0
    _prefill(pm.base, prompt_ids[reused:-1], cache)
    if opts.mode == "ar":
        calls = _ar_calls(pm, cache, prompt_ids[-1], u, s, opts, max_new, ctx)
    else:
        calls = _ptp_calls(pm, cache, prompt_ids[-1], u, s, opts, max_new, ctx, history=prompt_ids)
    generated = 0
    seq = list(prompt_ids)  # every token fed or emitted; the cache holds seq[:offset]
    t_gen = time.perf_counter()
    prompt_time = t_gen - t0  # prefill of all prompt tokens but the last (which every first call processes)
    try:
        for block, info in calls:
            now = time.perf_counter()
            seq.extend(block)
            finish = None
            out = []
            for t in block:
                if t in eos:
                    finish = "stop"
                    break
                out.append(t)
                if generated + len(out) >= max_new:
                    finish = "length"
                    break
            for t in out:
                detok.add_token(t)
            if finish:
                detok.finalize()
            generated += len(out)
            yield GenerationStep(
                tokens=out,
                text=detok.last_segment,
                proposed=info.get("proposed", 0),
                accepted=info.get("accepted", 0),
                rows=info.get("rows", 1),
                step_time=info.get("time", 0.0),
                elapsed=now - t_gen,
                generated=generated,
                prompt_tokens=len(prompt_ids),
                prompt_time=prompt_time,
                finish_reason=finish or ("length" if generated >= max_new else None),
                peak_memory=_peak_gb(),
                source=info.get("source"),
            )
            if finish or generated >= max_new:
                return
    finally:
        if prompt_cache is not None:
            # Stored once, at the end (normal, closed early, or failed): after a failed call the cache holds rows
            # nobody trimmed, so its offset disagrees with the tokens and the next ``take`` starts afresh.
            prompt_cache.store(cache, seq)


def _ar_calls(pm, cache, last, u, s: SamplingSettings, opts, max_new, ctx):
    """Autoregressive decoding, pipelined like mlx-lm: the next pass is queued before the host reads a token."""
    base = pm.base

    def step(tok: mx.array, i: int) -> mx.array:
        logits = base(tok.reshape(1, 1), cache=cache)[0, -1]
        return pick(mx.array(u[i]), logits, s.temperature, s.top_k, s.top_p, check=False)

    tok = step(mx.array([last]), 0)
    mx.async_eval(tok)
    for i in range(max_new):
        t_start = time.perf_counter()
        nxt = None
        if i + 1 < max_new:
            nxt = step(tok, i + 1)
            mx.async_eval(nxt)
        t = int(tok.item())  # sync: the host needs this token (the next pass is already queued)
        if t < 0:
            raise ValueError("cannot sample: the model produced non-finite logits")
        yield [t], {"time": time.perf_counter() - t_start}
        tok = nxt


class ChainDrafter:
    """PTP's own drafts: after each call, the auxiliary branch that matches the accepted count.

    Drafters are what a PTP call verifies. ``plan`` asks the budget for the call's rows; ``update`` takes the
    next drafts from the call's auxiliary outputs. Tests inject other drafters (``ptp_mlx.testing``).
    """

    def __init__(self, budget: Budget | FixedBudget, step: str = "fused", trees: bool = True):
        self.budget, self.step, self.trees = budget, step, trees
        self.drafts: list[int] = []
        self.conf: list[float] = []
        self.second: tuple[int, float] | None = None  # runner-up of the first draft (a sibling strand candidate)
        # Realized pace of the adapter's calls since the last burst: tokens and cost (in plain steps, from the
        # budget's measured curve). Predictions can be optimistic; this is what the calls really delivered.
        self.episode = [0, 0.0, 0]  # tokens, cost, calls

    def plan(self, i: int, remaining: int, room: int) -> Plan:
        calibrating = isinstance(self.budget, Budget) and self.budget.calibrate
        tokens, cost, calls = self.episode
        if calibrating and calls >= 3 and tokens < cost:
            # Three or more drafting calls delivered fewer tokens than plain steps would have in the same time:
            # decode plainly for a while, whatever the predictions say.
            self.budget.relax()
            self.episode = [0, 0.0, 0]
            return Plan([], [], burst=min(self.budget.burst_len, remaining))
        if self.trees and self.second is not None and isinstance(self.budget, Budget):
            plan = self.budget.plan(self.drafts, self.conf, remaining, room, self.step, second=self.second)
        else:
            plan = self.budget.plan(self.drafts, self.conf, remaining, room, self.step)
        if plan.burst and isinstance(self.budget, Budget):
            self.budget.relax()  # each autoregressive burst fades the evidence, so drafting is tried again later
            self.episode = [0, 0.0, 0]
        elif plan.drafts:
            plan.source = "ptp"
        return plan

    def update(
        self,
        plan: Plan,
        accepted: int,
        aux_tokens: list[int],
        aux_conf: list[float],
        observe: bool = True,
        alt: int | None = None,
        second: list[tuple[int, float]] | None = None,
    ) -> None:
        if observe and alt is None:  # the budget calibrates on the adapter's own chain drafts only
            self.budget.observe(self.conf[: len(plan.drafts)], accepted)
        if observe and isinstance(self.budget, Budget):  # the adapter's calls (not lookup's): their real pace
            e = self.episode
            self.episode = [e[0] + accepted + 1, e[1] + self.budget.curve(plan.rows), e[2] + 1]
        self.drafts, self.conf, self.second = [], [], None
        r, rows = 0, None
        for d, w in plan.branches:
            if d == accepted and alt is None:
                rows = (r, w)
            r += w
        for k, (_, w) in enumerate(plan.alts):
            if k == alt and w:
                rows = (r, w)
            r += w
        if rows is not None:  # slot 0 predicts the exact token just emitted: the drafts start at slot 1
            r, w = rows
            self.drafts, self.conf = aux_tokens[r + 1 : r + w], aux_conf[r + 1 : r + w]
            if second and w > 1:
                self.second = second[r + 1]


def _ptp_calls(pm: PTPModel, cache, last, u, s: SamplingSettings, opts: DecodeOptions, max_new, ctx, history=()):
    """PTP decoding: each call verifies the drafts in hand and drafts again for the likely outcomes.

    Rows: [last accepted token, drafts q_1..q_n | branch d auxiliaries ...]. Branch d assumes the first d
    drafts are accepted. After the call, c = number of leading drafts equal to the exact token at their
    position; the call emits the exact tokens at positions 0..c and branch c (if present) gives the next
    drafts, its first slot being the exact token just emitted.
    """
    width = pm.config.window
    # Greedy verification ignores u, so drafts may use the adapter's reserved "argmax" u when it has one.
    greedy_u = pm.config.greedy_u if s.greedy else None
    if opts.drafter is not None:
        drafter = opts.drafter
    else:
        if opts.num_draft_tokens:
            budget = FixedBudget(opts.num_draft_tokens, width)
        else:
            budget = opts.budget or Budget(CostCurve(), max_width=width)
        drafter = ChainDrafter(budget, opts.step, trees=opts.trees)
        if opts.lookup:
            drafter = LookupDrafter(drafter, list(history), max_draft=width - 1)
    emitted = getattr(drafter, "emitted", None)
    clock = opts.clock or NO_CLOCK
    i = 0  # index of the next token to emit, in the uniform stream
    while i < max_new:
        t_start = time.perf_counter()
        clock.start()
        offset = cache[0].offset
        # 1. The drafter (and its budget) chooses what to verify and which branches to draft.
        plan = drafter.plan(i, max_new - i, ctx - offset)
        if plan.burst:
            # Drafting does not pay here (poor drafts or costly rows): decode a pipelined autoregressive
            # burst instead. Same uniforms, same tokens; the cache again ends just before the last token.
            ready = getattr(drafter, "ready", None)  # prompt lookup may end the burst early
            burst = _ar_calls(pm, cache, last, _Shifted(u, i), s, opts, plan.burst, ctx)
            done = 0
            for block, info in burst:
                last = block[-1]
                done += 1
                if emitted:
                    emitted(block)
                yield block, info
                if ready is not None and done < plan.burst and ready():
                    # The next step is already queued and has fed ``last`` into the cache: trim it so the
                    # cache again ends just before ``last`` (the lookup call feeds it at the same position).
                    burst.close()
                    for layer_cache in cache:
                        layer_cache.trim(1)
                    break
            i += done
            continue
        clock.mark("plan")
        # 2. One call: verify, draft, accept, trim (ptp_call).
        out = ptp_call(pm, cache, last, plan, u, i, s, greedy_u, clock)
        block, c = out.block, out.accepted
        # 3. The next drafts come from the branch of the path that stood, its first slot the exact token.
        drafter.update(plan, c, out.aux_tokens, out.aux_conf, alt=out.alt, second=out.second)
        if emitted:
            emitted(block)
        clock.mark("update")
        clock.tag("rows", plan.rows)
        last = block[-1]
        i += len(block)
        t = time.perf_counter() - t_start
        n = len(plan.drafts) + len(plan.alts)
        source = "alt" if out.alt is not None else plan.source if n else None
        yield block, {"proposed": n, "accepted": c, "rows": plan.rows, "time": t, "source": source}


class PhaseClock:
    """Splits each PTP call into phases (``ptp-bench --profile``): ``mark(name)`` ends the phase ``name``."""

    def __init__(self) -> None:
        self.calls: list[dict[str, float]] = []
        self._t = 0.0

    def start(self) -> None:
        self.calls.append({})
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.calls[-1][name] = self.calls[-1].get(name, 0.0) + now - self._t
        self._t = now

    def tag(self, key: str, value: float) -> None:
        self.calls[-1][key] = value


class _NoClock:
    def start(self) -> None:
        pass

    def mark(self, name: str) -> None:
        pass

    def tag(self, key: str, value: float) -> None:
        pass


NO_CLOCK = _NoClock()


@dataclass
class CallOut:
    """What one PTP call settled: the emitted ``block``, the drafts it ``accepted`` (the alternative counts as
    one), the auxiliary rows' argmax and confidence, their runner-up tokens and confidences, and the index of
    the alternative strand that landed (None: the chain)."""

    block: list[int]
    accepted: int
    aux_tokens: list[int]
    aux_conf: list[float]
    second: list[tuple[int, float]]
    alt: int | None = None


def ptp_call(pm: PTPModel, cache, last: int, plan: Plan, u, i: int, s: SamplingSettings, greedy_u, clock=NO_CLOCK):
    """One fused PTP call: verify ``plan.drafts`` after ``last`` (and the alternatives to the first draft,
    ``plan.alts``, as sibling strands: a token tree), draft ``plan.branches``, then keep only the accepted path
    in the cache. Returns a ``CallOut``."""
    # Accept rule: a draft stands iff it equals pick(u, teacher logits) at its position; the first
    # mismatch is replaced by that exact token, so every emitted token is the autoregressive one.
    offset = cache[0].offset
    n, branches, alts = len(plan.drafts), plan.branches, plan.alts
    # 1. One forward pass: token rows [last, q_1..q_n, alternatives], then the auxiliary windows (built lazily).
    tokens = mx.array([last] + plan.drafts + [a for a, _ in alts])
    parents = list(range(-1, n)) + [0] * len(alts) if alts else None  # alternatives follow ``last`` like q_1
    windows = [Window(offset + 1 + d, w) for d, w in branches]
    windows += [Window(offset + 2, w, via=n + 1 + k) for k, (_, w) in enumerate(alts) if w]
    widths = [(d, w) for d, w in branches] + [(1, w) for _, w in alts if w]  # (depth, rows) of each window
    aux_u = None
    if windows:
        aux_u = mx.array(
            np.full(sum(w for _, w in widths), greedy_u, np.float32)
            if greedy_u is not None
            else np.concatenate([u.take(i + d, w) for d, w in widths])
        )
    logits = pm(tokens, aux_u, windows, cache, parents=parents)
    n_tok = n + 1 + len(alts)
    row_u = u.take(i, n + 1)
    if alts:  # a row's u is that of the position it predicts: an alternative predicts what q_1 would
        row_u = np.concatenate([row_u, np.repeat(u.take(i + 1, 1), len(alts))])
    targets = pick(mx.array(row_u), logits[:n_tok], s.temperature, s.top_k, s.top_p, check=False)
    outs = [targets]
    if windows:
        aux = logits[n_tok:].astype(mx.float32)
        top = mx.argmax(aux, axis=-1)
        lse = mx.logsumexp(aux, axis=-1)
        rest = mx.where(mx.arange(aux.shape[-1])[None] == top[:, None], -mx.inf, aux)  # runner-up: max of the rest
        outs += [top, mx.exp(mx.max(aux, axis=-1) - lse), mx.argmax(rest, axis=-1), mx.exp(mx.max(rest, axis=-1) - lse)]
    clock.mark("build")
    mx.eval(*outs)  # sync: one host read per call for targets and next drafts
    clock.mark("compute")
    targets_l = targets.tolist()
    aux_l = [o.tolist() for o in outs[1:]] if windows else [[], [], [], []]
    if min(targets_l) < 0:
        raise ValueError("cannot sample: the model produced non-finite logits")
    # 2. Accept the leading drafts that equal the exact tokens; if the first draft fell, an alternative may stand.
    c = 0
    while c < n and plan.drafts[c] == targets_l[c]:
        c += 1
    keep, block, alt = offset + 1 + c, targets_l[: c + 1], None
    if c == 0 and alts:
        hit = [k for k, (a, _) in enumerate(alts) if a == targets_l[0]]
        if hit:
            alt = hit[0]
            block, keep = [targets_l[0], targets_l[n + 1 + alt]], offset + 2
            # Compact: the alternative's K/V row moves next to ``last``; the other strands are trimmed below.
            src = offset + n + 1 + alt
            for layer_cache in cache:
                layer_cache.keys[..., offset + 1, :] = layer_cache.keys[..., src, :]
                layer_cache.values[..., offset + 1, :] = layer_cache.values[..., src, :]
    # 3. Trim the cache back to the accepted path: [last, q_1..q_c] (or [last, alternative]) stay.
    for layer_cache in cache:
        layer_cache.trim(layer_cache.offset - keep)
    clock.mark("read+trim")
    second = list(zip(aux_l[2], aux_l[3], strict=True))
    return CallOut(block, c if alt is None else 1, aux_l[0], aux_l[1], second, alt)
