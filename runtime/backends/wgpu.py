"""The wgpu backend: WebGPU through wgpu-py, on a hardware adapter or Mesa's lavapipe/llvmpipe.

Device verbs only (see ``runtime.backends.base``); the server owns every policy. Shape:

- Buffers are storage buffers (``STORAGE | COPY_SRC | COPY_DST | INDIRECT``), sizes rounded up
  to 4 bytes. Reads go through a reusable ``MAP_READ`` staging buffer.
- Logical streams share the one ``GPUQueue``. Each stream batches its dispatches into a command
  encoder (one open compute pass) and submits it every ``max_tasks`` dispatches (default 32, as
  CubeCL's ``tasks_max``) or at the next blocking call. On one queue, submission order is the
  execution order, so an event is "submit the recording stream's pending work" (docs/contract.md 3).
- ``queue.write_buffer`` lands at the next submit, *ahead of* anything encoded but not yet
  submitted; ``copy_in`` therefore submits every stream's pending work first, so a write issued
  after a launch or a replay never overtakes it.
- Programs are compute pipelines with an explicit bind-group layout (bindings in order, then one
  uniform buffer for the params). Uniform buffers are immutable and cached by their bytes; bind
  groups are cached by (program, uniform bytes, buffers).
- Graphs are software graphs (CubeCL ``cubecl-wgpu/src/compute/graph.rs``): each recorded launch
  is resolved once to (pipeline, bind group, static count or indirect count buffer); a replay
  re-encodes the list into the stream's encoder, setting the pipeline only when it changes, and
  submits once.

- The ``GPUQueue`` belongs to one queue thread (:class:`QueueThread`): every ``submit``,
  ``write_buffer``, ``map_async``, ``unmap`` and ``destroy`` runs there, in the order the server
  issued them. Measured on lavapipe: ``queue.submit`` blocks until the previous submission has
  finished (1.2-1.6 s behind three 384x384 matmuls), and ``destroy``, ``map_async`` and
  ``create_buffer_with_data`` block as long while another thread is inside a submit; so none of
  them may run in a server handler (docs/contract.md section 2: no handler waits for the device).
  The owner only encodes and hands finished command buffers over.
- Reads and ``synchronize`` return a :class:`MapCompletion`: the queue thread maps a staging
  buffer asynchronously after the copy; the *caller's* thread waits for the map and copies the
  bytes out (``Completion.wait``), never the server.
- Submission load: at most ``max_inflight`` submits are unfinished; the queue thread then waits
  for a fence before the next one (CubeCL's submission load). ``load()`` reports the dispatches
  and bytes queued on that thread, which the device queue bounds.
- One invalid dispatch does not fail its batch: when ``finish()`` refuses a batch, each dispatch
  is encoded alone, the valid ones are submitted in order and each invalid one fails its
  launch's mark (issue 13 case 3). Failures found after the enqueue follow the backends' one
  protocol (``base.py``, ``mark``): ``mark.fail`` marks what the work would have written, and
  the error is reported on the stream by its next completion (a read or a fence, failed on the
  queue thread after every earlier submit of that stream ran or was refused).

wgpu-py objects other than the queue are only touched by the server's single owner, except a
mapped staging buffer, which belongs to the one reader waiting on it until it is handed back.
``queue.on_submitted_work_done`` is not used (broken in wgpu 0.32.0): a fence maps a 4-byte
buffer after a copy instead.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from ..errors import (ErrorQueue, InvalidHandle, LaunchError, OutOfMemory, UnsupportedError,
                      error_list, unhealthy)
from .. import _threads
from .base import Backend, Completion, written_buffers

# Mesa's drivers complain on stderr when XDG_RUNTIME_DIR is unset (headless machines, CI);
# they only need it to exist, and never write there for compute.
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

try:
    import wgpu
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise UnsupportedError(f"the wgpu backend needs wgpu-py: pip install wgpu ({exc})") from exc

from .wgpu_graph import (COUNT_CHECK_WGSL, GATE_WGSL, MAX_UNROLLED, WgpuCond,  # noqa: E402
                         WgpuGraph, _checked, _oversize)
from .wgpu_queue import (_CHECK, _DESTROY, _DEVCHECK, _MAP, _SUBMIT, _WRITE,  # noqa: E402
                         MapCompletion, QueueThread, _Batch)

INSTALL_HINT = "apt-get install -y mesa-vulkan-drivers (lavapipe, a Vulkan CPU adapter)"
_STORAGE = (wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
            | wgpu.BufferUsage.INDIRECT)
_ADAPTER_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "Unknown": 3, "CPU": 4}
_BACKEND_RANK = {"Vulkan": 0, "Metal": 0, "D3D12": 0, "OpenGL": 1}
_LIMITS = ("max-buffer-size", "max-storage-buffer-binding-size",
           "max-storage-buffers-per-shader-stage", "max-compute-workgroup-storage-size",
           "max-compute-invocations-per-workgroup", "max-compute-workgroup-size-x",
           "max-compute-workgroup-size-y", "max-compute-workgroup-size-z",
           "max-compute-workgroups-per-dimension", "max-bind-groups")
_CACHE_MAX = 4096   # uniform buffers and bind groups kept before a cache is cleared


def _align4(n: int) -> int:
    return max(4, (int(n) + 3) & ~3)


def _gpu_error(exc: BaseException, what: str):
    """A runtime error for a wgpu-py error raised while doing ``what``."""
    msg = f"wgpu: {what} failed: {str(exc).strip()}"
    if isinstance(exc, getattr(wgpu, "GPUOutOfMemoryError", ())):
        return OutOfMemory(msg)
    return LaunchError(msg)


def _rank(adapter) -> tuple:
    info = adapter.info
    return (_ADAPTER_RANK.get(info.get("adapter_type", "Unknown"), 3),
            _BACKEND_RANK.get(info.get("backend_type", ""), 2))


def select_adapter(device: int = 0, prefer: str | None = None):
    """The ``device``-th best adapter: hardware first, then lavapipe (Vulkan CPU), then llvmpipe GL.

    Args:
        device: index into the ranked adapter list (0 = best).
        prefer: optional case-insensitive substring of the adapter name or backend type
            (also read from ``RUNTIME_WGPU_ADAPTER``); matching adapters are ranked first.
    Returns:
        a ``GPUAdapter``.
    Raises:
        UnsupportedError: no adapter at all (with the install hint), or ``device`` out of range.
    See also: ``wgpu.gpu.enumerate_adapters_sync`` (WebGPU ``navigator.gpu.requestAdapter``).
    """
    adapters = list(wgpu.gpu.enumerate_adapters_sync())
    if not adapters:
        raise UnsupportedError(f"wgpu: no WebGPU adapter found; install one: {INSTALL_HINT}")
    prefer = (prefer or os.environ.get("RUNTIME_WGPU_ADAPTER") or "").lower()

    def key(a):
        text = f"{a.info.get('device', '')} {a.info.get('backend_type', '')}".lower()
        return (not (prefer and prefer in text),) + _rank(a)
    adapters.sort(key=key)
    if not 0 <= device < len(adapters):
        raise UnsupportedError(f"wgpu: device {device} does not exist; {len(adapters)} adapter(s): "
                               f"{[describe(a) for a in adapters]}")
    return adapters[device]


#: the process that opened a wgpu device (None: none yet); a forked child inherits it
_DEVICE_PID = None


def _refuse_after_fork() -> None:
    """Raise ``UnsupportedError`` in a forked child of a process that opened a wgpu device:
    wgpu-native's (and the Vulkan driver's: lavapipe's) threads and locks stayed in the parent,
    so a device opened here hangs at its first submit (found by ADV2). As CUDA refuses a
    context inherited across fork (``cudaErrorInitializationError``)."""
    if _DEVICE_PID is not None and _DEVICE_PID != os.getpid():
        raise UnsupportedError(
            f"wgpu: this process ({os.getpid()}) is a fork of process {_DEVICE_PID}, which "
            "opened a wgpu device: wgpu-native and the Vulkan driver do not survive a fork "
            "(their threads stayed in the parent; a device opened here would hang). Start "
            "workers with multiprocessing's 'spawn' or 'forkserver' method, or open wgpu only "
            "after the fork (the cpu backend works in a forked child)")


#: devices of closed backends, by ``(device index, adapter preference, adapter)``: the next
#: backend of that adapter takes one instead of opening another (:func:`_take_device`)
_IDLE_DEVICES: dict = {}
_IDLE_LOCK = threading.Lock()


def _take_device(key):
    """A device a closed backend of the same adapter left (:func:`_park_device`), or None.

    Why (SOAK9): wgpu-native frees a device (a ``VkDevice``; on lavapipe a queue thread of its
    own and ~0.6 MB) only when the last native object made from it is released, and an
    asynchronous exception (Ctrl-C, ``PyThreadState_SetAsyncExc``) landing in a wgpu-py call
    right after its native create returned (``create_bind_group``, ``create_command_encoder``:
    where the interrupts that stop a server land) leaves a native object no Python object
    owns: that server's device was never freed, and each server stopped so leaked an OS thread
    for good (SOAK7, SOAK8: 27 -> 39 threads over two soak rounds; 200 servers interrupted
    once each: +42 threads, +120 MB). Reused, such a device costs nothing more: the devices
    open are bounded by the most backends of an adapter open at once."""
    with _IDLE_LOCK:
        idle = _IDLE_DEVICES.get(key)
        return idle.pop() if idle else None


def _park_device(key, dev) -> None:
    """Keep ``dev`` (a closed backend's, its queue thread ended) for the next backend of its
    adapter (:func:`_take_device`)."""
    with _IDLE_LOCK:
        _IDLE_DEVICES.setdefault(key, []).append(dev)


def describe(adapter) -> str:
    """``"<adapter name> [<backend type>, <adapter type>]"``.

    E.g. ``"llvmpipe (LLVM 15.0.7, 256 bits) [Vulkan, CPU]"``.
    """
    info = adapter.info
    name = info.get("device") or info.get("description") or "unknown adapter"
    return f"{name} [{info.get('backend_type', '?')}, {info.get('adapter_type', '?')}]"


class WgpuProgram:
    """A compiled kernel: its compute pipeline and bind-group layout (plus the kernel)."""

    __slots__ = ("kernel", "pipeline", "layout", "nbind", "has_params", "checked")

    def __init__(self, kernel, pipeline, layout):
        self.kernel, self.pipeline, self.layout = kernel, pipeline, layout
        self.nbind = len(kernel.bindings)
        self.has_params = bool(kernel.params)
        self.checked = bool(kernel.checks)     # binds the backend's err_flag (Kernel.checks)

    def __repr__(self):
        return f"WgpuProgram({self.kernel.name!r})"


class WgpuStream:
    """A logical stream: an open command encoder and compute pass not yet submitted.

    ``log`` lists what the open batch holds, ``(graph or None, tasks, mark or None)``, so a
    batch that fails validation can be split into its dispatches. ``errors``: failures found
    after the enqueue (at submit: server's owner or queue thread), reported by the stream's
    next completion (a deque: appended and drained on different threads). ``released``: the
    server forgot it; an error found later goes to the backend's ``failures`` instead.
    ``fence``: the readback ``release_stream`` waits for (None before it is asked).
    """

    __slots__ = ("encoder", "cpass", "pipeline", "tasks", "log", "errors", "released", "fence")

    def __init__(self):
        self.released = False
        self.fence = None
        self.encoder = self.cpass = self.pipeline = None
        self.tasks = 0     # dispatches encoded since the last submit
        self.log: list = []
        self.errors = ErrorQueue()
        self.released = False      # reclaimed: later errors go to the backend's ``failures``


class WgpuBackend(Backend):
    """WebGPU device verbs over one ``GPUDevice`` and its one ``GPUQueue``.

    Args:
        device: index of the adapter in the ranked list (0 = best; see :func:`select_adapter`).
        adapter: optional substring preferring an adapter by name or backend (``"vulkan"``).
        max_tasks: dispatches batched per stream before a submit (default 32, or
            ``RUNTIME_WGPU_MAX_TASKS``).
        max_inflight: submits allowed unfinished before the queue thread waits for a fence
            (default 8, or ``RUNTIME_WGPU_MAX_INFLIGHT``).
    Raises:
        UnsupportedError: no adapter (with the hint ``apt-get install -y mesa-vulkan-drivers``).
        TypeError: an option it does not take (``runtime.client("wgpu", seed=1)``: the cpu
            backend's ``scheduler``/``seed``/``threads`` mean nothing here), before a device opens.
    Backends: software graphs (``hardware_graphs = False``); fresh allocations inside a capture
        window are retained by the server, not refused.
    See also: ``GPUAdapter.request_device_sync``; CubeCL ``cubecl-wgpu/src/compute/server.rs``.
    """

    name = "wgpu"
    hardware_graphs = False

    @staticmethod
    def probe() -> dict:
        """``{"hardware": bool, "device": name}`` of the adapter ``WgpuBackend()`` would open,
        without opening a device (``backend=None`` skips software adapters).

        Raises: ``UnsupportedError`` when there is no adapter (with the install hint), or in a
        forked child of a process that opened a device (:func:`_refuse_after_fork`).
        """
        _refuse_after_fork()
        adapter = select_adapter(0)
        return {"hardware": adapter.info.get("adapter_type") in ("DiscreteGPU", "IntegratedGPU"),
                "device": describe(adapter)}

    #: wgpu-py starts threads of its own (a device's poll thread): opened on a thread of its
    #: own (runtime.server._open, SOAK7)
    foreign_threads = True

    def __init__(self, device: int = 0, adapter: str | None = None, max_tasks: int | None = None,
                 max_inflight: int | None = None, **options):
        if options:
            raise TypeError(f"the wgpu backend takes no option {', '.join(map(repr, sorted(options)))}"
                            ": it takes adapter=, max_tasks=, max_inflight= (and check=, "
                            "max_idle_bytes=, as every backend); scheduler=, seed=, threads= and "
                            "blas_threads= are the cpu backend's")
        super().__init__(device)
        _refuse_after_fork()
        self.adapter = select_adapter(device, adapter)
        self.device_name = describe(self.adapter)
        have = self.adapter.limits
        limits = {k: have[k] for k in _LIMITS if k in have}
        # (SOAK9) a closed backend's device of this adapter when there is one (_take_device)
        self._device_key = (int(device), adapter or os.environ.get("RUNTIME_WGPU_ADAPTER"),
                            self.device_name)
        self._parked = False
        self.dev = _take_device(self._device_key)
        if self.dev is None:
            try:
                self.dev = self.adapter.request_device_sync(required_limits=limits)
            except Exception as exc:  # noqa: BLE001 - any device-creation failure: unsupported
                raise UnsupportedError(f"wgpu: cannot open {self.device_name}: {exc}") from exc
        global _DEVICE_PID
        _DEVICE_PID = os.getpid()
        self.queue = self.dev.queue
        self.limits = self.dev.limits
        self.max_tasks = int(max_tasks or os.environ.get("RUNTIME_WGPU_MAX_TASKS", 32))
        self.max_workgroups = (self.limits["max-compute-workgroups-per-dimension"],) * 3
        self._open: set = set()          # streams with an encoder not yet submitted
        self._uniforms: dict = {}        # uniform bytes -> GPUBuffer (immutable once made)
        self._groups: dict = {}          # (program, uniform bytes, args) -> GPUBindGroup
        self._groups_of: dict = {}       # GPUBuffer -> keys of the bind groups using it
        self._groups_by: dict = {}       # WgpuProgram -> keys of its bind groups
        self._fence_src = self._new_buffer(4, _STORAGE)
        self._fence_dst = self._new_buffer(4, wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        # err_flag of kernels with device-side checks (Kernel.checks), read back and zeroed
        # after each submit holding one (QueueThread._check_device); zero when created
        self._err = self._new_buffer(4, _STORAGE)
        self._err_read = self._new_buffer(4, wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        self.qt = QueueThread(self, int(max_inflight
                                        or os.environ.get("RUNTIME_WGPU_MAX_INFLIGHT", 8)))

    @property
    def submits(self) -> int:
        """``queue.submit`` calls so far (tests and benchmarks read it)."""
        return self.qt.submits

    def load(self) -> tuple:
        """``(dispatches + other operations, bytes of writes)`` queued on the queue thread."""
        qt = self.qt
        return (qt.items, qt.bytes)

    def _queue_error(self, op, exc) -> None:
        """An operation of the queue thread failed; never dropped silently. A read fails its
        completion; a refused submit of a stream's batch fails the marks of the work it held
        (what it would have written reads as stale) and is reported on that stream (its next
        completion); a loop-status or device-check readback that fails fails the mark of the
        work it checks (its outcome is unknown); a refused write or readback submit is reported
        unattributed (the next blocking call on any stream raises it)."""
        kind, obj, _ = op
        if kind == _MAP:
            err = LaunchError(f"wgpu: reading back {obj.size} bytes failed: {exc}")
            obj.fail(unhealthy(error_list(obj.error) + [err]) if obj.error else err)
            obj.issued.set()
        elif kind == _SUBMIT and type(obj) is _Batch:
            err = _gpu_error(exc, "a submit")
            for mark in obj.marks:
                mark.fail(err)
            s = obj.stream
            (self.failures if s.released else s.errors).append(err)
        elif kind in (_CHECK, _DEVCHECK):     # its work's outcome is unknown: failed
            mark, s = obj[1], obj[2]
            err = _gpu_error(exc, "reading back a replay's loop status" if kind == _CHECK
                             else "reading back a device-side check")
            (self.failures if s.released else s.errors).append(
                mark.fail(err) if mark is not None else err)
        elif kind in (_SUBMIT, _WRITE):
            what = "a submit" if kind == _SUBMIT else "a write_buffer"
            self.failures.append(_gpu_error(exc, what))

    def is_alive(self) -> bool:
        """False once the queue thread stopped or died (waiting callers get ``ServerClosed``)."""
        qt = self.qt
        return not qt.closed and _threads.is_alive(qt._thread)   # (SOAK8)

    # -- memory ------------------------------------------------------------------------
    def _new_buffer(self, nbytes: int, usage):
        if nbytes > self.limits["max-buffer-size"]:
            raise OutOfMemory(f"wgpu: cannot allocate {nbytes} bytes: the adapter's "
                              f"max-buffer-size is {self.limits['max-buffer-size']} bytes "
                              f"({self.device_name})")
        try:
            return self.dev.create_buffer(size=nbytes, usage=usage)
        except Exception as exc:  # noqa: BLE001 - GPUValidationError / GPUOutOfMemoryError
            raise OutOfMemory(f"wgpu: cannot allocate {nbytes} bytes: {str(exc).strip()}") from exc

    def alloc(self, nbytes: int):
        """A storage buffer of ``nbytes`` rounded up to 4 bytes (at least 4).

        Raises: ``OutOfMemory`` past ``max-buffer-size`` or when the device refuses.
        See also: ``GPUDevice.create_buffer`` (usage STORAGE|COPY_SRC|COPY_DST|INDIRECT).
        """
        return self._new_buffer(_align4(nbytes), _STORAGE)

    def free(self, buf) -> None:
        """Destroy ``buf`` and forget the bind groups that use it (``GPUBuffer.destroy``).

        Pending encoders are submitted first and the destroy runs on the queue thread after
        those submits: an encoded dispatch on a destroyed buffer would fail validation at
        submit; submitted work keeps the memory until it completes.
        """
        for key in self._groups_of.pop(buf, ()):
            self._forget_group(key, buf)
        self._submit_all()
        self.qt.push((_DESTROY, buf, 0))

    # -- streams and events -------------------------------------------------------------
    def new_stream(self):
        """A logical stream over the one queue (its own encoder, submitted in order)."""
        return WgpuStream()

    def _submit(self, s: WgpuStream) -> None:
        """Finish the stream's encoder, if it has one, and hand it to the queue thread. A batch
        that fails validation is split (see :meth:`_split`); this never raises for it."""
        enc = s.encoder
        if enc is None:
            return
        s.cpass.end()
        s.encoder = s.cpass = s.pipeline = None
        self._open.discard(s)
        n, s.tasks = s.tasks, 0
        log, s.log = s.log, []
        try:
            cbs = [enc.finish()]
        except Exception:  # noqa: BLE001 - validation error of one batched dispatch
            cbs = self._split(s, log)
            n = 1
        marks = tuple(m for _, _, m in log if m is not None)
        for cb in cbs:
            self.qt.push((_SUBMIT, _Batch(cb, s, marks), n))

    def _split(self, s: WgpuStream, log) -> list:
        """Encode each dispatch of a refused batch alone, in order: the valid ones become
        command buffers, each invalid one fails its launch's (or replay's) mark and is reported
        on the stream, naming its kernel (and graph: ``Mark.fail``)."""
        cbs = []
        for graph, tasks, mark in log:
            for pipeline, group, xyz, indirect, kernel, written in tasks:
                enc = self.dev.create_command_encoder()
                cpass = enc.begin_compute_pass()
                cpass.set_pipeline(pipeline)
                cpass.set_bind_group(0, group)
                if indirect is None:
                    cpass.dispatch_workgroups(*xyz)
                else:
                    cpass.dispatch_workgroups_indirect(indirect, xyz or 0)
                cpass.end()
                try:
                    cbs.append(enc.finish())
                except Exception as exc:  # noqa: BLE001 - GPUValidationError
                    err = _gpu_error(exc, f"dispatch of kernel {kernel.name}"
                                     + (": the dispatch did not run" if graph else ""))
                    s.errors.append(err if mark is None else mark.fail(err))
        return cbs

    def _submit_all(self) -> None:
        for s in list(self._open):
            self._submit(s)

    def _pass(self, s: WgpuStream):
        if s.cpass is None:
            s.encoder = self.dev.create_command_encoder()
            s.cpass = s.encoder.begin_compute_pass()
            self._open.add(s)
        return s.cpass

    def release_stream(self, stream) -> bool:
        """Forget ``stream`` once the device ran its work (True); False before, ask again
        later (``Backend.release_stream``). The first call submits its batch and a fence
        readback behind it; each call polls that fence without waiting. Errors it reported
        and did not hand to a completion yet go to ``failures``: never dropped.

        (Before ADV9 it returned True once submitted: the server then took the stream's marks
        as final, so a launch on another stream reading a buffer whose writer's device-side
        check (``Kernel.checks``) was not read back yet took it as clean, and its result read
        back the failed data with no error.)"""
        if stream.fence is None:
            self._submit(stream)
            stream.fence = self._readback(self._fence_src, 4, None)
        if not stream.fence.wait(0):            # (polls: never waits for the device)
            return False
        stream.released = True
        self.failures.extend(stream.errors.take())
        return True


    def record_event(self, stream):
        """A token for "everything enqueued on ``stream`` so far" (the stream itself: on one
        queue, submitting its pending work is what orders later work after it)."""
        return stream

    def wait_event(self, stream, event) -> None:
        """Submit the event's stream's pending work, so anything ``stream`` submits later runs
        after it (docs/contract.md section 3: the single queue's submission order)."""
        if event is not stream:
            self._submit(event)

    def flush(self, stream) -> None:
        """Submit ``stream``'s batched dispatches now (``GPUQueue.submit``)."""
        self._submit(stream)

    def _readback(self, src, size: int, nbytes, stream=None):
        """Copy ``size`` bytes of ``src`` into a staging buffer and map them, on the queue
        thread; returns the :class:`MapCompletion` (``nbytes`` None: a fence, no value), which
        reports ``stream``'s errors."""
        cls = 4 if size == 4 else 1 << max(12, (size - 1).bit_length())
        lst = self.qt.free_staging.get(cls)
        staging = lst.pop() if lst else None
        if staging is None:
            staging = self._new_buffer(cls, wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        enc = self.dev.create_command_encoder()
        enc.copy_buffer_to_buffer(src, 0, staging, 0, size)
        comp = MapCompletion(self.qt, staging, size, nbytes, stream)
        self.qt.push((_SUBMIT, enc.finish(), 1))
        self.qt.push((_MAP, comp, 0))
        return comp

    def synchronize(self, stream) -> Completion:
        """Submit ``stream``'s work; the completion finishes once the device ran it.

        Returns: a :class:`MapCompletion` of a 4-byte fence (value None); the caller waits.
        Streams: waits for ``stream`` and, since the queue is shared, for all work submitted
            before it.
        See also: ``GPUQueue.submit``, ``GPUBuffer.map_async`` on a 4-byte fence buffer.
        """
        self._submit(stream)
        return self._readback(self._fence_src, 4, None, stream)

    # -- copies -------------------------------------------------------------------------
    def copy_in(self, stream, buf, data: np.ndarray) -> None:
        """Write ``data`` (uint8) to the start of ``buf``, after all work issued before it.

        ``queue.write_buffer`` lands at the next submit, ahead of encoded-but-unsubmitted work,
        so every stream's pending encoder is submitted first (they share the queue).
        Raises: ``InvalidHandle`` when the data does not fit.
        Streams: after everything issued before it on every stream (``write_buffer`` runs on
            the queue thread, after the submits issued before it).
        See also: ``GPUQueue.write_buffer`` (sizes padded to 4 bytes).
        """
        n = int(data.nbytes)
        if n == 0:
            return
        if n > buf.size:
            raise InvalidHandle(f"wgpu: write of {n} bytes into a buffer of {buf.size} bytes")
        self._submit_all()
        if n % 4:
            data = np.concatenate([np.ravel(data).view(np.uint8), np.zeros(-n % 4, np.uint8)])
        self.qt.push((_WRITE, buf, data))

    def copy_out(self, stream, buf, nbytes: int) -> Completion:
        """Copy the first ``nbytes`` of ``buf`` to the host after ``stream``'s work.

        Returns: a :class:`MapCompletion` (value: ``uint8`` array of ``nbytes``); returns at
            once, the caller's thread waits for the map (never the server).
        Streams: after ``stream``'s work (other streams' writes are ordered by ``wait_event``).
        See also: ``GPUCommandEncoder.copy_buffer_to_buffer`` into a ``MAP_READ`` staging
        buffer, then ``GPUBuffer.map_async`` / ``read_mapped`` / ``unmap``.
        """
        nbytes = int(nbytes)
        if nbytes == 0:
            return Completion.ready(np.zeros(0, np.uint8))
        self._submit(stream)
        return self._readback(buf, _align4(nbytes), nbytes, stream)

    # -- kernels ------------------------------------------------------------------------
    def compile(self, kernel) -> WgpuProgram:
        """A compute pipeline for ``kernel.wgsl`` with an explicit bind-group layout.

        Raises: ``LaunchError`` when the kernel has no WGSL or the WGSL fails to compile
            (the compiler's message included).
        See also: ``GPUDevice.create_shader_module``, ``create_bind_group_layout``,
            ``create_compute_pipeline``.
        """
        if not kernel.wgsl:
            raise LaunchError(f"kernel {kernel.name} has no WGSL source; the wgpu backend needs "
                              f"Kernel(..., wgsl=...)")
        entries = [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {"type": "read-only-storage" if b.access == "read" else "storage"}}
                   for i, b in enumerate(kernel.bindings)]
        if kernel.params:
            entries.append({"binding": len(kernel.bindings), "visibility": wgpu.ShaderStage.COMPUTE,
                            "buffer": {"type": "uniform"}})
        if kernel.checks:               # err_flag (Kernel.checks), after the others
            entries.append({"binding": len(entries), "visibility": wgpu.ShaderStage.COMPUTE,
                            "buffer": {"type": "storage"}})
        try:
            module = self.dev.create_shader_module(label=kernel.name, code=kernel.wgsl)
            layout = self.dev.create_bind_group_layout(entries=entries)
            pipeline = self.dev.create_compute_pipeline(
                label=kernel.name,
                layout=self.dev.create_pipeline_layout(bind_group_layouts=[layout]),
                compute={"module": module, "entry_point": "main"})
        except Exception as exc:  # noqa: BLE001 - GPUValidationError carries the compiler message
            raise LaunchError(f"kernel {kernel.name}: WGSL compile failed on {self.device_name}: "
                              f"{str(exc).strip()}") from exc
        return WgpuProgram(kernel, pipeline, layout)

    def _uniform(self, data: bytes):
        ubuf = self._uniforms.get(data)
        if ubuf is None:
            if len(self._uniforms) >= _CACHE_MAX:
                self._uniforms.clear()   # bind groups and graphs keep their own references
            # not create_buffer_with_data: it blocks while the queue thread is in a submit
            ubuf = self.dev.create_buffer(size=len(data),
                                          usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
            self.qt.push((_WRITE, ubuf, np.frombuffer(data, np.uint8)))
            self._uniforms[data] = ubuf
        return ubuf

    def _bind_group(self, program: WgpuProgram, args, params: tuple):
        """The bind group of ``program`` over ``args`` (+ the params' uniform buffer), cached."""
        ubytes = program.kernel.uniform_bytes(params) if program.has_params else b""
        key = (program, ubytes, *args)
        group = self._groups.get(key)
        if group is not None:
            return group
        kernel = program.kernel
        if len(args) != program.nbind:
            raise LaunchError(f"kernel {kernel.name} takes {program.nbind} buffers, "
                              f"got {len(args)}")
        entries = [{"binding": i, "resource": {"buffer": buf, "offset": 0, "size": _align4(n)}}
                   for i, (buf, n) in enumerate(args)]
        if program.has_params:
            entries.append({"binding": program.nbind,
                            "resource": {"buffer": self._uniform(ubytes), "offset": 0,
                                         "size": len(ubytes)}})
        if program.checked:
            entries.append({"binding": len(entries),
                            "resource": {"buffer": self._err, "offset": 0, "size": 4}})
        try:
            group = self.dev.create_bind_group(layout=program.layout, entries=entries)
        except Exception as exc:  # noqa: BLE001 - GPUValidationError: sizes, limits
            raise _gpu_error(exc, f"binding the buffers of kernel {kernel.name}") from exc
        if len(self._groups) >= _CACHE_MAX:
            self._groups.clear()
            self._groups_of.clear()
            self._groups_by.clear()
        self._groups[key] = group
        for buf, _ in args:
            self._groups_of.setdefault(buf, set()).add(key)
        self._groups_by.setdefault(program, set()).add(key)
        return group

    def _forget_group(self, key, gone=None) -> None:
        """Drop the cached bind group ``key`` and its entries in the indexes of its program and
        buffers (but ``gone``'s, being popped): a long-lived buffer bound with per-request ones
        kept a key per request in its index, the cache itself staying small."""
        self._groups.pop(key, None)
        keys = self._groups_by.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._groups_by[key[0]]
        for buf, _ in key[2:]:
            if buf is not gone:
                keys = self._groups_of.get(buf)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self._groups_of[buf]

    def release_program(self, program) -> None:
        """Drop the cached bind groups of ``program`` (the server forgot it): they kept its
        pipeline alive, 4,096 of them at most instead of the server's ``MAX_PROGRAMS``."""
        for key in list(self._groups_by.get(program, ())):
            self._forget_group(key)

    def _count(self, program: WgpuProgram, count):
        """``(xyz, None)`` for a static count, ``(None, buf)`` for an indirect one, or None when
        the dispatch is empty."""
        if len(count) == 2:
            return None, count[0]           # at least 12 bytes: checked by the client
        if min(count) == 0:
            return None
        return tuple(count), None   # the per-dimension limit is checked by the client

    def launch(self, stream, program: WgpuProgram, count, args, params: tuple, mark=None) -> None:
        """Encode one dispatch on ``stream``'s batch; submit when ``max_tasks`` are batched.

        Args:
            count: ``(x, y, z)`` workgroups, or ``(buf, nbytes)``: three u32 read at execution.
        Raises: ``LaunchError`` (bad bindings, count over the limit). A dispatch that fails
            validation when its batch is finished fails ``mark`` (module doc).
        Streams: after ``stream``'s earlier work; submitted at ``max_tasks`` or the next blocking
            call, ``flush``, ``wait_event`` from another stream, or ``copy_in``; a kernel with
            device-side checks (``Kernel.checks``) at once, its flag read back after it
            (``QueueThread._check_device``: a failed check fails ``mark``).
        See also: ``GPUComputePassEncoder.set_pipeline``, ``set_bind_group``,
            ``dispatch_workgroups`` / ``dispatch_workgroups_indirect``.
        """
        resolved = self._count(program, count)
        if resolved is None:
            return
        group = self._bind_group(program, args, params)
        cpass = self._pass(stream)
        gate = None
        if resolved[1] is not None:     # an indirect count: checked against the limit first
            gate = self._count_gate(resolved[1], 0)
            cpass.set_pipeline(gate[0])
            cpass.set_bind_group(0, gate[1])
            cpass.dispatch_workgroups(1, 1, 1)
            stream.pipeline = gate[0]
        if stream.pipeline is not program.pipeline:
            cpass.set_pipeline(program.pipeline)
            stream.pipeline = program.pipeline
        cpass.set_bind_group(0, group)
        xyz, indirect = resolved
        if indirect is None:
            cpass.dispatch_workgroups(*xyz)
        else:
            cpass.dispatch_workgroups_indirect(indirect, 0)
        task = (program.pipeline, group, xyz, indirect, program.kernel,
                written_buffers(program.kernel, args))
        stream.log.append((None, (task,) if gate is None else (gate, task), mark))
        stream.tasks += 1 if gate is None else 2
        if program.checked or gate is not None:     # submitted now, its checks read back
            self._submit(stream)
            kernels = ((program.kernel,) if program.checked else ()) + (
                (gate[4],) if gate is not None else ())
            self.qt.push((_DEVCHECK, (kernels, mark, stream), 0))
        elif stream.tasks >= self.max_tasks:
            self._submit(stream)

    # -- graphs ---------------------------------------------------------------------------
    unrolls_loops = True

    def begin_graph(self, stream) -> WgpuGraph:
        """An empty recording for ``stream`` (nothing is encoded while it records)."""
        return WgpuGraph(stream)

    def _task(self, program, count, args, params: tuple, keep_empty: bool = False):
        """One resolved dispatch (see :class:`WgpuGraph`), or None for an empty static one
        (kept as a zero dispatch with ``keep_empty``, so launch indices stay aligned)."""
        resolved = self._count(program, count)
        if resolved is None:
            if not keep_empty:
                return None
            resolved = ((0, 0, 0), None)
        return ((program.pipeline, self._bind_group(program, args, params)) + resolved
                + (program.kernel, written_buffers(program.kernel, args)))

    def record_launch(self, recording: WgpuGraph, program, count, args, params: tuple) -> None:
        """Resolve one dispatch now: pipeline, bind group (uniforms uploaded once), count.

        An indirect count keeps its buffer, read at every replay; inside a conditional node it
        is refused (``LaunchError``: the gate writes the node's indirect counts itself).
        See also: CubeCL ``wstream.rs`` ``record_pipeline``.
        """
        if recording.nodes and len(count) == 2:
            raise LaunchError(f"kernel {program.kernel.name}: an indirect count inside a "
                              "capture_if/capture_while body is not supported on wgpu (the "
                              "node's gate writes the indirect counts); use an (x, y, z) count")
        task = self._task(program, count, args, params, keep_empty=True)
        recording.stack[-1].append(task)

    def end_graph(self, recording: WgpuGraph) -> WgpuGraph:
        """The finished graph (the recording itself; no device work). With conditional nodes,
        ``tasks`` becomes the flattening of ``tree``."""
        recording.stack = []
        big = _oversize(recording.tree)
        if big is not None:
            raise LaunchError(
                f"capture_while on wgpu: loop node {big.index} would unroll to {big.oversize:,} "
                f"dispatches (max_iterations={big.max_iterations:,} x its body and gate), more "
                f"than {MAX_UNROLLED:,} (runtime.backends.wgpu.MAX_UNROLLED): wgpu records one "
                "gated copy of the body per iteration; lower max_iterations, or loop on the host")
        if recording.count:
            self._set_checks(recording)
        recording.tasks = self._flatten(recording.tree)
        recording.checked = _checked(recording.tasks)
        return recording

    def _count_gate(self, buf, offset: int) -> tuple:
        """A dispatch that fails a device-side check when one of the three u32 workgroup counts
        at byte ``offset`` of ``buf`` is past the device's per-dimension limit (WebGPU skips such
        an indirect dispatch without a word: now its launch or replay fails, ``LaunchError``)."""
        prog = getattr(self, "_gate_counts", None)
        if prog is None:
            from ..kernel import Binding, Kernel, Param
            limit = self.max_workgroups[0]
            kernel = Kernel("indirect_count_check", [Binding("counts", "u32", "read")],
                            [Param("at", "u32"), Param("limit", "u32")], (1, 1, 1),
                            wgsl=COUNT_CHECK_WGSL, checks=(
                                f"an indirect workgroup count past the device's per-dimension "
                                f"limit ({limit}): WebGPU ran nothing for that dispatch",))
            prog = self._gate_counts = self.compile(kernel)
        group = self._bind_group(prog, ((buf, offset + 12),),
                                 (offset // 4, self.max_workgroups[0]))
        return (prog.pipeline, group, (1, 1, 1), None, prog.kernel, ())

    # -- conditional nodes (WgpuCond) ------------------------------------------------------
    def _gate_program(self):
        prog = getattr(self, "_gate", None)
        if prog is None:
            from ..kernel import Binding, Kernel, Param
            kernel = Kernel("cond_gate", [Binding("cond", "u32", "read"),
                                          Binding("parent", "u32", "read"),
                                          Binding("flags", "u32", "read_write"),
                                          Binding("counts", "u32", "read"),
                                          Binding("args", "u32", "read_write")],
                            [Param("mode", "u32"), Param("pidx", "u32"), Param("n", "u32")],
                            (1, 1, 1), wgsl=GATE_WGSL)
            prog = self._gate = self.compile(kernel)
            self._one = self._new_buffer(16, _STORAGE)      # the top level's flags: on
            self.qt.push((_WRITE, self._one, np.ones(4, np.uint32).view(np.uint8)))
        return prog

    def begin_cond(self, recording: WgpuGraph, kind: str, cond, max_iterations) -> None:
        """Open a :class:`WgpuCond` (``max_iterations`` is required for a while loop)."""
        if kind == "while" and max_iterations is None:
            raise LaunchError("capture_while on wgpu needs max_iterations (the loop is unrolled)")
        self._gate_program()
        if recording.nodes:
            outer = recording.nodes[-1]
            parent = (outer.flags, 1 if recording.stack[-1] is outer.other else 0)
        else:
            parent = (self._one, 0)
        node = WgpuCond(kind, cond, max_iterations, recording.count, parent,
                        self._new_buffer(16, _STORAGE))
        recording.count += 1
        recording.stack[-1].append(node)
        recording.stack.append(node.then)
        recording.nodes.append(node)

    def else_cond(self, recording: WgpuGraph) -> None:
        recording.stack.pop()
        recording.stack.append(recording.nodes[-1].other)

    def end_cond(self, recording: WgpuGraph) -> None:
        recording.stack.pop()
        self._finish(recording.nodes.pop())

    def _finish(self, node: WgpuCond) -> None:
        """Build ``node.flat``: its gate(s) and its branches' dispatches made indirect."""
        direct = [(t, 0) for t in node.then if isinstance(t, tuple)] + [
            (t, 1) for t in node.other if isinstance(t, tuple)]
        n = len(direct)
        counts = np.zeros((max(n, 1), 4), np.uint32)
        for k, (t, which) in enumerate(direct):
            counts[k, :3] = t[2] if t[3] is None else (0, 0, 0)
            counts[k, 3] = which
        cbuf = self._new_buffer(counts.nbytes, _STORAGE)
        self.qt.push((_WRITE, cbuf, counts.reshape(-1).view(np.uint8)))
        abuf = self._new_buffer(12 * max(n, 1), _STORAGE)
        node.bufs = (cbuf, abuf)
        gate = self._gate
        pbuf, pidx = node.parent
        bufs = [node.cond, (pbuf, 16), (node.flags, 16), (cbuf, counts.nbytes),
                (abuf, 12 * max(n, 1))]

        def gate_task(mode):
            return (gate.pipeline, self._bind_group(gate, bufs, (mode, pidx, 0 if mode == 3 else n)),
                    (1, 1, 1), None, gate.kernel, (node.flags, abuf))
        slot = {}
        for k, (t, _) in enumerate(direct):
            slot[id(t)] = (t[0], t[1], 12 * k, abuf, t[4], t[5])

        def expand(items):
            out = []
            for t in items:
                out.extend([slot[id(t)]] if isinstance(t, tuple) else t.flat)
            return out
        if node.kind == "if":
            node.flat = [gate_task(0)] + expand(node.then) + expand(node.other)
        else:
            body = expand(node.then)
            node.flat = []
            size = node.max_iterations * (len(body) + 1)
            if size > MAX_UNROLLED:             # refused by end_graph, never built
                node.oversize = size
                return
            for j in range(node.max_iterations):
                node.flat.append(gate_task(1 if j == 0 else 2))
                node.flat.extend(body)
            if node.max_iterations == 0:
                node.flat.append(gate_task(1))        # flags[0] = the condition, for mode 3
            node.flat.append(gate_task(3))

    def _set_checks(self, graph: WgpuGraph) -> None:
        """``graph.checks``: the loop nodes whose overflow a replay reads back."""
        checks = []

        def walk(items):
            for t in items:
                if not isinstance(t, tuple):
                    if t.kind == "while":
                        checks.append((t.flags, t))
                    walk(t.then)
                    walk(t.other)
        walk(graph.tree)
        graph.checks = checks
        if checks and (graph.status is None or graph.status.size < 4 * len(checks)):
            graph.status = self._new_buffer(4 * len(checks), wgpu.BufferUsage.MAP_READ
                                            | wgpu.BufferUsage.COPY_DST)

    def _flatten(self, tree) -> list:
        """The dispatches a replay encodes: ``tree``'s, each node's ``flat`` in its place and a
        count check (:meth:`_count_gate`) before each indirect dispatch of the top level (a
        node's own indirect counts are written by its gate, from recorded counts). ``tree``
        itself when it holds neither."""
        if not any(not isinstance(t, tuple) or t[3] is not None for t in tree):
            return tree
        out = []
        for t in tree:
            if not isinstance(t, tuple):
                out.extend(t.flat)
            elif t[3] is not None:
                out += [self._count_gate(t[3], t[2] or 0), t]
            else:
                out.append(t)
        return out

    def update_graph(self, stream, graph: WgpuGraph, changes: dict, conds: dict):
        """Swap in patched dispatches: a new bind group (and uniform) only for the launches in
        ``changes``; a conditional node is rebuilt (gate bind groups, count table) only when
        something in it changed. Replays enqueued before were encoded with the old ones."""
        counter = iter(range(1 << 62))
        built: list = []
        replaced: list = []

        def patch(items, parent):
            out, changed = [], False
            for t in items:
                if isinstance(t, tuple):
                    i = next(counter)
                    if i in changes:
                        if parent is not None and len(changes[i][1]) == 2:
                            raise LaunchError("an indirect count inside a conditional node is "
                                              "not supported on wgpu")
                        t = self._task(*changes[i], keep_empty=True)
                        changed = True
                    out.append(t)
                    continue
                node = WgpuCond(t.kind, conds.get(t.index, t.cond), t.max_iterations, t.index,
                                t.parent, t.flags)
                if parent is not None:
                    node.parent = (parent.flags, t.parent[1])
                node.then, c1 = patch(t.then, node)
                node.other, c2 = patch(t.other, node)
                if c1 or c2 or t.index in conds:
                    built.append(node)
                    replaced.extend(t.bufs)     # its old gate's buffers: forgotten below
                    changed = True
                    out.append(node)
                else:
                    out.append(t)
            return out, changed
        tree, _ = patch(graph.tree, None)
        for node in built:           # innermost first: patch appends children before parents
            self._finish(node)
        for buf in replaced:
            for key in self._groups_of.pop(buf, ()):
                self._forget_group(key, buf)
        graph.tree = tree
        graph.tasks = self._flatten(tree)
        if graph.count:
            self._set_checks(graph)
        graph.checked = _checked(graph.tasks)
        return graph

    def abort_graph(self, recording: WgpuGraph) -> None:
        """Drop an unfinished recording."""
        recording.tasks = recording.tree = []
        recording.stack, recording.nodes = [], []

    def launch_graph(self, stream, graph: WgpuGraph, mark=None) -> None:
        """Re-encode ``graph`` after ``stream``'s pending work and submit it once.

        The pipeline is set only when it changes from the previous dispatch; everything else
        was resolved at capture. Returns once submitted (it does not wait for the device).
        Streams: after ``stream``'s pending work, which goes in the same command buffer.
        See also: ``GPUQueue.submit``; CubeCL ``wstream.rs`` replay.
        """
        if not graph.tasks:
            return
        cpass = self._pass(stream)
        set_pipeline, set_bind_group = cpass.set_pipeline, cpass.set_bind_group
        dispatch, indirect_dispatch = cpass.dispatch_workgroups, cpass.dispatch_workgroups_indirect
        last = stream.pipeline
        for pipeline, group, xyz, indirect, _, _ in graph.tasks:
            if pipeline is not last:
                set_pipeline(pipeline)
                last = pipeline
            set_bind_group(0, group)
            if indirect is None:
                dispatch(*xyz)
            else:
                indirect_dispatch(indirect, xyz or 0)
        stream.pipeline = last
        stream.tasks += len(graph.tasks)
        stream.log.append((graph, graph.tasks, mark))
        checks = graph.checks
        if checks:                   # capture_while nodes: read back whether a loop ran out
            cpass.end()
            enc = stream.encoder
            for i, (flags, _) in enumerate(checks):
                enc.copy_buffer_to_buffer(flags, 8, graph.status, 4 * i, 4)
            stream.cpass, stream.pipeline = enc.begin_compute_pass(), None
        self._submit(stream)
        if checks:
            self.qt.push((_CHECK, (graph, mark, stream), 0))
        if graph.checked:            # device-side checks (Kernel.checks): read back after it
            self.qt.push((_DEVCHECK, (graph.checked, mark, stream), 0))

    def destroy_graph(self, stream, graph: WgpuGraph) -> None:
        """Submit ``stream``'s pending work, then drop the graph's references: submitted command
        buffers keep what they use alive, so queue order is enough (no host wait)."""
        self._submit(stream)
        graph.tasks = []
        self._forget_nodes(graph.tree)

    def _forget_nodes(self, items) -> None:
        """Forget the cached gate bind groups over conditional nodes' own buffers (flags, count
        table, indirect args): the cache kept them, and the buffers, after the graph was
        destroyed, up to ``_CACHE_MAX`` groups (SOAK6). Graphs hold their own groups."""
        for t in items:
            if not isinstance(t, tuple):
                for buf in (t.flags, *t.bufs):
                    for key in self._groups_of.pop(buf, ()):
                        self._forget_group(key, buf)
                self._forget_nodes(t.then)
                self._forget_nodes(t.other)

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the queue thread (what it still holds fails with ``ServerClosed``; joined for
        at most 1 s) and drop the caches; the device is kept for the next backend of its
        adapter (:func:`_take_device`) once the queue thread ended."""
        try:
            self.qt.close()
        finally:
            self._groups.clear()
            self._groups_of.clear()
            self._groups_by.clear()
            self._uniforms.clear()
            self._open.clear()
            if not self._parked and not _threads.is_alive(self.qt._thread):
                self._parked = True
                _park_device(self._device_key, self.dev)
