"""No function in ``ptp_mlx/decode`` or ``ptp_mlx/model`` takes more than 7 parameters (issue 42, item 4): what a call
takes travels as records (``decode/shape.py``: ``CallSpec``, ``CallInputs``), not as long argument lists. ``self``
and ``cls`` do not count; ``*args`` and ``**kwargs`` do, and so do nested functions."""

from __future__ import annotations

import ast
from pathlib import Path

import ptp_mlx

ROOT = Path(ptp_mlx.__file__).parent
PACKAGES = ("decode", "model")
MAX_PARAMS = 7
EXEMPT: set[tuple[str, str]] = set()  # (path under ptp_mlx, function name): none


def n_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    n = len(positional) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if positional and positional[0].arg in ("self", "cls") else 0)


def too_many(source: str, limit: int = MAX_PARAMS) -> list[tuple[str, int]]:
    """``(function name, parameters)`` of every function in ``source`` with more than ``limit`` parameters."""
    return [
        (node.name, n_params(node))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n_params(node) > limit
    ]


def test_the_check_counts_parameters():
    planted = """
def eight(a, b, c, d, e, f, g, h): pass
def seven(a, b, c, d, e, f, g): pass
def rest(a, b, c, d, e, f, *args, **kw): pass
def keywords(a, *, b, c, d, e, f, g, h): pass
class K:
    def method(self, a, b, c, d, e, f, g): pass
    def wide(self, a, b, c, d, e, f, g, h): pass
    @classmethod
    def make(cls, a, b, c, d, e, f, g): pass
def outer():
    def inner(a, b, c, d, e, f, g, h): pass
"""
    assert sorted(too_many(planted)) == [("eight", 8), ("inner", 8), ("keywords", 8), ("rest", 8), ("wide", 8)]


def test_no_function_in_decode_or_model_takes_more_than_seven_parameters():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += [(rel, name, n) for name, n in too_many(path.read_text()) if (rel, name) not in EXEMPT]
    assert not found, "\n".join(f"{rel}: {name} takes {n} parameters (at most {MAX_PARAMS})" for rel, name, n in found)
