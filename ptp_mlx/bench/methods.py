"""The decoders a benchmark compares, each behind one call: token ids in, a ``Measured`` answer out.

- ``mlx-lm``: plain ``mlx_lm.stream_generate`` on the same weights (what a user would otherwise run);
- ``mlx-lm-draft``: the same with mlx-lm's own speculative decoding and a draft model;
- ``ar`` and ``ptp``: our ``Engine.generate`` in autoregressive and PTP mode.

Every runner times the whole call on the host, prefill included (Spec-Bench's wall time), and counts model
calls so that mean accepted tokens per call is comparable across methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..sampler import SamplingSettings
from ..stats import RunStats

# ptp-chain: PTP with the adapter's chain only (no prompt lookup, no sibling strands); ptp-lenient: PTP under the
# lenient acceptance rule of ``--accept`` (not the exact sample: never in the lossless check)
METHODS = ("mlx-lm", "ar", "ptp", "ptp-chain", "ptp-lenient", "mlx-lm-draft")


@dataclass
class Measured:
    """One answer of one method, with the figures the report needs."""

    token_ids: list[int]
    calls: int  # calls of the target model
    accepted_sum: int  # sum over calls of the tokens each call settled (accepted drafts + 1)
    wall_time: float  # seconds from the call to the last token, prefill included
    first_time: float  # seconds until the first tokens reached the host (prefill + first call)
    first_tokens: int  # tokens that arrived with the first call
    peak_memory: float  # GB, MLX's peak since the call started
    finish_reason: str | None
    cpu_time: float = 0.0  # process CPU seconds (all threads): robust to other load on a CPU-only machine
    # accepted drafts per proposer ("ptp", "lookup"; "ptp-strand", "lookup-strand": through a token tree's strand)
    by_source: dict[str, int] = field(default_factory=dict)
    trees: dict = field(default_factory=dict)  # ``RunStats.tree_dict``: calls and tokens by tree size, strand depths


Runner = Callable[[list[int], int, SamplingSettings, int], Measured]  # ids, max tokens, sampling, turn start


class EngineRunner:
    """Our decoder: ``Engine.generate`` in ``mode`` ("ar" or "ptp")."""

    def __init__(
        self,
        engine,
        mode: str,
        step: str = "fused",
        num_draft_tokens: int | None = None,
        lookup: bool = True,
        accept=None,
    ):
        self.engine = engine
        self.mode = mode
        self.step = step
        self.num_draft_tokens = num_draft_tokens if mode == "ptp" else None
        self.lookup = lookup
        self.accept = accept
        self.name = "ptp-lenient" if accept is not None else mode if lookup or mode != "ptp" else "ptp-chain"

    def __call__(self, ids: list[int], max_tokens: int, sampling: SamplingSettings, turn_start: int = 0) -> Measured:
        """One answer to ``ids``; ``turn_start``: where its last user message starts (``Engine.generate``)."""
        mx.clear_cache()
        toks: list[int] = []
        first_tokens = 0
        first_time = 0.0
        finish = None
        peak = 0.0
        stats = RunStats()
        c0, t0 = time.process_time(), time.perf_counter()
        for st in self.engine.generate(
            ids,
            mode=self.mode,
            sampling=sampling,
            max_tokens=max_tokens,
            step=self.step,
            num_draft_tokens=self.num_draft_tokens,
            lookup=self.lookup,
            trees=self.lookup,  # ptp-chain turns both off
            accept=self.accept,
            turn_start=turn_start,
        ):
            stats.add(st, final=False)  # (the one per-step aggregator: ptp_mlx/stats.py)
            if not toks and st.tokens:
                first_time, first_tokens = time.perf_counter() - t0, len(st.tokens)
            toks.extend(st.tokens)
            finish = st.finish_reason
            peak = max(peak, st.peak_memory)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        acc = sum(k * v for k, v in stats.histogram.items())  # tokens settled: accepted drafts + 1 per call
        by_source = dict(stats.by_source)
        return Measured(
            toks, stats.calls, acc, wall, first_time, first_tokens, peak, finish, cpu, by_source, stats.tree_dict()
        )


class MlxLmRunner:
    """mlx-lm's own ``stream_generate`` (optionally with its speculative decoding) on the given weights."""

    def __init__(self, model, tokenizer, draft_model=None, num_draft_tokens: int = 2):
        self.model = model
        self.tokenizer = tokenizer
        self.draft_model = draft_model
        self.num_draft_tokens = num_draft_tokens
        self.name = "mlx-lm-draft" if draft_model is not None else "mlx-lm"

    def sampler(self, s: SamplingSettings):
        """mlx-lm's sampler for ``s`` (``None`` = its greedy argmax). Not our exact sampler: same law, other draws."""
        if s.greedy:
            return None
        from mlx_lm.sample_utils import make_sampler

        return make_sampler(temp=s.temperature, top_p=s.top_p if s.top_p < 1.0 else 0.0, top_k=s.top_k)

    def __call__(self, ids: list[int], max_tokens: int, sampling: SamplingSettings, turn_start: int = 0) -> Measured:
        """One answer to ``ids`` (``turn_start`` is our decoding's: mlx-lm's has no lenient rule to restrict)."""
        import mlx_lm

        kw = {"sampler": self.sampler(sampling)}
        if self.draft_model is not None:
            kw.update(draft_model=self.draft_model, num_draft_tokens=self.num_draft_tokens)
        mx.random.seed(sampling.seed)
        mx.clear_cache()
        mx.reset_peak_memory()
        toks: list[int] = []
        responses = target_calls = 0
        first_time = 0.0
        finish = None
        c0, t0 = time.process_time(), time.perf_counter()
        for r in mlx_lm.stream_generate(self.model, self.tokenizer, list(ids), max_tokens=max_tokens, **kw):
            responses += 1
            target_calls += 0 if r.from_draft else 1  # a target call settles its drafts plus one own token
            if r.finish_reason == "stop":  # mlx-lm's last response carries the EOS token itself
                finish = "stop"
                break
            if not toks:
                first_time = time.perf_counter() - t0
            toks.append(int(r.token))
            finish = r.finish_reason
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        peak = mx.get_peak_memory() / 1e9
        return Measured(toks, max(target_calls, 1), responses, wall, first_time, 1 if toks else 0, peak, finish, cpu)


def make_runners(
    engine, methods: list[str], draft_model=None, num_draft_tokens: int | None = None, step: str = "fused", accept=None
) -> dict[str, Runner]:
    """Runners in the order of ``methods``; mlx-lm runners use the engine's own base weights.

    ``num_draft_tokens``: PTP's fixed draft budget (None: adaptive) and mlx-lm-draft's drafts per step (2)."""
    runners: dict[str, Runner] = {}
    for m in methods:
        if m == "mlx-lm":
            runners[m] = MlxLmRunner(engine.pm.base, engine.tokenizer)
        elif m == "mlx-lm-draft":
            runners[m] = MlxLmRunner(engine.pm.base, engine.tokenizer, draft_model, num_draft_tokens or 2)
        elif m in ("ar", "ptp"):
            runners[m] = EngineRunner(engine, m, step, num_draft_tokens)
        elif m == "ptp-lenient":
            runners[m] = EngineRunner(engine, "ptp", step, num_draft_tokens, accept=accept or "entropy")
        elif m == "ptp-chain":
            runners[m] = EngineRunner(engine, "ptp", step, num_draft_tokens, lookup=False)
        else:
            raise ValueError(f"unknown method {m!r} (known: {', '.join(METHODS)})")
    return runners
