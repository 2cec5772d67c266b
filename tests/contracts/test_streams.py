"""Streams: identity (CubeCL D6), cross-stream ordering of ordinary operations (docs/contract.md
section 3), and stream-ordered reuse of pooled buffers."""

import threading

import numpy as np
import pytest

import runtime
from runtime import StreamId
from runtime import kernels as K


def test_current_is_stable_on_one_thread():                              # 60
    assert StreamId.current() == StreamId.current()


def test_new_returns_distinct_ids():                                     # 61
    ids = {StreamId.new() for _ in range(100)}
    assert len(ids) == 100 and StreamId.current() not in ids


def test_each_thread_gets_its_own_stream():                              # 63
    seen = []
    t = threading.Thread(target=lambda: seen.append(StreamId.current()))
    t.start()
    t.join()
    assert seen[0] != StreamId.current()


def test_set_stream_pins_and_unpins(client):                              # 62
    s = StreamId.new()
    client.set_stream(s)
    assert client.stream == s
    client.set_stream(None)
    assert client.stream == StreamId.current()
    with pytest.raises(TypeError):
        client.set_stream(3)


def test_a_write_on_one_stream_is_seen_by_a_launch_on_another(client):
    """The server orders B after A's last write (event wait), for every backend."""
    a = client.with_stream(StreamId.new())
    b = client.with_stream(StreamId.new())
    n = 1000
    x = a.create(np.zeros(n, np.float32))
    y = a.empty(n, np.float32)
    for k in range(1, 6):
        a.write(x, np.full(n, k, np.float32))
        b.launch(K.add_scalar, K.grid(n), [x, y], {"alpha": 0.5, "n": n})
        np.testing.assert_array_equal(b.read(y), np.full(n, k + 0.5, np.float32))


def test_a_write_waits_for_a_read_on_another_stream(client):
    """Write-after-read across streams: B's write must not land before A's launch read x."""
    a = client.with_stream(StreamId.new())
    b = client.with_stream(StreamId.new())
    n = 256
    x = a.create(np.ones(n, np.float32))
    y = a.empty(n, np.float32)
    a.launch(K.mul_scalar, K.grid(n), [x, y], {"alpha": 3.0, "n": n})
    b.write(x, np.full(n, 100, np.float32))
    np.testing.assert_array_equal(a.read(y), np.full(n, 3, np.float32))
    np.testing.assert_array_equal(b.read(x), np.full(n, 100, np.float32))


@pytest.mark.parametrize("seed", range(12))
def test_cross_stream_ordering_holds_under_every_interleaving(seed):
    c = runtime.client("cpu", scheduler="interleave", seed=seed)
    try:
        a = c.with_stream(StreamId.new())
        b = c.with_stream(StreamId.new())
        n = 64
        x = a.create(np.zeros(n, np.float32))
        t = a.create(np.zeros(n, np.float32))
        y = b.create(np.zeros(n, np.float32))
        for k in range(1, 4):
            a.write(x, np.full(n, k, np.float32))
            a.launch(K.mul_scalar, K.grid(n), [x, t], {"alpha": 2.0, "n": n})
            b.launch(K.accumulate, K.grid(n), [t, y], {"n": n})
        np.testing.assert_array_equal(b.read(y), np.full(n, 2 + 4 + 6, np.float32))
    finally:
        c.shutdown()


@pytest.mark.parametrize("seed", range(8))
def test_a_reused_buffer_waits_for_its_previous_users(seed):
    """A freed buffer handed to another stream is not overwritten before the old work ran."""
    c = runtime.client("cpu", scheduler="interleave", seed=seed)
    try:
        a = c.with_stream(StreamId.new())
        b = c.with_stream(StreamId.new())
        n = 64
        x = a.create(np.full(n, 5, np.float32))
        out = a.empty(n, np.float32)
        a.launch(K.mul_scalar, K.grid(n), [x, out], {"alpha": 2.0, "n": n})
        del x                                       # freed while a's launch may not have run
        z = b.create(np.full(n, -1, np.float32))    # may reuse x's buffer on another stream
        np.testing.assert_array_equal(a.read(out), np.full(n, 10, np.float32))
        np.testing.assert_array_equal(b.read(z), np.full(n, -1, np.float32))
    finally:
        c.shutdown()


def test_record_and_wait_event_order_two_streams(client):
    a = client.with_stream(StreamId.new())
    b = client.with_stream(StreamId.new())
    n = 128
    x = a.create(np.full(n, 2, np.float32))
    y = a.empty(n, np.float32)
    a.launch(K.mul_scalar, K.grid(n), [x, y], {"alpha": 4.0, "n": n})
    ev = a.record_event()
    assert isinstance(ev, runtime.Event) and ev.stream == a.stream and ev.position >= 1
    b.wait_event(ev)
    np.testing.assert_array_equal(b.read(y), np.full(n, 8, np.float32))


