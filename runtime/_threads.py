"""Starting a thread with a way out.

``threading.Thread.start`` waits, without a timeout, for the new thread to say it runs. On
CPython 3.10 and 3.11 an asynchronous exception aimed at the starting thread
(``PyThreadState_SetAsyncExc``: a watchdog's timeout, a test harness's interrupt, the
contract's "asynchronous exception") can land in the new thread instead: the new thread's
state carries the starter's id until it runs, and ``SetAsyncExc`` takes the newest state with
that id. The new thread then dies before it says it runs (``Exception ignored in thread
started by ...``) and the starter waits for ever, holding whatever it held: in
``runtime.client()`` the server table's lock, so every later ``runtime.client()`` of the
process hung too (SOAK7: 1 in ~1,000 interrupted requests).

:func:`start` is ``thread.start()`` whose wait ends after :data:`START_S` seconds: it returns
whether the thread runs, and a thread it gave up on does nothing if it ever starts late (its
target is dropped). Callers raise a typed error (``ServerClosed`` for a server's threads).

:class:`Event` is a ``threading.Event`` that an asynchronous exception cannot leave locked
(SOAK8). CPython delivers one at a Python function's entry and right after a C function
called from Python returns; ``threading.Event`` (and any ``with`` over a
``threading.Condition``) enters its lock through the Condition's Python-level ``__enter__``,
which returns after the lock's C ``acquire``: an exception landing there leaves the lock held
for ever, and every later ``set`` (the device thread answering a call, a worker finishing a
completion) waited for it for ever. A ``with`` over a plain lock (a C ``__enter__`` and
``__exit__``) has no such point.
"""

from __future__ import annotations

import _thread
import gc
import sys
import threading

#: seconds :func:`start` waits for a new thread to run (it takes microseconds when all is well;
#: a new thread waits for the GIL at most a few switch intervals even on a loaded host)
START_S = 10.0


