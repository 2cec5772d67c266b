"""No silent stale data (issue 13): a read returns the right values or raises, on every backend.

One test per case of the issue (1, 2, 4, 5, 6, 7; case 3 is wgpu's batch failure, elsewhere),
plus the other paths of the same kinds: every change of a buffer's owner is fenced, every
failure reaches the write set of the stream that issued it. Values are checked against numpy.

On the cpu backend's default (thread) scheduler a race is made deterministic with a *gate*: a
cpu kernel that blocks its stream until the test opens it (bounded wait, never a hang), so the
work that must come first is still pending when the later work is issued.
"""

import os
import threading

import numpy as np
import pytest

import runtime
from runtime import Tensor
from runtime import kernels as K
from runtime.errors import CaptureRefused, LaunchError, ReplayFailed, ServerUnhealthy
from runtime.testing import backend_unavailable

from helpers import fail_write_set

N = 64


def fill(c, h, value, n=N):
    c.launch(K.fill, K.grid(n), [h], {"value": float(value), "n": n})


def add(c, x, y, alpha, n=N):
    c.launch(K.add_scalar, K.grid(n), [x, y], {"alpha": float(alpha), "n": n})


class Gate:
    """A cpu kernel that holds its stream until ``open()`` (at most 20 s: never a hang)."""

    def __init__(self):
        self.event = threading.Event()
        self.kernel = runtime.Kernel("gate", [runtime.Binding("y", "f32", "read_write")],
                                     cpu=lambda y, count: self.event.wait(20.0))

    def close_on(self, c, h):
        """Block ``c``'s stream (cpu only; other backends batch or order work by themselves)."""
        if c.backend == "cpu":
            c.launch(self.kernel, 1, [h])

    def open(self):
        self.event.set()


def other(c):
    return c.with_stream(runtime.StreamId.new())


ALL_BACKENDS = [b.strip() for b in os.environ.get("RUNTIME_TEST_BACKENDS", "cpu,wgpu,cuda").split(",")
                if b.strip()]


@pytest.fixture(params=[*ALL_BACKENDS, *(f"interleave-{k}" for k in range(4))])
def fresh(request):
    """A client of each backend, then the cpu backend's seeded interleavings (a server of its
    own each, with the checker: a fresh pool, so the reuse is the test's, and every ordering is
    tried)."""
    if not request.param.startswith("interleave-"):
        why = backend_unavailable(request.param)
        if why:
            pytest.skip(why)
        yield runtime.client(request.param).with_stream(runtime.StreamId.new())
        return
    c = runtime.client("cpu", scheduler="interleave", seed=int(request.param[11:]), check=True)
    yield c.with_stream(runtime.StreamId.new())
    assert c.checker_violations() == []
    c.shutdown()


# -- case 1 and its kind: a buffer changing owner carries the fences of its pending work --------
def test_a_window_allocation_is_ordered_after_the_buffers_previous_owner(client):   # case 1
    a, b = client, other(client)
    x = a.create(np.ones(N, np.float32))
    a.sync()
    gate = Gate()
    tb = b.empty(N, np.float32)
    gate.close_on(b, tb)
    fill(b, tb, 7.0)
    tb.release()                                  # the fill is still pending
    a.graph_prepare()
    a.start_capture()
    out = a.empty(N, np.float32)                  # the pool hands out tb's buffer
    add(a, x, out, 1.0)
    g = a.stop_capture()
    g.replay()
    gate.open()
    np.testing.assert_array_equal(a.read(out), np.full(N, 2.0, np.float32))
    g.release()


@pytest.mark.parametrize("seed", range(6))
def test_a_window_allocation_is_ordered_under_every_interleaving(seed):       # case 1, seeded
    c = runtime.client("cpu", scheduler="interleave", seed=seed, check=True)
    try:
        test_a_window_allocation_is_ordered_after_the_buffers_previous_owner(
            c.with_stream(runtime.StreamId.new()))
        assert c.checker_violations() == []
    finally:
        c.shutdown()


