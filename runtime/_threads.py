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
"""

from __future__ import annotations

import threading

#: seconds :func:`start` waits for a new thread to run (it takes microseconds when all is well;
#: a new thread waits for the GIL at most a few switch intervals even on a loaded host)
START_S = 10.0


class _Started(threading.Event):
    """``Thread._started`` whose untimed ``wait`` (``Thread.start``'s) ends after ``limit_s``."""

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


def not_started(what: str) -> str:
    """The message of the error a caller raises when :func:`start` gave up on ``what``."""
    return (f"{what} did not start within {START_S:g} s: an asynchronous exception aimed at "
            "this thread (PyThreadState_SetAsyncExc, CPython < 3.12) may have landed in the "
            "new thread; nothing was started, try again")
