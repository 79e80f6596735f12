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
from .decode.ar import ar_calls, prefill
from .decode.call import NO_CLOCK
from .decode.fixed import bank_for
from .decode.ptp import AnswerLimits, ptp_calls
from .decode.session import ContextTokens, DecodeSession, number_tokens, vocab_size
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
    accepted: int = 0  # drafts accepted within the answer: the call decided accepted + 1 of its tokens (its end counts)
    rows: int = 1  # rows in the forward pass (verify + auxiliaries)
    step_time: float = 0.0  # seconds for this call
    elapsed: float = 0.0  # seconds since prefill ended (all decoding calls so far)
    generated: int = 0  # tokens generated so far, this block included
    prompt_tokens: int = 0
    prompt_time: float = 0.0  # seconds of prefill
    finish_reason: str | None = None  # "stop" (EOS), "length" (max tokens / context) or None
    peak_memory: float = 0.0  # GB
    # who proposed the accepted drafts: "ptp" (chain), "lookup"; "ptp-strand", "lookup-strand": the path took a token
    # tree's side strand of that source; None: none
    source: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of ``tokens`` when the answer asked for them
    accept: str = "exact"  # the acceptance rule's label: "exact", or "lenient ..." (not the exact sample)
    strand_rows: int = 0  # token rows of the call's side strands (a token tree; 0: a chain)


@dataclass
class DecodeOptions:
    mode: str = "ar"  # "ar" or "ptp"
    max_tokens: int = 256
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    # How PTP drafts (``drafting/policy.py: make_drafter``): the adaptive budget (default: a flat cost curve with the
    # adapter's width) or a fixed one of N drafts per call (mlx-lm's flag: no AR bursts), runner-up siblings,
    # prompt-lookup chains, and the step kind ("fused", or "simple": two calls, draft then verify).
    drafting: DraftingConfig = field(default_factory=DraftingConfig)
    drafter: Drafter | None = None  # default: the adapter's own drafts (``drafting``); tests inject others
    clock: object | None = None  # a PhaseClock splits every PTP call into phases (ptp-bench --profile)
    logits: LogitsHook | None = None  # penalties, logit_bias and logprobs of one answer (ptp_mlx/logits.py)
    # Chain calls: the next call built for every outcome of this one while it computes (``decode/pipeline.py``).
    # None: where that pays on this machine, learnt from the calls' times (``decode/chain_odds.ChainChoice``); True:
    # always; False: every call built after the read (the profile's synchronous reference).
    chain: bool | None = None
    # Calls and steps: the fixed-shape ones compiled, or the same functions run eagerly (the reference); None: compiled
    # unless PTP_MLX_EAGER=1 (``decode.fixed.compiled_by_default``).
    compiled: bool | None = None
    accept: AcceptRule = EXACT  # the acceptance rule (decode/accept.py); a lenient one is opt-in and labelled
    turn_start: int = 0  # where the prompt's current turn starts (a chat's last user message; ``Engine.turn_start``)
    # The prompt is text to continue (no chat template): the answer's leading space is part of it (mlx-lm's
    # detokenizer trims it, as a chat answer wants), so a client that joins prompt and answer gets the text.
    continuation: bool = False


