"""A conversation's KV cache carried from one answer to the next (the chat, the server's LRU, the bench's turns)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .model.kv import KVState
from .model.ptp import PTPModel
from .model.stock_cache import StockCache


@dataclass
class PromptCache:
    """A conversation's KV cache and the tokens it holds, carried from one answer to the next (as
    ``mlx_lm.chat`` does): the next prompt prefills only what follows their longest common prefix.

    Either cache kind of ``PTPModel.make_cache`` (``KVState``, or mlx-lm's own as a ``StockCache``) through the
    verbs both have; a cache that cannot keep the shared prefix (SSM state) is replaced by a fresh one, and one
    that cannot say what it holds (``offset`` None) is not kept at all: such a model prefills every prompt whole."""

    cache: KVState | StockCache | None = None
    tokens: list[int] = field(default_factory=list)
    reused: int = 0  # prompt tokens the last answer did not have to prefill
    lease: KVState | StockCache | None = field(default=None, repr=False)  # the cache the latest answer took

    def take(self, pm: PTPModel, prompt_ids: list[int]) -> tuple[KVState | StockCache, int]:
        """A cache holding a prefix of ``prompt_ids[:-1]`` and that prefix's length (0: a fresh cache)."""
        cache, self.cache = self.cache, None  # invalid while a generation works on it
        if cache is None or cache.offset != len(self.tokens):  # (a failed call leaves rows it did not trim)
            cache, keep = pm.make_cache(), 0
        else:
            keep = 0
            limit = min(len(self.tokens), len(prompt_ids) - 1)
            while keep < limit and self.tokens[keep] == prompt_ids[keep]:
                keep += 1
            if cache.can_trim_to(keep):
                cache.trim_to(keep)  # drop what the new prompt does not share (the end of the last answer, at least)
            else:  # (state that cannot be rewound past what the new prompt changes)
                cache, keep = pm.make_cache(), 0
        self.lease = cache
        return cache, keep

    def store(self, cache: KVState | StockCache, seq: list[int]) -> None:
        """Record ``cache`` as holding ``seq[:offset]``, unless a later answer has taken the cache over since (or
        the cache cannot say what it holds)."""
        if self.lease is cache and cache.offset is not None:
            self.cache, self.tokens = cache, seq[: cache.offset]
