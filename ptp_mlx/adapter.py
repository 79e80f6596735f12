"""Adapter folders: ``adapter_config.json`` + ``adapter.safetensors`` (docs/conventions.md, "Files")."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .adapter_config import U_EMBEDDING_KINDS, AdapterConfig
from .errors import UserError
from .paths import DEFAULT_MODEL_NAME, atomic_dir, shipped_adapters_dir

FORMAT = "ptp-mlx-adapter"
CONFIG = "adapter_config.json"
WEIGHTS = "adapter.safetensors"


def base_identity(base) -> dict:
    """What an adapter records about the base model it belongs to."""
    from .model.layers import language_model, model_type
    from .models import model_fingerprint, model_signature

    a = language_model(base).args
    return {
        "model_type": model_type(base),
        "hidden_size": a.hidden_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": getattr(a, "num_key_value_heads", None) or a.num_attention_heads,
        "intermediate_size": a.intermediate_size,
        "vocab_size": a.vocab_size,
        "fingerprint": model_fingerprint(base),
        "signature": model_signature(base),
    }


def make_config(base, adapter, rank: int, scale: float, window: int, name: str | None = None, **extra) -> dict:
    cfg = {
        "format": FORMAT,
        "version": 1,
        "base_model": {"name": name, **base_identity(base)},
        "rank": rank,
        "scale": scale,
        "target_modules": list(adapter.targets),
        "layers": adapter.layer_ids,
        "u_embedding": adapter.u_embed.kind,
        "window": window,
        "sampling": None,
        "acceptance_histogram": None,
    }
    cfg.update(extra)
    return cfg


def save_adapter(adapter, config: dict, out: Path, overwrite: bool = True) -> None:
    """Write the adapter folder atomically."""
    weights = dict(tree_flatten(adapter.trainable_parameters()))
    weights = {k: v for k, v in weights.items() if not k.endswith(".scale")}
    with atomic_dir(Path(out), overwrite=overwrite) as tmp:
        mx.save_safetensors(str(tmp / WEIGHTS), weights, metadata={"format": FORMAT})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))


def read_config(path: Path) -> dict:
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise UserError(f"not an adapter folder (no {CONFIG}): {path}")
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"corrupt {path / CONFIG}: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise UserError(f"{path / CONFIG} is not a {FORMAT} config")
    if cfg.get("u_embedding") not in U_EMBEDDING_KINDS:
        raise UserError(
            f"unknown u-embedding kind {cfg.get('u_embedding')!r} in {path / CONFIG} "
            f"(known: {', '.join(U_EMBEDDING_KINDS)})"
        )
    return cfg


def check_fits(cfg: dict, base, path: Path, check_fingerprint: bool = True) -> None:
    """Raise ``UserError`` naming the first way the adapter does not fit ``base``."""
    want = cfg.get("base_model", {})
    have = (
        base_identity(base)
        if check_fingerprint
        else {k: getattr(base.args, k) for k in want if k not in ("name", "fingerprint") and hasattr(base.args, k)}
    )
    if check_fingerprint and want.get("signature") and want.get("fingerprint") != have.get("fingerprint"):
        from .models import signature_matches

        if signature_matches(want["signature"], have["signature"]):
            have.pop("fingerprint")  # the same weights in another float dtype (a bf16 conversion on a GPU, say)
    for k, v in have.items():
        if k == "signature":
            continue
        if k in want and want[k] is not None and want[k] != v:
            raise UserError(
                f"adapter {path} was made for another base model ({want.get('name') or 'unknown'}): "
                f"{k} is {want[k]} there but {v} here"
            )


def load_adapter(path: Path, base, check_fingerprint: bool = True):
    """Load an adapter folder onto ``base``: ``(PTPAdapter, AdapterConfig)``; clear errors when it does not fit."""
    from .model.ptp import PTPAdapter

    path = Path(path)
    raw = read_config(path)
    check_fits(raw, base, path, check_fingerprint)
    try:
        cfg = AdapterConfig.from_dict(raw, strict=True)
        adapter = PTPAdapter(base, cfg.rank, cfg.scale, cfg.u_embedding, targets=cfg.target_modules, layers=cfg.layers)
    except (KeyError, ValueError) as e:
        raise UserError(f"bad adapter config {path / CONFIG}: {e}") from None
    try:
        weights = mx.load(str(path / WEIGHTS))
    except Exception as e:
        raise UserError(f"cannot read {path / WEIGHTS} (truncated or corrupt?): {e}") from None
    expected = {k: v.shape for k, v in tree_flatten(adapter.parameters()) if not k.endswith(".scale")}
    unknown = sorted(set(weights) - set(expected))
    missing = sorted(set(expected) - set(weights))
    if unknown or missing:
        raise UserError(
            f"adapter {path} does not match its config: "
            + (f"unknown keys {unknown[:5]}" if unknown else f"missing keys {missing[:5]}")
        )
    for k, v in weights.items():
        if tuple(v.shape) != tuple(expected[k]):
            raise UserError(f"adapter {path}: {k} has shape {tuple(v.shape)}, expected {tuple(expected[k])}")
    adapter.load_weights(list(weights.items()), strict=False)
    mx.eval(adapter.parameters())
    return adapter, cfg


def shipped_adapter(model_name: str = DEFAULT_MODEL_NAME) -> Path | None:
    """The adapter folder shipped inside the package for ``model_name``, if any."""
    p = shipped_adapters_dir() / model_name
    return p if (p / CONFIG).exists() and (p / WEIGHTS).exists() else None


def adapter_for(base, shipped: bool = True) -> Path | None:
    """An adapter made for exactly this base model: one under ``$PTP_MLX_HOME/adapters`` (``ptp-train auto``
    installs there; it comes first) or a shipped one, whose recorded fingerprint matches the model's, or whose
    signature does (the same weights in another float dtype: a bf16 conversion on a GPU).
    ``shipped=False``: installed ones only."""
    from .models import model_fingerprint, model_signature, signature_matches
    from .paths import cache_root

    want = have_sig = None
    for root in (cache_root() / "adapters", *([shipped_adapters_dir()] if shipped else [])):
        if not root.is_dir():
            continue
        for d in sorted(root.iterdir()):
            if not ((d / CONFIG).is_file() and (d / WEIGHTS).is_file()):
                continue
            try:
                bm = json.loads((d / CONFIG).read_text()).get("base_model", {})
                fp, sig = bm.get("fingerprint"), bm.get("signature")
            except (OSError, ValueError, AttributeError):
                continue
            if fp:
                want = want or model_fingerprint(base)
                if fp == want:
                    return d
                if sig:  # the same weights in another float dtype
                    have_sig = have_sig or model_signature(base)
                    if signature_matches(sig, have_sig):
                        return d
    return None


def randomize_adapter(adapter, scale: float = 0.05, seed: int = 0) -> None:
    """Give every LoRA ``B`` random values so the adapter changes the auxiliary rows (tests, and the random models of ``ptp-bench --cost-sweep``)."""
    mx.random.seed(seed)
    for layer in adapter.layers:
        for lora in layer.values():
            lora.B = mx.random.normal(lora.B.shape) * scale
    mx.eval(adapter.parameters())
