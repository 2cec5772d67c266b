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
``resolve`` with a ``done`` test (pruning) runs on the server's owner only. A failure may land
between any two reads of the owner (a worker runs the failing work meanwhile), so whatever
drops a parent or calls a mark clean reads the error last: after that the work ran (``done``,
``ran``: a failure is recorded before its work is known to have run) and after ``parents``
(an inherited failure is cached before the parents are dropped); the failure counter is read
again after ``done``. Read the other way round, a failure landing in between was lost: the
mark looked clean and its reader returned stale values (RACE7: :meth:`settled`).
"""

from __future__ import annotations

import collections
import copy
import os
import threading

from ..errors import LaunchError, ReplayFailed, ServerError, ServerUnhealthy, detach, unhealthy


def _kept(error):
    """The copy of ``error`` a mark keeps: the same class, message and attributes, without a
    traceback or chained exceptions (``errors.detach``). A copy, because the original may be
    raised later (to the caller, or by a replay handler) and raising attaches the raiser's
    frames, which would keep the caller's handles and streams alive as long as the mark."""
    try:
        kept = copy.copy(error)
    except Exception:  # noqa: BLE001 - an exception class that cannot be rebuilt from its args
        kept = error
    return detach(kept)


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
        ran: set (on the backend's worker) once the operation ran without failing: it is
            known done without a fence, so a chain of marks of work that ran is cut at once
            (``Marks.done``) and stays as long as the work not yet run; ``also``: other marks
            of the same operation, finished with it.
    """

    __slots__ = ("op", "_error", "parents", "stream", "pos", "since", "seen", "ran", "also")

    #: failures recorded on any mark so far (only grows): a chain none of whose marks existed
    #: before the latest failure cannot have inherited one (``since``), so it is not walked.
    failures = 0
    _lock = threading.Lock()

    def __init__(self, op, error=None, parents=(), stream=None, pos=0):
        self.op, self._error = op, None
        self.stream, self.pos = stream, pos
        self.ran = False                  # set by a backend once the operation ran cleanly
        self.also = ()                    # marks finished with it (``finished``)
        self.seen = -1                    # ``Marks.epoch`` of the last prune walk through it
        self.since = Mark.failures        # the failure count when its oldest ancestor was made
        if parents:
            self.set_parents(parents)
        else:
            self.parents = ()
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
        self._error = _kept(value) if value is not None else None

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
            self._error = _kept(error)      # kept while the mark lives: no caller's frames
        return error

    def finished(self) -> None:
        """The operation ran without failing (any thread: a backend worker, once it ran): it
        is known done (``Marks.done``), and when no failure was recorded anywhere since its
        oldest ancestor was made (``since``) none of its parents can have failed (they ran
        before it), so it drops them at once: a chain of marks is then only as long as the
        work not yet run, without waiting for a fence."""
        self.ran = True
        if self.parents and Mark.failures == self.since:
            self.parents = ()
        for m in self.also:               # marks of the same operation (a replay's buffers
            m.finished()                  # written only inside conditional nodes)

    def resolve(self, done=None):
        """The error of this mark, its own or inherited from a failed parent (cached: a failure
        never goes away). With ``done`` (``done(mark) -> bool``: its operation is known to have
        run; server thread only) it also drops the parents that are final: failed marks and
        their descendants keep no parents, nor do marks whose parents all ran cleanly.
        Iterative, so a long chain of unfinished work never recurses deeply."""
        if self._error is not None or not self.parents:
            return self._error
        if Mark.failures == self.since:   # nothing failed since its oldest ancestor was made
            if done is not None and done(self) and Mark.failures == self.since:
                self.parents = ()         # it ran, and so did its ancestors: final, clean
            return None                   # (counted again after done: one may have landed)
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
            # done first, failures after (see the module doc): a parent failing meanwhile
            # (before its work is known to have run) is seen below, never dropped as clean
            ran = done is not None and m.stream is not None and done(m)
            if m._error is None:
                for hid, p in m.parents:
                    if p._error is not None:
                        m._error = LaunchError(
                            f"it read handle {hid}, whose last writer, the {p.describe()}, "
                            f"failed ({p._error})")
                        break
            if m._error is not None:
                m.parents = ()
            elif ran:                     # it ran, so did every ancestor: a parent resolved
                m.parents = tuple((h, p) for h, p in m.parents   # clean (no parents, no
                                  if p.parents or p._error is not None)   # error) goes
            elif done is not None:
                m.parents = tuple((h, p) for h, p in m.parents if not p.settled(done))
        return self._error

    def settled(self, done) -> bool:
        """True when this mark is final and clean: no unfinished parents, its operation ran
        (``done``) and nothing failed; server thread only. Reads ``parents``, then ``done``,
        then the error (module doc): a failure landing on a worker while it reads is never
        missed (a mark found failed afterwards stays a parent, and its failure is inherited)."""
        return not self.parents and (self.stream is None or done(self)) and self._error is None

    def final(self, done) -> bool:
        """True when this mark can no longer change: it failed, or it is :meth:`settled`;
        server thread only. (A caller keeping the marks that may still fail keeps those that
        are not ``settled``: a failed one read as final would be dropped with its failure.)"""
        return self._error is not None or self.settled(done)

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


def _after_fork_in_child() -> None:
    # a worker recording a failure at the fork held the failure counter's lock, which no
    # thread of the child would ever release: every failure there (Mark.fail) hung
    Mark._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _nothing() -> None:
    """The default ``Marks.before_take``."""


class Marks:
    """The failure-mark and fence policy of one server (docs/contract.md section 4), in one place.

    Holds what the server knows about failures and completed work: the errors queued on
    streams (``StreamState.errors``) and unattributed ones (``async_errors``), the fences that
    tell which work is known to have run (``StreamState.fences``/``done_pos``), and the marks
    of the handles (``HandleState.mark``). Runs on the server's single owner, like every
    handler; the common path (a launch with clean inputs, a read of a clean buffer) costs a
    few attribute tests.

    Args:
        backend: the server's backend (``synchronize``, ``failures``/``take_failures``).
        streams, handles, graphs: the server's tables (``{id: StreamState}``,
            ``{id: HandleState}``, ``{id: GraphState}``), read to attribute failures.
    Attributes:
        async_errors: errors of queued messages no stream owns, raised by the next blocking
            call on any stream.
        checker: the stream-ordering checker or None (a call that raised still synced).
    """

    __slots__ = ("backend", "streams", "handles", "graphs", "async_errors", "checker",
                 "before_take", "fenced", "epoch")

    def __init__(self, backend, streams: dict, handles: dict, graphs: dict):
        self.backend = backend
        self.streams, self.handles, self.graphs = streams, handles, graphs
        self.async_errors: list = []
        self.checker = None
        #: called first by :meth:`take_errors` (the server's ``_reap_busy``: streams nobody can
        #: name whose work was still running when they ended; their errors are due now)
        self.before_take = _nothing
        #: streams with fences not settled yet (a few: those with recent blocking calls)
        self.fenced: set = set()
        #: counts what became known to have run (``settle``): a prune walk is not repeated
        #: through marks it visited since nothing new was learnt
        self.epoch = 0

    # -- queued errors --------------------------------------------------------------------------
    def on_async_error(self, exc) -> None:
        """A fire-and-forget handler raised past its own error handling: report it at the next
        drain of any stream (typed: a ``ServerError``)."""
        # detached: its frames (the caller's too, on the combining path) would stay alive
        self.async_errors.append(detach(exc) if isinstance(exc, ServerError)
                                 else ServerError(f"internal error in a queued message: {exc!r}"))

    def collect(self) -> None:
        """Move the errors no stream owns that the backend found after enqueue (``Backend.
        take_failures``) to ``async_errors``. (Failures of launches and replays reach their
        marks and streams through ``Mark.fail``: the backends' one failure protocol.)"""
        failures = self.backend.failures
        if failures:
            self.async_errors.extend(self.backend.take_failures())

    def on_reclaim(self, s) -> None:
        """Stream ``s`` was reclaimed (its work is done; ``Backend.release_stream`` handed the
        errors its work left to ``failures``): its queued errors are never dropped, they go to
        the next blocking call on any stream (``async_errors``); its marks need no stream any
        more (its work ran: ``done`` is True for them)."""
        if s.errors:
            self.async_errors.extend(s.errors)
            s.errors = []
        s.done_pos = s.pos
        s.fences.clear()
        self.fenced.discard(s)
        self.epoch += 1

    def take_errors(self, s) -> list:
        """The errors queued on ``s`` and the unattributed ones (the backend's included),
        emptied."""
        self.before_take()
        self.collect()
        if not (s.errors or self.async_errors):
            return []
        errs = s.errors + self.async_errors
        s.errors, self.async_errors = [], []
        return errs

    def drain(self, s) -> None:
        """Raise the errors queued on ``s`` (and unattributed ones) together, emptying the queue."""
        errs = self.take_errors(s)
        if errs:
            raise unhealthy(errs)

    # -- fences ---------------------------------------------------------------------------------
    def fence(self, s, comp) -> None:
        """Remember that ``comp`` finishes once ``s`` ran up to its current position (a read's
        copy, a sync, a warm-up fence): marks of that work are then final (``done``), and so
        are those of the work of other streams ``s`` waited for before it (``s.synced``: the
        server's event waits and the user's ``wait_event``), so a host read on a third stream
        settles the streams it waited for (issue 24 item 2). Only a tick is kept
        (``Completion.tick``), never the completion or its value. Settles the fences of ``s``
        that finished since its last blocking call (``settle``)."""
        fences = s.fences
        if fences:
            self.settle(s)
        if comp.done and not fences:      # finished already (an idle stream): settled here
            self.ran(s)
            return
        tick = [False]
        comp.tick = tick
        if comp.done:                     # finished already, or before the tick was attached
            tick[0] = True
        fences.append((s.pos, tick, dict(s.synced) if s.synced else None))
        self.fenced.add(s)
        if len(fences) > 64:              # nobody waited on them yet: forget the oldest
            fences.popleft()

    def ran(self, s) -> None:
        """``s`` is known to have run up to its current position (a blocking call found it idle):
        its marks so far are final, and so are those of the work of the streams it waited for
        before (``s.synced``), as when a fence there finishes (``settle``)."""
        if s.done_pos < s.pos:
            s.done_pos = s.pos
        if s.synced:
            streams = self.streams
            for sid, p in s.synced.items():
                o = streams.get(sid)
                if o is not None and o.done_pos < p:
                    o.done_pos = p
        self.epoch += 1

    @staticmethod
    def clean(st) -> bool:
        """Whether handle state ``st``'s mark is final and clean (its writer ran, with no
        failure and no unfinished parents, as far as known now: its stream ran past it, or the
        backend said it ran, ``Mark.ran``); such a mark is replaced by
        ``CLEAN``, so the next test is one identity check."""
        m = st.mark
        if m is CLEAN:
            return True
        if not m.parents and m.stream is not None and (
                m.pos <= m.stream.done_pos or m.ran) and m._error is None:   # (in this order:
            st.mark = CLEAN                                                 # Mark.settled)
            return True
        return False

    def settle(self, s) -> None:
        """Drop the finished fences of ``s`` (any finished fence covers everything before it
        on ``s``): advance ``s.done_pos``, and ``done_pos`` of every stream ``s`` had waited
        for before the fence, to the position it waited for."""
        fences = s.fences
        last = None
        for i, f in enumerate(fences):
            if f[1][0]:
                last = i
        if last is None:
            return
        if last == len(fences) - 1:
            self.fenced.discard(s)
        self.epoch += 1
        streams = self.streams
        for _ in range(last + 1):
            pos, _, waited = fences.popleft()
            if s.done_pos < pos:
                s.done_pos = pos
            if waited:
                for sid, p in waited.items():
                    o = streams.get(sid)
                    if o is not None and o.done_pos < p:
                        o.done_pos = p

    def fence_then_raise(self, s, errs: list):
        """A blocking call on ``s`` that will raise: a completion of everything enqueued on
        ``s`` before it (its errors found at execution come with it) and the queued errors
        ``errs``, plus any the fence's own submit found. The caller waits on the completion,
        then raises them all together, once: errors of the work before a blocking call are
        raised by that call, never left for a later one (docs/contract.md section 1), and a
        call that raised has still waited for its stream, like one that returned (so the host may count
        it as a sync: ``checker.on_sync``)."""
        comp = self.backend.synchronize(s.raw)
        self.fence(s, comp)
        errs = errs + self.take_errors(s)
        if self.checker is not None:
            self.checker.on_sync(s)
        return comp, errs

    def done(self, mark) -> bool:
        """Whether the operation of ``mark`` is known to have run (a fence after it finished;
        a stream runs in order, so any finished fence covers everything before it)."""
        s = mark.stream
        if mark.pos <= s.done_pos or mark.ran:
            return True
        if self.fenced:                   # a fence of any stream may cover it (``fence``)
            for f in list(self.fenced):
                self.settle(f)
        return mark.pos <= s.done_pos

    # -- marks ----------------------------------------------------------------------------------
    def inherit(self, mark, reads) -> None:
        """Give ``mark`` (a launch or replay) the marks of what it reads, ``reads`` =
        ``[(handle id, Mark)]``: a failed one fails it now; those that may still fail become
        its ``parents`` (it inherits their failure when it is found, e.g. at execution after it
        was enqueued); final clean ones are dropped."""
        parents = []
        done = self.done
        for hid, m in reads:
            if m is CLEAN:
                continue
            if m._error is None and m.parents:
                if done(m):
                    m.resolve(done)       # ran: settle its chain once (amortised)
                else:
                    self._prune(m)
            if m._error is not None:
                mark.error = LaunchError(f"it read handle {hid}, whose last writer, the "
                                         f"{m.describe()}, failed ({m._error})")
                mark.parents = ()
                return
            if not m.settled(done):       # (one failing since the test above stays: RACE7)
                parents.append((hid, m))
        if parents:
            mark.set_parents(parents)

    def _prune(self, mark, budget: int = 16) -> None:
        """Cut the chain below ``mark`` (not known to have run) at the first ancestors known to
        have run (``done``): a mark that ran has no unfinished ancestors, so its parents go
        (``resolve``). Walks at most ``budget`` marks that have not run: the chains stay as long
        as the work not yet known complete (issue 24 item 2), at a cost bounded per launch."""
        done, epoch = self.done, self.epoch
        stack = [mark]
        while stack and budget:
            m = stack.pop()
            if m.seen == epoch:
                continue                  # walked already since anything new was learnt
            m.seen = epoch
            budget -= 1
            for _, p in m.parents:
                if p._error is None and p.parents:
                    if done(p):
                        p.resolve(done)
                    else:
                        stack.append(p)

    def error_of(self, mark):
        """The error of ``mark`` (own or inherited), pruning what is final; None when clean."""
        if mark is CLEAN:
            return None
        return mark.resolve(self.done)

    @staticmethod
    def fail(states, op: tuple, err) -> None:
        """Mark ``states`` as written by the failed operation ``op`` (``Mark.op``)."""
        if states:
            m = Mark(op, err)
            for st in states:
                st.mark = m
