"""The cpu backend's schedulers: when the items queued on its streams run, and in which order.

- :class:`ThreadScheduler` (default): worker threads run any stream head as soon as it is
  runnable (per-stream FIFO, event waits honoured).
- :class:`InterleavingScheduler` (``seed``): defers all work, and when someone waits runs the
  runnable stream heads in a seeded random order, honouring only per-stream FIFO and events.
  A missing cross-stream dependency then gives wrong data deterministically for some seed;
  the property tests and ``runtime.testing`` use it. It records the order it ran stream heads
  (``trace``, a compact string: :func:`encode_trace` / :func:`decode_trace`).
- :class:`TraceScheduler` (``scheduler="trace", trace=...``): runs a recorded trace again, so a
  failing schedule stays reproducible after the code around it changed.

A scheduler sees the backend through ``backend.streams`` (``{index: stream}``, each stream with
``q``, a deque of ``(kind, payload)`` items, ``busy``, ``sched``, ``pending`` and ``index``: a
number never reused, in order of creation) and ``backend.execute(stream, kind, payload)``; item
kinds are ``RUN`` (a callable; ``CALL``: one that uses no library thread pool), ``WAIT`` (an
event: runnable once ``event.done``) and ``SIGNAL`` (an event or a completion to finish). The
backend calls :meth:`Scheduler.event_done` when an event completes.

Cost: a pick looks only at streams that have work (the thread scheduler: a FIFO of runnable
streams; a stream whose head waits on an event sits on that event's ``waiters`` until it
completes; the interleaving scheduler: the streams with queued items), never at every stream
ever created: a server with thousands of idle streams schedules as fast as one with a few.
"""

from __future__ import annotations

import collections
import itertools
import random
import threading

from .. import _threads
from ..errors import LaunchError, ServerClosed
from .base import Completion

RUN, WAIT, SIGNAL = 0, 1, 2
#: a ``RUN`` item that uses no library thread pool (a copy, numpy ufunc calls): it runs
#: outside the thread rule's count (``runtime.kernels.threads``); schedulers treat it as ``RUN``.
CALL = 3
#: a ``CALL`` item touching at most ``runtime.backends.cpu.TINY_BYTES``: the server's owner may
#: run a few of them itself, in order, when a read or sync flushes the stream (``CpuBackend.flush``).
TINY = 4
#: items a ``ThreadScheduler`` leaves queued without waking a worker (``push(defer=True)``):
#: past this backlog it wakes one.
DEFER_MAX = 16
#: seconds ``ThreadScheduler.close`` waits for its lock before it takes it back (held by a
#: thread an asynchronous exception interrupted: nothing else holds it for long).
CLOSE_LOCK_S = 2.0
#: seconds deferred work waits at most for a caller before the polling worker runs it.
DEFER_S = 0.02
#: a stream's ``sched`` state in the thread scheduler: in no list, in ``ready``, on an event's
#: ``waiters``.
IDLE, READY, BLOCKED = 0, 1, 2


