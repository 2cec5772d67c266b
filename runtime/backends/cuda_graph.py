"""What CuPy's graph API lacks, through NVIDIA's ``cuda-bindings`` (the driver API): conditional
IF/WHILE nodes recorded into a stream capture, and in-place kernel-node updates of an
instantiated graph. Used only by :mod:`runtime.backends.cuda`; every call here runs on the
server's owner with the backend's device current.

Conditional nodes (CUDA 12.4+, CUDA programming guide "Conditional Graph Nodes"; the
``cudaGraphConditionalHandleCreate`` + ``cudaStreamBeginCaptureToGraph`` pattern of NVIDIA's
``graphConditionalNodes`` sample and of ``cuda.core``'s graph builder):

- ``capture_if`` / ``capture_while`` open a node in the graph the stream is capturing into
  (``cuStreamGetCaptureInfo``): a conditional handle, a one-thread *gate* kernel
  (:data:`GATE_SOURCE`, NVRTC) captured on the parent stream that reads the 1-element i32/u32
  condition buffer and calls ``cudaGraphSetConditional``, then the node (``cuGraphAddNode``)
  made the stream's only dependency (``cuStreamUpdateCaptureDependencies``). The body is
  captured into the node's child graph on a private body stream (one per open node, taken from
  the backend's free list and given back at the node's end, so windows on other streams never
  share one; ``cuStreamBeginCaptureToGraph`` ... ``cuStreamEndCapture``), so launches inside a
  body go to that stream. Nesting works to any depth (the nested node goes into the body graph).
- ``else``: a second IF node whose handle a gate sets to "the condition was zero" from the value
  the first gate saved (the true branch may write the condition buffer; CUDA 12.4 has no
  two-branch IF node, 12.8's is not needed). An IF body that recorded nothing gets one empty
  node: drivers before 12.8 hang on a conditional node with an empty body graph.
- WHILE: the gate before the node zeroes an iteration counter; a gate at the end of the body
  counts the iteration, re-reads the condition and, when it still holds after
  ``max_iterations`` iterations (default :data:`DEFAULT_MAX_ITERATIONS`: a loop never hangs),
  stops the loop and sets an *over* word. After each replay the backend copies the over words
  to pinned memory and zeroes them (stream-ordered); the next completion on any stream that
  finds one set fails the replay's mark with ``LoopLimitExceeded`` (the write set is marked,
  reads raise ``ReplayFailed``): never a silent truncation (:class:`LoopChecks`).
- No cuda-bindings, HIP, or a driver older than 12.4: ``UnsupportedError`` at capture
  (:func:`support_reason`), never at replay.

Kernel-node updates (``Graph.update`` without recapture): each top-level launch's kernel node
is taken from the capture right after it is recorded (the stream's only capture dependency);
an update sets the changed nodes' parameters on the instantiated graph
(``cuGraphExecKernelNodeSetParams``: launches already enqueued keep the old ones, CUDA's rule).
Where that is impossible (no cuda-bindings, a launch inside a conditional body, a zero
workgroup count before or after, a new condition buffer) :func:`update_in_place` says why and
the server rebuilds the graph from its recording (``Graph.fallback_reason``).
"""

from __future__ import annotations

import collections
import ctypes
import threading

import numpy as np

try:
    from cuda.bindings import driver as drv
    BINDINGS_MISSING = None
except Exception as _e:  # noqa: BLE001 - any broken install means "not available"
    drv = None
    BINDINGS_MISSING = f"{type(_e).__name__}: {_e}"

from ..errors import CaptureRefused, LoopLimitExceeded, UnsupportedError

#: the oldest driver with conditional nodes and capture into a node's body graph (12.4).
MIN_DRIVER = 12040
#: ``capture_while(max_iterations=None)``'s bound (the client's and the cpu backend's).
DEFAULT_MAX_ITERATIONS = 1 << 20

