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

from .decode.accept import EXACT, AcceptRule
from .decode.ahead import (
    build_after_burst,
    build_chained,
    chained_plan,
    confirm_after_burst,
    confirm_chained,
    drop_chained,
)
from .decode.ar import Shifted, ar_calls, prefill
from .decode.call import NO_CLOCK, build_call, finish_call
from .decode.fixed import bank_for
from .decode.session import CallRecord, ContextTokens, DecodeSession, number_tokens, vocab_size
from .drafting.budget import BudgetPolicy
from .drafting.policy import DraftingConfig, make_drafter
from .drafting.protocol import Drafter, DraftSession
from .logits import LogitsHook, TokenLogprob
from .model.ptp import PTPModel
from .prompt_cache import PromptCache
from .sampler import SamplingSettings, UniformStream


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
    accept: str = "exact"  # the acceptance rule's label: "exact", or "lenient ..." (not the exact sample)


@dataclass
class DecodeOptions:
    mode: str = "ar"  # "ar" or "ptp"
    step: str = "fused"  # "fused" or "simple" (two calls: draft, then verify)
    max_tokens: int = 256
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    budget: BudgetPolicy | None = None  # default: a flat cost curve with the adapter's width
    num_draft_tokens: int | None = None  # a fixed budget (mlx-lm's flag): up to N drafts every call, no AR bursts
    lookup: bool = True  # also draft by prompt lookup (ptp_mlx/drafting/lookup.py)
    trees: bool = True  # let the adaptive budget verify the runner-up of the first draft as a sibling strand
    drafter: Drafter | None = None  # default: ``default_drafter`` (the adapter's own drafts); tests inject others
    clock: object | None = None  # a PhaseClock splits every PTP call into phases (ptp-bench --profile)
    logits: LogitsHook | None = None  # penalties, logit_bias and logprobs of one answer (ptp_mlx/logits.py)
    # Chain calls: the next call built for every outcome of this one while it computes (``decode/ahead.py``), on every
    # backend; False: every call built after the read (the profile's synchronous reference).
    ahead: bool = True
    # Calls and steps: the fixed-shape ones compiled, or the same functions run eagerly (the reference); None: compiled
    # unless PTP_MLX_EAGER=1 (``decode.fixed.compiled_by_default``).
    compiled: bool | None = None
    accept: AcceptRule = EXACT  # the acceptance rule (decode/accept.py); a lenient one is opt-in and labelled
    turn_start: int = 0  # where the prompt's current turn starts (a chat's last user message; ``Engine.turn_start``)

    @property
    def drafting(self) -> DraftingConfig:
        """The drafting knobs above as one config (what ``drafting/policy.py: make_drafter`` composes from)."""
        return DraftingConfig(self.num_draft_tokens, self.budget, self.trees, self.lookup, self.step)


class ContextFull(ValueError):
    pass


def encode_prompt(tokenizer, prompt: str | Sequence[dict], chat: bool = True) -> list[int]:
    """Token ids for a prompt string or a list of chat messages (chat template when the tokenizer has one).

    The tokenizer-level function, for code that holds a tokenizer and no engine (training, the bench, tests);
    ``Engine.encode`` is the engine's verb on top of it (it also passes tool definitions to the template)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer.encode(messages[-1]["content"] if not isinstance(prompt, str) else prompt))


def turn_start(tokenizer, messages: Sequence[dict], ids: Sequence[int], tools: list[dict] | None = None) -> int:
    """Where the current turn (the last user message and what follows) starts in ``ids``, the prompt of
    ``messages``: how many tokens ``ids`` shares with the earlier messages rendered alone. 0 for one message or a
    tokenizer without a chat template; the whole prompt if the template will not render the earlier messages alone
    (no part of the prompt is then taken for this turn's)."""
    msgs = list(messages)
    last = max((k for k, m in enumerate(msgs) if m.get("role") == "user"), default=0)
    if last == 0 or not getattr(tokenizer, "chat_template", None):
        return 0
    try:
        kw = {"tools": tools} if tools else {}
        before = tokenizer.apply_chat_template(msgs[:last], add_generation_prompt=False, tokenize=True, **kw)
    except Exception:  # noqa: BLE001 - a template that needs a user message last: claim nothing for this turn
        return len(ids)
    before = list(before["input_ids"] if isinstance(before, dict) else before)
    return next((k for k, (a, b) in enumerate(zip(before, ids, strict=False)) if a != b), min(len(before), len(ids)))


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
    prefill(pm.base, prompt_ids[reused:-1], cache)
    if opts.mode == "ar":
        calls = ar_calls(pm, cache, prompt_ids[-1], u, s, max_new, hook=opts.logits, bank=bank_for(pm, opts.compiled))
    else:
        context = None
        if opts.accept.guarded:  # a pivot rule's lookup calls read which tokens the context holds
            context = ContextTokens(opts.accept.pivot, vocab_size(pm), prompt_ids, number_tokens(tokenizer))
        calls = _ptp_calls(pm, cache, prompt_ids[-1], u, s, opts, max_new, ctx, prompt_ids, eos, context)
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
                proposed=info.proposed,
                accepted=info.accepted,
                rows=info.rows,
                step_time=info.time,
                elapsed=now - t_gen,
                generated=generated,
                prompt_tokens=len(prompt_ids),
                prompt_time=prompt_time,
                finish_reason=finish or ("length" if generated >= max_new else None),
                peak_memory=_peak_gb(),
                source=info.source,
                logprobs=info.logprobs[: len(out)] if info.logprobs is not None else None,
                accept=opts.accept.label if opts.mode == "ptp" else "exact",
            )
            if finish or generated >= max_new:
                return
    finally:
        calls.close()  # a PTP call queued but not read leaves the cache now, before it is stored
        if prompt_cache is not None:
            # Stored once, at the end (normal, closed early, or failed): after a failed call the cache holds rows
            # nobody trimmed, so its offset disagrees with the tokens and the next ``take`` starts afresh.
            prompt_cache.store(cache, seq)


