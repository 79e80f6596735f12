"""No import circles in ``ptp_mlx``: every import between its modules, at module level or inside a function,
is an edge of one graph, and that graph has no cycle (a lazy import only hides a circle, it does not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

import ptp_mlx

ROOT = Path(ptp_mlx.__file__).parent


def _module_name(path: Path) -> str:
    parts = ["ptp_mlx", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``module -> {ptp_mlx modules it imports}``, from the source of every module of the package."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(0, node.level - 1)):
                    base = base.rpartition(".")[0]
                base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                # ``from .pkg import name``: name may be a submodule of pkg or an attribute defined in it
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:  # ``import ptp_mlx.x.y`` names x.y; an attribute names its module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (cyc := visit(n)):
                return cyc
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (cyc := visit(m)):
            return cyc
    return None


def test_the_graph_sees_lazy_and_relative_imports():
    g = import_graph()
    assert "ptp_mlx.sampler" in g["ptp_mlx.generate"]  # module level, relative
    assert "ptp_mlx.ties" in g["ptp_mlx.testing"]  # inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles_in_ptp_mlx():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)
