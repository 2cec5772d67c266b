"""Write marks: "this buffer's last writer failed", found at enqueue or at execution.

Design.md section 4: a failure marks what the failed work would have written, and a read of a
marked buffer raises until a later write to it lands. Each operation that writes buffers gets
one :class:`Mark` (shared by everything it writes); the server makes it the buffers' current
mark when it enqueues the operation. A later write (host ``write``, launch, replay) installs a
new mark, which is what "until a later write lands" means. The backend calls
:meth:`Mark.fail` when the operation fails after it was enqueued (at execution on a worker
thread, at submit); a read holds the mark of the write it observes and checks it once its copy
completed, so a failure found while the read waited is still raised.

Threads: ``fail`` may run on any thread (a backend worker); it only sets one attribute, which
readers check after their completion finished (ordered after the failing work by the stream).
"""

from __future__ import annotations

from ..errors import ReplayFailed, ServerUnhealthy, unhealthy


class Mark:
    """The outcome of one writing operation.

    Attributes:
        op: what wrote (``"replay of graph 3"``, ``"launch of add_scalar on stream 2"``); a
            tuple formatted only when an error is reported.
        error: ``None`` while the write is fine, else the ``ServerError`` it failed with.
    """

    __slots__ = ("op", "error")

    def __init__(self, op, error=None):
        self.op, self.error = op, error

    def fail(self, error: BaseException):
        """Record that the operation failed (keeps the first error); any thread. Returns the
        error to report on the stream: for a replay, ``error`` retyped with the graph named."""
        if self.op[0] == "replay":
            error = type(error)(f"{error} (in a replay of graph {self.op[1]})")
        if self.error is None:
            self.error = error
        return error

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
