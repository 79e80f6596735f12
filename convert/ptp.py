"""Official PyTorch PTP checkpoints -> MLX base-model folder + adapter folder (``ptp-convert ptp``).

Accepts a Lightning ``.ckpt`` (``{"state_dict": ...}``), a plain state dict (``.pt``/``.bin``) or safetensors,
holding the full model + LoRA + u-embedding or only the adapter (docs/method.md, section 8). The LoRA stays
unmerged: it becomes this project's gated adapter (``PTPAdapter``), applied to auxiliary rows only.

Output ``OUT/adapter`` always; ``OUT/model`` too unless ``--base DIR`` names the MLX base model to use.
Hyper-parameters the file does not store come from ``train.yaml`` (found beside the checkpoint or given),
overridden by flags: LoRA ``alpha`` (PEFT default 8, scale = alpha / r) and the trained window length.
Rank, target modules, layers and the u-embedding kind are read from the tensors; a yaml or flag that
contradicts them is an error (it belongs to another run).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ptp_mlx.adapter import load_adapter, make_config, save_adapter
from ptp_mlx.conversion import Mapping, Summary, check_output, dir_size, dtype_name
from ptp_mlx.errors import UserError
from ptp_mlx.model.layers import linear_dims, projections
from ptp_mlx.model.ptp import U_EMBEDDING_KINDS, PTPAdapter
from ptp_mlx.paths import atomic_dir

from . import hf
from .common import is_tensor, load_pickle, read_weight_file, shape_of, to_mx
from .ptp_layout import Layout, TrainFacts, classify, find_train_yaml, read_train_yaml, u_embedding_kind

PEFT_DEFAULT_ALPHA = 8.0
DEFAULT_WINDOW = 16  # the reference's train_completion_len
HIST_NAME = "correct_count_hist.pt"  # the reference's validation histogram of accepted lengths


def read_state_dict(path: Path, trust_pickle: bool) -> tuple[dict[str, Any], str]:
    """The tensors of a checkpoint file and a word for its format."""
    obj = read_weight_file(path, trust_pickle)
    if not isinstance(obj, dict) or not obj:
        raise UserError(f"{path} holds no state dict")
    fmt = "safetensors" if isinstance(next(iter(obj.values())), mx.array) else "state dict"
    if isinstance(obj.get("state_dict"), dict):
        obj, fmt = obj["state_dict"], "Lightning checkpoint"
    bad = [k for k, v in obj.items() if not is_tensor(v)]
    if bad:
        raise UserError(f"{path} is not a state dict of tensors (non-tensor entries: {', '.join(map(str, bad[:5]))})")
    return obj, fmt


def read_histogram(path: Path | None, src: Path, notes: list[str]) -> list[float] | None:
    """The acceptance histogram (index k = k leading drafts right), given or found beside the checkpoint."""
    explicit = path is not None
    path = Path(path).expanduser() if explicit else src.parent / HIST_NAME
    if not path.is_file():
        if explicit:
            raise UserError(f"histogram file not found: {path}")
        return None
    try:
        hist = load_pickle(path)
    except UserError as e:
        if explicit:
            raise
        notes.append(f"ignored {path}: {e}")
        return None
    values = to_mx(hist).astype(mx.float32).tolist() if is_tensor(hist) else hist
    ok = isinstance(values, list) and values and all(isinstance(v, (int, float)) and v >= 0 for v in values)
    if not ok or sum(values) <= 0:
        if explicit:
            raise UserError(f"{path} is not a histogram (a 1-D tensor of non-negative counts)")
        notes.append(f"ignored {path}: not a histogram")
        return None
    notes.append(f"acceptance histogram from {path}")
    return [float(v) / float(sum(values)) for v in values]


def lora_rank(lay: Layout, sd: dict[str, Any]) -> int:
    """The LoRA rank, checking that every target of every LoRA layer has both factors of one rank."""
    missing = [
        f"layers.{i}.{t}.lora_{ab}"
        for i in lay.layers
        for t in lay.targets
        for ab in "AB"
        if (i, t, ab) not in lay.lora
    ]
    if missing:
        raise UserError(
            f"missing keys ({len(missing)}): {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")
        )
    ranks = {}
    for (_, _, ab), key in lay.lora.items():
        s = shape_of(sd[key])
        if len(s) != 2:
            raise UserError(f"wrong shape for {key}: {list(s)} (a LoRA factor is 2-D)")
        ranks[key] = s[0] if ab == "A" else s[1]
    if len(set(ranks.values())) > 1:
        r0 = min(ranks.values(), key=list(ranks.values()).count)
        odd = next(k for k, r in ranks.items() if r == r0)
        raise UserError(
            f"wrong shape for {odd}: LoRA rank {r0} where the other factors have rank {max(set(ranks.values()) - {r0})}"
        )
    return next(iter(ranks.values()))


def check_against_base(lay: Layout, sd: dict[str, Any], base, rank: int) -> None:
    """Raise a base-model mismatch when the adapter tensors do not fit ``base``'s shapes."""
    n_layers, hidden = len(base.model.layers), base.args.hidden_size
    u_w = sd[lay.u_embed.get("u_adapter.weight") or lay.u_embed["embedding.weight"]]
    u_hidden = shape_of(u_w)[0 if "u_adapter.weight" in lay.u_embed else 1]
    if u_hidden != hidden:
        raise UserError(
            f"base-model mismatch: the u-embedding is for hidden size {u_hidden}, the base model's is {hidden}"
        )
    if lay.layers and lay.layers[-1] >= n_layers:
        raise UserError(
            f"base-model mismatch: the checkpoint has LoRA on layer {lay.layers[-1]} but the base "
            f"model has {n_layers} layers"
        )
    for (i, t, ab), key in sorted(lay.lora.items()):
        in_dim, out_dim = linear_dims(projections(base.layers[i])[t])
        want = (rank, in_dim) if ab == "A" else (out_dim, rank)
        if shape_of(sd[key]) != want:
            raise UserError(
                f"base-model mismatch: {key} is {list(shape_of(sd[key]))}, the base model's {t} needs {list(want)}"
            )


