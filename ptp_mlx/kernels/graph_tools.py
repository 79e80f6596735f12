"""ptp-graph (``graph_tools.cpp``): the decoding loop's operations on MLX graphs that are never evaluated, one small
MLX C++ extension built at first use wherever MLX runs (Linux, a Mac, CUDA) and wherever a C++ compiler, CMake and
nanobind are: no kernels, no machine-specific flags. Today it holds the cut of a call built ahead and not used
(``cut_buffers``; cut as it is built and put back for the build that runs: ``cut_ahead``, ``restore``), which lets that call go after
the next call is queued rather than on the critical path (``decode/release.py``).

Never required: where it cannot be built, unused builds are let go as they come (one notice says so).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .extension import ModuleSpec, load

GRAPH = ModuleSpec((Path(__file__).with_name("graph_tools.cpp"),), (), "_ptp_graph", ("-O2",), "graph", False)
_state: dict = {"module": None, "tried": False, "why": ""}


def _self_check(mod) -> str:
    """The cut on small unevaluated graphs: one edge to the buffer named, none to a buffer the node does not read,
    none the second time (the edge points elsewhere now); a node two edges deep only where the walk goes that deep,
    and never one a kept graph reaches; a cut made ahead put back once, and the graph then computes as built."""
    import mlx.core as mx
    import numpy as np

    buf, other, unrelated = mx.zeros((4,)), mx.ones((4,)), mx.ones((2,))
    mx.eval(buf, other, unrelated)
    total = buf + other  # (never evaluated)
    got = [mod.cut_buffers([total], [unrelated]), mod.cut_buffers([total], [buf]), mod.cut_buffers([total], [buf])]
    shared = buf * 3  # (read by a dropped graph and by a kept one)
    deep = (buf * 2) + shared
    got += [mod.cut_buffers([deep], [buf]), mod.cut_buffers([deep], [buf], [shared + 1], 3)]
    # cut ahead (as a build is made), then put back for the build that runs: it computes from the buffer again
    vals = mx.arange(4, dtype=mx.float32)
    mx.eval(vals)
    made = (vals * 4) + 1
    ahead = mod.cut_ahead([made], [other, vals], [], 3)
    got += [ahead.edges, mod.restore(ahead, [other, vals]), mod.restore(ahead, [other, vals])]
    if not np.array_equal(np.array(made), np.arange(4) * 4 + 1):
        return "its self-check's restored graph computed the wrong values"
    if got != [0, 1, 0, 0, 1, 1, 1, 0]:
        return "its self-check disagreed with the graph it cut"
    return ""


def module():
    """The loaded ``_ptp_graph`` module, or None (a one-line notice the first time it cannot be had, unless no
    compiler is the reason on a machine where the CPU kernels gave that notice already)."""
    if _state["tried"]:
        return _state["module"]
    _state["tried"] = True
    if os.environ.get("PTP_MLX_GRAPH_TOOLS", "").strip().lower() in ("0", "off", "no", "false"):
        _state["why"] = "PTP_MLX_GRAPH_TOOLS=0"
        return None
    mod, why = load(GRAPH, _self_check)  # (never required: any failure is the notice, builds go as they come)
    if mod is not None:
        _state["module"] = mod
        return mod
    _state["why"] = why
    print(
        f"notice: ptp-mlx's graph tools not built ({why}); calls built ahead and not used are let go on the "
        "critical path (slower where a device computes)",
        file=sys.stderr,
    )
    return None


def cut_buffers():
    """``cut_buffers(outs, bufs, keep=[], depth=1)`` (see ``graph_tools.cpp``), or None where the module is not
    built."""
    mod = module()
    return None if mod is None else mod.cut_buffers


def state() -> str:
    """``"in use"``, ``"off (<why>)"`` or ``"not tried"``: what a report records."""
    if not _state["tried"]:
        return "not tried"
    return "in use" if _state["module"] is not None else f"off ({_state['why']})"