GATE_NAME = "runtime_cond_gate"
#: modes of the gate kernel
IF_ENTER, ELSE_ENTER, WHILE_ENTER, WHILE_NEXT = 0, 1, 2, 3
#: The gate: one thread. ``scratch`` is the node's two words: [0] the IF's saved condition or
#: the WHILE's iteration count, [1] the WHILE's over word. ``cudaGraphSetConditional`` is a
#: device-runtime builtin the driver resolves at module load (declared as
#: ``<cuda_device_runtime_api.h>`` declares it, so NVRTC needs no CUDA headers and no -rdc).
GATE_SOURCE = r"""
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    unsigned long long handle, unsigned int value);

extern "C" __global__ void runtime_cond_gate(unsigned long long handle,
                                             const unsigned int* cond, unsigned int* scratch,
                                             unsigned int max_iterations, int mode) {
    unsigned int go;
    if (mode == 0) {                 /* IF: take the branch, save the value for the else */
        go = cond[0] != 0u;
        scratch[0] = go;
    } else if (mode == 1) {          /* ELSE: the saved value was zero */
        go = scratch[0] == 0u;
    } else {                         /* WHILE: 2 = before the node, 3 = end of each iteration */
        unsigned int n = mode == 2 ? 0u : scratch[0] + 1u;
        scratch[0] = n;
        go = cond[0] != 0u;
        if (go && n >= max_iterations) {
            scratch[1] = 1u;         /* over: the condition still holds after max_iterations */
            go = 0u;
        }
    }
    cudaGraphSetConditional(handle, go);
}
"""

_PARAM_CTYPES = {np.float32: ctypes.c_float, np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32}


# -- the version gate ---------------------------------------------------------------------------
def version_text(version: int | None) -> str:
    """``12040`` -> ``"12.4"`` (CUDA's ``1000 * major + 10 * minor``); None -> ``"unknown"``."""
    return "unknown" if version is None else f"{version // 1000}.{version % 1000 // 10}"


def driver_version() -> int | None:
    """``cuDriverGetVersion`` through cuda-bindings, or None (no bindings, no driver)."""
    if drv is None:
        return None
    try:
        err, version = drv.cuDriverGetVersion()
    except Exception:  # noqa: BLE001 - libcuda.so not found: no driver
        return None
    return int(version) if err == drv.CUresult.CUDA_SUCCESS else None


def support_reason(version: int | None, hip: bool = False,
                   bindings_missing: str | None = None) -> str | None:
    """Why conditional nodes cannot be recorded here, or None when they can.

    Args: ``version``: the driver's ``cuDriverGetVersion`` (None: no driver answered); ``hip``:
    CuPy is built for ROCm; ``bindings_missing``: why ``cuda.bindings`` did not import.
    """
    if hip:
        return "HIP has no conditional graph nodes"
    if bindings_missing is not None:
        return (f"the cuda-bindings package is not importable ({bindings_missing}); pip install "
                "'cuda-bindings>=12.4,<13' (the cuda extra)")
    if version is None:
        return "no CUDA driver answers cuDriverGetVersion"
    if version < MIN_DRIVER:
        return (f"the CUDA driver is {version_text(version)}; conditional graph nodes need "
                f"{version_text(MIN_DRIVER)} or newer")
    return None


def _ok(result, what: str):
    """The outputs of a cuda-bindings call (``(CUresult, *outputs)``), or raise
    ``CaptureRefused`` naming the call and the driver's error."""
    err, *out = result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CaptureRefused(f"cuda: {what} failed ({getattr(err, 'name', err)}); the capture "
                             "cannot record this conditional node")
    return out[0] if len(out) == 1 else tuple(out)


def _stream(cupy_stream):
    return drv.CUstream(int(cupy_stream.ptr))


# -- what a recording carries -------------------------------------------------------------------
class Frame:
    """One open conditional node: ``kind`` (``"if"``, ``"else"`` once switched, ``"while"``),
    the body stream capturing its child graph, the parent stream, its scratch words, the
    condition's device pointer, the bound, the node index, its conditional handle and how many
    nodes the open body holds (``content``)."""

    __slots__ = ("kind", "stream", "parent", "scratch", "cond_ptr", "max_iterations", "index",
                 "handle", "content")

    def __init__(self, kind, stream, parent, scratch, cond_ptr, max_iterations, index):
        self.handle = None           # the conditional handle of the node open now
        self.content = 0             # nodes captured into the open body so far
        self.kind, self.stream, self.parent = kind, stream, parent
        self.scratch, self.cond_ptr = scratch, cond_ptr
        self.max_iterations, self.index = max_iterations, index