@pytest.mark.parametrize("graph_first", [True, False])
def test_a_buffer_freed_with_a_replay_pending_waits_for_it(fresh, graph_first):
    """Release the graph and a handle it writes, in either order, while its replay is pending:
    the next owner of the buffer, on another stream, is ordered after the replay."""
    a, b = fresh, other(fresh)
    gate = Gate()
    x = a.create(np.ones(N, np.float32))
    y = a.empty(N, np.float32)
    a.graph_prepare()
    add(a, x, y, 4.0)
    a.start_capture()
    gate.close_on(a, y)                           # recorded: every replay waits for the gate
    add(a, x, y, 4.0)
    g = a.stop_capture()
    b.wait_event(a.record_event())                # an event of a's stream *before* the replay
    g.replay()                                    # pending behind the gate
    for release in ((g.release, y.release) if graph_first else (y.release, g.release)):
        release()
    z = b.create(np.full(N, 9.0, np.float32))     # may take y's buffer
    gate.open()
    a.sync()                                      # the replay ran: it must not have hit z
    np.testing.assert_array_equal(b.read(z), np.full(N, 9.0, np.float32))


def test_a_graph_destroyed_with_a_replay_pending_hands_its_buffers_on_fenced(fresh):
    a, b = fresh, other(fresh)
    gate = Gate()
    x = a.create(np.ones(N, np.float32))
    a.graph_prepare()
    a.start_capture()
    tmp = a.empty(N, np.float32)                  # retained by the graph
    gate.close_on(a, tmp)
    add(a, x, tmp, 2.0)
    g = a.stop_capture()
    tmp.release()
    b.wait_event(a.record_event())                # an event of a's stream *before* the replay
    g.replay()
    g.release()                                   # tmp's buffer goes back to the pool now
    z = b.create(np.full(N, -5.0, np.float32))
    gate.open()
    a.sync()                                      # the replay ran: it must not have hit z
    np.testing.assert_array_equal(b.read(z), np.full(N, -5.0, np.float32))


def test_the_checker_models_pool_reuse_instead_of_trusting_it(monkeypatch):
    """A pool that forgot the fences (what case 1 was) is caught by check=True."""
    from runtime.server.memory import Pool
    real = Pool.give
    monkeypatch.setattr(Pool, "give", lambda self, slot, fences: real(self, slot, {}))
    c = runtime.client("cpu", scheduler="interleave", seed=3, check=True)
    try:
        a, b = c.with_stream(runtime.StreamId.new()), c.with_stream(runtime.StreamId.new())
        t = b.empty(N, np.float32)
        fill(b, t, 7.0)
        tid = t.id
        t.release()
        z = a.empty(N, np.float32)                # t's buffer, no fence
        fill(a, z, 1.0)
        with pytest.raises(runtime.StreamRaceError, match=f"handle {tid}"):
            a.sync()
    finally:
        c.shutdown()


# -- case 2 and its kind: failures found after the enqueue reach the write set ------------------
def _checked_copy():
    def cpu(x, t, count):
        if x[0] < 0:
            raise ValueError("negative input")
        t[:] = x
    wgsl = """@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> t: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {
  if (g.x < arrayLength(&t)) { t[g.x] = x[g.x]; } }"""
    cuda = """extern "C" __global__ void checked_copy(const float* x, float* t) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x; t[i] = x[i]; }"""
    # t is rewritten, never read: "write", so a replay with clean inputs clears its mark
    return runtime.Kernel("checked_copy", [runtime.Binding("x", "f32", "read"),
                                           runtime.Binding("t", "f32", "write")],
                          cpu=cpu, wgsl=wgsl, cuda=cuda)


