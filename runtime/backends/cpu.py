"""The cpu backend (numpy): the embedded default, always available.

Buffers are ``uint8`` numpy arrays. Streams are real asynchronous in-order queues: work is
enqueued by the server and executed by a scheduler, never by the caller. The schedulers
(:mod:`runtime.backends.cpu_schedule`, re-exported here): ``ThreadScheduler`` (default, worker
threads), ``InterleavingScheduler`` (seeded deterministic interleavings, with a ``trace``) and
``TraceScheduler`` (runs a recorded trace again).

The graph is a software graph: the resolved launch list (callable, views, params), replayed in
order as one queue item.

Threads: a stream's kernels run one after another on one worker thread, and each kernel may fan
out into a library pool, OpenBLAS (numpy's matmuls) or numba (the compiled loops of
``runtime.kernels.cpu_loops``). The thread rule (:mod:`runtime.kernels.threads`, README "The cpu
backend: kernels and threads") gives both pools ``cores // items executing now`` threads,
counted over every cpu backend of the process: one busy stream uses every core, concurrent
streams split them, and no pool waits for a thread another worker holds. ``threads=`` sets the
cores, ``blas_threads=`` takes BLAS out of the rule; the user's ``OPENBLAS_NUM_THREADS`` (etc.)
and ``NUMBA_NUM_THREADS`` win.
"""

from __future__ import annotations

import collections
import itertools
import threading

import numpy as np

from ..errors import LaunchError, OutOfMemory, ServerClosed, unhealthy
from ..kernel import DTYPES
from ..kernels.threads import RULE
from .base import Backend, Completion
from .cpu_schedule import (InterleavingScheduler, Scheduler, ThreadScheduler,  # noqa: F401
                           TraceScheduler, decode_trace, encode_trace)
from .cpu_schedule import RUN as _RUN, SIGNAL as _SIGNAL, WAIT as _WAIT


