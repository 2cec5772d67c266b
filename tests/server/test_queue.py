"""The device queue and server lifecycle (CubeCL D5 actor scenarios 48-57; D7 64-66 run on
every backend in tests/contracts/test_basics.py)."""

import threading
import time

import numpy as np
import pytest

import runtime
from runtime.errors import ServerClosed
from runtime.server.queue import DeviceQueue, OwnerLock


@pytest.fixture
def queue():
    errors = []
    q = DeviceQueue("test-queue", errors.append)
    q.errors = errors
    yield q
    q.close(lambda: None)


def test_basic_execution_and_state_persistence(queue):                  # 48
    state = {"n": 0}

    def inc():
        state["n"] += 1
        return state["n"]
    assert queue.call(inc) == 1
    assert queue.call(inc) == 2


def test_fire_and_forget_then_blocking_sees_all(queue):                 # 49, 55
    state = {"n": 0}

    def inc():
        state["n"] += 1
    threads = [threading.Thread(target=lambda: [queue.submit(inc) for _ in range(100)])
               for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert queue.call(lambda: state["n"]) == 1000


def test_fifo_order_across_posts_submits_and_calls(queue):
    seen = []
    for i in range(50):
        (queue.post if i % 3 == 0 else queue.submit)(seen.append, i)
    assert queue.call(lambda: list(seen)) == list(range(50))


def test_posted_work_runs_without_a_blocking_call(queue):               # 50
    done = threading.Event()
    queue.post(done.set)
    assert done.wait(2.0)


def test_shutdown_drains_work_left_queued(queue):                        # 51
    ran = []
    queue.post(ran.append, 1)
    queue.close(lambda: ran.append("closed"))
    assert ran == [1, "closed"]
    with pytest.raises(ServerClosed):
        queue.submit(ran.append, 2)


def test_an_error_in_a_blocking_call_goes_to_its_caller(queue):          # 52, 53, 54
    def boom():
        raise RuntimeError("boom")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom"):
            queue.call(boom)
    assert queue.call(lambda: 0) == 0


def test_an_error_in_fire_and_forget_work_is_reported(queue):
    queue.submit(lambda: 1 / 0)
    assert queue.call(lambda: len(queue.errors)) == 1


def test_calls_from_inside_a_message_do_not_deadlock(queue):            # 56
    inner = []
    queue.call(lambda: queue.post(inner.append, "later"))
    assert queue.call(lambda: list(inner)) == ["later"]


def test_servers_start_lazily_and_shutdown_stops_them():
    c = runtime.client("cpu", scheduler="thread", seed=12345)
    assert c.read(c.create(np.ones(1, np.float32)))[0] == 1
    srv = c._server                               # private: the server object outlives the call
    runtime.shutdown()
    assert srv.closed
    with pytest.raises(ServerClosed):
        c.sync()
    c2 = runtime.client("cpu")                      # a new server starts on demand
    assert c2.read(c2.create(np.ones(1, np.float32)))[0] == 1


def test_a_producer_waiting_for_room_gets_server_closed_when_a_backend_worker_died():
    """The backlog only shrinks while the backend's workers run it: once one died (``healthy``
    turns False), a producer waiting for room would wait forever (it checked only the device
    thread); it gets ``ServerClosed`` saying a worker died, as a waiting reader does."""
    import time
    alive = [True]
    q = DeviceQueue("test-dead-worker", lambda e: None, healthy=lambda: alive[0],
                    load=lambda: (10 ** 9, 0))          # a backlog nobody will run
    out = []

    def producer():
        try:
            q.submit(lambda: None)
            out.append("queued")
        except BaseException as e:  # noqa: BLE001 - what the producer got
            out.append(e)
    t = threading.Thread(target=producer, daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive() and q.room_waiters == 1          # waiting for room, as it should
    alive[0] = False                                     # the worker dies
    t.join(5)
    try:
        assert not t.is_alive(), "the producer still waits for room after the worker died"
        assert len(out) == 1 and isinstance(out[0], ServerClosed), out
        assert "worker" in str(out[0])
    finally:
        q.close(lambda: None)


def test_a_blocking_call_from_code_that_holds_the_owner_lock_is_refused_and_never_runs():
    """User code that runs inside a message (the cpu backend's kernel bodies on its fast
    paths) and makes a blocking call queues a message only its own thread could run: the
    call raises ``UnsupportedError`` after one poll interval (``reentrant``), and the message
    is taken back, so it never runs after the caller was told it failed."""
    here = threading.local()
    q = DeviceQueue("test-reentrant", lambda e: None,
                    reentrant=lambda: getattr(here, "inside", False))
    ran, got = [], []

    def message():
        here.inside = True
        try:
            q.call(ran.append, "nested")
        except Exception as e:  # noqa: BLE001 - what the nested call raised
            got.append(e)
        finally:
            here.inside = False
    try:
        q.call(message)
        assert len(got) == 1 and isinstance(got[0], runtime.UnsupportedError), got
        q.call(lambda: None)                 # the queue runs on; the nested call never ran
        assert ran == []
    finally:
        q.close(lambda: None)


def test_the_owner_lock_is_one_token_taken_and_given_back():
    """``OwnerLock`` (issue 26: a ``list.pop`` / ``append`` instead of ``threading.Lock``'s
    argument parsing) keeps ``threading.Lock``'s contract where the queue relies on it: one
    holder at a time, a second release refused (two tokens would let two owners run at
    once), a timed acquire that gives up, and a blocking acquire that gets it once another
    thread lets go."""
    lock = OwnerLock()
    assert not lock.locked()
    assert lock.acquire(False) and lock.locked()
    assert not lock.acquire(False)
    assert not lock.acquire(timeout=0.05)            # held: gives up after its timeout
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()                               # not held: refused, no second token
    assert lock.tok == [True]
    assert lock.acquire(False)
    got = []
    t = threading.Thread(target=lambda: got.append(lock.acquire(timeout=10.0)))
    t.start()
    time.sleep(0.05)
    assert not got                                   # still waiting for the holder
    lock.release()
    t.join(10.0)
    assert got == [True] and lock.locked() and lock.tok == []
