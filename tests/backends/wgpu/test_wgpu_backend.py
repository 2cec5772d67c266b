"""wgpu-specific behaviour, tested against the backend's device verbs (``runtime.backends.base``).

The contracts every backend shares live in ``tests/contracts/``; this file covers what only the
wgpu backend has: adapter reporting, batching over the one queue, the write_buffer ordering
pitfall, cached pipelines/uniforms/bind groups, indirect dispatch and one-submit replay.
Skipped only when wgpu-py or a WebGPU adapter is absent. It reaches into the backend's private
tables (``be._groups``, ``client._server.backend``): they are what it tests.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import runtime.kernels as K
from runtime.errors import LaunchError, OutOfMemory, UnsupportedError
from runtime.kernel import Binding, Kernel
from helpers import backend_module_or_skip, library_kernels

wgpu_backend = backend_module_or_skip("wgpu", "bash setup.sh installs wgpu-py")
N = 1000
NB = N * 4


@pytest.fixture(scope="module")
def be():
    try:
        backend = wgpu_backend.WgpuBackend()
    except UnsupportedError as exc:
        pytest.skip(f"no WebGPU adapter: {exc}")
    yield backend
    backend.close()


@pytest.fixture
def s(be):
    return be.new_stream()


def put(be, s, arr):
    arr = np.ascontiguousarray(arr)
    buf = be.alloc(arr.nbytes)
    be.copy_in(s, buf, arr.view(np.uint8).ravel())
    return buf


def get(be, s, buf, n=N, dtype=np.float32):
    done = be.copy_out(s, buf, n * np.dtype(dtype).itemsize)
    assert done.wait(10)
    return done.result().view(dtype)


def launch(be, s, prog, count, bufs, n=N, **params):
    kernel = prog.kernel
    be.launch(s, prog, count, [(b, n * 4) for b in bufs], kernel.pack_params(dict(params, n=n)))


def test_adapter_is_reported_by_name_and_backend_type(be):
    assert re.fullmatch(r".+ \[\w+, \w+\]", be.device_name), be.device_name
    assert be.device_name == wgpu_backend.describe(be.adapter)


def test_no_adapter_raises_unsupported_with_the_install_hint(monkeypatch):
    monkeypatch.setattr(wgpu_backend.wgpu.gpu, "enumerate_adapters_sync", lambda: [])
    with pytest.raises(UnsupportedError, match="apt-get install -y mesa-vulkan-drivers"):
        wgpu_backend.WgpuBackend()


def test_an_option_of_another_backend_is_a_type_error_naming_it():
    """USER5: ``runtime.client("wgpu", seed=1)`` (the cpu backend's option) was silently
    accepted and ignored, though ``runtime.client`` documents a TypeError for an option the
    backend does not take (cpu and cuda raise one)."""
    import runtime
    for opts in ({"seed": 1}, {"scheduler": "interleave", "threds": 2}):
        with pytest.raises(TypeError, match=r"wgpu backend takes no option '(seed|scheduler)'"):
            runtime.client("wgpu", **opts)


def test_a_kernel_without_wgsl_is_a_launch_error(be):
    cpu_only = Kernel("cpu_only", [Binding("y", "f32", "read_write")], cpu=lambda y, count: None)
    with pytest.raises(LaunchError, match="no WGSL"):
        be.compile(cpu_only)


def test_a_wgsl_compile_failure_carries_the_compiler_message(be):
    bad = Kernel("bad", [Binding("y", "f32", "read_write")], wgsl="fn main( {")
    with pytest.raises(LaunchError, match="(?s)kernel bad.*expected"):
        be.compile(bad)


def test_every_library_kernel_has_wgsl_that_compiles(be):
    kernels = library_kernels()
    assert "runtime.kernels.pointwise.add" in kernels
    missing = [name for name, k in kernels.items() if not k.wgsl]
    assert not missing, f"kernels without a WGSL source: {missing}"
    for name, kernel in kernels.items():
        assert be.compile(kernel).pipeline is not None, name


def test_a_write_after_a_launch_on_one_stream_lands_after_it(be, s):
    x = put(be, s, np.arange(N, dtype=np.float32))
    y = be.alloc(NB)
    launch(be, s, be.compile(K.add_scalar), K.grid(N), [x, y], alpha=1.0)
    assert s.tasks == 1          # still batched, not submitted: the pitfall is live
    be.copy_in(s, x, np.zeros(N, np.float32).view(np.uint8))
    np.testing.assert_array_equal(get(be, s, y), np.arange(N) + 1.0)
    np.testing.assert_array_equal(get(be, s, x), np.zeros(N))


def test_a_write_on_another_stream_does_not_overtake_pending_work(be, s):
    x = put(be, s, np.full(N, 2.0, np.float32))
    y = be.alloc(NB)
    launch(be, s, be.compile(K.mul_scalar), K.grid(N), [x, y], alpha=3.0)
    other = be.new_stream()
    be.copy_in(other, x, np.zeros(N, np.float32).view(np.uint8))
    np.testing.assert_array_equal(get(be, s, y), np.full(N, 6.0))


def test_launches_are_batched_and_submitted_at_max_tasks(be, s):
    y = put(be, s, np.zeros(N, np.float32))
    fill = be.compile(K.fill)
    before = be.submits
    for i in range(be.max_tasks * 2 + 3):
        launch(be, s, fill, K.grid(N), [y], value=float(i))
    assert be.submits - before == 2 and s.tasks == 3
    np.testing.assert_array_equal(get(be, s, y), np.full(N, be.max_tasks * 2 + 2.0))


def test_wait_event_submits_the_recording_streams_pending_work(be, s):
    x = put(be, s, np.ones(N, np.float32))
    launch(be, s, be.compile(K.fill), K.grid(N), [x], value=5.0)
    event = be.record_event(s)
    other = be.new_stream()
    be.wait_event(other, event)
    assert s.encoder is None     # submitted ahead of anything `other` submits later
    y = be.alloc(NB)
    launch(be, other, be.compile(K.copy), K.grid(N), [x, y])
    np.testing.assert_array_equal(get(be, other, y), np.full(N, 5.0))


def test_uniform_buffers_and_bind_groups_are_cached(be, s):
    x = put(be, s, np.ones(N, np.float32))
    y = be.alloc(NB)
    prog = be.compile(K.add_scalar)
    uniforms, groups = len(be._uniforms), len(be._groups)
    for _ in range(50):
        launch(be, s, prog, K.grid(N), [x, y], alpha=0.5)
    assert (len(be._uniforms), len(be._groups)) == (uniforms + 1, groups + 1)
    launch(be, s, prog, K.grid(N), [x, y], alpha=0.25)
    assert (len(be._uniforms), len(be._groups)) == (uniforms + 2, groups + 2)
    np.testing.assert_array_equal(get(be, s, y), np.full(N, 1.25))


def test_free_forgets_the_bind_groups_of_the_buffer(be, s):
    x, y = put(be, s, np.ones(N, np.float32)), be.alloc(NB)
    launch(be, s, be.compile(K.copy), K.grid(N), [x, y])
    be.synchronize(s)
    assert x in be._groups_of
    be.free(x)
    assert x not in be._groups_of
    assert not any(x in key for key in be._groups)


def test_odd_sized_copies_round_trip(be, s):
    data = np.arange(7, dtype=np.uint8)
    buf = be.alloc(7)
    be.copy_in(s, buf, data)
    np.testing.assert_array_equal(get(be, s, buf, 7, np.uint8), data)
    assert be.copy_out(s, buf, 0).result().size == 0


def test_allocation_past_max_buffer_size_is_out_of_memory(be):
    with pytest.raises(OutOfMemory, match="max-buffer-size"):
        be.alloc(be.limits["max-buffer-size"] + 4)


def test_the_backend_declares_its_per_dimension_workgroup_limit(be):
    """The client refuses counts past it (tests/contracts/test_policy.py)."""
    m = be.limits["max-compute-workgroups-per-dimension"]
    assert be.max_workgroups == (m, m, m)


def test_replay_is_one_submit_and_matches_numpy(be, s):
    x = put(be, s, np.ones(N, np.float32))
    y = put(be, s, np.zeros(N, np.float32))
    acc = be.compile(K.accumulate)
    graph = be.begin_graph(s)
    for _ in range(be.max_tasks * 3):       # well past the batching threshold
        be.record_launch(graph, acc, K.grid(N), [(x, NB), (y, NB)], acc.kernel.pack_params([N]))
    graph = be.end_graph(graph)
    assert s.encoder is None                # recording opened no encoder on the stream
    before = be.submits
    be.launch_graph(s, graph)
    assert be.submits - before == 1
    be.launch_graph(s, graph)
    np.testing.assert_array_equal(get(be, s, y), np.full(N, 2.0 * be.max_tasks * 3))


def test_replay_sets_the_pipeline_only_when_it_changes(be, s, monkeypatch):
    x, y = put(be, s, np.ones(N, np.float32)), put(be, s, np.zeros(N, np.float32))
    acc, scale = be.compile(K.accumulate), be.compile(K.mul_scalar)
    graph = be.begin_graph(s)
    for _ in range(4):
        be.record_launch(graph, acc, K.grid(N), [(x, NB), (y, NB)], (N,))
    for _ in range(3):
        be.record_launch(graph, scale, K.grid(N), [(x, NB), (y, NB)], (2.0, N))
    be.end_graph(graph)
    calls = []
    cls = type(be.dev.create_command_encoder().begin_compute_pass())
    real = cls.set_pipeline
    monkeypatch.setattr(cls, "set_pipeline", lambda self, p: (calls.append(p), real(self, p)))
    be.launch_graph(s, graph)
    assert calls == [acc.pipeline, scale.pipeline]
    np.testing.assert_array_equal(get(be, s, y), np.full(N, 2.0))


def test_a_write_after_a_replay_lands_after_it(be, s):
    x, y = put(be, s, np.full(N, 3.0, np.float32)), be.alloc(NB)
    graph = be.begin_graph(s)
    be.record_launch(graph, be.compile(K.copy), K.grid(N), [(x, NB), (y, NB)], (N,))
    be.launch_graph(s, be.end_graph(graph))
    be.copy_in(s, x, np.zeros(N, np.float32).view(np.uint8))
    np.testing.assert_array_equal(get(be, s, y), np.full(N, 3.0))


def test_indirect_dispatch_in_a_graph_reads_its_counts_at_replay(be, s):
    x, y = put(be, s, np.ones(N, np.float32)), put(be, s, np.zeros(N, np.float32))
    counts = put(be, s, np.array([1, 1, 1], np.uint32))
    acc = be.compile(K.accumulate)
    graph = be.begin_graph(s)
    be.record_launch(graph, acc, (counts, 12), [(x, NB), (y, NB)], (N,))
    graph = be.end_graph(graph)
    be.launch_graph(s, graph)                            # one workgroup: 64 elements
    expect = np.zeros(N)
    expect[:K.WORKGROUP] += 1
    np.testing.assert_array_equal(get(be, s, y), expect)
    be.copy_in(s, counts, np.array([4, 1, 1], np.uint32).view(np.uint8))
    be.launch_graph(s, graph)                            # the new counts: 256 elements
    expect[:4 * K.WORKGROUP] += 1
    np.testing.assert_array_equal(get(be, s, y), expect)


def test_an_indirect_count_buffer_under_12_bytes_is_a_launch_error(client):
    """Checked once in the client for every backend (no backend-only count checks)."""
    counts, y = client.create(np.zeros(2, np.uint32)), client.empty(N, np.float32)
    with pytest.raises(LaunchError, match="12 bytes"):
        client.launch(K.fill, counts, [y], {"value": 1.0, "n": N})


def test_destroying_a_graph_after_its_replay_keeps_the_replay_intact(be, s):
    x, y = put(be, s, np.full(N, 7.0, np.float32)), be.alloc(NB)
    graph = be.begin_graph(s)
    be.record_launch(graph, be.compile(K.copy), K.grid(N), [(x, NB), (y, NB)], (N,))
    graph = be.end_graph(graph)
    be.launch_graph(s, graph)
    be.destroy_graph(s, graph)
    del graph
    np.testing.assert_array_equal(get(be, s, y), np.full(N, 7.0))


def test_synchronize_returns_a_completion_the_caller_waits_on(be, s):
    y = be.alloc(NB)
    launch(be, s, be.compile(K.fill), K.grid(N), [y], value=1.0)
    done = be.synchronize(s)           # submitted, not waited for: the caller's thread waits
    assert s.encoder is None
    assert done.wait(10) and done.result() is None


# -- through the public client ---------------------------------------------------------------
@pytest.fixture
def client(be):
    import runtime
    c = runtime.client("wgpu")
    c.set_stream(runtime.StreamId.new())
    return c


def test_the_client_reports_the_adapter_it_got(client):
    assert re.fullmatch(r".+ \[\w+, \w+\]", client.device_name), client.device_name


def test_a_kernel_is_compiled_once_however_often_it_launches(client, monkeypatch):
    backend = client._server.backend
    compiled = []
    real = backend.compile
    monkeypatch.setitem(vars(backend), "compile", lambda k: (compiled.append(k), real(k))[1])
    twice = K.elementwise("twice", [("x", "f32", "read"), ("y", "f32", "read_write")], "2.0 * x[i]",
                          cpu=lambda x, y, *, n, count: None)
    x = client.create(np.arange(N, dtype=np.float32))
    y = client.empty((N,), np.float32)
    for _ in range(5):
        client.launch(twice, K.grid(N), [x, y], {"n": N})
    np.testing.assert_array_equal(client.read(y), 2.0 * np.arange(N))
    assert compiled == [twice]


def test_a_client_replay_is_one_submit_past_the_batching_threshold(client):
    backend = client._server.backend
    x = client.create(np.ones(N, np.float32))
    y = client.create(np.zeros(N, np.float32))
    launches = backend.max_tasks * 2 + 1
    client.graph_prepare()
    for _ in range(launches):
        client.launch(K.accumulate, K.grid(N), [x, y], {"n": N})
    client.read(y)
    client.start_capture()
    for _ in range(launches):
        client.launch(K.accumulate, K.grid(N), [x, y], {"n": N})
    graph = client.stop_capture()
    client.flush()
    before = backend.submits
    graph.replay()
    assert backend.submits - before == 1
    np.testing.assert_array_equal(client.read(y), np.full(N, 2.0 * launches))


def test_an_indirect_launch_through_the_client_replays_with_new_counts(client):
    x = client.create(np.ones(N, np.float32))
    y = client.create(np.zeros(N, np.float32))
    counts = client.create(np.array([2, 1, 1], np.uint32))
    client.graph_prepare()
    client.launch(K.accumulate, counts, [x, y], {"n": N})
    client.read(y)
    client.start_capture()
    client.launch(K.accumulate, counts, [x, y], {"n": N})
    graph = client.stop_capture()
    client.write(counts, np.array([16, 1, 1], np.uint32))
    graph.replay()
    expect = np.zeros(N)
    expect[:2 * K.WORKGROUP] += 1
    expect[:min(N, 16 * K.WORKGROUP)] += 1
    np.testing.assert_array_equal(client.read(y), expect)


_PLUS_WGSL = """@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(1) fn main() {{ y[0] = x[0] + {k}.0; }}"""


def _live(kind: str) -> int:
    import gc
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__ == kind)


def test_per_request_kernels_keep_at_most_the_servers_programs_compiled(monkeypatch):
    """A service making a Kernel per request (a templated source): the server keeps
    MAX_PROGRAMS compiled programs, and the bind-group cache no longer keeps the pipelines of
    the ones it dropped alive (before: up to 4,096 pipelines, ~75 KB each on lavapipe; RSS grew
    ~50 KB per request past the program bound). ADV3"""
    import runtime
    from runtime.server.server import ComputeServer
    monkeypatch.setattr(ComputeServer, "MAX_PROGRAMS", 8)
    try:
        c = runtime.client("wgpu", max_idle_bytes=(1 << 30) + 5)   # a server of its own
    except UnsupportedError as exc:
        pytest.skip(str(exc))
    try:
        x = c.create(np.ones(4, np.float32))
        y = c.create(np.zeros(4, np.float32))
        before = _live("GPUComputePipeline")
        for k in range(40):
            kern = Kernel(f"plus{k}", [Binding("x", "f32", "read"), Binding("y", "f32", "read_write")],
                          workgroup_size=(1, 1, 1), wgsl=_PLUS_WGSL.format(k=k))
            c.launch(kern, 1, [x, y])
            np.testing.assert_array_equal(c.read(y), [1 + k, 0, 0, 0])
        del kern
        assert _live("GPUComputePipeline") - before <= 8 + 2
        assert len(c._server.programs) == 8
    finally:
        c.shutdown()


def test_a_long_lived_buffer_bound_with_per_request_buffers_keeps_a_bounded_index(be, s):
    """A weight bound with a fresh buffer per request (then freed): the bind group of each is
    dropped with the freed buffer, and so is its key in the weight's index (before, the
    weight's list kept a key per request for ever while the cache stayed small). ADV3"""
    prog = be.compile(K.add_scalar)
    w = be.alloc(NB)
    for i in range(50):
        out = be.alloc(NB + 4 * i)               # a new buffer per request
        be.launch(s, prog, (1, 1, 1), [(w, NB), (out, NB)], (1.0, N))
        be.free(out)
    assert be.synchronize(s).wait(10)
    assert len(be._groups_of.get(w, ())) <= 1
    assert len(be._groups_by.get(prog, ())) <= 1
    be.free(w)
