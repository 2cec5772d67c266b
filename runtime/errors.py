"""The runtime's error classes (docs/contract.md section 5).

Every error the server raises is a :class:`ServerError`. Wrong Python types raise the
standard ``TypeError``/``ValueError`` at the call, before anything is queued. Each message
says what was wrong, with which id, and what to do.
"""

from __future__ import annotations

import threading


class ServerError(Exception):
    """Base of every error a runtime server raises (docs/contract.md section 5)."""


class GraphStateError(ServerError):
    """A capture-state transition out of order (stop without start, start twice, prepare twice).

    The state is left unchanged (CubeCL ``stream/capture.rs``: a rejected transition changes nothing).
    """


class CaptureRefused(ServerError):
    """An operation the capture window forbids: read/sync/replay/record_event/wait_event on the
    capturing stream (raised at once), or a write / free of a used handle / refused launch
    inside the window (raised by ``stop_capture``). Any refusal invalidates the window (CUDA's
    ``cudaErrorStreamCaptureInvalidated``): ``stop_capture`` raises this naming the first
    refused operation, and makes no graph."""


class UnknownGraph(ServerError):
    """Replay of a graph id the server does not know: never made, destroyed, or a released clone."""


class ReplayFailed(ServerError):
    """Read of a buffer whose last writer failed (found at enqueue, at submit or while it
    executed): a replay of a graph (its write set), a launch, a host write; ``.cause`` is the
    original error. Raised on every read until a later write to the buffer lands (a successful
    replay or launch writing it, or a host ``write``); see ``runtime.server.marks``."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


class LaunchError(ServerError):
    """A kernel launch that cannot run: compile failure, bad bindings, bad params."""


#: the end of every ``LoopLimitExceeded`` message: what to do.
RAISE_THE_LIMIT = ("capture the loop with a larger capture_while(..., max_iterations=N) or make "
                   "its body clear the condition sooner")


class LoopLimitExceeded(LaunchError):
    """A ``capture_while`` loop whose condition was still true after ``max_iterations`` runs of
    its body (eagerly, or in a replay): the loop stopped there, and a replay's write set
    is marked with this error (``ReplayFailed`` on read), never silently truncated."""

    @classmethod
    def in_replay(cls, node: int, limit: int, where: str = "") -> "LoopLimitExceeded":
        """The error of loop node ``node`` found still true after ``limit`` iterations in a
        graph replay (``where``: e.g. ``" on wgpu; the unrolled loop"``)."""
        return cls(f"capture_while node {node}: its condition was still non-zero after "
                   f"max_iterations={limit} iterations in a graph replay{where or '; the loop'} "
                   f"stopped there: {RAISE_THE_LIMIT}")


class InvalidHandle(ServerError):
    """A handle that is unknown, freed, from another server, or of the wrong size."""


class OutOfMemory(ServerError):
    """The backend could not allocate the requested bytes."""


class ServerClosed(ServerError):
    """The server stopped (``runtime.shutdown()``, interpreter exit) or its thread died; every
    waiting caller gets this instead of hanging."""


class ServerForked(ServerClosed):
    """This process is a fork of the one that started the server (``os.fork()``,
    ``multiprocessing``'s ``fork`` start method, gunicorn ``--preload``): the device thread and
    the backend's workers stayed in the parent, so the parent's clients, handles and graphs
    cannot be used here. ``runtime.client(...)`` in the child starts a fresh server (as CUDA
    refuses a context inherited across fork: ``cudaErrorInitializationError``)."""


class LivenessError(ServerError):
    """(check mode) A replay would touch a buffer whose handle was freed (seed 001: liveness)."""


class StreamRaceError(ServerError):
    """(check mode) Two accesses to one buffer from different streams not ordered by
    happens-before, at least one a write (seed 001: no concurrent use, same-stream refreshes)."""


class UnsupportedError(ServerError):
    """The backend is not available here, or does not support the operation."""


class ServerUnhealthy(ServerError):
    """Errors of fire-and-forget work queued on a stream, drained together by the next blocking
    call on it (read, sync, flush). ``.errors`` lists them in order.

    The raised object is also an instance of each drained error's class, so
    ``pytest.raises(InvalidHandle)`` catches an unhealthy drain made of an ``InvalidHandle``.
    """

    errors: list

    def __init__(self, errors):
        self.errors = list(errors)
        lines = "; ".join(f"{type(e).__name__}: {e}" for e in self.errors)
        super().__init__(f"{len(self.errors)} queued error(s) on this stream: {lines}")

    def __reduce__(self):
        # errors cross process pools and Ray: rebuilt from the drained errors, so the copy has
        # the same classes (the combined class is made again by ``unhealthy``) and message
        state = {k: v for k, v in self.__dict__.items() if k != "errors"} or None
        if type(self) is ServerUnhealthy:
            return (ServerUnhealthy, (self.errors,), state)
        return (unhealthy, (self.errors,), state)


_UNHEALTHY_CLASSES: dict[tuple, type] = {}


def _kinds(e) -> tuple:
    """The ``ServerError`` classes a drain of ``e`` must be an instance of: its own, those of a
    ``ServerUnhealthy``'s errors, those a ``FoldedErrors`` folded in."""
    if isinstance(e, ServerUnhealthy):
        out = ()
        for x in e.errors:
            out += _kinds(x)
        return out
    k = type(e)
    return (k,) + getattr(e, "kinds", ()) if issubclass(k, ServerError) else ()


def unhealthy(errors) -> ServerUnhealthy:
    """Build a ``ServerUnhealthy`` that is also an instance of each drained error's class
    (errors folded into a ``FoldedErrors`` included)."""
    errors = list(errors)
    kinds = []
    for e in errors:
        for k in (type(e),) + getattr(e, "kinds", ()):
            if k not in kinds and k is not ServerUnhealthy and issubclass(k, ServerError):
                kinds.append(k)
    # a class another one derives from goes (ServerError itself, LaunchError beside
    # LoopLimitExceeded): as a base listed before its subclass it made the MRO fail, and the
    # drain fell back to a plain ServerUnhealthy that was an instance of none of them
    kinds = [k for k in kinds if not any(o is not k and issubclass(o, k) for o in kinds)]
    key = tuple(kinds)
    cls = _UNHEALTHY_CLASSES.get(key)
    if cls is None:
        try:
            cls = type("ServerUnhealthy", (ServerUnhealthy, *kinds), {}) if kinds else ServerUnhealthy
        except TypeError:  # incompatible layouts: fall back to the plain aggregate
            cls = ServerUnhealthy
        _UNHEALTHY_CLASSES[key] = cls
    err = cls.__new__(cls)
    ServerUnhealthy.__init__(err, errors)
    if isinstance(err, ReplayFailed):
        err.cause = next((getattr(e, "cause", None) for e in errors if isinstance(e, ReplayFailed)), None)
    return err


#: errors a list of queued errors keeps (a stream's, the unattributed ones) before the rest
#: are folded into one :class:`FoldedErrors` (see :func:`fold_errors`).
MAX_QUEUED_ERRORS = 64


class FoldedErrors(ServerError):
    """Errors queued past ``MAX_QUEUED_ERRORS`` (on a stream that never blocks, or waiting for
    any blocking call), folded into one: ``count`` of them and the ``last`` one, so the queue
    stays bounded and none is dropped silently. Raised with the others by the next blocking
    call. Made by :func:`fold_errors` (``FoldedErrors.of(first)``)."""

    count = 0
    last = None
    #: the ``ServerError`` classes of the errors folded in, first seen first: the drain that
    #: raises them is an instance of each (``unhealthy``), as if none had been folded
    kinds = ()

    @classmethod
    def of(cls, first) -> "FoldedErrors":
        """A fold holding ``first``."""
        folded = cls()
        folded.add(first)
        return folded

    def add(self, err) -> None:
        """Count ``err`` in (a ``FoldedErrors`` adds its count and classes)."""
        if isinstance(err, FoldedErrors):
            self.count += err.count
            kinds = err.kinds
            err = err.last
        else:
            self.count += 1
            kinds = _kinds(err)
        for k in kinds:
            if k not in self.kinds:
                self.kinds += (k,)
        self.last = err
        self.args = (f"{self.count} more queued errors (the latest: {type(err).__name__}: "
                     f"{err})",)

    def __reduce__(self):
        # the same message, count and classes (so a drain rebuilt from it is still an instance
        # of each); the last error itself stays behind (it may not pickle)
        return (_refold, (self.args, self.count, self.kinds))


def _refold(args, count, kinds) -> FoldedErrors:
    """A ``FoldedErrors`` rebuilt by pickle (``FoldedErrors.__reduce__``)."""
    folded = FoldedErrors(*args)
    folded.count, folded.kinds = count, tuple(kinds)
    return folded


def fold_errors(errors: list, limit: int = MAX_QUEUED_ERRORS) -> None:
    """Keep the list of queued ``errors`` at most ``limit`` long, in place: the errors past
    ``limit - 1`` are folded into one :class:`FoldedErrors` (the first ones stay as they are).
    Call it after appending; cheap below the limit."""
    if len(errors) > limit:
        tail = errors[limit - 1]
        folded = tail if isinstance(tail, FoldedErrors) else FoldedErrors.of(tail)
        for e in errors[limit:]:
            folded.add(e)
        del errors[limit - 1:]
        errors.append(folded)


class ErrorQueue(list):
    """Errors found after their work was enqueued, waiting for the blocking call that reports
    them: a backend stream's (raised by its next completion) or a backend's unattributed
    ``failures`` (raised by the next blocking call on any stream). Appended on any thread (a
    worker, a queue thread, the server's owner), taken on another; bounded like the server's
    own queues (:func:`fold_errors`: past ``limit`` the newest are folded into one
    ``FoldedErrors``, counted, never dropped), so a stream that never blocks cannot grow it.
    The one bounding rule every backend uses (docs/contract.md section 1: every list is bounded by
    live work).

    A ``list`` whose adding and taking methods hold a lock: its emptiness test, which every
    launch, replay, read and sync asks of a stream, stays the list's own (no Python call).
    Mutate it only through ``append``, ``extend``, ``take`` and ``popleft``."""

    __slots__ = ("_lock", "limit")

    def __init__(self, limit: int = MAX_QUEUED_ERRORS):
        super().__init__()
        self._lock = threading.Lock()
        self.limit = limit

    def _fold(self) -> None:
        """(lock held) ``fold_errors`` in place, through the list's own methods."""
        limit = self.limit
        tail = self[limit - 1]
        folded = tail if isinstance(tail, FoldedErrors) else FoldedErrors.of(tail)
        for e in self[limit:]:
            folded.add(e)
        del self[limit - 1:]
        list.append(self, folded)

    def append(self, error) -> None:
        """Queue ``error`` (folded past ``limit``); any thread."""
        with self._lock:
            list.append(self, error)
            if len(self) > self.limit:
                self._fold()

    def extend(self, errors) -> None:
        """Queue each of ``errors``, in order; any thread."""
        with self._lock:
            list.extend(self, errors)
            if len(self) > self.limit:
                self._fold()

    def take(self) -> list:
        """Every queued error, in order, emptied (a plain list); ``[]`` when none."""
        if not self:
            return []
        with self._lock:
            items = list(self)
            del self[:]
        return items

    def popleft(self):
        """The oldest queued error, removed. Raises ``IndexError`` when none."""
        with self._lock:
            return self.pop(0)

    def __repr__(self) -> str:
        return f"ErrorQueue({list.__repr__(self)})"


def detach(error):
    """Drop the tracebacks of ``error`` and the exceptions it chains (``__cause__``,
    ``__context__``), and return it. For errors the runtime keeps (a failure mark, a stream's
    queued errors): a traceback holds its frames, and through them every frame below (a client
    call that ran the kernel on its own thread), so a kept error would keep that caller's
    handles and streams alive for as long as the mark lives. The message (kernel, cause type and
    text) is kept."""
    seen = set()
    e = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return error


def error_list(error) -> list:
    """The errors in ``error``: ``[]`` for None, ``.errors`` of a ``ServerUnhealthy``, else
    ``[error]`` (so drained errors can be combined into one ``unhealthy``)."""
    if error is None:
        return []
    if isinstance(error, ServerUnhealthy):
        return list(error.errors)
    return [error]


__all__ = [
    "ServerError", "GraphStateError", "CaptureRefused", "UnknownGraph", "ReplayFailed",
    "LaunchError", "InvalidHandle", "OutOfMemory", "ServerUnhealthy", "ServerClosed",
    "LivenessError", "StreamRaceError", "UnsupportedError", "unhealthy", "LoopLimitExceeded",
]
