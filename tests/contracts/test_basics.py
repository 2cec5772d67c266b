"""The basic verbs on every backend (CubeCL D7 scenarios 64-66: create/read, empty, an
elementwise launch) and many threads on many streams of one server."""

import threading

import numpy as np

import runtime
from runtime import kernels as K


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
