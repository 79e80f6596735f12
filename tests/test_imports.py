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


# Packages import downward only (issue 42): a module imports modules of its own floor or lower ones, at module level
# and inside functions alike. Floors, lowest first; a module not named takes the floor of its nearest named parent.
FLOORS: dict[str, float] = {
    "ptp_mlx": 0,  # the leaves: errors, paths, sampler, logits, adapter_config, blas, kernels, ...
    "ptp_mlx.model": 1,
    "ptp_mlx.adapter": 1.5,  # (adapters and checkpoints onto the model)
    "ptp_mlx.models": 1.5,
    "ptp_mlx.prompt_cache": 1.5,
    "ptp_mlx.drafting": 2,
    "ptp_mlx.decode": 3,
    "ptp_mlx.generate": 4,
    "ptp_mlx.engine": 4,
    "ptp_mlx.stats": 4.5,  # (what decoding steps add up to: bench, chat, server)
    "ptp_mlx.ties": 4.5,  # (a divergence judged against plain decoding's own logits)
    "ptp_mlx.generate_cli": 5,
    "ptp_mlx.cli_common": 5,
    "ptp_mlx.serve": 5,
    "ptp_mlx.bench": 5,
    "ptp_mlx.train": 5,
    "ptp_mlx.testing": 6,
}


def floor_of(module: str, floors: dict[str, float] = FLOORS) -> float:
    m = module
    while m not in floors:
        m = m.rpartition(".")[0]
    return floors[m]


def climbing(graph: dict[str, set[str]], floors: dict[str, float] = FLOORS) -> list[tuple[str, str]]:
    """Every import ``(module, imported)`` from a lower floor to a higher one."""
    return sorted((m, t) for m, ts in graph.items() for t in ts if floor_of(t, floors) > floor_of(m, floors))


def test_the_floor_check_catches_a_climbing_import():
    planted = {"ptp_mlx.model.layers": {"ptp_mlx.decode.shape"}, "ptp_mlx.decode.shape": {"ptp_mlx.model.shape"}}
    assert climbing(planted) == [("ptp_mlx.model.layers", "ptp_mlx.decode.shape")]
    assert floor_of("ptp_mlx.decode.probe") == 3 and floor_of("ptp_mlx.sampler") == 0


def test_packages_import_downward_only():
    up = climbing(import_graph())
    assert not up, "\n".join(f"{m} (floor {floor_of(m)}) imports {t} (floor {floor_of(t)})" for m, t in up)