def decoding_settings(pm, s: SamplingSettings) -> SamplingSettings:
    """``s`` in the CDF order of ``pm``'s adapter (plain and PTP decoding alike, so they agree token for token);
    vocabulary-id order without an adapter."""
    order = pm.config.cdf_order if pm.adapter is not None else "id"
    return s if s.order == order else replace(s, order=order)


def default_drafter(pm: PTPModel, opts: DecodeOptions) -> Drafter:
    """The adapter's drafts as ``opts.drafting`` composes them (``drafting/policy.py: make_drafter``)."""
    return make_drafter(opts.drafting, pm.config.window)


def _ptp_calls(
    pm: PTPModel, cache, last, u, s: SamplingSettings, opts: DecodeOptions, max_new, ctx, history, eos, context=None
):
    """PTP decoding: each call verifies the drafts in hand and drafts again for the likely outcomes.

    Rows: [last accepted token, drafts q_1..q_n | branch d auxiliaries ...]. Branch d assumes the first d
    drafts are accepted. After the call, c = number of leading drafts equal to the exact token at their
    position; the call emits the exact tokens at positions 0..c and branch c (if present) gives the next
    drafts, its first slot being the exact token just emitted. A call is queued before the host reads it, and
    the next one, when the drafter can tell its rows, is built for the likely outcomes meanwhile
    (``ptp_mlx/decode/ahead.py``) and queued right after the read, before this call's block is handed out.
    """
    # Greedy verification ignores u, so drafts may use the adapter's reserved "argmax" u when it has one.
    greedy_u = pm.config.greedy_u if s.greedy else None
    drafter = opts.drafter if opts.drafter is not None else default_drafter(pm, opts)
    drafter.begin(DraftSession(list(history), u, s, opts.turn_start))
    bank = bank_for(pm, opts.compiled) if pm.adapter is not None or opts.drafter is None else None
    hook = opts.logits
    sess = DecodeSession(pm, cache, u, s, greedy_u, hook, bank, drafter.runner_up, drafter.reads_top_prob, opts.accept)
    sess.context = context  # (``ContextTokens``: only under a pivot rule)
    clock = opts.clock or NO_CLOCK
    i = 0  # index of the next token to emit, in the uniform stream
    # With a logits hook a call's rows depend on the tokens committed before it: no call is built ahead.
    chain = hook is None and bool(opts.ahead)
    plan, call, nxt = None, None, None  # the next call's plan / its queued build / the call chained on it
    started: list = []  # the call built on a burst's last step (``decode/ahead.py: build_after_burst``)
    cold_before = -1  # the bank's cold count before the previous iteration (a call built then runs now)
    carried = 0.0  # the previous iteration's time queueing this one's call (chained): this call's cost, not that one's
    try:
        while i < max_new:
            t_start = time.perf_counter()
            cold_start = _cold(bank)
            clock.start()
            if call is None and started:
                # The call built while the burst's last step computed, queued if the drafter's plan is its plan.
                drafter.chained(started[0].guesses[0].plan)
                plan = drafter.plan(i, max_new - i, ctx - started[0].call.offset)
                call = confirm_after_burst(started.pop(), plan, cache, last)
                if call is not None:
                    clock.mark("update")
                    mx.async_eval(*call.arrays)
                    clock.mark("queue")
            if call is None:
                # 1. The drafter (and its budget) chooses what to verify and which branches to draft.
                plan = plan or drafter.plan(i, max_new - i, ctx - cache.offset)
                if plan.burst:
                    end = i + plan.burst

                    def start(token, end=end):
                        built = build_after_burst(sess, drafter, token, end, max_new, ctx)
                        started.extend([built] if built is not None else [])

                    args = (pm, cache, last, u, i, s, plan.burst, drafter, hook, bank, sess.context)
                    last, done = yield from _burst(*args, start=start if chain else None)
                    i, plan = i + done, None
                    continue
                clock.mark("plan")
                # 2. One call: verify, draft (queued now; read, accepted and trimmed by ``finish_call``).
                call = build_call(sess, last, plan, i)
                clock.mark("build")
                mx.async_eval(*call.arrays)  # (on MLX's CPU backend this returns only near the end of a large graph)
                clock.mark("queue")
            # The next call, for every outcome of this one, built while it computes (decode/ahead.py).
            nxt = build_chained(sess, drafter, call, max_new, ctx) if chain else None
            clock.mark("ahead")
            out = finish_call(cache, call, clock, then=0 if nxt is None else nxt.rows)
            plan, call = call.plan, None
            # 3. The next drafts come from the branch of the path that stood, its first slot the exact token.
            drafter.update(plan, out)
            drafter.emitted(out.block)
            if sess.context is not None:
                sess.context.add(out.block)
            block, c, rows, last = out.block, out.accepted, plan.rows, out.block[-1]
            n = len(plan.drafts) + len(plan.alts)
            source = "alt" if out.alt is not None else plan.source if n else None
            i += len(block)
            plan = None
            if i < max_new and not eos.intersection(block):
                # The next call is planned now (preferring the one already built, when there is one); chained on
                # this one, it is queued before the yield.
                drafter.chained(chained_plan(nxt, out))
                plan = drafter.plan(i, max_new - i, ctx - cache.offset + (0 if nxt is None else nxt.rows))
            if nxt is not None:
                call = confirm_chained(nxt, out, plan, i, cache)
                nxt = None
            clock.mark("update")
            t_queue = time.perf_counter()
            if call is not None:
                mx.async_eval(*call.arrays)
                clock.mark("queue")
            # Each call is charged its own queueing: on MLX's CPU backend ``async_eval`` returns only once all but
            # the last few kernels have run, so queueing the chained call is mostly that call's compute.
            queued = time.perf_counter() - t_queue
            clock.tag("rows", rows)
            t = time.perf_counter() - t_start - queued + carried
            carried = queued
            # What the call cost, as measured (the budget learns costs, and its pace guard watches): cold when a
            # shape ran uncompiled in this call or the one built before it.
            drafter.timed(rows, len(block), t, cold=_cold(bank) != cold_before)
            cold_before = cold_start
            yield block, CallRecord(t, n, c, rows, source, out.logprobs)
    finally:
        if started:  # built on a burst that was never finished: the state before it comes back
            drop_chained(started[0], cache, started[0].call.offset)
        if nxt is not None:  # chained on a call that was never read: the state before it comes back
            drop_chained(nxt, cache, call.offset if call is not None else cache.offset - nxt.rows)
            call = None
        if call is not None:  # queued but never read (the consumer stopped first): its rows leave the cache
            cache.trim_to(call.offset)


