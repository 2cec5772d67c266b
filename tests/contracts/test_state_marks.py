"""A failure reaches everything computed from the failed data, state included (issue 23 item 1;
docs/contract.md section 4).

The rule: a launch or replay that reads a marked buffer, through a ``read`` or ``read_write``
binding, or a graph that reads a buffer before it writes it (an input, or state it reads and
writes), marks everything it writes with the original cause. Only a write computed from clean
data clears a mark: a host write of the whole buffer, or a launch/replay none of whose inputs is
marked. A graph whose state is marked keeps failing until the state is written from the host.

The step kernel fails for real on cpu (its body raises while ``flag[0] != 0``); on wgpu (and
cuda) the backend reports the same failure after the enqueue (what a failed submit or an
asynchronous device error does) while the test's host flag is set.
"""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import ReplayFailed

N = 64
START = np.arange(N, dtype=np.float32)


def _step_cpu(state, flag, out, *, count):
    if flag[0] != 0:
        raise ValueError("flag set")
    out[:] = state + 1


_WGSL = """@group(0) @binding(0) var<storage, read> state: array<f32>;
@group(0) @binding(1) var<storage, read> flag: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {
  if (g.x < arrayLength(&out)) { out[g.x] = state[g.x] + 1.0; } }"""
_CUDA = """extern "C" __global__ void step(const float* state, const float* flag, float* out) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x; out[i] = state[i] + 1.0f; }"""
#: ``out = state + 1``; fails while ``flag[0] != 0``. ``out`` is rewritten, never read: "write".
STEP = runtime.Kernel("step", [runtime.Binding("state", "f32", "read"),
                               runtime.Binding("flag", "f32", "read"),
                               runtime.Binding("out", "f32", "write")],
                      cpu=_step_cpu, wgsl=_WGSL, cuda=_CUDA)


def _checked_cpu(flag, y, *, count):
    if flag[0] != 0:
        raise ValueError("flag set")
    y[:] = 7


_CHECKED_WGSL = """@group(0) @binding(0) var<storage, read> flag: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {
  if (g.x < arrayLength(&y)) { y[g.x] = 7.0; } }"""
#: ``y = 7``; fails while ``flag[0] != 0``.
CHECKED = runtime.Kernel("checked_fill", [runtime.Binding("flag", "f32", "read"),
                                          runtime.Binding("y", "f32", "write")],
                         cpu=_checked_cpu, wgsl=_CHECKED_WGSL)


class _Flag:
    """The failure switch: a device buffer for the cpu body, a host bit for other backends
    (their backend reports the failure after the enqueue while it is set)."""

    def __init__(self, c, monkeypatch):
        self.c, self.on = c, False
        self.buf = c.create(np.zeros(1, np.float32))
        if c.backend == "cpu":
            return
        be = c._server.backend           # private: inject a failure reported after the enqueue
        launch, launch_graph = be.launch, be.launch_graph

        def late(stream, mark):          # the backends' protocol (runtime/backends/base.py)
            err = mark.fail(runtime.LaunchError("step: flag set (reported after the enqueue)"))
            stream.errors.append(err)    # wgpu: reported by the stream's next completion

        def patched_launch(stream, program, count, args, params, mark=None):
            launch(stream, program, count, args, params, mark)
            if self.on and mark is not None and getattr(program, "kernel", None) in (STEP, CHECKED):
                late(stream, mark)

        def patched_graph(stream, graph, mark=None):
            launch_graph(stream, graph, mark)
            if self.on and mark is not None:
                late(stream, mark)
        monkeypatch.setitem(vars(be), "launch", patched_launch)
        monkeypatch.setitem(vars(be), "launch_graph", patched_graph)

    def set(self, on: bool) -> None:
        self.c.write(self.buf, np.full(1, 1.0 if on else 0.0, np.float32))
        self.on = on


def _blocking(c, h):
    """Read ``h``, swallowing the stream's own queued failure the first time (it is raised by
    the first blocking call, together with the mark, once)."""
    try:
        return c.read(h)
    except ReplayFailed:
        raise
    except runtime.ServerError:
        return c.read(h)


def _step_pair(c, state, flag, out):
    c.launch(STEP, 1, [state, flag, out])
    c.launch(K.copy, K.grid(N), [out, state], {"n": N})


