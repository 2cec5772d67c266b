"""Bad input gets a typed error, the server keeps serving, other clients are unaffected
(docs/contract.md section 5)."""

import threading

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import (CaptureRefused, InvalidHandle, LaunchError, OutOfMemory, ServerClosed,
                            ServerError, ServerUnhealthy, UnknownGraph)


def still_serves(client):
    """Another client on another thread still gets correct answers."""
    out = {}

    def other():
        c2 = runtime.client(client.backend)
        h = c2.create(np.array([1.5, 2.5], np.float32))
        out["v"] = c2.read(h)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    np.testing.assert_array_equal(out["v"], [1.5, 2.5])


def test_wrong_python_types_raise_at_the_call(client):
    h = client.create(np.zeros(4, np.float32))
    with pytest.raises(TypeError):
        client.create([1, 2, 3])
    with pytest.raises(TypeError):
        client.write(h, [1, 2, 3, 4])
    with pytest.raises(TypeError):
        client.write("h", np.zeros(4, np.float32))
    with pytest.raises(TypeError):
        client.read(7)
    with pytest.raises(TypeError):
        client.launch("add", 1, [h])
    with pytest.raises(TypeError):
        client.launch(K.fill, "one", [h], {"value": 1.0, "n": 4})
    with pytest.raises(TypeError):
        client.launch(K.fill, 1, h, {"value": 1.0, "n": 4})
    with pytest.raises(TypeError):
        client.launch(K.fill, 1, [h], {"value": "x", "n": 4})
    with pytest.raises(ValueError):
        client.launch(K.fill, 1, [h], {"value": 1.0})
    with pytest.raises(ValueError):
        client.launch(K.fill, 1, [h], {"value": 1.0, "n": -1})
    with pytest.raises(ValueError):
        client.launch(K.fill, (-1, 1), [h], {"value": 1.0, "n": 4})
    with pytest.raises(ValueError):
        client.empty((2, -3), np.float32)
    with pytest.raises(ValueError):
        runtime.client("no-such-backend")
    np.testing.assert_array_equal(client.read(h), [0, 0, 0, 0])
    still_serves(client)


def test_wrong_sizes_raise_invalid_handle(client):
    h = client.create(np.zeros(4, np.float32))
    with pytest.raises(InvalidHandle, match="holds 4"):
        client.write(h, np.zeros(5, np.float32))
    with pytest.raises(InvalidHandle, match="16"):
        client.write(h, b"\0" * 8)
    with pytest.raises(LaunchError, match="bindings"):
        client.launch(K.add, 1, [h, h], {"n": 4})
    np.testing.assert_array_equal(client.read(h), [0, 0, 0, 0])


def test_released_handles_are_refused(client):
    h = client.create(np.arange(4, dtype=np.float32))
    g = client.create(np.zeros(4, np.float32))
    h.release()
    for call in (lambda: client.read(h), lambda: client.write(h, np.zeros(4, np.float32)),
                 lambda: client.launch(K.copy, 1, [h, g], {"n": 4})):
        with pytest.raises(InvalidHandle, match="released"):
            call()
    np.testing.assert_array_equal(client.read(g), [0, 0, 0, 0])
    still_serves(client)


def test_a_handle_of_another_server_is_refused():
    a = runtime.client("cpu")
    b = runtime.client("cpu", scheduler="interleave", seed=1)
    try:
        h = a.create(np.zeros(2, np.float32))
        with pytest.raises(InvalidHandle, match="another server"):
            b.read(h)
    finally:
        b.shutdown()


def test_launch_errors_are_queued_and_raised_by_the_next_blocking_call(client):
    h = client.create(np.zeros(4, np.float32))
    broken = runtime.Kernel("broken", [runtime.Binding("y", "f32", "read_write")],
                            wgsl="this is not wgsl", cuda="this is not cuda",
                            cpu=lambda y, count: 1 / 0)
    client.launch(broken, 1, [h])                 # returns: fire-and-forget
    with pytest.raises(ServerUnhealthy) as info:
        client.sync()
    assert isinstance(info.value, LaunchError) and "broken" in str(info.value)
    client.sync()                                  # drained: the stream is healthy again
    client.launch(K.fill, 1, [h], {"value": 7.0, "n": 4})
    np.testing.assert_array_equal(client.read(h), [7, 7, 7, 7])   # CubeCL 70
    still_serves(client)


def test_a_kernel_without_a_source_for_this_backend_is_a_launch_error(client):
    h = client.create(np.zeros(4, np.float32))
    only_cuda = runtime.Kernel("only_cuda", [runtime.Binding("y", "f32", "read_write")],
                               cuda='extern "C" __global__ void only_cuda(float* y) {}')
    if client.backend == "cuda":
        pytest.skip("this kernel has a cuda source")
    client.launch(only_cuda, 1, [h])
    with pytest.raises(LaunchError, match="only_cuda"):
        client.flush()


