"""The device queue: one FIFO of messages, run by one owner at a time.

Design.md section 1: every server-side table is touched by one thread at a time and the queue
is the order. The owner is either the device thread or a caller that found the server idle and
runs the queued messages (its own last) under the server's lock: the combining fast path. A
blocking call then costs no thread hand-off (about 60 µs on this machine through a plain queue
and a thread wake-up; a few µs combined).

Invariant that keeps a message from being stranded: whoever holds the owner lock drains until
the queue is empty, releases, and looks again; a message appended while the lock was held is
therefore either drained by the holder or seen by it after its release.

Bounds (docs/contract.md section 1): the queue holds at most ``max_messages`` messages and
``max_bytes`` of pending host data (writes), and the backend's own backlog (``load``: items
enqueued on its streams but not yet run, and their bytes) at most ``max_load`` items. A
fire-and-forget ``submit`` that finds the queue full waits on its own thread until there is
room (or raises ``ServerClosed`` once the server stops): a flood from one client never grows
memory without bound. Blocking calls and finalizer posts do not wait for room (each caller has
at most one blocking call outstanding, and a finalizer may run inside a message).

Releases (a ``Handle``'s free, a graph's destroy, a dropped stream) come from finalizers, which
may fire by the thousand at once (dropping a list of handles) on any thread, even inside a
message, and must never block. They are coalesced (:meth:`DeviceQueue.release`): a release
joins the batch of the release message at the tail of the queue if there is one (a ``deque``
append: no lock, no wait), else it queues a new batch message. So a burst of 100,000 drops puts
one message in the queue, not 100,000, and a release never runs before a message queued before
it (a launch using the handle it frees). A batch message runs at most ``RELEASE_BATCH`` units
and, if more are left, queues itself again behind the messages that arrived meanwhile: a
blocking call of another client waits for at most one batch.

Deferred work (``lazy``, issue 26): the owner may leave work for the next owner (the server's
launches and replays of tiny work, made while nothing was queued): a list of at most
``LAZY_MAX`` items that every owner runs (``run_lazy``) before anything else it does under the
lock: before the first message of a drain, before the message it runs on the combining path,
and on the server's own entries (read, launch, replay, sync). So no message, and no entry,
ever runs before deferred work that was recorded before it: the work runs later than it was
asked for, never out of order and never unseen. Work no call ran meanwhile is run by the device
thread within ``LAZY_S``: after any wake-up it looks every ``LAZY_S`` until ``LAZY_LOOKS`` looks
in a row found nothing, then waits without a timeout, and the next deferral wakes it
(``lazy_asleep``); so a deferred launch or replay runs on its own within tens of milliseconds,
as a fire-and-forget enqueue does (docs/contract.md section 3), a steady stream of deferrals costs
one wake-up per ~0.1 s at most, and the look, which takes the GIL, stays rare.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
import traceback
import weakref

from .. import _threads
from ..errors import ServerClosed, ServerError, ServerForked, UnsupportedError, unhealthy

#: seconds between health checks while a caller waits for an answer.
POLL_S = 0.05
#: default bounds: queued messages, bytes of pending host data, backend backlog items. Small on
#: purpose: a blocking call waits behind at most this backlog. Measured on 2 loaded cores
#: (runtime/bench/stalls.py (b), 4 flooding threads): a 16-byte read's p99 was 10 ms with 32/256,
#: 23 ms with 64/256, 51 ms with 128/512 and 330 ms with 256/1024, at the same launch rate.
MAX_MESSAGES = 32
MAX_BYTES = 256 << 20
MAX_LOAD = 256
#: release units (a free is 1, a graph destroy 1 + its handles / 8) run per release message.
RELEASE_BATCH = 256
#: deferred items (``DeviceQueue.lazy``) past which the owner that defers one runs them all.
LAZY_MAX = 16
#: seconds after which the device thread runs deferred work that no call ran (module doc).
LAZY_S = 0.02
#: looks (every ``LAZY_S``) that find no deferred work before the device thread waits without a
#: timeout again: it looks for ~0.1 s after each wake-up, then sleeps until work comes.
LAZY_LOOKS = 5
#: seconds the device thread waits for the owner lock before it checks whether a thread that
#: was interrupted left it held (``DeviceQueue._take_owner``).
OWNER_CHECK_S = 1.0


class OwnerLock:
    """The owner lock (module doc): held by the one thread that may run messages and device
    work now. A token in a one-item list (``tok``): taking it is one ``list.pop()`` (atomic
    under the GIL; ``IndexError`` when another thread holds it), giving it back one
    ``append``. Issue 26: every call into an idle server takes and gives back the owner lock,
    and ``threading.Lock.acquire(False)`` spends most of its ~1,000 instructions parsing its
    arguments; the pop and the append cost ~300 together (valgrind callgrind, CPython 3.11).
    The hot paths use ``tok`` directly: ``if tok: tok.pop()`` with ``IndexError`` handled as
    "held" (another thread took it between the test and the pop), ``tok.append(True)`` to
    give it back.

    Nobody blocks on it in the hot paths: a caller that finds it held queues its work, which the
    holder runs before it lets go (the module doc's invariant). A blocking :meth:`acquire`
    (the device thread, tests) polls, sleeping 0.5 ms doubling to 20 ms between looks; only a
    thread that found messages queued while another held the lock waits this way, and the
    holder drains them itself on release. The API is ``threading.Lock``'s subset the queue
    uses: :meth:`acquire`, :meth:`release`, :meth:`locked`.
    """

    __slots__ = ("tok",)

    def __init__(self):
        self.tok = [True]

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock; True once held. ``blocking=False``: one try. ``timeout`` (seconds,
        -1: none): give up after it, False."""
        tok = self.tok
        deadline = None if timeout < 0 else time.monotonic() + timeout
        delay = 0.0005
        while True:
            if tok:
                try:
                    tok.pop()
                    return True
                except IndexError:          # taken between the test and the pop
                    pass
            if not blocking:
                return False
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                delay = min(delay, left)
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def release(self) -> None:
        """Give the lock back. Raises ``RuntimeError`` when it is not held (as
        ``threading.Lock``: a second token would let two owners run at once)."""
        if self.tok:
            raise RuntimeError("release of the owner lock, which nobody holds")
        self.tok.append(True)

    def locked(self) -> bool:
        """Whether a thread holds the lock."""
        return not self.tok


class Reply:
    """The answer of one blocking message: a value or an error, set once by the owner."""

    __slots__ = ("done", "value", "error", "_event")

    def __init__(self):
        self.done = False
        self.value = None
        self.error = None
        self._event = None

    def finish(self, value, error):
        self.value, self.error = value, error
        self.done = True            # before reading _event; the waiter sets _event then re-checks
        ev = self._event
        if ev is not None:
            ev.set()

    def wait(self, timeout):
        if self.done:
            return True
        if self._event is None:
            self._event = _threads.Event()     # (SOAK8: no lock an interrupt leaves held)
            if self.done:
                return True
        return self._event.wait(timeout)


class DeviceQueue:
    """A FIFO of ``(fn, args, slot)`` messages with a device thread and a combining fast path.

    Args:
        name: the device thread's name.
        on_async_error: called with the exception of a fire-and-forget message that raised (the
            server queues it on a stream); never called for blocking messages.
        healthy: a callable that turns False when a worker the answers depend on died (the cpu
            backend's stream workers); a waiting caller then gets ``ServerClosed``.
        load: a callable returning the backend's backlog ``(items, bytes)`` (see module doc);
            the backend calls :meth:`notify_room` when it shrinks.
        reentrant: a callable, True on a thread that holds the owner lock while it runs user
            code (the cpu backend's kernel bodies on its fast paths): asked by a wait that
            lasted a poll interval; such a blocking call or wait for room can never be
            answered, so it raises ``UnsupportedError`` (its message is taken back unrun).
        in_kernel: a callable, True on a thread that is running a kernel body (a backend
            worker's, or a waiter helping its stream): asked by a wait for a completion that
            lasted a poll interval, which then raises ``UnsupportedError`` (the body may be
            what the completion waits for: it would hang).
        max_messages, max_bytes, max_load: the bounds (module doc); attributes, changeable.
    """

    def __init__(self, name: str, on_async_error, healthy=None, load=None,
                 max_messages: int = MAX_MESSAGES, max_bytes: int = MAX_BYTES,
                 max_load: int = MAX_LOAD, reentrant=None, in_kernel=None):
        self._healthy = healthy or (lambda: True)
        self._reentrant = reentrant or (lambda: False)
        self._in_kernel = in_kernel or (lambda: False)
        self._load = load or (lambda: (0, 0))
        self._q = collections.deque()
        self._owner = OwnerLock()
        self._tok = self._owner.tok     # the hot paths' handle on it (OwnerLock)
        self._wake = _threads.Event()   # SOAK8: set by callers; an interrupted set or wait
        #                                 (threading.Event) left its lock held: the device thread hung
        self._on_async_error = on_async_error
        #: called with ``(exception, fn, args)`` of a fire-and-forget message that raised (the
        #: server's marks what the message would have written: ``ComputeServer._on_async_error``)
        self.message_error = lambda e, fn, args: on_async_error(e)
        self.max_messages, self.max_bytes, self.max_load = max_messages, max_bytes, max_load
        self.bytes = 0                  # pending host data of queued messages
        # SOAK8: blocks take the plain lock (``with self._room_lock``), never the Condition's
        # Python-level __enter__/__exit__, where an asynchronous exception (KeyboardInterrupt)
        # can land with the lock taken and leave it held for ever (the next write hung)
        self._room_lock = threading.Lock()
        self._room = threading.Condition(self._room_lock)
        self.room_waiters = 0           # producers waiting for room (tests and benchmarks read it)
        self.closed = False
        self.closing = False            # a normal shutdown is under way (not a death)
        self.death: BaseException | None = None
        self._carry: dict = {}          # {id: batch} cut short by RELEASE_BATCH, requeued
        self._batch_fn = self._run_batch    # one object: release() spots its messages by it
        self.forked_from: int | None = None     # the parent's pid, in a forked child
        #: errors still queued when the server closed: raised, once, with the next
        #: ``ServerClosed`` (never dropped by a shutdown; set by the server's last message)
        self.leftover: list = []
        #: deferred work (module doc): appended and run by the owner only
        self.lazy: list = []
        #: runs and empties ``lazy`` (owner only; set by the server: ``ComputeServer._run_lazy``)
        self.run_lazy = self.lazy.clear
        #: whether the device thread waits without a timeout: an owner that appends to ``lazy``
        #: then sets ``_wake``. The thread sets it first, then looks at ``lazy``, and the owner
        #: appends first, then reads it: either the thread sees the work or the owner wakes it.
        self.lazy_asleep = False
        #: run by the device thread as it ends after a death (the server: close the backend,
        #: whose workers would otherwise outlive it; a shutdown closes it in its last message)
        self.on_death = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        try:
            started = _threads.start(self._thread)  # SOAK7: never a hang in runtime.client()
        except BaseException:           # (an asynchronous exception: the thread may run)
            self.closed = True
            self._wake.set()
            raise
        if not started:
            self.closed = True
            raise ServerClosed(_threads.not_started(f"the device thread {name}"))
        _QUEUES.add(self)

    # -- producers ------------------------------------------------------------------------
    def full(self) -> bool:
        """Whether a fire-and-forget message must wait: a bound of the module doc is reached."""
        if len(self._q) >= self.max_messages or self.bytes >= self.max_bytes:
            return True
        items, nbytes = self._load()
        return items >= self.max_load or self.bytes + nbytes >= self.max_bytes

    def wait_room(self) -> None:
        """Block the calling (producer) thread until the queue has room.

        Raises: ``ServerClosed`` when the server stops or dies meanwhile, or a worker the
        backlog depends on died (the cpu backend's stream workers: nothing would ever make
        room); checked every 50 ms.
        """
        with self._room_lock:
            self.room_waiters += 1
            try:
                while self.full():
                    if self.closed or self.closing or not _threads.is_alive(self._thread):
                        raise self.closed_error()
                    if not self._healthy():
                        break               # (stopped below, outside the room's lock)
                    self._room.wait(POLL_S)
                    if self.full() and self._owner.locked() and self._reentrant():
                        raise self._reentry()     # only this thread's owner lock makes room
            finally:
                self.room_waiters -= 1
        if self.full():                     # a worker the backlog depends on died
            self._worker_died()

    def _worker_died(self) -> None:
        """A waiting caller found the backend dead (a worker thread died): stop the server
        (``_die``: every later call raises ``ServerClosed``, the next ``runtime.client`` gets
        a fresh server) and raise ``ServerClosed``. Before, the server only raised to the
        callers that noticed and stayed in the server table: a new client was handed the dead
        server for ever (wgpu, its queue thread), or calls on streams of the cpu workers still
        alive kept answering (ADV6)."""
        if not (self.closed or self.closing):
            self._die(RuntimeError("a backend worker thread died"))
        raise self.closed_error()

    def notify_room(self) -> None:
        """Wake producers waiting for room (the owner after a message, the backend when its
        backlog shrank); cheap when nobody waits."""
        if self.room_waiters:
            with self._room_lock:
                self._room.notify_all()

    def submit(self, fn, *args, nbytes: int = 0) -> None:
        """Fire-and-forget: queue ``fn(*args)``; run it now if the server is idle.

        Args:
            nbytes: bytes of host data the message carries (a write's payload), counted
                against ``max_bytes`` until the message ran.
        Waits for room when the queue is full (module doc).
        Raises: ``ServerClosed`` once the server stopped (also while waiting for room).
        """
        if self.closed:
            raise self.closed_error()
        q = self._q
        items, held = self._load()              # (full(), inlined: this is the launch path)
        if (len(q) >= self.max_messages or items >= self.max_load
                or self.bytes + held >= self.max_bytes):
            self.wait_room()
        if nbytes:
            with self._room_lock:
                self.bytes += nbytes
            fn = _Counted(self, fn, nbytes)
        elif not q and self._owner.acquire(False):
            if not q and not self.closed:   # idle: run it here, with nothing queued to wrap
                try:
                    if self.lazy:
                        self.run_lazy()
                    fn(*args)
                except (SystemExit, KeyboardInterrupt, _Fatal) as e:
                    self._die(e)
                except BaseException as e:  # noqa: BLE001 - queued on a stream, as in _drain
                    self.message_error(e, fn, args)
                finally:
                    self._release()
                return
            q.append((fn, args, None))
            self._drain()
            return
        q.append((fn, args, None))
        if self._owner.acquire(False):
            self._drain()
        else:
            self._wake.set()

    def post(self, fn, *args) -> None:
        """Queue ``fn(*args)`` for the device thread without ever running it here.

        For finalizers (``Handle.__del__``, a graph's last drop), which may fire anywhere,
        including inside a message. Silently dropped once the server stopped.
        """
        if self.closed:
            return
        self._q.append((fn, args, None))
        self._wake.set()

    def release(self, fn, *args) -> None:
        """Queue the release ``fn(*args)`` (a free, a graph destroy, a dropped stream) from a
        finalizer: never blocks, never runs it here, and adds at most one message to the queue
        however many releases are pending (module doc). Silently dropped once the server
        stopped. ``fn`` may return its cost in batch units (default 1) and must be idempotent
        (a release may be queued twice: below).

        An asynchronous exception landing in here (a signal handler's on the main thread, where
        finalizers run too) would lose the release (a buffer, graph or stream kept for ever):
        the release is queued again in a batch of its own before the exception goes on."""
        if self.closed:
            return
        try:
            self._join_batch(fn, args)
        except BaseException:
            self._q.append((self._batch_fn, (_Batch(((fn, args),)),), None))
            self._wake.set()
            raise

    def _join_batch(self, fn, args) -> None:
        q = self._q
        try:
            last = q[-1]
        except IndexError:
            last = None
        if last is not None and last[0] is self._batch_fn:
            batch = last[1][0]
            if not batch.started:
                batch.append((fn, args))
                if not batch.started:
                    return
                # its runner started meanwhile and may have finished: queue the batch again for
                # whatever is left (this release included; only the owner pops a batch)
                q.append((self._batch_fn, (batch,), None))
                if not self._wake.is_set():
                    self._wake.set()
                return
        q.append((self._batch_fn, (_Batch(((fn, args),)),), None))
        if not self._wake.is_set():
            self._wake.set()

    def _run_batch(self, batch: "_Batch") -> None:
        """The message of one batch of releases: run at most ``RELEASE_BATCH`` units, requeue
        the rest at the tail (``_carry`` remembers it for :meth:`run_releases`); also when an
        asynchronous exception interrupted the run (nothing of the batch is lost)."""
        batch.started = True
        try:
            self._run(batch, RELEASE_BATCH)
        finally:
            if batch:
                if not batch.carried:
                    batch.carried = True
                    self._carry[id(batch)] = batch
                self._q.append((self._batch_fn, (batch,), None))
            elif batch.carried:               # done: forget it (the carry is bounded by live ones)
                batch.carried = False
                self._carry.pop(id(batch), None)

    def _run(self, batch: "_Batch", limit) -> int:
        # a release leaves the batch only after it ran (only the owner pops a batch): an
        # asynchronous exception (a signal handler's, on a caller that drains) before or inside
        # it leaves it at the head, run again later (releases are idempotent)
        done = units = 0
        while batch and (limit is None or units < limit):
            fn, args = batch[0]
            try:
                cost = fn(*args)
            except Exception as e:  # noqa: BLE001 - every error goes to the next blocking call
                cost = 1
                self._on_async_error(e)
            batch.popleft()
            units += cost if type(cost) is int and cost > 0 else 1
            done += 1
        return done

    def run_releases(self) -> int:
        """Owner only: run now every release a batch message left for later (cut short by
        ``RELEASE_BATCH``): each was dropped before the message running this, so counts and
        capture windows see them gone. Releases queued after this message are left alone (a
        message queued before them may still use what they free). Returns the releases run."""
        done = 0
        carry, self._carry = self._carry, {}
        for batch in carry.values():
            batch.carried = False
            done += self._run(batch, None)
        return done

    @property
    def pending_releases(self) -> int:
        """Releases queued and not run yet (a snapshot: owner only, or for tests)."""
        return sum(len(m[1][0]) for m in list(self._q) if m[0] is self._batch_fn)

    def call(self, fn, *args):
        """Blocking: queue ``fn(*args)`` and return its value (or raise its error).

        Raises: ``ServerClosed`` if the server stops or dies before answering (never a hang).
        """
        if self.closed:
            raise self.closed_error()
        q = self._q
        tok = self._tok
        owner = False
        if not q and tok:
            try:
                owner = tok.pop()           # (OwnerLock: the owner lock taken)
            except IndexError:              # (taken meanwhile by another thread)
                pass
        if owner:
            if not q and not self.closed:   # idle: run it here, no slot (the combining path)
                try:
                    if self.lazy:
                        self.run_lazy()
                    return fn(*args)
                except (SystemExit, KeyboardInterrupt, _Fatal) as e:
                    self._die(e)
                    raise self.closed_error() from None
                except BaseException:
                    self._check_backend()   # (a read's flush interrupted: CpuBackend.broken)
                    raise
                finally:                    # (_release, inlined: the blocking calls' path)
                    tok.append(True)
                    if self.room_waiters:
                        self.notify_room()
                    if q and not self.closed and self._owner.acquire(False):
                        self._drain()
            slot = Reply()
            msg = (fn, args, slot)
            q.append(msg)
            self._drain()
        else:
            slot = Reply()
            msg = (fn, args, slot)
            q.append(msg)
            if self._owner.acquire(False):
                self._drain()
            else:
                self._wake.set()
        if not slot.done:
            self.wait(slot, msg)
        if slot.error is not None:
            raise slot.error
        return slot.value

    def _reentry(self, msg=None) -> UnsupportedError:
        """The caller holds the owner lock itself (``reentrant``): take ``msg`` back out of the
        queue (it must not run after the caller was told it failed) and say why."""
        if msg is not None:               # by identity (this thread is the owner: nothing
            q = self._q                   # else pops; appends go to the right)
            for i, m in enumerate(list(q)):
                if m is msg:
                    del q[i]
                    break
        return UnsupportedError(
            "a blocking runtime call (read, sync, replay, ...) or a wait for room in the queue "
            "from inside a cpu kernel body that runs at once under the server's lock (a tiny "
            "launch or replay on an idle stream, or a read's flush: issue 26's fast paths) "
            "could never be answered; call the runtime outside kernel bodies")

    def wait(self, waitable, msg=None) -> None:
        """Wait for ``waitable.wait(timeout)`` to turn True, checking health every 50 ms.

        Args:
            msg: the queued message ``waitable`` answers (``call``), taken back if the caller
                itself holds the owner lock (see ``reentrant``).
        Raises: ``ServerClosed`` when the server stopped or its thread died meanwhile;
            ``UnsupportedError`` when the caller holds the owner lock itself (a kernel body
            on the cpu fast paths calling the runtime): nothing else could answer; or when a
            kernel body waits for a completion for a poll interval (``in_kernel``).
        """
        try:
            while not waitable.wait(POLL_S):
                self._poll(waitable, msg)
        except ServerError:
            raise
        except BaseException:
            self._check_backend()         # an interrupt while this thread ran queued work
            raise

    def _check_backend(self) -> None:
        """After an exception escaped a handler or a wait: if the backend now reports itself
        dead (a worker died, or a thread running a stream's queued work was interrupted with an
        item taken: ``CpuBackend.broken``), queued work may have been lost, so the server stops
        (every later call raises ``ServerClosed``) rather than answer from stale buffers."""
        if not self.closed and not self._healthy():
            self._die(RuntimeError(
                "the backend stopped: a worker thread died, or a thread running a stream's "
                "queued work was interrupted by an exception (KeyboardInterrupt, a signal "
                "handler's) with an item taken, so queued work may have been lost"))

    def _poll(self, waitable, msg) -> None:
        """One poll interval of :meth:`wait` passed: raise what ends the wait, if anything."""
        if msg is not None and self._owner.locked() and self._reentrant():
            raise self._reentry(msg)
        if msg is None and self._in_kernel():
            raise UnsupportedError(
                "a blocking runtime call (read, sync, ...) from inside a cpu kernel body "
                "waited for work that the body itself holds up (its own stream's, or work "
                "ordered after it): it could never return; call the runtime outside kernel "
                "bodies (as CUDA host functions may not call CUDA)")
        if self.closed or not _threads.is_alive(self._thread) or not self._healthy():
            if waitable.wait(0):
                return
            if not (self.closed or self.closing) and not self._healthy():
                self._worker_died()
            raise self.closed_error()

    # -- the owner ------------------------------------------------------------------------
    def _release(self) -> None:
        """Release the owner lock after running one message directly (``call``/``submit`` on an
        idle server), then drain what was queued meanwhile (the module doc's invariant)."""
        self._tok.append(True)
        if self.room_waiters:
            self.notify_room()
        if self._q and not self.closed and self._owner.acquire(False):
            self._drain()

    def _drain(self) -> None:
        """Run queued messages in FIFO order; the caller holds the owner lock, released here."""
        q = self._q
        while True:
            try:
                if self.lazy and not self.closed:
                    self.run_lazy()         # deferred work first (module doc)
                while q and not self.closed:
                    fn, args, slot = q.popleft()
                    try:
                        value = fn(*args)
                    except (SystemExit, KeyboardInterrupt, _Fatal) as e:
                        self._die(e)
                        if slot is not None:
                            slot.finish(None, self.closed_error())
                        return
                    except BaseException as e:  # noqa: BLE001 - every error goes to its caller
                        if slot is None:
                            self.message_error(e, fn, args)
                        else:
                            slot.finish(None, e)
                        self._check_backend()
                    else:
                        if slot is not None:
                            slot.finish(value, None)
                    if self.room_waiters:
                        self.notify_room()
            except BaseException as e:
                # raised between messages, so by no handler: an asynchronous exception (a
                # signal handler's, KeyboardInterrupt, PyThreadState_SetAsyncExc) right after
                # popleft loses that message (a waiter would wait for ever, a launch would
                # vanish silently): the server stops, every waiter gets ServerClosed
                self._die(e)
                raise
            finally:
                self._tok.append(True)
            if not q or self.closed or not self._owner.acquire(False):
                return

    def wake_for_lazy(self) -> None:
        """Owner only, after an append to ``lazy`` while ``lazy_asleep``: wake the device thread
        (once: the flag is cleared here, so a burst of deferrals costs one ``Event.set``)."""
        self.lazy_asleep = False
        self._wake.set()

    def _loop(self) -> None:
        looks = 0                       # timed looks left before an untimed wait (module doc)
        try:
            while not self.closed:
                if looks:
                    self._wake.wait(LAZY_S)
                    looks -= 1
                    timed = True
                else:
                    self.lazy_asleep = True     # (first, then lazy: see lazy_asleep)
                    if not self.lazy:
                        self._wake.wait()
                    self.lazy_asleep = False
                    looks, timed = LAZY_LOOKS, False
                self._wake.clear()
                if self._q:
                    if self._owner.acquire(False) or self._take_owner():
                        self._drain()
                elif timed and self.lazy and not self.closed and self._owner.acquire(False):
                    looks = LAZY_LOOKS
                    self._drain()               # deferred work no call ran: run it now
        except BaseException as e:  # noqa: BLE001
            self._die(e)
        finally:
            if not self.closed:
                self._die(RuntimeError("device thread exited"))
            if self.death is not None and self.on_death is not None:
                with contextlib.suppress(Exception):
                    self.on_death()

    def _take_owner(self) -> bool:
        """The device thread found messages queued and the owner lock held: wait for it
        (polling, as ``OwnerLock.acquire``; its holder drains the queue itself before it lets
        go, so this is a fallback), True once it holds the lock, False when the queue emptied
        or the server closed meanwhile. If at two checks in a row, ``OWNER_CHECK_S`` apart (the
        first after ``OWNER_CHECK_S``), the lock is held but no thread is running a
        message (:func:`_running_a_message`), the lock was left held by a thread interrupted
        between taking it and running (an asynchronous exception: KeyboardInterrupt or a
        signal handler's exception on the main thread, ``PyThreadState_SetAsyncExc``) and
        nothing could ever run a message again: the server stops (every waiter gets
        ``ServerClosed``) instead of hanging. Off the hot path."""
        lost = 0
        check = time.monotonic() + OWNER_CHECK_S
        delay = 0.0005
        while not self.closed and self._q:
            if self._owner.acquire(False):
                return True
            if time.monotonic() >= check:
                check = time.monotonic() + OWNER_CHECK_S
                if self._owner.locked() and not _running_a_message():
                    lost += 1
                    if lost >= 2:
                        self._die(RuntimeError(
                            "the server's owner lock was left held by a thread that was "
                            "interrupted (KeyboardInterrupt, an exception raised by a signal "
                            "handler or an asynchronous exception) between taking it and "
                            "running a message; no message could run again"))
                        return False
                else:
                    lost = 0
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return False

    def _die(self, exc: BaseException) -> None:
        if self.death is None:
            self.death = exc
            if not isinstance(exc, _Fatal):
                traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        self.closed = True
        self._wake.set()                # the device thread ends (and runs on_death)
        self._fail_pending()
        with self._room_lock:
            self._room.notify_all()

    def _fail_pending(self) -> None:
        self.lazy.clear()               # deferred work of a stopped server: its reads raise
        while self._q:
            try:
                _, _, slot = self._q.popleft()
            except IndexError:
                break
            if slot is not None:
                slot.finish(None, self.closed_error())

    def closed_error(self) -> ServerClosed:
        """The error a call on this stopped queue raises: ``ServerForked`` in a forked child,
        else ``ServerClosed`` saying why it stopped; the first one also carries the errors that
        were still queued at the shutdown (``leftover``: one ``ServerUnhealthy`` that is also a
        ``ServerClosed`` and an instance of each of their classes)."""
        if self.forked_from is not None:
            return ServerForked(
                f"server {self._thread.name} belongs to process {self.forked_from}, and this "
                f"process ({os.getpid()}) is a fork of it (os.fork(), multiprocessing's 'fork' "
                "start method): the device thread and the backend's workers did not come along, "
                "so the parent's clients, handles and graphs cannot be used here; call "
                "runtime.client(...) in this process for a fresh server")
        err = ServerClosed(self._closed_message())
        left, self.leftover = self.leftover, []
        return unhealthy([err] + left) if left else err

    def _closed_message(self) -> str:
        if self.death is not None:
            why = f"closed: the device thread died ({self.death!r})"
        else:
            why = "shut down (runtime.shutdown(), client.shutdown() or interpreter exit)"
        return f"server {self._thread.name} was {why}; create a new client with runtime.client(...)"

    def close(self, finish) -> None:
        """Stop: run what is queued, then ``finish()`` as the last message, then end the thread.

        Fire-and-forget work queued before the close still runs (CubeCL test 51). Idempotent.
        """
        if self.closed:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("close() from the device thread")
        self.closing = True
        try:
            with self._room_lock:            # producers waiting for room get ServerClosed now
                self._room.notify_all()
            done = Reply()

            def last():
                try:
                    finish()
                finally:
                    self.closed = True
            self._q.append((last, (), done))
            if self._owner.acquire(False):
                self._drain()
            else:
                self._wake.set()
            done.wait(10.0)
            self.closed = True
            self._wake.set()
        except BaseException as e:
            # SOAK8: an asynchronous exception cut the close short (before its last message
            # was queued, ran, or woke the device thread): stop anyway, so the device thread
            # and the backend's workers end (on_death), never left running for nobody
            if not self.closed:
                self._die(_Fatal(f"its shutdown was interrupted by {type(e).__name__}"))
            self._wake.set()
            raise
        self._thread.join(timeout=5.0)
        self._fail_pending()
        with self._room_lock:
            self._room.notify_all()

    def is_alive(self) -> bool:
        return not self.closed and _threads.is_alive(self._thread)


#: every queue of this process, so that a forked child can close the ones it inherited
_QUEUES: "weakref.WeakSet[DeviceQueue]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # the device threads and the backends' workers stay in the parent, and any lock one of them
    # held is held forever here: close every inherited queue without touching those locks, so
    # each use raises ServerForked (finalizer posts are dropped) instead of hanging
    parent = os.getppid()
    for q in list(_QUEUES):
        q.forked_from = parent
        q.closed = True
        q._room_lock = threading.Lock()
        q._wake = _threads.Event()
        q._room = threading.Condition(q._room_lock)
    _QUEUES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: code of the functions that take or hold the owner lock (the server adds its own: sync_idle)
#: and of the waits a caller makes without it (see _running_a_message)
OWNER_CODES: set = set()
_WAIT_CODES: set = set()


def _running_a_message() -> bool:
    """Whether a thread other than the caller may hold the owner lock legitimately: one of its
    frames is a function of ``OWNER_CODES`` that is not just waiting (its callee is not a wait
    of ``_WAIT_CODES``: ``call`` and ``close`` wait after they released the lock, ``submit``
    waits for room before it takes it). A thread interrupted while it held the lock has left
    those functions. A frame walk: the device thread asks only after a wait timed out."""
    me = threading.get_ident()
    for tid, f in _threads.current_frames().items():      # (SOAK9: gh-106883)
        if tid == me:
            continue
        child = None
        while f is not None:
            if f.f_code in OWNER_CODES and (child is None or child.f_code not in _WAIT_CODES):
                return True
            child, f = f, f.f_back
    return False


class _Batch(collections.deque):
    """Releases ``(fn, args)`` carried by one message; ``started`` once its runner began (no
    release joins it after that), ``carried`` while it was cut short and waits in ``_carry``."""

    __slots__ = ("started", "carried")

    def __init__(self, items=()):
        super().__init__(items)
        self.started = self.carried = False


class _Counted:
    """A message carrying host data: takes its bytes off the queue's count once it ran."""

    __slots__ = ("queue", "fn", "nbytes")

    def __init__(self, queue: DeviceQueue, fn, nbytes: int):
        self.queue, self.fn, self.nbytes = queue, fn, nbytes

    def __call__(self, *args):
        try:
            return self.fn(*args)
        finally:
            q = self.queue
            with q._room_lock:
                q.bytes -= self.nbytes
                if q.room_waiters:
                    q._room.notify_all()


class _Fatal(BaseException):
    """Raised inside a message to kill the device thread (tests of the death path)."""


#: what a message run directly may raise that ends the server (``_die``), not only the call
DeviceQueue.FATAL = (SystemExit, KeyboardInterrupt, _Fatal)
OWNER_CODES.update(f.__code__ for f in (DeviceQueue.call, DeviceQueue.submit, DeviceQueue.close,
                                        DeviceQueue._drain, DeviceQueue._release))
_WAIT_CODES.update(f.__code__ for f in (DeviceQueue.wait, DeviceQueue.wait_room, Reply.wait))