class CudaGraph:
    """An instantiated graph and what updating and checking it needs.

    Attributes:
        exec: CuPy's ``cupy.cuda.graph.Graph`` (``.graph``: the captured ``cudaGraph_t``,
            ``.graphExec``: the instance), launched by :meth:`launch`.
        nodes: per recorded launch (bodies included, recording order): the kernel node in
            ``exec.graph`` (a ``CUgraphNode``), or None (inside a conditional body, a zero count,
            or no cuda-bindings): :func:`update_in_place`.
        checks: ``[(node index, max_iterations, scratch)]`` of the WHILE nodes (:class:`LoopChecks`).
        keep: device memory the graph's gates use (scratch words), freed with the graph.
    """

    __slots__ = ("exec", "nodes", "checks", "keep")

    def __init__(self, exec_graph, nodes, checks, keep):
        self.exec, self.nodes, self.checks, self.keep = exec_graph, nodes, checks, keep

    def launch(self, cupy_stream) -> None:
        """``cudaGraphLaunch`` on ``cupy_stream``."""
        self.exec.launch(cupy_stream)


# -- conditional nodes while capturing ----------------------------------------------------------
class Conditionals:
    """Records conditional nodes for one backend.

    Args:
        backend: the ``CudaBackend`` (its ``alloc``, ``body_stream()`` /
            ``return_body_stream(stream)`` and ``hip``).
        compile_gate: ``() -> launchable`` compiling :data:`GATE_SOURCE` (called on first use;
            the result is called as ``f(grid, block, args, stream=)``, CuPy's ``Function``).
    """

    def __init__(self, backend, compile_gate):
        self.backend = backend
        self._compile_gate = compile_gate
        self._gate = None
        self._reason = False         # not asked yet

    def unsupported(self) -> str | None:
        """Why conditional nodes cannot be recorded (cached), or None."""
        if self._reason is False:
            self._reason = support_reason(driver_version(), self.backend.hip, BINDINGS_MISSING)
        return self._reason

    def tracks_nodes(self) -> bool:
        """Whether kernel nodes are taken from the capture (cuda-bindings and a driver)."""
        return drv is not None and driver_version() is not None

    def _context(self, parent):
        """The context of the node (``cuStreamGetCtx`` of the capturing stream; drivers before
        12.5 cannot answer that during a capture: the thread's current one, as ``cuda.core``)."""
        if (driver_version() or 0) >= 12050:
            return _ok(drv.cuStreamGetCtx(parent), "cuStreamGetCtx")
        return _ok(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")

    def gate(self):
        if self._gate is None:
            self._gate = self._compile_gate()
        return self._gate

    def _launch_gate(self, cupy_stream, frame: Frame, mode: int) -> None:
        limit = min(int(frame.max_iterations), 0xFFFFFFFF)
        self.gate()((1, 1, 1), (1, 1, 1),
                    (np.uint64(int(frame.handle)), np.uint64(frame.cond_ptr),
                     np.uint64(frame.scratch.ptr), np.uint32(limit), np.int32(mode)),
                    stream=cupy_stream)

    def _open(self, frame: Frame, mode: int, cond_type) -> None:
        """Gate + node on ``frame.parent``, then capture the node's body on ``frame.stream``."""
        parent = _stream(frame.parent)
        status, _, graph, _, _ = _ok(drv.cuStreamGetCaptureInfo(parent), "cuStreamGetCaptureInfo")
        if status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise CaptureRefused(f"cuda: the capture this conditional node belongs to is not "
                                 f"active ({getattr(status, 'name', status)}); no node recorded")
        ctx = self._context(parent)
        frame.handle = _ok(drv.cuGraphConditionalHandleCreate(graph, ctx, 0, 0),
                           "cuGraphConditionalHandleCreate")
        self._launch_gate(frame.parent, frame, mode)
        _, _, graph, deps, ndeps = _ok(drv.cuStreamGetCaptureInfo(parent),
                                       "cuStreamGetCaptureInfo")
        params = node_params(frame.handle, cond_type, ctx)
        node = _ok(drv.cuGraphAddNode(graph, deps, ndeps, params), "cuGraphAddNode")
        _ok(drv.cuStreamUpdateCaptureDependencies(
            parent, [node], 1,
            drv.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES),
            "cuStreamUpdateCaptureDependencies")
        _ok(drv.cuStreamBeginCaptureToGraph(
            _stream(frame.stream), params.conditional.phGraph_out[0], None, None, 0,
            drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCaptureToGraph")

    def begin(self, rec, kind: str, cond, max_iterations, index: int) -> None:
        """Open a node in ``rec`` (a ``CudaRecording``). Raises ``UnsupportedError`` (before
        anything is recorded) or ``CaptureRefused`` (a driver call failed)."""
        reason = self.unsupported()
        if reason is not None:
            raise UnsupportedError(
                f"capture_{kind} inside a capture on cuda: {reason}; run it outside the capture "
                "(eager), or use the cpu or wgpu backend")
        buf, _ = cond
        parent = rec.frames[-1].stream if rec.frames else rec.cs.stream
        scratch = self.backend.alloc(8)
        limit = DEFAULT_MAX_ITERATIONS if max_iterations is None else max_iterations
        frame = Frame(kind, self.backend.body_stream(), parent, scratch, int(buf.ptr), limit,
                      index)
        try:
            if kind == "if":
                self._open(frame, IF_ENTER, drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF)
            else:
                self._open(frame, WHILE_ENTER,
                           drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE)
        except BaseException:
            self.backend.return_body_stream(frame.stream)
            raise
        rec.keep.append(scratch)
        if kind == "while":
            rec.checks.append((index, limit, scratch))
        if rec.frames:
            rec.frames[-1].content += 1
        rec.frames.append(frame)

    def _close_body(self, rec) -> Frame:
        frame = rec.frames[-1]
        body = _stream(frame.stream)
        if frame.kind == "while":
            self._launch_gate(frame.stream, frame, WHILE_NEXT)
        elif frame.content == 0:
            # an empty body graph hangs conditional nodes on drivers before 12.8 (fixed in
            # r570; XLA carried the same workaround): give it one empty node
            _, _, graph, deps, ndeps = _ok(drv.cuStreamGetCaptureInfo(body),
                                           "cuStreamGetCaptureInfo")
            node = _ok(drv.cuGraphAddEmptyNode(graph, deps, ndeps), "cuGraphAddEmptyNode")
            _ok(drv.cuStreamUpdateCaptureDependencies(
                body, [node], 1,
                drv.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES),
                "cuStreamUpdateCaptureDependencies")
        _ok(drv.cuStreamEndCapture(body), "cuStreamEndCapture")
        return frame

    def else_(self, rec) -> None:
        """Close the true branch of the innermost IF node and open its false branch."""
        frame = self._close_body(rec)
        frame.kind, frame.content = "else", 0
        self._open(frame, ELSE_ENTER, drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF)

    def end(self, rec) -> None:
        """Close the innermost node's body capture."""
        self._close_body(rec)
        self.backend.return_body_stream(rec.frames.pop().stream)

    def abort(self, rec) -> None:
        """End the body captures still open (a refused window); errors are swallowed."""
        while rec.frames:
            frame = rec.frames.pop()
            try:
                drv.cuStreamEndCapture(_stream(frame.stream))
            except Exception:  # noqa: BLE001 - an invalidated capture still ends
                pass
            self.backend.return_body_stream(frame.stream)

    def node_of_last_launch(self, cupy_stream):
        """The kernel node the capture on ``cupy_stream`` just recorded (its only dependency),
        or None when the driver does not say."""
        try:
            err, status, _, _, deps, ndeps = drv.cuStreamGetCaptureInfo(_stream(cupy_stream))
        except Exception:  # noqa: BLE001 - no node tracking: updates fall back
            return None
        if err != drv.CUresult.CUDA_SUCCESS or int(ndeps) != 1:
            return None
        return deps[0]


def node_params(handle, cond_type, ctx):
    """``CUgraphNodeParams`` of a conditional node: one body graph, ``cond_type`` IF or WHILE,
    the handle and the context (``cuGraphAddNode`` fills ``conditional.phGraph_out``)."""
    params = drv.CUgraphNodeParams()
    params.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.handle = handle
    params.conditional.type = cond_type
    params.conditional.size = 1
    params.conditional.ctx = ctx
    return params


# -- kernel-node updates ------------------------------------------------------------------------
def kernel_params(program, count, args, params):
    """``CUDA_KERNEL_NODE_PARAMS`` of one launch of ``program`` (a ``CudaProgram``): its
    function, grid ``count`` ``(x, y, z)``, block ``workgroup_size``, and the arguments as the
    launch passes them (each buffer's device pointer, then each param as its C type)."""
    kp = drv.CUDA_KERNEL_NODE_PARAMS()
    kp.func = drv.CUfunction(int(program.function.ptr))
    kp.gridDimX, kp.gridDimY, kp.gridDimZ = (int(c) for c in count)
    kp.blockDimX, kp.blockDimY, kp.blockDimZ = (int(b) for b in program.block)
    kp.sharedMemBytes = 0
    values = [int(buf.ptr) for buf, _ in args] + [t(v).item() for t, v in
                                                  zip(program.param_types, params)]
    types = ([ctypes.c_void_p] * len(args)
             + [_PARAM_CTYPES[t] for t in program.param_types])
    kp.kernelParams = (tuple(values), tuple(types))
    return kp


def update_in_place(graph: CudaGraph, changes: dict, conds: dict) -> str | None:
    """Set the kernel nodes of ``changes`` (``{launch index: (program, count, args, params)}``)
    on the instantiated ``graph`` (``cuGraphExecKernelNodeSetParams``). Returns None when done,
    else why it cannot (nothing changed, or a driver call failed part way: the caller rebuilds
    the graph either way, so the instance is never used half patched)."""
    why = ("cuda: the graph was recaptured from its recording ({}); kernel nodes are patched in "
           "place (cuGraphExecKernelNodeSetParams) only for launches outside conditional "
           "bodies with non-zero counts")
    if drv is None:
        return why.format(f"cuda-bindings is not importable: {BINDINGS_MISSING}")
    if conds:
        return why.format("a conditional node's condition buffer changed")
    nodes = graph.nodes
    todo = []
    for i, (program, count, args, params) in sorted(changes.items()):
        node = nodes[i] if i < len(nodes) else None
        if node is None:
            return why.format(f"launch {i} has no kernel node of its own to patch (inside a "
                              "conditional body, recorded with a zero count, or nodes were not "
                              "tracked: no driver answered, or CuPy released the captured "
                              "graph)")
        if len(count) != 3 or not all(count):
            return why.format(f"launch {i}'s new count {tuple(count)} launches nothing")
        todo.append((node, kernel_params(program, count, args, params)))
    exec_handle = drv.CUgraphExec(int(graph.exec.graphExec))
    for node, kp in todo:
        try:
            err = drv.cuGraphExecKernelNodeSetParams(exec_handle, node, kp)[0]
        except Exception as e:  # noqa: BLE001
            return why.format(f"cuGraphExecKernelNodeSetParams raised {type(e).__name__}: {e}")
        if err != drv.CUresult.CUDA_SUCCESS:
            return why.format(f"cuGraphExecKernelNodeSetParams failed: "
                              f"{getattr(err, 'name', err)}")
    return None


# -- loop-limit reports -------------------------------------------------------------------------
class LoopChecks:
    """The over words of replays in flight, turned into ``LoopLimitExceeded`` once known.

    ``after_replay`` (the owner, right after ``cudaGraphLaunch``) copies each WHILE node's over
    word to pinned memory and zeroes it on the replay's stream, then records an event.
    ``settle`` (any thread: a completion's waiter, or the owner) looks at the checks whose event
    completed: a set word fails the replay's mark (the write set is marked) and queues the error
    on the replay's stream (``CudaStream.errors``), which that stream's next completion raises.
    Bounded by replays in flight: every ``after_replay`` settles the finished ones first.
    """

    def __init__(self):
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, event, view, graph: CudaGraph, mark, stream) -> None:
        """One replay's copied over words (``view``: ``uint32 [len(graph.checks)]`` pinned)."""
        self.settle()
        self._pending.append((event, view, graph.checks, mark, stream))

    def settle(self) -> None:
        """Report every check whose event completed (never blocks)."""
        with self._lock:
            keep = collections.deque()
            while self._pending:
                item = self._pending.popleft()
                try:
                    done = item[0].done
                except Exception:  # noqa: BLE001 - a sticky error: the stream reports it
                    done = True
                if not done:
                    keep.append(item)
                    continue
                _, view, checks, mark, stream = item
                for (index, limit, _), over in zip(checks, view):
                    if over:
                        err = LoopLimitExceeded.in_replay(index, limit, " on cuda; the loop")
                        stream.errors.append(mark.fail(err) if mark is not None else err)
                        break
            self._pending = keep
