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


def _ping_pong(c, x, y, launches: int, n: int = N):
    """A graph of ``launches`` ``add_scalar`` launches ping-ponging ``x -> y -> x ...`` (each
    adds 1.0), captured after a warm-up: a replay adds ``launches`` to ``x`` when even."""
    def run():
        for i in range(launches):
            c.launch(K.add_scalar, K.grid(n), [x, y] if i % 2 == 0 else [y, x],
                     {"alpha": 1.0, "n": n})
    run()
    c.sync()
    c.graph_prepare()
    run()
    c.sync()
    c.start_capture()
    run()
    return c.stop_capture()


def _wait_until(pred, seconds: float = 10.0) -> bool:
    import time
    end = time.monotonic() + seconds
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


@pytest.mark.parametrize("what", ["tiny replay", "launch", "replay of 1,000 launches"])
def test_deferred_work_no_call_runs_is_run_by_the_device_thread(c, what):
    # docs/contract.md section 3: a stream runs asynchronously to the caller; deferred work that no
    # later call runs still runs on its own (the device thread looks every LAZY_S)
    x = c.create(np.zeros(N, np.float32))
    y = c.create(np.zeros(N, np.float32))
    srv, q = c._server, c._server.queue
    if what == "launch":
        do, want = (lambda: c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 3.0, "n": N}),
                    np.full(N, 3, np.float32))
        out = y
    else:
        launches = 1 if what == "tiny replay" else 1000
        g = _ping_pong(c, x, y, launches)
        c.write(x, np.full(N, 5, np.float32))
        c.write(y, np.zeros(N, np.float32))
        c.sync()
        do, out = g.replay, (y if launches == 1 else x)
        want = np.full(N, 6 if launches == 1 else 1005, np.float32)
    do()
    assert len(q.lazy) == 1                 # deferred: nothing ran it yet
    raw = srv.streams[c._sid].raw
    assert _wait_until(lambda: not q.lazy and srv.backend.idle(raw)), \
        "deferred work no call ran was not run on its own"
    np.testing.assert_array_equal(c.read(out), want)
    # and the device thread stops looking once deferrals stop (no timed wake-ups for ever)
    assert _wait_until(lambda: q.lazy_asleep, 5.0)


def test_replays_of_a_thousand_launches_are_deferred_and_the_backlog_stays_bounded(c):
    x = c.create(np.zeros(N, np.float32))
    y = c.create(np.zeros(N, np.float32))
    g = _ping_pong(c, x, y, 1000)
    c.write(x, np.zeros(N, np.float32))
    c.sync()
    srv, q = c._server, c._server.queue
    most_lazy = most_load = 0
    for _ in range(300):
        g.replay()
        most_lazy = max(most_lazy, len(q.lazy))
        most_load = max(most_load, q._load()[0])
    assert 1 <= most_lazy <= LAZY_MAX
    # the LAZY_MAX-th deferral enqueues the run and looks for room, as an enqueue does
    assert most_load <= q.max_load + LAZY_MAX
    np.testing.assert_array_equal(c.read(x), np.full(N, 300_000, np.float32))


def test_a_deferred_replay_too_large_to_run_at_once_fails_its_write_set_and_its_readers(c):
    # 2 x 16,384 floats a launch: not tiny (not run at once), small (a waiter runs it): the
    # deferred replay is enqueued by the next owner; its failure marks its write set and a
    # deferred replay reading those buffers inherits it, as enqueued replays do
    n = 1 << 14
    x = c.create(np.arange(n, dtype=np.float32))
    y = c.create(np.zeros(n, np.float32))
    z = c.create(np.zeros(n, np.float32))
    g1 = captured_once(c, DOUBLE, [x, y], {}, n)
    g2 = captured_once(c, DOUBLE, [y, z], {}, n)
    assert not c._server.graphs[g1.id].graph.inline
    c.write(x, np.full(n, -1, np.float32))         # g1 raises on a negative input
    c.sync()
    g1.replay()
    g2.replay()
    assert len(_lazy(c)) == 2
    for h in (y, z):
        with pytest.raises(ReplayFailed):
            c.read(h)
    c.write(x, np.arange(n, dtype=np.float32))
    g1.replay()
    g2.replay()
    np.testing.assert_array_equal(c.read(z), 4 * np.arange(n, dtype=np.float32))


