"""The cuda backend (CuPy): device buffers from a CuPy memory pool, one CUDA stream per logical
stream, NVRTC kernels, and hardware graphs made by stream capture.

The server owns every policy (ordering, refusals, retention); this file only turns its verbs into
CuPy calls. Nothing here synchronizes the device: every wait is on one stream or one event,
because a device-wide sync from one thread would break another thread's capture.

- Buffers: :class:`cupy.cuda.MemoryPointer` from a private :class:`cupy.cuda.MemoryPool`; a
  pointer is fixed for the buffer's life, so a graph keeps reading the same address.
- Copies: host to device from pinned staging (``cudaMemcpyAsync``), the staging kept alive until
  an event recorded after the copy has completed; device to host into pinned memory plus an
  event, returned as a :class:`runtime.backends.base.Completion` that polls the event.
- Graphs: ``cudaStreamBeginCapture`` in relaxed mode (see :meth:`CudaBackend.begin_graph` for
  why), ``cudaStreamEndCapture`` + ``cudaGraphInstantiate`` + ``cudaGraphUpload``; a replay is one
  ``cudaGraphLaunch`` on the capture stream. ``capture_if``/``capture_while`` record CUDA 12.4
  conditional nodes and ``Graph.update`` patches kernel nodes in place, through cuda-bindings
  (:mod:`runtime.backends.cuda_graph`).
- HIP: where CuPy is built for ROCm the same calls go to HIP; ``device_name`` says so. CuPy may
  not support stream capture on HIP: ``start_capture`` then raises ``UnsupportedError``.

See also: tinygrad ``runtime/ops_cuda.py`` and ``runtime/graph/cuda.py``; CubeCL
``cubecl-cuda/src/compute/server.rs`` (research/cubecl.md section 11).
"""

from __future__ import annotations

import collections
import time

import numpy as np

try:
    import cupy
    from cupy.cuda import runtime as _rt
except Exception as _e:  # noqa: BLE001 - any broken cupy install means "not available"
    raise ImportError(f"cupy is not importable ({type(_e).__name__}: {_e}); install the wheel "
                      "matching your CUDA, e.g. pip install cupy-cuda12x") from _e

from ..kernel import DTYPES
from ..errors import (CaptureRefused, ErrorQueue, LaunchError, OutOfMemory, ServerClosed,
                      UnsupportedError)
from .base import Backend, Completion
from .cuda_graph import (GATE_NAME, GATE_SOURCE, Conditionals, CudaGraph, LoopChecks,
                         update_in_place)

#: kernel param dtype -> the numpy scalar type CuPy packs as that C type (by value, 4 bytes).
# seconds: a completion's waiter yields the GIL between event queries for this long, then sleeps
_SPIN_S, _SLEEP_MAX_S = 200e-6, 1e-3


