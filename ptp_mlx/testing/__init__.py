"""Tiny real models for tests and examples: random models of each supported family (mlx-lm's own classes) with a
byte-level tokenizer, saved as real mlx-lm folders (config.json, model.safetensors, tokenizer files), so tests
exercise the real loading path without any download. Also the test drafters that ``stream_generate`` accepts."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..adapter import randomize_adapter
from ..drafting.protocol import CallResult, Drafter, DraftPlan, Strand

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_config(
    vocab_size: int = 259, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, context: int = 512
) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "max_position_embeddings": context,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def save_byte_tokenizer(out: Path, template: str = CHAT_TEMPLATE, added: list[str] | None = None):
    """Byte-level BPE without merges: 3 special tokens then the 256 byte symbols (vocabulary 259), then ``added``
    tokens (ids from 259), with the chat ``template``; saved to ``out``. Returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_syms = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIALS + byte_syms)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    if added:
        tok.add_tokens(added)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS[1],
        eos_token=SPECIALS[2],
        unk_token=SPECIALS[0],
        pad_token=SPECIALS[0],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = template
    fast.save_pretrained(str(out))
    return fast


# Family-specific config fields on top of ``tiny_config`` (small sliding windows, so the window really slides).
FAMILY_CONFIGS = {
    "llama": {},
    "mistral": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
    "qwen2": {},
    "qwen3": {},
    "phi3": {"tie_word_embeddings": False},
    "gemma3_text": {
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "rope_local_base_freq": 10000.0,
    },
    "olmo2": {},
    # gemma3's multimodal wrapper (text weights under language_model); its text_config is gemma3_text's
    "gemma3": {},
    # an SSM: PTP must refuse it
    "mamba": {
        "state_size": 4,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
        "intermediate_size": 128,
    },
    # a KV-cache family PTP has not verified: plain decoding with mlx-lm's trimmable caches
    "starcoder2": {},
}
REFUSED_FAMILIES = ("mamba", "starcoder2")  # PTP refuses them; they decode with mlx-lm's own caches
PTP_FAMILIES = tuple(k for k in FAMILY_CONFIGS if k not in REFUSED_FAMILIES)


def make_tiny_model(out: Path, seed: int = 0, family: str = "llama", varied: bool = False, **cfg_kw) -> Path:
    """Write a random tiny model folder of ``family`` that ``mlx_lm.load`` opens. Returns ``out``.

    ``varied``: larger random weights everywhere, for varied, moderately peaked next-token distributions (with
    default initialisation a tiny model repeats one token)."""
    from mlx_lm.utils import _get_classes as get_model_classes

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**tiny_config(**cfg_kw), **FAMILY_CONFIGS[family], "model_type": family}
    if family == "gemma3":
        text = {**cfg, **FAMILY_CONFIGS["gemma3_text"], "model_type": "gemma3_text"}
        cfg = {"model_type": "gemma3", "text_config": text, "vocab_size": text["vocab_size"]}
        cfg.update({k: text[k] for k in ("bos_token_id", "eos_token_id", "max_position_embeddings")})
    cfg["architectures"] = [f"{family}ForCausalLM"]
    Model, Args = get_model_classes(cfg)
    mx.random.seed(seed)
    model = Model(Args.from_dict(cfg))
    # Larger-than-default embeddings give peaked, varied next-token distributions.
    emb = _embedding(model)
    emb.weight = mx.random.normal(emb.weight.shape) * 0.5
    gemma = family.startswith("gemma")
    if gemma:  # gemma scales embeddings by sqrt(hidden): keep the logits comparable
        emb.weight = emb.weight / 8.0
    if varied:
        new = []
        for k, v in tree_flatten(model.parameters()):
            if k.endswith("embed_tokens.weight"):
                new.append((k, mx.random.normal(v.shape) * (0.125 if gemma else 1.0)))
            elif v.ndim == 2 and "norm" not in k:
                new.append((k, mx.random.normal(v.shape) * 2.0 / np.sqrt(v.shape[1])))
            else:
                new.append((k, v))
        model.load_weights(new)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_byte_tokenizer(out)
    return out


def _embedding(model):
    model = getattr(model, "language_model", None) or model
    inner = getattr(model, "model", None) or getattr(model, "backbone", None)
    return getattr(inner, "embed_tokens", None) or inner.embeddings


class OracleDrafter(Drafter):
    """A test drafter without an adapter: ``tokens[g]`` is proposed as the draft for generated token ``g`` (the
    teacher's own continuation makes every draft right, a wrong one makes every draft wrong). Each call then
    verifies up to ``width - 1`` drafts and runs no auxiliary rows."""

    def __init__(self, tokens, width: int = 8):
        self.tokens, self.width = [int(t) for t in tokens], width

    def plan(self, i: int, remaining: int, room: int):
        n = max(0, min(self.width - 1, remaining - 1, room - 1))
        return DraftPlan(self.tokens[i : i + n], [])

    def update(self, plan: DraftPlan, result: CallResult) -> None:
        pass


