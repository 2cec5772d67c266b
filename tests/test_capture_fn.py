"""``runtime.capture(fn)`` (seed 000): graph path equals eager execution, stable outputs, the
documented Python effects, and every fallback."""

import numpy as np
import pytest

import runtime
from runtime import Tensor
from runtime import kernels as K
from runtime.errors import GraphStateError, UnknownGraph, UnsupportedError


def model(c, rng):
    """Stable input/weight tensors and a closure of a few library ops over them."""
    x = Tensor.from_numpy(c, rng.standard_normal((3, 8)).astype(np.float32))
    w = Tensor.from_numpy(c, rng.standard_normal((8, 5)).astype(np.float32))
    b = Tensor.from_numpy(c, rng.standard_normal(5).astype(np.float32))
    g = Tensor.from_numpy(c, np.ones(5, np.float32))
    z = Tensor.from_numpy(c, np.zeros(5, np.float32))

    def fn():
        h = x.matmul(w, b, activation="gelu")
        return h.layer_norm(g, z, residual=h.gelu()), h
    return x, fn


def test_replays_equal_eager_across_changing_inputs(client):
    rng = np.random.default_rng(1)
    x, fn = model(client, rng)
    graph = runtime.capture(fn, client=client)
    assert graph.recorded and graph.fallback_reason is None
    assert graph.stream == client.stream
    first = graph.output
    handles = [t.handle.id for t in first]
    for _ in range(12):
        data = rng.standard_normal((3, 8)).astype(np.float32)
        graph.write(x, data)
        out = graph.replay()
        assert out is first and [t.handle.id for t in out] == handles   # stable outputs
        got = [graph.read(t) for t in out]
        x.write(data)
        want = [t.numpy() for t in fn()]                                # eager, same kernels
        for a, e in zip(got, want):
            np.testing.assert_array_equal(a, e)


def test_python_effects_run_at_capture_only(client):
    x = Tensor.from_numpy(client, np.arange(4, dtype=np.float32))
    calls = []

    def fn():
        calls.append(1)                     # a Python side effect
        return x.gelu()

    graph = runtime.capture(fn, client=client, warmup=2)
    assert len(calls) == 3                  # two warm-ups + the recorded run
    for _ in range(5):
        graph.replay()
    assert len(calls) == 3                  # replays run only the recorded launches
    graph.write(x, np.zeros(4, np.float32))
    np.testing.assert_array_equal(graph.replay().numpy(), np.zeros(4, np.float32))


def test_host_read_inside_fn_falls_back(client):
    x = Tensor.from_numpy(client, np.arange(4, dtype=np.float32))
    seen = []

    def fn():
        y = x.gelu()
        seen.append(y.numpy())              # a host read: cannot be recorded
        return y

    graph = runtime.capture(fn, client=client)
    assert not graph.recorded and not graph.is_hardware and graph.graph is None
    assert "reads to the host" in graph.fallback_reason
    n = len(seen)
    for k in range(4):
        x.write(np.full(4, k, np.float32))
        out = graph.replay()
        assert out is graph.output and len(seen) == n + k + 1   # fn re-run, fresh output
        np.testing.assert_array_equal(out.numpy(), Tensor.from_numpy(
            client, np.full(4, k, np.float32)).gelu().numpy())


def test_host_write_inside_fn_falls_back(client):
    x = Tensor.from_numpy(client, np.zeros(4, np.float32))
    step = [0]

    def fn():
        step[0] += 1
        x.write(np.full(4, step[0], np.float32))     # refused late: cannot be recorded
        return x.gelu()

    graph = runtime.capture(fn, client=client)
    assert not graph.recorded and "refused" in graph.fallback_reason
    out = graph.replay()
    want = Tensor.from_numpy(client, np.full(4, step[0], np.float32)).gelu().numpy()
    np.testing.assert_array_equal(out.numpy(), want)


def test_backend_without_graphs_falls_back(monkeypatch):
    c = runtime.client("cpu", seed=424242)            # a server of its own
    backend = c._server.backend                       # private: a backend without graphs

    def no_graphs(raw):
        raise UnsupportedError("graph capture is not supported by this test backend")

    monkeypatch.setitem(vars(backend), "begin_graph", no_graphs)
    x = Tensor.from_numpy(c, np.arange(4, dtype=np.float32))
    graph = runtime.capture(lambda: x.gelu(), client=c)
    assert not graph.recorded and "cannot record graphs" in graph.fallback_reason
    x.write(np.ones(4, np.float32))
    np.testing.assert_allclose(graph.replay().numpy(), np.full(4, 0.8413447, np.float32),
                               rtol=1e-6)


