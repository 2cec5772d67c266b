"""A launch that fails after it was enqueued is reported on its own stream, never moves, never
takes other work with it (issue 13 case 3; design.md section 4).

The failing kernel writes element 63 of its binding: WGSL declares ``array<f32, 64>``, so wgpu
refuses a 16-byte binding when the batch is finished; the numpy body raises ``IndexError`` on
the 4-element view. The same program runs on both backends and is checked against numpy.
(cuda: an out-of-bounds store is undefined behaviour there, not an error: not run.)
"""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import LaunchError, ReplayFailed

WGSL = """
@group(0) @binding(0) var<storage, read_write> y: array<f32, 64>;
@compute @workgroup_size(1)
fn main() { y[63] = 5.0; }
"""


def _past_end_cpu(y, *, count):
    y[63] = 5.0


PAST_END = runtime.Kernel("past_end", [runtime.Binding("y", "f32", "read_write")],
                          workgroup_size=(1, 1, 1), wgsl=WGSL, cpu=_past_end_cpu)
ONES = np.ones(4, np.float32)


@pytest.fixture
def ab(client, backend):
    if backend == "cuda":
        pytest.skip("an out-of-bounds store is undefined behaviour on cuda, not an error")
    return client, client.with_stream(runtime.StreamId.new())


def _add(c, x, y, alpha):
    c.launch(K.add_scalar, 1, [x, y], {"alpha": alpha, "n": 4})


def test_one_bad_launch_fails_alone_on_its_own_stream(ab):
    a, b = ab
    x, y0, y1, small = a.create(ONES), a.empty(4, np.float32), a.empty(4, np.float32), a.empty(4, np.float32)
    z = b.create(np.zeros(4, np.float32))
    b.sync()
    _add(a, x, y0, 1.0)
    a.launch(PAST_END, 1, [small])
    _add(a, x, y1, 2.0)
    b.write(z, np.full(4, 9, np.float32))       # wgpu: this write submits a's batch
    np.testing.assert_array_equal(b.read(z), np.full(4, 9, np.float32))   # b: no error, write kept
    with pytest.raises(LaunchError, match="past_end"):
        a.read(y0)                               # reported on a, naming the kernel
    np.testing.assert_array_equal(a.read(y0), ONES + 1)     # the good launches ran
    np.testing.assert_array_equal(a.read(y1), ONES + 2)
    with pytest.raises(ReplayFailed, match="past_end"):
        a.read(small)                            # what it would have written is marked
    b.sync()


def test_a_failing_replay_keeps_the_eager_launch_queued_before_it(ab, backend):
    a, b = ab
    x, out, y2, small = a.create(ONES), a.empty(4, np.float32), a.empty(4, np.float32), a.empty(4, np.float32)
    a.graph_prepare()
    a.start_capture()
    _add(a, x, out, 3.0)
    a.launch(PAST_END, 1, [small])
    g = a.stop_capture()
    _add(a, x, y2, 5.0)                          # eager, batched before the replay
    g.replay()
    with pytest.raises(LaunchError, match="past_end") as info:
        a.read(y2)
    assert f"graph {g.id}" in str(info.value)
    for h in (small, out):                       # the replay's whole write set is marked
        with pytest.raises(ReplayFailed, match="past_end"):
            a.read(h)
    np.testing.assert_array_equal(a.read(y2), ONES + 5)
    b.sync()                                     # nothing moved to another stream