class RandomTreeDrafter(Drafter):
    """A test drafter of random token trees: each call verifies a random chain (each draft the teacher's own
    token ``tokens[g]`` with probability ``p_right``, else a random one), random side strands at random rows of
    the chain (one to three tokens, each sometimes the right one) and strands of those strands (at a random token
    of their parent), and random auxiliary branches for the chain's outcomes and for each strand. Drafts ignore the auxiliary outputs; the rows still run, so masks, positions and
    the cache compaction after a strand lands are all exercised."""

    def __init__(self, tokens, width: int = 4, seed: int = 0, p_right: float = 0.5, vocab: int = 256):
        self.tokens, self.width, self.p_right, self.vocab = [int(t) for t in tokens], width, p_right, vocab
        self.rng = np.random.default_rng(seed)
        self.alt_hits = 0  # calls whose path took a strand
        self.deep_hits = 0  # of those, a strand after a chain draft, or two tokens or more of one (rows moved)
        self.nested_hits = 0  # of those, paths that went on through a strand of a strand

    def _token(self, g: int, right: bool) -> int:
        if right and g < len(self.tokens):
            return self.tokens[g]
        return int(self.rng.integers(3, self.vocab))

    def plan(self, i: int, remaining: int, room: int):
        rng = self.rng
        n = int(rng.integers(0, min(self.width, remaining, room)))
        drafts = [self._token(i + k, rng.random() < self.p_right) for k in range(n)]
        rows = 1 + n
        branches = []
        for d in range(n + 1):
            w = int(rng.integers(0, 4))
            if w >= 2 and rows + w <= room:
                branches.append((d, w))
                rows += w
        strands = []
        if remaining >= 2:
            for _ in range(int(rng.integers(0, 3))):
                at = int(rng.integers(0, n + 1))
                k = int(rng.integers(1, 4))
                w = int(rng.choice([0, 2, 3]))
                if rows + k + w > room:
                    break
                toks = [self._token(i + at + j, rng.random() < 0.6) for j in range(k)]
                strands.append(Strand(at, tuple(toks), w))
                rows += k + w
            for parent in range(len(strands)):  # strands of strands: a child follows one of its parent's tokens
                if rng.random() < 0.5:
                    continue
                up = strands[parent]
                at = int(rng.integers(up.at + 1, up.depth + 1))
                k, w = int(rng.integers(1, 3)), int(rng.choice([0, 2]))
                if rows + k + w > room or at + k > remaining - 1:
                    continue
                toks = [self._token(i + at + j, rng.random() < 0.7) for j in range(k)]
                strands.append(Strand(at, tuple(toks), w, parent=parent))
                rows += k + w
        return DraftPlan(drafts, branches, strands=strands)

    def update(self, plan: DraftPlan, result: CallResult) -> None:
        if result.strand is not None:
            at = plan.strands[plan.root(result.strand)].at
            self.alt_hits += 1
            self.deep_hits += at > 0 or result.accepted - at >= 2
            self.nested_hits += plan.strands[result.strand].parent >= 0


class ChainingTreeDrafter(RandomTreeDrafter):
    """``RandomTreeDrafter`` whose calls are also built ahead (``decode/pipeline.py``): for every outcome of a call
    it guesses a chain of known tokens with one fixed shape (``guess``), and half the time its next plan is that
    guess (the chained call runs), otherwise a random tree (the chained call is dropped). A strand that stands in a
    tree call with a call chained on it drops that call before the strand's K/V rows move."""

    def __init__(self, tokens, width: int = 4, seed: int = 0, p_right: float = 0.5, vocab: int = 256):
        super().__init__(tokens, width, seed, p_right, vocab)
        self.guessed: dict[int, DraftPlan] = {}

    def guess(self, plan: DraftPlan, accepted: int, i: int, remaining: int, room: int):
        from ..drafting.protocol import Guess

        n = max(0, min(2, remaining - 1, room - 1))
        drafts = [self._token(i + k, self.rng.random() < self.p_right) for k in range(n)]
        w = min(3, remaining - n + 1, room - 1 - n)
        nxt = DraftPlan(drafts, [(n, w)] if w >= 2 else [])
        self.guessed[i] = nxt
        return Guess(nxt, None)

    def plan(self, i: int, remaining: int, room: int):
        guessed, self.guessed = self.guessed.get(i), {}
        if guessed is not None and self.rng.random() < 0.5:
            return guessed
        return super().plan(i, remaining, room)


