"""Write marks: "this buffer's last writer failed", found at enqueue or at execution.

Design.md section 4: a failure marks what the failed work would have written, and a read of a
marked buffer raises until a later write to it lands. Each operation that writes buffers gets
one :class:`Mark` (shared by everything it writes); the server makes it the buffers' current
mark when it enqueues the operation. A later write (host ``write``, launch, replay) installs a
new mark, which is what "until a later write lands" means. The backend calls
:meth:`Mark.fail` when the operation fails after it was enqueued (at execution on a worker
thread, at submit); a read holds the mark of the write it observes and checks it once its copy
completed, so a failure found while the read waited is still raised.

Propagation: an operation that reads a buffer through a ``read`` binding (a replay: through
one of its read-only inputs) computes from stale data when that buffer's writer failed, so its
own writes are marked too. The writer may fail after the reader was enqueued (at execution, at
a later submit): the reader's mark keeps the marks of its inputs as ``parents`` and inherits
their failure whenever it is found (``error`` looks through them). Parents are dropped once
they are final (:meth:`Mark.resolve`, on the server: the parent failed, or its operation is
known to have run, with no failed input), so the chains stay as short as the work not yet
known to have run.

Threads: ``fail`` may run on any thread (a backend worker); it only sets one attribute, which
readers check after their completion finished (ordered after the failing work by the stream).
``error`` may be read on any thread (it only caches a failure it finds, which never goes away);
``resolve`` with a ``done`` test (pruning) runs on the server's owner only.
"""

from __future__ import annotations

import threading

from ..errors import LaunchError, ReplayFailed, ServerUnhealthy, unhealthy


class Mark:
    """The outcome of one writing operation.

    Attributes:
        op: what wrote (``"replay of graph 3"``, ``"launch of add_scalar on stream 2"``); a
            tuple formatted only when an error is reported.
        error: ``None`` while the write is fine, else the ``ServerError`` it failed with, or
            the ``LaunchError`` it inherits from a failed parent ("it read handle N, whose last
            writer ... failed"). Setting it records the operation's own failure.
        parents: ``((handle id, Mark), ...)``: the marks of the buffers it read through
            ``read`` bindings that were not final when it was enqueued.
        stream, pos: the server's ``StreamState`` and position of the operation (``stream``
            None: nothing can fail later, e.g. a host write).
    """

    __slots__ = ("op", "_error", "parents", "stream", "pos", "since")

    #: failures recorded on any mark so far (only grows): a chain none of whose marks existed
    #: before the latest failure cannot have inherited one (``since``), so it is not walked.
    failures = 0
    _lock = threading.Lock()

    def __init__(self, op, error=None, parents=(), stream=None, pos=0):
        self.op, self._error = op, None
        self.stream, self.pos = stream, pos
        self.since = Mark.failures        # the failure count when its oldest ancestor was made
        self.set_parents(parents)
        if error is not None:
            self.error = error

    def set_parents(self, parents) -> None:
        """Make ``((handle id, Mark), ...)`` its parents (see the module doc)."""
        self.parents = tuple(parents)
        for _, p in self.parents:
            if p.since < self.since:
                self.since = p.since

    @property
    def error(self):
        if self._error is None and self.parents and Mark.failures != self.since:
            return self.resolve()
        return self._error

    @error.setter
    def error(self, value):
        Mark._count_failure()
        self._error = value

    @staticmethod
    def _count_failure() -> None:
        with Mark._lock:
            Mark.failures += 1

    def fail(self, error: BaseException):
        """Record that the operation failed (keeps the first error); any thread. Returns the
        error to report on the stream: for a replay, ``error`` retyped with the graph named."""
        if self.op[0] == "replay":
            error = type(error)(f"{error} (in a replay of graph {self.op[1]})")
        Mark._count_failure()
        if self._error is None:
            self._error = error
        return error

    def resolve(self, done=None):
        """The error of this mark, its own or inherited from a failed parent (cached: a failure
        never goes away). With ``done`` (``done(mark) -> bool``: its operation is known to have
        run; server thread only) it also drops the parents that are final: failed marks and
        their descendants keep no parents, nor do marks whose parents all ran cleanly.
        Iterative, so a long chain of unfinished work never recurses deeply."""
        if self._error is not None or not self.parents:
            return self._error
        if Mark.failures == self.since:   # nothing failed since its oldest ancestor was made
            if done is not None and done(self):
                self.parents = ()         # it ran, and so did its ancestors: final, clean
            return None
        post, seen, posted, stack = [], set(), set(), [self]
        while stack:                      # post-order over the unresolved ancestors
            m = stack[-1]
            if id(m) not in seen:
                seen.add(id(m))
                stack.extend(p for _, p in m.parents
                             if p._error is None and p.parents and id(p) not in seen)
            else:
                stack.pop()
                if id(m) not in posted:
                    posted.add(id(m))
                    post.append(m)
        for m in post:                    # parents before children
            if m._error is None:
                for hid, p in m.parents:
                    if p._error is not None:
                        m._error = LaunchError(
                            f"it read handle {hid}, whose last writer, the {p.describe()}, "
                            f"failed ({p._error})")
                        break
            if m._error is not None:
                m.parents = ()
            elif done is not None:
                m.parents = tuple((h, p) for h, p in m.parents if not p.final(done))
        return self._error

    def final(self, done) -> bool:
        """True when this mark can no longer change: it failed, or it has no unfinished
        parents and its operation ran (``done``); server thread only."""
        return self._error is not None or (not self.parents and (self.stream is None
                                                                 or done(self)))

    def describe(self) -> str:
        """The operation in words."""
        op = self.op
        if op[0] == "replay":
            return f"replay of graph {op[1]}"
        if op[0] == "launch":
            return f"launch of {op[1]} on stream {int(op[2])}"
        if op[0] == "write":
            return f"host write to handle {op[1]} on stream {int(op[2])}"
        return str(op[1])

    def stale(self, hid: int, queued=None) -> ReplayFailed:
        """The error a read of handle ``hid`` raises: ``ReplayFailed`` (``.cause`` = the failure),
        combined with the stream's ``queued`` errors (a list, a ``ServerUnhealthy`` or one error)
        into one ``ServerUnhealthy`` that is also an instance of each of their classes."""
        cause = self.error
        err = ReplayFailed(f"read of handle {hid}: its last writer, the {self.describe()}, failed "
                           f"({type(cause).__name__}: {cause}); the buffer holds stale data until "
                           "a later write to it lands (a replay of that graph, another launch or "
                           "replay writing it, or a host write)", cause)
        if queued is None:
            return err
        if isinstance(queued, ServerUnhealthy):
            others = queued.errors
        else:
            others = list(queued) if isinstance(queued, list) else [queued]
        return unhealthy([err] + others) if others else err


#: the mark of a buffer whose last writer cannot fail later (a host write, a fresh buffer).
CLEAN = Mark(("host", "host write"))
