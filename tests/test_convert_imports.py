"""torch stays out of the runtime: no module imports it at import time; converters import it lazily inside
the functions that need it (runs without torch)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_level_torch_imports(path: Path) -> list[int]:
    """Line numbers of ``import torch`` / ``from torch ...`` outside any function body."""
    hits = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import) and any(a.name.split(".")[0] == "torch" for a in child.names):
                hits.append(child.lineno) if not in_function else None
            elif isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "torch":
                hits.append(child.lineno) if not in_function else None
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return hits


def test_no_module_level_torch_import_in_package():
    files = [p for d in ("ptp_mlx", "app", "convert") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 10
    offenders = {str(p.relative_to(ROOT)): lines for p in files if (lines := module_level_torch_imports(p))}
    assert offenders == {}


def test_converters_import_without_torch_at_module_level():
    import ptp_mlx.convert.cli  # noqa: F401
    import ptp_mlx.convert.common  # noqa: F401
    import ptp_mlx.convert.hf  # noqa: F401
    import ptp_mlx.convert.ptp  # noqa: F401

    import ptp_mlx.conversion  # noqa: F401
    import ptp_mlx.gguf  # noqa: F401
