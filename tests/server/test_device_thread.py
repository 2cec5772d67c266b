"""A device thread that never stalls and never grows without bound (issue 14).

1. a wgpu read waits on the caller's thread: another client's blocking call completes while it
   waits; 2. the device queue is bounded: a flood blocks at the bound and drains (and a replay
   loop blocks on wgpu's queue-thread backlog); 3. shutdown wakes blocked readers with a
   ``ServerClosed`` that says why; 4. ended threads' streams are reclaimed; 5. ``empty_cache``,
   the idle bound and the retry on ``OutOfMemory`` give memory back.

Waits are on events and counters, each bounded (``_until``); nothing sleeps to assert. The
private reaches (``c._server``, ``qt._run``, ``q._q``) are the server and queue under test.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import OutOfMemory, ServerClosed
from runtime.server import get_server
from runtime.server.queue import DeviceQueue
from helpers import LIMIT_S, captured_add_one, until as _until

def _wgpu_or_skip():
    from conftest import backend_unavailable
    why = backend_unavailable("wgpu")
    if why:
        pytest.skip(why)


class _MapGate:
    """Hold the wgpu queue thread before each ``map_async`` until ``open()`` (restored on exit):
    a read then waits as long as the test wants, deterministically."""

    def __init__(self, backend):
        from runtime.backends import wgpu as W
        self.qt, self.kind = backend.qt, W._MAP
        self.gate, self.reached = threading.Event(), threading.Event()

    def __enter__(self):
        run = self.qt._run

        def gated(op):
            if op[0] == self.kind:
                self.reached.set()
                self.gate.wait(LIMIT_S)
            return run(op)
        self.qt._run = gated
        return self

    def open(self):
        self.gate.set()

    def __exit__(self, *exc):
        self.gate.set()
        del self.qt._run


def _hold(q: DeviceQueue, gate: threading.Event) -> None:
    """Make ``q``'s device thread run a message that waits for ``gate``; return once it does."""
    started = threading.Event()
    q.post(lambda: (started.set(), gate.wait(LIMIT_S)))
    assert started.wait(LIMIT_S)


def _reader(c, h, out: dict):
    def run():
        try:
            out["value"] = c.read(h)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# -- 1. no handler waits for the device -----------------------------------------------------
def test_wgpu_read_waits_off_the_server_while_others_enqueue():
    _wgpu_or_skip()
    c = runtime.client("wgpu")
    c.set_stream(runtime.StreamId.new())
    other = c.with_stream(runtime.StreamId.new())
    x = c.create(np.arange(16, dtype=np.float32))
    y = c.empty(16, np.float32)
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 16})
    z = other.create(np.full(4, 3, np.float32))
    with _MapGate(c._server.backend) as gate:     # private: hold the device thread in a map
        out = {}
        t = _reader(c, y, out)
        assert gate.reached.wait(LIMIT_S)        # the read is waiting for its map
        other.launch(K.fill, 1, [z], {"value": 3.0, "n": 4})   # enqueue: no wait
        assert other.memory_usage()["handles"] >= 3    # a blocking round trip completes
        assert t.is_alive() and not out
        gate.open()
        t.join(LIMIT_S)
    np.testing.assert_array_equal(out["value"], np.arange(16, dtype=np.float32) + 1)


# -- 2. a bounded queue -----------------------------------------------------------------------
def test_a_flood_blocks_at_the_bound_and_drains():
    gate, ran = threading.Event(), []
    q = DeviceQueue("test-bounded", lambda e: None, max_messages=8)
    try:
        _hold(q, gate)                                 # the device thread is busy
        producer = threading.Thread(target=lambda: [q.submit(ran.append, i) for i in range(100)])
        producer.start()
        _until(lambda: q.room_waiters == 1, "the producer to wait for room")
        assert len(q._q) == 8 and not ran and producer.is_alive()
        gate.set()
        producer.join(LIMIT_S)
        assert not producer.is_alive()
        assert q.call(lambda: list(ran)) == list(range(100))
    finally:
        gate.set()
        q.close(lambda: None)


def test_pending_host_bytes_are_bounded_too():
    gate, seen = threading.Event(), []
    q = DeviceQueue("test-bytes", lambda e: None, max_bytes=1000)
    try:
        _hold(q, gate)
        producer = threading.Thread(
            target=lambda: [q.submit(seen.append, k, nbytes=400) for k in range(5)])
        producer.start()
        _until(lambda: q.room_waiters == 1, "the producer to wait for room")
        assert q.bytes == 1200 and not seen       # 3 messages in: the 4th waits
        gate.set()
        producer.join(LIMIT_S)
        assert q.call(lambda: (list(seen), q.bytes)) == (list(range(5)), 0)
    finally:
        gate.set()
        q.close(lambda: None)


