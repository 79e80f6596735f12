"""The engine: a loaded model, its tokenizer and adapter, and a ready decoding budget.

The CLI, the chat, the bench and the tests all build one ``Engine`` and iterate ``Engine.generate``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from . import blas
from .adapter import adapter_for, load_adapter, shipped_adapter
from .decode.accept import EXACT, AcceptRule
from .decode.chain_odds import choice_at
from .decode.fixed import compiled_by_default
from .decode.probe import cached_cost_curve
from .drafting.budget import Budget
from .drafting.cost import CostCurve
from .drafting.policy import DraftingConfig
from .errors import UserError
from .generate import DecodeOptions, GenerationStep, stream_generate
from .kernels.graph_tools import module as graph_tools
from .kernels.packed import pack_halves, pack_model, registered, release_with
from .logits import LogitsHook, LogitsSettings
from .model.block import block_layers
from .model.layers import weight_matrices
from .model.ptp import PTPModel
from .models import check_ptp_model, load, model_fingerprint
from .paths import DEFAULT_MODEL_NAME, cache_root
from .prompt import encode_prompt, turn_start
from .prompt_cache import PromptCache
from .sampler import SamplingSettings


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


@dataclass
class Engine:
    pm: PTPModel
    tokenizer: object
    model_path: str
    adapter_path: str | None = None
    budget: Budget | None = None
    # Per decoding mode (greedy / sampled) when the adapter records separate acceptance histograms.
    mode_budgets: dict[str, Budget] = field(default_factory=dict)
    log: object = field(default=_stderr, repr=False)

    @classmethod
    def load(
        cls,
        model: str | None = None,
        adapter: str | None = None,
        log=_stderr,
        measure_cost: bool = True,
        recalibrate: bool = False,
    ) -> Engine:
        """Load ``model`` (default: the default model) and ``adapter``.

        ``adapter=None`` takes the adapter shipped for the default model (if any); ``"none"`` loads none.
        ``recalibrate`` probes this machine's cost curve again instead of reading the cached one.
        """
        blas.warn_if_slow()
        adapter_dir: Path | None
        if adapter is None:
            adapter_dir = shipped_adapter(DEFAULT_MODEL_NAME) if model is None else None
        elif str(adapter).lower() == "none":
            adapter_dir = None
        else:
            adapter_dir = Path(adapter).expanduser()
            if not adapter_dir.exists():
                raise UserError(f"adapter folder not found: {adapter}")
        if adapter_dir is not None:
            check_ptp_model(model)  # before any weights load
        base, tokenizer = load(model, log=log)
        if adapter is None:
            from .model.layers import SUPPORTED_MODEL_TYPES, model_type

            if model_type(base) in SUPPORTED_MODEL_TYPES:
                # Adapters follow the model (its fingerprint), not the flag; one the user installed comes first.
                found = adapter_for(base, shipped=adapter_dir is None)
                if found is not None:
                    adapter_dir = found
                    log(f"using the adapter made for this model: {adapter_dir}")
        ad, cfg = load_adapter(adapter_dir, base) if adapter_dir else (None, None)
        pm = PTPModel(base, ad, cfg, fuse=True)
        # ptp-sgemm reads a quantized file's weights from their codes (kernels/packed.py): the same floats
        weights, lora_a = weight_matrices(base), pm.lora_matrices()
        pack_model(weights, log=log)
        pack_halves(lora_a)  # the adapter's A rows at the bfloat16 precision they are held at
        release_with(pm, weights + lora_a)
        eng = cls(
            pm=pm,
            tokenizer=tokenizer,
            model_path=str(model or DEFAULT_MODEL_NAME),
            adapter_path=str(adapter_dir) if adapter_dir else None,
            log=log,
        )
        if ad is not None:
            graph_tools()  # (built once per machine, at the first start rather than inside the first answer)
            eng.budget = eng.make_budget(measure_cost, recalibrate)
        return eng

    def make_budget(self, measure: bool = True, recalibrate: bool = False) -> Budget:
        """The adaptive budget over this machine's cost curve (cached under ``PTP_MLX_HOME/cost-curves/``, probed
        once, then corrected by every call: ``drafting/learn.py``); one per decoding mode, sharing the curve."""
        c = self.pm.config
        width = c.window
        if measure:
            # The curve depends on the machine, the model and the adapter's shape (rank, LoRA layers).
            ident = [
                model_fingerprint(self.pm.base),
                str(mx.default_device()),
                blas.state["blas"],
                c.rank,
                list(c.layers) if c.layers is not None else None,
                list(c.target_modules) if c.target_modules is not None else None,
                # bump when the cost of a PTP call changes (v4: real calls, pipelined AR step; v5: compiled calls)
                f"ptp-call-v5-{'compiled' if compiled_by_default() else 'eager'}",
                registered(weight_matrices(self.pm.base)),  # its weights read from codes: rows cost more
                block_layers(self.pm.base),  # its layers one primitive each (model/block.py): a cheaper step
            ]
            key = hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()[:16]
            curve = cached_cost_curve(self.pm, key, cache_root() / "cost-curves", self.log, recalibrate)
            # (whether building the next call ahead pays: learnt per machine, model and adapter too)
            choice_at(self.pm, cache_root() / "cost-curves" / f"chain-choice-{key}.json", recalibrate)
        else:
            curve = CostCurve()
        # Calibrated: each budget learns, over this engine's answers, how its drafts really fare.
        self.mode_budgets = {
            m: Budget.from_histogram(curve, list(h), width, calibrate=True) for m, h in c.acceptance_histograms.items()
        }
        hist = list(c.acceptance_histogram) if c.acceptance_histogram else None
        return Budget.from_histogram(curve, hist, width, calibrate=True)

    def budget_for(self, sampling: SamplingSettings) -> Budget | None:
        """The budget primed with the acceptance seen in this decoding mode (greedy drafts land more often)."""
        return self.mode_budgets.get("greedy" if sampling.greedy else "sampled", self.budget)

    @property
    def has_adapter(self) -> bool:
        return self.pm.adapter is not None

    def default_mode(self) -> str:
        return "ptp" if self.has_adapter else "ar"

    def new_prompt_cache(self) -> PromptCache:
        """An empty cache to carry one conversation from answer to answer (``generate(prompt_cache=...)``)."""
        return PromptCache()

    def encode(self, prompt: str | Sequence[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt string or chat messages; ``tools`` (OpenAI function definitions) go to the chat
        template, as mlx-lm passes them."""
        if not tools:
            return encode_prompt(self.tokenizer, prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def turn_start(self, messages: Sequence[dict], ids: Sequence[int], tools: list[dict] | None = None) -> int:
        """Where the last user message starts in ``ids``, the prompt of ``messages`` (``generate.turn_start``)."""
        return turn_start(self.tokenizer, messages, ids, tools)

    def generate(
        self,
        prompt: str | Sequence[dict] | Sequence[int],
        mode: str | None = None,
        sampling: SamplingSettings | None = None,
        max_tokens: int = 256,
        step: str = "fused",
        num_draft_tokens: int | None = None,
        prompt_cache: PromptCache | None = None,
        lookup: bool = True,
        trees: bool = True,
        logits: LogitsSettings | None = None,
        tools: list[dict] | None = None,
        compiled: bool | None = None,
        accept: AcceptRule | str | None = None,
        turn_start: int | None = None,
        continuation: bool = False,
    ) -> Iterator[GenerationStep]:
        """Stream an answer to a prompt string, chat messages, or token ids.

        ``num_draft_tokens`` fixes the draft budget (default: the adaptive budget); ``prompt_cache`` (one per
        conversation) lets a follow-up prefill only its new tokens; ``lookup=False`` turns prompt-lookup drafts
        off; ``trees=False`` verifies chains only (no sibling strands). ``logits``: ``frequency_penalty``,
        ``presence_penalty``, ``logit_bias`` (exact parts of the sampler, PTP stays lossless) and ``logprobs`` (each
        step's ``logprobs``); see ``ptp_mlx/logits.py``. ``tools``: function definitions for the chat template
        (``ptp_mlx.tools.parse_tool_calls`` reads the calls back). ``compiled=False`` runs the fixed-shape calls
        eagerly (the reference the compiled ones are tested against). ``accept``: the acceptance rule
        (``decode/accept.py``; a string is parsed): exact by default; a lenient rule is not the exact sample and every
        step says so (``GenerationStep.accept``). ``turn_start``: where the prompt's current turn starts (token ids
        of a chat: ``turn_start``; messages: found here); a lenient rule never accepts a copy of what came before
        it (an earlier answer) but by the exact rule. ``continuation``: the prompt is text the answer continues (no
        chat template): the answer's text keeps its leading space."""
        mode = mode or self.default_mode()
        if mode == "ptp" and not self.has_adapter:
            raise UserError("PTP mode needs an adapter (--adapter DIR), or use --mode ar")
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int):
            ids = list(prompt)
        else:
            ids = self.encode(prompt, tools=tools)
        rule = AcceptRule.parse(accept) if isinstance(accept, str) else accept or EXACT
        if turn_start is None:
            chat = not isinstance(prompt, str) and bool(prompt) and isinstance(prompt[0], dict)
            turn_start = self.turn_start(prompt, ids, tools) if chat and rule.lenient else 0
        sampling = sampling or SamplingSettings()
        if num_draft_tokens is not None and not 1 <= num_draft_tokens <= self.pm.config.window - 1:
            raise UserError(f"--num-draft-tokens must be between 1 and {self.pm.config.window - 1} for this adapter")
        opts = DecodeOptions(
            mode=mode,
            max_tokens=max_tokens,
            sampling=sampling,
            drafting=DraftingConfig(num_draft_tokens, self.budget_for(sampling), trees, lookup, step),
            compiled=compiled,
            accept=rule,
            turn_start=turn_start,
            continuation=continuation,
        )
        if logits is not None and logits.active:
            vocab = getattr(self.pm.args, "vocab_size", None)
            opts.logits = LogitsHook(logits.validate(vocab), sampling.temperature, self.tokenizer)
        return stream_generate(self.pm, self.tokenizer, ids, opts, prompt_cache=prompt_cache)
