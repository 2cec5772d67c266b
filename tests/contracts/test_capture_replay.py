"""Capture and replay on every backend: CubeCL scenarios 1-5 (A: hardware expectations where the
backend has hardware graphs, e.g. cuda) and 11-20 (C: software graphs), cubecl-scenarios.md.

Where a scenario's expected output equals what the warm-up already wrote, a variant changes the
inputs between warm-up and replay, so a replay that does nothing fails.
"""

import threading

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import CaptureRefused, GraphStateError, LaunchError, UnknownGraph

from helpers import add_one, captured_once, mul_two, prelude


def test_capture_replay_runs_the_recorded_launch_twice(client):          # scenarios 1, 11
    inp, out = prelude(client)
    client.start_capture()
    add_one(client, inp, out)
    g = client.stop_capture()
    for _ in range(2):
        g.replay()
        np.testing.assert_array_equal(client.read(out), [2, 3, 4, 5])


def test_replay_is_not_a_noop_when_inputs_change_after_warmup(client):   # variant of 1 / 11
    inp, out = prelude(client)
    client.start_capture()
    add_one(client, inp, out)
    g = client.stop_capture()
    client.write(out, np.zeros(4, np.float32))
    np.testing.assert_array_equal(client.read(out), [0, 0, 0, 0])     # capture did not execute
    g.replay()
    np.testing.assert_array_equal(client.read(out), [2, 3, 4, 5])


def test_input_rewrite_is_seen_by_the_next_replay(client):               # scenarios 3, 13
    inp, out = prelude(client)
    client.start_capture()
    add_one(client, inp, out)
    g = client.stop_capture()
    g.replay()
    np.testing.assert_array_equal(client.read(out), [2, 3, 4, 5])
    client.write(inp, np.array([10, 20, 30, 40], np.float32))
    g.replay()
    np.testing.assert_array_equal(client.read(out), [11, 21, 31, 41])


def test_allocation_inside_the_window(client, hardware):                # scenarios 2, 12
    inp, out = prelude(client)
    client.start_capture()
    add_one(client, inp, out)
    grown = client.empty(3_145_733)
    if hardware:
        with pytest.raises(CaptureRefused, match="allocated inside the window"):
            client.stop_capture()
        return
    g = client.stop_capture()                      # a software graph pins the new buffer
    client.write(inp, np.array([5, 6, 7, 8], np.float32))
    g.replay()
    np.testing.assert_array_equal(client.read(out), [6, 7, 8, 9])
    del grown


def _chain(c, inp, tmp, out):
    add_one(c, inp, tmp)
    mul_two(c, tmp, out)


def test_intermediate_recycling_keeps_window_buffers_pinned(client):     # scenarios 4, 14
    c = client
    inp = c.create(np.array([1, 2, 3, 4], np.float32))
    out = c.empty(4, np.float32)
    c.graph_prepare()
    tmp = c.empty(4, np.float32)
    _chain(c, inp, tmp, out)
    np.testing.assert_array_equal(c.read(out), [4, 6, 8, 10])
    del tmp
    c.start_capture()
    tmp = c.empty(4, np.float32)
    _chain(c, inp, tmp, out)
    g = c.stop_capture()
    del tmp
    sentinels = [c.create(np.full(4, 999, np.float32)) for _ in range(8)]
    c.write(inp, np.array([2, 3, 4, 5], np.float32))   # variant: differs from the warm-up
    g.replay()
    np.testing.assert_array_equal(c.read(out), [6, 8, 10, 12])
    for s in sentinels:
        np.testing.assert_array_equal(c.read(s), [999] * 4)


def test_many_launches_replay_every_one(client):                         # scenarios 5, 15
    c = client
    n, launches = 64, 150
    a = c.create(np.zeros(n, np.float32))
    b = c.create(np.zeros(n, np.float32))

    def one_pass():
        for i in range(launches):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            add_one(c, src, dst, n)
    c.graph_prepare()
    one_pass()
    np.testing.assert_array_equal(c.read(a), [150] * n)
    np.testing.assert_array_equal(c.read(b), [149] * n)
    c.start_capture()
    one_pass()
    g = c.stop_capture()
    g.replay()
    g.replay()
    np.testing.assert_array_equal(c.read(a), [450] * n)
    np.testing.assert_array_equal(c.read(b), [449] * n)
    c.write(a, np.full(n, 100, np.float32))
    c.write(b, np.full(n, 100, np.float32))
    g.replay()
    np.testing.assert_array_equal(c.read(a), [250] * n)
    np.testing.assert_array_equal(c.read(b), [249] * n)


