"""Acceptance statistics of a generation, printed in one fixed format by every command: the one per-step
aggregator of ``ptp-generate`` and the server (the chat keeps its own per-chat counts, restored with saved chats)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .generate import GenerationStep

TREE_SIZES = ((0, "chain"), (1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (10**9, "9+"))


def tree_size(strand_rows: int) -> str:
    """The bucket of a call's token tree by its side strands' token rows ("chain": none)."""
    return next(name for top, name in TREE_SIZES if strand_rows <= top)


def tree_line(method: str, trees: dict) -> str | None:
    """One report line: tokens per call by tree size, and how deep paths through a strand went; None: no tree."""
    calls, tokens = trees.get("calls", {}), trees.get("tokens", {})
    if not any(k != "chain" for k in calls):
        return None
    sizes = [name for _, name in TREE_SIZES if calls.get(name)]
    by_size = ", ".join(f"{k}: {tokens[k] / calls[k]:.2f} ({calls[k]} calls)" for k in sizes)
    depth = " ".join(f"{k}:{v}" for k, v in sorted(trees.get("strand_depth", {}).items(), key=lambda kv: int(kv[0])))
    return f"{method} tokens per call by strand rows: {by_size} | paths through a strand by accepted drafts: {depth or '-'}"


@dataclass
class RunStats:
    """Accumulates ``GenerationStep``s of one or more answers."""

    prompt_tokens: int = 0
    prompt_time: float = 0.0
    tokens: int = 0
    calls: int = 0
    gen_time: float = 0.0
    peak_memory: float = 0.0
    histogram: Counter = field(default_factory=Counter)  # tokens emitted per call -> count
    by_source: Counter = field(default_factory=Counter)  # accepted drafts per source ("ptp", "lookup", ...-strand)
    tree_calls: Counter = field(default_factory=Counter)  # PTP calls by tree size (``tree_size`` of strand rows)
    tree_tokens: Counter = field(default_factory=Counter)  # tokens those calls settled
    strand_depth: Counter = field(default_factory=Counter)  # accepted drafts of calls whose path took a strand
    proposed: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted

    def add(self, step: GenerationStep, final: bool) -> None:
        self.calls += 1
        self.proposed += step.proposed
        self.accepted += step.accepted
        self.tokens += len(step.tokens)
        self.histogram[step.accepted + 1] += 1
        if step.source:
            self.by_source[step.source] += step.accepted
        if step.proposed or step.rows > 1:  # a PTP call (not a plain step)
            size = tree_size(step.strand_rows)
            self.tree_calls[size] += 1
            self.tree_tokens[size] += step.accepted + 1
            if step.source and step.source.endswith("-strand"):
                self.strand_depth[step.accepted] += 1
        self.peak_memory = max(self.peak_memory, step.peak_memory)
        if final:
            self.prompt_tokens += step.prompt_tokens
            self.prompt_time += step.prompt_time
            self.gen_time += step.elapsed

    def consume(self, steps):
        """Iterate ``steps``, accumulating, and yield them on."""
        last = None
        for st in steps:
            if last is not None:
                self.add(last, final=False)
            last = st
            yield st
        if last is not None:
            self.add(last, final=True)

    def tree_dict(self) -> dict:
        """The token-tree figures (JSON-ready): PTP calls and tokens by tree size, accepted depth through strands."""
        return {
            "calls": dict(self.tree_calls),
            "tokens": dict(self.tree_tokens),
            "strand_depth": {str(k): v for k, v in sorted(self.strand_depth.items())},
        }

    @property
    def mean_accepted(self) -> float:
        """Tokens per call: accepted drafts plus the exact token (1.0 for autoregressive decoding)."""
        return sum(k * v for k, v in self.histogram.items()) / max(1, self.calls)

    @property
    def generation_tps(self) -> float:
        return self.tokens / self.gen_time if self.gen_time > 0 else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time > 0 else 0.0

    def summary(self) -> str:
        return (
            f"prompt {self.prompt_tps:.1f} tok/s | generation {self.generation_tps:.1f} tok/s | "
            f"mean accepted {self.mean_accepted:.2f} tokens/call | peak memory {self.peak_memory:.2f} GB"
        )

    def histogram_line(self) -> str:
        parts = " ".join(f"{k}:{self.histogram[k]}" for k in sorted(self.histogram))
        src = ", ".join(f"{k} {v}" for k, v in sorted(self.by_source.items()))
        return f"accepted per call (tokens:calls) {parts}" + (f" | accepted drafts by source: {src}" if src else "")
