"""A launch that may write nothing never clears a failure mark (docs/contract.md section 4b).

A replay's clean mark says "this buffer was rewritten from clean data". A launch whose workgroup
count is 0 (after ``Graph.update(count=...)``) runs nothing, and an indirect count is read on the
device, so it may be 0: what such a launch writes may be left as the failed writer left it. Before
the fix the replay installed its clean mark on its whole write set anyway, so a read returned the
stale values without an error (and a later launch of the same graph reading that buffer was not
marked either); an eager indirect launch of count 0 did the same. Found by ADV2.

The failure is made the same way on every backend: a replay refused inside a capture window of
its stream marks the graph's write set (section 4).
"""

import numpy as np
import pytest

from runtime import kernels as K
from runtime.errors import ReplayFailed

from graph_kernels import capture
from helpers import fail_write_set


def test_a_launch_updated_to_a_zero_count_keeps_the_failure_of_what_it_writes(client):
    x = client.create(np.arange(4, dtype=np.float32))
    y = client.create(np.zeros(4, np.float32))
    z = client.create(np.zeros(4, np.float32))

    def work():
        client.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})    # y = x + 1
        client.launch(K.add_scalar, 1, [y, z], {"alpha": 10.0, "n": 4})   # z = y + 10
    g = capture(client, work)
    g.replay()
    np.testing.assert_array_equal(client.read(z), [11, 12, 13, 14])
    fail_write_set(client, g)
    for h in (y, z):
        with pytest.raises(ReplayFailed):
            client.read(h)
    g.update(count={0: (0, 1, 1)})          # y = x + 1 runs nothing now
    g.replay()
    with pytest.raises(ReplayFailed):       # old: the stale [1, 2, 3, 4]
        client.read(y)
    with pytest.raises(ReplayFailed):       # old: z computed from the stale y, no error
        client.read(z)
    g.update(count={0: (1, 1, 1)})
    g.replay()                              # written from clean data again: recovered
    np.testing.assert_array_equal(client.read(y), [1, 2, 3, 4])
    np.testing.assert_array_equal(client.read(z), [11, 12, 13, 14])


def test_an_indirect_launch_keeps_the_failure_of_what_it_writes(client):
    if not client.capabilities["indirect_dispatch"]:
        pytest.skip("the device does not read counts: launch reads them first (count 0: no-op)")
    x = client.create(np.arange(4, dtype=np.float32))
    y = client.create(np.zeros(4, np.float32))
    g = capture(client, lambda: client.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4}))
    g.replay()
    client.sync()
    fail_write_set(client, g)
    zero = client.create(np.array([0, 1, 1], np.uint32))
    client.launch(K.add_scalar, zero, [x, y], {"alpha": 5.0, "n": 4})    # runs nothing
    with pytest.raises(ReplayFailed):       # old: the stale [1, 2, 3, 4]
        client.read(y)
    client.launch(K.add_scalar, 1, [x, y], {"alpha": 5.0, "n": 4})       # a direct launch
    np.testing.assert_array_equal(client.read(y), [5, 6, 7, 8])


def test_a_graph_writing_a_buffer_only_through_an_indirect_launch_keeps_its_failure(client):
    if not client.capabilities["indirect_dispatch"]:
        pytest.skip("a capture window refuses an indirect launch here")
    x = client.create(np.arange(4, dtype=np.float32))
    y = client.create(np.zeros(4, np.float32))
    cnt = client.create(np.array([1, 1, 1], np.uint32))
    g = capture(client, lambda: client.launch(K.add_scalar, cnt, [x, y], {"alpha": 1.0, "n": 4}))
    g.replay()
    np.testing.assert_array_equal(client.read(y), [1, 2, 3, 4])
    fail_write_set(client, g)
    client.write(cnt, np.array([0, 1, 1], np.uint32))
    g.replay()                              # count 0 on the device: y not written
    with pytest.raises(ReplayFailed):       # old: the stale [1, 2, 3, 4]
        client.read(y)
    client.write(y, np.zeros(4, np.float32))
    client.write(cnt, np.array([1, 1, 1], np.uint32))
    g.replay()
    np.testing.assert_array_equal(client.read(y), [1, 2, 3, 4])
