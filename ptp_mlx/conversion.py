"""What every converter shares, the GGUF one of the default model included: output checks, progress and the
summary. Reading PyTorch files (and so torch) stays in ``convert/common.py``."""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from tqdm import tqdm

from .errors import UserError
from .paths import creation_problem

FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def dtype_name(v: Any) -> str:
    return str(v.dtype).replace("mlx.core.", "").replace("torch.", "")


# ---------------------------------------------------------------------------------------------- output


def check_output(out: Path | None, overwrite: bool, dry_run: bool) -> Path | None:
    """Fail early, before any heavy work, when ``out`` cannot be written."""
    if dry_run:
        return Path(out) if out else None
    if out is None:
        raise UserError("--out DIR is required (or pass --dry-run)")
    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise UserError(f"output folder already exists: {out} (pass --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise UserError(f"output path exists and is not a folder: {out}")
    problem = creation_problem(out)  # (nothing made yet: ``atomic_dir`` makes the parents, and removes them on failure)
    if problem:
        raise UserError(f"cannot write {out}: {problem}")
    return out


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def progress(items: Iterable, desc: str, total: int | None = None, unit: str = "tensor"):
    """A tqdm bar on stderr (stdout carries the product)."""
    return tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------- summary


@dataclass
class Mapping:
    """One source tensor and where it went (``dst`` None when dropped, with the reason)."""

    src: str
    dst: str | None
    shape: tuple[int, ...]
    dtype: str
    why: str = ""

    def line(self) -> str:
        dst = self.dst if self.dst is not None else f"(dropped: {self.why})"
        return f"{self.src} -> {dst}  {list(self.shape)} {self.dtype}"


@dataclass
class Summary:
    """What a conversion mapped and wrote; ``lines()`` is what the CLI prints on stderr."""

    kind: str
    mappings: list[Mapping] = field(default_factory=list)
    written: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # dst tensor -> (shape, dtype)
    out: Path | None = None
    bytes: int = 0
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def mapped(self) -> int:
        return sum(m.dst is not None for m in self.mappings)

    @property
    def dropped(self) -> list[Mapping]:
        return [m for m in self.mappings if m.dst is None]

    def lines(self, max_groups: int = 24) -> list[str]:
        tensors = self.written or {m.dst: (m.shape, m.dtype) for m in self.mappings if m.dst}
        n_params = sum(_numel(s) for s, _ in tensors.values())
        dtypes = Counter(d for _, d in tensors.values())
        out = [
            f"{self.kind}: mapped {self.mapped} source tensors, dropped {len(self.dropped)}"
            + (f" ({', '.join(sorted({m.why for m in self.dropped}))})" if self.dropped else "")
        ]
        verb = "wrote" if self.written else "would write (source shapes and dtypes)"
        out.append(
            f"  {verb} {len(tensors)} tensors, {n_params / 1e6:.2f}M values, dtypes "
            + ", ".join(f"{d} x{c}" for d, c in sorted(dtypes.items()))
        )
        for k, v in self.info.items():
            out.append(f"  {k}: {v}")
        groups = shape_groups(tensors)
        for line in groups[:max_groups]:
            out.append(f"    {line}")
        if len(groups) > max_groups:
            out.append(f"    ... {len(groups) - max_groups} more groups")
        out.extend(f"  note: {n}" for n in self.notes)
        if self.out is not None and self.written:
            out.append(f"  size on disk: {human_bytes(self.bytes)} in {self.out}")
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def shape_groups(tensors: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    """Compact shape listing: per-layer tensors folded into ``layers.*`` with a count."""
    groups: dict[tuple[str, tuple[int, ...], str], int] = {}
    for name, (shape, dtype) in tensors.items():
        key = (re.sub(r"(^|[./])layers\.\d+\.", r"\1layers.*.", name), tuple(shape), dtype)
        groups[key] = groups.get(key, 0) + 1
    return [f"{n} {list(s)} {d}" + (f" x{c}" if c > 1 else "") for (n, s, d), c in sorted(groups.items())]


def one_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