def test_every_public_call_during_a_capture(client):
    c = client
    x = c.create(np.ones(4, np.float32))
    y = c.empty(4, np.float32)
    c.graph_prepare()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    c.read(y)
    c.start_capture()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})    # recorded
    with pytest.raises(CaptureRefused):
        c.read(y)
    with pytest.raises(CaptureRefused):
        c.sync()
    with pytest.raises(CaptureRefused):
        c.record_event()
    with pytest.raises(runtime.GraphStateError):
        c.graph_prepare()
    with pytest.raises(runtime.GraphStateError):
        c.start_capture()
    c.flush()                                      # allowed: hands work to the device
    z = c.empty(4, np.float32)                     # allowed (retained on software graphs)
    assert c.memory_usage()["handles"] >= 3
    still_serves(c)                                # other streams work meanwhile
    # the refusals invalidated the window (CUDA's rule): no graph, the first one named first
    with pytest.raises(CaptureRefused, match=r"first refused operation: read of handle .*"
                                             r"then: sync.*record_event"):
        c.stop_capture()
    c.graph_prepare()                              # back to no capture
    c.abort_capture()
    c.write(x, np.full(4, 2, np.float32))
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    np.testing.assert_array_equal(c.read(y), [3, 3, 3, 3])
    del z


def test_unknown_graph_and_released_clones(client):
    x = client.create(np.ones(4, np.float32))
    client.graph_prepare()
    client.start_capture()
    y = client.empty(4, np.float32)
    client.launch(K.mul_scalar, 1, [x, y], {"alpha": 2.0, "n": 4})
    g = client.stop_capture()
    g.release()
    with pytest.raises(UnknownGraph, match="released"):
        g.replay()
    with pytest.raises(UnknownGraph):
        g.clone()
    with pytest.raises(UnknownGraph, match="unknown"):
        client._server.call(client._server.h_replay, 10**9)   # private: an id no Graph has
    still_serves(client)


def test_a_closed_server_raises_server_closed_everywhere():
    c = runtime.client("cpu", scheduler="thread", seed=99)   # its own server
    h = c.create(np.ones(4, np.float32))
    y = c.empty(4, np.float32)
    c.graph_prepare()
    c.start_capture()
    c.launch(K.add_scalar, 1, [h, y], {"alpha": 1.0, "n": 4})
    g = c.stop_capture()
    c.shutdown()
    for call in (c.sync, lambda: c.read(h), lambda: c.create(np.ones(2, np.float32)),
                 lambda: c.launch(K.fill, 1, [h], {"value": 1.0, "n": 4}), g.replay,
                 c.graph_prepare, lambda: c.write(h, np.ones(4, np.float32))):
        with pytest.raises(ServerClosed):
            call()
    del h, g                                       # finalizers after close are harmless
    assert issubclass(ServerClosed, ServerError)


def test_a_waiting_caller_gets_server_closed_when_the_server_stops():
    c = runtime.client("cpu", scheduler="thread", seed=98)
    gate = threading.Event()
    block = runtime.Kernel("block", [runtime.Binding("y", "f32", "read_write")],
                           cpu=lambda y, count: gate.wait(5))
    h = c.create(np.zeros(4, np.float32))
    c.launch(block, 1, [h])
    err = {}

    def waiter():
        try:
            c.read(h)
        except ServerError as e:
            err["e"] = e
    t = threading.Thread(target=waiter)
    t.start()
    threading.Timer(0.2, gate.set).start()
    c.shutdown()
    t.join(10)
    assert not t.is_alive()
    assert "e" not in err or isinstance(err["e"], ServerClosed)