def test_lifecycle_state_errors_change_nothing(client):                  # scenario 16
    c = client
    with pytest.raises(GraphStateError, match="graph_prepare"):
        c.start_capture()
    with pytest.raises(GraphStateError, match="no capture is recording"):
        c.stop_capture()
    c.graph_prepare()
    with pytest.raises(GraphStateError, match="already prepared"):
        c.graph_prepare()
    inp = c.create(np.array([1, 2, 3, 4], np.float32))
    out = c.empty(4, np.float32)
    add_one(c, inp, out)
    np.testing.assert_array_equal(c.read(out), [2, 3, 4, 5])
    c.start_capture()
    with pytest.raises(GraphStateError, match="already recording"):
        c.start_capture()
    add_one(c, inp, out)
    g = c.stop_capture()
    c.write(inp, np.array([0, 0, 0, 1], np.float32))
    g.replay()
    np.testing.assert_array_equal(c.read(out), [1, 1, 1, 2])


def test_read_inside_the_window_is_refused_at_once(client):              # scenario 17
    inp, out = prelude(client)
    client.start_capture()
    add_one(client, inp, out)
    with pytest.raises(CaptureRefused, match="recording"):
        client.read(out)
    with pytest.raises(CaptureRefused):
        client.sync()
    # the refusals invalidated the window (CUDA's cudaErrorStreamCaptureInvalidated)
    with pytest.raises(CaptureRefused, match=f"first refused operation: read of handle {out.id}"):
        client.stop_capture()
    client.write(inp, np.array([4, 3, 2, 1], np.float32))   # the stream is back to no capture
    add_one(client, inp, out)
    np.testing.assert_array_equal(client.read(out), [5, 4, 3, 2])


def test_write_inside_the_window_is_refused_at_stop(client):             # scenario 18
    inp, out = prelude(client)
    client.start_capture()
    add_one(client, inp, out)
    client.write(inp, np.array([9, 9, 9, 9], np.float32))   # returns: fire-and-forget
    with pytest.raises(CaptureRefused, match=f"write to handle {inp.id}"):
        client.stop_capture()
    add_one(client, inp, out)                     # the stream is usable; the write never landed
    np.testing.assert_array_equal(client.read(out), [2, 3, 4, 5])


def test_freeing_a_used_handle_inside_the_window_is_refused_at_stop(client):
    inp, out = prelude(client)
    client.start_capture()
    add_one(client, inp, out)
    hid = inp.id
    inp.release()
    with pytest.raises(CaptureRefused, match=f"handle {hid} was freed"):
        client.stop_capture()
    np.testing.assert_array_equal(client.read(out), [2, 3, 4, 5])


def test_destroy_leaves_an_enqueued_replay_intact(client):               # scenario 19
    c = client
    inp = c.create(np.array([1, 2, 3, 4], np.float32))
    out = c.empty(4, np.float32)
    c.graph_prepare()
    tmp = c.empty(4, np.float32)
    _chain(c, inp, tmp, out)
    c.read(out)
    del tmp
    c.start_capture()
    tmp = c.empty(4, np.float32)
    _chain(c, inp, tmp, out)
    g = c.stop_capture()
    del tmp
    c.write(inp, np.array([3, 3, 3, 3], np.float32))    # variant: differs from the warm-up
    g.replay()
    del g                                               # last clone: destroy queued behind it
    sentinels = [c.create(np.full(4, 999, np.float32)) for _ in range(8)]
    np.testing.assert_array_equal(c.read(out), [8, 8, 8, 8])
    for s in sentinels:
        np.testing.assert_array_equal(c.read(s), [999] * 4)


def test_capture_is_isolated_from_another_stream(client):                # scenario 20
    inp, out = prelude(client)
    client.start_capture()
    add_one(client, inp, out)
    seen = {}

    def other():
        c2 = runtime.client(client.backend)          # unpinned: this thread's own stream
        a = c2.create(np.full(4, 7, np.float32))
        b = c2.empty(4, np.float32)
        mul_two(c2, a, b)
        seen["b"] = c2.read(b)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    np.testing.assert_array_equal(seen["b"], [14] * 4)
    g = client.stop_capture()
    assert g.info()["launches"] == 1
    client.write(inp, np.array([0, 1, 2, 3], np.float32))
    g.replay()
    np.testing.assert_array_equal(client.read(out), [1, 2, 3, 4])


def test_empty_window_gives_a_graph_whose_replay_does_nothing(client):
    inp, out = prelude(client)
    client.start_capture()
    g = client.stop_capture()
    client.write(out, np.full(4, -1, np.float32))
    g.replay()
    np.testing.assert_array_equal(client.read(out), [-1] * 4)


