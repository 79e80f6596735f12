"""mlx-lm's own caches for a model PTP does not patch, behind the verbs a conversation's prompt cache uses.

``PTPModel.make_cache`` returns a ``KVState`` (``model/kv.py``) for every model PTP patches and a ``StockCache`` for
the others (an SSM such as mamba, a family PTP has not verified): both answer ``offset``, ``can_trim_to`` and
``trim_to``, so ``PromptCache`` and everything above it treat them alike. Chosen over asking each caller to tell
the kinds apart: the one place that knows mlx-lm's cache objects is here, and the callers have no special case.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache


class StockCache(Sequence):
    """mlx-lm's per-layer cache list (``model(x, cache=stock)`` iterates it as mlx-lm expects).

    ``offset``: the tokens it holds, read off a layer that counts them (``KVCache``, ``RotatingKVCache``); None
    when no layer does (pure SSM state), and such a cache is never reused: its holder cannot say what it holds.
    Trimming goes through mlx-lm's ``trim_prompt_cache``; state that cannot be rewound (SSM) trims only to where
    it already is."""

    def __init__(self, layers: list):
        self.layers = list(layers)

    @classmethod
    def for_model(cls, model) -> StockCache:
        return cls(make_prompt_cache(model))

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    @property
    def offset(self) -> int | None:
        for c in self.layers:
            n = getattr(c, "offset", None)
            if isinstance(n, int):
                return n
        return None

    def can_trim_to(self, n: int) -> bool:
        """Whether ``trim_to(n)`` can keep exactly the first ``n`` tokens."""
        have = self.offset
        if have is None or not 0 <= n <= have:
            return False
        return n == have or can_trim_prompt_cache(self.layers)

    def trim_to(self, n: int) -> None:
        """Keep the first ``n`` tokens (``can_trim_to(n)`` must hold)."""
        if not self.can_trim_to(n):
            raise ValueError(f"cannot trim this {type(self.layers[0]).__name__} cache to {n} tokens")
        if n < self.offset:
            trim_prompt_cache(self.layers, self.offset - n)