class Event:
    """``threading.Event`` (``set``, ``clear``, ``is_set``, ``wait``) that an asynchronous
    exception landing anywhere in a call leaves usable (module doc): its lock is only taken by
    ``with`` over a plain lock, and each waiter sleeps on a lock of its own that ``set``
    releases. One landing in a ``wait`` makes it raise (its waiter is forgotten); one landing
    in ``set`` still wakes every waiter."""

    __slots__ = ("_flag", "_lock", "_waiters")

    def __init__(self):
        self._flag = False
        self._lock = threading.Lock()
        self._waiters: list = []    # one held lock per waiting thread, released by set()

    def is_set(self) -> bool:
        return self._flag

    isSet = is_set

    def set(self) -> None:
        with self._lock:
            self._flag = True
            waiters, self._waiters = self._waiters, []
            try:
                for w in waiters:
                    w.release()
            finally:                # (an exception between two releases: the rest too)
                for w in waiters:
                    if w.locked():
                        w.release()

    def clear(self) -> None:
        with self._lock:
            self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set, or ``timeout`` seconds (None: no limit); returns ``is_set()``."""
        if self._flag:
            return True
        w = threading.Lock()
        w.acquire()
        with self._lock:
            if self._flag:
                return True
            try:
                self._waiters.append(w)
            except BaseException:
                if w in self._waiters:
                    self._waiters.remove(w)
                raise
        got = False
        try:
            got = w.acquire(True, -1 if timeout is None else max(0.0, timeout))
        finally:
            with self._lock:
                if w in self._waiters:      # (timed out, or interrupted)
                    self._waiters.remove(w)
        return got or self._flag

    def _at_fork_reinit(self) -> None:
        """(``threading``'s hook in a forked child) Fresh lock; the waiters stayed behind."""
        self._lock = threading.Lock()
        self._waiters = []


class Condition(_thread.RLock):
    """``threading.Condition()`` (its default reentrant lock; ``with``, ``acquire``,
    ``release``, ``wait``, ``wait_for``, ``notify``, ``notify_all``) that an asynchronous
    exception landing anywhere leaves unlocked (module doc; SOAK9). It *is* its lock, a C
    ``RLock``: ``with`` enters and exits in C, with no point where an exception can land
    between taking the lock and the block that releases it. ``threading.Condition``'s
    ``with`` enters through a Python ``__enter__``: a ``concurrent.futures.Future``'s
    ``result()`` interrupted there (``Batcher.embed`` under Ctrl-C) left the future's lock
    owned by the interrupted caller, and the batcher's worker, answering any request, waited
    for it for ever: every later request hung.

    ``wait`` reacquires the lock however it ends (an exception landing in it: raised with the
    lock held again, as ``threading.Condition``'s); one landing in ``notify`` still wakes the
    waiters it chose. Used as the ``_condition`` of the batcher's request futures.
    """

    __slots__ = ("_waiters",)

    def __init__(self):
        super().__init__()
        self._waiters: list = []    # one held plain lock per waiting thread, released by notify

    def wait(self, timeout: float | None = None) -> bool:
        """Release the lock, block until notified or ``timeout`` seconds pass (None: no
        limit), take the lock back. Returns whether notified. Raises ``RuntimeError`` when the
        caller does not hold the lock."""
        if not self._is_owned():
            raise RuntimeError("cannot wait on un-acquired lock")
        saved = (self._recursion_count(), _thread.get_ident())   # (an exception here: held)
        w = _thread.allocate_lock()
        w.acquire()
        self._waiters.append(w)
        got = False
        try:
            # no delivery point between ``try`` and this call: the ``finally`` only runs
            # once it released the lock
            self._release_save()
            got = w.acquire(True, -1 if timeout is None else max(0.0, timeout))
            return got
        finally:
            self._acquire_restore(saved)
            if not got and w in self._waiters:  # (timed out, or interrupted)
                self._waiters.remove(w)

    def wait_for(self, predicate, timeout: float | None = None):
        """``threading.Condition.wait_for``: wait until ``predicate()`` is true or ``timeout``
        seconds passed in all; returns the predicate's last value."""
        return threading.Condition.wait_for(self, predicate, timeout)

    def notify(self, n: int = 1) -> None:
        """Wake up to ``n`` waiters (``RuntimeError`` when the caller does not hold the lock);
        an exception landing in it still wakes every waiter it took."""
        if not self._is_owned():
            raise RuntimeError("cannot notify on un-acquired lock")
        # (Event.set's lines, inline on purpose: a shared helper's entry would be a point
        # where an exception lands after the waiters were taken, and none would wake)
        waiters = self._waiters[:n]
        self._waiters = self._waiters[n:]
        try:
            for w in waiters:
                w.release()
        finally:                    # (an exception between two releases: the rest too)
            for w in waiters:
                if w.locked():
                    w.release()

    def notify_all(self) -> None:
        """Wake every waiter (see :meth:`notify`)."""
        self.notify(len(self._waiters))

    notifyAll = notify_all

    def _at_fork_reinit(self) -> None:
        """(a forked child) Fresh lock; the waiters stayed behind."""
        super()._at_fork_reinit()
        self._waiters = []


class _Started(Event):
    """``Thread._started`` whose untimed ``wait`` (``Thread.start``'s) ends after ``limit_s``."""

    __slots__ = ("limit_s",)

    def __init__(self, limit_s: float):
        super().__init__()
        self.limit_s = limit_s

    def wait(self, timeout=None):
        return super().wait(self.limit_s if timeout is None else timeout)


def start(thread: threading.Thread, limit_s: float | None = None) -> bool:
    """``thread.start()`` with a way out: True once the thread runs, False when it did not run
    within ``limit_s`` seconds (default :data:`START_S`; the thread died before it ran, see the
    module doc): its target is then dropped and ``threading`` forgets it, so it runs nothing if
    it starts late.

    Raises what ``Thread.start`` raises (``RuntimeError``: started twice, no threads left; an
    asynchronous exception landing in its wait, the thread then dropped unless it runs).
    """
    started = _Started(START_S if limit_s is None else limit_s)
    thread._started = started
    try:
        thread.start()
    except BaseException:               # (an asynchronous exception landing in the wait)
        if not started.is_set():
            _forget(thread)
        raise
    if started.is_set():
        return True
    _forget(thread)
    return False


def _forget(thread: threading.Thread) -> None:
    """Drop a thread that has not run: its target (it runs nothing if it starts late) and
    ``threading``'s record of it (``threading.enumerate()`` listed it, and through its target
    whatever it would have served, for ever)."""
    thread._target, thread._args, thread._kwargs = None, (), {}
    limbo, lock = getattr(threading, "_limbo", None), getattr(threading, "_active_limbo_lock", None)
    if limbo is not None and lock is not None:
        with lock:
            limbo.pop(thread, None)


def is_alive(thread: threading.Thread) -> bool:
    """``thread.is_alive()`` without CPython 3.11's flaw (SOAK8): an exception landing in
    ``Thread._wait_for_tstate_lock`` right after its non-blocking poll of a running thread's
    lock runs that method's handler (bpo-45274's), which releases the lock the thread holds and
    marks it stopped: ``is_alive()`` is False for good while the thread runs on (the BLAS owner
    then started a second owner per such interrupt). This reads the lock's state only."""
    lock = getattr(thread, "_tstate_lock", False)
    if lock is False or not hasattr(thread, "_is_stopped"):  # (other versions: their own)
        return thread.is_alive()
    if not thread._started.is_set():
        return False
    return lock is not None and lock.locked() and not thread._is_stopped


def current_frames() -> dict:
    """``sys._current_frames()`` (thread id -> top frame) with the cyclic gc off meanwhile
    (SOAK9). On CPython 3.11 it holds the interpreter's thread-list lock while it builds its
    dict; a collection starting there runs weakref callbacks (Python code), which can hand the
    GIL to a thread that then starts a thread and waits for that lock with the GIL held: both
    wait for ever (CPython gh-106883; a fork's wait for BLAS calls, cpu_threads._before_fork,
    hung so beside a matmul starting its fan-out threads)."""
    was = gc.isenabled()
    try:
        gc.disable()
        return sys._current_frames()
    finally:
        if was:
            gc.enable()


def not_started(what: str) -> str:
    """The message of the error a caller raises when :func:`start` gave up on ``what``."""
    return (f"{what} did not start within {START_S:g} s: an asynchronous exception aimed at "
            "this thread (PyThreadState_SetAsyncExc, CPython < 3.12) may have landed in the "
            "new thread; nothing was started, try again")
