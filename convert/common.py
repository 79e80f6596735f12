"""Reading weight files safely for the ``hf`` and ``ptp`` converters (safetensors, PyTorch pickles).

torch is imported only inside the functions that need it (:func:`load_pickle`, :func:`to_mx`), so the converters
import without it and the safetensors paths work without it.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import mlx.core as mx

from ptp_mlx.conversion import dtype_name, one_line
from ptp_mlx.errors import UserError

# ---------------------------------------------------------------------------------------------- reading


def sniff(path: Path) -> str:
    """File format from its first bytes: ``safetensors``, ``zip`` (torch.save), ``pickle``, ``gguf``."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:4] == b"GGUF":
        return "gguf"
    if head[:4] == b"PK\x03\x04":
        return "zip"
    if head[:1] == b"\x80":
        return "pickle"
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    return "unknown"


def load_safetensors(path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except Exception as e:  # MLX raises on truncated headers or data
        raise UserError(f"cannot read {path} (truncated or corrupt safetensors?): {one_line(e)}") from None


def load_pickle(path: Path, trust_pickle: bool = False) -> Any:
    """``torch.load`` under the pickle rule: ``weights_only=True`` unless the user trusts the file.

    A pickle can run arbitrary code while loading; ``weights_only`` restricts it to tensors and plain
    containers. Anything that needs more is refused with the global it asked for.
    """
    import pickle

    try:
        import torch
    except ImportError:
        raise UserError(
            f"{path.name} is a PyTorch pickle: reading it needs torch (pip install 'ptp-mlx[convert]')"
        ) from None
    try:
        with warnings.catch_warnings():  # torch warns about pickles it refuses; the refusal is our one error line
            warnings.simplefilter("ignore")
            return torch.load(str(path), map_location="cpu", weights_only=not trust_pickle, mmap=sniff(path) == "zip")
    except pickle.UnpicklingError as e:
        if trust_pickle:
            raise UserError(f"cannot unpickle {path}: {one_line(e)}") from None
        wanted = re.search(r"GLOBAL ([\w.]+)", str(e)) or re.search(r"global[s]? ['`]?([\w.]+)", str(e))
        what = f" (it asks for {wanted.group(1)})" if wanted else ""
        raise UserError(
            f"refusing to load {path}: it needs code execution beyond plain tensors{what}; "
            "pass --trust-pickle only if you trust where the file came from"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, AttributeError, ImportError, ModuleNotFoundError) as e:
        raise UserError(f"cannot read {path} (truncated or corrupt checkpoint?): {one_line(e)}") from None


def read_weight_file(path: Path, trust_pickle: bool = False) -> Any:
    """The object stored in a weight file: a dict of mx arrays (safetensors) or the unpickled object."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"file not found: {path}")
    kind = sniff(path)
    if kind == "safetensors":
        return load_safetensors(path)
    if kind in ("zip", "pickle"):
        return load_pickle(path, trust_pickle)
    if kind == "gguf":
        raise UserError(f"{path} is a GGUF file: use `ptp-convert gguf`")
    raise UserError(f"{path} is not a safetensors or PyTorch checkpoint (unknown file format)")


def is_tensor(v: Any) -> bool:
    return isinstance(v, mx.array) or (type(v).__module__.startswith("torch") and hasattr(v, "shape"))


def shape_of(v: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in v.shape)


def to_mx(v: Any) -> mx.array:
    """A torch tensor or mx array as an mx array, bit-exact (bfloat16 travels as raw 16-bit words)."""
    if isinstance(v, mx.array):
        return v
    import torch

    t = v.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def is_float(v: Any) -> bool:
    return dtype_name(v) in ("float32", "float16", "bfloat16", "float64")