def test_the_device_thread_dying_wakes_every_waiter():
    from runtime.server.queue import _Fatal
    c = runtime.client("cpu", scheduler="thread", seed=97)
    srv = c._server                      # private: kill this server's device thread
    gate = threading.Event()

    def die():
        gate.wait(5)
        raise _Fatal("test: kill the device thread")
    results = []

    def caller():
        try:
            c.sync()
            results.append("ok")
        except ServerClosed as e:
            results.append(e)
    srv.post(die)                                  # runs on the device thread, which blocks
    import time
    time.sleep(0.1)
    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    gate.set()
    for t in threads:
        t.join(10)
    assert len(results) == 3 and all(isinstance(r, ServerClosed) for r in results), results
    assert "died" in str(results[0])
    with pytest.raises(ServerClosed):
        c.sync()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_backend_worker_wakes_the_waiting_reader():
    """Stream workers that die (a BaseException escaping the backend's execution: a kernel
    body's own exceptions, SystemExit included, are typed errors and never kill one) must not
    leave a reader waiting forever on work only they could run: it gets ServerClosed. (A reader
    runs its own stream's work itself; here it waits on another stream's event.)"""
    import time
    c = runtime.client("cpu", scheduler="thread", seed=96)
    backend = c._server.backend           # private: the cpu worker threads to kill
    execute, main = backend.execute, threading.main_thread()

    def dying(*args):                     # each worker dies on the first item it runs
        if threading.current_thread() is not main:
            raise SystemExit("test: kill the worker")
        return execute(*args)
    backend.execute = dying
    threads = backend.scheduler.threads   # every one dead (is_alive() turns False at the first:
    n = 1 << 19                           # a survivor ran the work below under load, and the
    deadline = time.time() + 10           # read returned): large launches, which a worker runs
    while any(t.is_alive() for t in threads) and time.time() < deadline:
        k = c.with_stream(runtime.StreamId.new())
        k.launch(K.fill, K.grid(n), [k.empty(n, np.float32)], {"value": 1.0, "n": n})
        time.sleep(0.01)
    backend.execute = execute
    assert not any(t.is_alive() for t in threads)
    a = c.with_stream(runtime.StreamId.new())
    b = c.with_stream(runtime.StreamId.new())
    with pytest.raises(ServerClosed, match="worker"):  # (since ADV6's 8593783 a dying worker
        h = a.create(np.zeros(4, np.float32))          # stops the server at once: the create
        b.launch(K.fill, 1, [h], {"value": 1.0, "n": 4})   # raises; before, the read did)
        b.read(h)
    fresh = runtime.client("cpu", scheduler="thread", seed=96)     # a new server, not the dead one
    assert fresh._server is not c._server
    fresh.shutdown()
    c.shutdown()


def test_a_drain_is_an_instance_of_each_class_it_raises_related_or_folded():
    """A blocking call raises the errors queued on its stream as one ServerUnhealthy that is
    an instance of each of their classes (section 1). Found by ADV2: (1) a drain of a
    LaunchError and a LoopLimitExceeded (its subclass), or of a plain ServerError and any
    other, was an instance of none of them (the combined class's MRO failed: a base listed
    before its subclass); (2) errors folded past MAX_QUEUED_ERRORS (a stream that never
    blocks) lost their classes: 70 refused allocations, then a launch whose kernel fails to
    compile: ``except LaunchError`` missed the sync's error; a pickled copy too."""
    import pickle

    from runtime.errors import LoopLimitExceeded, OutOfMemory, unhealthy

    e = unhealthy([LaunchError("a"), LoopLimitExceeded("b")])
    assert isinstance(e, LaunchError) and isinstance(e, LoopLimitExceeded)
    e = unhealthy([ServerError("internal"), OutOfMemory("b")])
    assert isinstance(e, OutOfMemory)

    c = runtime.client("cpu")
    c.set_stream(runtime.StreamId.new())
    h = c.create(np.zeros(4, np.float32))
    no_cpu = runtime.Kernel("no_cpu_body", [runtime.Binding("y", "f32", "read_write")], wgsl="x")
    for _ in range(70):
        c.empty(1 << 46)                  # OutOfMemory, queued on the stream (nobody blocks)
    c.launch(no_cpu, 1, [h])              # LaunchError (compile), queued after them: folded
    with pytest.raises(ServerUnhealthy) as info:
        c.sync()
    err = info.value
    assert isinstance(err, OutOfMemory) and isinstance(err, LaunchError), type(err).__mro__
    assert "no_cpu_body" in str(err)
    copy = pickle.loads(pickle.dumps(err))
    assert isinstance(copy, OutOfMemory) and isinstance(copy, LaunchError)
    c.sync()                              # drained once


@pytest.mark.parametrize("shape, dtype", [((1 << 40, 1 << 40), np.float32),
                                          ((1 << 31, 1 << 33), np.uint8),
                                          (1 << 62, np.float32)])
def test_an_allocation_past_what_the_device_can_hold_is_out_of_memory(client, shape, dtype):
    """``empty`` of a shape whose byte count passes 2**63 or numpy's largest array: the handle
    says the exact size, the allocation fails with ``OutOfMemory`` (queued, raised by the next
    blocking call of the stream) and a read of the handle raises a ``ServerError``. Before, the
    byte count wrapped to 0 (np.prod in int64), so the handle held 0 bytes for 2**80 elements
    and the read raised numpy's reshape ValueError; and the cpu backend's refusal of 2**64 bytes
    was numpy's ValueError, queued as an internal error instead of OutOfMemory (ADV3)."""
    h = client.empty(shape, dtype)
    dims = (shape,) if isinstance(shape, int) else shape
    want = np.dtype(dtype).itemsize
    for d in dims:
        want *= d
    assert h.nbytes == want
    with pytest.raises(ServerError):
        client.read(h)
    with pytest.raises(OutOfMemory):
        client.sync()
    client.sync()                       # raised once
    x = client.create(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(client.read(x), [0, 1, 2, 3])
    still_serves(client)
