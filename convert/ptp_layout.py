"""The reference PTP checkpoint layout (docs/method.md, section 8): key classification and ``train.yaml`` facts.

Pure bookkeeping on key names and shapes, no tensors are touched here, so ``--dry-run`` and every input
check run before anything is converted.

Layout (Lightning module -> MixedTransformerModel -> PEFT model -> Hugging Face causal LM)::

    model.model.base_model.model.model.layers.{i}.self_attn.q_proj.base_layer.weight
    model.model.base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.default.weight   # [r, in]
    model.model.base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.default.weight   # [out, r]
    model.model.base_model.model.lm_head.weight
    model.u_embed.u_adapter.{weight,bias}     # binary
    model.u_embed.embedding.weight            # linear_interpolation [3, H]

Without PEFT (trained from scratch) the base prefix is ``model.model.``; adapter-only files hold only the
LoRA and u-embedding keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ptp_mlx.errors import UserError
from ptp_mlx.model.ptp import ALL_TARGETS, U_EMBEDDING_KINDS

# Longest first: the first prefix under which a key is a valid Hugging Face name wins.
BASE_PREFIXES = (
    "model.model.base_model.model.",
    "model.base_model.model.",
    "base_model.model.",
    "model.model.",
    "model.",
    "",
)
_HF_NAME = re.compile(
    r"^(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|model\.rotary_emb\.inv_freq"
    r"|model\.layers\.\d+\.[A-Za-z0-9_.]+)$"
)
_LORA = re.compile(
    r"^(?P<prefix>.*?)model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<target>\w+)"
    r"\.lora_(?P<ab>[AB])\.(?P<name>[^.]+)\.weight$"
)
_UEMB = re.compile(r"^(?:.*\.)?u_embed\.(?P<rest>.+)$")
_PEFT_OTHER = re.compile(r"\.(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector|modules_to_save|original_module)\.")


def normalize_key(key: str) -> str:
    """Apply the reference loader's legacy renames: ``student.`` -> ``model.``, ``.u_adapter.`` -> ``.u_embed.``.

    The second rename applies only to keys of the legacy form (no ``u_embed`` yet): the current binary
    u-embedding is itself named ``u_embed.u_adapter`` and must stay as it is.
    """
    if key.startswith("student."):
        key = "model." + key[len("student.") :]
    if ".u_embed." not in key and not key.startswith("u_embed."):
        if key.startswith("u_adapter."):
            key = "u_embed." + key[len("u_adapter.") :]
        elif ".u_adapter." in key:
            key = key.replace(".u_adapter.", ".u_embed.", 1)
    return key


@dataclass
class Layout:
    """A classified checkpoint: base tensors by Hugging Face name, LoRA factors, u-embedding tensors."""

    base: dict[str, str] = field(default_factory=dict)  # hf name -> source key
    lora: dict[tuple[int, str, str], str] = field(default_factory=dict)  # (layer, target, "A"|"B") -> key
    u_embed: dict[str, str] = field(default_factory=dict)  # "u_adapter.weight" ... -> key
    prefix: str | None = None
    renamed: int = 0

    @property
    def has_base(self) -> bool:
        return any(n.startswith("model.layers.") or n == "model.embed_tokens.weight" for n in self.base)

    @property
    def layers(self) -> list[int]:
        return sorted({i for i, _, _ in self.lora})

    @property
    def targets(self) -> tuple[str, ...]:
        found = {t for _, t, _ in self.lora}
        return tuple(t for t in ALL_TARGETS if t in found)


def classify(keys: list[str]) -> tuple[Layout, dict[str, str]]:
    """Sort checkpoint keys into base / LoRA / u-embedding. Returns the layout and ``normalized -> original``.

    Raises ``UserError`` listing every key that fits none of them.
    """
    original = {}
    for k in keys:
        n = normalize_key(k)
        if n in original:
            raise UserError(f"duplicate key after legacy renames: {k} and {original[n]}")
        original[n] = k
    lay = Layout(renamed=sum(n != k for n, k in original.items()))
    rest, unexpected, adapter_names = [], [], set()
    for n in original:
        if m := _UEMB.match(n):
            lay.u_embed[m["rest"]] = n
        elif m := _LORA.match(n):
            if m["target"] not in ALL_TARGETS:
                unexpected.append(original[n])
                continue
            adapter_names.add(m["name"])
            lay.lora[(int(m["layer"]), m["target"], m["ab"])] = n
        elif _PEFT_OTHER.search(n):
            unexpected.append(original[n])  # LoRA on other modules, DoRA, modules_to_save: not this format
        else:
            rest.append(n)
    if len(adapter_names) > 1:
        raise UserError(
            f"the checkpoint holds several PEFT adapters ({', '.join(sorted(adapter_names))}); expected one"
        )
    if rest:

        def fits(prefix: str, n: str) -> bool:
            return n.startswith(prefix) and bool(_HF_NAME.match(n[len(prefix) :].replace(".base_layer.", ".")))

        lay.prefix = max(BASE_PREFIXES, key=lambda p: sum(fits(p, n) for n in rest))
        for n in rest:
            if fits(lay.prefix, n):
                lay.base[n[len(lay.prefix) :].replace(".base_layer.", ".")] = n
            else:
                unexpected.append(original[n])
    if unexpected:
        unexpected.sort()
        raise UserError(
            f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:8])}"
            + (" ..." if len(unexpected) > 8 else "")
        )
    if not lay.lora and not lay.u_embed:
        raise UserError(
            "no PTP keys in the checkpoint (no u_embed and no LoRA): is this a plain model? "
            "use `ptp-convert hf` for those"
        )
    return lay, original


def u_embedding_kind(u_keys: dict[str, tuple[int, ...]], hidden: int | None) -> str:
    """The u-embedding kind from its tensor names and shapes (docs/method.md, section 2)."""
    names = set(u_keys)
    if not names:
        raise UserError("missing keys: the u-embedding (model.u_embed.*) is not in the checkpoint")
    if names == {"u_adapter.weight", "u_adapter.bias"}:
        w, b = u_keys["u_adapter.weight"], u_keys["u_adapter.bias"]
        if len(w) != 2 or w[1] != 32 or b != (w[0],) or (hidden is not None and w[0] != hidden):
            raise UserError(
                f"wrong shape for the binary u-embedding: weight {list(w)}, bias {list(b)} "
                f"(expected [{hidden or 'H'}, 32] and [{hidden or 'H'}])"
            )
        return "binary"
    if names == {"embedding.weight"}:
        w = u_keys["embedding.weight"]
        if len(w) == 2 and w[0] == 3 and (hidden is None or w[1] == hidden):
            return "linear_interpolation"
        if len(w) == 2 and w[0] == 32:
            raise UserError(
                "the checkpoint holds a 'round' u-embedding (Embedding(32, H)); supported kinds: "
                + ", ".join(U_EMBEDDING_KINDS)
            )
        raise UserError(
            f"wrong shape for the u-embedding: embedding.weight {list(w)} "
            f"(linear_interpolation is [3, {hidden or 'H'}])"
        )
    if names == {"embedding.weight", "embedding.bias"}:
        raise UserError(
            "the checkpoint holds a 'sawtooth' or 'quarter_cos' u-embedding (Linear(32, H) named "
            "'embedding'); supported kinds: " + ", ".join(U_EMBEDDING_KINDS)
        )
    if "u_adapter.weight" in names and "u_adapter.bias" not in names:
        raise UserError("missing keys: model.u_embed.u_adapter.bias")
    raise UserError(f"unexpected u-embedding keys: {', '.join('u_embed.' + n for n in sorted(names))}")


@dataclass
class TrainFacts:
    """What the reference ``train.yaml`` says (None where it is silent)."""

    path: Path | None = None
    rank: int | None = None
    alpha: float | None = None
    use_rslora: bool = False
    u_embedding: str | None = None
    window: int | None = None
    model_id: str | None = None


def find_train_yaml(ckpt: Path) -> Path | None:
    """``train.yaml`` beside the checkpoint or one folder up (Lightning writes ``EXP/checkpoints/*.ckpt``)."""
    for d in (ckpt.parent, ckpt.parent.parent):
        if (d / "train.yaml").is_file():
            return d / "train.yaml"
    return None


def read_train_yaml(path: Path) -> TrainFacts:
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path} is not a training config (not a mapping)")

    def get(*keys):
        node = doc
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                return None
            node = node[k]
        return node

    inner = get("model", "model") or {}
    lora = inner.get("lora_config") or {} if isinstance(inner, dict) else {}
    model_id = inner.get("model_id") if isinstance(inner, dict) else None
    facts = TrainFacts(path=Path(path))
    try:
        facts.rank = int(lora["r"]) if "r" in lora else None
        facts.alpha = float(lora["lora_alpha"]) if "lora_alpha" in lora else None
        facts.use_rslora = bool(lora.get("use_rslora", False))
        facts.window = int(get("data", "train_completion_len")) if get("data", "train_completion_len") else None
    except (TypeError, ValueError) as e:
        raise UserError(f"bad value in {path}: {e}") from None
    if isinstance(inner, dict) and inner.get("adapter_name") is not None:
        facts.u_embedding = str(inner["adapter_name"])
    facts.model_id = model_id if isinstance(model_id, str) else None
    return facts