def _spy_backend(c, monkeypatch) -> dict:
    """Count the cpu backend's immediate verbs: a replay run together with a read's copy
    (``launch_graph_now`` given the buffer), run alone, and copies alone (``copy_out_now``)."""
    backend = c._server.backend
    seen = {"with_copy": 0, "alone": 0, "copies": 0}
    run, copy = backend.launch_graph_now, backend.copy_out_now

    def launch_graph_now(stream, graph, buf=None, nbytes=0, dtype=None):
        seen["alone" if buf is None else "with_copy"] += 1
        return run(stream, graph, buf, nbytes, dtype)

    def copy_out_now(*a, **k):
        seen["copies"] += 1
        return copy(*a, **k)
    monkeypatch.setattr(backend, "launch_graph_now", launch_graph_now)
    monkeypatch.setattr(backend, "copy_out_now", copy_out_now)
    return seen


@pytest.fixture
def own(monkeypatch):
    """A client of a server of its own whose device thread makes no timed look at deferred
    work (a look landing between a deferral and the read, on a loaded host, would run it)."""
    from runtime.server import queue as queue_mod
    monkeypatch.setattr(queue_mod, "LAZY_S", 3600.0)
    cl = runtime.client("cpu", max_idle_bytes=(1 << 30) + 11)
    yield cl
    cl.shutdown()


def test_a_read_after_one_deferred_replay_runs_it_with_the_copy_and_reads_right(own,
                                                                               monkeypatch):
    # the core path (issue 26): replay, then read what it wrote, one backend call for both;
    # a stateful graph (acc += x, state read and written by one graph) checked every time
    c = own
    x = c.create(np.arange(N, dtype=np.float32))
    acc = c.create(np.zeros(N, np.float32))
    g = captured_once(c, K.accumulate, [x, acc], {}, N)
    c.write(acc, np.zeros(N, np.float32))
    c.sync()
    seen = _spy_backend(c, monkeypatch)
    ref = np.zeros(N, np.float32)
    for i in range(20):
        g.replay()
        assert len(_lazy(c)) == 1
        ref += np.arange(N, dtype=np.float32)
        np.testing.assert_array_equal(c.read(acc), ref)
        if i % 5 == 4:                       # a buffer the graph only reads: after it ran too
            g.replay()
            ref += np.arange(N, dtype=np.float32)
            np.testing.assert_array_equal(c.read(x), np.arange(N, dtype=np.float32))
            assert not _lazy(c)
            np.testing.assert_array_equal(c.read(acc), ref)
    assert seen["with_copy"] == 24 and seen["alone"] == 0, seen


def test_a_deferred_replay_failing_in_a_reads_run_fails_its_write_set_until_one_lands(
        own, monkeypatch):
    c = own
    seen = _spy_backend(c, monkeypatch)
    x = c.create(np.ones(N, np.float32))
    y = c.create(np.zeros(N, np.float32))
    z = c.create(np.zeros(N, np.float32))
    g1 = _captured(c, DOUBLE, [x, y])           # y = 2x, raising on a negative input
    g2 = _captured(c, DOUBLE, [y, z])           # z = 2y: reads what g1 writes
    c.write(x, -np.ones(N, np.float32))
    c.sync()
    g1.replay()
    with pytest.raises(ReplayFailed) as e:      # run with the read: it failed
        c.read(y)
    assert isinstance(e.value, LaunchError) and "a negative input" in str(e.value)
    assert seen["with_copy"] == 1 and seen["alone"] == 0, seen
    for _ in range(2):
        with pytest.raises(ReplayFailed):       # every read, until a replay lands
            c.read(y)
    np.testing.assert_array_equal(c.read(x), -np.ones(N, np.float32))   # (raised once)
    g2.replay()                                 # one deferred replay reading the failed y:
    assert len(_lazy(c)) == 1                   # not run with the copy, and it inherits
    with pytest.raises(ReplayFailed) as e:
        c.read(z)
    assert "a negative input" in str(e.value)
    g1.replay()                                 # fails again on the same input
    with pytest.raises(ReplayFailed):
        c.read(y)
    c.write(x, np.full(N, 3, np.float32))       # the input is fine again: both land
    g1.replay()
    np.testing.assert_array_equal(c.read(y), np.full(N, 6, np.float32))
    g2.replay()
    np.testing.assert_array_equal(c.read(z), np.full(N, 12, np.float32))


def test_a_read_on_another_stream_runs_a_deferred_replay_first_without_its_copy(own,
                                                                                monkeypatch):
    c = own
    x = c.create(np.arange(N, dtype=np.float32))
    y = c.create(np.zeros(N, np.float32))
    other = c.create(np.full(N, 7, np.float32))
    g = _captured(c, DOUBLE, [x, y])
    c.sync()
    seen = _spy_backend(c, monkeypatch)
    g.replay()
    c2 = c.with_stream(runtime.StreamId.new())
    np.testing.assert_array_equal(c2.read(other), np.full(N, 7, np.float32))
    assert not _lazy(c) and seen["with_copy"] == 0 and seen["alone"] == 1, seen
    np.testing.assert_array_equal(c.read(y), 2 * np.arange(N, dtype=np.float32))