def compare_base(base, lay: Layout, sd: dict[str, Any], base_dir: Path) -> None:
    """A full checkpoint converted onto ``--base``: its base tensors must be that model's (bf16/quantized ok)."""
    params = dict(tree_flatten(base.parameters()))
    tied = bool(getattr(base.args, "tie_word_embeddings", False))
    for name, key in sorted(lay.base.items()):
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and tied):
            continue
        if name not in params:
            raise UserError(f"base-model mismatch: {key} has no counterpart in {base_dir}")
        mod = _module_at(base, name.rsplit(".", 1)[0])
        have, quantized = params[name], hasattr(mod, "bits") and name.endswith(".weight")
        if quantized:
            have = mx.dequantize(
                mod.weight, mod.scales, getattr(mod, "biases", None), group_size=mod.group_size, bits=mod.bits
            )
        want = to_mx(sd[key]).astype(mx.float32)
        if tuple(have.shape) != tuple(want.shape):
            raise UserError(
                f"base-model mismatch: {key} is {list(want.shape)} in the checkpoint, {list(have.shape)} in {base_dir}"
            )
        diff = float(mx.linalg.norm((have.astype(mx.float32) - want).reshape(-1)))
        rel = diff / (float(mx.linalg.norm(want.reshape(-1))) + 1e-12)
        if rel > (0.25 if quantized else 0.02):
            raise UserError(
                f"base-model mismatch: {key} differs from {base_dir} (relative difference {rel:.3g}); "
                "the checkpoint was trained on another base model"
            )


def _module_at(model, path: str):
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def config_source(config_dir: Path | None, facts: TrainFacts) -> Path:
    """Where the base model's ``config.json`` and tokenizer come from (the checkpoint stores neither)."""
    if config_dir is not None:
        return Path(config_dir).expanduser()
    if facts.model_id:
        p = Path(facts.model_id).expanduser()
        if (p / "config.json").is_file():
            return p
        try:  # the Hugging Face cache, offline only
            from huggingface_hub import snapshot_download

            return Path(
                snapshot_download(
                    facts.model_id,
                    local_files_only=True,
                    allow_patterns=["*.json", "tokenizer.model", "*.txt", "*.jinja"],
                )
            )
        except Exception:
            pass
    raise UserError(
        "the checkpoint does not store the model config: pass --config DIR (the base model's Hugging "
        "Face folder with config.json and tokenizer) or --base DIR (an MLX base model folder)"
    )


