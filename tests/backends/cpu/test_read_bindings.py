"""A cpu kernel body gets its ``read`` bindings as read-only views: a body that writes one (a
kernel whose access is misdeclared) fails with a ``LaunchError`` that marks its outputs,
eagerly and inside a replay, and the buffer it tried to write is unchanged. Before, the write
went through: a buffer declared read changed with no cross-stream ordering, no graph write set
and no failure mark covering it (ADV3). WebGPU refuses a write to ``var<storage, read>`` when
the shader compiles, so this is the cpu backend catching up."""

import numpy as np
import pytest

import runtime
from runtime import Binding, Kernel
from runtime.errors import LaunchError, ReplayFailed


def _sneaky(x, y, *, count):
    y[:] = x + 1
    x[0] = 99.0                      # writes the binding it declared "read"


SNEAKY = Kernel("sneaky", [Binding("x", "f32", "read"), Binding("y", "f32", "write")],
                workgroup_size=(1, 1, 1), cpu=_sneaky)


@pytest.mark.parametrize("size", [4, 1 << 16], ids=["tiny", "worker"])
def test_a_body_writing_a_read_binding_fails_and_changes_nothing(size):
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    x = c.create(np.zeros(size, np.float32))
    y = c.create(np.full(size, 5, np.float32))
    c.launch(SNEAKY, 1, [x, y])
    with pytest.raises(ReplayFailed, match="read-only") as e:
        c.read(y)                    # its output is marked; the stream's LaunchError with it
    assert isinstance(e.value, LaunchError)
    c.sync()                         # (raised once)
    np.testing.assert_array_equal(c.read(x), np.zeros(size, np.float32))


def test_a_replay_of_a_body_writing_a_read_binding_fails_and_changes_nothing():
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    x = c.create(np.zeros(4, np.float32))
    y = c.create(np.full(4, 5, np.float32))
    c.graph_prepare()
    c.start_capture()                # (no warm-up: it would fail)
    c.launch(SNEAKY, 1, [x, y])
    g = c.stop_capture()
    g.replay()
    with pytest.raises(ReplayFailed, match="read-only"):
        c.read(y)
    c.sync()
    np.testing.assert_array_equal(c.read(x), np.zeros(4, np.float32))
