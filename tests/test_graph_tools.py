"""ptp-graph (ptp_mlx/kernels/graph_tools.py): built wherever MLX runs, its cut checked on real graphs, and where it
cannot be built, one notice and the builds let go as before."""

import mlx.core as mx
import numpy as np
import pytest

from ptp_mlx.kernels import extension, graph_tools


@pytest.fixture
def cut():
    fn = graph_tools.cut_buffers()
    if fn is None:
        pytest.skip(f"ptp-graph not built here: {graph_tools.state()}")
    return fn


def test_it_is_built_for_every_platform_without_machine_flags():
    spec = graph_tools.GRAPH
    assert not spec.linux_only and not any(f.startswith("-march") for f in spec.flags)
    assert spec.library_name().startswith("graph-") and spec.module == "_ptp_graph"


def test_a_cut_graph_no_longer_holds_the_buffer_and_another_writes_it_in_place(cut):
    """The unevaluated graph holds ``buf``: a later in-place update must copy it. Cut, the update writes ``buf``'s
    own memory (MLX donates a buffer nothing else holds), and the cut graph is let go unevaluated."""

    def address(a) -> int:
        return int(np.asarray(memoryview(a)).__array_interface__["data"][0])

    for cut_it in (False, True):
        buf = mx.arange(1 << 16, dtype=mx.float32)
        mx.eval(buf)
        where = address(buf)
        dropped = buf * 2  # a build never evaluated (its node reads buf)
        if cut_it:
            assert cut([dropped], [buf]) == 1
        new = buf.at[mx.array([3])].add(1.0)  # (the call queued instead: it writes buf in place if it may)
        del buf
        mx.eval(new)
        assert (address(new) == where) is cut_it
        assert new[3].item() == 4.0
        del dropped


def test_only_edges_to_the_named_buffers_are_cut_once_with_siblings(cut):
    a, b = mx.ones((6,)), mx.zeros((6,))
    mx.eval(a, b)
    x = a * 3 + b
    parts = mx.split(x, 3)  # three siblings of one node, each reading x
    assert cut(list(parts), [a]) == 0  # (the split reads x, not a)
    assert cut(list(parts), [x]) >= 1
    assert cut(list(parts), [x]) == 0
    total = a + b
    assert cut([total, total], [a, b]) == 2  # (walked once, both edges)


def test_a_buffer_read_a_few_nodes_deep_is_let_go_only_by_a_walk_that_deep(cut):
    """A build that moves rows (``fixed.move_rows``: a gather, a reshape and a slice update) reads the buffer a few
    nodes before its output: a walk of depth 1 cuts nothing and the later in-place write copies the buffer; a walk as
    deep as ``release.CUT_DEPTH`` cuts the gather's and the slice update's edges and the write is in place."""
    from ptp_mlx.decode.fixed import move_rows
    from ptp_mlx.decode.release import CUT_DEPTH

    def address(a) -> int:
        return int(np.asarray(memoryview(a)).__array_interface__["data"][0])

    for depth in (1, CUT_DEPTH):
        buf = mx.arange(1 << 16, dtype=mx.float32).reshape(1, 4, 256, 64)
        mx.eval(buf)
        where = address(buf)
        moved = move_rows(buf, mx.array([3, 4], dtype=mx.int32), mx.array(9, dtype=mx.int32))
        dropped = moved * 2  # (the build's call on the moved rows, never evaluated)
        edges = cut([dropped], [buf], [], depth)
        assert (edges >= 2) == (depth > 1) and (edges == 0) == (depth == 1)
        new = buf.at[mx.array([0])].add(1.0)  # (the call queued instead)
        del buf
        mx.eval(new)
        assert (address(new) == where) == (depth > 1)
        del moved, dropped


def test_a_node_reached_first_through_a_longer_path_is_walked_again_from_closer(cut):
    """The model's layers chain: the walk from a later layer's output reaches an earlier layer's node with little
    depth left; from that layer's own output it must still reach the buffer its move reads (with free rows, half the
    edges of an unused build with moved rows were missed so)."""
    buf = mx.arange(8, dtype=mx.float32)
    mx.eval(buf)
    moved = buf * 2  # (reads the buffer one node before the layer)
    layer1 = moved + 1
    layer2 = layer1 * 3  # (the next layer, reading the first)
    assert cut([layer1, layer2], [buf], [], 2) == 1


