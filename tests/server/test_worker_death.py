"""A backend worker thread that dies stops its server at once, and the next client gets a
fresh one (ADV6).

An asynchronous exception (KeyboardInterrupt, ``PyThreadState_SetAsyncExc``) can end a cpu
stream worker, or wgpu's queue thread, with an item taken and not run. Before: the cpu worker
put the stream back in the ready list, so another worker or a read's fast path ran the
stream's later items (a read copied the values from before the lost launch: stale, no
error), and the server stayed up for the other streams; a waiter that noticed the dead worker
raised ``ServerClosed`` but left the server in the table, so ``runtime.client(...)`` handed out
the dead server for ever (wgpu: every later call of the process raised). Now a worker dying
with an exception marks the backend broken (the server stops before anything else runs) and a
waiter that finds a backend worker dead stops the server (docs/contract.md section 1: every
later call raises ``ServerClosed``, never a stale value; a new client starts a fresh server).

The exception is injected deterministically: the backend's ``execute`` (what a worker calls
with the item it took) raises for the launch when a worker runs it.
"""

import threading
import time

import numpy as np
import pytest

import runtime
from helpers import until
from runtime import kernels as K
from runtime.backends.cpu_schedule import CALL, RUN, TINY
from runtime.errors import ServerClosed

pytestmark = pytest.mark.filterwarnings(      # the worker the test kills
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")

N = 1 << 18                       # 2 MiB a launch binds: never run on the caller's thread


def _server_with_one_lost_launch(monkeypatch):
    c = runtime.client("cpu", max_idle_bytes=1 << 21)   # a server of its own
    be = c._server.backend                              # private: the injection point
    x = c.create(np.arange(N, dtype=np.float32))
    y = c.create(np.zeros(N, np.float32))
    c.sync()
    real = be.execute
    fired = []

    def execute(s, kind, payload):
        if (not fired and kind in (RUN, CALL, TINY)
                and threading.current_thread().name.startswith("runtime-cpu-worker")):
            fired.append(threading.current_thread())
            raise KeyboardInterrupt("interrupted (injected by the test)")
        return real(s, kind, payload)
    monkeypatch.setattr(be, "execute", execute)
    c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
    until(lambda: fired and not fired[0].is_alive(), "the worker to take the launch and die")
    return c, x, y


def test_a_worker_dying_with_a_launch_taken_stops_the_server_instead_of_a_stale_read(
        monkeypatch):
    c, x, y = _server_with_one_lost_launch(monkeypatch)
    try:
        with pytest.raises(ServerClosed, match="worker|interrupted"):
            got = c.read(y)                 # before: zeros, the launch never ran
            pytest.fail(f"a read after the lost launch returned {got[:4]}")
        other = c.with_stream(runtime.StreamId.new())
        with pytest.raises(ServerClosed):   # every later call, on any stream
            other.read(x)
        fresh = runtime.client("cpu", max_idle_bytes=1 << 21)
        assert fresh._server is not c._server
        h = fresh.create(np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(fresh.read(h), np.arange(4, dtype=np.float32))
    finally:
        c.shutdown()


def test_a_waiter_that_finds_a_worker_dead_stops_the_server_for_a_fresh_one(monkeypatch):
    """The waiter's side alone (a worker dead without marking the backend broken: a backend
    whose workers do not tell, such as wgpu's queue thread): the server leaves the table."""
    c = runtime.client("cpu", max_idle_bytes=1 << 21)
    h = c.create(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(c.read(h), np.arange(4, dtype=np.float32))
    started = threading.Event()
    slow = runtime.Kernel("slow", [runtime.Binding("y", "f32", "write")],
                          cpu=lambda y, *, count: (started.set(), time.sleep(0.5), y.fill(1)))
    try:
        c.launch(slow, 1, [h])              # on a worker: the read waits (polls every 50 ms)
        assert started.wait(10)
        monkeypatch.setattr(c._server.queue, "_healthy", lambda: False)  # private: dead, untold
        with pytest.raises(ServerClosed):
            c.read(h)
        assert c._server.closed
        fresh = runtime.client("cpu", max_idle_bytes=1 << 21)
        assert fresh._server is not c._server
        np.testing.assert_array_equal(fresh.read(fresh.create(np.ones(2, np.float32))),
                                      np.ones(2, np.float32))
    finally:
        monkeypatch.undo()
        c.shutdown()
