"""Letting go of the calls built ahead that the read did not use (``ahead.py``; docs/method.md, section 5): their
graphs' edges to the K/V buffers are cut before the call queued instead runs, so that it writes those buffers in
place, and the rest of their graphs go once it is queued (``CallQueue.bury``: off the critical path where a device
computes). Each build's cut is prepared while the call before it computes (``prepare``); after the read only the
walk is left (``park``). Without ptp-graph (``kernels/graph_tools.py``: no compiler) the builds go as they come."""

from __future__ import annotations

from .call import PendingCall

# How deep the cut walks from an unused build's K/V outputs: its compiled call reads a strand's moved rows through the
# move's slice update, and that through a reshape and the gather (``fixed.move_rows``).
CUT_DEPTH = 6


def _graph():
    """ptp-graph's module (``kernels/graph_tools.cpp``), or None where it is not built."""
    from ..kernels.graph_tools import module

    return module()


def _flat(state: tuple) -> list:
    keys, values, _ = state
    return [a for a in (*keys, *values) if a is not None]


def prepare(state: tuple, before: tuple | None, running: PendingCall | None = None):
    """The cut of a build (the cache's ``state`` after it, built on the state ``before``), found while ``running``
    (the call it was built after) computes: the edges of its graph within ``CUT_DEPTH`` nodes of its K/V outputs that
    read the buffers of ``before``, never walking into ``running``'s graph (MLX's stream thread evaluates it
    meanwhile); cut only by ``park``. None without ptp-graph."""
    graph = _graph()
    if graph is None or before is None:
        return None
    return graph.prepare(_flat(state), _flat(before), running.arrays if running is not None else [], CUT_DEPTH)


def park(grave: list | None, before: tuple | None, unused: list[tuple], keep=None) -> None:
    """Keep the builds ``unused`` (each ``(call, the cache's state after it, its prepared cut or None)``) in
    ``grave``, to be let go once the next call is queued (``CallQueue.bury``; letting a build go cost 0.19-0.35 ms on
    this CPU's path, docs/results/decode-floor/2026-12-06i/), their graphs' edges to the K/V buffers of ``before``
    (the state they were built on) cut first (the edges ``prepare`` found), never in a node whose edges the prepared
    cut of the build that runs (``keep``) holds too. Without ptp-graph (or ``grave`` None) they go now."""
    if grave is None or before is None or not unused:
        return
    graph = _graph()
    if graph is None:
        return
    plans = [p if p is not None else prepare(state, before) for _call, state, p in unused]
    graph.cut_prepared(plans, keep)
    # (the cuts go with the builds: letting go of a cut's node handles is a few hundred reference counts on memory
    # the compute pushed out of the caches, 0.05-0.1 ms a read on the path)
    grave.extend((call, state, plan) for (call, state, _), plan in zip(unused, plans, strict=True))
    if keep is not None:
        grave.append(keep)
