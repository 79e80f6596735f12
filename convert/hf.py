"""Hugging Face model folder -> MLX model folder (``ptp-convert hf``).

Reads ``*.safetensors`` (or ``pytorch_model*.bin`` under the pickle rule), builds the mlx-lm model class for
the config, checks every tensor against it (missing, unexpected and mis-shaped keys are listed), optionally
casts and quantizes, and writes an mlx-lm folder (config, safetensors, tokenizer) atomically. The model
building pieces are mlx-lm's own (model classes, ``quantize_model``, ``save_model``, ``save_config``,
``load_tokenizer``), so the result opens with ``mlx_lm.load``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ptp_mlx.conversion import FLOAT_DTYPES, Mapping, Summary, check_output, dir_size, dtype_name, progress
from ptp_mlx.errors import UserError
from ptp_mlx.paths import atomic_dir

from .common import is_float, is_tensor, read_weight_file, shape_of, to_mx

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
QUANT_BITS = (2, 3, 4, 5, 6, 8)  # what MLX's affine quantization takes (and mlx-lm's loader reads)
QUANT_GROUPS = (32, 64, 128)
DEFAULT_Q_BITS, DEFAULT_Q_GROUP_SIZE = 4, 64


def check_quantization(bits: int, group_size: int) -> None:
    """Refuse settings MLX cannot quantize with: checked before any file is read (``UserError``)."""
    if bits not in QUANT_BITS:
        raise UserError(f"--q-bits must be one of {', '.join(map(str, QUANT_BITS))}, got {bits}")
    if group_size not in QUANT_GROUPS:
        raise UserError(f"--q-group-size must be one of {', '.join(map(str, QUANT_GROUPS))}, got {group_size}")


def read_config(folder: Path) -> dict:
    """``config.json`` of a model folder, with a clear error when absent or corrupt."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"{folder} is not a model folder (no config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"corrupt {path}: {e}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise UserError(f"{path} has no model_type")
    return normalize_config(cfg)


def normalize_config(cfg: dict) -> dict:
    """Spell RoPE settings the way mlx-lm's model args read them.

    transformers 5 writes ``rope_parameters: {rope_theta, rope_type, ...}`` and no top-level ``rope_theta``;
    mlx-lm's Llama reads only ``rope_theta``/``rope_scaling`` and would silently fall back to theta 10000.
    """
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" in rp:
            cfg.setdefault("rope_theta", rp["rope_theta"])
        if rp.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rp.items() if k != "rope_theta"})
    return cfg


def model_classes(config: dict):
    """mlx-lm's (Model, ModelArgs) for a config; unknown architectures are bad input."""
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)
    except ValueError as e:
        raise UserError(f"unsupported architecture: {e}") from None


