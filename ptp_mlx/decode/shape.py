"""A PTP call's spec, inputs and outputs, each with a name (docs/method.md, section 5).

The rows of a call are its ``CallShape`` (``model/shape.py``: the model's one description of a pass). ``CallSpec``
adds what else fixes the call's graph (the sampling settings, the acceptance rule): with the attention bucket it
keys the compiled call (``decode/fixed.py``). ``CallInputs`` is what changes from call to call of one spec (the
arrays, where the offset comes from, and the host's processing of the rows); ``CallOutputs`` what a call returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..model.shape import CallShape
from ..sampler import SamplingSettings
from .accept import EXACT, AcceptRule


@dataclass(frozen=True)
class CallSpec:
    """What fixes a call's graph besides the attention bucket (frozen, hashable): its rows, the sampling settings
    and the acceptance rule."""

    shape: CallShape
    settings: SamplingSettings
    rule: AcceptRule = EXACT
    # rows of a token tree's strand the call moves in its own K/V buffers before its pass (0: none): a call chained
    # on a tree call, for the outcomes where the path took a strand (``CallInputs.move_src``, ``decode/ahead.py``)
    move: int = 0


@dataclass(frozen=True, eq=False)
class CallInputs:
    """What one call of a ``CallSpec`` takes (one record, so every function of a call takes it whole)."""

    tokens: mx.array  # int32 [n_tok]: the token rows' ids
    row_u: mx.array  # float32 [n_tok]: the token rows' uniforms
    aux_u: mx.array  # float32 [n_aux]: the auxiliary rows' uniforms
    # int32 []: the cache length before the call as an array (a chained call's, computed on the device, with its
    # largest value ``bound``: the buffers and the bucket hold that); None: the state's offset
    offset: mx.array | None = None
    bound: int | None = None
    offered: mx.array | None = None  # bool [vocab]: the context's tokens (a ``guarded`` rule's lookup calls)
    hook: object | None = None  # the answer's ``LogitsHook``: the call then runs eagerly
    # int32 [CallSpec.move] and []: the K/V rows the call reads and where the first is written, computed on the
    # device (rows already in place where the path took no strand)
    move_src: mx.array | None = None
    move_dst: mx.array | None = None
    prefixes: list | None = None  # per token row, the drafts before it (what the hook counts for that row)


@dataclass
class CallOutputs:
    """What a call returns (lazy arrays until read)."""

    targets: mx.array  # int32 [n_tok]: the exact token at every token row (pick of its u under the base model)
    accepted: mx.array  # int32 []: leading chain drafts equal to their targets
    aux_top: mx.array | None = None  # int32 [n_aux]: each auxiliary row's argmax (the next drafts)
    aux_conf: mx.array | None = None  # float32 [n_aux]: its probability (softmax at T 1)
    alt: mx.array | None = None  # int32 [n_aux, ALTS]: the runner-ups, best first (``runner_up``; fixed.py)
    alt_conf: mx.array | None = None  # float32 [n_aux, ALTS]: their probabilities
    top_prob: mx.array | None = None  # float32 [n_aux]: top probability at the sampling temperature
    scored: list[mx.array] | None = None  # what a logits hook reads back for logprobs (eager calls only)
    # float32 [n_tok, vocab]: the token rows' logits, where a target may read UNRESOLVED (sampler.py, ``resolve``)
    target_logits: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        fields = (self.targets, self.accepted, self.aux_top, self.aux_conf, self.alt, self.alt_conf)
        return [a for a in (*fields, self.top_prob, self.target_logits) if a is not None] + list(self.scored or [])
