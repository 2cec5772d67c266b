"""A cpu kernel's ``bind`` (the resolved-call hook of runtime.kernel) that raises is the kernel
failing: eagerly the launch's outputs are marked; at ``stop_capture`` and ``Graph.update`` (the
graph's calls are bound there) it is a ``LaunchError``, the window is gone and an update changes
nothing. Before, both raised the bind's own exception (a raw RuntimeError: not a typed error),
and the failed update had already swapped its launch list into the backend graph, which a
later update of another launch then bound again (ADV3)."""

import numpy as np
import pytest

import runtime
from runtime import Binding, Kernel, Param
from runtime.errors import LaunchError


def _scale(x, y, *, alpha, count):
    y[:] = x * alpha


def _bind_scale(x, y, *, alpha, count):
    if alpha < 0:
        raise RuntimeError("this bind refuses a negative alpha")
    return lambda: np.multiply(x, alpha, out=y)


_scale.bind = _bind_scale
SCALE = Kernel("scale", [Binding("x", "f32", "read"), Binding("y", "f32", "write")],
               [Param("alpha", "f32")], workgroup_size=(1, 1, 1), cpu=_scale)


def test_a_bind_that_raises_at_capture_is_a_launch_error_and_closes_the_window():
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    x = c.create(np.ones(4, np.float32))
    y = c.create(np.full(4, 7, np.float32))
    c.sync()
    c.graph_prepare()
    c.start_capture()
    c.launch(SCALE, 1, [x, y], {"alpha": -1.0})
    with pytest.raises(LaunchError, match="bind raised"):
        c.stop_capture()
    np.testing.assert_array_equal(c.read(y), np.full(4, 7, np.float32))   # nothing ran
    c.graph_prepare()                 # the stream is back to no capture
    c.abort_capture()


def test_an_update_whose_bind_raises_changes_nothing():
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    x = c.create(np.full(4, 2, np.float32))
    y = c.create(np.zeros(4, np.float32))
    c.graph_prepare()
    c.launch(SCALE, 1, [x, y], {"alpha": 3.0})
    c.start_capture()
    c.launch(SCALE, 1, [x, y], {"alpha": 3.0})
    g = c.stop_capture()
    with pytest.raises(LaunchError, match="bind raised"):
        g.update(params={0: {"alpha": -1.0}})
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.full(4, 6, np.float32))   # the old params
    g.update(params={0: {"alpha": 5.0}})                                   # and it still updates
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.full(4, 10, np.float32))
