"""The cpu backend (numpy): the embedded default, always available.

Buffers are ``uint8`` numpy arrays. Streams are real asynchronous in-order queues: work is
enqueued by the server and executed by a scheduler, never by the caller. The schedulers:

- :class:`ThreadScheduler` (default): one worker thread runs any stream head as soon as it is
  runnable (per-stream FIFO, event waits honoured).
- :class:`InterleavingScheduler` (``seed``): defers all work, and when someone waits runs the
  runnable stream heads in a seeded random order, honouring only per-stream FIFO and events.
  A missing cross-stream dependency then gives wrong data deterministically for some seed;
  the property tests and ``runtime.testing`` use it. It records the order it ran stream heads
  (``trace``, a compact string).
- :class:`TraceScheduler` (``scheduler="trace", trace=...``): runs a recorded trace again, so a
  failing schedule stays reproducible after the code around it changed.

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
import random
import threading

import numpy as np

from ..errors import LaunchError, LoopLimitExceeded, OutOfMemory, ServerClosed, unhealthy
from ..kernel import DTYPES
from ..kernels.threads import RULE
from .base import Backend, Completion

_RUN, _WAIT, _SIGNAL = 0, 1, 2


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
    """The resolved launch list of a capture: ``[(fn, views, kwargs, count, name)]``, with
    :class:`CpuCond` nodes where ``capture_if``/``capture_while`` recorded one (``nodes``)."""

    __slots__ = ("launches", "nodes")

    def __init__(self, launches):
        self.launches = launches
        self.nodes = any(type(x) is not tuple for x in launches)


class CpuRecording:
    """A recording: ``stack`` of open launch lists (the top level, then each open node's
    branch), ``nodes``: the open :class:`CpuCond` s, innermost last."""

    __slots__ = ("stack", "nodes", "count")

    def __init__(self):
        self.stack = [[]]
        self.nodes: list = []
        self.count = 0


class CpuCond:
    """A conditional node: ``kind`` ``"if"`` (run ``then`` when ``cond[0] != 0`` else
    ``other``) or ``"while"`` (run ``then`` while ``cond[0] != 0``, at most ``max_iterations``
    times, default ``DEFAULT_MAX_ITERATIONS``). ``cond`` is an int32 view of the condition
    buffer's first 4 bytes, read when a replay reaches the node."""

    __slots__ = ("kind", "cond", "max_iterations", "then", "other", "index")

    def __init__(self, kind, cond, max_iterations):
        self.kind, self.cond, self.max_iterations = kind, cond, max_iterations
        self.then, self.other = [], []
        self.index = None


#: ``capture_while(max_iterations=None)``'s bound (``runtime.client.client``'s value).
DEFAULT_MAX_ITERATIONS = 1 << 20


def _run_nodes(items, fail) -> None:
    """Run a launch list with conditional nodes (a replay); see :class:`CpuCond`."""
    for item in items:
        if type(item) is tuple:
            _run_launch(*item, fail, " (in a graph replay)")
        elif item.kind == "if":
            _run_nodes(item.then if item.cond[0] != 0 else item.other, fail)
        else:
            limit = DEFAULT_MAX_ITERATIONS if item.max_iterations is None else item.max_iterations
            done = 0
            while item.cond[0] != 0:
                if done >= limit:
                    err = LoopLimitExceeded(
                        f"capture_while node {item.index}: its condition was still non-zero "
                        f"after max_iterations={limit} iterations in a graph replay; the loop "
                        "stopped there")
                    if fail is not None:
                        err = fail(err) or err
                    raise err
                _run_nodes(item.then, fail)
                done += 1


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


class Scheduler:
    """Decides when queued stream items run. Subclasses: ``ThreadScheduler``,
    ``InterleavingScheduler``."""

    def attach(self, backend: "CpuBackend") -> None:
        self.backend = backend

    def notify(self) -> None:
        """Work was enqueued."""

    def push(self, stream, item) -> None:
        """Append ``item`` to ``stream``'s queue and let a worker know."""
        stream.q.append(item)

    def notify_all(self) -> None:
        """An event completed: streams waiting on it may run."""

    def settle(self, comp: Completion, stream) -> Completion:
        """Called by the server's owner after enqueuing the item on ``stream`` that finishes
        ``comp``."""
        return comp

    def close(self) -> None:
        pass