class ContextFull(ValueError):
    pass


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
    # (PTP: the last chunk is left computing while the drafter is set up and the first call built: ``ptp_calls``)
    in_flight = prefill(pm.base, prompt_ids[reused:-1], cache, wait=opts.mode == "ar")
    if opts.mode == "ar":
        sess = DecodeSession(pm, cache, u, s, hook=opts.logits, bank=bank_for(pm, opts.compiled))
        calls = ar_calls(sess, prompt_ids[-1], max_new)
    else:
        sess, drafter = _ptp_session(pm, tokenizer, cache, u, s, opts, prompt_ids)
        sess.prefilling = in_flight
        limits = AnswerLimits(max_new, ctx, frozenset(eos))
        # (with a logits hook a call's rows depend on the tokens committed before it: no call is built ahead)
        calls = ptp_calls(sess, drafter, prompt_ids[-1], limits, chain=opts.chain, clock=opts.clock or NO_CLOCK)
    del in_flight  # (held here, its K/V buffers could not be written in place by the first call)
    accept_label = opts.accept.label if opts.mode == "ptp" else "exact"
    lead = opts.continuation  # (the first text still to come: its leading space is put back, ``_leading_space``)
    generated = 0
    seq = list(prompt_ids)  # every token fed or emitted; the cache holds seq[:offset]
    t_gen = time.perf_counter()
    prompt_time = t_gen - t0  # prefill of all prompt tokens but the last (which every first call processes)
    try:
        for block, info in calls:
            now = time.perf_counter()
            if sess.prefilled_at is not None:  # (the prefill ended inside the first call's turn: when, it noted)
                t_gen, prompt_time, sess.prefilled_at = sess.prefilled_at, sess.prefilled_at - t0, None
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
            text = detok.last_segment
            if lead and (text or finish):
                text, lead = _leading_space(tokenizer, prompt_ids, seq[len(prompt_ids) :], detok.text) + text, False
            generated += len(out)
            accepted = info.accepted
            if finish:  # (drafts accepted past the end-of-answer token or past max_tokens were not emitted)
                accepted = max(0, min(accepted, len(out) + (finish == "stop") - 1))
            yield GenerationStep(
                tokens=out,
                text=text,
                proposed=info.proposed,
                accepted=accepted,
                rows=info.rows,
                step_time=info.time,
                elapsed=now - t_gen,
                generated=generated,
                prompt_tokens=len(prompt_ids),
                prompt_time=prompt_time,
                finish_reason=finish or ("length" if generated >= max_new else None),
                peak_memory=_peak_gb(),
                source=info.source,
                strand_rows=info.strand_rows,
                logprobs=info.logprobs[: len(out)] if info.logprobs is not None else None,
                accept=accept_label,
            )
            if finish or generated >= max_new:
                return
    finally:
        calls.close()  # a PTP call queued but not read leaves the cache now, before it is stored
        if prompt_cache is not None:
            # Stored once, at the end (normal, closed early, or failed): after a failed call the cache holds rows
            # nobody trimmed, so its offset disagrees with the tokens and the next ``take`` starts afresh.
            prompt_cache.store(cache, seq)


def _leading_space(tokenizer, prompt_ids: Sequence[int], answer: list[int], shown: str) -> str:
    """ " " where the answer's text, decoded after the prompt's last tokens, starts with more spaces than ``shown``
    (the detokenizer's text so far, which trims one); else ""."""
    ctx = list(prompt_ids[-8:])
    base, full = tokenizer.decode(ctx), tokenizer.decode(ctx + answer)
    own = full[len(base) :] if full.startswith(base) else ""
    return " " if len(own) - len(own.lstrip(" ")) > len(shown) - len(shown.lstrip(" ")) else ""


def decoding_settings(pm, s: SamplingSettings) -> SamplingSettings:
    """``s`` in the CDF order of ``pm``'s adapter (plain and PTP decoding alike, so they agree token for token);
    vocabulary-id order without an adapter."""
    order = pm.config.cdf_order if pm.adapter is not None else "id"
    return s if s.order == order else replace(s, order=order)


def _ptp_session(pm: PTPModel, tokenizer, cache, u, s: SamplingSettings, opts: DecodeOptions, history: list[int]):
    """One PTP answer's ``DecodeSession`` and its drafter (``opts.drafter``, or the adapter's own drafts as
    ``opts.drafting`` composes them), begun on the prompt."""
    drafter = opts.drafter if opts.drafter is not None else make_drafter(opts.drafting, pm.config.window)
    drafter.begin(DraftSession(list(history), u, s, opts.turn_start))
    # Greedy verification ignores u, so drafts may use the adapter's reserved "argmax" u when it has one.
    greedy_u = pm.config.greedy_u if s.greedy else None
    bank = bank_for(pm, opts.compiled) if pm.adapter is not None or opts.drafter is None else None
    context = None
    if opts.accept.guarded:  # a pivot rule's lookup calls read which tokens the context holds
        context = ContextTokens(opts.accept.pivot, vocab_size(pm), history, number_tokens(tokenizer))
    sess = DecodeSession(
        pm,
        cache,
        u,
        s,
        greedy_u=greedy_u,
        hook=opts.logits,
        bank=bank,
        runner_up=drafter.runner_up,
        reads_top_prob=drafter.reads_top_prob,
        rule=opts.accept,
        context=context,
    )
    return sess, drafter