def test_a_producer_waiting_for_room_gets_server_closed_at_shutdown():
    gate, err = threading.Event(), {}
    q = DeviceQueue("test-closed", lambda e: None, max_messages=2)
    _hold(q, gate)

    def flood():
        try:
            for i in range(10):
                q.submit(int, i)
        except ServerClosed as e:
            err["e"] = e
    producer = threading.Thread(target=flood)
    producer.start()
    _until(lambda: q.room_waiters == 1, "the producer to wait for room")
    closer = threading.Thread(target=q.close, args=(lambda: None,))
    closer.start()
    producer.join(LIMIT_S)
    gate.set()
    closer.join(LIMIT_S)
    assert "shut down" in str(err["e"]) and "died" not in str(err["e"])


def test_wgpu_replay_loop_without_reads_blocks_on_the_submission_backlog():
    _wgpu_or_skip()
    srv = get_server("wgpu", max_idle_bytes=(1 << 30) + 1)   # a private server: bounds changed
    c = runtime.client("wgpu", max_idle_bytes=(1 << 30) + 1)
    x, y, g = captured_add_one(c)
    qt = srv.backend.qt
    gate, done = threading.Event(), []
    run = qt._run
    qt._run = lambda op: (gate.wait(LIMIT_S), run(op))[1]   # the queue thread holds
    srv.queue.max_load = 8
    try:
        t = threading.Thread(target=lambda: [g.replay() or done.append(1) for _ in range(40)])
        t.start()
        _until(lambda: srv.queue.room_waiters == 1, "the replay loop to wait for room")
        assert srv.backend.load()[0] >= 8 and len(done) < 40
        gate.set()
        t.join(LIMIT_S)
        assert len(done) == 40
        np.testing.assert_array_equal(c.read(y), np.full(4, 2, np.float32))
    finally:
        gate.set()
        del qt._run
        srv.shutdown()


# -- 3. shutdown wakes every waiter, saying why -----------------------------------------------
def test_shutdown_wakes_a_blocked_wgpu_reader_with_server_closed():
    _wgpu_or_skip()
    c = runtime.client("wgpu", max_idle_bytes=(1 << 30) + 2)    # a private server to stop
    x = c.create(np.ones(16, np.float32))
    with _MapGate(c._server.backend) as gate:     # private: hold the device thread in a map
        out = {}
        t = _reader(c, x, out)
        assert gate.reached.wait(LIMIT_S)
        c.shutdown()
        t.join(LIMIT_S)
        assert not t.is_alive()
    assert isinstance(out.get("error"), ServerClosed), out
    assert "shut down" in str(out["error"]) and "died" not in str(out["error"])


def test_shutdown_message_on_cpu_says_shut_down_not_died():
    gate, entered = threading.Event(), threading.Event()

    def hold(y, *, n, count):
        entered.set()
        gate.wait(LIMIT_S)
    blocker = runtime.Kernel("hold", [runtime.Binding("y", "f32", "read_write")],
                             [runtime.Param("n", "u32")], cpu=hold)
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 3)      # a private server to stop
    a = c.with_stream(runtime.StreamId.new())
    b = c.with_stream(runtime.StreamId.new())
    y = a.empty(4, np.float32)
    a.launch(blocker, 1, [y], {"n": 4})
    assert entered.wait(LIMIT_S)
    out = {}
    t = _reader(b, y, out)                     # waits on stream a's event
    closer = threading.Thread(target=c.shutdown)
    closer.start()
    t.join(LIMIT_S)
    gate.set()
    closer.join(LIMIT_S)
    assert isinstance(out.get("error"), ServerClosed), out
    assert "shut down" in str(out["error"]) and "died" not in str(out["error"])


# -- 4. reclaimed streams ---------------------------------------------------------------------


# -- 5. memory given back ---------------------------------------------------------------------


def test_out_of_memory_trims_the_pool_and_retries_once():
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 4)       # a private server
    srv = c._server                               # private: inject OutOfMemory into alloc
    be = srv.backend
    alloc = be.alloc
    cap = {"bytes": 3 << 20}

    def bounded(nbytes):             # a device with 3 MiB: reserved bytes count against it
        if srv.pool.bytes_reserved + nbytes > cap["bytes"]:
            raise OutOfMemory(f"test device: {nbytes} bytes do not fit")
        return alloc(nbytes)
    be.alloc = bounded
    try:
        small = [c.empty(1 << 20) for _ in range(3)]
        c.sync()
        for h in small:
            h.release()                  # 3 MiB idle in the 1 MiB class
        big = c.create(np.arange(1 << 19, dtype=np.float32))   # 2 MiB: a different class
        np.testing.assert_array_equal(c.read(big), np.arange(1 << 19, dtype=np.float32))
        huge = c.empty(4 << 20)          # cannot fit even after trimming: raised on the stream
        with pytest.raises(OutOfMemory):
            c.sync()
        del huge
    finally:
        c.shutdown()