def _fail_replays_while(client, monkeypatch, bad):
    """Non-cpu backends: report a failure of a replay after it was enqueued while ``bad()``
    (what a failed submit or an asynchronous device error does); cpu fails for real."""
    if client.backend == "cpu":
        return
    be = client._server.backend          # private: inject a failure reported after the enqueue
    real = be.launch_graph

    def launch_graph(stream, graph, mark=None):
        real(stream, graph, mark)
        if bad() and mark is not None:
            mark.fail(LaunchError("checked_copy: injected failure found after the enqueue"))
    monkeypatch.setitem(vars(be), "launch_graph", launch_graph)


def test_a_failure_while_a_replay_executes_marks_its_write_set(client, monkeypatch):  # case 2
    c = client
    k = _checked_copy()
    x = c.create(np.full(N, 10.0, np.float32))
    t, y = c.empty(N, np.float32), c.empty(N, np.float32)
    state = {"x": 10.0}
    _fail_replays_while(c, monkeypatch, lambda: state["x"] < 0)
    c.graph_prepare()
    c.launch(k, K.grid(N), [x, t])
    add(c, t, y, 1.0)
    c.start_capture()
    c.launch(k, K.grid(N), [x, t])
    add(c, t, y, 1.0)
    g = c.stop_capture()
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.full(N, 11.0, np.float32))
    c.write(x, np.full(N, -1.0, np.float32))
    state["x"] = -1.0
    g.replay()
    for _ in range(3):                            # every read, not only the first
        with pytest.raises(ReplayFailed, match=f"replay of graph {g.id}") as ei:
            c.read(y)
        assert "checked_copy" in str(ei.value.cause)
    with pytest.raises(ReplayFailed):
        c.read(t)
    np.testing.assert_array_equal(c.read(x), np.full(N, -1.0, np.float32))   # not written
    c.write(x, np.full(N, 3.0, np.float32))
    state["x"] = 3.0
    g.replay()                                    # a replay that lands clears the marks
    np.testing.assert_array_equal(c.read(y), np.full(N, 4.0, np.float32))
    c.sync()
    g.release()


def test_an_eager_launch_failing_at_execution_marks_its_output_on_every_stream():
    """The failure is reported on the issuing stream; the output reads stale from any stream.
    (cpu: an execution-time failure of an eager launch needs a cpu kernel body that raises.)"""
    a = runtime.client("cpu").with_stream(runtime.StreamId.new())
    b = other(a)
    k = _checked_copy()
    x = a.create(np.full(N, -1.0, np.float32))
    t = a.create(np.zeros(N, np.float32))
    a.launch(k, K.grid(N), [x, t])
    with pytest.raises(ReplayFailed, match="launch of checked_copy"):
        b.read(t)
    with pytest.raises(LaunchError):
        a.sync()                                  # reported on the stream that issued it
    with pytest.raises(ReplayFailed):
        a.read(t)
    a.write(t, np.full(N, 5.0, np.float32))       # a whole-buffer write replaces the data
    np.testing.assert_array_equal(b.read(t), np.full(N, 5.0, np.float32))


def test_a_failure_found_at_enqueue_marks_what_the_launch_would_write(client):
    c = client
    only_cuda = runtime.Kernel("only_cuda", [runtime.Binding("y", "f32", "read_write")],
                               cuda='extern "C" __global__ void only_cuda(float* y) {}')
    y = c.create(np.full(N, 2.0, np.float32))
    if c.backend == "cuda":
        only_cuda = runtime.Kernel("only_wgsl", [runtime.Binding("y", "f32", "read_write")],
                                   wgsl="@compute @workgroup_size(1) fn main() {}")
    c.launch(only_cuda, 1, [y])
    with pytest.raises(ReplayFailed) as ei:
        c.read(y)
    assert isinstance(ei.value, LaunchError)      # with the stream's queued error
    c.write(y, np.full(N, 6.0, np.float32))
    np.testing.assert_array_equal(c.read(y), np.full(N, 6.0, np.float32))


