"""The wgpu backend's queue thread and what it hands back (used only by :mod:`.wgpu`).

The ``GPUQueue`` belongs to one :class:`QueueThread`: every ``submit``, ``write_buffer``,
``map_async``, ``unmap`` and ``destroy`` runs there in the order the server's owner issued them
(none of them may run in a server handler: on lavapipe they block behind a running submit).
Reads and fences are :class:`MapCompletion` objects the caller's thread waits on. After a submit
that holds device-side flags the thread reads them back before the next operation: a replay's
loop status (``capture_while``: ``LoopLimitExceeded``) and the backend's ``err_flag``
(``Kernel.checks``: ``LaunchError``), failing the mark of the work they belong to
(docs/contract.md section 4). See the :mod:`.wgpu` module docstring for the whole backend.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import wgpu

from .. import _threads
from ..errors import LaunchError, LoopLimitExceeded, ServerClosed, error_list, unhealthy
from .base import Completion

_STAGING_KEEP = 4   # idle staging buffers kept per size class
_SUBMIT, _WRITE, _MAP, _UNMAP, _DESTROY, _CHECK, _DEVCHECK = range(7)
_CLOSED_MSG = "the wgpu server was shut down before this work completed"


class _Batch:
    """A stream's submitted command buffer and the marks of the work it holds (a refused
    submit fails them and is reported on the stream)."""

    __slots__ = ("cb", "stream", "marks")

    def __init__(self, cb, stream, marks):
        self.cb, self.stream, self.marks = cb, stream, marks


def _report(comp: "MapCompletion") -> None:
    """Queue thread, at a stream's read or fence: fail it with the stream's reported errors
    (every earlier submit of the stream ran or was refused by now)."""
    s = comp.stream
    if s is not None and s.errors:
        comp.error = unhealthy(error_list(comp.error) + s.errors.take())


class MapCompletion(Completion):
    """A read (or a fence) whose staging buffer the queue thread maps asynchronously.

    ``wait`` runs on the caller's thread: it waits until the queue thread has issued the map,
    then for the map itself (``GPUPromise``, resolved by wgpu-py's poll thread), copies the
    first ``nbytes`` out (``read_mapped``) and hands the buffer back to the queue thread for
    ``unmap``. Value: a ``uint8`` array of ``nbytes``, or None for a fence. Fails with
    ``LaunchError`` when the map fails and ``ServerClosed`` when the server shuts down first.
    """

    __slots__ = ("qt", "staging", "size", "nbytes", "issued", "promise", "_lock", "stream")

    def __init__(self, qt, staging, size: int, nbytes, stream=None):
        super().__init__()
        self.qt, self.staging, self.size, self.nbytes = qt, staging, size, nbytes
        self.stream = stream                # its errors are reported by this completion
        self.issued = _threads.Event()     # set once map_async was called (or it failed)
        self.promise = None
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> bool:
        """Block up to ``timeout`` seconds (None: until done); True once done."""
        if self.done:
            return True
        if not self.issued.wait(timeout):
            return False
        promise = self.promise
        if not self.done and promise is not None:
            if not promise._thread_event.wait(timeout):   # set by wgpu-py's poll thread
                return False
            self._collect()
        return True

    def _collect(self) -> None:
        with self._lock:
            if self.done:
                return
            staging = self.staging
            try:
                self.promise.sync_wait()      # resolved already; raises if the map failed
                value = None
                if self.nbytes is not None:
                    value = np.frombuffer(staging.read_mapped(0, self.size), np.uint8)[:self.nbytes]
            except Exception as exc:  # noqa: BLE001 - a failed map (device lost, closed)
                self.qt.push((_UNMAP, staging, 0))
                err = (ServerClosed(_CLOSED_MSG) if self.qt.closed
                       else LaunchError(f"wgpu: reading back {self.size} bytes failed: {exc}"))
                self.fail(unhealthy(error_list(self.error) + [err]) if self.error else err)
                return
            self.qt.push((_UNMAP, staging, 0))
            self.set(value)


class QueueThread:
    """The thread that owns the ``GPUQueue``: runs queue operations in issue order.

    Operations: submit a command buffer, ``write_buffer``, ``map_async`` of a staging buffer
    (a :class:`MapCompletion`), ``unmap`` (the staging buffer goes back to the free list) and
    ``destroy``. Before a submit, when ``max_inflight`` submits are unfinished, it waits for a
    fence (submission load). Never a hang: ``close`` fails what is queued with ``ServerClosed``
    and joins the thread for at most 1 s (it may be inside a submit that waits for the device).
    """

    def __init__(self, backend: "WgpuBackend", max_inflight: int):
        self.backend = backend
        self.queue = backend.queue
        self.max_inflight = max_inflight
        self.ops: collections.deque = collections.deque()
        # SOAK8: blocks take the plain lock (``with self.lock``), never the Condition's Python
        # __enter__/__exit__, where a KeyboardInterrupt can land with the lock taken
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.closed = False
        self.items = 0           # dispatches (or 1 per other op) queued here, for load()
        self.bytes = 0           # host bytes of queued writes
        self.inflight = 0        # submits since the last fence completed
        self.submits = 0         # command buffers handed over (counted at push, by the owner)
        self.free_staging: dict = {}     # size -> idle MAP_READ buffers
        self._thread = threading.Thread(target=self._loop, name="runtime-wgpu-queue", daemon=True)
        try:
            started = _threads.start(self._thread)
        except BaseException:           # (an asynchronous exception: the thread may run)
            self.close()
            raise
        if not started:
            self.closed = True
            raise ServerClosed(_threads.not_started("the wgpu queue thread"))

    def push(self, op) -> None:
        """Queue ``(kind, obj, arg)``; ``arg`` is the dispatch count of a submit, the data of a
        write. Raises ``ServerClosed`` once closed (the op's completion is failed)."""
        if not self.cv.acquire(timeout=LOCK_S):
            # SOAK7: an asynchronous exception landing in a caller between its acquire and
            # its ``with`` block left the lock held for ever (nobody holds it longer than a
            # few operations): take it back, or the server's owner waited here for ever
            self.cv._lock.release()
            self.cv.acquire()
        with _Held(self.cv):
            if self.closed:
                if op[0] == _MAP:
                    _fail_closed(op[1])
                    return
                if op[0] == _UNMAP:
                    return
                raise ServerClosed(_CLOSED_MSG)
            self.items += _weight(op)
            if op[0] == _SUBMIT:
                self.submits += 1
            elif op[0] == _WRITE:
                self.bytes += op[2].nbytes
            self.ops.append(op)
            self.cv.notify()

    def _loop(self) -> None:
        cv, lock, ops = self.cv, self.lock, self.ops
        while True:
            with lock:
                while not ops and not self.closed:
                    cv.wait()
                if self.closed:
                    return
                op = ops.popleft()
            try:
                self._run(op)
            except Exception as exc:  # noqa: BLE001 - reported, the thread goes on
                self.backend._queue_error(op, exc)
            finally:
                with lock:
                    self.items -= _weight(op)
                    if op[0] == _WRITE:
                        self.bytes -= op[2].nbytes
                self.backend.on_room()

    def _run(self, op) -> None:
        kind, obj, arg = op
        if kind == _SUBMIT:
            if self.inflight >= self.max_inflight:
                self._fence()
            self.queue.submit([obj.cb if type(obj) is _Batch else obj])
            self.inflight += 1
        elif kind == _WRITE:
            self.queue.write_buffer(obj, 0, arg)
        elif kind == _MAP:
            _report(obj)
            try:
                obj.promise = obj.staging.map_async(wgpu.MapMode.READ, 0, obj.size)
            finally:
                obj.issued.set()
            self.inflight = 0            # the map resolves after every earlier submission
        elif kind == _UNMAP:
            state = obj.map_state
            if state == "mapped":
                obj.unmap()
            keep = self.free_staging.setdefault(obj.size, [])
            if state != "pending" and len(keep) < _STAGING_KEEP and not self.closed:
                keep.append(obj)
            else:
                obj.destroy()
        elif kind == _DESTROY:
            obj.destroy()
        elif kind == _CHECK:
            self._check_loops(*obj)
        elif kind == _DEVCHECK:
            self._check_device(*obj)

    def _check_loops(self, graph, mark, stream) -> None:
        """After a replay of ``graph`` (submitted just before): map its loop status (one u32
        per ``capture_while`` node, copied by the replay) and fail ``mark`` with
        ``LoopLimitExceeded`` when a loop's condition still held after ``max_iterations``
        (reported on ``stream``'s next completion). Waits on this thread for that replay."""
        over = self._read_u32(graph.status)
        if over is None:
            return
        for (_, node), v in zip(graph.checks, over):
            if v:
                err = LoopLimitExceeded.in_replay(node.index, node.max_iterations,
                                                  " on wgpu; the unrolled loop")
                stream.errors.append(mark.fail(err) if mark is not None else err)
                return

    def _check_device(self, kernels, mark, stream) -> None:
        """After a submit holding dispatches of kernels with device-side checks (``kernels``,
        ``Kernel.checks``; the submit just before, of one launch or one replay): copy the
        backend's ``err_flag`` out, wait on this thread for it, and when a check failed zero the
        flag (before any later submit: this thread submits in order) and fail ``mark`` with a
        ``LaunchError`` naming the kernel and the check, reported on ``stream``'s next
        completion (docs/contract.md section 4: what the work writes reads as failed)."""
        be = self.backend
        code = self._copy_back(be._err, be._err_read)
        if not code:                # (None: closed meanwhile)
            return
        self.queue.write_buffer(be._err, 0, np.zeros(1, np.uint32))
        what = " or ".join(f"kernel {k.name}: " + (k.checks[code - 1] if code <= len(k.checks)
                                                   else f"device check {code}")
                           for k in kernels)
        # (a kernel's check skips only what it guards: the rest of its output may be written,
        # so the message says what holds, the mark, not "nothing was written")
        err = LaunchError(f"{what} (a device-side check on wgpu; what the work writes is marked "
                          "failed)")
        err = mark.fail(err) if mark is not None else err
        (be.failures if stream.released else stream.errors).append(err)

    def _fence(self) -> None:
        """Wait (on this thread) until every submission so far has finished."""
        self._copy_back(self.backend._fence_src, self.backend._fence_dst)

    def _copy_back(self, src, dst) -> int | None:
        """Copy the 4 bytes of ``src`` into the ``MAP_READ`` buffer ``dst`` after every
        submission so far, wait (on this thread) for the map and return them as a u32; None
        when the thread was closed meanwhile."""
        enc = self.backend.dev.create_command_encoder()
        enc.copy_buffer_to_buffer(src, 0, dst, 0, 4)
        self.queue.submit([enc.finish()])
        words = self._read_u32(dst)
        return None if words is None else int(words[0])

    def _read_u32(self, buf):
        """Map the ``MAP_READ`` buffer ``buf`` after every submission so far, wait (on this
        thread, looking every 50 ms whether the thread was closed) and return its words as a
        ``uint32`` array; None when closed meanwhile."""
        promise = buf.map_async(wgpu.MapMode.READ, 0, buf.size)
        while not promise._thread_event.wait(0.05):
            if self.closed:
                return None
        promise.sync_wait()
        words = np.frombuffer(buf.read_mapped(0, buf.size), np.uint32).copy()
        buf.unmap()
        self.inflight = 0
        return words

    def close(self) -> None:
        """Fail what is queued with ``ServerClosed`` and stop the thread (joined <= 1 s)."""
        with self.lock:
            self.closed = True
            ops, self.ops = list(self.ops), collections.deque()
            self.items = self.bytes = 0
            self.cv.notify_all()
        for kind, obj, _ in ops:
            if kind == _MAP:
                _fail_closed(obj)
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout=1.0)      # (not one that never started: SOAK7)


#: seconds a push waits for the queue's lock before it takes it back (:meth:`QueueThread.push`)
LOCK_S = 2.0


class _Held:
    """``with`` over a lock already acquired: releases it on the way out."""

    __slots__ = ("lock",)

    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        return self.lock

    def __exit__(self, *exc):
        self.lock.release()


def _weight(op) -> int:
    return op[2] if op[0] == _SUBMIT else 1


def _fail_closed(comp: MapCompletion) -> None:
    if not comp.done:
        comp.fail(ServerClosed(_CLOSED_MSG))
    comp.issued.set()
