"""One streaming generator for autoregressive and PTP decoding.

Every consumer (``ptp-generate``, the chat, the bench, the tests) iterates ``stream_generate`` and gets one
``GenerationStep`` per model call: the accepted block of tokens and its text, how many drafts were proposed
and accepted, and timing. Token ``g`` of the answer is always ``pick(u[g], P_base(. | prefix))`` for the
seeded uniform stream ``u``, so ``mode="ptp"`` returns exactly what ``mode="ar"`` returns.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx

from .budget import Budget, CostCurve, FixedBudget, Pace, Plan, u_factor
from .call import NO_CLOCK, ptp_call
from .logits import LogitsHook, TokenLogprob
from .lookup import LookupDrafter
from .ptp_model import PTPModel
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
    logprobs: list[TokenLogprob] | None = None  # one per token of ``tokens`` when the answer asked for them


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
    logits: LogitsHook | None = None  # penalties, logit_bias and logprobs of one answer (ptp_mlx/logits.py)


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
    s = decoding_settings(pm, opts.sampling).validate()
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
            if opts.logits is not None:
                opts.logits.commit(block)  # later rows' penalties count these tokens
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
                logprobs=info["logprobs"][: len(out)] if info.get("logprobs") is not None else None,
            )
            if finish or generated >= max_new:
                return
    finally:
        if prompt_cache is not None:
            # Stored once, at the end (normal, closed early, or failed): after a failed call the cache holds rows
            # nobody trimmed, so its offset disagrees with the tokens and the next ``take`` starts afresh.
            prompt_cache.store(cache, seq)


def decoding_settings(pm, s: SamplingSettings) -> SamplingSettings:
    """``s`` in the CDF order of ``pm``'s adapter (plain and PTP decoding alike, so they agree token for token);
    vocabulary-id order without an adapter."""
    order = pm.config.cdf_order if pm.adapter is not None else "id"
    return s if s.order == order else replace(s, order=order)


def _ar_calls(pm, cache, last, u, s: SamplingSettings, opts, max_new, ctx):
    """Autoregressive decoding, pipelined like mlx-lm: the next pass is queued before the host reads a token."""
    base = pm.base

    hook = getattr(opts, "logits", None)  # penalties, logit_bias, logprobs (ptp_mlx/logits.py); None: untouched

    def step(tok: mx.array, i: int) -> tuple[mx.array, list | None]:
        logits = base(tok.reshape(1, 1), cache=cache)[0, -1]
        if hook is None:
            return pick(mx.array(u[i]), logits, s.temperature, s.top_k, s.top_p, check=False, order=s.order), None
        # The token fed at i > 0 is not committed yet (read back after this pass is queued): ``pending``.
        logits = hook.rows(logits[None], pending=tok if i > 0 else None)
        t = pick(mx.array([u[i]]), logits, s.temperature, s.top_k, s.top_p, check=False, order=s.order)
        return t[0], hook.score(logits, t)

    tok, scored = step(mx.array([last]), 0)
    mx.async_eval(tok, *(scored or []))
    for i in range(max_new):
        t_start = time.perf_counter()
        nxt = None
        if i + 1 < max_new:
            nxt, nxt_scored = step(tok, i + 1)
            mx.async_eval(nxt, *(nxt_scored or []))
        t = int(tok.item())  # sync: the host needs this token (the next pass is already queued)
        if t < 0:
            raise ValueError("cannot sample: the model produced non-finite logits")
        info = {"time": time.perf_counter() - t_start}
        if scored is not None:
            info["logprobs"] = hook.read(scored, [0], [t])
        yield [t], info
        if nxt is not None:
            tok, scored = nxt, nxt_scored


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
        self.pace = Pace()  # what the adapter's calls really delivered since the last burst
        # Sampling in probability order (the adapter's CDF order): the uniforms of the drafted positions are
        # known, and a draft can only be right if its u falls inside the mode's bin (``u_factor``).
        self.uniforms = None
        self.mode: list[float] = []  # each draft's top probability at the decoding temperature
        self.planned: list[float] = []  # the confidences the last plan used (what the budget calibrates on)

    @property
    def runner_up(self) -> bool:
        """Whether calls should read the auxiliary rows' runner-ups (only the adaptive budget builds trees)."""
        return self.trees and isinstance(self.budget, Budget)

    def confidences(self, i: int) -> list[float]:
        """The drafts' confidences for a call at generated position ``i`` (draft k predicts position i+1+k),
        sharpened by their uniforms when sampling in probability order."""
        if self.uniforms is None or len(self.mode) != len(self.conf):
            return self.conf
        us = self.uniforms.take(i + 1, len(self.conf))
        return [c * u_factor(float(x), m) for c, x, m in zip(self.conf, us, self.mode, strict=True)]

    def plan(self, i: int, remaining: int, room: int) -> Plan:
        conf = self.planned = self.confidences(i)
        adaptive = isinstance(self.budget, Budget)
        if adaptive and self.budget.calibrate and self.pace.behind():
            # Drafting calls delivered fewer tokens than plain steps would have in the same time: decode
            # plainly for a while, whatever the predictions say.
            plan = Plan([], [], burst=min(self.budget.burst_len, remaining))
        elif adaptive:
            second = self.second if self.trees else None
            plan = self.budget.plan(self.drafts, conf, remaining, room, self.step, second=second)
        else:
            plan = self.budget.plan(self.drafts, conf, remaining, room, self.step)
        if plan.burst and adaptive:
            self.budget.relax()  # each autoregressive burst fades the evidence, so drafting is tried again later
            self.pace = Pace()
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
        aux_mode: list[float] | None = None,
    ) -> None:
        if observe and alt is None:  # the budget calibrates on the adapter's own chain drafts only
            self.budget.observe(self.planned[: len(plan.drafts)], accepted)
        if observe and isinstance(self.budget, Budget):  # the adapter's calls (not lookup's): their real pace
            self.pace.add(accepted + 1, self.budget.curve(plan.rows))
        self.drafts, self.conf, self.second, self.mode, self.planned = [], [], None, [], []
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
            self.mode = aux_mode[r + 1 : r + w] if aux_mode else []
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
    runner_up = getattr(drafter, "runner_up", False)  # read runner-ups only for a drafter that builds trees
    chain = drafter if isinstance(drafter, ChainDrafter) else getattr(drafter, "inner", None)
    chain = chain if isinstance(chain, ChainDrafter) and s.order == "prob" and not s.greedy else None
    if chain is not None:
        chain.uniforms = u  # its drafts' uniforms sharpen their confidences (``u_factor``)
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
        out = ptp_call(
            pm, cache, last, plan, u, i, s, greedy_u, clock, runner_up, mode_mass=chain is not None, hook=opts.logits
        )
        block, c = out.block, out.accepted
        # 3. The next drafts come from the branch of the path that stood, its first slot the exact token.
        drafter.update(plan, c, out.aux_tokens, out.aux_conf, alt=out.alt, second=out.second, aux_mode=out.aux_mode)
        if emitted:
            emitted(block)
        clock.mark("update")
        clock.tag("rows", plan.rows)
        last = block[-1]
        i += len(block)
        t = time.perf_counter() - t_start
        n = len(plan.drafts) + len(plan.alts)
        source = "alt" if out.alt is not None else plan.source if n else None
        info = {"proposed": n, "accepted": c, "rows": plan.rows, "time": t, "source": source}
        yield block, {**info, "logprobs": out.logprobs}
