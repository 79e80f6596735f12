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
    fixed-shape calls (None: the eager pass of ``PTPModel.__call__``). ``runner_up`` / ``mode_mass``: what the
    drafter reads from every call's auxiliary rows besides their argmax and confidence."""

    pm: PTPModel
    cache: KVState
    uniforms: UniformStream
    settings: SamplingSettings
    greedy_u: float | None = None
    hook: object | None = None
    bank: CompileBank | None = None
    runner_up: bool = False
    mode_mass: bool = False
    rule: AcceptRule = EXACT  # the acceptance rule (decode/accept.py): exact unless the answer opted out
