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


# Imports the converters in a fresh interpreter where ``import torch`` fails (as on a machine without it), then
# reports which modules loaded and whether torch did.
_NO_TORCH = """
import importlib, sys

sys.modules["torch"] = None  # "import torch" now fails, and importlib.util.find_spec("torch") finds nothing
names = sys.argv[1:]
for name in names:
    importlib.import_module(name)
print(",".join(n for n in names if n in sys.modules), sys.modules.get("torch") is not None)
"""
CONVERTERS = ("ptp_mlx.convert.cli", "ptp_mlx.convert.common", "ptp_mlx.convert.hf", "ptp_mlx.convert.ptp")
CONVERTERS += ("ptp_mlx.conversion", "ptp_mlx.gguf")


def test_converters_import_without_torch_at_module_level():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *CONVERTERS], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    loaded, torch_loaded = out.stdout.split()
    assert loaded.split(",") == list(CONVERTERS) and torch_loaded == "False"


def test_the_torch_blocker_blocks():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NO_TORCH, "torch"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr and "torch" in out.stderr