def test_replay_inside_its_own_window_is_refused_and_marks_the_write_set(client):
    c = client
    inp, out = prelude(c)
    c.start_capture()
    add_one(c, inp, out)
    g = c.stop_capture()
    c.graph_prepare()
    c.start_capture()
    with pytest.raises(CaptureRefused):
        g.replay()
    with pytest.raises(CaptureRefused, match=f"first refused operation: replay of graph {g.id}"):
        c.stop_capture()                          # the refusal invalidated the window
    other = c.with_stream(runtime.StreamId.new())
    with pytest.raises(runtime.ReplayFailed) as info:
        other.read(out)                           # the failed replay's write set
    assert isinstance(info.value.cause, CaptureRefused)
    np.testing.assert_array_equal(other.read(inp), [1, 2, 3, 4])   # not in the write set
    with pytest.raises(runtime.ReplayFailed):
        c.read(out)                               # keeps failing ...
    c.write(inp, np.array([6, 6, 6, 6], np.float32))
    g.replay()                                    # ... until a replay lands
    np.testing.assert_array_equal(c.read(out), [7, 7, 7, 7])


def test_clones_share_one_graph_released_by_the_last(client):
    inp, out = prelude(client)
    client.start_capture()
    add_one(client, inp, out)
    g = client.stop_capture()
    g2 = g.clone()
    assert g2.id == g.id and g2.stream == g.stream and g2.is_hardware == g.is_hardware
    g.release()
    g.release()                                   # idempotent
    with pytest.raises(UnknownGraph):
        g.replay()
    client.write(inp, np.array([1, 1, 1, 1], np.float32))
    g2.replay()                                   # the backend graph is still alive
    np.testing.assert_array_equal(client.read(out), [2, 2, 2, 2])
    gid = g2.id
    g2.release()
    client.sync()
    with pytest.raises(UnknownGraph):
        client._server.call(client._server.h_replay, gid)   # private: a released id, no Graph


def test_replay_runs_on_the_capture_stream_whoever_calls_it(client):
    inp, out = prelude(client)
    client.start_capture()
    add_one(client, inp, out)
    g = client.stop_capture()
    client.write(inp, np.array([2, 2, 2, 2], np.float32))
    done = {}

    def other():
        g.replay()
        done["ok"] = True
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert done["ok"]
    np.testing.assert_array_equal(client.read(out), [3, 3, 3, 3])   # same stream as the replay


def test_indirect_counts_are_read_when_the_replay_executes(client, hardware):
    if hardware:            # a driver graph cannot read counts from a buffer at replay (cuda)
        inp, out = prelude(client)
        counts = client.create(np.array([1, 1, 1], np.uint32))
        client.read(counts)
        client.start_capture()
        client.launch(K.add_scalar, counts, [inp, out], {"alpha": 1.0, "n": 4})
        with pytest.raises(CaptureRefused, match="indirect launch of add_scalar"):
            client.stop_capture()
        return
    c = client
    n = 256
    x = c.create(np.ones(n, np.float32))
    y = c.create(np.zeros(n, np.float32))
    counts = c.create(np.array([4, 1, 1], np.uint32))            # 4 workgroups x 64 = 256
    c.launch(K.accumulate, counts, [x, y], {"n": n})
    np.testing.assert_array_equal(c.read(y), np.ones(n, np.float32))
    c.graph_prepare()
    c.start_capture()
    c.launch(K.accumulate, counts, [x, y], {"n": n})
    g = c.stop_capture()
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.full(n, 2, np.float32))
    c.write(counts, np.array([2, 1, 1], np.uint32))               # only the first 128 now
    g.replay()
    expect = np.full(n, 2, np.float32)
    expect[:128] = 3
    np.testing.assert_array_equal(c.read(y), expect)
    c.write(counts, np.array([0, 1, 1], np.uint32))               # an empty dispatch
    g.replay()
    np.testing.assert_array_equal(c.read(y), expect)


# -- the capture state machine through a server, every backend (CubeCL D1 scenarios 22, 23) --
def test_a_rejected_transition_changes_nothing(client):                   # 22 (through a server)
    client.graph_prepare()
    with pytest.raises(GraphStateError, match="already prepared"):
        client.graph_prepare()
    client.start_capture()                          # still prepared: begin succeeds
    client.stop_capture()


def test_a_refused_window_returns_to_no_capture(client):                  # 23 (abort)
    import numpy as np
    h = client.create(np.zeros(4, np.float32))
    client.graph_prepare()
    client.start_capture()
    client.write(h, np.ones(4, np.float32))
    with pytest.raises(Exception):
        client.stop_capture()
    client.graph_prepare()                          # back in no capture: prepare succeeds
    client.start_capture()
    client.stop_capture()


def test_warmup_errors_abort_start_capture(client):
    import numpy as np
    import runtime
    h = client.create(np.zeros(4, np.float32))
    bad = runtime.Kernel("bad", [runtime.Binding("y", "f32", "read_write")], wgsl="nope", cuda="nope")
    client.graph_prepare()
    client.launch(bad, 1, [h])                      # fails to compile on every backend: queued
    with pytest.raises(runtime.ServerUnhealthy, match="bad"):
        client.start_capture()
    with pytest.raises(GraphStateError):            # back in no capture (CubeCL wgpu)
        client.stop_capture()
    client.graph_prepare()
    client.start_capture()
    client.stop_capture()
