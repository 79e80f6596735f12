"""Every test asserts something that can fail: an AST check over ``tests/`` (issue 31).

A test passes the check when its body (nested functions included) has an ``assert`` whose condition is not a
constant, a ``pytest.raises`` / ``pytest.warns`` / ``pytest.fail``, or a call to a helper that does (helpers are
found the same way, transitively, in ``tests/`` and ``ptp_mlx/testing/``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST_CHECKS = {"raises", "warns", "fail", "deprecated_call"}


def _called_names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def _checks_directly(fn: ast.AST) -> bool:
    for n in ast.walk(fn):
        if isinstance(n, ast.Assert) and not isinstance(n.test, ast.Constant):
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in PYTEST_CHECKS:
            if isinstance(n.func.value, ast.Name) and n.func.value.id == "pytest":
                return True
    return False


def _functions(paths) -> dict[str, list[ast.AST]]:
    out: dict[str, list[ast.AST]] = {}
    for p in paths:
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(n.name, []).append(n)
    return out


def unchecked_tests(paths) -> list[str]:
    """``file::test`` for every test function that asserts nothing that can fail."""
    helpers = _functions([*paths, *sorted((ROOT / "ptp_mlx" / "testing").glob("*.py"))])
    checking = {name for name, fns in helpers.items() if any(_checks_directly(f) for f in fns)}
    while True:  # helpers that call checking helpers check too
        more = {
            name
            for name, fns in helpers.items()
            if name not in checking and any(_called_names(f) & checking for f in fns)
        }
        if not more:
            break
        checking |= more
    bad = []
    for p in paths:
        for n in ast.parse(p.read_text()).body:
            fns = (
                [n]
                if isinstance(n, ast.FunctionDef)
                else [m for m in n.body if isinstance(m, ast.FunctionDef)]
                if isinstance(n, ast.ClassDef)
                else []
            )
            for f in fns:
                if f.name.startswith("test") and not (_checks_directly(f) or _called_names(f) & checking):
                    bad.append(f"{p.name}::{f.name}")
    return bad


def test_every_test_asserts_something_that_can_fail():
    paths = sorted((ROOT / "tests").glob("test_*.py"))
    assert len(paths) > 30
    assert unchecked_tests(paths) == []


def test_the_check_finds_a_test_without_one(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text(
        "import pytest\n\n"
        "def helper(x):\n    assert x\n\n"
        "def test_const():\n    assert True\n\n"
        "def test_nothing():\n    print(1)\n\n"
        "def test_helper():\n    helper(1)\n\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n"
    )
    assert unchecked_tests([f]) == ["test_x.py::test_const", "test_x.py::test_nothing"]