def test_work_on_another_stream_is_not_silently_lost(client):
    x = Tensor.from_numpy(client, np.arange(4, dtype=np.float32))
    other = client.with_stream(runtime.StreamId.new())
    y = other.empty(4, np.float32)

    def fn():                               # launches on `other`, not on the capture stream
        other.launch(runtime.kernels.copy, 1, [x.handle, y], {"n": 4})

    graph = runtime.capture(fn, client=client)
    assert not graph.recorded and "nothing was recorded" in graph.fallback_reason
    with pytest.raises(ValueError, match="stream"):
        runtime.capture(lambda: Tensor(other, y, (4,)).gelu(), client=client)


def test_client_is_found_from_the_output(client):
    x = Tensor.from_numpy(client, np.arange(4, dtype=np.float32))
    graph = runtime.capture(lambda: x.gelu())
    assert graph.recorded and graph.stream == client.stream
    with pytest.raises(ValueError, match="client="):
        runtime.capture(lambda: None)


def test_errors_leave_the_stream_usable(client):
    x = Tensor.from_numpy(client, np.arange(4, dtype=np.float32))
    runs = [0]

    def boom():
        runs[0] += 1
        if runs[0] == 2:                    # fails in the recorded run
            raise RuntimeError("boom")
        return x.gelu()

    with pytest.raises(RuntimeError, match="boom"):
        runtime.capture(boom, client=client)
    graph = runtime.capture(lambda: x.gelu(), client=client)   # the stream is out of capture
    assert graph.recorded
    client.graph_prepare()
    with pytest.raises(GraphStateError):
        runtime.capture(lambda: x.gelu(), client=client)
    client.start_capture()
    client.stop_capture().release()
    with pytest.raises(TypeError):
        runtime.capture(42, client=client)
    with pytest.raises(ValueError):
        runtime.capture(lambda: x.gelu(), client=client, warmup=-1)
    graph.release()
    with pytest.raises(UnknownGraph):
        graph.replay()


def test_a_captured_graph_reports_its_memory_and_zeros_on_the_fallback_path():
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    x = c.create(np.arange(64, dtype=np.float32))
    y = c.empty(64, np.float32)
    g = runtime.capture(lambda: c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 64}),
                        client=c)
    assert g.memory_usage() == g.graph.memory_usage() and g.memory_usage()["used_bytes"] == 512
    assert g.nbytes == g.graph.nbytes
    g.release()
    assert g.nbytes == 0 and g.memory_usage()["pool"] is None


def test_an_owner_holding_a_graph_of_its_own_closure_is_freed_without_the_cyclic_gc(client):
    """SOAK7: a recorded CapturedGraph kept ``fn``, which only the fallback path runs again;
    an object whose graph records a closure over itself (MiniLM's bucket ``forward``) was
    then in a reference cycle and kept its weights until the cyclic garbage collector ran
    (a service embedding a corpus per job: up to 5 models, 750 MB). Its buffers now go back
    as soon as the owner is dropped."""
    import gc
    import weakref

    class Owner:
        def __init__(self, c):
            self.w = Tensor.from_numpy(c, np.full(16, 2.0, np.float32))
            self.x = Tensor.from_numpy(c, np.arange(16, dtype=np.float32))

            def forward():
                return self.x.add(self.w)
            self.graph = runtime.capture(forward, client=c)

    gc.collect()                        # (earlier tests' cyclic garbage: freed before counting)
    before = client.memory_usage()["handles"]
    gc.disable()
    try:
        refs = []
        for k in range(3):
            o = Owner(client)
            assert o.graph.recorded
            np.testing.assert_array_equal(o.graph.replay().numpy(), np.arange(16) + 2.0)
            refs.append(weakref.ref(o))
            del o
        alive = [r for r in refs if r() is not None]
        client.sync()
        left = client.memory_usage()["handles"] - before
    finally:
        gc.enable()
    assert alive == [] and left == 0, (len(alive), left)