def _driver_installed() -> bool:
    """Whether the NVIDIA driver's ``libcuda.so.1`` loads (what the CUDA runtime needs)."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def device_count() -> int:
    """Devices CuPy sees. Raises ``UnsupportedError`` with the driver's reason when none answers.

    See also: ``cudaGetDeviceCount`` (``cupy.cuda.runtime.getDeviceCount``).
    """
    try:
        n = _rt.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device, broken install
        why = f"{type(e).__name__}: {e}"
        if "InsufficientDriver" in why and not _driver_installed():
            # the CUDA runtime says "driver version is insufficient" also when there is no
            # driver at all (a machine without a GPU): say that, not "upgrade your driver"
            why += "; no NVIDIA driver (libcuda.so.1) is installed here: is there a GPU?"
        raise UnsupportedError(f"cuda: no device answers ({why})") from e
    if n < 1:
        raise UnsupportedError("cuda: cupy reports 0 devices")
    return n


def describe(device: int) -> str:
    """``"<GPU name> [CUDA, sm_90]"`` or ``"<GPU name> [HIP, gfx90a]"``.

    See also: ``cudaGetDeviceProperties`` (``cupy.cuda.runtime.getDeviceProperties``).
    """
    props = _rt.getDeviceProperties(device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    if _rt.is_hip:
        arch = props.get("gcnArchName", b"")
        return f"{name} [HIP, {arch.decode() if isinstance(arch, bytes) else arch}]"
    return f"{name} [CUDA, sm_{props['major']}{props['minor']}]"


def kernel_args(args, params: tuple, param_types: tuple) -> tuple:
    """CUDA kernel arguments: each buffer's device pointer (8 bytes, as ``uint64``), then each
    param as its exact C type (``f32`` -> ``np.float32``, ``i32`` -> ``np.int32``, ``u32`` ->
    ``np.uint32``): a Python float would be passed as a double and misread."""
    return tuple([np.uint64(buf.ptr) for buf, _ in args]
                 + [t(v) for t, v in zip(param_types, params)])


class _OnDevice:
    """Make ``device`` current for a block and restore the caller's device after it (the owner
    may be any caller thread on the combining fast path; its current device is its own). One
    per block: it holds the device to restore."""

    __slots__ = ("device", "prev")

    def __init__(self, device: int):
        self.device = device

    def __enter__(self):
        self.prev = _rt.getDevice()
        if self.prev != self.device:
            _rt.setDevice(self.device)

    def __exit__(self, *exc):
        if self.prev != self.device:
            _rt.setDevice(self.prev)


class EventCompletion(Completion):
    """A completion tied to a CUDA event: done when the event is.

    ``wait`` polls ``event.done`` (``cudaEventQuery``) on the caller's thread, outside the
    server's lock, yielding the GIL between polls; it never synchronizes the device. ``finish``
    (optional) turns the finished work into the value, e.g. pinned bytes into a numpy array.
    An asynchronous CUDA error raised by the query fails the completion with ``LaunchError``.
    ``check`` (optional, ``() -> error or None``): called once the event completed, before the
    value is made; an error it returns fails the completion (a loop-limit report of a replay
    on this stream: ``cuda_graph.LoopChecks``).
    """

    __slots__ = ("cuda_event", "finish", "check")

    def __init__(self, cuda_event, finish=None, check=None):
        super().__init__()
        self.cuda_event, self.finish, self.check = cuda_event, finish, check

    def wait(self, timeout: float | None = None) -> bool:
        """Block up to ``timeout`` seconds (None: until done); True once done."""
        start = time.monotonic()
        delay = 0.0
        while not self.done:
            try:
                ready = self.cuda_event.done
            except Exception as e:  # noqa: BLE001 - a sticky CUDA error of earlier work
                self.fail(LaunchError(f"cuda: work before this point failed on the device: {e}"))
                return True
            if ready:
                fin, self.finish = self.finish, None
                err = self.check() if self.check is not None else None
                if err is not None:
                    self.fail(err)
                else:
                    self.set(fin() if fin is not None else None)
                return True
            now = time.monotonic() - start
            if timeout is not None and now >= timeout:
                return False
            if now > _SPIN_S:   # short waits (a tiny read) stay fast; long ones stop burning a core
                delay = min(max(delay * 2, 20e-6), _SLEEP_MAX_S)
            time.sleep(delay)
        return True


class CudaProgram:
    """A compiled kernel: the CuPy ``RawKernel``, its ``Function`` on this device, the block size
    (the kernel's ``workgroup_size``) and its param types."""

    __slots__ = ("kernel", "raw", "function", "block", "param_types")

    def __init__(self, kernel, raw, function):
        self.kernel, self.raw, self.function = kernel, raw, function
        self.block = tuple(kernel.workgroup_size)
        self.param_types = tuple(DTYPES[p.dtype].type for p in kernel.params)


class CudaStream:
    """One ``cupy.cuda.Stream(non_blocking=True)`` and what must outlive its queued work.

    ``retire`` holds ``(event, object)`` pairs (pinned staging, destroyed graphs) released once
    the event, recorded after the work that uses the object, has completed; events of one stream
    complete in order, so only the head is checked. (Graphs destroyed while the stream captures
    are held by the server until the window ends: ``runtime.server.capture``.) ``errors``:
    failures of replays on this stream found later (a loop limit), raised by its next
    completion.
    """

    __slots__ = ("stream", "retire", "capturing", "errors")

    def __init__(self, stream):
        self.stream = stream
        self.retire: collections.deque = collections.deque()
        self.capturing = False
        self.errors = ErrorQueue()


class CudaRecording:
    """An open stream capture: the stream, how many launches it recorded, and for
    :mod:`cuda_graph`: the open conditional nodes (``frames``), each launch's kernel node
    (``nodes``), the WHILE nodes' loop checks (``checks``), the gates' scratch (``keep``) and
    how many conditional nodes it holds (``conds``)."""

    __slots__ = ("cs", "launches", "frames", "nodes", "checks", "keep", "conds")

    def __init__(self, cs: CudaStream):
        self.cs, self.launches = cs, 0
        self.frames: list = []
        self.nodes: list = []
        self.checks: list = []
        self.keep: list = []
        self.conds = 0


class CudaBackend(Backend):
    """CuPy buffers, CUDA streams and events, NVRTC kernels, hardware graphs by stream capture.

    Args:
        device: the CUDA device index.

    Raises:
        UnsupportedError: no device answers, or ``device`` is out of range.

    Backends: ``hardware_graphs = True``: the server refuses a fresh allocation inside a capture
    window (a graph must not depend on memory the capture itself created).
    See also: ``cupy.cuda.Stream``, ``cupy.cuda.Event``, ``cupy.RawKernel``, ``cupy.cuda.Graph``.
    """

    name = "cuda"
    hardware_graphs = True
    indirect_dispatch = False     # no device-side indirect launch: the client reads the counts

    @classmethod
    def probe(cls) -> dict:
        """Whether a CUDA (or HIP) device answers, without opening a server.

        Returns: ``{"hardware": True, "device": device 0's description}`` (``Backend.probe``).
        Raises: ``UnsupportedError`` with the driver's reason (no driver, no device).
        """
        device_count()
        return {"hardware": True, "device": describe(0)}

    def __init__(self, device: int = 0):
        super().__init__(device)
        n = device_count()
        if not 0 <= device < n:
            raise UnsupportedError(f"cuda: device {device} does not exist ({n} device(s))")
        self.device_name = describe(device)
        props = _rt.getDeviceProperties(device)
        self.max_workgroups = (int(props["maxGridSize"][0]), int(props["maxGridSize"][1]),
                               int(props["maxGridSize"][2]))
        with _OnDevice(self.device):
            self._pool = cupy.cuda.MemoryPool()     # private: the user's cupy pool stays theirs
            self._pinned = cupy.cuda.PinnedMemoryPool()
        self._streams: list[CudaStream] = []
        self._freed: collections.deque = collections.deque()   # (events, buffer) awaiting them
        self.closed = False
        self._graph_tools()

    def _graph_tools(self) -> None:
        """The conditional-node recorder, the free body streams and the loop checks of replays
        in flight (``cuda_graph``)."""
        self.hip = bool(_rt.is_hip)
        self._conds = Conditionals(self, self._compile_gate)
        self._bodies: list = []
        self._loops = LoopChecks()
        self._track_nodes = None                    # asked on the first capture

    def _compile_gate(self):
        with _OnDevice(self.device):
            try:
                return cupy.RawKernel(GATE_SOURCE, GATE_NAME).kernel
            except Exception as e:  # noqa: BLE001 - CompileException, CUDADriverError
                raise LaunchError(f"cuda: the conditional-node gate kernel failed to compile or "
                                  f"load: {type(e).__name__}: {e}") from e

    def body_stream(self):
        """A private ``cupy.cuda.Stream`` to capture one conditional node's body on (from the
        free list, else new); :meth:`return_body_stream` gives it back at the node's end. Bounded
        by the nodes open at once (windows on several streams may each have some open)."""
        if self._bodies:
            return self._bodies.pop()
        with _OnDevice(self.device):
            return cupy.cuda.Stream(non_blocking=True)

    def return_body_stream(self, stream) -> None:
        """Give back a body stream whose capture ended (no work is queued on it)."""
        self._bodies.append(stream)

    def _check_of(self, cs: CudaStream):
        """A completion's check for ``cs`` (None when nothing can be pending: the fast path)."""
        if not self._loops and not cs.errors:
            return None

        def check():
            self._loops.settle()
            try:
                return cs.errors.popleft()
            except IndexError:         # none, or another waiter of this stream took it
                return None
        return check

    # -- helpers -----------------------------------------------------------------------------
    def _event(self, cs: CudaStream):
        if cs.capturing:   # the server never asks this; an event here would become a graph node
            raise CaptureRefused("cuda: internal error: an event was asked of a capturing stream")
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(cs.stream)
        return ev

    @staticmethod
    def _reap(cs: CudaStream) -> None:
        """Release retired objects whose event completed (never blocks)."""
        retire = cs.retire
        try:
            while retire and retire[0][0].done:
                retire.popleft()
        except Exception:  # noqa: BLE001 - a sticky error: keep them; the next sync reports it
            pass

    def _staging(self, nbytes: int):
        mem = self._pinned.malloc(nbytes)
        return mem, np.frombuffer(mem, np.uint8, nbytes)

    # -- memory -------------------------------------------------------------------------------
    def alloc(self, nbytes):
        """A device buffer of ``nbytes`` bytes (``MemoryPool.malloc``; ``cudaMalloc`` on a miss).

        Raises: ``OutOfMemory``.
        """
        self._reap_freed()
        try:
            with _OnDevice(self.device):
                return self._pool.malloc(max(int(nbytes), 1))
        except (cupy.cuda.memory.OutOfMemoryError, OverflowError, ValueError) as e:  # (size_t)
            raise OutOfMemory(f"cuda: could not allocate {nbytes} bytes on device "
                              f"{self.device}: {e}") from e

    def free(self, buf):
        """Return ``buf`` to the private CuPy pool once the work already enqueued on it ran:
        it is held behind an event recorded now on every stream not capturing (CuPy's pool would
        hand the memory out again at once). No ``cudaFree``: that synchronizes the device."""
        with _OnDevice(self.device):
            events = [self._event(cs) for cs in self._streams if not cs.capturing]
        self._freed.append((events, buf))
        self._reap_freed()

    def _reap_freed(self) -> None:
        freed = self._freed
        try:
            while freed and all(ev.done for ev in freed[0][0]):
                freed.popleft()
        except Exception:  # noqa: BLE001 - a sticky error: keep them; the next sync reports it
            pass

    def release_stream(self, stream):
        """Forget ``stream`` once its queued work ran (``cudaStreamQuery``); False before."""
        self._reap(stream)
        try:
            idle = not stream.capturing and not stream.retire and stream.stream.done
        except Exception:  # noqa: BLE001 - a sticky error: keep it
            return False
        if idle:
            self._loops.settle()
            self.failures.extend(stream.errors.take())  # reported by the next blocking call
            try:
                self._streams.remove(stream)
            except ValueError:
                pass
        return idle

    # -- streams and events -------------------------------------------------------------------
    def new_stream(self):
        """A ``cupy.cuda.Stream(non_blocking=True)``: it never orders against the legacy stream."""
        if self.closed:
            raise ServerClosed("cuda backend is closed")
        with _OnDevice(self.device):
            cs = CudaStream(cupy.cuda.Stream(non_blocking=True))
        self._streams.append(cs)
        return cs

    def record_event(self, stream):
        """``cudaEventRecord`` of a fresh timing-free event on ``stream``."""
        with _OnDevice(self.device):
            return self._event(stream)

    def wait_event(self, stream, event):
        """``cudaStreamWaitEvent``: later work on ``stream`` waits for ``event``."""
        with _OnDevice(self.device):
            stream.stream.wait_event(event)

    def synchronize(self, stream):
        """A completion of an event recorded on ``stream`` now; waiting on it syncs nothing else.
        It fails with ``LaunchError`` when earlier device work raised an asynchronous error."""
        with _OnDevice(self.device):
            self._reap(stream)
            return EventCompletion(self._event(stream), check=self._check_of(stream))

    # -- copies -------------------------------------------------------------------------------
    def copy_in(self, stream, buf, data):
        """``cudaMemcpyAsync`` host to device on ``stream`` from pinned staging; the staging is
        retired with an event so it outlives the copy."""
        n = data.nbytes
        if n == 0:
            return
        with _OnDevice(self.device):
            self._reap(stream)
            mem, view = self._staging(n)
            view[:] = data
            buf.copy_from_host_async(mem.ptr, n, stream.stream)
            stream.retire.append((self._event(stream), mem))

    def copy_out(self, stream, buf, nbytes):
        """``cudaMemcpyAsync`` device to pinned host on ``stream`` + an event; the completion's
        value is a private ``uint8`` copy (the pinned block goes back to the pool)."""
        if nbytes == 0:
            return Completion.ready(np.empty(0, np.uint8))
        with _OnDevice(self.device):
            self._reap(stream)
            mem, view = self._staging(nbytes)
            buf.copy_to_host_async(mem.ptr, nbytes, stream.stream)
            return EventCompletion(self._event(stream), view.copy, self._check_of(stream))

    # -- kernels ------------------------------------------------------------------------------
    def compile(self, kernel):
        """Compile ``kernel.cuda`` with NVRTC (``cupy.RawKernel``) and load it on this device.

        Raises: ``LaunchError`` (no CUDA source, a compile error with NVRTC's log, or a block
        larger than the kernel allows).
        """
        if kernel.cuda is None:
            raise LaunchError(f"kernel {kernel.name} has no CUDA source (give Kernel(cuda=...))")
        with _OnDevice(self.device):
            try:
                raw = cupy.RawKernel(kernel.cuda, kernel.name)
                function = raw.kernel            # compiles (NVRTC, cached on disk) and loads
                limit = raw.max_threads_per_block
            except Exception as e:  # noqa: BLE001 - CompileException, CUDADriverError
                raise LaunchError(f"kernel {kernel.name} failed to compile with NVRTC: "
                                  f"{type(e).__name__}: {e}") from e
        block = kernel.workgroup_size
        if block[0] * block[1] * block[2] > limit:
            raise LaunchError(f"kernel {kernel.name}: workgroup_size {block} exceeds the "
                              f"{limit} threads per block this kernel allows on this device")
        return CudaProgram(kernel, raw, function)

    def launch(self, stream, program, count, args, params, mark=None):
        """``cuLaunchKernel`` on ``stream``: grid = ``count`` ``(x, y, z)``, block =
        ``workgroup_size``. A zero count launches nothing. (No indirect counts:
        ``indirect_dispatch`` is False, the client reads them first.)
        """
        with _OnDevice(self.device):
            grid = count
            if grid[0] and grid[1] and grid[2]:
                program.function(grid, program.block,
                                 kernel_args(args, params, program.param_types),
                                 stream=stream.stream)

    # -- graphs -------------------------------------------------------------------------------
    def begin_graph(self, stream):
        """``cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed)``.

        Why relaxed, not global (CubeCL) or thread-local: (1) the server's owner is whichever
        thread drains the queue (the device thread or a caller on the combining fast path), so
        ``end_capture`` may run on another thread than ``begin_capture``, which only relaxed mode
        allows; (2) while a window is open the owner is the only thread issuing CUDA work for
        this device, but callers waiting on completions of *other* streams poll
        ``cudaEventQuery`` outside the lock, and the owner itself may ``cudaMalloc`` (a fresh
        allocation the server then refuses) or load a module: global mode would let any of those
        invalidate the capture, and docs/contract.md promises that other streams work normally. What
        capture forbids regardless is enforced by the server: no read, sync or replay on the
        capturing stream, no event recorded on it.

        Raises: ``UnsupportedError`` (this CuPy build cannot capture, e.g. on HIP).
        """
        with _OnDevice(self.device):
            try:
                stream.stream.begin_capture(mode=_rt.streamCaptureModeRelaxed)
            except Exception as e:  # noqa: BLE001
                raise UnsupportedError(f"cuda: stream capture is not available here "
                                       f"({type(e).__name__}: {e})") from e
        stream.capturing = True
        if self._track_nodes is None:
            self._track_nodes = self._conds.tracks_nodes()
        return CudaRecording(stream)

    def record_launch(self, recording, program, count, args, params):
        """Launch on the capturing stream (inside a conditional node: on the body stream
        capturing its child graph): the driver records it as a kernel node (``count`` is
        ``(x, y, z)``: the server refuses indirect launches in a window, ``indirect_dispatch``).
        A top-level launch's node is kept for ``update_graph``."""
        frames = recording.frames
        stream = frames[-1].stream if frames else recording.cs.stream
        node = None
        with _OnDevice(self.device):
            if count[0] and count[1] and count[2]:
                program.function(count, program.block,
                                 kernel_args(args, params, program.param_types), stream=stream)
                if frames:
                    frames[-1].content += 1
                elif self._track_nodes:
                    node = self._conds.node_of_last_launch(stream)
        recording.nodes.append(node)
        recording.launches += 1

    def _end_capture(self, cs: CudaStream):
        try:
            with _OnDevice(self.device):
                return cs.stream.end_capture()
        finally:
            cs.capturing = False

    def end_graph(self, recording):
        """``cudaStreamEndCapture`` + instantiate (in CuPy's ``end_capture``), then
        ``cudaGraphUpload`` on the capture stream (best effort). An empty window gives ``None``,
        which replays as nothing.

        Raises: ``CaptureRefused`` when the driver invalidated the capture.
        """
        cs = recording.cs
        empty = recording.launches == 0 and recording.conds == 0
        try:
            graph = self._end_capture(cs)
        except Exception as e:  # noqa: BLE001
            if empty:
                return None
            raise CaptureRefused(f"cuda: the driver invalidated the capture on this stream "
                                 f"({type(e).__name__}: {e}); no graph was made") from e
        if empty:
            return None
        with _OnDevice(self.device):
            for scratch in recording.keep:          # the gates' words start at zero
                scratch.memset_async(0, 8, cs.stream)
            try:
                graph.upload(cs.stream)
            except Exception:  # noqa: BLE001 - only a first-launch latency optimisation
                pass
        nodes = recording.nodes
        if not getattr(graph, "graph", 0):     # a CuPy that drops the cudaGraph_t once
            nodes = [None] * len(nodes)         # instantiated: its nodes are gone with it
        return CudaGraph(graph, nodes, recording.checks, recording.keep)

    def abort_graph(self, recording):
        """End the capture and drop what it recorded (the stream leaves capture mode)."""
        if recording.frames:
            with _OnDevice(self.device):
                self._conds.abort(recording)
        try:
            self._end_capture(recording.cs)
        except Exception:  # noqa: BLE001 - an invalidated capture still ends
            pass

    def launch_graph(self, stream, graph, mark=None):
        """``cudaGraphLaunch`` on the capture stream; returns once enqueued. A graph with
        ``capture_while`` nodes then copies their over words out and zeroes them, behind an
        event: a loop past ``max_iterations`` fails ``mark`` with ``LoopLimitExceeded`` when a
        later completion sees it (``cuda_graph.LoopChecks``)."""
        if graph is not None:
            with _OnDevice(self.device):
                graph.launch(stream.stream)
                if graph.checks:
                    n = len(graph.checks)
                    mem, view = self._staging(4 * n)
                    words = np.frombuffer(mem, np.uint32, n)
                    for i, (_, _, scratch) in enumerate(graph.checks):
                        over = scratch + 4
                        over.copy_to_host_async(mem.ptr + 4 * i, 4, stream.stream)
                        over.memset_async(0, 4, stream.stream)
                    ev = self._event(stream)
                    stream.retire.append((ev, mem))
                    self._loops.add(ev, words, graph, mark, stream)

    def destroy_graph(self, stream, graph):
        """Drop ``graph`` once the replays enqueued on ``stream`` have run.

        Deviation: no ``stream.synchronize()``; the graph is retired behind an event recorded on
        ``stream`` (a blocking sync would stall every client of the device thread, and a sync of
        a capturing stream would invalidate its capture). The server never calls this on a
        capturing stream (it holds the graph until the window ends).
        """
        if graph is None:
            return
        with _OnDevice(self.device):
            self._reap(stream)
            stream.retire.append((self._event(stream), graph))

    # -- graphs that change ---------------------------------------------------------------------
    #: why the last ``update_graph`` could not patch in place (``Graph.fallback_reason``); set
    #: by :meth:`update_graph` before it returns None.
    update_fallback_reason = None

    def update_graph(self, stream, graph, changes, conds):
        """Patch the changed launches' kernel nodes of the instantiated graph
        (``cuGraphExecKernelNodeSetParams``; replays already enqueued keep the old parameters,
        CUDA's rule) and return ``graph``; or return None (the server recaptures the graph from
        its recording) with :attr:`update_fallback_reason` saying why
        (``cuda_graph.update_in_place``)."""
        with _OnDevice(self.device):
            why = update_in_place(graph, changes, conds)
        if why is None:
            return graph
        self.update_fallback_reason = why
        return None

    def begin_cond(self, recording, kind, cond, max_iterations):
        """Open a CUDA 12.4 conditional IF/WHILE node in the capture (``cuda_graph``): a gate
        kernel reading the 1-element condition at ``cond`` and setting the node's handle, the
        node, then the body captured into its child graph.

        Raises: ``UnsupportedError`` at capture (never at replay) without cuda-bindings, on
        HIP, or with a driver older than 12.4, naming which; ``CaptureRefused`` when a driver
        call fails (the window is then refused).
        """
        with _OnDevice(self.device):
            self._conds.begin(recording, kind, cond, max_iterations, recording.conds)
        recording.conds += 1

    def else_cond(self, recording):
        """Close the innermost IF node's true branch; its false branch is a second IF node on
        "the condition was zero" (the value the first gate saved)."""
        with _OnDevice(self.device):
            self._conds.else_(recording)

    def end_cond(self, recording):
        """Close the innermost conditional node (a WHILE body ends with its loop gate)."""
        with _OnDevice(self.device):
            self._conds.end(recording)

    # -- lifetime -----------------------------------------------------------------------------
    def is_alive(self):
        return not self.closed

    def close(self):
        """End open captures, wait for each stream (``cudaStreamSynchronize``, one stream at a
        time, never the device), then drop staging and graphs."""
        self.closed = True
        for cs in self._streams:
            if cs.capturing:
                try:
                    self._end_capture(cs)
                except Exception:  # noqa: BLE001
                    pass
            try:
                with _OnDevice(self.device):
                    cs.stream.synchronize()
            except Exception:  # noqa: BLE001 - a sticky error: nothing left to report it to
                pass
            cs.retire.clear()
        self._freed.clear()