def find_weight_files(src: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: safetensors first, else ``pytorch_model*.bin``."""
    for pattern in ("*.safetensors", "pytorch_model*.bin"):
        files = sorted(p for p in src.glob(pattern) if not p.name.startswith(("adapter", ".")))
        if files:
            return files
    raise UserError(f"no weights in {src} (expected *.safetensors or pytorch_model*.bin)")


def read_weights(files: list[Path], trust_pickle: bool) -> dict[str, Any]:
    weights: dict[str, Any] = {}
    for f in progress(files, "reading", total=len(files), unit="file"):
        obj = read_weight_file(f, trust_pickle)
        if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
            obj = obj["state_dict"]
        if not isinstance(obj, dict) or not all(is_tensor(v) for v in obj.values()):
            raise UserError(f"{f} is not a state dict of tensors")
        weights.update(obj)
    return weights


def target_dtype(dtype: str, config: dict) -> mx.Dtype | None:
    """The float dtype to cast to: explicit, or (``auto``) the config's own, or None to keep the source's."""
    if dtype != "auto":
        if dtype not in FLOAT_DTYPES:
            raise UserError(f"unknown dtype {dtype!r} (auto, float32, float16, bfloat16)")
        return FLOAT_DTYPES[dtype]
    declared = config.get("torch_dtype") or config.get("dtype")
    return FLOAT_DTYPES.get(declared) if isinstance(declared, str) else None


def plan_model(config: dict, weights: dict[str, Any], names: dict[str, str] | None = None):
    """Build the (lazy, unloaded) mlx-lm model for ``config`` and map ``weights`` onto it.

    ``names`` maps each weight key to the source key it came from (for messages and the mapping listing).
    Returns ``(model, kept, mappings)``; raises ``UserError`` listing missing, unexpected and mis-shaped keys.
    """
    names = names or {k: k for k in weights}
    model_cls, args_cls = model_classes(config)
    try:
        model = model_cls(args_cls.from_dict(config))
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"cannot build the model from its config: {e}") from None
    unused = {k for k in weights if k.endswith("rotary_emb.inv_freq")}
    kept = (
        model.sanitize({k: v for k, v in weights.items() if k not in unused})
        if hasattr(model, "sanitize")
        else {k: v for k, v in weights.items() if k not in unused}
    )
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    missing = sorted(set(expected) - set(kept))
    unexpected = sorted(names.get(k, k) for k in set(kept) - set(expected))
    if unexpected:
        raise UserError(
            f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:8])}"
            + (" ..." if len(unexpected) > 8 else "")
        )
    if missing:
        raise UserError(
            f"missing keys ({len(missing)}): {', '.join(names.get(k, k) for k in missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
    for k, v in kept.items():
        if shape_of(v) != expected[k]:
            raise UserError(
                f"wrong shape for {names.get(k, k)}: {list(shape_of(v))} in the checkpoint, "
                f"{list(expected[k])} for the model config"
            )
    mappings = []
    for k, v in weights.items():
        if k in kept:
            mappings.append(Mapping(names.get(k, k), k, shape_of(v), dtype_name(v)))
        else:
            why = (
                "unused RoPE table"
                if k in unused
                else "tied to the embedding"
                if k == "lm_head.weight"
                else "dropped by the model's sanitize"
            )
            mappings.append(Mapping(names.get(k, k), None, shape_of(v), dtype_name(v), why))
    return model, kept, mappings


def load_into(model, kept: dict[str, Any], dtype: mx.Dtype | None) -> None:
    """Convert to MLX (bit-exact), cast floats to ``dtype`` and load, one tensor at a time."""
    arrays = []
    for k, v in progress(kept.items(), "converting", total=len(kept)):
        a = to_mx(v)
        if dtype is not None and is_float(v):
            a = a.astype(dtype)
        mx.eval(a)
        arrays.append((k, a))
    model.load_weights(arrays, strict=True)
    model.eval()


def speed_notes(cast: mx.Dtype | None, weights: dict[str, Any], quantized: bool) -> list[str]:
    """On CPU only float32 matmuls use BLAS (docs/method.md, section 10): say so when the result is not float32."""
    if mx.default_device() != mx.cpu:
        return []
    half = (cast is not None and cast in (mx.float16, mx.bfloat16)) or (
        cast is None and any(dtype_name(v) in ("float16", "bfloat16") for v in weights.values())
    )
    if quantized or half:
        return ["on CPU, float32 weights run several times faster (--dtype float32, no --quantize)"]
    return []


def quantize(model, config: dict, bits: int, group_size: int) -> dict:
    """``model`` quantized in place (settings checked already: ``check_quantization``); returns the new config."""
    from mlx_lm.utils import quantize_model

    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints an info line; stdout is the product's
        _, config = quantize_model(model, config, group_size, bits)
    return config


def tokenizer_source(folder: Path) -> Path:
    if not any((Path(folder) / f).exists() for f in TOKENIZER_FILES):
        raise UserError(f"no tokenizer files in {folder} (expected one of {', '.join(TOKENIZER_FILES)})")
    return Path(folder)


def write_model_folder(model, config: dict, tok_src: Path, dst: Path) -> None:
    """Weights, config and tokenizer as an mlx-lm folder in ``dst`` (which exists and is empty)."""
    from mlx_lm.utils import load_tokenizer, save_config, save_model

    try:
        tokenizer = load_tokenizer(tok_src)
    except Exception as e:  # transformers raises many kinds on bad tokenizer files
        raise UserError(f"cannot load the tokenizer from {tok_src}: {e}") from None
    save_model(dst, model)
    config = {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}
    save_config(config, config_path=dst / "config.json")
    tokenizer.save_pretrained(str(dst))
    gen = tok_src / "generation_config.json"
    if gen.is_file():
        shutil.copy(gen, dst / gen.name)


def verify_loads(folder: Path) -> None:
    """The folder must open with ``mlx_lm.load`` (lazy: shapes and files only)."""
    import mlx_lm

    try:
        mlx_lm.load(str(folder), lazy=True)
    except Exception as e:
        raise RuntimeError(f"the written folder does not load with mlx_lm.load: {e}") from e


def convert_hf(
    src: Path,
    out: Path | None,
    dtype: str = "auto",
    quantize_bits: int | None = None,
    q_group_size: int = DEFAULT_Q_GROUP_SIZE,
    overwrite: bool = False,
    dry_run: bool = False,
    trust_pickle: bool = False,
) -> Summary:
    """Convert the Hugging Face folder ``src`` into the MLX folder ``out``. Returns the summary.

    ``quantize_bits`` None: no quantization (0 is not "off": it is refused with the other unsupported widths)."""
    quantizing = quantize_bits is not None
    if quantizing:
        check_quantization(quantize_bits, q_group_size)  # before anything is read or converted
    src = Path(src).expanduser()
    if not src.is_dir():
        raise UserError(f"not a folder: {src} (expected a Hugging Face model folder)")
    out = check_output(out, overwrite, dry_run)
    config = read_config(src)
    if config.get("quantization_config") or config.get("quantization"):
        raise UserError(f"{src} is already quantized; convert a float checkpoint (or use mlx_lm.convert)")
    cast = target_dtype(dtype, config)
    files = find_weight_files(src)
    tok_src = tokenizer_source(src)
    weights = read_weights(files, trust_pickle)
    model, kept, mappings = plan_model(config, weights)
    summary = Summary("hf", mappings, out=out)
    summary.info["source"] = f"{len(files)} file(s) in {src}"
    summary.info["dtype"] = str(cast).replace("mlx.core.", "") if cast is not None else "as in the source"
    if quantizing:
        summary.info["quantization"] = f"{quantize_bits}-bit, group {q_group_size}"
    summary.notes += speed_notes(cast, weights, quantizing)
    if dry_run:
        return summary
    if cast is not None:
        config["torch_dtype"] = str(cast).replace("mlx.core.", "")
        config.pop("dtype", None)
    load_into(model, kept, cast)
    if quantizing:
        config = quantize(model, config, quantize_bits, q_group_size)
    summary.written = {k: (tuple(v.shape), dtype_name(v)) for k, v in tree_flatten(model.parameters())}
    with atomic_dir(out, overwrite=overwrite) as tmp:
        write_model_folder(model, config, tok_src, tmp)
        verify_loads(tmp)
    summary.bytes = dir_size(out)
    return summary
