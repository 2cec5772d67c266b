"""The device queue and server lifecycle (CubeCL D5 actor scenarios 48-57, D7 64-66)."""

import threading

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import ServerClosed
from runtime.server.queue import DeviceQueue


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


def test_created_resource_is_the_same_when_read(client):                 # 64
    h = client.create(np.array([0, 1, 2], np.uint8))
    np.testing.assert_array_equal(client.read(h), [0, 1, 2])


def test_empty_allocates_memory(client):                                  # 65
    h = client.empty(4)
    assert client.read(h).nbytes == 4 and h.nbytes == 4


def test_execute_elementwise_addition(client):                            # 66
    a = client.create(np.array([0, 1, 2], np.float32))
    b = client.create(np.array([4, 4, 4], np.float32))
    out = client.empty(3, np.float32)
    client.launch(K.add, 1, [a, b, out], {"n": 3})
    np.testing.assert_array_equal(client.read(out), [4, 5, 6])


def test_many_threads_many_streams_same_server(backend):
    results = {}

    def work(k):
        c = runtime.client(backend)
        x = c.create(np.full(100, k, np.float32))
        y = c.empty(100, np.float32)
        for _ in range(20):
            c.launch(K.add_scalar, 2, [x, y], {"alpha": 1.0, "n": 100})
            c.launch(K.copy, 2, [y, x], {"n": 100})
        results[k] = c.read(x)
    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(8):
        np.testing.assert_array_equal(results[k], np.full(100, k + 20, np.float32))


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
