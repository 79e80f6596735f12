"""Paths in a tree of token rows (shared by the model's masks and the decode floor's call shapes)."""

from __future__ import annotations


def tree_path(parents, j: int) -> list[int]:
    """Token row ``j`` and its ancestors in a tree of token rows (``parents[j]``: the row ``j`` follows, -1 none)."""
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out