def _graph(c, state, flag, out):
    c.graph_prepare()
    _step_pair(c, state, flag, out)                    # warm-up: state + 1
    c.start_capture()
    _step_pair(c, state, flag, out)
    return c.stop_capture()


def _raises_stale(c, *handles):
    for _ in range(2):                                 # every read, not only the first
        for h in handles:
            with pytest.raises(ReplayFailed, match="step|flag set"):
                c.read(h)


def test_a_graph_whose_state_is_marked_keeps_failing_until_the_state_is_written(
        client, monkeypatch):
    c = client
    flag = _Flag(c, monkeypatch)
    state, out = c.create(START), c.empty(N, np.float32)
    g = _graph(c, state, flag.buf, out)
    g.replay()                                         # warm-up + replay: state = START + 2
    np.testing.assert_array_equal(c.read(state), START + 2)
    flag.set(True)
    g.replay()                                         # fails: state and out are marked
    with pytest.raises(runtime.ServerError):
        c.sync()
    flag.set(False)
    g.replay()                                         # reads the marked state: marked again
    _raises_stale(c, out, state)
    g.replay()
    _raises_stale(c, out, state)
    c.write(state, START)                              # the documented recovery
    g.replay()
    np.testing.assert_array_equal(c.read(out), START + 1)
    np.testing.assert_array_equal(c.read(state), START + 1)
    g.release()


def test_the_same_launches_issued_eagerly_keep_failing_too(client, monkeypatch):
    c = client
    flag = _Flag(c, monkeypatch)
    state, out = c.create(START), c.empty(N, np.float32)
    _step_pair(c, state, flag.buf, out)
    np.testing.assert_array_equal(c.read(state), START + 1)
    flag.set(True)
    _step_pair(c, state, flag.buf, out)
    with pytest.raises(runtime.ServerError):
        c.sync()
    flag.set(False)
    _step_pair(c, state, flag.buf, out)
    _raises_stale(c, out, state)
    c.write(state, START)
    _step_pair(c, state, flag.buf, out)
    np.testing.assert_array_equal(c.read(state), START + 1)


def test_accumulate_over_a_marked_buffer_keeps_the_mark(client, monkeypatch):
    """``y += x`` (``y`` bound ``read_write``) reads the stale ``y``: still marked."""
    c = client
    flag = _Flag(c, monkeypatch)
    x, y = c.create(np.ones(N, np.float32)), c.create(np.zeros(N, np.float32))
    flag.set(True)
    c.launch(CHECKED, 1, [flag.buf, y])                # fails: y is marked
    with pytest.raises(runtime.ServerError):
        c.sync()
    flag.set(False)
    c.launch(K.accumulate, K.grid(N), [x, y], {"n": N})
    _raises_stale(c, y)
    c.launch(CHECKED, 1, [flag.buf, y])                # a write computed from clean data ...
    c.launch(K.accumulate, K.grid(N), [x, y], {"n": N})
    np.testing.assert_array_equal(c.read(y), np.full(N, 8, np.float32))   # ... clears it


def test_an_accumulator_graph_keeps_failing_until_its_state_is_written(client, monkeypatch):
    c = client
    flag = _Flag(c, monkeypatch)
    x, y = c.create(np.ones(N, np.float32)), c.create(np.zeros(N, np.float32))
    tmp = c.empty(N, np.float32)
    c.graph_prepare()
    c.launch(CHECKED, 1, [flag.buf, tmp])
    c.launch(K.accumulate, K.grid(N), [tmp, y], {"n": N})
    c.start_capture()
    c.launch(CHECKED, 1, [flag.buf, tmp])
    c.launch(K.accumulate, K.grid(N), [tmp, y], {"n": N})
    g = c.stop_capture()
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.full(N, 14, np.float32))
    flag.set(True)
    g.replay()
    with pytest.raises(runtime.ServerError):
        c.sync()
    flag.set(False)
    g.replay()                                         # y (read_write state) is marked
    _raises_stale(c, y, tmp)
    c.write(y, np.zeros(N, np.float32))
    g.replay()                                         # tmp is written before it is read
    np.testing.assert_array_equal(c.read(y), np.full(N, 7, np.float32))
    np.testing.assert_array_equal(c.read(tmp), np.full(N, 7, np.float32))
    g.release()


