"""An indirect launch reads its count buffer: a failure of that buffer's last writer reaches
what the launch writes (docs/contract.md section 4: a failure reaches everything computed from
the failed data).

Before ADV8 an eager indirect launch inherited the marks of its ``read`` bindings only: with its
count buffer's writer failed (the buffer still holding the counts from before), it ran the stale
counts, its output took a clean mark, and a read returned values computed from them without an
error (a count of 0 left by the failed writer: the output's old zeros instead of ``x + 1``).
A graph's indirect count was already a source (``capture.sources``). cuda reads the counts on
the host first (``h_indirect_count``), which raises.
"""

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import ReplayFailed
from runtime.kernel import Binding, Kernel

from graph_kernels import capture
from helpers import fail_write_set


def _counts_writer(c):
    """``(src, cnt, g)``: ``g`` copies ``src`` into the count buffer ``cnt`` (warmed up: cnt
    holds [0, 1, 1]); ``src`` then holds [2, 1, 1], what the next replay would copy."""
    src = c.create(np.array([0, 1, 1], np.uint32))
    cnt = c.create(np.array([5, 5, 5], np.uint32))
    g = capture(c, lambda: c.launch(K.copy_words, 1, [src, cnt], {"n": 3}))
    c.sync()
    c.write(src, np.array([2, 1, 1], np.uint32))
    return src, cnt, g


def test_an_indirect_launch_counted_by_a_failed_writer_inherits_the_failure(client):
    if not client.capabilities["indirect_dispatch"]:
        pytest.skip("the device does not read counts: launch reads them on the host first")
    src, cnt, g = _counts_writer(client)
    fail_write_set(client, g)                         # cnt keeps [0, 1, 1]: the failed copy's target
    x = client.create(np.arange(128, dtype=np.float32))
    y = client.create(np.zeros(128, np.float32))
    client.launch(K.add_scalar, cnt, [x, y], {"alpha": 1.0, "n": 128})
    for _ in range(2):                       # old: zeros (count 0 ran nothing), no error
        with pytest.raises(ReplayFailed):
            client.read(y)
    other = client.with_stream(runtime.StreamId.new())
    client.sync()
    with pytest.raises(ReplayFailed):        # from another stream too
        other.read(y)
    z = client.create(np.zeros(128, np.float32))
    client.launch(K.add_scalar, 2, [y, z], {"alpha": 1.0, "n": 128})
    with pytest.raises(ReplayFailed):        # and what is computed from it
        client.read(z)
    g.replay()                               # the counts are rewritten from clean data
    client.write(y, np.zeros(128, np.float32))   # (an indirect launch keeps y's own mark)
    client.launch(K.add_scalar, cnt, [x, y], {"alpha": 1.0, "n": 128})
    np.testing.assert_array_equal(client.read(y), np.arange(128, dtype=np.float32) + 1)


def _fail_counts(c, *, count):
    raise ValueError("count writer fails (injected by the test)")


#: writes a u32 count buffer, failing at execution (cpu: a worker runs it, after the launches
#: enqueued behind it were)
FAIL_COUNTS = Kernel("fail_counts", [Binding("c", "u32", "write")], cpu=_fail_counts)


def test_an_indirect_launch_inherits_a_count_writer_failing_after_it_was_enqueued():
    c = runtime.client("cpu")
    c.set_stream(runtime.StreamId.new())
    cnt = c.create(np.array([0, 1, 1], np.uint32))
    x = c.create(np.arange(128, dtype=np.float32))
    y = c.create(np.zeros(128, np.float32))
    c.launch(FAIL_COUNTS, 1, [cnt])          # fails when it runs, after the launch below is
    c.launch(K.add_scalar, cnt, [x, y], {"alpha": 1.0, "n": 128})      # enqueued
    with pytest.raises(ReplayFailed):        # (with the stream's LaunchError)
        c.read(y)
    with pytest.raises(ReplayFailed):        # old: zeros, no error
        c.read(y)
    c.write(cnt, np.array([2, 1, 1], np.uint32))
    c.write(y, np.zeros(128, np.float32))
    c.launch(K.add_scalar, cnt, [x, y], {"alpha": 1.0, "n": 128})
    np.testing.assert_array_equal(c.read(y), np.arange(128, dtype=np.float32) + 1)