def _cold(bank) -> int:
    """How many calls of ``bank`` so far ran a shape uncompiled (eagerly or tracing it); 0 without a bank."""
    return bank.cold if bank is not None else 0


def _burst(pm, cache, last, u, i, s, length, drafter, hook=None, bank=None, context=None, start=None):
    """Drafting does not pay here (poor drafts or costly rows): decode a pipelined autoregressive burst instead.
    Same uniforms, same tokens; the cache again ends just before the last token. Returns ``(last, done)``.
    ``start(token)``: builds the next PTP call on the last step's token while it computes."""
    stop = []
    burst = ar_calls(
        pm, cache, last, Shifted(u, i), s, length, hook=hook, bank=bank, then=start, stop=lambda: bool(stop)
    )
    done, cold = 0, [_cold(bank)] * 3
    for block, info in burst:
        last = block[-1]
        done += 1
        cold = cold[1:] + [_cold(bank)]
        # (the first step of a burst is not pipelined behind another: not a plain step's pace; nor is a step that
        # ran, or followed, an uncompiled one, nor the step read after the burst was told to stop)
        if done > 1 and cold[0] == cold[-1] and not stop:
            drafter.timed(1, 1, info.time)
        drafter.emitted(block)
        if context is not None:
            context.add(block)
        yield block, info
        if done < length - 1 and not stop and drafter.ready():
            # A draft worth a call is in hand: the burst ends after the step already queued, whose token is read
            # and kept (not dropped: it was computed anyway), and the drafter plans with it. (Past ``length - 1``
            # the step queued is the burst's last anyway, and the next call may already be built on it.)
            stop.append(True)
    return last, done