def test_wait_event_takes_the_old_tuple_with_a_deprecation_warning(client):
    """``record_event()`` returned ``(stream, position)`` before the Event object (issue 29)."""
    a = client.with_stream(StreamId.new())
    b = client.with_stream(StreamId.new())
    x = a.create(np.full(64, 3, np.float32))
    y = a.empty(64, np.float32)
    a.launch(K.mul_scalar, K.grid(64), [x, y], {"alpha": 2.0, "n": 64})
    ev = a.record_event()
    with pytest.warns(DeprecationWarning, match="unpacking an Event"):
        sid, pos = ev
    assert (sid, pos) == (ev.stream, ev.position)
    with pytest.warns(DeprecationWarning, match="deprecated"):
        b.wait_event((sid, pos))
    np.testing.assert_array_equal(b.read(y), np.full(64, 6, np.float32))


@pytest.mark.parametrize("token", [("a", 1), (1.5, 2), (None, 0), (True, 0), (1, -5),
                                   (1, 2.0), (1, "2")])
def test_wait_event_refuses_an_old_tuple_that_is_not_a_stream_and_a_position(client, token):
    """The deprecated ``(stream, position)`` tuple took anything silently (a str, a float,
    a negative position: no wait and no error); a typed error now, nothing queued, and the
    client keeps working (ADV6)."""
    a = client.with_stream(StreamId.new())
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="stream id"):
        a.wait_event(token)
    x = a.create(np.full(4, 2, np.float32))
    np.testing.assert_array_equal(a.read(x), np.full(4, 2, np.float32))


def test_wait_event_refuses_what_is_not_an_event_of_its_server():
    a = runtime.client("cpu")
    other = runtime.client("cpu", max_idle_bytes=1 << 20)      # another server
    assert other._server is not a._server   # private: to show the two servers differ
    ev = other.record_event()
    with pytest.raises(ValueError, match="another server|recorded on server"):
        a.wait_event(ev)
    for bad in (None, 3, (1, 2, 3), "e"):
        with pytest.raises(TypeError, match="Event"):
            a.wait_event(bad)
    a.wait_event(a.with_stream(StreamId.new()).record_event())   # the server still serves


def test_streams_run_asynchronously_to_the_caller():
    """Enqueueing returns before the work ran: a blocked stream does not block the caller."""
    c = runtime.client("cpu")
    gate = threading.Event()
    blocker = runtime.Kernel("block", [runtime.Binding("y", "f32", "read_write")],
                             cpu=lambda y, count: gate.wait(10))
    c.set_stream(StreamId.new())
    y = c.create(np.zeros(4, np.float32))
    c.launch(blocker, 1, [y])
    c.launch(K.fill, 1, [y], {"value": 3.0, "n": 4})   # returns while the stream is blocked
    other = c.with_stream(StreamId.new())
    z = other.create(np.ones(4, np.float32))
    np.testing.assert_array_equal(other.read(z), [1, 1, 1, 1])  # other streams keep going
    gate.set()
    np.testing.assert_array_equal(c.read(y), [3, 3, 3, 3])


def test_capabilities_and_checker_violations_are_public(client):
    """``client.capabilities`` and ``client.checker_violations()`` (issue 29 item 4: tests and
    the testing kit read them instead of ``client._server``)."""
    caps = client.capabilities
    assert set(caps) == {"hardware_graphs", "max_workgroups", "checked", "indirect_dispatch"}
    assert caps["hardware_graphs"] is (client.backend == "cuda")
    assert caps["indirect_dispatch"] is (client.backend != "cuda")
    assert caps["max_workgroups"] is None or (len(caps["max_workgroups"]) == 3 and
                                              min(caps["max_workgroups"]) >= 65535)
    if not caps["checked"]:
        with pytest.raises(runtime.UnsupportedError, match="check=True"):
            client.checker_violations()
    checked = runtime.client("cpu", check=True, scheduler="interleave", seed=2929)
    try:
        assert checked.capabilities["checked"] and checked.checker_violations() == []
        a, b = checked.with_stream(StreamId.new()), checked.with_stream(StreamId.new())
        x = a.create(np.ones(4, np.float32))
        b.graph_prepare()
        b.launch(K.add_scalar, 1, [x, b.create(np.zeros(4, np.float32))], {"alpha": 1.0, "n": 4})
        b.sync()
        assert checked.checker_violations() == []          # the server ordered it: no race
        got = checked.checker_violations()
        got.append("mine")                                  # a copy
        assert checked.checker_violations() == []
    finally:
        checked.shutdown()