def test_nodes_a_kept_graph_reaches_are_never_cut(cut):
    """A node the dropped build shares with the build that runs (``keep``) keeps its edges, however deep the walk:
    the build that runs computes the right values; the dropped build's own nodes are cut."""
    buf = mx.arange(8, dtype=mx.float32)
    mx.eval(buf)
    for protect in (True, False):
        shared = buf * 3
        dropped = (shared + 1) + buf  # (its own node reads buf too)
        kept = shared * 2
        # the dropped build's own edge; unprotected, the shared node's too
        assert cut([dropped], [buf], [kept] if protect else [], 6) == (1 if protect else 2)
        assert np.array_equal(np.array(kept), np.arange(8) * 6) == protect


def test_builds_cut_as_made_leave_the_buffer_and_the_one_put_back_computes_as_built(cut):
    """``release.prepare``'s cut, made as each build is built (``cut_ahead``): the builds hold the buffer no more, so
    the build that runs after the read writes it in place, whichever build that is, once it has its edges back
    (``restore``, from the state it was built on, in the order the cut was given it), and computes exactly what it
    was built to; a second restore finds nothing left to put back; a node beyond the walk's depth is never cut."""
    from ptp_mlx.decode import release

    mod = release._graph()

    def address(a) -> int:
        return int(np.asarray(memoryview(a)).__array_interface__["data"][0])

    for runs in (0, 1):
        other = mx.ones((1,), dtype=mx.float32)
        buf = mx.arange(1 << 16, dtype=mx.float32)
        mx.eval(buf, other)
        where, want = address(buf), np.arange(1 << 16, dtype=np.float32)
        # two builds for two outcomes, never evaluated yet, each writing the buffer (as a call writes its K/V rows)
        builds = [buf.at[mx.array([3])].add(other), buf.at[mx.array([5])].add(2.0)]
        cuts = [mod.cut_ahead([b], [other, buf], [], release.CUT_DEPTH) for b in builds]
        assert [c.edges for c in cuts] == [2, 1]
        assert mod.restore(cuts[runs], [other, buf]) == cuts[runs].edges
        assert mod.restore(cuts[runs], [other, buf]) == 0
        ran = builds[runs]
        del buf, other
        mx.eval(ran)
        want[[3, 5][runs]] += [1.0, 2.0][runs]
        assert np.array_equal(np.array(ran), want) and address(ran) == where
        del builds, cuts, ran
    # a node two builds share, cut by the first: the second's cut says so, and ``prepare`` refuses it (restoring the
    # second would leave that node reading the placeholder)
    shared_buf = mx.arange(8, dtype=mx.float32)
    mx.eval(shared_buf)
    common = shared_buf * 2
    first = mod.cut_ahead([common + 1], [shared_buf], [], release.CUT_DEPTH)
    second = mod.cut_ahead([common - 1], [shared_buf], [], release.CUT_DEPTH)
    assert (first.edges, first.shared, second.edges, second.shared) == (1, 0, 0, 1)
    with pytest.raises(RuntimeError, match="another build's cut"):
        release.prepare(([common - 1], [], 0), ([shared_buf], [], 0))
    far = mx.arange(8, dtype=mx.float32)
    mx.eval(far)
    deep = far * 2
    for _ in range(release.CUT_DEPTH):
        deep = deep + 1
    assert mod.cut_ahead([deep], [far], [], release.CUT_DEPTH).edges == 0
    assert np.array_equal(np.array(deep), np.arange(8) * 2 + release.CUT_DEPTH)


def test_without_a_toolchain_builds_are_let_go_as_before_with_one_notice(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(extension, "shared_path", lambda name: None)
    monkeypatch.setattr(extension, "kernel_dir", lambda: tmp_path)
    monkeypatch.setattr(extension, "_cmake", lambda: None)
    monkeypatch.setattr(graph_tools, "_state", {"module": None, "tried": False, "why": ""})
    assert graph_tools.cut_buffers() is None and graph_tools.cut_buffers() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "notice: ptp-mlx's graph tools not built (no cmake found); calls built ahead and not used are let go on the "
        "critical path (slower where a device computes)"
    ]
    assert graph_tools.state() == "off (no cmake found)"
    from ptp_mlx.decode import release

    assert release._graph() is None


def test_turned_off_by_its_variable(monkeypatch, capsys):
    monkeypatch.setenv("PTP_MLX_GRAPH_TOOLS", "0")
    monkeypatch.setattr(graph_tools, "_state", {"module": None, "tried": False, "why": ""})
    assert graph_tools.cut_buffers() is None
    assert graph_tools.state() == "off (PTP_MLX_GRAPH_TOOLS=0)"
    assert "notice" not in capsys.readouterr().err
