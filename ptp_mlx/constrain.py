"""Constrained decoding (``response_format`` json_object / json_schema) as a logits mask, on llguidance's matcher.

A row's mask is the set of tokens the grammar allows after the answer's tokens before that row: the committed
answer plus, in a PTP call, the drafts before the row (the matcher consumes them, computes the mask and rolls
back). Plain decoding and PTP verification mask the same logits the same way, so PTP is lossless with respect to
the constrained distribution: each emitted token is ``pick(u, masked logits)`` exactly as plain decoding draws it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import numpy as np


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:  # the serve extra installs it
        raise ValueError(f"constrained output needs llguidance (pip install 'ptp-mlx[serve]'): {e}") from None
    return llguidance


def json_grammar(schema: dict | None) -> str:
    """The grammar of JSON text matching ``schema`` (None: any JSON object, OpenAI's ``json_object``).
    ``ValueError`` when the schema cannot be compiled."""
    ll = _llguidance()
    try:
        grammar = ll.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, defaults={"whitespace_flexible": False}
        )
    except (ValueError, TypeError) as e:
        raise ValueError(f"the JSON schema is not usable: {e}") from None
    err = ll.LLMatcher.validate_grammar(grammar)
    if err:
        raise ValueError(f"the JSON schema is not usable: {err.splitlines()[0]}")
    return grammar


@functools.lru_cache(maxsize=4)
def _lltokenizer(hf_tokenizer, vocab: int, eos: tuple[int, ...]):
    # About a second for a large vocabulary: cached per tokenizer.
    return _llguidance().hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=list(eos))


class Constraint:
    """The grammar state of one answer: ``masks`` for a call's rows, ``commit`` for emitted tokens."""

    def __init__(self, tokenizer, grammar: str, vocab: int) -> None:
        ll = _llguidance()
        hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the Hugging Face tokenizer
        eos = tuple(sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id]))
        self.matcher = ll.LLMatcher(_lltokenizer(hf, vocab, eos), grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the grammar is not usable: {self.matcher.get_error()}")
        self.vocab = vocab
        self.words = (vocab + 31) // 32

    def _mask(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)

    def masks(self, extra: Sequence[Sequence[int]]) -> np.ndarray:
        """Allowed tokens ``[R, V]`` for rows following the committed answer plus ``extra[r]``. A row behind a
        token the grammar refuses can never be accepted (its predecessor's row masked that token): it gets the
        mask of the last valid state."""
        out = np.zeros((len(extra), self.vocab), dtype=bool)
        m = self.matcher
        for r, toks in enumerate(extra):
            n = m.try_consume_tokens(list(toks))
            out[r] = self._mask()
            if n:
                m.rollback(n)
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        if not self.matcher.is_stopped():
            self.matcher.try_consume_tokens(list(tokens))


def schema_of(response_format: dict) -> dict | None:
    """The schema of an OpenAI ``response_format`` (None for json_object); ``ValueError`` on a malformed one."""
    if response_format["type"] == "json_object":
        return None
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise ValueError("'json_schema' must be an object with a 'schema'")
    schema = spec.get("schema", {})
    return json.loads(json.dumps(schema)) if isinstance(schema, dict) else {}