def resolve_hyper(
    lay: Layout,
    sd: dict[str, Any],
    facts: TrainFacts,
    rank: int | None,
    alpha: float | None,
    u_kind: str | None,
    window: int | None,
) -> dict[str, Any]:
    """Rank, scale, kind, window: tensors first, then flags, then ``train.yaml``, then the defaults."""
    r = lora_rank(lay, sd) if lay.lora else 0
    want_r = rank if rank is not None else facts.rank
    if lay.lora and want_r is not None and want_r != r:
        src = "--rank" if rank is not None else str(facts.path)
        raise UserError(f"wrong shapes: the LoRA tensors have rank {r} but {src} says {want_r}")
    kind = u_embedding_kind({k: shape_of(sd[v]) for k, v in lay.u_embed.items()}, None)
    want_kind = u_kind or facts.u_embedding
    if want_kind is not None and want_kind != kind:
        src = "--u-embedding" if u_kind else str(facts.path)
        if want_kind not in U_EMBEDDING_KINDS:
            raise UserError(f"{src} names the u-embedding {want_kind!r}; supported: {', '.join(U_EMBEDDING_KINDS)}")
        raise UserError(f"{src} says the u-embedding is {want_kind} but the checkpoint holds {kind} weights")
    a = alpha if alpha is not None else facts.alpha if facts.alpha is not None else PEFT_DEFAULT_ALPHA
    scale = (a / math.sqrt(r) if facts.use_rslora else a / r) if r else 0.0
    w = window or facts.window or DEFAULT_WINDOW
    return {"rank": r, "alpha": a, "scale": scale, "u_embedding": kind, "window": int(w)}


def adapter_mappings(lay: Layout, sd: dict[str, Any], original: dict[str, str]) -> list[Mapping]:
    maps = [
        Mapping(original[k], f"adapter/layers.{i}.{t}.{ab}", shape_of(sd[k]), dtype_name(sd[k]))
        for (i, t, ab), k in sorted(lay.lora.items())
    ]
    maps += [
        Mapping(original[k], f"adapter/u_embed.{rest}", shape_of(sd[k]), dtype_name(sd[k]))
        for rest, k in sorted(lay.u_embed.items())
    ]
    return maps


def build_adapter(base, lay: Layout, sd: dict[str, Any], hp: dict[str, Any]) -> PTPAdapter:
    """The gated adapter in this project's format, factors kept unmerged, float32."""
    adapter = PTPAdapter(
        base, max(hp["rank"], 1), hp["scale"], hp["u_embedding"], targets=lay.targets, layers=lay.layers
    )
    weights = [(f"layers.{i}.{t}.{ab}", k) for (i, t, ab), k in lay.lora.items()]
    weights += [(f"u_embed.{rest}", k) for rest, k in lay.u_embed.items()]
    expected = {k: tuple(v.shape) for k, v in tree_flatten(adapter.parameters())}
    arrays = []
    for name, key in weights:
        if shape_of(sd[key]) != expected[name]:
            raise UserError(f"wrong shape for {key}: {list(shape_of(sd[key]))}, expected {list(expected[name])}")
        arrays.append((name, to_mx(sd[key]).astype(mx.float32)))
    adapter.load_weights(arrays, strict=True)
    mx.eval(adapter.parameters())
    return adapter