class StrandChainingTreeDrafter(ChainingTreeDrafter):
    """``ChainingTreeDrafter`` that also guesses the next call after each path through its strands, strands of
    strands included (``Drafter.guess_strand``): the call built ahead serves those paths too and, where it runs,
    moves the strands' K/V rows in its own graph."""

    def guess_strand(self, plan: DraftPlan, strand: int, accepted: int, i: int, remaining: int, room: int):
        return self.guess(plan, accepted, i, remaining, room)


class StrandKindTreeDrafter(StrandChainingTreeDrafter):
    """``StrandChainingTreeDrafter`` whose guess after a path through a strand has another shape than after the
    chain's outcomes (one draft and a branch of two): those paths get a build of their own where time is spare."""

    def guess_strand(self, plan: DraftPlan, strand: int, accepted: int, i: int, remaining: int, room: int):
        from ..drafting.protocol import Guess

        n = max(0, min(1, remaining - 1, room - 1))
        drafts = [self._token(i + k, self.rng.random() < self.p_right) for k in range(n)]
        nxt = DraftPlan(drafts, [(n, 2)] if remaining - n + 1 >= 2 and room - 1 - n >= 2 else [])
        self.guessed[i] = nxt
        return Guess(nxt, None)


def save_random_adapter(model_dir: Path, out: Path, window: int = 4, seed: int = 0) -> Path:
    """A rank-4 adapter with random ``B`` (drafts are verified, some accepted) for the model in ``model_dir``,
    saved as an adapter folder at ``out`` (tests only)."""
    import mlx_lm

    from ..adapter import make_config, save_adapter
    from ..model.ptp import PTPAdapter

    model, _ = mlx_lm.load(str(model_dir))
    mx.random.seed(seed)
    ad = PTPAdapter(model, 4, 1.0, "binary")
    randomize_adapter(ad)
    save_adapter(ad, make_config(model, ad, 4, 1.0, window=window), out)
    return out


def explain_divergence(pm, prompt_ids, s, want: list[int], got: list[int], eos_ids=()):
    """Where autoregressive tokens ``want`` and PTP tokens ``got`` for the same uniforms first part, and whether
    that is a float near-tie.

    Returns ``(position, Tie or None, report)``; the tie is judged from the autoregressive decoder's own logits
    there (``ptp_mlx.ties``). Where one sequence ended, each of ``eos_ids`` is tried as its token.
    """
    from ..sampler import UniformStream
    from ..ties import judge_divergence

    g = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
    refs = [want[g]] if g < len(want) else list(eos_ids)
    others = [got[g]] if g < len(got) else list(eos_ids)
    if not refs or not others:
        return g, None, f"lengths differ: {len(want)} vs {len(got)} tokens (common prefix {g})"
    u = UniformStream(s.seed)[g]
    _, tie = judge_divergence(pm, prompt_ids, want[:g], refs, others, u, s)
    report = f"first divergence at generated position {g}: {refs[0]} vs {others[0]}, u={u:.9f}: {tie.describe()}"
    return g, tie, report


def multi_row_logit_gap(base, prompt_ids: list[int], answer: list[int], widths=(2, 3, 4, 8, 16, 24)) -> float:
    """The largest logit gap between a row computed in a pass of several rows and the same row computed one row
    at a time (docs/method.md, section 11), over every answer position and passes of each of ``widths`` rows
    (and one over the whole answer). Tolerances of tests that compare verification rows with a one-row replay
    derive from it, so they follow this machine's BLAS kernels instead of a constant."""
    from mlx_lm.models.cache import make_prompt_cache

    fed = [prompt_ids[-1], *answer[:-1]]  # the rows whose logits score the answer's tokens

    def rows(width: int) -> np.ndarray:
        cache = make_prompt_cache(base)
        base(mx.array(prompt_ids[:-1])[None], cache=cache)
        out = [base(mx.array(fed[s : s + width])[None], cache=cache)[0] for s in range(0, len(fed), width)]
        return np.array(mx.concatenate(out).astype(mx.float32), dtype=np.float64)

    one = rows(1)
    return max(float(np.abs(rows(w) - one).max()) for w in (*widths, len(fed)))


class FlipOne:
    """A deliberately broken bench decoder (tests only): the real runner ``inner`` with the token at ``pos`` changed."""

    def __init__(self, inner, pos=3):
        self.inner, self.pos = inner, pos

    def __call__(self, ids, max_tokens, sampling, turn_start=0):
        m = self.inner(ids, max_tokens, sampling, turn_start)
        if len(m.token_ids) > self.pos:
            m.token_ids[self.pos] = (m.token_ids[self.pos] + 1) % 200 + 3
        return m
