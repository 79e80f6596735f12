"""Logits processing and log-probabilities as exact parts of the sampler (OpenAI's ``frequency_penalty``,
``presence_penalty``, ``logit_bias``, ``logprobs``).

Plain decoding and PTP verification both call ``LogitsHook.rows`` on the logits of every row before ``pick``,
so both sample from the same processed logits and stay token for token identical. A row's penalty counts the
answer's tokens before that row: those already emitted (``commit``), plus, in a PTP call, the drafts between the
call's first row and that row (``extra``), plus, in pipelined plain decoding, the token not yet read back
(``pending``). Prompt tokens are not counted (as vLLM; OpenAI says "the text so far").

Log-probabilities are those of the distribution the token was sampled from before truncation: the log-softmax of
the processed logits at the request's temperature (temperature 1 when greedy), from the verifying pass's own
logits. ``top_k``/``top_p`` are not applied to them (they would give ``-inf`` to every dropped token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .cdf import work_dtype

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class LogitsSettings:
    """A request's logits processing (all off by default: decoding is then untouched)."""

    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence of the token in the answer
    presence_penalty: float = 0.0  # subtracted once if the token occurs earlier in the answer
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: also the k most likely
    grammar: str | None = None  # an llguidance grammar the answer must follow (ptp_mlx/constrain.py)

    @property
    def penalised(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty)

    @property
    def active(self) -> bool:
        return self.penalised or bool(self.logit_bias) or self.logprobs is not None or self.grammar is not None

    def validate(self, vocab: int | None = None) -> LogitsSettings:
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not np.isfinite(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        for t, b in self.logit_bias.items():
            if vocab is not None and not 0 <= t < vocab:
                raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {t}")
            if not np.isfinite(b) or not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}")
        return self


@dataclass
class TokenLogprob:
    """One emitted token's log-probability and the most likely alternatives (descending)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class LogitsHook:
    """The per-answer state of ``LogitsSettings``: the counts of the tokens emitted so far (on the device, so
    pipelined plain decoding never waits for them)."""

    def __init__(self, settings: LogitsSettings, temperature: float, tokenizer=None) -> None:
        self.s = settings
        self.temperature = temperature if temperature > 0 else 1.0
        self.counts: mx.array | None = None  # float32 [V]: occurrences of each token in the answer so far
        self._bias: mx.array | None = None
        self.tokenizer = tokenizer  # for the grammar
        self.constraint = None

    def _setup(self, vocab: int) -> None:
        if self.counts is None:
            if self.s.grammar is not None:
                from .constrain import Constraint

                self.constraint = Constraint(self.tokenizer, self.s.grammar, vocab)
            self.counts = mx.zeros((vocab,), dtype=mx.float32)
            if self.s.logit_bias:
                b = np.zeros(vocab, dtype=np.float32)
                for t, v in self.s.logit_bias.items():
                    b[t] = v
                self._bias = mx.array(b)

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens emitted (read back on the host): later rows count them."""
        if self.s.penalised and tokens and self.counts is not None:
            self.counts = self.counts.at[mx.array(list(tokens))].add(1.0)
        if self.constraint is not None:
            self.constraint.commit(tokens)

    def rows(
        self, logits: mx.array, extra: Sequence[Sequence[int]] | None = None, pending: mx.array | None = None
    ) -> mx.array:
        """Processed logits ``[R, V]`` of ``R`` rows. ``extra[r]``: tokens between the committed answer and row
        ``r`` (a PTP call's drafts before that row); ``pending``: one token every row follows that is not yet
        committed (pipelined plain decoding)."""
        self._setup(logits.shape[-1])
        x = logits.astype(mx.float32)
        if self.s.penalised:
            counts = self.counts[None]
            if pending is not None:
                counts = counts + (mx.arange(x.shape[-1]) == pending.reshape(-1)[0]).astype(mx.float32)[None]
            pairs = [(r, t) for r, toks in enumerate(extra or []) for t in toks]
            if pairs:
                r_idx, t_idx = mx.array([p[0] for p in pairs]), mx.array([p[1] for p in pairs])
                counts = counts + mx.zeros(x.shape, dtype=mx.float32).at[r_idx, t_idx].add(1.0)
            x = x - self.s.frequency_penalty * counts - self.s.presence_penalty * (counts > 0).astype(mx.float32)
        if self._bias is not None:
            x = x + self._bias
        if self.constraint is not None:
            # The grammar state needs the tokens on the host: a pending token is read back here (a sync that
            # pipelined plain decoding otherwise avoids).
            before = [int(pending.reshape(-1)[0].item())] if pending is not None else []
            rows = [before + list(t) for t in (extra or [[]] * x.shape[0])]
            x = mx.where(mx.array(self.constraint.masks(rows)), x, -mx.inf)
        return x

    def score(self, processed: mx.array, tokens: mx.array) -> list[mx.array] | None:
        """Lazy log-probabilities of ``tokens`` (one per row) and the top alternatives: evaluate them with the
        call's own sync, then ``read``. ``None`` when the request asked for none."""
        k = self.s.logprobs
        if k is None:
            return None
        ls = processed.astype(work_dtype())  # float64 on the CPU, as the sampler's softmax
        ls = ls / self.temperature if self.temperature != 1 else ls
        ls = ls - mx.logsumexp(ls, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(ls, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
        if k == 0:
            return [chosen]
        ids = mx.argpartition(-ls, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(ls, ids, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        return [chosen, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)]

    @staticmethod
    def read(scored: list[mx.array] | None, rows: Sequence[int], tokens: Sequence[int]) -> list[TokenLogprob] | None:
        """The evaluated ``score`` of ``rows`` (the emitted tokens' rows, in order)."""
        if scored is None:
            return None
        chosen = scored[0].tolist()
        ids = scored[1].tolist() if len(scored) > 1 else None
        vals = scored[2].tolist() if len(scored) > 1 else None
        out = []
        for r, t in zip(rows, tokens, strict=True):
            # Tokens a grammar rules out have probability 0 (log -inf): they are no alternatives.
            top = [(i, v) for i, v in zip(ids[r], vals[r], strict=True) if v > -np.inf] if ids is not None else []
            out.append(TokenLogprob(int(t), float(chosen[r]), top))
        return out
