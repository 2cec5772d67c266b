"""The server's policies against a fake backend that records every device verb (CubeCL's
dummy server; tinygrad's null backend): no device needed, and the hardware-graph path of the
server is exercised on a machine without a GPU."""

import numpy as np
import pytest

from runtime import kernels as K
from runtime.backends.base import Backend, Completion
from runtime import ComputeClient, StreamId
from runtime.errors import CaptureRefused
from runtime.server import ComputeServer


class FakeBackend(Backend):
    """Records ``(verb, ...)`` tuples; buffers are bytearrays; nothing executes."""

    name = "fake"

    def __init__(self, hardware=False):
        super().__init__(0)
        self.hardware_graphs = hardware
        self.calls = []
        self.nstreams = 0

    def alloc(self, nbytes):
        self.calls.append(("alloc", nbytes))
        return bytearray(nbytes)

    def free(self, buf):
        self.calls.append(("free",))

    def new_stream(self):
        self.nstreams += 1
        return f"s{self.nstreams}"

    def record_event(self, stream):
        self.calls.append(("record_event", stream))
        return ("ev", stream)

    def wait_event(self, stream, event):
        self.calls.append(("wait_event", stream, event))

    def synchronize(self, stream):
        self.calls.append(("synchronize", stream))
        return Completion.ready()

    def copy_in(self, stream, buf, data):
        self.calls.append(("copy_in", stream))

    def copy_out(self, stream, buf, nbytes):
        self.calls.append(("copy_out", stream))
        return Completion.ready(np.zeros(nbytes, np.uint8))

    def compile(self, kernel):
        self.calls.append(("compile", kernel.name))
        return kernel.name

    def launch(self, stream, program, count, args, params, mark=None):
        self.calls.append(("launch", stream, program))

    def begin_graph(self, stream):
        self.calls.append(("begin_graph", stream))
        return []

    def record_launch(self, recording, program, count, args, params):
        recording.append(program)

    def end_graph(self, recording):
        self.calls.append(("end_graph", tuple(recording)))
        return tuple(recording)

    def launch_graph(self, stream, graph, mark=None):
        self.calls.append(("launch_graph", stream, graph))

    def destroy_graph(self, stream, graph):
        self.calls.append(("destroy_graph", stream, graph))


@pytest.fixture
def fake():
    backend = FakeBackend()
    srv = ComputeServer(backend, "runtime-fake:0")
    c = ComputeClient(srv, "fake", 0)
    c.set_stream(StreamId.new())
    yield backend, c
    srv.shutdown()


def verbs(backend, *names):
    return [c for c in backend.calls if c[0] in names]


def test_each_kernel_compiles_once(fake):
    backend, c = fake
    h = c.create(np.zeros(4, np.float32))
    for _ in range(5):
        c.launch(K.fill, 1, [h], {"value": 1.0, "n": 4})
    c.sync()
    assert verbs(backend, "compile") == [("compile", "fill")]
    assert len(verbs(backend, "launch")) == 5


def test_same_stream_work_needs_no_events(fake):
    backend, c = fake
    x = c.create(np.zeros(4, np.float32))
    y = c.empty(4, np.float32)
    c.launch(K.copy, 1, [x, y], {"n": 4})
    c.read(y)
    assert verbs(backend, "record_event", "wait_event") == []


def test_cross_stream_use_waits_on_one_event_once(fake):
    backend, c = fake
    other = c.with_stream(StreamId.new())
    x = c.create(np.zeros(4, np.float32))
    y = other.empty(4, np.float32)
    other.launch(K.copy, 1, [x, y], {"n": 4})
    other.launch(K.copy, 1, [x, y], {"n": 4})          # already synced: no second wait
    c.sync()
    ev = verbs(backend, "record_event", "wait_event")
    assert [e[0] for e in ev] == ["record_event", "wait_event"]
    assert ev[1][1] != ev[0][1]                         # the other stream waits on c's event


def test_the_window_records_launches_and_replay_is_one_launch_graph(fake):
    backend, c = fake
    x = c.create(np.zeros(4, np.float32))
    c.graph_prepare()
    c.start_capture()
    c.launch(K.fill, 1, [x], {"value": 1.0, "n": 4})
    c.launch(K.fill, 1, [x], {"value": 2.0, "n": 4})
    g = c.stop_capture()
    n_launch = len(verbs(backend, "launch"))
    g.replay()
    g.replay()
    assert len(verbs(backend, "launch")) == n_launch    # replays launch no kernels one by one
    assert [v[0] for v in verbs(backend, "launch_graph")] == ["launch_graph"] * 2
    assert verbs(backend, "end_graph") == [("end_graph", ("fill", "fill"))]
    del g
    c.sync()
    assert len(verbs(backend, "destroy_graph")) == 1


def test_a_graph_destroyed_while_its_stream_captures_waits_for_the_window_to_end(fake):
    """No event may be recorded on a capturing stream: the server holds the graph (once for
    every backend; it was cuda's graveyard)."""
    backend, c = fake
    x = c.create(np.zeros(4, np.float32))
    c.graph_prepare()
    c.start_capture()
    c.launch(K.fill, 1, [x], {"value": 1.0, "n": 4})
    g = c.stop_capture()
    c.graph_prepare()
    c.start_capture()
    g.release()
    c.memory_usage()                                 # the destroy message ran
    assert verbs(backend, "destroy_graph") == []
    c.stop_capture().release()
    c.memory_usage()
    assert len(verbs(backend, "destroy_graph")) == 2  # the held one, then the empty window's


def test_a_hardware_graph_refuses_a_window_that_grew_the_pool():
    backend = FakeBackend(hardware=True)
    srv = ComputeServer(backend, "runtime-fake-hw:0")
    c = ComputeClient(srv, "fake", 0)
    c.set_stream(StreamId.new())
    try:
        x = c.create(np.zeros(4, np.float32))
        c.graph_prepare()
        tmp = c.empty(4, np.float32)                    # warm-up allocates and frees ...
        c.launch(K.copy, 1, [x, tmp], {"n": 4})
        del tmp
        c.start_capture()
        tmp = c.empty(4, np.float32)                    # ... so this is served by the pool
        c.launch(K.copy, 1, [x, tmp], {"n": 4})
        g = c.stop_capture()
        assert g.is_hardware
        c.graph_prepare()
        c.start_capture()
        big = c.empty(3_145_733)                        # a size the pool never saw
        with pytest.raises(CaptureRefused, match="grew the pool"):
            c.stop_capture()
        del big, g
    finally:
        srv.shutdown()