def limit_blas_threads(n: int = 1, force: bool = False) -> int | None:
    """Cap numpy's BLAS (OpenBLAS) at ``n`` threads for this process, unless the user chose.

    A fixed count, outside the thread rule (:mod:`runtime.kernels.threads`, which sizes BLAS
    itself while cpu streams execute; ``CpuBackend(blas_threads=n)`` fixes it through this).

    Args:
        n: threads (>= 1).
        force: apply even when ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS``/``MKL_NUM_THREADS``
            is set (otherwise the user's setting wins and nothing is done).
    Returns: the previous thread count (pass it back, with ``force=True``, to restore), or
        ``None`` when skipped, when no BLAS was found or ``threadpoolctl`` is missing.
    """
    import os

    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        return None
    if not force and any(os.environ.get(v) for v in
                         ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return None
    prev = max((i.get("num_threads", 1) for i in threadpool_info() if i.get("user_api") == "blas"),
               default=None)
    if prev is not None and prev != n:
        threadpool_limits(int(n), user_api="blas")
    return prev


class CpuEvent:
    """Completes when the stream that recorded it reaches it."""

    __slots__ = ("done",)

    def __init__(self):
        self.done = False


class CpuBuffer:
    """A device buffer: ``data`` (uint8 numpy array) and cached typed views of it."""

    __slots__ = ("data", "views")

    def __init__(self, data):
        self.data = data
        self.views: dict = {}


class CpuStream:
    """An in-order queue of ``(kind, payload)`` items and the errors its work raised."""

    __slots__ = ("q", "errors", "index", "busy")

    def __init__(self, index):
        self.busy = False
        self.q = collections.deque()
        self.errors: list = []
        self.index = index


class CpuGraph:
    """The resolved launch list of a capture: ``[(fn, views, kwargs, count, name)]``."""

    __slots__ = ("launches",)

    def __init__(self, launches):
        self.launches = launches


def _run_launch(fn, views, kwargs, count, name, fail=None, where=""):
    if not isinstance(count, tuple):         # indirect: three u32 read now
        count = tuple(int(v) for v in np.frombuffer(count, np.uint32, 3))
    if count[0] and count[1] and count[2]:
        try:
            fn(*views, count=count, **kwargs)
        except Exception as e:  # noqa: BLE001 - kernel code is user code
            err = LaunchError(f"kernel {name}{where} raised on cpu: {type(e).__name__}: {e}")
            if fail is not None:
                err = fail(err) or err
            raise err from e


class CpuBackend(Backend):
    """numpy buffers, asynchronous streams, software graphs.

    Args:
        device: ignored (one cpu device).
        scheduler: a ``Scheduler``, ``"thread"`` (default), ``"interleave"`` or ``"trace"``.
        seed: the ``InterleavingScheduler`` seed when ``scheduler="interleave"``.
        threads: the cores the thread rule shares out among executing streams, for the whole
            process (default: the CPUs this process may run on; e.g. a Ray replica's
            ``num_cpus``).
        blas_threads: ``"auto"`` (default): the thread rule sizes OpenBLAS's pool (unless the
            user's ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` is set); an
            int fixes it at that many threads for the process; ``None`` leaves BLAS alone.
        trace: the schedule ``TraceScheduler`` runs when ``scheduler="trace"`` (a string from
            ``InterleavingScheduler.trace`` or a list of stream indices).
    Raises: ``ValueError`` (unknown scheduler, a trace without ``scheduler="trace"`` or the
        reverse, a malformed trace, ``threads < 1``, ``blas_threads`` neither ``"auto"``, an
        int >= 1 nor ``None``).
    """

    name = "cpu"
    hardware_graphs = False
    device_name = "numpy " + np.__version__

    def __init__(self, device: int = 0, scheduler=None, seed: int = 0, trace=None,
                 threads: int | None = None, blas_threads: int | str | None = "auto"):
        super().__init__(device)
        if (scheduler == "trace") != (trace is not None):
            raise ValueError("pass trace=... together with scheduler='trace' (and only then)")
        if blas_threads != "auto" and blas_threads is not None and (
                isinstance(blas_threads, (bool, str)) or int(blas_threads) < 1):
            raise ValueError(f"blas_threads must be 'auto', an int >= 1 or None, "
                             f"got {blas_threads!r}")
        if threads is not None:
            RULE.set_cores(threads)
        if blas_threads != "auto":
            RULE.fix_blas()
            if blas_threads is not None:
                limit_blas_threads(blas_threads, force=True)
        if scheduler is None or scheduler == "thread":
            scheduler = ThreadScheduler()
        elif scheduler == "interleave":
            scheduler = InterleavingScheduler(seed)
        elif scheduler == "trace":
            scheduler = TraceScheduler(trace)
        elif not isinstance(scheduler, Scheduler):
            raise ValueError(f"scheduler must be 'thread', 'interleave', 'trace' or a Scheduler, "
                             f"got {scheduler!r}")
        self.streams: list[CpuStream] = []
        self.scheduler = scheduler
        self.enqueued = 0                    # items enqueued (by the server's owner only)
        self.executed = 0                    # items run (any thread; see load())
        self._executed = itertools.count(1)  # next() is atomic under the GIL
        self._bytes = 0                      # host bytes held by queued writes
        self._bytes_lock = threading.Lock()
        scheduler.attach(self)
        self.closed = False

    def load(self) -> tuple:
        """``(items, bytes)`` enqueued on the streams and not yet run (design.md section 1).
        ``(0, 0)`` under the interleaving scheduler, which runs nothing until someone waits."""
        if not isinstance(self.scheduler, ThreadScheduler):
            return (0, 0)
        return (self.enqueued - self.executed, self._bytes)

    def release_stream(self, stream) -> bool:
        """Drop ``stream`` from the scheduler's list once its queue is empty (True), so a pick
        is linear in live streams only; False while it has work."""
        lock = getattr(self.scheduler, "cv", None) or threading.Lock()
        with lock:
            if not self.scheduler.is_idle(stream):
                return False
            try:
                self.streams.remove(stream)
            except ValueError:
                pass
        return True

    # -- execution (scheduler side) ----------------------------------------------------------
    def execute(self, s: CpuStream, kind, payload) -> None:
        self.executed = next(self._executed)
        try:
            self._execute(s, kind, payload)
        finally:
            self.on_room()

    def _execute(self, s: CpuStream, kind, payload) -> None:
        if kind == _RUN:
            RULE.enter()                    # the thread rule counts the items executing now
            try:
                payload()
            except Exception as e:  # noqa: BLE001 - kernel code is user code
                s.errors.append(e if isinstance(e, LaunchError) else LaunchError(
                    f"a cpu kernel raised while executing: {type(e).__name__}: {e}"))
            finally:
                RULE.exit()
        elif kind == _SIGNAL:
            if isinstance(payload, CpuEvent):
                payload.done = True
                self.scheduler.notify_all()
            else:
                if s.errors:
                    errs, s.errors = s.errors, []
                    payload.fail(unhealthy(errs))
                else:
                    payload.set(payload.value)

    def _enqueue(self, s: CpuStream, kind, payload) -> None:
        if self.closed:
            raise ServerClosed("cpu backend is closed")
        self.enqueued += 1
        self.scheduler.push(s, (kind, payload))

    # -- memory -------------------------------------------------------------------------------
    def alloc(self, nbytes):
        try:
            return CpuBuffer(np.zeros(nbytes, np.uint8))
        except MemoryError as e:
            raise OutOfMemory(f"cpu: could not allocate {nbytes} bytes") from e

    def free(self, buf):
        pass  # numpy frees the array once no queued work references it

    # -- streams and events -------------------------------------------------------------------
    def new_stream(self):
        s = CpuStream(len(self.streams))
        self.streams.append(s)
        return s

    def record_event(self, stream):
        ev = CpuEvent()
        if self.scheduler.is_idle(stream):
            ev.done = True
        else:
            self._enqueue(stream, _SIGNAL, ev)
        return ev

    def wait_event(self, stream, event):
        if not event.done:
            self._enqueue(stream, _WAIT, event)

    def synchronize(self, stream):
        if self.scheduler.is_idle(stream) and not stream.errors:
            return Completion.ready()
        comp = Completion()
        self._enqueue(stream, _SIGNAL, comp)
        return self.scheduler.settle(comp, stream)

    # -- copies -------------------------------------------------------------------------------
    def copy_in(self, stream, buf, data):
        n, dst = data.nbytes, buf.data

        def write():
            try:
                dst[:n] = data
            finally:
                with self._bytes_lock:
                    self._bytes -= n
        with self._bytes_lock:
            self._bytes += n
        self._enqueue(stream, _RUN, write)

    def copy_out(self, stream, buf, nbytes):
        comp = Completion()
        src = buf.data

        def read():
            comp.value = src[:nbytes].copy()
        self._enqueue(stream, _RUN, read)
        self._enqueue(stream, _SIGNAL, comp)
        return self.scheduler.settle(comp, stream)

    # -- kernels ------------------------------------------------------------------------------
    def compile(self, kernel):
        if kernel.cpu is None:
            raise LaunchError(f"kernel {kernel.name} has no cpu implementation")
        return kernel

    def _resolve(self, kernel, count, args, params):
        views = []
        for b, (buf, nbytes) in zip(kernel.bindings, args):
            key = (nbytes, b.dtype)
            v = buf.views.get(key)
            if v is None:
                dt = DTYPES[b.dtype]
                v = buf.views[key] = buf.data[:nbytes - nbytes % dt.itemsize].view(dt)
            views.append(v)
        kwargs = dict(zip(kernel.param_names, params))
        if len(count) == 2:                      # indirect: (buf, nbytes), read at execution
            count = count[0].data
        return kernel.cpu, views, kwargs, count, kernel.name

    @classmethod
    def probe(cls) -> dict:
        """``{"hardware": False, "device": "numpy <version>"}``: always available."""
        return {"hardware": False, "device": cls.device_name}

    def launch(self, stream, program, count, args, params, fail=None):
        fn, views, kwargs, count, name = self._resolve(program, count, args, params)
        self._enqueue(stream, _RUN, lambda: _run_launch(fn, views, kwargs, count, name, fail))

    # -- graphs -------------------------------------------------------------------------------
    def begin_graph(self, stream):
        return []

    def record_launch(self, recording, program, count, args, params):
        recording.append(self._resolve(program, count, args, params))

    def end_graph(self, recording):
        return CpuGraph(tuple(recording))

    def launch_graph(self, stream, graph, fail=None):
        launches = graph.launches

        def replay():
            for launch in launches:   # a failing launch stops the replay: the rest never runs
                _run_launch(*launch, fail, " (in a graph replay)")
        self._enqueue(stream, _RUN, replay)

    def destroy_graph(self, stream, graph):
        pass  # queued replays hold their own references to the launch list

    # -- lifetime -----------------------------------------------------------------------------
    def is_alive(self):
        alive = getattr(self.scheduler, "is_alive", None)
        return not self.closed and (alive is None or alive())

    def close(self):
        self.closed = True
        self.scheduler.close()
        err = ServerClosed("the cpu server was shut down before this work ran")
        for s in self.streams:
            while s.q:
                kind, payload = s.q.popleft()
                if kind == _SIGNAL and isinstance(payload, Completion):
                    payload.fail(err)
