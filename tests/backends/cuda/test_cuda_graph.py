"""cuda conditional nodes and kernel-node updates (``runtime.backends.cuda_graph``, issue 27).

No device needed (these run wherever CuPy and cuda-bindings import): the gate kernel compiles
with NVRTC, the version gate (a faked driver version) and its ``UnsupportedError`` at capture,
the cuda-bindings parameter structs (read back through ctypes), the order of driver calls that
records IF/else/WHILE nodes nested to depth 2 (over a recording stand-in for the driver), the
update path and its fallbacks, and the loop-limit report. Device tests skip with the driver's
reason; the shared contracts (``tests/contracts/test_conditionals.py``,
``test_graph_update.py``) run on cuda in ``benchmarks/device_check.sh``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import runtime
from helpers import backend_module_or_skip
from runtime.errors import LoopLimitExceeded, UnsupportedError
from runtime.kernel import DTYPES

cuda_backend = backend_module_or_skip("cuda", "bash setup.sh --test installs cupy-cuda12x")
from runtime.backends import cuda_graph  # noqa: E402 - only after the skip above

needs_bindings = pytest.mark.skipif(
    cuda_graph.drv is None, reason=f"cuda-bindings is not importable: {cuda_graph.BINDINGS_MISSING}"
    " (bash setup.sh --test installs it)")
try:
    cuda_backend.CudaBackend.probe()
    NO_DEVICE = None
except UnsupportedError as _e:
    NO_DEVICE = str(_e)
needs_device = pytest.mark.skipif(NO_DEVICE is not None, reason=f"no CUDA device: {NO_DEVICE}")


# -- NVRTC ------------------------------------------------------------------------------------
def test_the_gate_kernel_compiles_with_nvrtc_and_calls_set_conditional():
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(cuda_graph.GATE_SOURCE, "gate.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=compute_70"])
        ptx = nvrtc.getPTX(prog)
    except Exception as e:  # noqa: BLE001 - NVRTC's log says what is wrong
        pytest.fail(f"{type(e).__name__}: {e}\n{nvrtc.getProgramLog(prog)}")
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert f".entry {cuda_graph.GATE_NAME}(" in ptx
    # the device-runtime builtin stays an external call the driver resolves at load
    assert ".extern .func cudaGraphSetConditional" in ptx and "call.uni" in ptx


# -- the version gate -------------------------------------------------------------------------
@pytest.mark.parametrize("version, expect", [
    (12040, None), (12080, None), (13000, None),
    (12030, "driver is 12.3; conditional graph nodes need 12.4"),
    (11080, "driver is 11.8"),
    (None, "no CUDA driver answers")])
def test_support_reason_follows_the_driver_version(version, expect):
    got = cuda_graph.support_reason(version)
    assert got == expect if expect is None else expect in got


def test_support_reason_names_hip_and_missing_bindings():
    assert "HIP" in cuda_graph.support_reason(12040, hip=True)
    got = cuda_graph.support_reason(12040, bindings_missing="ImportError: no module cuda")
    assert "cuda-bindings" in got and "pip install" in got and "no module cuda" in got


class _Stream:
    def __init__(self, ptr):
        self.ptr = ptr

    def __repr__(self):
        return f"s{self.ptr:x}"


class _Buf:
    def __init__(self, ptr):
        self.ptr = ptr


@pytest.fixture
def fake_be(monkeypatch):
    """A CudaBackend with no device: fake streams, scratch and gate; the bookkeeping only."""
    monkeypatch.setattr(cuda_backend._rt, "getDevice", lambda: 0)
    be = cuda_backend.CudaBackend.__new__(cuda_backend.CudaBackend)
    be.device, be._streams, be.closed = 0, [], False
    be._graph_tools()
    be.log = []
    be._bodies = [_Stream(0xB2), _Stream(0xB1), _Stream(0xB0)]      # the free list
    scratch = iter(range(0x5000, 0x6000, 0x10))
    monkeypatch.setitem(vars(be), "alloc", lambda n: _Buf(next(scratch)))

    def gate(grid, block, args, stream=None):
        be.log.append(("gate", stream.ptr, int(args[4]), int(args[3]), int(args[2]),
                       int(args[1])))
    monkeypatch.setitem(vars(be), "_compile_gate", lambda: gate)
    be._conds = cuda_graph.Conditionals(be, be._compile_gate)
    return be


@pytest.mark.parametrize("version", [12030, None])
def test_an_old_or_missing_driver_raises_unsupported_at_capture_and_records_nothing(
        fake_be, monkeypatch, version):
    monkeypatch.setattr(cuda_graph, "driver_version", lambda: version)
    rec = cuda_backend.CudaRecording(cuda_backend.CudaStream(_Stream(0xA0)))
    for kind in ("if", "while"):
        with pytest.raises(UnsupportedError, match=f"capture_{kind} inside a capture on cuda: "
                           + ("the CUDA driver is 12.3" if version else "no CUDA driver")):
            fake_be.begin_cond(rec, kind, (_Buf(0x100), 4), 3)
    assert rec.frames == [] and rec.conds == 0 and rec.keep == [] and fake_be.log == []


def test_this_machine_without_a_driver_raises_unsupported_at_capture(fake_be):
    """The real gate on this machine (no GPU): whatever it lacks is named, nothing recorded."""
    reason = cuda_graph.support_reason(cuda_graph.driver_version(), False,
                                       cuda_graph.BINDINGS_MISSING)
    if reason is None:
        pytest.skip("this machine has a CUDA 12.4+ driver: conditional nodes are supported")
    rec = cuda_backend.CudaRecording(cuda_backend.CudaStream(_Stream(0xA0)))
    with pytest.raises(UnsupportedError, match="capture_while inside a capture on cuda"):
        fake_be.begin_cond(rec, "while", (_Buf(0x100), 4), None)
    assert rec.frames == [] and rec.conds == 0


# -- the parameter structs --------------------------------------------------------------------
@needs_bindings
def test_the_conditional_node_params_struct():
    d = cuda_graph.drv
    p = cuda_graph.node_params(d.CUgraphConditionalHandle(9),
                               d.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE,
                               d.CUcontext(0x77))
    assert p.type == d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    assert int(p.conditional.handle) == 9 and p.conditional.size == 1
    assert p.conditional.type == d.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
    assert int(p.conditional.ctx) == 0x77


class _Function:
    ptr = 0xF00D


class _Program:
    """A ``CudaProgram`` stand-in: function pointer, block and param types."""

    def __init__(self, param_types=(np.float32, np.int32, np.uint32)):
        self.function, self.block, self.param_types = _Function(), (64, 2, 1), param_types


@needs_bindings
def test_the_kernel_node_params_struct_packs_the_launch_as_the_launch_does():
    kp = cuda_graph.kernel_params(_Program(), (3, 2, 1), [(_Buf(0xAB000), 16), (_Buf(0xCD000), 8)],
                                  (1.5, -7, 4000000000))
    assert int(kp.func) == 0xF00D
    assert (kp.gridDimX, kp.gridDimY, kp.gridDimZ) == (3, 2, 1)
    assert (kp.blockDimX, kp.blockDimY, kp.blockDimZ) == (64, 2, 1) and kp.sharedMemBytes == 0
    argv = ctypes.cast(int(kp.kernelParams), ctypes.POINTER(ctypes.c_void_p))
    vals = [ctypes.cast(argv[0], ctypes.POINTER(ctypes.c_uint64))[0],
            ctypes.cast(argv[1], ctypes.POINTER(ctypes.c_uint64))[0],
            ctypes.cast(argv[2], ctypes.POINTER(ctypes.c_float))[0],
            ctypes.cast(argv[3], ctypes.POINTER(ctypes.c_int32))[0],
            ctypes.cast(argv[4], ctypes.POINTER(ctypes.c_uint32))[0]]
    assert vals == [0xAB000, 0xCD000, 1.5, -7, 4000000000]
    # the same C types the eager launch packs (cuda.kernel_args)
    assert [type(v) for v in cuda_backend.kernel_args(
        [(_Buf(1), 4)], (1.5, -7, 4), _Program().param_types)] == [
            np.uint64, np.float32, np.int32, np.uint32]
    assert set(cuda_graph._PARAM_CTYPES) == {DTYPES[n].type for n in ("f32", "i32", "u32")}


# -- the driver calls that record conditional nodes ---------------------------------------------
class _FakeDriver:
    """Stands in for ``cuda.bindings.driver``: the real structs and enums, recorded calls."""

    def __init__(self, log):
        self._d, self.log = cuda_graph.drv, log
        self.handles = 0
        self.nodes = 100

    def __getattr__(self, name):
        return getattr(self._d, name)

    def _ok(self, *out):
        return (self._d.CUresult.CUDA_SUCCESS, *out)

    def cuStreamGetCaptureInfo(self, stream):
        d = self._d
        return self._ok(d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE, 1,
                        d.CUgraph(int(stream)), [d.CUgraphNode(self.nodes)], 1)

    def cuCtxGetCurrent(self):
        self.log.append(("ctx", "current"))
        return self._ok(self._d.CUcontext(0xC0))

    def cuStreamGetCtx(self, stream):
        self.log.append(("ctx", int(stream)))
        return self._ok(self._d.CUcontext(0xC0))

    def cuGraphConditionalHandleCreate(self, graph, ctx, default, flags):
        self.handles += 1
        self.log.append(("handle", int(graph), self.handles))
        return self._ok(self._d.CUgraphConditionalHandle(self.handles))

    def cuGraphAddNode(self, graph, deps, ndeps, params):
        self.nodes += 1
        kind = params.conditional.type.name.rsplit("_", 1)[1]
        self.log.append(("node", int(graph), kind, int(params.conditional.handle),
                         params.conditional.size, int(params.conditional.ctx), ndeps))
        return self._ok(self._d.CUgraphNode(self.nodes))

    def cuStreamUpdateCaptureDependencies(self, stream, deps, n, flags):
        self.log.append(("deps", int(stream), [int(x) for x in deps], flags.name))
        return self._ok()

    def cuStreamBeginCaptureToGraph(self, stream, graph, deps, data, n, mode):
        self.log.append(("begin", int(stream), mode.name))
        return self._ok()

    def cuGraphAddEmptyNode(self, graph, deps, ndeps):
        self.nodes += 1
        self.log.append(("empty", int(graph), ndeps))
        return self._ok(self._d.CUgraphNode(self.nodes))

    def cuStreamEndCapture(self, stream):
        self.log.append(("end", int(stream)))
        return self._ok(self._d.CUgraph(0))


class _Kernel:
    def __init__(self, log):
        self.log = log

    def __call__(self, grid, block, args, stream=None):
        self.log.append(("launch", stream.ptr))


@needs_bindings
@pytest.mark.parametrize("version", [12040, 12050])
def test_if_else_nested_in_a_while_records_gates_nodes_and_body_captures_in_order(
        fake_be, monkeypatch, version):
    monkeypatch.setattr(cuda_graph, "driver_version", lambda: version)
    fake = _FakeDriver(fake_be.log)
    monkeypatch.setattr(cuda_graph, "drv", fake)
    prog = _Program(())
    prog.function = _Kernel(fake_be.log)
    rec = cuda_backend.CudaRecording(cuda_backend.CudaStream(_Stream(0xA0)))
    fake_be._track_nodes = False
    cond, flag = (_Buf(0x100), 4), (_Buf(0x200), 4)

    def launch():
        fake_be.record_launch(rec, prog, (1, 1, 1), [], ())
    launch()                                              # top level
    fake_be.begin_cond(rec, "while", cond, 5)
    launch()                                              # in the loop body
    fake_be.begin_cond(rec, "if", flag, None)
    launch()                                              # then
    fake_be.else_cond(rec)
    launch()                                              # else
    fake_be.end_cond(rec)
    fake_be.end_cond(rec)

    def ctx(stream):     # drivers before 12.5 cannot name a capturing stream's context
        return ("ctx", stream) if version >= 12050 else ("ctx", "current")
    loop, branch = 0x5000, 0x5010                         # the two nodes' scratch words
    big = cuda_graph.DEFAULT_MAX_ITERATIONS
    assert fake_be.log == [
        ("launch", 0xA0),
        ctx(0xA0), ("handle", 0xA0, 1), ("gate", 0xA0, cuda_graph.WHILE_ENTER, 5, loop, 0x100),
        ("node", 0xA0, "WHILE", 1, 1, 0xC0, 1),
        ("deps", 0xA0, [101], "CU_STREAM_SET_CAPTURE_DEPENDENCIES"),
        ("begin", 0xB0, "CU_STREAM_CAPTURE_MODE_RELAXED"),
        ("launch", 0xB0),
        ctx(0xB0), ("handle", 0xB0, 2), ("gate", 0xB0, cuda_graph.IF_ENTER, big, branch, 0x200),
        ("node", 0xB0, "IF", 2, 1, 0xC0, 1),
        ("deps", 0xB0, [102], "CU_STREAM_SET_CAPTURE_DEPENDENCIES"),
        ("begin", 0xB1, "CU_STREAM_CAPTURE_MODE_RELAXED"),
        ("launch", 0xB1),
        ("end", 0xB1),                                    # else: a second IF node whose gate
        ctx(0xB0), ("handle", 0xB0, 3),                   # reads the value the first one saved
        ("gate", 0xB0, cuda_graph.ELSE_ENTER, big, branch, 0x200),
        ("node", 0xB0, "IF", 3, 1, 0xC0, 1),
        ("deps", 0xB0, [103], "CU_STREAM_SET_CAPTURE_DEPENDENCIES"),
        ("begin", 0xB1, "CU_STREAM_CAPTURE_MODE_RELAXED"),
        ("launch", 0xB1),
        ("end", 0xB1),
        ("gate", 0xB0, cuda_graph.WHILE_NEXT, 5, loop, 0x100),   # the loop's test, then its end
        ("end", 0xB0)]
    assert rec.frames == [] and rec.conds == 2 and rec.launches == 4
    (index, limit, scratch), = rec.checks                 # one WHILE node checked per replay
    assert (index, limit, scratch.ptr) == (0, 5, loop) and len(rec.keep) == 2
    assert rec.nodes == [None, None, None, None]          # body launches: no node of their own
    assert sorted(s.ptr for s in fake_be._bodies) == [0xB0, 0xB1, 0xB2]   # all given back


@needs_bindings
def test_an_if_body_that_records_nothing_gets_an_empty_node(fake_be, monkeypatch):
    """Drivers before 12.8 hang on a conditional node whose body graph is empty."""
    monkeypatch.setattr(cuda_graph, "driver_version", lambda: 12040)
    monkeypatch.setattr(cuda_graph, "drv", _FakeDriver(fake_be.log))
    prog = _Program(())
    prog.function = _Kernel(fake_be.log)
    rec = cuda_backend.CudaRecording(cuda_backend.CudaStream(_Stream(0xA0)))
    fake_be._track_nodes = False
    fake_be.begin_cond(rec, "if", (_Buf(0x100), 4), None)
    fake_be.record_launch(rec, prog, (0, 1, 1), [], ())     # a zero count: no node
    fake_be.else_cond(rec)
    fake_be.record_launch(rec, prog, (1, 1, 1), [], ())
    fake_be.end_cond(rec)
    fake_be.begin_cond(rec, "if", (_Buf(0x100), 4), None)   # a then holding only a node
    fake_be.begin_cond(rec, "if", (_Buf(0x100), 4), None)   # (itself empty)
    fake_be.end_cond(rec)
    fake_be.end_cond(rec)
    bodies = [e for e in fake_be.log if e[0] in ("begin", "launch", "empty", "end")]
    assert bodies == [("begin", 0xB0, "CU_STREAM_CAPTURE_MODE_RELAXED"),
                      ("empty", 0xB0, 1), ("end", 0xB0),                  # the empty then
                      ("begin", 0xB0, "CU_STREAM_CAPTURE_MODE_RELAXED"),
                      ("launch", 0xB0), ("end", 0xB0),                    # the else: a kernel
                      ("begin", 0xB0, "CU_STREAM_CAPTURE_MODE_RELAXED"),
                      ("begin", 0xB1, "CU_STREAM_CAPTURE_MODE_RELAXED"),
                      ("empty", 0xB1, 1), ("end", 0xB1),                  # the inner node
                      ("end", 0xB0)]                                      # the outer: not empty


@needs_bindings
def test_windows_on_two_streams_capture_their_bodies_on_their_own_body_streams(
        fake_be, monkeypatch):
    monkeypatch.setattr(cuda_graph, "driver_version", lambda: 12040)
    monkeypatch.setattr(cuda_graph, "drv", _FakeDriver(fake_be.log))
    r1 = cuda_backend.CudaRecording(cuda_backend.CudaStream(_Stream(0xA0)))
    r2 = cuda_backend.CudaRecording(cuda_backend.CudaStream(_Stream(0xA1)))
    fake_be.begin_cond(r1, "while", (_Buf(0x100), 4), 2)
    fake_be.begin_cond(r2, "if", (_Buf(0x100), 4), None)
    assert r1.frames[0].stream is not r2.frames[0].stream
    fake_be.end_cond(r1)
    fake_be.begin_cond(r1, "if", (_Buf(0x100), 4), None)   # reuses the stream r1 gave back
    assert r1.frames[0].stream.ptr == 0xB0 and r2.frames[0].stream.ptr == 0xB1


@needs_bindings
def test_an_aborted_window_ends_the_open_body_captures(fake_be, monkeypatch):
    monkeypatch.setattr(cuda_graph, "driver_version", lambda: 12040)
    monkeypatch.setattr(cuda_graph, "drv", _FakeDriver(fake_be.log))
    cs = cuda_backend.CudaStream(_Stream(0xA0))
    ended = []
    cs.stream.end_capture = lambda: ended.append(True)
    rec = cuda_backend.CudaRecording(cs)
    fake_be.begin_cond(rec, "while", (_Buf(0x100), 4), 2)
    fake_be.begin_cond(rec, "if", (_Buf(0x100), 4), None)
    fake_be.abort_graph(rec)
    assert [e for e in fake_be.log if e[0] == "end"] == [("end", 0xB1), ("end", 0xB0)]
    assert rec.frames == [] and ended == [True]


# -- kernel-node updates ------------------------------------------------------------------------
class _Exec:
    graphExec = 0xE0


class _SetParams(_FakeDriver):
    def __init__(self, log, fail=False):
        super().__init__(log)
        self.fail = fail

    def cuGraphExecKernelNodeSetParams(self, exec_graph, node, kp):
        self.log.append(("set", int(exec_graph), int(node), kp.gridDimX))
        if self.fail:
            return (self._d.CUresult.CUDA_ERROR_INVALID_VALUE,)
        return self._ok()


@needs_bindings
def test_update_patches_the_kernel_nodes_in_place(monkeypatch):
    log = []
    monkeypatch.setattr(cuda_graph, "drv", _SetParams(log))
    d = cuda_graph.drv._d
    g = cuda_graph.CudaGraph(_Exec(), [d.CUgraphNode(11), None, d.CUgraphNode(13)], [], [])
    change = (_Program(()), (4, 1, 1), [(_Buf(0x10), 4)], ())
    assert cuda_graph.update_in_place(g, {0: change, 2: change}, {}) is None
    assert log == [("set", 0xE0, 11, 4), ("set", 0xE0, 13, 4)]


@needs_bindings
@pytest.mark.parametrize("case, why", [
    ("body", "launch 1 has no kernel node"), ("zero", "launches nothing"),
    ("cond", "condition buffer changed"), ("fail", "CUDA_ERROR_INVALID_VALUE")])
def test_update_says_why_it_falls_back_and_patches_nothing_it_can_refuse(monkeypatch, case, why):
    log = []
    monkeypatch.setattr(cuda_graph, "drv", _SetParams(log, fail=case == "fail"))
    d = cuda_graph.drv._d
    g = cuda_graph.CudaGraph(_Exec(), [d.CUgraphNode(11), None], [], [])
    ok = (_Program(()), (4, 1, 1), [], ())
    changes = {0: ok, 1: ok} if case == "body" else {0: (_Program(()), (0, 1, 1), [], ())} \
        if case == "zero" else {0: ok}
    got = cuda_graph.update_in_place(g, changes, {0: (_Buf(1), 4)} if case == "cond" else {})
    assert got is not None and why in got and "recaptured" in got
    assert log == ([("set", 0xE0, 11, 4)] if case == "fail" else [])   # all checked first


def test_update_without_bindings_falls_back_and_says_so(monkeypatch, fake_be):
    monkeypatch.setattr(cuda_graph, "drv", None)
    monkeypatch.setattr(cuda_graph, "BINDINGS_MISSING", "ImportError: no cuda.bindings")
    g = cuda_graph.CudaGraph(_Exec(), [object()], [], [])
    assert fake_be.update_graph(None, g, {0: (_Program(()), (1, 1, 1), [], ())}, {}) is None
    assert "cuda-bindings is not importable: ImportError" in fake_be.update_fallback_reason


# -- the loop limit ------------------------------------------------------------------------------
class _Event:
    def __init__(self, done):
        self.done = done


class _Mark:
    def __init__(self):
        self.failed = None

    def fail(self, err):
        self.failed = err
        return err


def test_a_loop_past_its_limit_fails_the_mark_and_the_streams_next_completion(fake_be):
    cs, other = cuda_backend.CudaStream(_Stream(1)), cuda_backend.CudaStream(_Stream(2))
    g = cuda_graph.CudaGraph(_Exec(), [], [(0, 7, None), (1, 3, None)], [])
    mark, pending_mark, clean_mark = _Mark(), _Mark(), _Mark()
    fake_be._loops.add(_Event(True), np.array([0, 1], np.uint32), g, mark, cs)
    fake_be._loops.add(_Event(False), np.array([1, 0], np.uint32), g, pending_mark, cs)
    fake_be._loops.add(_Event(True), np.array([0, 0], np.uint32), g, clean_mark, other)
    comp = cuda_backend.EventCompletion(_Event(True), lambda: "value",
                                        fake_be._check_of(other))
    assert comp.wait(1.0) and comp.result() == "value"     # the clean replay's stream
    assert isinstance(mark.failed, LoopLimitExceeded)      # settled by any completion
    assert "node 1" in str(mark.failed) and "max_iterations=3" in str(mark.failed)
    assert pending_mark.failed is None and clean_mark.failed is None
    comp = cuda_backend.EventCompletion(_Event(True), lambda: "value", fake_be._check_of(cs))
    assert comp.wait(1.0)
    with pytest.raises(LoopLimitExceeded, match="node 1"):
        comp.result()
    assert len(fake_be._loops._pending) == 1               # the replay still in flight


class _Scratch:
    """A scratch ``MemoryPointer`` stand-in recording stream-ordered copies and memsets."""

    def __init__(self, ptr, log):
        self.ptr, self.log = ptr, log

    def __add__(self, off):
        return _Scratch(self.ptr + off, self.log)

    def copy_to_host_async(self, dst, n, stream):
        self.log.append(("d2h", self.ptr, dst, n, stream.ptr))

    def memset_async(self, value, n, stream):
        self.log.append(("memset", self.ptr, value, n, stream.ptr))


def test_end_graph_zeroes_the_scratch_and_a_replay_copies_out_then_zeroes_the_over_words(
        fake_be, monkeypatch):
    log = []
    cs = cuda_backend.CudaStream(_Stream(0xA0))
    launched = []

    class _CupyGraph:
        graph = 0xC4                           # the captured cudaGraph_t, kept by CuPy

        def upload(self, stream):
            pass

        def launch(self, stream):
            launched.append(stream.ptr)
    cs.stream.end_capture = lambda: _CupyGraph()
    rec = cuda_backend.CudaRecording(cs)
    s1, s2 = _Scratch(0x5000, log), _Scratch(0x6000, log)
    rec.keep, rec.checks, rec.conds, rec.nodes = [s1, s2], [(0, 4, s1), (1, 9, s2)], 2, ["n0"]
    g = fake_be.end_graph(rec)
    assert isinstance(g, cuda_graph.CudaGraph) and g.checks == rec.checks
    assert g.nodes == ["n0"]
    assert log == [("memset", 0x5000, 0, 8, 0xA0), ("memset", 0x6000, 0, 8, 0xA0)]
    log.clear()

    class _Pinned(bytearray):
        ptr = 0x9000
    pinned = _Pinned(8)
    monkeypatch.setattr(fake_be, "_staging", lambda n: (pinned, None))
    ev = _Event(False)
    monkeypatch.setattr(fake_be, "_event", lambda stream: ev)
    mark = _Mark()
    fake_be.launch_graph(cs, g, mark)
    assert launched == [0xA0]
    assert log == [("d2h", 0x5004, 0x9000, 4, 0xA0), ("memset", 0x5004, 0, 4, 0xA0),
                   ("d2h", 0x6004, 0x9004, 4, 0xA0), ("memset", 0x6004, 0, 4, 0xA0)]
    assert cs.retire[-1] == (ev, pinned)                   # the pinned words outlive the copy
    pinned[4] = 1                                          # node 1 ran past its 9 iterations
    fake_be._loops.settle()
    assert mark.failed is None                             # not before the replay's event
    ev.done = True
    fake_be._loops.settle()
    assert isinstance(mark.failed, LoopLimitExceeded) and "max_iterations=9" in str(mark.failed)
    assert list(cs.errors) == [mark.failed] and not fake_be._loops


def test_no_nodes_are_kept_when_cupy_released_the_captured_graph(fake_be):
    """A node of a destroyed cudaGraph_t must never reach cuGraphExecKernelNodeSetParams."""
    cs = cuda_backend.CudaStream(_Stream(0xA0))

    class _Instance:                          # graph = 0: CuPy kept only the graphExec
        graph, graphExec = 0, 0xE0

        def upload(self, stream):
            pass
    cs.stream.end_capture = lambda: _Instance()
    rec = cuda_backend.CudaRecording(cs)
    rec.launches, rec.nodes = 2, ["n0", "n1"]
    g = fake_be.end_graph(rec)
    assert g.nodes == [None, None]
    why = cuda_graph.update_in_place(g, {1: (_Program(()), (1, 1, 1), [], ())}, {})
    if cuda_graph.drv is not None:
        assert "CuPy released the captured graph" in why


def test_completions_need_no_check_without_loops(fake_be):
    assert fake_be._check_of(cuda_backend.CudaStream(_Stream(1))) is None


# -- on a device ---------------------------------------------------------------------------------
@needs_device
def test_on_a_device_an_update_patches_the_kernel_node_in_place():
    """(Values of conditionals and updates on cuda: tests/contracts, in device_check.sh.)"""
    reason = cuda_graph.support_reason(cuda_graph.driver_version(), False,
                                       cuda_graph.BINDINGS_MISSING)
    if reason is not None:
        pytest.skip(f"kernel nodes are not tracked here: {reason}")
    from helpers import add_one
    c = runtime.client("cuda")
    x, y = c.create(np.arange(4, dtype=np.float32)), c.empty(4, np.float32)
    x2, y2 = c.create(np.full(4, 5, np.float32)), c.empty(4, np.float32)
    c.graph_prepare()
    add_one(c, x, y)
    c.start_capture()
    add_one(c, x, y)
    g = c.stop_capture()
    g.update(rebind={x: x2, y: y2}, params={0: {"alpha": 2.0}})
    assert g.fallback_reason is None                       # patched in place
    g.replay()
    np.testing.assert_array_equal(c.read(y2), np.full(4, 7, np.float32))