class ThreadScheduler(Scheduler):
    """Run every stream head as soon as it is runnable, on a few worker threads.

    A stream is run by at most one worker at a time (per-stream FIFO); different streams run
    concurrently (numpy releases the GIL in large operations), so a stream blocked on an event
    or a long kernel does not hold up the others.

    Args:
        workers: worker threads (default 4).
    """

    def __init__(self, workers: int = 4):
        self.workers = workers

    def attach(self, backend):
        super().attach(backend)
        self.cv = threading.Condition()
        self.waiting = 0
        self.closed = False
        self.rr = 0
        self.threads = [threading.Thread(target=self._loop, name=f"runtime-cpu-worker-{k}",
                                         daemon=True) for k in range(self.workers)]
        for t in self.threads:
            t.start()

    def notify(self):
        if self.waiting:
            with self.cv:
                self.cv.notify()

    def push(self, s, item):
        with self.cv:                           # atomic with a worker's pick-then-wait
            s.q.append(item)
            if self.waiting:
                self.cv.notify()

    def notify_all(self):
        with self.cv:
            self.cv.notify_all()

    def _pick(self):
        streams = self.backend.streams
        n = len(streams)
        for k in range(n):
            s = streams[(self.rr + k) % n]
            if s.q and not s.busy:
                kind, payload = s.q[0]
                if kind != _WAIT or payload.done:
                    self.rr = (self.rr + k + 1) % n
                    s.busy = True               # before popleft: see is_idle
                    s.q.popleft()
                    return s, kind, payload
        return None

    def _loop(self):
        cv = self.cv
        with cv:
            while not self.closed:
                item = self._pick()
                if item is None:
                    self.waiting += 1
                    cv.wait()
                    self.waiting -= 1
                    continue
                cv.release()
                try:
                    self.backend.execute(*item)
                finally:
                    cv.acquire()
                    item[0].busy = False
                    if item[0].q:
                        cv.notify()             # its next item may be runnable now

    def is_idle(self, stream) -> bool:
        return not stream.q and not stream.busy   # q first: a worker sets busy, then pops

    def settle(self, comp, stream):
        comp.helper = lambda: self.help(stream, comp)
        return comp

    def help(self, stream, comp) -> None:
        """Run ``stream``'s runnable head items on the calling (waiting) thread until ``comp``
        is done, unless a worker already holds the stream: saves two thread hand-offs on a
        read or sync. Runs outside the server's lock; ``busy`` keeps per-stream FIFO."""
        cv = self.cv
        while not comp.done:
            with cv:
                if stream.busy or not stream.q or self.closed:
                    return
                kind, payload = stream.q[0]
                if kind == _WAIT and not payload.done:
                    return
                stream.busy = True
                stream.q.popleft()
            try:
                self.backend.execute(stream, kind, payload)
            finally:
                with cv:
                    stream.busy = False
                    if stream.q and self.waiting:
                        cv.notify()

    def is_alive(self) -> bool:
        return all(t.is_alive() for t in self.threads)

    def close(self):
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        for t in self.threads:
            t.join(timeout=5.0)


def encode_trace(picks) -> str:
    """A schedule as a compact string: stream indices, runs written ``index*count``.

    Args:
        picks: the stream index (``CpuStream.index``, the order streams were first used) of
            every stream head the scheduler ran, in order.
    Returns: e.g. ``"0*3,1,0*2"`` for ``[0, 0, 0, 1, 0, 0]``; ``""`` for no picks.
    """
    out = []
    for k, group in itertools.groupby(picks):
        n = len(list(group))
        out.append(f"{k}*{n}" if n > 1 else str(k))
    return ",".join(out)


def decode_trace(trace) -> list:
    """The stream indices of a trace from :func:`encode_trace` (a list or tuple of ints is
    returned as a list).

    Raises: ``ValueError`` (not a trace: entries must be ``index`` or ``index*count``, both
        non-negative ints); ``TypeError`` (neither a string nor a sequence of ints).
    """
    if isinstance(trace, (list, tuple)):
        if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in trace):
            raise ValueError(f"a trace holds non-negative stream indices, got {trace!r}")
        return list(trace)
    if not isinstance(trace, str):
        raise TypeError(f"trace must be a string from encode_trace or a list of ints, got "
                        f"{type(trace).__name__}")
    picks: list = []
    for entry in filter(None, trace.replace(" ", "").split(",")):
        k, star, n = entry.partition("*")
        if not k.isdigit() or (star and not n.isdigit()):
            raise ValueError(f"bad trace entry {entry!r} in {trace[:80]!r}: write index or "
                             "index*count")
        picks.extend([int(k)] * (int(n) if n else 1))
    return picks


