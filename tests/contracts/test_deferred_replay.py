"""A deferred replay or launch is never seen out of order and never silent (issue 26).

On the cpu backend a replay or launch of tiny work on an idle server is deferred:
``Graph.replay`` / ``ComputeClient.launch`` records it (``DeviceQueue.lazy``) and returns; whoever takes the server's owner lock next runs it before
anything else it does (a read, a launch, a sync, a write, a capture, a release, any queued
message, the shutdown). These tests give each of those entries a deferred replay to run first,
make deferred replays fail in the middle of a run of them (the replays after a failed one must
inherit the failure through their sources' marks, as enqueued replays do), and check that the
list of deferred work stays bounded however many replays come without a read. Values are
checked against numpy.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from helpers import captured_once
from runtime.errors import LaunchError, ReplayFailed, ServerClosed
from runtime.server.queue import LAZY_MAX

N = 64
RAN = []        # (kernel name) per bound call that ran: the shutdown test counts them


def _double(x, y, *, n, count):
    if (x[:n] < 0).any():
        raise ValueError("a negative input")
    y[:n] = x[:n] * 2


_double.bind = lambda x, y, *, count, n: (lambda: _double(x, y, n=n, count=count))
#: ``y = 2x``, raising on a negative input (a ``bind``: tiny, so its replays are deferred)
DOUBLE = runtime.Kernel("deferred_double", [("x", "f32", "read"), ("y", "f32", "write")],
                        [("n", "u32")], cpu=_double)


def _bump(s, *, n, count):
    if (s[:n] >= 5).any():
        raise ValueError("the state reached 5")
    s[:n] += 1
    RAN.append("bump")


_bump.bind = lambda s, *, count, n: (lambda: _bump(s, n=n, count=count))
#: ``s += 1``, raising once the state reached 5: state read and written by one graph
BUMP = runtime.Kernel("deferred_bump", [("s", "f32", "read_write")], [("n", "u32")], cpu=_bump)


def _captured(c, kernel, bufs, n=N):
    """One launch of ``kernel`` over ``bufs`` captured after a warm-up (each runs it once)."""
    return captured_once(c, kernel, bufs, {}, n)


@pytest.fixture
def c():
    """A client of the default cpu server (thread scheduler) on a fresh stream."""
    cl = runtime.client("cpu")
    cl.set_stream(runtime.StreamId.new())
    return cl


def _lazy(c) -> list:
    return c._server.queue.lazy


def test_a_replay_of_tiny_work_is_deferred_and_every_entry_runs_it_first(c):
    x = c.create(np.arange(N, dtype=np.float32))
    y = c.create(np.zeros(N, np.float32))
    z = c.create(np.zeros(N, np.float32))
    g = _captured(c, DOUBLE, [x, y])
    ref = 2 * np.arange(N, dtype=np.float32)
    entries = {
        "read": lambda: c.read(y),
        "sync": c.sync,
        "launch": lambda: c.launch(DOUBLE, K.grid(N), [y, z], {"n": N}),
        "write": lambda: c.write(x, np.arange(N, dtype=np.float32)),
        "create": lambda: c.create(np.ones(4, np.float32)),
        "event": c.record_event,
        "flush": c.flush,
    }
    for name, entry in entries.items():
        c.write(y, np.zeros(N, np.float32))
        c.sync()
        g.replay()
        assert len(_lazy(c)) == 1, f"{name}: the replay was not deferred"
        entry()
        if name != "launch":                   # (a tiny launch is deferred too, behind it)
            assert not _lazy(c), f"{name} did not run the deferred replay first"
        np.testing.assert_array_equal(c.read(y), ref, err_msg=name)
        if name == "launch":                   # it read y after the replay wrote it
            np.testing.assert_array_equal(c.read(z), 2 * ref)


def test_a_capture_started_after_a_deferred_replay_neither_records_nor_refuses_it(c):
    x = c.create(np.arange(N, dtype=np.float32))
    y = c.create(np.zeros(N, np.float32))
    z = c.create(np.zeros(N, np.float32))
    g = _captured(c, DOUBLE, [x, y])
    c.write(y, np.zeros(N, np.float32))
    c.launch(DOUBLE, K.grid(N), [y, z], {"n": N})
    c.sync()
    c.graph_prepare()
    c.launch(DOUBLE, K.grid(N), [y, z], {"n": N})
    c.sync()
    c.write(y, np.zeros(N, np.float32))
    c.sync()
    g.replay()                                  # deferred: runs before the window opens
    c.start_capture()
    c.launch(DOUBLE, K.grid(N), [y, z], {"n": N})
    g2 = c.stop_capture()                       # not refused: the replay was not in the window
    np.testing.assert_array_equal(c.read(y), 2 * np.arange(N, dtype=np.float32))
    g2.replay()
    np.testing.assert_array_equal(c.read(z), 4 * np.arange(N, dtype=np.float32))


def test_deferred_replays_after_a_failed_one_inherit_its_failure(c):
    x = c.create(np.ones(N, np.float32))
    y = c.create(np.zeros(N, np.float32))
    z = c.create(np.zeros(N, np.float32))
    g1 = _captured(c, DOUBLE, [x, y])           # y = 2x
    g2 = _captured(c, DOUBLE, [y, z])           # z = 2y: reads what g1 writes
    c.write(x, -np.ones(N, np.float32))
    c.sync()
    g1.replay()                                 # both deferred; g1 fails when they run,
    g2.replay()                                 # and g2 reads its stale output
    assert len(_lazy(c)) == 2
    with pytest.raises(ReplayFailed) as e:
        c.read(z)
    assert "deferred_double" in str(e.value)
    assert isinstance(e.value, LaunchError)     # with the stream's own error (raised once)
    with pytest.raises(ReplayFailed):
        c.read(y)
    c.sync()
    c.write(x, np.full(N, 3, np.float32))       # the input is fine again: both land
    g1.replay()
    g2.replay()
    np.testing.assert_array_equal(c.read(z), np.full(N, 12, np.float32))
    np.testing.assert_array_equal(c.read(y), np.full(N, 6, np.float32))


def test_a_stateful_graph_failing_inside_a_run_of_deferred_replays_keeps_failing(c):
    s = c.create(np.zeros(N, np.float32))
    g = _captured(c, BUMP, [s])
    c.write(s, np.zeros(N, np.float32))
    c.sync()
    for _ in range(8):                          # the 6th fails (the state reached 5); the
        g.replay()                              # 7th and 8th read the failed state
    with pytest.raises(ReplayFailed) as e:
        c.read(s)
    assert isinstance(e.value, LaunchError) and "state reached 5" in str(e.value)
    for _ in range(3):                          # no replay lands on a failed state
        g.replay()
        with pytest.raises(ReplayFailed):
            c.read(s)
    c.sync()
    c.write(s, np.full(N, 2, np.float32))       # the state written from the host
    g.replay()
    g.replay()
    np.testing.assert_array_equal(c.read(s), np.full(N, 4, np.float32))


def test_deferred_work_stays_bounded_however_many_replays_come_without_a_read(c):
    x = c.create(np.zeros(N, np.float32))
    y = c.create(np.zeros(N, np.float32))
    # ping-pong through two graphs: x -> y -> x, 1.0 added each time
    ga = captured_once(c, K.add_scalar, [x, y], {"alpha": 1.0}, N)
    gb = captured_once(c, K.add_scalar, [y, x], {"alpha": 1.0}, N)
    c.write(x, np.zeros(N, np.float32))
    c.sync()
    most = 0
    for _ in range(500):
        ga.replay()
        gb.replay()
        most = max(most, len(_lazy(c)))
    assert most <= LAZY_MAX
    np.testing.assert_array_equal(c.read(x), np.full(N, 1000, np.float32))


def test_another_threads_read_runs_a_deferred_replay_first(c):
    x = c.create(np.arange(N, dtype=np.float32))
    y = c.create(np.zeros(N, np.float32))
    g = _captured(c, DOUBLE, [x, y])
    c.write(y, np.zeros(N, np.float32))
    c.sync()
    g.replay()
    assert len(_lazy(c)) == 1
    got = {}

    def reader():                               # ordered after the replay by the join below
        other = runtime.client("cpu")
        other.set_stream(c.stream)
        got["y"] = other.read(y)
    t = threading.Thread(target=reader)
    t.start()
    t.join(10)
    assert not t.is_alive()
    np.testing.assert_array_equal(got["y"], 2 * np.arange(N, dtype=np.float32))


def test_a_graph_dropped_with_a_deferred_replay_still_lands_it(c):
    x = c.create(np.arange(N, dtype=np.float32))
    y = c.create(np.zeros(N, np.float32))
    g = _captured(c, DOUBLE, [x, y])
    c.write(y, np.zeros(N, np.float32))
    c.sync()
    g.replay()
    del g                                       # its destroy is queued behind the replay
    gc.collect()
    np.testing.assert_array_equal(c.read(y), 2 * np.arange(N, dtype=np.float32))


def test_the_shutdown_runs_deferred_replays_and_then_every_call_raises():
    c = runtime.client("cpu", scheduler="thread", seed=97)     # its own server
    s = c.create(np.zeros(N, np.float32))
    g = _captured(c, BUMP, [s])
    c.write(s, np.zeros(N, np.float32))
    c.sync()
    RAN.clear()
    g.replay()
    g.replay()
    assert RAN == []                            # deferred
    c.shutdown()                                # fire-and-forget work before it still runs
    assert RAN == ["bump", "bump"]
    with pytest.raises(ServerClosed):
        c.read(s)
    with pytest.raises(ServerClosed):
        g.replay()


def test_deferred_launches_run_in_order_with_replays_and_inherit_failures(c):
    x = c.create(np.ones(N, np.float32))
    y = c.create(np.zeros(N, np.float32))
    z = c.create(np.zeros(N, np.float32))
    g = _captured(c, DOUBLE, [y, z])            # z = 2y
    c.write(x, np.full(N, -1, np.float32))
    c.sync()
    c.launch(DOUBLE, K.grid(N), [x, y], {"n": N})       # deferred; fails when it runs
    g.replay()                                          # deferred; reads the failed y
    c.launch(K.add_scalar, K.grid(N), [z, x], {"alpha": 1.0, "n": N})  # reads z: inherits
    assert len(_lazy(c)) == 3
    for h in (y, z, x):
        with pytest.raises(ReplayFailed):
            c.read(h)
    c.sync()
    c.write(x, np.full(N, 2, np.float32))               # fine again: all three land in order
    c.launch(DOUBLE, K.grid(N), [x, y], {"n": N})
    g.replay()
    c.launch(K.add_scalar, K.grid(N), [z, x], {"alpha": 1.0, "n": N})
    np.testing.assert_array_equal(c.read(x), np.full(N, 9, np.float32))
    np.testing.assert_array_equal(c.read(z), np.full(N, 8, np.float32))


def test_a_handle_dropped_right_after_a_deferred_launch_is_freed_after_it_ran(c):
    x = c.create(np.ones(N, np.float32))
    y = c.create(np.zeros(N, np.float32))
    c.sync()
    hid = y.id
    c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})   # deferred
    del y                                       # its free is queued behind the launch
    gc.collect()
    np.testing.assert_array_equal(c.read(x), np.ones(N, np.float32))
    c.sync()
    assert hid not in c._server.handles        # freed, after the launch that used it ran
    assert not c._server.marks.async_errors    # (no InvalidHandle: the launch came first)
