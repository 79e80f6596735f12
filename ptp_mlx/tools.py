"""Tool calls: the tool definitions go to the model's chat template, and the calls come back out of the answer in
the format that template defines (mlx-lm's tokenizer wrapper knows it: ``tool_call_start``/``tool_call_end`` and
a ``tool_parser``, inferred from the template, as ``mlx_lm.server`` does).

``ToolCallSplitter`` separates a streamed answer into its plain text and the raw text of each call, holding back
anything that could be the start of a call marker; ``parse_tool_calls`` turns the raw texts into OpenAI
``tool_calls``.
"""

from __future__ import annotations

import json
import uuid


def supports_tools(tokenizer) -> bool:
    """Whether the model's chat template defines a tool-call format mlx-lm can parse."""
    return bool(getattr(tokenizer, "has_tool_calling", False)) and getattr(tokenizer, "tool_parser", None) is not None


class ToolCallSplitter:
    """Feed text deltas; get back the plain text that is safe to emit. The text between ``start`` and ``end``
    markers is collected in ``calls`` (a call still open when the answer ends is kept as it stands)."""

    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self.held = ""
        self.inside = False
        self.calls: list[str] = []

    def feed(self, delta: str) -> str:
        text, out = self.held + delta, []
        self.held = ""
        while text:
            marker = self.end if self.inside else self.start
            i = text.find(marker)
            if i >= 0:
                if self.inside:
                    self.calls[-1] += text[:i]
                else:
                    out.append(text[:i])
                    self.calls.append("")
                self.inside = not self.inside
                text = text[i + len(marker) :]
                continue
            keep = next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)
            body, self.held = text[: len(text) - keep], text[len(text) - keep :]
            if self.inside:
                self.calls[-1] += body
            else:
                out.append(body)
            break
        return "".join(out)

    def flush(self) -> str:
        """What is still held when the answer ends (inside a call: added to it)."""
        held, self.held = self.held, ""
        if self.inside:
            self.calls[-1] += held
            return ""
        return held


def parse_tool_calls(tokenizer, raw_calls: list[str], tools: list | None) -> list[dict]:
    """OpenAI ``tool_calls`` from the raw call texts (``ValueError`` on a call the template's parser rejects)."""
    out = []
    for raw in raw_calls:
        try:
            parsed = tokenizer.tool_parser(raw, tools)
        except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"the model wrote a tool call that does not parse: {raw.strip()[:200]!r} ({e})") from None
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError(f"the model wrote a tool call without a name: {raw.strip()[:200]!r}")
            args = call.get("arguments", {})
            out.append(
                {
                    "id": call.get("id") or "call_" + uuid.uuid4().hex[:24],
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                    },
                }
            )
    return out