def test_a_graph_recovers_when_the_buffers_it_rewrites_were_marked(client, monkeypatch):
    """A graph that writes a buffer before reading it (a temporary, an output) is not computed
    from its stale contents: a replay with clean sources clears the marks."""
    c = client
    flag = _Flag(c, monkeypatch)
    x, t, y = c.create(START), c.empty(N, np.float32), c.empty(N, np.float32)
    c.graph_prepare()
    c.launch(STEP, 1, [x, flag.buf, t])
    c.launch(K.add_scalar, K.grid(N), [t, y], {"alpha": 1.0, "n": N})
    c.start_capture()
    c.launch(STEP, 1, [x, flag.buf, t])
    c.launch(K.add_scalar, K.grid(N), [t, y], {"alpha": 1.0, "n": N})
    g = c.stop_capture()
    flag.set(True)
    g.replay()
    with pytest.raises(runtime.ServerError):
        c.sync()
    _raises_stale(c, t, y)
    flag.set(False)
    g.replay()
    np.testing.assert_array_equal(c.read(y), START + 2)
    g.release()


def test_a_static_graph_with_state_keeps_failing_until_the_state_is_written(
        client, monkeypatch):
    c = client
    flag = _Flag(c, monkeypatch)

    def body(f, out, s):
        c2 = s.client
        c2.launch(STEP, 1, [s.handle, f.handle, out.handle])
        c2.launch(K.copy, K.grid(N), [out.handle, s.handle], {"n": N})

    sg = runtime.StaticGraph(c, inputs={"f": ((1,), "f32")}, outputs={"out": ((N,), "f32")},
                             state={"s": START}, body=body)
    np.testing.assert_array_equal(sg(f=[0.0])["out"], START + 1)
    flag.on = True
    with pytest.raises(runtime.ServerError):
        sg(f=[1.0])
    flag.on = False
    for _ in range(2):
        with pytest.raises(ReplayFailed):
            sg(f=[0.0])                                # the state is stale: never a value
    sg.write(s=START)
    np.testing.assert_array_equal(sg(f=[0.0])["out"], START + 1)
    np.testing.assert_array_equal(sg.read("s"), START + 1)
    sg.release()


def _fail_a_write_of(c, y, short):
    """A launch that would write all of ``y`` fails (its ``x`` is too short: the elements
    check refuses it at enqueue, on every backend): ``y`` is marked."""
    n = y.nbytes // 4
    c.launch(K.add_scalar, K.grid(n), [short, y], {"alpha": 1.0, "n": n})
    with pytest.raises(runtime.ServerError):
        c.sync()


def _raises_elements(c, h):
    for _ in range(2):                                 # every read, not only the first
        with pytest.raises(ReplayFailed, match="add_scalar"):
            c.read(h)


def test_a_write_covering_part_of_a_marked_buffer_keeps_its_mark(client):
    """A ``write`` binding clears a mark only for what it covers: a launch (or a graph) that
    rewrites the first half of a buffer whose last writer failed leaves the second half as the
    failure left it, so a read still raises (before: the stale half read back with no error;
    ADV6). A write of the whole buffer (a launch or the host) clears it."""
    c = client.with_stream(runtime.StreamId.new())
    short = c.create(np.zeros(4, np.float32))
    y = c.create(np.full(8, 100, np.float32))
    _fail_a_write_of(c, y, short)
    c.launch(K.fill, K.grid(4), [y], {"value": 1.0, "n": 4})        # half of y
    _raises_elements(c, y)
    c.launch(K.fill, K.grid(8), [y], {"value": 2.0, "n": 8})        # all of y
    np.testing.assert_array_equal(c.read(y), np.full(8, 2, np.float32))

    g_y = c.create(np.full(8, 100, np.float32))                     # the same through a graph
    c.graph_prepare()
    c.launch(K.fill, K.grid(4), [g_y], {"value": 3.0, "n": 4})
    c.start_capture()
    c.launch(K.fill, K.grid(4), [g_y], {"value": 3.0, "n": 4})
    g = c.stop_capture()
    _fail_a_write_of(c, g_y, short)
    for _ in range(2):                                              # replays keep failing
        g.replay()
        _raises_elements(c, g_y)
    c.write(g_y, np.zeros(8, np.float32))                           # the host writes it all
    g.replay()
    np.testing.assert_array_equal(c.read(g_y), [3, 3, 3, 3, 0, 0, 0, 0])


