"""What a PTP call returns, with a name (docs/method.md, section 5). The call's rows are its ``CallShape``
(``model/shape.py``: the model's one description of a pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class CallOutputs:
    """What a call returns (lazy arrays until read)."""

    targets: mx.array  # int32 [n_tok]: the exact token at every token row (pick of its u under the base model)
    accepted: mx.array  # int32 []: leading chain drafts equal to their targets
    aux_top: mx.array | None = None  # int32 [n_aux]: each auxiliary row's argmax (the next drafts)
    aux_conf: mx.array | None = None  # float32 [n_aux]: its probability (softmax at T 1)
    second: mx.array | None = None  # int32 [n_aux]: the runner-up (``runner_up``)
    second_conf: mx.array | None = None  # float32 [n_aux]: its probability
    top_prob: mx.array | None = None  # float32 [n_aux]: top probability at the sampling temperature
    scored: list[mx.array] | None = None  # what a logits hook reads back for logprobs (eager calls only)
    # float32 [n_tok, vocab]: the token rows' logits, where a target may read UNRESOLVED (sampler.py, ``resolve``)
    target_logits: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        fields = (self.targets, self.accepted, self.aux_top, self.aux_conf, self.second, self.second_conf)
        return [a for a in (*fields, self.top_prob, self.target_logits) if a is not None] + list(self.scored or [])