class InterleavingScheduler(Scheduler):
    """Defer all work; on a wait, run runnable stream heads in a seeded random order.

    Every pick is recorded: ``trace`` is the schedule as a compact string (see
    :func:`encode_trace`), and ``TraceScheduler(trace)`` runs it again exactly.

    Args:
        seed: the interleaving; the same program and seed give the same order.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.rng = random.Random(seed)
        self.picks: list = []

    def __repr__(self):
        return f"InterleavingScheduler(seed={self.seed})"

    @property
    def trace(self) -> str:
        """The stream heads run so far, in order, as a compact string (:func:`encode_trace`)."""
        return encode_trace(self.picks)

    def choose(self, ready: list):
        """The stream to run next among ``ready`` (runnable heads, in stream index order)."""
        return ready[self.rng.randrange(len(ready))]

    def settle(self, comp, stream):
        streams = self.backend.streams
        while not comp.done:
            ready = [s for s in streams if s.q and (s.q[0][0] != _WAIT or s.q[0][1].done)]
            if not ready:
                comp.fail(LaunchError("interleaving scheduler: no stream can make progress "
                                      "(an event wait that never completes)"))
                break
            s = self.choose(ready)
            self.picks.append(s.index)
            kind, payload = s.q.popleft()
            self.backend.execute(s, kind, payload)
        return comp

    def is_idle(self, stream) -> bool:
        return not stream.q


class TraceScheduler(InterleavingScheduler):
    """Run a recorded schedule again: the stream heads in the order of ``trace``.

    Args:
        trace: a trace string (``InterleavingScheduler.trace``) or a list of stream indices.
    Raises: ``ValueError``/``TypeError`` for a malformed trace.

    When the program changed since the trace was recorded, a step can name a stream that has
    nothing queued (the step is skipped) or whose head waits on an event (the lowest runnable
    stream runs instead, and the step is kept for later); past the end of the trace the lowest
    runnable stream runs. ``diverged`` counts those steps, ``first_divergence`` is the first
    pick that did not follow the trace (None while it is followed exactly), and ``trace`` is
    the schedule really run.
    """

    def __init__(self, trace):
        super().__init__(0)
        self.planned = decode_trace(trace)
        self.step = 0
        self.diverged = 0
        self.first_divergence = None

    def __repr__(self):
        return f"TraceScheduler({encode_trace(self.planned)!r})"

    def _off_trace(self):
        self.diverged += 1
        if self.first_divergence is None:
            self.first_divergence = len(self.picks)

    def choose(self, ready):
        planned, streams = self.planned, self.backend.streams
        while self.step < len(planned):
            k = planned[self.step]
            s = streams[k] if k < len(streams) else None
            if s is not None and s in ready:
                self.step += 1
                return s
            self._off_trace()
            if s is not None and s.q:
                return ready[0]           # blocked on an event: run another, keep the step
            self.step += 1                # nothing queued there: skip the step
        self._off_trace()
        return ready[0]


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
        return CpuRecording()

    def record_launch(self, recording, program, count, args, params):
        recording.stack[-1].append(self._resolve(program, count, args, params))

    def end_graph(self, recording):
        return CpuGraph(tuple(recording.stack[0]))

    def launch_graph(self, stream, graph, fail=None):
        launches = graph.launches
        if graph.nodes:
            self._enqueue(stream, _RUN, lambda: _run_nodes(launches, fail))
            return

        def replay():
            for launch in launches:   # a failing launch stops the replay: the rest never runs
                _run_launch(*launch, fail, " (in a graph replay)")
        self._enqueue(stream, _RUN, replay)

    def destroy_graph(self, stream, graph):
        pass  # queued replays hold their own references to the launch list

    # -- graphs that change ---------------------------------------------------------------------
    def begin_cond(self, recording, kind, cond, max_iterations):
        """Open an ``if``/``while`` node: its condition is read from ``cond``'s buffer each time
        a replay reaches it (``LoopLimitExceeded`` past ``max_iterations``)."""
        buf, _ = cond
        node = CpuCond(kind, buf.data[:4].view(np.int32), max_iterations)
        node.index, recording.count = recording.count, recording.count + 1
        recording.stack[-1].append(node)
        recording.stack.append(node.then)
        recording.nodes.append(node)

    def else_cond(self, recording):
        recording.stack.pop()
        recording.stack.append(recording.nodes[-1].other)

    def end_cond(self, recording):
        recording.stack.pop()
        node = recording.nodes.pop()
        node.then, node.other = tuple(node.then), tuple(node.other)

    def update_graph(self, stream, graph, changes, conds):
        """Swap in a patched launch list (resolved again only where ``changes``/``conds`` say):
        replays enqueued before keep the list they captured at enqueue."""
        counter = itertools.count()

        def patch(items):
            out = []
            for item in items:
                if type(item) is tuple:
                    i = next(counter)
                    out.append(self._resolve(*changes[i]) if i in changes else item)
                else:
                    cond = item.cond
                    if item.index in conds:
                        cond = conds[item.index][0].data[:4].view(np.int32)
                    node = CpuCond(item.kind, cond, item.max_iterations)
                    node.index = item.index
                    node.then, node.other = patch(item.then), patch(item.other)
                    out.append(node)
            return tuple(out)
        graph.launches = patch(graph.launches)
        return graph

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