def test_a_graph_updated_to_write_part_of_a_buffer_keeps_its_mark(client):
    """The same shape through ``Graph.update(params=...)``: a graph's fill of all of ``y``
    updated to cover half keeps ``y``'s failure mark across replays; updated back, a replay
    clears it (ADV6)."""
    c = client.with_stream(runtime.StreamId.new())
    short = c.create(np.zeros(4, np.float32))
    y = c.create(np.full(8, 100, np.float32))
    c.graph_prepare()
    c.launch(K.fill, K.grid(8), [y], {"value": 3.0, "n": 8})
    c.start_capture()
    c.launch(K.fill, K.grid(8), [y], {"value": 3.0, "n": 8})
    g = c.stop_capture()
    g.update(params={0: {"n": 4}})
    _fail_a_write_of(c, y, short)
    g.replay()
    _raises_elements(c, y)
    g.update(params={0: {"n": 8}})
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.full(8, 3, np.float32))


def test_a_grid_covering_part_of_a_marked_buffer_keeps_its_mark(client):
    """The same through the workgroup count: ``fill`` declares ``n`` = all of ``y`` (1024
    floats) but one workgroup of 64 writes 64 of them (every backend honours the count), so the
    rest still holds what the failed writer left: a read keeps raising, eagerly, in a graph and
    after ``Graph.update(count=...)`` to one workgroup (USER6: the mark was cleared and 960 stale
    values read back with no error). A grid covering ``n`` clears it."""
    c = client.with_stream(runtime.StreamId.new())
    n = 1024
    short = c.create(np.zeros(4, np.float32))
    y = c.create(np.full(n, 100, np.float32))
    _fail_a_write_of(c, y, short)
    c.launch(K.fill, 1, [y], {"value": 1.0, "n": n})                # 64 of 1024
    _raises_elements(c, y)
    c.launch(K.fill, K.grid(n), [y], {"value": 2.0, "n": n})        # all of it
    np.testing.assert_array_equal(c.read(y), np.full(n, 2, np.float32))

    c.graph_prepare()
    c.launch(K.fill, K.grid(n), [y], {"value": 3.0, "n": n})
    c.start_capture()
    c.launch(K.fill, K.grid(n), [y], {"value": 3.0, "n": n})
    g = c.stop_capture()
    g.update(count={0: (1, 1, 1)})                                  # now 64 of 1024
    _fail_a_write_of(c, y, short)
    g.replay()
    _raises_elements(c, y)
    g.update(count={0: K.grid(n)})
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.full(n, 3, np.float32))


def test_a_loop_graph_recovers_once_its_state_is_written(client, monkeypatch):
    """The accumulator above with its step inside ``capture_while``: ``tmp`` is written and
    then read inside the loop body, so it is a temporary, not state. Before (ADV6) a write
    inside a node hid no later read, so ``tmp`` counted as a source: after one failed replay
    every replay failed, state rewritten or not (``runtime.models.Decoder``'s loop graphs and
    a ``StaticGraph(loop=...)`` could never recover: their temporaries cannot be written from
    the host). Now a host write of the state (``y``, the loop counter) recovers it."""
    from graph_kernels import add_i32, i32
    c = client
    flag = _Flag(c, monkeypatch)
    y = c.create(np.zeros(N, np.float32))
    tmp = c.empty(N, np.float32)
    go = c.create(i32(1))

    def body():
        c.launch(add_i32, 1, [go], {"delta": -1})           # one iteration per replay
        c.launch(CHECKED, 1, [flag.buf, tmp])                # tmp = 7, or the failure
        c.launch(K.accumulate, K.grid(N), [tmp, y], {"n": N})
    c.graph_prepare()
    c.start_capture()
    try:
        c.capture_while(go, body, max_iterations=2)
    except runtime.UnsupportedError as e:
        c.abort_capture()
        pytest.skip(str(e))
    g = c.stop_capture()
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.full(N, 7, np.float32))
    flag.set(True)
    c.write(go, i32(1))
    g.replay()
    with pytest.raises(runtime.ServerError):
        c.sync()
    flag.set(False)
    c.write(go, i32(1))
    g.replay()                                         # y (read_write state) is marked
    with pytest.raises(ReplayFailed):
        c.read(y)
    c.write(y, np.zeros(N, np.float32))                # the state, from the host
    c.write(go, i32(1))
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.full(N, 7, np.float32))
    g.release()
