"""What stays constant over one answer's PTP calls, held once instead of passed to every call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .accept import EXACT, AcceptRule

if TYPE_CHECKING:
    from ..model.kv import KVState
    from ..model.ptp import PTPModel
    from ..sampler import SamplingSettings, UniformStream
    from .fixed import CompileBank


@dataclass
class DecodeSession:
    """One answer's model, K/V state, uniforms and settings, and how its calls run.

    ``greedy_u``: the adapter's reserved "draft the argmax" uniform under greedy decoding (None: the answer's own
    uniforms). ``hook``: the answer's ``LogitsHook`` (its calls then run eagerly). ``bank``: the compiled
    fixed-shape calls (None: the eager pass of ``PTPModel.__call__``). ``runner_up`` / ``reads_top_prob``: what the
    drafter reads from every call's auxiliary rows besides their argmax and confidence."""

    pm: PTPModel
    cache: KVState
    uniforms: UniformStream
    settings: SamplingSettings
    greedy_u: float | None = None
    hook: object | None = None
    bank: CompileBank | None = None
    runner_up: bool = False
    reads_top_prob: bool = False
    rule: AcceptRule = EXACT  # the acceptance rule (decode/accept.py): exact unless the answer opted out


@dataclass(frozen=True)
class CallRecord:
    """What one decoding call (a PTP call or an autoregressive step) reports with its block."""

    time: float  # seconds of wall time for this call, as the decoding loop saw it
    proposed: int = 0  # drafts verified (0 for an autoregressive step)
    accepted: int = 0  # drafts accepted
    rows: int = 1  # rows of the pass (token rows and auxiliaries)
    source: str | None = None  # who proposed the accepted drafts ("ptp", "alt", "lookup"); None: none
    logprobs: list | None = None  # the block's ``TokenLogprob``s when the answer's logits hook asks for them
