"""Letting go of the calls built ahead that the read did not use (``ahead.py``; docs/method.md, section 5): every
build's edges to the K/V buffers it was built on are cut as it is made, while the call before it computes
(``prepare``), so that whichever call is queued after the read writes those buffers in place; the build that runs
gets its edges back (``restore``), and the others' graphs go once it is queued (``park``, ``CallQueue.bury``: off
the critical path where a device computes). Without ptp-graph (``kernels/graph_tools.py``: no compiler) nothing is
cut and unused builds go as they come."""

from __future__ import annotations

from .call import PendingCall

# How deep the cut walks from a build's K/V outputs: its compiled call reads a strand's moved rows through the move's
# slice update, and that through a reshape and the gather (``fixed.move_rows``).
CUT_DEPTH = 6


def _graph():
    """ptp-graph's module (``kernels/graph_tools.cpp``), or None where it is not built."""
    from ..kernels.graph_tools import module

    return module()


def _flat(state: tuple) -> list:
    keys, values, _ = state
    return [a for a in (*keys, *values) if a is not None]


def prepare(state: tuple, before: tuple | None, running: PendingCall | None = None):
    """Cut a build (the cache's ``state`` after it, built on the state ``before``) while ``running`` (the call it was
    built after) computes: the edges of its graph within ``CUT_DEPTH`` nodes of its K/V outputs that read the
    buffers of ``before`` point elsewhere from now on, never walking into ``running``'s graph (MLX's stream thread
    evaluates it meanwhile). Returns the cut, which ``restore`` undoes for the build that runs; None without
    ptp-graph (nothing cut)."""
    graph = _graph()
    if graph is None or before is None:
        return None
    cut = graph.cut_ahead(_flat(state), _flat(before), running.arrays if running is not None else [], CUT_DEPTH)
    if cut.shared:  # (builds share no node that reads the buffers: each moves its rows, or grows them, in its own)
        raise RuntimeError("ptp-graph: a build reads a node another build's cut has cut (restore would not mend it)")
    return cut


def restore(cut, before: tuple | None) -> None:
    """Give the build that runs its edges back (``cut``: its ``prepare``d cut, None: nothing was cut), each to its
    buffer of ``before``, the state it was built on: before it is queued (a node left cut would read a scalar)."""
    if cut is None:
        return
    graph = _graph()
    if before is None or graph is None or graph.restore(cut, _flat(before)) != cut.edges:
        raise RuntimeError("ptp-graph: a build's cut edges could not all be put back")


def park(grave: list | None, unused: list[tuple]) -> None:
    """Keep the builds ``unused`` (each ``(call, the cache's state after it, its cut or None)``) in ``grave``, to be
    let go once the next call is queued (``CallQueue.bury``; letting a build go cost 0.19-0.35 ms on this CPU's path,
    docs/results/decode-floor/2026-12-06i/). Only cut builds wait there (they hold none of the buffers the call queued
    instead writes); the others, and all of them where ``grave`` is None, go now."""
    if grave is not None:
        grave.extend(u for u in unused if u[2] is not None)
