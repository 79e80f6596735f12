"""What stays constant over one answer's PTP calls, held once instead of passed to every call."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .accept import EXACT, PAIR_TABLE, AcceptRule, context_index

if TYPE_CHECKING:
    from ..model.kv import KVState
    from ..model.ptp import PTPModel
    from ..sampler import SamplingSettings, UniformStream
    from .fixed import CompileBank


class ContextTokens:
    """What the context holds (the prompt and the answer so far) for a pivot rule's lookup calls
    (``decode/accept.py``): its token ids (``pivot=1``: a bool [vocab] table) or its adjacent token pairs
    (``pivot=2``: a hashed bool table of ``PAIR_TABLE`` slots, then a [vocab] one), one array refreshed only when
    something new arrives. ``numbers`` (the vocabulary's number tokens) are always set in the [vocab] table."""

    def __init__(self, pivot: float, vocab: int, tokens=(), numbers=()):
        self.pivot = pivot
        base = 0 if pivot == 1 else PAIR_TABLE  # where the [vocab] table starts
        self.seen = np.zeros(base + vocab, dtype=bool)
        # A number is always a pivot: a copied one in place of a computed one (a sum's) changes the answer.
        self.seen[[base + t for t in numbers if 0 <= t < vocab]] = True
        self._array: mx.array | None = None
        self._last: int | None = None  # the latest token (the first of the next pair)
        self.add(tokens)

    def add(self, tokens) -> None:
        ids = [int(t) for t in tokens]
        if not ids:
            return
        if self.pivot == 1:
            idx = context_index(1, None, [t for t in ids if 0 <= t < self.seen.size])
        else:
            seq = ([] if self._last is None else [self._last]) + ids
            idx = context_index(2, seq[:-1], seq[1:])
        self._last = ids[-1]
        if idx.size and not self.seen[idx].all():
            self.seen[idx] = True
            self._array = None

    def array(self) -> mx.array:
        """bool: True where the context holds that id (or pair), indexed by ``context_index``."""
        if self._array is None:
            self._array = mx.array(self.seen)
        return self._array


@lru_cache(maxsize=4)
def number_tokens(tokenizer) -> tuple[int, ...]:
    """The ids of the tokenizer's tokens that hold an ASCII digit (either pivot guard treats them as pivots)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # (mlx-lm's wrapper holds the Hugging Face tokenizer)
    vocab = hf.get_vocab()
    return tuple(sorted(i for text, i in vocab.items() if any("0" <= c <= "9" for c in text)))


def vocab_size(pm: PTPModel) -> int:
    """The model's vocabulary size (the rows of its logits)."""
    n = getattr(pm.args, "vocab_size", None)
    if not n:
        from ..model.layers import token_embedding

        n = token_embedding(pm.base).weight.shape[0]
    return int(n)


@dataclass
class DecodeSession:
    """One answer's model, K/V state, uniforms and settings, and how its calls run.

    ``greedy_u``: the adapter's reserved "draft the argmax" uniform under greedy decoding (None: the answer's own
    uniforms). ``hook``: the answer's ``LogitsHook`` (its calls then run eagerly). ``bank``: the compiled
    fixed-shape calls (None: the eager pass of ``PTPModel.__call__``). ``runner_up`` / ``reads_top_prob``: what the
    drafter reads from every call's auxiliary rows besides their argmax and confidence."""

    pm: PTPModel
    cache: KVState
    uniforms: UniformStream
    settings: SamplingSettings
    greedy_u: float | None = None
    hook: object | None = None
    bank: CompileBank | None = None
    runner_up: bool = False
    reads_top_prob: bool = False
    rule: AcceptRule = EXACT  # the acceptance rule (decode/accept.py): exact unless the answer opted out
    context: ContextTokens | None = None  # the context's token ids, kept only under a ``pivot`` rule
    # the prompt's last prefill chunk, queued and not yet waited for (``ar.prefill``, ``wait=False``): the first
    # call is planned and built while it computes (``settle``), then ``prefilled_at`` notes when it ended
    prefilling: list[mx.array] | None = None
    prefilled_at: float | None = None

    def settle(self) -> bool:
        """Wait for the prefill still in flight, if any, and note when it ended; True when there was one."""
        if self.prefilling is None:
            return False
        mx.eval(self.prefilling)  # (sync: the prompt's time ends here and the first call's begins)
        self.prefilling, self.prefilled_at = None, time.perf_counter()
        return True


@dataclass(frozen=True)
class CallRecord:
    """What one decoding call (a PTP call or an autoregressive step) reports with its block."""

    time: float  # seconds of wall time for this call, as the decoding loop saw it
    proposed: int = 0  # drafts verified (0 for an autoregressive step)
    accepted: int = 0  # drafts accepted
    rows: int = 1  # rows of the pass (token rows and auxiliaries)
    # who proposed the accepted drafts ("ptp", "lookup"; "ptp-strand", "lookup-strand": the path took a token
    # tree's side strand of that source); None: none
    source: str | None = None
    logprobs: list | None = None  # the block's ``TokenLogprob``s when the answer's logits hook asks for them
    strand_rows: int = 0  # token rows of the call's side strands (a token tree; 0: a chain)