def convert_ptp(
    src: Path,
    out: Path | None,
    base: Path | None = None,
    config: Path | None = None,
    train_yaml: Path | None = None,
    rank: int | None = None,
    alpha: float | None = None,
    u_embedding: str | None = None,
    window: int | None = None,
    name: str | None = None,
    histogram: Path | None = None,
    dtype: str = "auto",
    overwrite: bool = False,
    dry_run: bool = False,
    trust_pickle: bool = False,
) -> Summary:
    """Convert a reference PTP checkpoint. Returns the summary (with the key mapping)."""
    import mlx_lm

    src = Path(src).expanduser()
    if src.is_dir():
        raise UserError(f"{src} is a folder, not a checkpoint file")
    if not src.is_file():
        raise UserError(f"checkpoint not found: {src}")
    out = check_output(out, overwrite, dry_run)
    yaml_path = Path(train_yaml).expanduser() if train_yaml else find_train_yaml(src)
    if train_yaml and not yaml_path.is_file():
        raise UserError(f"train.yaml not found: {yaml_path}")
    facts = read_train_yaml(yaml_path) if yaml_path else TrainFacts()
    sd, fmt = read_state_dict(src, trust_pickle)
    lay, original = classify(list(sd))
    sd = {n: sd[k] for n, k in original.items()}
    summary = Summary("ptp", out=out)
    summary.info["source"] = f"{fmt}, {len(sd)} tensors" + (
        f", {lay.renamed} legacy keys renamed" if lay.renamed else ""
    )
    if facts.path:
        summary.notes.append(f"hyper-parameters from {facts.path}")

    base_model = cfg = kept = None
    if base is not None:
        base = Path(base).expanduser()
        hf.read_config(base)
        try:
            base_model, _ = mlx_lm.load(str(base), lazy=True)
        except Exception as e:
            raise UserError(f"cannot load the base model {base}: {e}") from None
    elif not lay.has_base:
        raise UserError(
            "the checkpoint holds only the adapter (LoRA and u-embedding): pass --base DIR, the MLX "
            "folder of the base model it was trained on"
        )
    else:
        cfg_dir = config_source(config, facts)
        cfg = {k: v for k, v in hf.read_config(cfg_dir).items() if k not in ("quantization", "quantization_config")}
        base_model, kept, base_maps = hf.plan_model(
            cfg, {n: sd[k] for n, k in lay.base.items()}, {n: original[k] for n, k in lay.base.items()}
        )
        for m in base_maps:
            m.dst = f"model/{m.dst}" if m.dst else None
        summary.mappings += base_maps
        tok_src = hf.tokenizer_source(cfg_dir)
    hp = resolve_hyper(lay, sd, facts, rank, alpha, u_embedding, window)
    check_against_base(lay, sd, base_model, hp["rank"])
    if base is not None and lay.has_base:
        compare_base(base_model, lay, sd, base)
        summary.mappings += [
            Mapping(original[k], None, shape_of(sd[k]), dtype_name(sd[k]), "base weights from --base")
            for k in lay.base.values()
        ]
    summary.mappings += adapter_mappings(lay, sd, original)
    summary.info["adapter"] = (
        f"LoRA rank {hp['rank']} on {', '.join(lay.targets) or 'no modules'} of "
        f"{len(lay.layers)} layers, alpha {hp['alpha']:g} (scale {hp['scale']:.4g}), "
        f"u-embedding {hp['u_embedding']}, window {hp['window']}"
    )
    summary.info["base model"] = str(base) if base is not None else "written from the checkpoint to model/"
    hist = read_histogram(histogram, src, summary.notes)
    if dry_run:
        return summary

    with atomic_dir(out, overwrite=overwrite) as tmp:
        if base is None:
            cast = hf.target_dtype(dtype, cfg)
            summary.notes += hf.speed_notes(cast, kept, False)
            hf.load_into(base_model, kept, cast)
            hf.write_model_folder(base_model, cfg, tok_src, tmp / "model")
            base_model, _ = mlx_lm.load(str(tmp / "model"))  # the adapter fits what is on disk
        adapter = build_adapter(base_model, lay, sd, hp)
        acfg = make_config(
            base_model,
            adapter,
            hp["rank"],
            hp["scale"],
            hp["window"],
            name=name or facts.model_id or (base.name if base else src.stem),
            lora_alpha=hp["alpha"],
            acceptance_histogram=hist,
            converted_from={"file": src.name, "format": fmt},
        )
        save_adapter(adapter, acfg, tmp / "adapter")
        load_adapter(tmp / "adapter", base_model)  # round trip: the folder loads onto its base
    summary.written = {f"adapter/{k}": (tuple(v.shape), dtype_name(v)) for k, v in tree_flatten(adapter.parameters())}
    if base is None:
        summary.written.update(
            {f"model/{k}": (tuple(v.shape), dtype_name(v)) for k, v in tree_flatten(base_model.parameters())}
        )
    summary.bytes = dir_size(out)
    summary.info = {
        **summary.info,
        "use": f"ptp-generate --model {out / 'model' if base is None else base} --adapter {out / 'adapter'}",
    }
    return summary
