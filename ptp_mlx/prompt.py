"""Prompts as token ids: a prompt string or chat messages through the tokenizer's chat template
(``encode_prompt``), and where a chat's current turn starts in them (``turn_start``)."""

from __future__ import annotations

from collections.abc import Sequence


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
    except Exception:
        return len(ids)
    before = list(before["input_ids"] if isinstance(before, dict) else before)
    return next((k for k, (a, b) in enumerate(zip(before, ids, strict=False)) if a != b), min(len(before), len(ids)))
