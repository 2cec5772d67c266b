"""The device queue: one FIFO of messages, run by one owner at a time.

Design.md section 1: every server-side table is touched by one thread at a time and the queue
is the order. The owner is either the device thread or a caller that found the server idle and
runs the queued messages (its own last) under the server's lock: the combining fast path. A
blocking call then costs no thread hand-off (about 60 µs on this machine through a plain queue
and a thread wake-up; a few µs combined).

Invariant that keeps a message from being stranded: whoever holds the owner lock drains until
the queue is empty, releases, and looks again; a message appended while the lock was held is
therefore either drained by the holder or seen by it after its release.
"""

from __future__ import annotations

import collections
import sys
import threading
import traceback

from ..errors import ServerClosed

#: seconds between health checks while a caller waits for an answer.
POLL_S = 0.05


class Slot:
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
            self._event = threading.Event()
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
    """

    def __init__(self, name: str, on_async_error, healthy=None):
        self._healthy = healthy or (lambda: True)
        self._q = collections.deque()
        self._owner = threading.Lock()
        self._wake = threading.Event()
        self._on_async_error = on_async_error
        self.closed = False
        self.death: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- producers ------------------------------------------------------------------------
    def submit(self, fn, *args) -> None:
        """Fire-and-forget: queue ``fn(*args)``; run it now if the server is idle.

        Raises: ``ServerClosed`` once the server stopped.
        """
        if self.closed:
            raise ServerClosed(self._closed_message())
        self._q.append((fn, args, None))
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

    def call(self, fn, *args):
        """Blocking: queue ``fn(*args)`` and return its value (or raise its error).

        Raises: ``ServerClosed`` if the server stops or dies before answering (never a hang).
        """
        if self.closed:
            raise ServerClosed(self._closed_message())
        slot = Slot()
        self._q.append((fn, args, slot))
        if self._owner.acquire(False):
            self._drain()
        else:
            self._wake.set()
        if not slot.done:
            self.wait(slot)
        if slot.error is not None:
            raise slot.error
        return slot.value

    def wait(self, waitable) -> None:
        """Wait for ``waitable.wait(timeout)`` to turn True, checking health every 50 ms.

        Raises: ``ServerClosed`` when the server stopped or its thread died meanwhile.
        """
        while not waitable.wait(POLL_S):
            if self.closed or not self._thread.is_alive() or not self._healthy():
                if waitable.wait(0):
                    return
                if not self.closed and not self._healthy():
                    self.death = self.death or RuntimeError("a backend worker thread died")
                raise ServerClosed(self._closed_message())

    # -- the owner ------------------------------------------------------------------------
    def _drain(self) -> None:
        """Run queued messages in FIFO order; the caller holds the owner lock, released here."""
        q = self._q
        while True:
            try:
                while q and not self.closed:
                    fn, args, slot = q.popleft()
                    try:
                        value = fn(*args)
                    except (SystemExit, KeyboardInterrupt, _Fatal) as e:
                        self._die(e)
                        if slot is not None:
                            slot.finish(None, ServerClosed(self._closed_message()))
                        return
                    except BaseException as e:  # noqa: BLE001 - every error goes to its caller
                        if slot is None:
                            self._on_async_error(e)
                        else:
                            slot.finish(None, e)
                    else:
                        if slot is not None:
                            slot.finish(value, None)
            finally:
                self._owner.release()
            if not q or self.closed or not self._owner.acquire(False):
                return

    def _loop(self) -> None:
        try:
            while not self.closed:
                self._wake.wait()
                self._wake.clear()
                if self._q:
                    self._owner.acquire()
                    self._drain()
        except BaseException as e:  # noqa: BLE001
            self._die(e)
        finally:
            if not self.closed:
                self._die(RuntimeError("device thread exited"))

    def _die(self, exc: BaseException) -> None:
        if self.death is None:
            self.death = exc
            if not isinstance(exc, _Fatal):
                traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        self.closed = True
        self._fail_pending()

    def _fail_pending(self) -> None:
        while self._q:
            try:
                _, _, slot = self._q.popleft()
            except IndexError:
                break
            if slot is not None:
                slot.finish(None, ServerClosed(self._closed_message()))

    def _closed_message(self) -> str:
        why = f" (the device thread died: {self.death!r})" if self.death is not None else ""
        return (f"server {self._thread.name} is closed{why}; create a new client with "
                "runtime.client(...)")

    def close(self, finish) -> None:
        """Stop: run what is queued, then ``finish()`` as the last message, then end the thread.

        Fire-and-forget work queued before the close still runs (CubeCL test 51). Idempotent.
        """
        if self.closed:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("close() from the device thread")
        done = Slot()

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
        self._thread.join(timeout=5.0)
        self._fail_pending()

    def is_alive(self) -> bool:
        return not self.closed and self._thread.is_alive()


class _Fatal(BaseException):
    """Raised inside a message to kill the device thread (tests of the death path)."""
