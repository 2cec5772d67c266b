"""The wgpu backend: WebGPU through wgpu-py, on a hardware adapter or Mesa's lavapipe/llvmpipe.

Device verbs only (see ``runtime.backends.base``); the server owns every policy. Shape:

- Buffers are storage buffers (``STORAGE | COPY_SRC | COPY_DST | INDIRECT``), sizes rounded up
  to 4 bytes. Reads go through a reusable ``MAP_READ`` staging buffer.
- Logical streams share the one ``GPUQueue``. Each stream batches its dispatches into a command
  encoder (one open compute pass) and submits it every ``max_tasks`` dispatches (default 32, as
  CubeCL's ``tasks_max``) or at the next blocking call. On one queue, submission order is the
  execution order, so an event is "submit the recording stream's pending work" (design.md 3).
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

wgpu-py objects are only touched by the server's single owner. ``queue.on_submitted_work_done``
is not used (broken in wgpu 0.32.0): waiting maps a 4-byte buffer after a copy instead.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import InvalidHandle, LaunchError, OutOfMemory, UnsupportedError
from .base import Backend, Completion

# Mesa's drivers complain on stderr when XDG_RUNTIME_DIR is unset (headless machines, CI);
# they only need it to exist, and never write there for compute.
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

try:
    import wgpu
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise UnsupportedError(f"the wgpu backend needs wgpu-py: pip install wgpu ({exc})") from exc

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


def describe(adapter) -> str:
    """``"<adapter name> [<backend type>, <adapter type>]"``.

    E.g. ``"llvmpipe (LLVM 15.0.7, 256 bits) [Vulkan, CPU]"``.
    """
    info = adapter.info
    name = info.get("device") or info.get("description") or "unknown adapter"
    return f"{name} [{info.get('backend_type', '?')}, {info.get('adapter_type', '?')}]"


class WgpuProgram:
    """A compiled kernel: its compute pipeline and bind-group layout (plus the kernel)."""

    __slots__ = ("kernel", "pipeline", "layout", "nbind", "has_params")

    def __init__(self, kernel, pipeline, layout):
        self.kernel, self.pipeline, self.layout = kernel, pipeline, layout
        self.nbind = len(kernel.bindings)
        self.has_params = bool(kernel.params)

    def __repr__(self):
        return f"WgpuProgram({self.kernel.name!r})"


class WgpuStream:
    """A logical stream: an open command encoder and compute pass not yet submitted."""

    __slots__ = ("encoder", "cpass", "pipeline", "tasks")

    def __init__(self):
        self.encoder = self.cpass = self.pipeline = None
        self.tasks = 0     # dispatches encoded since the last submit


class WgpuGraph:
    """A software graph: resolved dispatches ``(pipeline, bind_group, count, indirect_buf)``.

    Holding the bind groups keeps their buffers and uniform buffers alive on the device side;
    the server retains the runtime handles (CubeCL ``cubecl-wgpu/src/compute/graph.rs``).
    """

    __slots__ = ("stream", "tasks")

    def __init__(self, stream):
        self.stream, self.tasks = stream, []

    def __len__(self):
        return len(self.tasks)


class WgpuBackend(Backend):
    """WebGPU device verbs over one ``GPUDevice`` and its one ``GPUQueue``.

    Args:
        device: index of the adapter in the ranked list (0 = best; see :func:`select_adapter`).
        adapter: optional substring preferring an adapter by name or backend (``"vulkan"``).
        max_tasks: dispatches batched per stream before a submit (default 32, or
            ``RUNTIME_WGPU_MAX_TASKS``).
    Raises:
        UnsupportedError: no adapter (with the hint ``apt-get install -y mesa-vulkan-drivers``).
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

        Raises: ``UnsupportedError`` when there is no adapter (with the install hint).
        """
        adapter = select_adapter(0)
        return {"hardware": adapter.info.get("adapter_type") in ("DiscreteGPU", "IntegratedGPU"),
                "device": describe(adapter)}

    def __init__(self, device: int = 0, adapter: str | None = None, max_tasks: int | None = None,
                 **options):
        super().__init__(device, **options)
        self.adapter = select_adapter(device, adapter)
        self.device_name = describe(self.adapter)
        have = self.adapter.limits
        limits = {k: have[k] for k in _LIMITS if k in have}
        try:
            self.dev = self.adapter.request_device_sync(required_limits=limits)
        except Exception as exc:  # noqa: BLE001 - any device-creation failure means unsupported
            raise UnsupportedError(f"wgpu: cannot open {self.device_name}: {exc}") from exc
        self.queue = self.dev.queue
        self.limits = self.dev.limits
        self.max_tasks = int(max_tasks or os.environ.get("RUNTIME_WGPU_MAX_TASKS", 32))
        self.max_workgroups = (self.limits["max-compute-workgroups-per-dimension"],) * 3
        self._open: set = set()          # streams with an encoder not yet submitted
        self._uniforms: dict = {}        # uniform bytes -> GPUBuffer (immutable once made)
        self._groups: dict = {}          # (program, uniform bytes, args) -> GPUBindGroup
        self._groups_of: dict = {}       # GPUBuffer -> keys of the bind groups using it
        self._staging = None             # MAP_READ buffer reused by copy_out
        self._fence_src = self._new_buffer(4, _STORAGE)
        self._fence_dst = self._new_buffer(4, wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        self.submits = 0                 # queue.submit calls so far (tests and benchmarks read it)

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

        Pending encoders are submitted first: an encoded dispatch on a destroyed buffer would
        fail validation at submit; submitted work keeps the memory until it completes.
        """
        for key in self._groups_of.pop(buf, ()):
            self._groups.pop(key, None)
        self._submit_all()
        buf.destroy()

    # -- streams and events -------------------------------------------------------------
    def new_stream(self):
        """A logical stream over the one queue (its own encoder, submitted in order)."""
        return WgpuStream()

    def _submit(self, s: WgpuStream) -> None:
        """Finish and submit the stream's encoder, if it has one."""
        enc = s.encoder
        if enc is None:
            return
        s.cpass.end()
        s.encoder = s.cpass = s.pipeline = None
        self._open.discard(s)
        n, s.tasks = s.tasks, 0
        try:
            cb = enc.finish()
        except Exception as exc:  # noqa: BLE001 - validation error in one batched dispatch
            raise _gpu_error(exc, f"encoding a batch of {n} dispatch(es)") from exc
        self.queue.submit([cb])
        self.submits += 1

    def _submit_all(self) -> None:
        for s in list(self._open):
            self._submit(s)

    def _pass(self, s: WgpuStream):
        if s.cpass is None:
            s.encoder = self.dev.create_command_encoder()
            s.cpass = s.encoder.begin_compute_pass()
            self._open.add(s)
        return s.cpass

    def record_event(self, stream):
        """A token for "everything enqueued on ``stream`` so far" (the stream itself: on one
        queue, submitting its pending work is what orders later work after it)."""
        return stream

    def wait_event(self, stream, event) -> None:
        """Submit the event's stream's pending work, so anything ``stream`` submits later runs
        after it (design.md section 3: the single queue's submission order)."""
        if event is not stream:
            self._submit(event)

    def flush(self, stream) -> None:
        """Submit ``stream``'s batched dispatches now (``GPUQueue.submit``)."""
        self._submit(stream)

    def _wait_idle(self) -> None:
        # Maps complete in queue order: once this copy's map resolves, every earlier submission
        # has finished (the documented way to wait; no on_submitted_work_done).
        enc = self.dev.create_command_encoder()
        enc.copy_buffer_to_buffer(self._fence_src, 0, self._fence_dst, 0, 4)
        self.queue.submit([enc.finish()])
        self.submits += 1
        self._fence_dst.map_sync(wgpu.MapMode.READ)
        self._fence_dst.unmap()

    def synchronize(self, stream) -> Completion:
        """Submit ``stream``'s work and wait until the device finished it; blocks.

        Returns: ``Completion.ready(None)``.
        Raises: ``LaunchError`` when the batch fails validation at submit.
        Streams: waits for ``stream`` and, since the queue is shared, for all work submitted
            before it.
        See also: ``GPUQueue.submit``, ``GPUBuffer.map_sync`` on a 4-byte fence buffer.
        """
        self._submit(stream)
        self._wait_idle()
        return Completion.ready(None)

    # -- copies -------------------------------------------------------------------------
    def copy_in(self, stream, buf, data: np.ndarray) -> None:
        """Write ``data`` (uint8) to the start of ``buf``, after all work issued before it.

        ``queue.write_buffer`` lands at the next submit, ahead of encoded-but-unsubmitted work,
        so every stream's pending encoder is submitted first (they share the queue).
        Raises: ``InvalidHandle`` when the queue refuses the write (a destroyed buffer).
        Streams: after everything issued before it on every stream.
        See also: ``GPUQueue.write_buffer`` (sizes padded to 4 bytes).
        """
        n = int(data.nbytes)
        if n == 0:
            return
        self._submit_all()
        if n % 4:
            data = np.concatenate([np.ravel(data).view(np.uint8), np.zeros(-n % 4, np.uint8)])
        try:
            self.queue.write_buffer(buf, 0, data)
        except Exception as exc:  # noqa: BLE001 - GPUValidationError: destroyed or too small
            raise InvalidHandle(f"wgpu: write of {n} bytes failed: {str(exc).strip()}") from exc

    def copy_out(self, stream, buf, nbytes: int) -> Completion:
        """Copy the first ``nbytes`` of ``buf`` to the host after ``stream``'s work; blocks.

        Returns: ``Completion.ready(uint8 array of nbytes)``.
        Streams: after ``stream``'s work (other streams' writes are ordered by ``wait_event``).
        See also: ``GPUCommandEncoder.copy_buffer_to_buffer`` into a ``MAP_READ`` staging
        buffer, then ``GPUBuffer.map_sync`` / ``read_mapped``.
        """
        nbytes = int(nbytes)
        if nbytes == 0:
            return Completion.ready(np.zeros(0, np.uint8))
        self._submit(stream)
        size = _align4(nbytes)
        if self._staging is None or self._staging.size < size:
            if self._staging is not None:
                self._staging.destroy()
            grown = 1 << max(12, (size - 1).bit_length())
            self._staging = self._new_buffer(
                grown, wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        enc = self.dev.create_command_encoder()
        enc.copy_buffer_to_buffer(buf, 0, self._staging, 0, size)
        self.queue.submit([enc.finish()])
        self.submits += 1
        self._staging.map_sync(wgpu.MapMode.READ, 0, size)
        try:
            out = np.frombuffer(self._staging.read_mapped(0, size), np.uint8)[:nbytes]
        finally:
            self._staging.unmap()
        return Completion.ready(out)

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
            ubuf = self.dev.create_buffer_with_data(data=data, usage=wgpu.BufferUsage.UNIFORM)
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
        try:
            group = self.dev.create_bind_group(layout=program.layout, entries=entries)
        except Exception as exc:  # noqa: BLE001 - GPUValidationError: sizes, limits
            raise _gpu_error(exc, f"binding the buffers of kernel {kernel.name}") from exc
        if len(self._groups) >= _CACHE_MAX:
            self._groups.clear()
            self._groups_of.clear()
        self._groups[key] = group
        for buf, _ in args:
            self._groups_of.setdefault(buf, []).append(key)
        return group

    def _count(self, program: WgpuProgram, count):
        """``(xyz, None)`` for a static count, ``(None, buf)`` for an indirect one, or None when
        the dispatch is empty."""
        if len(count) == 2:
            buf, nbytes = count
            if nbytes < 12:
                raise LaunchError(f"kernel {program.kernel.name}: an indirect count buffer needs "
                                  f"3 u32 (12 bytes), got {nbytes} bytes")
            return None, buf
        if min(count) == 0:
            return None
        return tuple(count), None   # the per-dimension limit is checked by the client

    def launch(self, stream, program: WgpuProgram, count, args, params: tuple, fail=None) -> None:
        """Encode one dispatch on ``stream``'s batch; submit when ``max_tasks`` are batched.

        Args:
            count: ``(x, y, z)`` workgroups, or ``(buf, nbytes)``: three u32 read at execution.
        Raises: ``LaunchError`` (bad bindings, count over the limit, a batch failing validation).
        Streams: after ``stream``'s earlier work; submitted at ``max_tasks`` or the next blocking
            call, ``flush``, ``wait_event`` from another stream, or ``copy_in``.
        See also: ``GPUComputePassEncoder.set_pipeline``, ``set_bind_group``,
            ``dispatch_workgroups`` / ``dispatch_workgroups_indirect``.
        """
        resolved = self._count(program, count)
        if resolved is None:
            return
        group = self._bind_group(program, args, params)
        cpass = self._pass(stream)
        if stream.pipeline is not program.pipeline:
            cpass.set_pipeline(program.pipeline)
            stream.pipeline = program.pipeline
        cpass.set_bind_group(0, group)
        xyz, indirect = resolved
        if indirect is None:
            cpass.dispatch_workgroups(*xyz)
        else:
            cpass.dispatch_workgroups_indirect(indirect, 0)
        stream.tasks += 1
        if stream.tasks >= self.max_tasks:
            self._submit(stream)

    # -- graphs ---------------------------------------------------------------------------
    def begin_graph(self, stream) -> WgpuGraph:
        """An empty recording for ``stream`` (nothing is encoded while it records)."""
        return WgpuGraph(stream)

    def record_launch(self, recording: WgpuGraph, program, count, args, params: tuple) -> None:
        """Resolve one dispatch now: pipeline, bind group (uniforms uploaded once), count.

        An empty static dispatch records nothing; an indirect count keeps its buffer, read at
        every replay. See also: CubeCL ``wstream.rs`` ``record_pipeline``.
        """
        resolved = self._count(program, count)
        if resolved is not None:
            recording.tasks.append((program.pipeline, self._bind_group(program, args, params))
                                   + resolved)

    def end_graph(self, recording: WgpuGraph) -> WgpuGraph:
        """The finished graph (the recording itself; no device work)."""
        return recording

    def abort_graph(self, recording: WgpuGraph) -> None:
        """Drop an unfinished recording."""
        recording.tasks = []

    def launch_graph(self, stream, graph: WgpuGraph, fail=None) -> None:
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
        for pipeline, group, xyz, indirect in graph.tasks:
            if pipeline is not last:
                set_pipeline(pipeline)
                last = pipeline
            set_bind_group(0, group)
            if indirect is None:
                dispatch(*xyz)
            else:
                indirect_dispatch(indirect, 0)
        stream.pipeline = last
        stream.tasks += len(graph.tasks)
        self._submit(stream)

    def destroy_graph(self, stream, graph: WgpuGraph) -> None:
        """Submit ``stream``'s pending work, then drop the graph's references: submitted command
        buffers keep what they use alive, so queue order is enough (no host wait)."""
        self._submit(stream)
        graph.tasks = []

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Submit what is pending and drop the caches (the device is released with them)."""
        try:
            self._submit_all()
        finally:
            self._groups.clear()
            self._groups_of.clear()
            self._uniforms.clear()
            self._open.clear()