class Scheduler:
    """Decides when queued stream items run. Subclasses: ``ThreadScheduler``,
    ``InterleavingScheduler``."""

    def attach(self, backend: "CpuBackend") -> None:
        self.backend = backend

    def notify(self) -> None:
        """Work was enqueued."""

    def push(self, stream, item, defer: bool = False):
        """Append ``item`` to ``stream``'s queue and let a worker know (``defer``: the work is
        small and a caller will probably wait for it soon; a scheduler may leave it for that
        caller to run, see ``ThreadScheduler``). Returns True when it was left so (the backlog
        is then at most ``DEFER_MAX`` items), else None."""
        stream.q.append(item)

    def kick(self) -> None:
        """Make sure deferred work runs without a caller waiting for it."""

    def notify_all(self) -> None:
        """An event completed: streams waiting on it may run."""

    def event_done(self, event) -> None:
        """``event`` completed (``event.done`` is set): streams waiting on it may run."""
        self.notify_all()

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
    or a long kernel does not hold up the others. Runnable streams wait in ``ready`` (FIFO, so
    streams take turns); a stream whose head waits on an event is parked on the event's
    ``waiters`` until :meth:`event_done`; a stream given deferred work is noted in ``deferred``
    (a lock-free append) and made ready when a worker looks: a pick never scans idle or
    blocked streams.

    Small work is not handed to a worker (issue 26, the combining idea applied to execution):
    an item pushed with ``defer=True`` stays queued without waking a worker, and the caller
    that waits for it (a read, a sync: :meth:`help`) runs its stream's queue itself, in order,
    on its own thread. That saves the two thread hand-offs (a wake-up, the GIL passed to the
    worker and back), which cost more than tiny work itself. A worker is woken as before when
    the work is large (not deferred), when more than :data:`DEFER_MAX` items wait
    unannounced, when a waiting caller cannot make progress itself (its stream waits on
    another stream's event), and by :meth:`kick`. Nobody has to wait for deferred work to
    run: worker 0 polls every :data:`DEFER_S` while deferred pushes keep coming (one wake-up
    when they start again after a pause), so a fire-and-forget launch runs within tens
    of milliseconds on its own (a stream is asynchronous to the caller, docs/contract.md section
    3), and the poll, which takes the GIL from the caller, stays rare.

    Args:
        workers: worker threads (default 4).
    """

    def __init__(self, workers: int = 4):
        self.workers = workers

    def attach(self, backend):
        super().attach(backend)
        # SOAK8: blocks take the plain lock (``with self.lock``), never the Condition's Python
        # __enter__/__exit__, where an asynchronous exception can land with the lock taken
        # (SOAK6 found it left held: the server died of it)
        self.lock = lock = threading.Lock()
        self.cv = threading.Condition(lock)
        # the polling worker's untimed sleep: a deferred push after a pause wakes it alone
        # (cv would wake every idle worker, and each would race to take the caller's work)
        self.poll_cv = threading.Condition(lock)
        self.ready = collections.deque()      # streams that may be runnable (sched == READY)
        self.deferred = collections.deque()   # streams given deferred work (pending == True)
        self.waiting = 0
        self.closed = False
        self.pushes = 0                 # deferred pushes so far (by the server's owner only)
        self._seen = 0                  # ... when the polling worker last looked
        self.poller_asleep = False      # the polling worker waits without a timeout
        self.threads = [threading.Thread(target=self._loop, args=(k == 0,),
                                         name=f"runtime-cpu-worker-{k}", daemon=True)
                        for k in range(self.workers)]
        try:
            for t in self.threads:
                if not _threads.start(t):   # SOAK7: the backend's constructor raises, and the
                    raise ServerClosed(_threads.not_started(t.name))  # started ones end
        except BaseException:           # (an asynchronous exception too: none runs for nobody)
            self.close()
            raise

    def notify(self):
        if self.waiting:
            with self.lock:
                self._wake_one()

    def _wake_one(self) -> None:
        """Wake one idle worker for runnable work (under cv): a worker waiting on cv, else the
        polling worker from its untimed sleep."""
        if self.waiting > self.poller_asleep:
            self.cv.notify()
        elif self.poller_asleep:
            self.poll_cv.notify()

    def push(self, s, item, defer=False):
        if defer:
            be = self.backend
            if be.enqueued - be.executed <= DEFER_MAX:
                s.q.append(item)            # left for the caller that waits (help) to run
                if not s.pending:           # (a worker clears it, then looks at s.q)
                    s.pending = True
                    self.deferred.append(s)
                self.pushes += 1
                if self.poller_asleep:      # (read after the count: see _loop)
                    with self.lock:
                        self.poll_cv.notify()
                return True
        with self.lock:                           # atomic with a worker's pick-then-wait
            s.q.append(item)
            if s.sched == IDLE and not s.busy:
                s.sched = READY
                self.ready.append(s)
                if self.waiting:
                    self._wake_one()

    def _requeue(self, s) -> None:
        """``s`` stopped running, got work or its event completed: ready again if it has work
        (under cv)."""
        if s.q and s.sched == IDLE and not s.busy:
            s.sched = READY
            self.ready.append(s)
            if self.waiting:
                self._wake_one()

    def kick(self):
        if self.waiting:
            with self.lock:
                self._wake_all()

    def notify_all(self):
        with self.lock:
            self._wake_all()

    def _wake_all(self) -> None:
        self.cv.notify_all()
        self.poll_cv.notify_all()

    def event_done(self, event):
        with self.lock:
            waiters = getattr(event, "waiters", None)
            if waiters:
                event.waiters = None
                for s in waiters:
                    if s.sched == BLOCKED:
                        s.sched = IDLE
                        self._requeue(s)

    def _pick(self):
        deferred, ready = self.deferred, self.ready
        while deferred:                         # streams given deferred work: ready them
            s = deferred.popleft()
            s.pending = False
            self._requeue(s)
        while ready:
            s = ready.popleft()
            s.sched = IDLE
            if s.busy or not s.q:               # run elsewhere (help) or emptied meanwhile
                continue
            kind, payload = s.q[0]
            if kind == WAIT and not payload.done:
                s.sched = BLOCKED               # event_done makes it ready again
                if payload.waiters is None:
                    payload.waiters = []
                payload.waiters.append(s)
                continue
            s.busy = True                       # before popleft: see is_idle
            s.runner = threading.get_ident()
            s.q.popleft()
            return s, kind, payload
        return None

    def _loop(self, poller=False):
        try:
            self._work(poller)
        except BaseException as e:
            # an exception ending a worker (an asynchronous one: KeyboardInterrupt,
            # PyThreadState_SetAsyncExc) may have landed with an item taken and not run (or
            # run unmarked): the backend is broken and the server stops at once, before a fast
            # path or another worker answers from a buffer that item should have written
            # (before: the stream's later reads returned the stale values; ADV6)
            self.backend.set_broken(e)
            raise

    def _work(self, poller):
        cv, lock = self.cv, self.lock
        with lock:
            while not self.closed:
                item = self._pick()
                if item is None:
                    self.waiting += 1
                    if poller:
                        # asleep first, then the count: a push that read asleep=False counted
                        # before this read, so it is seen here and the wait is timed
                        self.poller_asleep = True
                        if self.pushes != self._seen:
                            self._seen = self.pushes
                            self.poller_asleep = False
                            cv.wait(DEFER_S)
                        else:
                            self.poll_cv.wait()
                            self.poller_asleep = False
                            if self.pushes != self._seen and not self.ready:
                                # woken by a deferred push: its caller runs it when it waits
                                # for it (help); look after DEFER_S, not at once
                                self._seen = self.pushes
                                cv.wait(DEFER_S)
                    else:
                        cv.wait()
                    self.waiting -= 1
                    continue
                cv.release()
                try:
                    self.backend.execute(*item)
                except BaseException as e:  # see _loop: broken before the stream is requeued
                    self.backend.set_broken(e)
                    raise
                finally:
                    cv.acquire()
                    item[0].busy = False
                    self._requeue(item[0])      # its next item may be runnable now

    def is_idle(self, stream) -> bool:
        return not stream.q and not stream.busy   # q first: a worker sets busy, then pops

    def settle(self, comp, stream):
        comp.helper = lambda: self.help(stream, comp)
        return comp

    def help(self, stream, comp) -> None:
        """Run ``stream``'s runnable head items on the calling (waiting) thread until ``comp``
        is done, unless a worker already holds the stream: saves two thread hand-offs on a
        read or sync. Runs outside the server's lock; ``busy`` keeps per-stream FIFO (held for
        the whole run, so the items are popped without the lock). When it stops short of
        ``comp`` (the stream waits on another stream's event), the workers are woken."""
        lock = self.lock
        claimed = taken = False
        try:                                # (from before busy is set: an interrupt anywhere
            with lock:                        # after it still clears it, else the stream hangs)
                if stream.busy or not stream.q or self.closed:
                    if not comp.done and self.waiting and (self.deferred or self.ready):
                        self._wake_all()        # (deferred work it waits for: see _pick)
                    return
                stream.runner = threading.get_ident()
                stream.busy = claimed = True
            q, execute = stream.q, self.backend.execute
            while not comp.done and q:
                kind, payload = q[0]
                if kind == WAIT and not payload.done:
                    break
                taken = True
                q.popleft()
                execute(stream, kind, payload)
                taken = False
        except BaseException as e:
            if taken:                       # interrupted with an item taken (see broken)
                self.backend.set_broken(e)
            raise
        finally:
            if claimed:
                with lock:
                    stream.busy = False
                    self._requeue(stream)
                    if not comp.done and self.waiting and (self.deferred or self.ready):
                        self._wake_all()        # (deferred work it waits for: see _pick)

    def is_alive(self) -> bool:
        return all(_threads.is_alive(t) for t in self.threads)   # (SOAK8: never a live
        #                                                             one taken for dead)

    def close(self):
        # SOAK6: an asynchronous exception landing between a ``with cv`` acquire and its block
        # leaves the lock held for ever (the server dies of it): take it back, or the workers
        # and the closing thread would wait for it for ever (a plain Lock: any thread may)
        if not self.cv.acquire(timeout=CLOSE_LOCK_S):
            self.cv._lock.release()
            self.cv.acquire()
        try:
            self.closed = True
            self._wake_all()
        finally:
            self.cv.release()
        for t in self.threads:
            if t.is_alive():                # (not one that never started: SOAK7)
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
    :func:`encode_trace`), and ``TraceScheduler(trace)`` runs it again exactly. The record
    grows with the work run (one int per stream item): a tool for property tests and short
    programs, not for a long-running server (the default ``ThreadScheduler`` keeps none).

    Args:
        seed: the interleaving; the same program and seed give the same order.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.rng = random.Random(seed)
        self.picks: list = []
        self.active: dict = {}        # {index: stream} of streams that may have queued work

    def push(self, stream, item, defer: bool = False) -> None:
        stream.q.append(item)
        self.active[stream.index] = stream

    def __repr__(self):
        return f"InterleavingScheduler(seed={self.seed})"

    @property
    def trace(self) -> str:
        """The stream heads run so far, in order, as a compact string (:func:`encode_trace`)."""
        return encode_trace(self.picks)

    def choose(self, ready: list):
        """The stream to run next among ``ready`` (runnable heads, in stream index order)."""
        return ready[self.rng.randrange(len(ready))]

    def _ready(self) -> list:
        """Streams with a runnable head, in index order (only streams with work are looked
        at; emptied ones leave ``active``)."""
        active = self.active
        ready = []
        for k in sorted(active):
            s = active[k]
            if not s.q:
                del active[k]
            elif s.q[0][0] != WAIT or s.q[0][1].done:
                ready.append(s)
        return ready

    def settle(self, comp, stream):
        while not comp.done:
            ready = self._ready()
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
            s = streams.get(k)
            if s is not None and s in ready:
                self.step += 1
                return s
            self._off_trace()
            if s is not None and s.q:
                return ready[0]           # blocked on an event: run another, keep the step
            self.step += 1                # nothing queued there: skip the step
        self._off_trace()
        return ready[0]