def refused_replay(c, x0):
    """A graph ``y = x + 1`` (x = ``x0``) whose replay the backend refused at enqueue
    (``helpers.fail_write_set``; a replay refused at the call, inside a window of its stream,
    marks nothing since ADV9): ``y`` is marked. Returns ``(x, y, graph)``."""
    x = c.create(np.full(N, x0, np.float32))
    y = c.empty(N, np.float32)
    c.graph_prepare()
    add(c, x, y, 1.0)
    c.start_capture()
    add(c, x, y, 1.0)
    g = c.stop_capture()
    fail_write_set(c, g)                          # refused at enqueue: marks y
    return x, y, g


def test_a_launch_reading_a_marked_buffer_marks_its_output(client):
    c = client
    _, y, g = refused_replay(c, 0.0)
    out = c.empty(N, np.float32)
    add(c, y, out, 1.0)                           # computed from stale y
    with pytest.raises(ReplayFailed, match=f"handle {y.id}"):
        c.read(out)
    g.release()


# -- case 4: a failed warm-up is never captured over -------------------------------------------
def _failing_kernel(backend):
    """Fails at execution (cpu), at submit (wgpu: a binding smaller than the shader's array),
    or at enqueue (cuda: no CUDA source)."""
    def cpu(y, count):
        raise RuntimeError("warm-up kernel failed")
    wgsl = """@group(0) @binding(0) var<storage, read_write> y: array<f32, 1024>;
@compute @workgroup_size(1) fn main() { y[0] = 1.0; }"""
    return runtime.Kernel("bad_warmup", [runtime.Binding("y", "f32", "read_write")],
                          workgroup_size=(1, 1, 1), cpu=cpu, wgsl=wgsl)


def test_a_failed_warmup_is_not_captured_over(client):                       # case 4
    c = client
    y = c.create(np.zeros(4, np.float32))
    c.graph_prepare()
    c.launch(_failing_kernel(c.backend), 1, [y])
    with pytest.raises(ServerUnhealthy, match="bad_warmup|dispatch"):   # naming: case 3
        c.start_capture()
    with pytest.raises(runtime.GraphStateError):  # back to no capture
        c.stop_capture()
    c.graph_prepare()                             # and a fresh capture works
    x = c.create(np.ones(N, np.float32))
    out = c.empty(N, np.float32)
    c.start_capture()
    add(c, x, out, 1.0)
    g = c.stop_capture()
    g.replay()
    np.testing.assert_array_equal(c.read(out), np.full(N, 2.0, np.float32))
    g.release()


def test_a_failed_warmup_in_runtime_capture_raises_and_leaves_no_window(client):
    c = client
    y = c.create(np.zeros(4, np.float32))
    bad = _failing_kernel(c.backend)
    with pytest.raises(ServerUnhealthy):
        runtime.capture(lambda: c.launch(bad, 1, [y]), client=c)
    c.graph_prepare()                             # the stream is back to no capture
    c.abort_capture()


# -- case 5: a join on a capturing stream is refused at once -----------------------------------
def test_wait_event_on_a_capturing_stream_is_refused(client):                  # case 5
    a, b = client, other(client)
    x = a.create(np.full(N, 4.0, np.float32))
    t, t2 = a.empty(N, np.float32), a.empty(N, np.float32)
    out = a.empty(N, np.float32)
    a.graph_prepare()
    a.start_capture()
    add(a, x, t, 1.0)
    b.launch(K.mul_scalar, K.grid(N), [t, t2], {"alpha": 2.0, "n": N})
    with pytest.raises(CaptureRefused, match="wait_event"):
        a.wait_event(b.record_event())
    with pytest.raises(CaptureRefused, match="record_event"):
        a.record_event()
    a.launch(K.copy, K.grid(N), [t2, out], {"n": N})
    # a caught refusal still invalidates the window: the graph would lack the join (issue 23)
    with pytest.raises(CaptureRefused, match="first refused operation: wait_event.*"
                                             "then: record_event"):
        a.stop_capture()
    a.graph_prepare()                             # back to no capture
    a.abort_capture()


