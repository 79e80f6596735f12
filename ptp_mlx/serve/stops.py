"""Stop strings over streamed text: the answer is cut before the first stop string, even one that spans blocks."""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas, get back the text that is safe to emit.

    Text that could be the start of a stop string is held back until the next delta decides it, so nothing past
    a stop string is ever emitted, whatever the block boundaries."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """The part of ``held + delta`` that can be emitted; sets ``stopped`` when a stop string is found."""
        if self.stopped:
            return ""
        text = self.held + delta
        if not self.stops:
            self.held = ""
            return text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held, self.stopped = "", True
            return text[:cut]
        keep = 0  # the longest tail of text that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What is still held when the answer ends without a stop string."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out
