"""ComputeClient: the thin client (docs/contract.md section 2; CubeCL ``client.rs``).

Each method checks its Python arguments (``TypeError``/``ValueError``/``InvalidHandle`` at the
call, before anything is queued), reads the stream id, and sends one message: ``submit`` for
fire-and-forget work, ``call`` for blocking work.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from ..errors import (RAISE_THE_LIMIT, InvalidHandle, LaunchError, LoopLimitExceeded,
                      ServerError, UnsupportedError, error_list, unhealthy)
from ..kernel import Kernel, normalize_count
from ..server import get_server
from ..server.server import BUSY
from .graph import Graph, _Owner
from .handle import Handle
from .pool import GraphPool
from ..streams import THREAD_KEYS, Event, StreamId, current_key


#: the iteration bound of ``capture_while(max_iterations=None)`` (eager and cpu replays): a
#: loop whose condition never clears fails with ``LoopLimitExceeded`` instead of hanging.
DEFAULT_MAX_ITERATIONS = 1 << 20


def _as_bytes(data):
    """A private contiguous uint8 copy of ``data`` (numpy array, bytes-like) and its array.
    A non-native byte order (``>f4`` on a little-endian host) is converted to native: kernels
    read native bytes (as torch and cupy, which refuse or convert such arrays); an object array
    is a ``TypeError`` (Python objects have no device layout). A 0-d array or numpy scalar keeps
    its shape ``()`` (``np.ascontiguousarray`` alone makes it ``(1,)``)."""
    if isinstance(data, np.generic):      # np.float32(3): a 0-d array, as torch.tensor(3.0)
        data = np.asarray(data)
    if isinstance(data, np.ndarray):
        if data.dtype.hasobject:
            raise TypeError(f"expected a numpy array of numbers, got dtype {data.dtype} (Python "
                            "objects have no device layout): convert it with .astype(np.float32) "
                            "or another numeric dtype")
        arr = np.ascontiguousarray(data).reshape(data.shape)
        if not arr.dtype.isnative:        # raw big-endian bytes would read as other numbers
            arr = arr.astype(arr.dtype.newbyteorder("="))
    elif isinstance(data, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(bytes(data), np.uint8)
    else:
        raise TypeError(f"expected a numpy array or bytes, got {type(data).__name__}")
    return arr


class ComputeClient:
    """A client of one device server; cheap, any number, any thread.

    Attributes:
        backend: ``"cpu"``, ``"wgpu"`` or ``"cuda"``.
        device: the device index.
        device_name: what the backend runs on (numpy version, wgpu adapter, GPU name).

    Streams: an unpinned client issues work on its calling thread's own stream; ``set_stream``
    pins it. Capture: see ``graph_prepare``/``start_capture``/``stop_capture``, or the
    higher-level ``runtime.capture(fn)`` and ``runtime.StaticGraph`` which do the warm-up and
    stream pinning for you.
    """

    def __init__(self, server, backend: str, device: int, stream=None):
        self._server = server
        self.backend = backend
        self.device = device
        self._pinned = self._pin = None
        if stream is not None:
            self.set_stream(stream)

    @property
    def device_name(self) -> str:
        """What the backend runs on: numpy's version, the wgpu adapter, the GPU's name."""
        return self._server.backend.device_name

    @property
    def capabilities(self) -> dict:
        """What this client's server and device do, the same for every client of the server:

        - ``hardware_graphs`` (bool): a graph is a driver graph, one dispatch per replay (cuda;
          CUDA graphs); a fresh allocation inside a capture window is then refused. False: a
          software graph the server re-issues (cpu, wgpu).
        - ``max_workgroups``: the largest workgroup count per dimension ``(x, y, z)`` (WebGPU's
          ``maxComputeWorkgroupsPerDimension``, CUDA's grid limits), or ``None`` for no limit;
          ``launch`` refuses a larger count with ``LaunchError``.
        - ``checked`` (bool): the server runs the stream-ordering checker (``check=True``;
          see :meth:`checker_violations`).
        - ``indirect_dispatch`` (bool): the device reads an indirect launch's counts when it
          executes, also in a graph replay (cpu, wgpu). False (cuda): ``launch`` reads them on
          the caller's thread first, and a capture window refuses an indirect launch.
        """
        srv = self._server
        mw = srv.backend.max_workgroups
        return {"hardware_graphs": bool(srv.backend.hardware_graphs),
                "max_workgroups": None if mw is None else tuple(mw),
                "checked": srv.checker is not None,
                "indirect_dispatch": bool(srv.backend.indirect_dispatch)}

    def checker_violations(self) -> list:
        """The ``LivenessError`` / ``StreamRaceError`` s the stream-ordering checker of this
        client's server found so far, oldest first: the first 10,000
        (``runtime.server.checker.MAX_VIOLATIONS``; a copy; each was also raised to the call
        that made it, or queued on its stream). All clients of the server share the list.

        Raises: ``UnsupportedError`` when the server runs without the checker (open it with
        ``runtime.client(backend, check=True)`` or ``RUNTIME_CHECK=1``): an empty list would
        read as "no races" when nothing looked.
        """
        checker = self._server.checker
        if checker is None:
            raise UnsupportedError(f"server {self._server.name} runs without the stream-ordering "
                                   f"checker: open it with runtime.client(..., check=True)")
        return list(checker.violations)

    # -- streams ------------------------------------------------------------------------------
    @property
    def stream(self) -> StreamId:
        """The stream this client's work goes to: the pinned one, else the thread's own."""
        return self._pinned if self._pinned is not None else StreamId.current()

    @property
    def _sid(self) -> int:
        # the plain int id sent to the server: its tables never hold a StreamId, so a dropped
        # one lets the server reclaim the stream (runtime.client.stream)
        pin = self._pin
        return pin if pin is not None else current_key()

    def set_stream(self, stream) -> None:
        """Pin this client to ``stream`` (a ``StreamId``); ``None`` unpins.

        Raises: ``TypeError`` for anything else.
        """
        if stream is not None and not isinstance(stream, StreamId):
            raise TypeError(f"set_stream takes a StreamId (runtime.StreamId.new()), got {stream!r}")
        self._pinned = stream
        self._pin = None if stream is None else int(stream)

    def __copy__(self) -> "ComputeClient":
        return self.clone()

    def __deepcopy__(self, memo) -> "ComputeClient":
        return self                 # a client is a reference to the one server of its device

    def __reduce__(self):
        raise TypeError("a ComputeClient talks to this process's device server: it cannot be "
                        "pickled; call runtime.client(...) in the other process")

    def with_stream(self, stream) -> "ComputeClient":
        """A new client on the same server, pinned to ``stream``."""
        c = ComputeClient(self._server, self.backend, self.device)
        c.set_stream(stream)
        return c

    def clone(self) -> "ComputeClient":
        """A new client on the same server with the same pin (CubeCL: clones copy the pin)."""
        return ComputeClient(self._server, self.backend, self.device, self._pinned)

    # -- memory -------------------------------------------------------------------------------
    def create(self, data) -> Handle:
        """Copy a host array to a new device buffer.

        Args:
            data: a numpy array or scalar (any numeric dtype and shape, 0-d included; copied
                now, so later changes to it do not matter; a non-native byte order such as
                ``>f4`` is converted, so the handle's dtype is the native one) or bytes-like
                (``uint8``).
        Returns: a ``Handle`` with the array's ``nbytes``, ``dtype`` and ``shape``; returns at
            once (fire-and-forget).
        Raises: ``TypeError`` (not an array/bytes; an object array); ``ServerClosed``.
            Allocation failures (``OutOfMemory``, after the idle pool was given back and the
            allocation retried once) are queued on the stream and raised by its next blocking
            call.
        Backpressure: waits for room while the device queue is full (docs/contract.md section 1).
        Streams: the copy is ordered on this client's stream.
        Capture: inside a window on this stream the copy is a host write: ``stop_capture``
            refuses the window.
        """
        arr = _as_bytes(data)
        srv = self._server
        sid = self._sid
        h = Handle(srv, sid, arr.nbytes, arr.dtype, arr.shape)
        host = isinstance(data, (np.ndarray, np.generic))      # bytes-like: copied already
        payload = arr.reshape(-1).view(np.uint8).copy() if host else arr
        srv.submit(srv.h_alloc, sid, h.id, arr.nbytes, payload, nbytes=payload.nbytes)
        return h

    def empty(self, shape, dtype=None) -> Handle:
        """A new device buffer with undefined contents.

        Args:
            shape: an int or tuple of elements, with ``dtype``; or, without ``dtype``, an int
                number of bytes (``empty(nbytes)``).
            dtype: numpy dtype (``np.float32``, ``"f4"``...).
        Returns: a ``Handle``; returns at once.
        Raises: ``TypeError``/``ValueError`` for a bad shape or dtype; ``TypeError`` for a tuple
            shape without a dtype (``empty(4)`` is 4 bytes, not torch's 4 floats; a tuple
            names elements, so it needs their dtype).
        Capture: allowed inside a window. Software graphs retain the buffer; on hardware graphs
            a buffer the warm pool cannot serve makes ``stop_capture`` refuse the window.
        """
        if dtype is None:
            if not isinstance(shape, (int, np.integer)):
                raise TypeError(f"empty({shape!r}) needs a dtype: empty(shape, np.float32); only "
                                "empty(nbytes), an int, means raw bytes (uint8)")
            dtype = np.uint8
        dtype = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shp):
            raise ValueError(f"shape must be non-negative ints, got {shape!r}")
        nbytes = math.prod(int(d) for d in shp) * dtype.itemsize   # exact (np.prod wraps)
        srv = self._server
        sid = self._sid
        h = Handle(srv, sid, nbytes, dtype, shp)
        srv.submit(srv.h_alloc, sid, h.id, nbytes, None)
        return h

    def write(self, handle: Handle, data) -> None:
        """Overwrite ``handle``'s buffer in place (same buffer, same device address).

        Args:
            handle: the target.
            data: a numpy array with ``handle.size`` elements (cast to ``handle.dtype`` with
                ``same_kind`` casting), or bytes-like of exactly ``handle.nbytes`` bytes.
        Returns: at once (fire-and-forget); the copy is taken now. Waits for room while the
            device queue is full (its bytes of pending host data count; docs/contract.md section 1).
        Raises: ``InvalidHandle`` (released, foreign, or a size mismatch); ``TypeError`` (not a
            Handle; an array whose dtype does not cast ``same_kind`` to the handle's, e.g. floats
            to an int32 buffer: the message names both); ``ServerClosed`` (also while waiting
            for room).
        Streams: ordered on this client's stream after earlier work on it, and after earlier
            uses of the buffer on other streams (the server inserts event waits).
        Capture: inside a window on this stream it is refused late: ``stop_capture`` raises
            ``CaptureRefused`` and the write is never applied (a graph cannot hold a host write:
            the buffer keeps what it held; a handle made inside that window, which held
            nothing, reads ``ReplayFailed`` until a later write lands, also after
            ``abort_capture``).
        """
        if not isinstance(handle, Handle):
            raise TypeError(f"write takes a Handle, got {type(handle).__name__}")
        hid = handle._check(self._server, "write")
        if isinstance(data, np.ndarray):
            if data.size != handle.size:
                raise InvalidHandle(f"write to handle {hid}: {data.size} elements given, the handle "
                                    f"holds {handle.size} ({handle.nbytes} bytes of {handle.dtype})")
            if not np.can_cast(data.dtype, handle.dtype, casting="same_kind"):
                raise TypeError(f"write to handle {hid}: {data.dtype} data does not cast to the "
                                f"handle's {handle.dtype} (same_kind casting): convert it with "
                                f".astype(np.{np.dtype(handle.dtype).name}) first")
            payload = np.ascontiguousarray(data).astype(handle.dtype, casting="same_kind",
                                                       copy=True).reshape(-1).view(np.uint8)
        else:
            payload = _as_bytes(data)
            if payload.nbytes != handle.nbytes:
                raise InvalidHandle(f"write to handle {hid}: {payload.nbytes} bytes given, the "
                                    f"handle holds {handle.nbytes}")
        srv = self._server
        srv.submit(srv.h_write, self._sid, hid, payload, nbytes=payload.nbytes)

    def read(self, handle: Handle) -> np.ndarray:
        """Copy ``handle``'s buffer to the host.

        Returns: a new ``np.ndarray`` of ``handle.dtype`` and ``handle.shape``. Blocks until the
            work before it on this stream (and the buffer's last write on any stream) ran.
            A graph replay is the exception (seed 001): it orders only against its capture
            stream, so read what it writes on ``g.stream`` (``client.with_stream(g.stream)``)
            or after a sync of or an event on that stream; from another stream the read races
            the replay (``check=True`` raises ``StreamRaceError``; docs/contract.md section 3).
        Raises: ``CaptureRefused`` (this stream is recording; the window is invalidated, its
            ``stop_capture`` raises too); ``InvalidHandle``; ``ReplayFailed``
            (the buffer's last writer failed, found at enqueue or while this read waited: a
            replay, a launch, a host write; raised on every read until a later write lands);
            ``ServerUnhealthy`` (queued errors of this stream); ``ServerClosed``. Except for
            ``CaptureRefused`` and ``InvalidHandle`` (raised at once), it raises only after
            what a returning read waits for ran (the work before it on this stream and the
            buffer's last write on any stream), together with every error that work left (one
            ``ServerUnhealthy`` that is also an instance of each error's class, e.g. a
            ``ReplayFailed`` and the ``LaunchError`` of this stream's failed launch), once.
        See also: ``cudaMemcpyAsync`` + event sync (cuda), ``map_async`` of a staging buffer (wgpu).
        """
        srv = self._server
        try:                                # a live handle of this server: one identity test
            hid = handle.id if handle._bindable is srv else None
        except AttributeError:
            hid = None
        if hid is None:
            if not isinstance(handle, Handle):
                raise TypeError(f"read takes a Handle, got {type(handle).__name__}")
            hid = handle._check(srv, "read")
        dtype = handle.dtype
        sid = self._pin                             # (self._sid, inlined: the hot path)
        if sid is None:
            try:                                    # (current_key(), inlined)
                sid = THREAD_KEYS.key
            except AttributeError:
                sid = current_key()
        raw = srv.read(sid, hid, dtype)
        if raw is BUSY:                             # the server was not idle: queued
            raw = srv.call(srv.h_read, sid, hid, dtype)
        if raw.__class__ is not np.ndarray:         # (an ndarray: copied at once, clean)
            raw = self._finish_read(raw, hid)
        if raw.dtype is not dtype and raw.dtype != dtype:   # (bytes: not typed by the backend)
            raw = raw.view(dtype)
        return raw if handle._flat else raw.reshape(handle.shape)

    def _finish_read(self, answer, hid: int) -> np.ndarray:
        """Wait for ``h_read``'s ``(completion, mark, errors)`` on this thread and return the
        bytes, or raise what the read must raise (see :meth:`read`); an ``np.ndarray`` answer
        is the bytes (``h_read``'s fast path)."""
        if answer.__class__ is np.ndarray:
            return answer
        comp, mark, errors = answer
        srv = self._server
        if not comp.done:
            srv.wait(comp)
        if mark.error is not None:          # its writer failed (found at enqueue or meanwhile)
            raise mark.stale(hid, errors + error_list(comp.error))
        if errors:                          # queued errors: comp is a fence of the stream
            raise unhealthy(errors + error_list(comp.error))
        return comp.result()

    # -- kernels ------------------------------------------------------------------------------
    def launch(self, kernel: Kernel, count, handles, params=None) -> None:
        """Enqueue one dispatch of ``kernel``.

        Args:
            kernel: a ``runtime.Kernel``.
            count: workgroups, an int or ``(x, y, z)``; or a ``Handle`` holding three ``u32``
                (an indirect dispatch: the counts are read when the launch executes, also on
                every replay of a graph that recorded it; WebGPU ``dispatch_workgroups_indirect``).
                A zero count is a no-op. On a backend whose device does not read counts
                (``capabilities["indirect_dispatch"]`` False: cuda) this call reads them first
                (a blocking read on this stream, raising what a read raises), and inside a
                capture window the launch is refused (``stop_capture`` raises
                ``CaptureRefused``): a hardware graph cannot record a host read.
            handles: one ``Handle`` per binding, in order.
            params: a mapping or sequence of the kernel's params.
        Returns: at once (fire-and-forget); waits for room while the device queue is full. On
            the cpu backend a launch of a kernel with a ``bind`` touching at most 64 KiB on an
            idle server is deferred (issue 26): the next call into the server, from any thread,
            runs it before anything else, the device thread within 20 ms if no call comes
            (docs/contract.md section 1).
        Raises: ``TypeError``/``ValueError`` (bad arguments), ``LaunchError`` (binding count;
            a handle whose elements are not 4 bytes (or 1: raw bytes), e.g. ``float64``; a count
            over the backend's ``max_workgroups`` per dimension; one buffer bound both
            ``read`` and written: the WebGPU rule, kept on every backend), ``InvalidHandle``,
            at the call. A 4-byte handle of another dtype than its binding's (``int32`` data
            bound ``f32``) is not refused: the kernel reads its bits in the binding's dtype, as
            a CUDA kernel reads whatever a pointer points at (``runtime.Tensor`` ops check
            dtypes). Compile and device failures are queued
            on the stream and raised by its next blocking call; a launch that did not run also
            marks the buffers it writes (``ReplayFailed`` on read).
        Streams: on this client's stream, after the last writes of its inputs on other streams.
        Capture: inside a window on this stream it is recorded, not executed.
        """
        if not isinstance(kernel, Kernel):
            raise TypeError(f"launch takes a runtime.Kernel, got {type(kernel).__name__}")
        if isinstance(handles, Handle) or not isinstance(handles, (list, tuple)):
            raise TypeError(f"launch of {kernel.name}: handles must be a list of Handles")
        if len(handles) != len(kernel.bindings):
            raise LaunchError(f"launch of {kernel.name}: it has {len(kernel.bindings)} bindings "
                              f"{[b.name for b in kernel.bindings]}, got {len(handles)} handles")
        srv = self._server
        hids = []
        try:                                      # fast path: live handles of this server
            for h in handles:
                if h._bindable is not srv:
                    break
                hids.append(h.id)
        except AttributeError:
            pass
        if len(hids) != len(handles):
            hids = []
            for b, h in zip(kernel.bindings, handles):
                if not isinstance(h, Handle):
                    raise TypeError(f"launch of {kernel.name}: binding {b.name} needs a Handle, "
                                    f"got {type(h).__name__}")
                if h.dtype.itemsize not in (1, 4):
                    raise LaunchError(f"launch of {kernel.name}: binding {b.name} is {b.dtype} "
                                      f"but handle {h.id} holds {h.dtype}")
                hids.append(h._check(srv, f"launch of {kernel.name}"))
        if (hids[0] == hids[1] if len(hids) == 2 else len(set(hids)) != len(hids)):
            _check_aliasing(kernel, hids)
        if isinstance(count, Handle):
            if count.nbytes < 12:
                raise LaunchError(f"indirect launch of {kernel.name}: the count handle {count.id} "
                                  "must hold three u32 (12 bytes)")
            cnt = count._check(srv, f"indirect launch of {kernel.name}")
            if not srv.backend.indirect_dispatch:
                # the device cannot read the counts (cuda here): this caller reads them first,
                # ordered on its stream, so no server handler waits for the device; inside a
                # capture window the launch goes on indirect and the window refuses it
                answer = srv.call(srv.h_indirect_count, self._sid, cnt)
                if answer is not None:
                    count = tuple(int(v) for v in
                                  self._finish_read(answer, cnt)[:12].view(np.uint32))
        if not isinstance(count, Handle):
            cnt = normalize_count(count)
            if 0 in cnt:
                return
            lim = srv.backend.max_workgroups
            if lim is not None and (cnt[0] > lim[0] or cnt[1] > lim[1] or cnt[2] > lim[2]):
                raise LaunchError(f"launch of {kernel.name}: workgroup count {cnt} exceeds the "
                                  f"{srv.backend.name} limit of {lim} per dimension; split the "
                                  "grid over y and z")
        params = kernel.pack_params(params)
        sid = self._pin                             # (self._sid, inlined: the hot path)
        if sid is None:
            try:                                    # (current_key(), inlined)
                sid = THREAD_KEYS.key
            except AttributeError:
                sid = current_key()
        room = srv.launch(sid, kernel, cnt, hids, params)
        if room is BUSY:                            # the server was not idle: queued
            srv.submit(srv.h_launch, sid, kernel, cnt, hids, params)
        elif room and srv.queue.full():             # enqueued on the device: bounded
            srv.queue.wait_room()

    # -- synchronisation ----------------------------------------------------------------------
    def sync(self) -> None:
        """Wait for everything enqueued on this client's stream.

        Raises: ``CaptureRefused`` (the stream is recording, at once; the window is invalidated);
            ``ServerUnhealthy`` (the errors of the work enqueued on this stream, found at
            enqueue or at execution, all together and drained: raised once, after that work
            ran); ``ServerClosed``.
        See also: ``cudaStreamSynchronize`` (waits, then returns the error).
        """
        srv = self._server
        sid = self._pin                     # (self._sid, inlined: the hot path)
        if sid is None:
            try:                            # (current_key(), inlined)
                sid = THREAD_KEYS.key
            except AttributeError:
                sid = current_key()
        if srv.sync_idle(sid):              # idle stream, nothing to report: no message
            return
        comp, errors = srv.call(srv.h_sync, sid)
        if not comp.done:
            srv.wait(comp)
        if srv.ended_busy:                  # (a hint, read unlocked) ended streams whose
            srv.call(srv.h_reap_ended)      # work this wait may have seen run: reclaim them
        if errors:
            raise unhealthy(errors + error_list(comp.error))
        comp.result()

    def flush(self) -> None:
        """Hand this stream's batched work to the device now and raise its queued errors
        (``ServerUnhealthy``); does not wait for the device."""
        srv = self._server
        srv.call(srv.h_flush, self._sid)

    def record_event(self) -> Event:
        """An :class:`~runtime.Event` after the work enqueued on this stream so far
        (``cudaEventRecord``); pass it to ``wait_event`` of a client of this server (another
        stream, another thread). Blocks until the device thread accepted it.

        Raises: ``CaptureRefused`` (this stream is capturing: the window is invalidated, its
            ``stop_capture`` raises too); ``ServerClosed``.
        """
        srv = self._server
        sid, pos = srv.call(srv.h_record_event, self._sid)
        return Event(sid, pos, srv)

    def wait_event(self, event: Event) -> None:
        """Make this stream wait for ``event`` from ``record_event`` (``cudaStreamWaitEvent``):
        work enqueued here afterwards runs after the event's work.

        Raises: ``TypeError`` (not an ``Event``); ``ValueError`` (an event of another server:
        another backend, device or options); ``CaptureRefused`` (this stream is capturing: the
        join would be missing from the graph, so the window is invalidated and its
        ``stop_capture`` raises too); ``ServerClosed``. A ``(stream, position)`` tuple, what ``record_event`` returned
        before, is accepted with a ``DeprecationWarning`` for one release.
        """
        srv = self._server
        if isinstance(event, Event):
            if event._server is not srv:
                raise ValueError(f"{event!r} was recorded on server "
                                 f"{getattr(event._server, 'name', None)!r}, this client's is "
                                 f"{srv.name!r}: an event orders the streams of one server")
            token = (event.stream, event.position)
        elif isinstance(event, tuple) and len(event) == 2:
            warnings.warn("wait_event((stream, position)) is deprecated: pass the Event "
                          "record_event() returns", DeprecationWarning, stacklevel=2)
            if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                       for v in event) or event[1] < 0:      # (was taken silently: ADV6)
                raise TypeError(f"wait_event((stream, position)) takes a stream id and a "
                                f"position >= 0 (ints), got {event!r}; pass the Event "
                                "record_event() returns")
            token = (int(event[0]), int(event[1]))
        else:
            raise TypeError(f"wait_event takes the Event record_event() returns, got {event!r}")
        srv.call(srv.h_wait_event, self._sid, token)

    # -- capture ------------------------------------------------------------------------------
    def graph_prepare(self, pool=None) -> None:
        """Open a capture on this stream: ``no capture -> prepared``.

        Then run the work once (the warm-up: executes normally, reads allowed), call
        ``start_capture()``, run the same work again (recorded, not executed) and
        ``stop_capture()``. Buffers freed during the warm-up are held back until
        ``start_capture`` so the pool holds everything the recorded run needs.
        The warm-up is optional; this transition is required (CubeCL's state machine).
        For the whole recipe in one call see ``runtime.capture(fn)``.

        Args:
            pool: a ``runtime.GraphPool``: the window allocates from the buffers the pool's
                graphs share first, and its temporaries (window buffers it allocated and
                dropped) join the pool; state it reads before writing stays the graph's own
                (docs/contract.md section 4c). All graphs of a pool capture on one stream.
        Raises: ``GraphStateError`` (already prepared or recording; or ``pool``'s graphs live
            on another stream; state unchanged); ``TypeError`` (``pool`` is not a GraphPool);
            ``ValueError`` (``pool`` belongs to another server).
        """
        srv = self._server
        if pool is None:
            srv.call(srv.h_graph_prepare, self._sid)
            return
        if not isinstance(pool, GraphPool):
            raise TypeError(f"graph_prepare(pool=...) takes a runtime.GraphPool, got {pool!r}")
        srv.call(srv.h_graph_prepare, self._sid, pool._bind(srv))

    def graph_estimate(self) -> dict:
        """What the capture window prepared on this stream will need, from its warm-up so far:
        ``{"bytes": the most bytes the allocations made since graph_prepare() held at once,
        "pool_free_bytes": what its GraphPool could serve when graph_prepare() ran (before the
        warm-up took from it; 0 without a pool), "new_bytes": bytes - pool_free_bytes, at least
        0: the new memory the window needs}``. Call it after the warm-up, before
        ``start_capture()``. Blocks (one round trip)."""
        srv = self._server
        return srv.call(srv.h_graph_estimate, self._sid)

    def start_capture(self) -> None:
        """Start recording this stream's launches: ``prepared -> capturing``.

        Inside the window, on this stream: ``launch`` is recorded, not run; ``read``, ``sync``,
        ``replay``, ``record_event`` and ``wait_event`` raise ``CaptureRefused`` at once;
        ``write``, freeing a handle the window uses and a refused launch are refused late. Any
        refusal invalidates the window: ``stop_capture`` raises ``CaptureRefused`` (CUDA's
        ``cudaErrorStreamCaptureInvalidated``). Other streams work normally meanwhile.

        Blocks until the warm-up has run: a warm-up that failed (at the call, at submit or while
        executing) is never captured over.

        Raises: ``GraphStateError`` (not prepared, or already recording; unchanged);
            ``ServerUnhealthy`` (the warm-up left errors: back to ``no capture``);
            ``UnsupportedError`` (the backend has no graphs).
        """
        srv = self._server
        sid = self._sid
        comp = srv.call(srv.h_warmup_fence, sid)     # the warm-up ran, or its errors are known
        if not comp.done:
            srv.wait(comp)
        srv.call(srv.h_start_capture, sid, comp.error)

    def stop_capture(self, retain: bool = False) -> Graph:
        """Stop recording and return the ``Graph``: ``capturing -> no capture``.

        Args:
            retain: keep every buffer the recording used alive for the graph's life, so its
                handles may be dropped (``runtime.capture`` and ``StaticGraph`` pass True).
                Default: buffers allocated inside the window are retained; caller-owned
                buffers are the caller's to keep alive: a replay after one was freed raises
                ``LivenessError`` (its buffer never goes to another owner while the graph lives).
        Returns: a ``Graph`` (empty window: a graph whose replay does nothing).
        Raises: ``GraphStateError`` (nothing recording; unchanged); ``CaptureRefused`` when any
            operation was refused in the window (at once: read, sync, replay, record_event,
            wait_event; late: write, freed handle, refused launch, allocation on a hardware
            graph), naming the first, with every other error queued in the window (one error
            that is an instance of each class): no graph is made, the stream is back to no
            capture; ``ServerUnhealthy`` (launch errors queued in the window).
        """
        srv = self._server
        sid = self._sid
        gid, hw = srv.call(srv.h_stop_capture, sid, bool(retain))
        return Graph(_Owner(srv, gid), self.stream, hw)

    def abort_capture(self) -> None:
        """Abandon a capture on this stream from any state (``prepared`` or ``capturing``): the
        recording is dropped, buffers held for the window go back to the pool, and the stream
        is back to ``no capture``; a no-op when nothing is open. Queued errors stay queued.
        Blocks until done. See also: CubeCL's capture abort; ``cudaStreamEndCapture`` + drop."""
        srv = self._server
        srv.call(srv.h_abort_capture, self._sid)

    # -- conditionals (docs/contract.md section 4b) ---------------------------------------------
    def _cond_handle(self, cond, what: str) -> int:
        if not isinstance(cond, Handle):
            raise TypeError(f"{what}: cond must be a Handle, got {type(cond).__name__}")
        if cond.nbytes != 4 or cond.dtype not in (np.dtype(np.int32), np.dtype(np.uint32)):
            raise ValueError(f"{what}: cond must be a 1-element int32/uint32 handle, got handle "
                             f"{cond.id} of {cond.nbytes} bytes of {cond.dtype}")
        return cond._check(self._server, what)

    def _cond_value(self, cond) -> bool:
        return bool(self.read(cond).reshape(-1)[0] != 0)

    def capture_if(self, cond, on_true, on_false=None) -> None:
        """Run ``on_true()`` if ``cond`` holds a non-zero value, else ``on_false()``.

        Args:
            cond: a 1-element ``int32``/``uint32`` ``Handle`` (non-zero = true).
            on_true, on_false: callables (no arguments) issuing launches on this client.
        Outside a capture window the condition is read on the host (a blocking ``read`` on
        this stream) and the branch runs eagerly. Inside a window on this stream both
        branches are recorded once, as one conditional node; every replay evaluates ``cond``
        on the device when it reaches the node (cpu: read from the buffer at execution; wgpu:
        a gate dispatch writes the indirect workgroup counts of the branches' dispatches, no
        host round trip; cuda: CUDA 12.4 conditional IF nodes). Nesting: bodies may contain ``capture_if``/``capture_while`` (depth
        2 and more).
        Raises: ``TypeError``/``ValueError`` (bad ``cond`` or bodies); ``UnsupportedError`` at
            capture on a backend without conditional nodes (cuda without cuda-bindings or a
            CUDA 12.4 driver); whatever a body raises (inside a window the window is then
            refused: ``stop_capture`` raises ``CaptureRefused``).
        See also: CUDA conditional IF nodes (``cudaGraphConditionalHandleCreate``), Warp
            ``capture_if``, ``torch.cond``.
        """
        hid = self._cond_handle(cond, "capture_if")
        if not callable(on_true) or (on_false is not None and not callable(on_false)):
            raise TypeError("capture_if: on_true and on_false must be callables")
        srv = self._server
        sid = self._sid
        if not srv.call(srv.h_cond_begin, sid, "if", hid, None, _dtype_name(cond)):
            branch = on_true if self._cond_value(cond) else on_false
            if branch is not None:
                branch()
            return
        self._record_bodies(sid, on_true, on_false)

    def capture_while(self, cond, body, max_iterations=None) -> None:
        """Run ``body()`` while ``cond`` holds a non-zero value (tested before each iteration).

        Args:
            cond: a 1-element ``int32``/``uint32`` ``Handle``; the body usually updates it.
            body: a callable (no arguments) issuing launches on this client.
            max_iterations: the most iterations (an int >= 0). Required on wgpu inside a
                capture (the loop is unrolled to it); None elsewhere means
                ``DEFAULT_MAX_ITERATIONS`` (so a loop never hangs). 0: the body never runs,
                so a condition that holds is ``LoopLimitExceeded`` (below) and a false one a
                no-op.
        Outside a capture window the condition is read on the host before each iteration.
        Inside one the body is recorded once, as a loop node evaluated on the device at every
        replay (cpu: from the buffer; wgpu: ``max_iterations`` gated copies of the body; cuda:
        a CUDA 12.4 conditional WHILE node).
        Raises: ``TypeError``/``ValueError`` (bad arguments; wgpu capture without
            ``max_iterations``); ``LoopLimitExceeded`` eagerly when ``cond`` is still non-zero
            after ``max_iterations`` iterations (the buffers the loop wrote on this stream are
            marked with it: ``ReplayFailed`` on read until rewritten; so are they when the
            loop is stopped early by an error, its body's or a condition read's, a
            KeyboardInterrupt included, which is raised); ``UnsupportedError`` at
            capture on a backend without loop nodes. In a replay an exceeded limit (every
            backend) marks the graph's write set with ``LoopLimitExceeded`` (``ReplayFailed``
            on read).
        See also: CUDA conditional WHILE nodes, Warp ``capture_while``.
        """
        hid = self._cond_handle(cond, "capture_while")
        if not callable(body):
            raise TypeError("capture_while: body must be a callable")
        if max_iterations is not None and (isinstance(max_iterations, bool) or not isinstance(
                max_iterations, (int, np.integer)) or max_iterations < 0):
            raise ValueError(f"capture_while: max_iterations must be an int >= 0 or None, got "
                             f"{max_iterations!r}")
        srv = self._server
        sid = self._sid
        limit = DEFAULT_MAX_ITERATIONS if max_iterations is None else int(max_iterations)
        if not srv.call(srv.h_cond_begin, sid, "while", hid,
                        None if max_iterations is None else int(max_iterations),
                        _dtype_name(cond)):
            done = started = 0
            since = srv.call(srv.h_position, sid)
            try:
                while self._cond_value(cond):
                    if done >= limit:
                        err = LoopLimitExceeded(
                            f"capture_while on stream {int(sid)}: condition handle {hid} was "
                            f"still non-zero after max_iterations={limit} iterations; the loop "
                            f"stopped: {RAISE_THE_LIMIT}")
                        # what the loop wrote is marked, as a replay's write set is: another
                        # reader gets ReplayFailed, never the truncated values without an error
                        started = 0
                        srv.call(srv.h_written_since_failed, sid, since, err)
                        raise err
                    started = 1
                    body()
                    done += 1
            except BaseException as e:
                if started:     # stopped early by an error (ADV9): marked as at the limit
                    self._stopped_loop(sid, since, done, e)
                raise
            return
        self._record_bodies(sid, body, None)

    def _stopped_loop(self, sid, since: int, done: int, exc) -> None:
        """An eager ``capture_while`` on ``sid`` was stopped after ``done`` whole iterations by
        ``exc`` (its body or a condition read raised: a launch's failure, a KeyboardInterrupt):
        what the loop wrote is marked with it, as at the limit, so another reader gets
        ``ReplayFailed``, never the values of an unfinished loop with no error (a server that
        stopped meanwhile has nothing left to mark)."""
        srv = self._server
        err = LaunchError(f"capture_while on stream {int(sid)} was stopped after {done} whole "
                          f"iteration(s) by {type(exc).__name__}: {exc}; what the loop wrote is "
                          "marked until a later write lands")
        try:
            srv.call(srv.h_written_since_failed, sid, since, err)
        except ServerError:
            pass

    def _record_bodies(self, sid, first, second) -> None:
        srv = self._server
        try:
            first()
            if second is not None:
                srv.call(srv.h_cond_else, sid)
                second()
        except BaseException as e:
            srv.call(srv.h_cond_end, sid, f"{type(e).__name__}: {e}")
            raise
        srv.call(srv.h_cond_end, sid, None)

    # -- misc ---------------------------------------------------------------------------------
    def memory_usage(self) -> dict:
        """``{"bytes_reserved", "bytes_in_use", "bytes_idle", "handles", "graphs", "streams",
        "graph_bytes", "graph_pools"}`` of the server (bytes, counts): ``graph_bytes`` the
        window buffers of all live graphs, ``graph_pools`` ``{pool id: GraphPool.memory_usage()}``
        (docs/contract.md section 4c). Blocks (one round trip)."""
        srv = self._server
        return srv.call(srv.h_memory_usage)

    def empty_cache(self) -> int:
        """Give every idle pool buffer back to the device, as ``torch.cuda.empty_cache``.

        Returns: the bytes released (``memory_usage()["bytes_reserved"]`` drops by as much);
            0 while a stream of this server is prepared or capturing (the warm pool is kept).
        Buffers still used by enqueued work are released once it ran (wgpu: ``destroy`` after
        the pending submits; cuda: behind events; cpu: numpy's reference count).
        Raises: ``ServerClosed``.
        """
        srv = self._server
        return srv.call(srv.h_empty_cache)

    def shutdown(self) -> None:
        """Stop this client's server (every client of it then raises ``ServerClosed``)."""
        self._server.shutdown()

    @property
    def closed(self) -> bool:
        """True once the server stopped (then every call raises ``ServerClosed``)."""
        return self._server.closed

    def __repr__(self):
        return f"ComputeClient(backend={self.backend!r}, device={self.device}, stream={self.stream!r})"


def _dtype_name(handle) -> str:
    """``"i32"`` or ``"u32"`` for a condition handle (checked by ``_cond_handle``)."""
    return "u32" if handle.dtype == np.dtype(np.uint32) else "i32"


def _check_aliasing(kernel, hids) -> None:
    """Refuse one buffer bound both ``read`` and ``read_write`` in a launch (``LaunchError``).

    WebGPU forbids it within one dispatch (a writable storage binding may not alias a read-only
    one); the rule is kept on every backend so a program behaves the same everywhere.
    """
    written = {h: b for b, h in zip(kernel.bindings, hids) if b.access != "read"}
    for b, h in zip(kernel.bindings, hids):
        if b.access == "read" and h in written:
            w = written[h]
            raise LaunchError(f"launch of {kernel.name}: handle {h} is bound to {b.name} (read) "
                              f"and also to {w.name} ({w.access}); aliasing a written buffer with "
                              "a read binding in one launch is refused on every backend (the "
                              "WebGPU rule); use a separate output buffer")


def client(backend=None, device: int = 0, **options) -> ComputeClient:
    """A client of the server for ``(backend, device)``, starting it on first use.

    Args:
        backend: ``"cpu"``, ``"wgpu"``, ``"cuda"``, or ``None``: ``RUNTIME_BACKEND`` if set, else
            the best available (cuda with a GPU, wgpu on a hardware adapter, else cpu).
        device: device index.
        **options: ``check=True`` turns on the stream-ordering checker (or ``RUNTIME_CHECK=1``);
            cpu: ``scheduler="thread"|"interleave"|Scheduler``, ``seed=int``,
            ``threads=int`` (the cores the thread rule shares out, for the whole process),
            ``blas_threads="auto"|int|None`` (``"auto"``: the rule sizes OpenBLAS's pool; an
            int fixes it; ``None`` leaves BLAS alone); see ``runtime.backends.cpu.CpuBackend``.
            Different options give a different server.
    Raises: ``ValueError`` (unknown backend; a bad option value); ``TypeError`` (an option the
        backend does not take); ``UnsupportedError`` (its library or device is missing, with an
        install hint).
    """
    srv = get_server(backend, device, **options)
    return ComputeClient(srv, srv.backend.name, device)
