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
``runtime.kernels.cpu_loops``). The thread rule (:mod:`runtime.cpu_threads`, README "The cpu
backend: kernels and threads") gives both pools ``cores // items executing now`` threads,
counted over every cpu backend of the process: one busy stream uses every core, concurrent
streams split them, and no pool waits for a thread another worker holds. ``threads=`` sets the
cores, ``blas_threads=`` takes BLAS out of the rule; the user's ``OPENBLAS_NUM_THREADS`` (etc.)
and ``NUMBA_NUM_THREADS`` win.
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading
from functools import partial

import numpy as np

from ..errors import (ErrorQueue, LaunchError, LoopLimitExceeded, OutOfMemory, ServerClosed,
                      detach, unhealthy)
from ..kernel import DTYPES
from ..cpu_threads import RULE, limit_blas_threads, whole_mode_from_env
from .base import Backend, Completion
from .cpu_fuse import fuse
from .cpu_schedule import (InterleavingScheduler, Scheduler, ThreadScheduler,  # noqa: F401
                           TraceScheduler, decode_trace, encode_trace)
from .cpu_schedule import CALL as _CALL, RUN as _RUN, SIGNAL as _SIGNAL, TINY as _TINY, \
    WAIT as _WAIT


class CpuEvent:
    """Completes when the stream that recorded it reaches it; ``waiters``: streams the thread
    scheduler parked on it (their head waits for it), or None."""

    __slots__ = ("done", "waiters")

    def __init__(self):
        self.done = False
        self.waiters = None


class CpuBuffer:
    """A device buffer: ``data`` (uint8 numpy array) and cached typed views of it."""

    __slots__ = ("data", "views")

    def __init__(self, data):
        self.data = data
        self.views: dict = {}


class CpuStream:
    """An in-order queue of ``(kind, payload)`` items and the errors its work raised;
    ``index`` (never reused) names it in traces, ``busy``/``sched``/``pending`` belong to the
    scheduler; ``runner``: the thread ident that set ``busy`` last (a kernel body blocking on
    its own stream is refused: :meth:`CpuBackend.held_by_caller`)."""

    __slots__ = ("q", "errors", "index", "busy", "sched", "pending", "runner")

    def __init__(self, index):
        self.busy = self.pending = False
        self.runner = 0
        self.sched = 0
        self.q = collections.deque()
        self.errors = ErrorQueue()
        self.index = index


class CpuGraph:
    """The resolved launch list of a capture: ``launches`` = ``[(fn, views, kwargs, count,
    name)]``, with :class:`CpuCond` nodes where ``capture_if``/``capture_while`` recorded one
    (``nodes``). Without nodes each launch is also resolved once into its cheapest call
    (``calls``, with the kernel ``names``; issue 26): the kernel's cpu ``bind`` (views, params
    and output bound at capture), else the callable with its arguments bound; zero-count
    launches are dropped (they run nothing); each run of pointwise launches is one compiled
    call (:mod:`runtime.backends.cpu_fuse`, named ``"<kernels> (N launches fused)"``). Whoever
    changes ``launches`` calls :meth:`rebind`."""

    __slots__ = ("launches", "nodes", "calls", "names", "small", "plain", "tiny", "inline",
                 "defer", "one")

    def __init__(self, launches):
        self.launches = launches
        self.rebind()

    def rebind(self) -> None:
        """Resolve ``launches`` into ``calls`` and ``names`` again (none with nodes)."""
        self.nodes = any(type(x) is not tuple for x in self.launches)
        calls, names, largest, plain, touched = [], [], 0, not self.nodes, 0
        kept = []
        for launch in () if self.nodes else self.launches:
            call = _bind(*launch)
            if call is not None:
                calls.append(call)
                names.append(launch[4])
                kept.append(launch)
                one = sum(v.nbytes for v in launch[1])
                largest, touched = max(largest, one), touched + one
                plain = plain and hasattr(launch[0], "bind") and launch[3].__class__ is tuple
        # runs of pointwise launches become one compiled call each (cpu_fuse); cost: the
        # calls a replay makes, a fused one counted by its work
        calls, names, cost = fuse(kept, calls, names)
        self.calls, self.names = tuple(calls), tuple(names)
        self.small = not self.nodes and largest <= DEFER_BYTES  # tiny kernels: a waiter runs it
        self.plain = plain                      # numpy ufunc calls only: no library pool
        self.tiny = plain and touched <= TINY_BYTES     # a flush may run it on the owner
        self.inline = self.tiny and cost <= INLINE_CALLS  # a replay may run it at once
        self.one = calls[0] if self.inline and len(calls) == 1 else None   # (no loop: issue 26)
        # ufunc calls a waiter would run anyway (no worker woken): a replay on an idle server
        # may be deferred (``ComputeServer.replay``) and enqueued by the next owner
        self.defer = self.small and plain


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


def _run_nodes(items, mark) -> None:
    """Run a launch list with conditional nodes (a replay); see :class:`CpuCond`."""
    for item in items:
        if type(item) is tuple:
            _run_launch(*item, mark, " (in a graph replay)")
        elif item.kind == "if":
            _run_nodes(item.then if item.cond[0] != 0 else item.other, mark)
        else:
            limit = DEFAULT_MAX_ITERATIONS if item.max_iterations is None else item.max_iterations
            done = 0
            while item.cond[0] != 0:
                if done >= limit:
                    err = LoopLimitExceeded.in_replay(item.index, limit)
                    if mark is not None:
                        err = mark.fail(err)
                    raise err
                _run_nodes(item.then, mark)
                done += 1


#: work whose kernels each touch at most this many bytes (their bindings summed) is left queued
#: for the caller that waits for it, without waking a worker (``ThreadScheduler``, issue 26):
#: numpy keeps the GIL on small arrays, so a worker could not run it beside the caller anyway,
#: and the hand-off (a wake-up, the GIL passed over and back) costs more than the work.
DEFER_BYTES = 1 << 20
#: work touching at most this many bytes in all (a launch, a copy, a whole ufunc-only replay)
#: is ``TINY``: a read or sync on its stream runs up to :data:`INLINE_ITEMS` of them itself,
#: in order, instead of handing them to the waiting caller's helper (``CpuBackend.flush``).
TINY_BYTES = 64 << 10
INLINE_ITEMS = 8
#: a replay of at most this many ``TINY`` launches on an idle stream runs on the caller's
#: thread at once (``launch_graph_now``): a few ufunc calls cost about what enqueuing them does,
#: so the replay returns no later than an enqueue would, with its work done (issue 26).
INLINE_CALLS = 4
#: typed views and resolved tiny launches cached per buffer (``CpuBuffer.views``).
MAX_VIEWS = 16


def _nothing() -> None:
    """The call of a launch that runs nothing (a zero workgroup count)."""


def _counts(count) -> tuple:
    """An indirect count's three u32 (``count``: the bytes of the count buffer), read now."""
    return tuple(int(v) for v in np.frombuffer(count, np.uint32, 3))


def _run_indirect(fn, views, kwargs, count):
    count = _counts(count)
    if count[0] and count[1] and count[2]:
        fn(*views, count=count, **kwargs)


def _bind(fn, views, kwargs, count, name):
    """One resolved launch as the cheapest zero-argument call doing its work: ``fn.bind`` (see
    ``runtime.kernel``), else ``fn`` with its arguments bound; ``None`` for a zero count (it
    runs nothing); an indirect count is read when the call runs."""
    if not isinstance(count, tuple):
        return partial(_run_indirect, fn, views, kwargs, count)
    if not (count[0] and count[1] and count[2]):
        return None
    bind = getattr(fn, "bind", None)
    if bind is not None:
        try:
            return bind(*views, count=count, **kwargs)
        except BaseException as e:  # noqa: BLE001 - kernel code is user code
            raise LaunchError(f"kernel {name}: its cpu bind raised: {_text(e)}") from e
    return partial(fn, *views, count=count, **kwargs)


def _copy_typed(buf, nbytes: int, dtype):
    """A copy of ``buf``'s first ``nbytes`` bytes: of its ``dtype`` view when ``dtype``'s
    itemsize divides ``nbytes`` (the view cached in ``buf.views`` by ``nbytes``, the latest dtype
    asked for; bounded by :data:`MAX_VIEWS`), else ``uint8`` bytes (``dtype`` None: bytes)."""
    if dtype is None or nbytes % dtype.itemsize:
        return buf.data[:nbytes].copy()
    views = buf.views
    if len(views) >= MAX_VIEWS:
        views.clear()
    v = views[nbytes] = buf.data[:nbytes].view(dtype)
    return v.copy()


def _text(e: BaseException) -> str:
    """``"<class name>: <message>"`` of an exception a kernel body raised, never raising itself:
    an exception whose ``__str__`` raises still becomes a ``LaunchError`` that marks the
    launch's outputs (its message is then left out)."""
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001 - user code's __str__
        return f"{type(e).__name__} (its message could not be formatted)"


def _run_launch(fn, views, kwargs, count, name, mark=None, where=""):
    """Run one launch on this thread. Anything the body raises (any exception: a
    ``ServerError`` of its own, ``SystemExit`` or ``KeyboardInterrupt`` raised by it included)
    becomes a ``LaunchError`` naming the kernel, handed to ``mark.fail`` (its outputs are
    marked) and raised: the stream reports it at its next completion (``_execute``); the
    worker thread goes on."""
    if not isinstance(count, tuple):         # indirect: three u32 read now
        count = _counts(count)
    if count[0] and count[1] and count[2]:
        try:
            fn(*views, count=count, **kwargs)
        except BaseException as e:  # noqa: BLE001 - kernel code is user code
            err = LaunchError(f"kernel {name}{where} raised on cpu: {_text(e)}")
            if mark is not None:
                err = mark.fail(err)
            raise err from e
    if mark is not None and not where:
        mark.ran = True                 # known done (Marks.done); its chain is cut at once
        if mark.parents or mark.also:
            mark.finished()


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
        whole_mode_from_env()          # a typo in RUNTIME_CPU_WHOLE: ValueError naming it
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
        self.streams: dict = {}              # {index: CpuStream} of live streams
        self._indices = itertools.count()     # stream indices, never reused (traces name them)
        self.scheduler = scheduler
        self.enqueued = 0                    # items enqueued (by the server's owner only)
        self.executed = 0                    # items run (any thread; see load())
        self._executed = itertools.count(1)  # next() is atomic under the GIL
        self._bytes = 0                      # host bytes held by queued writes
        self._bytes_lock = threading.Lock()
        self._threaded = isinstance(scheduler, ThreadScheduler)
        #: the exception that interrupted a thread running this backend's queued work on a
        #: caller's thread (a waiter's helper, a read's flush: KeyboardInterrupt or a signal
        #: handler's exception) after it took an item and before the item was known done: the
        #: item may be lost (a launch never run, its outputs unmarked) or half done, so the
        #: backend reports itself dead (``is_alive``) and the server stops: every later call
        #: raises ``ServerClosed`` instead of returning stale values
        self.broken = None
        #: called once ``broken`` is set (the server's: stop now, so no later call, fast paths
        #: included, answers from a buffer an interrupted item should have written)
        self.on_broken = _nothing
        scheduler.attach(self)
        self.closed = False

    def load(self) -> tuple:
        """``(items, bytes)`` enqueued on the streams and not yet run (docs/contract.md section 1).
        ``(0, 0)`` under the interleaving scheduler, which runs nothing until someone waits."""
        if not self._threaded:
            return (0, 0)
        return (self.enqueued - self.executed, self._bytes)

    def release_stream(self, stream) -> bool:
        """Forget ``stream`` once its queue is empty and nothing runs it (True); False while it
        has work. Errors its work left and no completion reported go to ``failures``."""
        lock = getattr(self.scheduler, "cv", None) or threading.Lock()
        with lock:
            if not self.scheduler.is_idle(stream):
                return False
            self.streams.pop(stream.index, None)
            if stream.errors:            # never dropped: raised by any stream's next call
                self.failures.extend(stream.errors.take())
        return True

    # -- execution (scheduler side) ----------------------------------------------------------
    def execute(self, s: CpuStream, kind, payload) -> None:
        self.executed = next(self._executed)
        try:
            self._execute(s, kind, payload)
        finally:
            self.on_room()

    def _execute(self, s: CpuStream, kind, payload) -> None:
        if kind == _TINY or kind == _CALL or kind == _RUN:
            # _TINY/_CALL use no library pool: outside the thread rule, which counts the
            # _RUN items executing now
            counted = kind == _RUN
            if counted:
                RULE.enter()
            try:
                payload()
            except BaseException as e:  # noqa: BLE001 - kernel code is user code
                s.errors.append(detach(e) if isinstance(e, LaunchError) else LaunchError(
                    f"a cpu kernel raised while executing: {_text(e)}"))
                if not isinstance(e, LaunchError):
                    # not a kernel's failure (those are LaunchErrors, their outputs marked): an
                    # interrupt in the item's own bookkeeping (an exception a signal handler
                    # raised on a helping thread): its outputs may be unmarked
                    self.set_broken(e)
            finally:
                if counted:
                    RULE.exit()
        elif kind == _SIGNAL:
            if isinstance(payload, CpuEvent):
                payload.done = True
                self.scheduler.event_done(payload)
            else:
                if s.errors:
                    payload.fail(unhealthy(s.errors.take()))
                else:
                    payload.set(payload.value)

    def _enqueue(self, s: CpuStream, kind, payload, defer: bool = False) -> None:
        if self.closed:
            raise ServerClosed("cpu backend is closed")
        self.enqueued += 1
        self.scheduler.push(s, (kind, payload), defer)

    # -- memory -------------------------------------------------------------------------------
    def alloc(self, nbytes):
        try:
            return CpuBuffer(np.zeros(nbytes, np.uint8))
        except (MemoryError, ValueError) as e:  # ValueError: past numpy's largest array
            raise OutOfMemory(f"cpu: could not allocate {nbytes} bytes") from e

    def free(self, buf):
        buf.views.clear()   # numpy frees the array once no queued work or cached call holds it

    # -- streams and events -------------------------------------------------------------------
    def new_stream(self):
        s = CpuStream(next(self._indices))
        self.streams[s.index] = s
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

    def flush(self, stream):
        """Run ``stream``'s queued work now, on the calling thread (the server's owner, in a
        read's or sync's handler), when it is all ``TINY`` (at most :data:`INLINE_ITEMS` items
        of at most :data:`TINY_BYTES` each: tens of µs) and no worker holds the stream: the
        read's copy then happens at once, with no completion to wait for (issue 26). Errors
        it raises are reported as from a worker (``stream.errors``, the launches' marks).
        Anything else stays queued for the helper or a worker."""
        q = stream.q
        if not q or not self._threaded:
            return
        lock = self.scheduler.lock          # (SOAK8: a plain lock's with, no Python frame)
        claimed = taken = False
        try:                                # (see ThreadScheduler.help: busy always cleared)
            with lock:
                if stream.busy or len(q) > INLINE_ITEMS or any(k != _TINY for k, _ in q):
                    return
                stream.runner = threading.get_ident()
                stream.busy = claimed = True
            while q:
                taken = True
                kind, payload = q.popleft()
                self.execute(stream, kind, payload)
                taken = False
        except BaseException as e:
            if taken:                       # interrupted with an item taken (see broken)
                self.set_broken(e)
            raise
        finally:
            if claimed:
                with lock:
                    stream.busy = False
                    if q and self.scheduler.waiting:
                        self.scheduler._requeue(stream)     # (wakes one idle worker)

    def held_by_caller(self, stream) -> bool:
        """Whether the calling thread is running ``stream``'s work now (it set ``busy``: a
        worker, or a waiter helping its stream). See ``Backend.held_by_caller``."""
        return stream.busy and stream.runner == threading.get_ident()

    def reentrant(self) -> bool:
        """Whether the calling thread is running a kernel body at once under the server's lock
        (``launch_now``, ``launch_graph_now``, ``flush``): a blocking runtime call it makes
        would wait for that lock forever. Walks the calling thread's frames: called only by a
        wait that has lasted a poll interval (``DeviceQueue.wait``), never on a hot path."""
        return _on_stack(_INLINE_CODES)

    def in_kernel(self) -> bool:
        """Whether the calling thread is running a kernel body (on a worker, on a waiter that
        helps its stream, or at once on the fast paths): a blocking runtime call it makes may
        wait for that very body. Walks the frames; asked only by a wait that has lasted a poll
        interval (``DeviceQueue.wait``)."""
        return _on_stack(_KERNEL_CODES)

    def idle(self, stream):
        return not stream.q and not stream.busy and not stream.errors and not self.closed

    def synchronize(self, stream):
        if self.scheduler.is_idle(stream) and not stream.errors:
            return Completion.ready()
        comp = Completion()
        self._enqueue(stream, _SIGNAL, comp, True)
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
        small = n <= DEFER_BYTES
        self._enqueue(stream, _TINY if n <= TINY_BYTES else _CALL if small else _RUN, write,
                      small)

    def copy_out_now(self, stream, buf, nbytes, dtype=None):
        """The copy, at once, when ``stream`` is idle under the thread scheduler, after running
        its queued ``TINY`` work here (:meth:`flush`; see ``Backend.copy_out_now``); the
        interleaving schedulers order every copy themselves. With ``dtype`` (whose itemsize
        divides ``nbytes``) it copies the buffer's typed view (cached in ``buf.views`` by
        ``nbytes``, the latest dtype asked for; bounded by :data:`MAX_VIEWS`): one numpy call
        instead of a slice, a copy and a view."""
        if stream.q:
            self.flush(stream)
        if stream.q or stream.busy or stream.errors or not self._threaded or self.closed:
            return None
        v = buf.views.get(nbytes)           # (an int key: a dtype hashes slower)
        if v is not None and v.dtype is dtype:
            return v.copy()
        return _copy_typed(buf, nbytes, dtype)

    def copy_out(self, stream, buf, nbytes):
        src = buf.data
        if not stream.q and not stream.busy and not stream.errors and self._threaded:
            return Completion.ready(src[:nbytes].copy())    # idle stream: copy now, in order
        comp = Completion()

        def read():
            comp.value = src[:nbytes].copy()
        self._enqueue(stream, _CALL if nbytes <= DEFER_BYTES else _RUN, read, True)
        self._enqueue(stream, _SIGNAL, comp, True)
        return self.scheduler.settle(comp, stream)

    # -- kernels ------------------------------------------------------------------------------
    def compile(self, kernel):
        if kernel.cpu is None:
            raise LaunchError(f"kernel {kernel.name} has no cpu implementation; the cpu backend "
                              "needs Kernel(..., cpu=fn), fn(*binding views, *, **params, count)")
        return kernel

    def _resolve(self, kernel, count, args, params):
        views = []
        for b, (buf, nbytes) in zip(kernel.bindings, args):
            ro = b.access == "read"
            key = (nbytes, b.dtype, ro)
            v = buf.views.get(key)
            if v is None:
                if len(buf.views) >= MAX_VIEWS:  # a pooled buffer reused at many sizes: bounded
                    buf.views.clear()
                dt = DTYPES[b.dtype]
                v = buf.data[:nbytes - nbytes % dt.itemsize].view(dt)
                if ro:                   # a body writing a binding declared read raises
                    v.flags.writeable = False
                buf.views[key] = v
            views.append(v)
        kwargs = dict(zip(kernel.param_names, params))
        if len(count) == 2:                      # indirect: (buf, nbytes), read at execution
            count = count[0].data
        return kernel.cpu, views, kwargs, count, kernel.name

    @classmethod
    def probe(cls) -> dict:
        """``{"hardware": False, "device": "numpy <version>"}``: always available."""
        return {"hardware": False, "device": cls.device_name}

    def launch(self, stream, program, count, args, params, mark=None):
        fn, views, kwargs, count, name = self._resolve(program, count, args, params)
        touched = sum(v.nbytes for v in views)
        small, plain = touched <= DEFER_BYTES, hasattr(fn, "bind")
        self._enqueue(stream, (_TINY if touched <= TINY_BYTES else _CALL) if small and plain
                      else _RUN,
                      lambda: _run_launch(fn, views, kwargs, count, name, mark), small)

    def defers(self, kernel, nbytes):
        """A plain kernel (a ``bind``: numpy calls only) touching at most :data:`TINY_BYTES`
        under the thread scheduler: what :meth:`launch_now` runs at once (issue 26)."""
        return nbytes <= TINY_BYTES and self._threaded and hasattr(kernel.cpu, "bind")

    def launch_now(self, stream, program, count, args, params):
        """Run a ``TINY`` launch of a plain kernel (numpy calls only, at most
        :data:`TINY_BYTES` touched) on the calling thread when ``stream`` is idle and the thread
        scheduler runs it (the interleaving schedulers decide every order themselves): the
        combining idea applied to execution (issue 26). See ``Backend.launch_now``."""
        if (stream.q or stream.busy or stream.errors or not self._threaded or self.closed
                or not args):
            return False
        # the launch resolved once into its cheapest call (``_bind``), kept with its first
        # buffer's views (bounded there; the key holds the buffers, so no id is reused)
        key = (program, count, params, *args)
        memo = args[0][0].views
        call = memo.get(key)
        if call is None:
            if len(count) != 3 or not hasattr(program.cpu, "bind"):
                return False
            fn, views, kwargs, count, name = self._resolve(program, count, args, params)
            touched = 0
            for v in views:
                touched += v.nbytes
            if touched > TINY_BYTES:
                return False
            call = _bind(fn, views, kwargs, count, name) or _nothing
            if 0.0 not in params:   # -0.0 == 0.0 as a key: a zero param's call is not kept
                if len(memo) >= MAX_VIEWS:
                    memo.clear()
                memo[key] = call
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - kernel code is user code
            raise LaunchError(f"kernel {program.name} raised on cpu: {_text(e)}") from e
        return True

    def launch_graph_now(self, stream, graph, buf=None, nbytes=0, dtype=None):
        """Run a replay of at most :data:`INLINE_CALLS` ``TINY`` launches on the calling thread
        when ``stream`` is idle (as :meth:`launch_now`), then, with ``buf``, copy it as
        :meth:`copy_out_now` (the stream is idle then). See ``Backend.launch_graph_now``."""
        if (not graph.inline or stream.q or stream.busy or stream.errors or not self._threaded
                or self.closed):
            return False
        f = graph.one
        try:
            if f is not None:
                f()
            else:
                for f in graph.calls:
                    f()
        except BaseException as e:  # noqa: BLE001 - kernel code is user code
            name = next(n for c, n in zip(graph.calls, graph.names) if c is f)
            raise LaunchError(f"kernel {name} (in a graph replay) raised on cpu: "
                              f"{_text(e)}") from e
        if buf is None:
            return True
        v = buf.views.get(nbytes)           # (copy_out_now's copy)
        if v is not None and v.dtype is dtype:
            return v.copy()
        return _copy_typed(buf, nbytes, dtype)

    # -- graphs -------------------------------------------------------------------------------
    def begin_graph(self, stream):
        return CpuRecording()

    def record_launch(self, recording, program, count, args, params):
        recording.stack[-1].append(self._resolve(program, count, args, params))

    def end_graph(self, recording):
        return CpuGraph(tuple(recording.stack[0]))

    def launch_graph(self, stream, graph, mark=None):
        if graph.nodes:
            launches = graph.launches
            def run():
                _run_nodes(launches, mark)
                if mark is not None:
                    mark.ran = True
                    if mark.parents or mark.also:
                        mark.finished()
            self._enqueue(stream, _RUN, run)
            return
        calls, names = graph.calls, graph.names

        def replay():
            f = None
            try:
                for f in calls:     # a failing launch stops the replay: the rest never runs
                    f()
            except BaseException as e:  # noqa: BLE001 - kernel code is user code
                name = next(n for c, n in zip(calls, names) if c is f)
                err = LaunchError(f"kernel {name} (in a graph replay) raised on cpu: "
                                  f"{_text(e)}")
                if mark is not None:
                    err = mark.fail(err)
                raise err from e
            if mark is not None:
                mark.ran = True     # known done (Marks.done); its chain is cut at once
                if mark.parents or mark.also:
                    mark.finished()
        if self.closed:                 # (_enqueue, inlined: every enqueued replay)
            raise ServerClosed("cpu backend is closed")
        self.enqueued += 1
        if self.scheduler.push(stream, ((_TINY if graph.tiny else _CALL) if graph.plain
                                        else _RUN, replay), graph.small):
            return False                # deferred: at most DEFER_MAX items are pending

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
        old = graph.launches
        graph.launches = patch(old)
        try:
            graph.rebind()
        except BaseException:       # (a kernel's bind raised: LaunchError) all or nothing
            graph.launches = old
            graph.nodes = any(type(x) is not tuple for x in old)
            raise
        return graph

    # -- lifetime -----------------------------------------------------------------------------
    def set_broken(self, exc: BaseException) -> None:
        """Record that queued work may have been lost or left unmarked (``broken``: an
        exception interrupted a thread running this backend's items outside a kernel body)
        and tell the server (``on_broken``), which stops."""
        if self.broken is None:
            self.broken = exc
            self.on_broken()

    def is_alive(self):
        alive = getattr(self.scheduler, "is_alive", None)
        return not self.closed and self.broken is None and (alive is None or alive())

    def close(self):
        self.closed = True
        self.scheduler.close()
        err = ServerClosed("the cpu server was shut down before this work ran")
        for s in list(self.streams.values()):
            while s.q:
                kind, payload = s.q.popleft()
                if kind == _SIGNAL and isinstance(payload, Completion):
                    payload.fail(err)


def _on_stack(codes) -> bool:
    """Whether a frame of the calling thread runs one of the code objects ``codes``."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code in codes:
            return True
        f = f.f_back
    return False


#: the code of the methods that run kernel bodies on the server's owner (``reentrant``)
_INLINE_CODES = frozenset(m.__code__ for m in (CpuBackend.launch_now,
                                                CpuBackend.launch_graph_now, CpuBackend.flush))
#: ... and of every method that runs kernel bodies on any thread (``in_kernel``)
_KERNEL_CODES = _INLINE_CODES | {CpuBackend._execute.__code__}