# -- case 6: runtime.capture and StaticGraph keep every buffer their recording touched ---------
def test_runtime_capture_keeps_the_tensors_fn_used_alive(client):              # case 6
    c = client
    x = Tensor.from_numpy(c, np.arange(4, dtype=np.float32))
    g = runtime.capture(lambda: x.add(x), client=c)
    x = Tensor.from_numpy(c, np.full(4, 100.0, np.float32))    # rebinds fn's x: old one dropped
    w = Tensor.from_numpy(c, np.full(4, 9.0, np.float32))
    np.testing.assert_array_equal(g.replay().numpy(), [0, 2, 4, 6])
    np.testing.assert_array_equal(w.numpy(), np.full(4, 9.0, np.float32))
    g.release()


def test_static_graph_keeps_the_weights_its_body_used_alive(client):          # case 6
    c = client
    b = Tensor.from_numpy(c, np.full(4, 1.5, np.float32))
    sg = runtime.StaticGraph(c, inputs={"x": ((4,), "f32")}, outputs={"y": ((4,), "f32")},
                             body=lambda x, y: {"y": x.add(b)})
    del b
    ws = [Tensor.from_numpy(c, np.full(4, -9.0, np.float32)) for _ in range(8)]   # one may reuse
    np.testing.assert_array_equal(sg(x=np.arange(4, dtype=np.float32))["y"],
                                  np.arange(4, dtype=np.float32) + 1.5)
    for w in ws:
        np.testing.assert_array_equal(w.numpy(), np.full(4, -9.0, np.float32))
    sg.release()


# -- case 7: a whole-buffer write clears the mark -----------------------------------------------
def test_a_write_clears_the_mark_of_a_refused_replay(client):                 # case 7
    c = client
    _, z, g = refused_replay(c, 1.0)
    with pytest.raises(ReplayFailed):
        c.read(z)
    c.write(z, np.zeros(N, np.float32))
    np.testing.assert_array_equal(c.read(z), np.zeros(N, np.float32))
    g.replay()
    np.testing.assert_array_equal(c.read(z), np.full(N, 2.0, np.float32))
    g.release()


# -- the abort verb ----------------------------------------------------------------------------
def test_abort_capture_unwinds_a_window_and_its_buffers(client):
    c = client
    x = c.create(np.ones(N, np.float32))
    c.graph_prepare()
    c.start_capture()
    tmp = c.empty(N, np.float32)
    add(c, x, tmp, 1.0)
    c.abort_capture()                             # nothing recorded, no graph
    c.abort_capture()                             # idempotent
    add(c, x, tmp, 5.0)                           # the stream runs eagerly again
    np.testing.assert_array_equal(c.read(tmp), np.full(N, 6.0, np.float32))


def test_a_free_refused_by_two_open_windows_is_refused_by_both(client, hardware):
    """A buffer freed while two capture windows (two streams) use it: both stop_capture calls
    refuse (neither graph may replay a buffer that went back to the pool)."""
    if hardware:
        pytest.skip("two concurrent stream captures: not on hardware graphs (CUDA global mode)")
    c1 = client
    c2 = runtime.client(c1.backend)
    c2.set_stream(runtime.StreamId.new())
    x = c1.create(np.ones(N, np.float32))
    c1.sync()
    outs = []
    for c in (c1, c2):
        y = c.empty(N, np.float32)
        c.graph_prepare()
        add(c, x, y, 1.0)
        c.start_capture()
        add(c, x, y, 1.0)
        outs.append(y)
    x.release()
    for c in (c1, c2):
        with pytest.raises(CaptureRefused, match="freed"):
            c.stop_capture()
    for c, y in zip((c1, c2), outs):      # the warm-ups ran; both servers serve on
        np.testing.assert_array_equal(c.read(y), np.full(N, 2, np.float32))
