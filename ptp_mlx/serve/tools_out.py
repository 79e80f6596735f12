"""What one answer shows the client: its text after stop strings, the log-probabilities of the tokens behind that
text, and the tool calls split out of it (ptp_mlx/tools.py)."""

from __future__ import annotations

from ..logits import TokenLogprob
from ..tools import ToolCallSplitter, parse_tool_calls, supports_tools
from .stops import StopMatcher


class AnswerText:
    """Feed ``GenerationStep``s; get the text to send and the chat-shaped log-probability entries of its tokens.

    Tokens past a stop string are not reported (a token counts when its text starts before the cut), and a token's
    entry waits while its text is held back as the possible start of a stop string. With tools, the text of tool
    calls is held out of the content and parsed at the end."""

    def __init__(self, tokenizer, stops: StopMatcher, tools: list | None) -> None:
        self.tok, self.stops, self.tools = tokenizer, stops, tools
        self.split = None
        if tools and supports_tools(tokenizer):
            self.split = ToolCallSplitter(tokenizer.tool_call_start, tokenizer.tool_call_end)
        self._bytemap: dict | None = None  # byte-level BPE symbol -> byte ({}: not a byte-level tokenizer)
        self.seen = 0  # characters of the model's text so far
        self.emitted = 0  # characters of it the stop strings let through
        self.pending: list[tuple[int, dict]] = []  # entries not sent yet, by where their token's text starts

    def _token(self, t: int) -> tuple[str, list[int]]:
        """A token's text and its exact bytes (a byte-level BPE token may hold part of a character: its text then
        shows U+FFFD, its bytes are exact, as OpenAI's ``bytes``)."""
        if self._bytemap is None:
            from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder

            bpe = isinstance(self.tok.detokenizer, BPEStreamingDetokenizer)
            self._bytemap = _byte_decoder() if bpe else {}
        sym = self.tok.convert_ids_to_tokens(t) if self._bytemap else None
        if isinstance(sym, str) and sym and all(c in self._bytemap for c in sym):
            raw = bytes(self._bytemap[c] for c in sym)
            return raw.decode("utf-8", "replace"), list(raw)
        s = self.tok.decode([t])
        return s, list(s.encode("utf-8"))

    def entry(self, lp: TokenLogprob) -> dict:
        text, raw = self._token(lp.token)
        top = []
        for t, v in lp.top:
            tt, tb = self._token(t)
            top.append({"token": tt, "logprob": v, "bytes": tb})
        return {"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}

    def feed(self, step) -> tuple[str, list[dict] | None]:
        entries = [self.entry(lp) for lp in step.logprobs] if step.logprobs is not None else None
        start = self.seen
        for e in entries or ():
            self.pending.append((start, e))
            start += len(e["token"])
        text = self.stops.feed(step.text)
        self.emitted += len(text)
        self.seen += len(step.text)
        if entries is not None or self.pending:
            # (entries whose text starts inside what was emitted go now; past a stop string, the rest never do)
            entries = [e for at, e in self.pending if at < self.emitted]
            self.pending = [] if self.stops.stopped else [(at, e) for at, e in self.pending if at >= self.emitted]
        if self.split is not None:
            text = self.split.feed(text)
        return text, entries

    def finish(self) -> tuple[str, list[dict] | None, list]:
        """The text still held, its tokens' entries (None: none waited), and the parsed tool calls. A call that
        does not parse is returned as text."""
        tail = self.stops.flush()
        entries = [e for _, e in self.pending] if self.pending else None
        self.pending = []
        if self.split is None:
            return tail, entries, []
        tail = self.split.feed(tail) + self.split.flush()
        raw = [c for c in self.split.calls if c.strip()]
        try:
            return tail, entries, parse_tool_calls(self.tok, raw, self.tools)
        except ValueError:
            start, end = self.tok.tool_call_start, self.tok.tool_call_end
            return tail + "".join(start + c + end for c in self.split.calls), entries, []
