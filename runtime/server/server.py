"""The per-device compute server: the handle, stream and graph tables, and every policy.

Each ``h_*`` method is one message handler; it runs on the single owner of the server (the
device thread, or a caller on the combining fast path, see ``queue.py``) and is the only code
that touches the tables or the backend. Policy lives here once for every backend (style.md
section 2): cross-stream ordering of ordinary operations, the capture window's refusals,
retention of window allocations, queued errors, the replay-failure mark on a graph's write set.
Two collaborators hold their part of it: ``Capture`` (capture.py: the window's lifecycle and
hooks) and ``Marks`` (marks.py: queued errors, fences, failure marks and their propagation).

Positions: each stream counts the operations it executed (``StreamState.pos``). A handle keeps
``writes`` and ``reads`` as ``{stream id: position}``; a use on stream B waits on an event of
stream A recorded at or after A's position when A != B (CUDA ``cudaStreamWaitEvent``). Replays
update none of this: by contract (seed 001) a replay orders only against its capture stream.
"""

from __future__ import annotations

import collections
import itertools

from ..backends.base import Completion
from ..streams import watch_thread_ends
from ..errors import (MAX_QUEUED_ERRORS, GraphStateError, InvalidHandle, LaunchError,
                      LivenessError, OutOfMemory, ServerError, UnknownGraph, UnsupportedError,
                      detach, fold_errors)
from . import capture as cap
from . import graphs
from .capture import merge
from .marks import CLEAN, Mark, Marks
from .memory import GraphPool, Pool
from . import queue as queue_mod
from .queue import LAZY_MAX, DeviceQueue

_graph_ids = itertools.count(1)


def _partly(kernel, params, states, st, count=None) -> bool:
    """Whether a launch of ``kernel`` writes handle state ``st`` (bound ``write``) only in part
    (``Kernel.partial_write``: its declared count, or what its workgroup ``count`` covers, is
    less than the buffer): it then keeps ``st``'s failure mark, as a ``read_write`` binding
    does (the part it does not cover still holds what a failed writer left)."""
    for bi, _, _ in kernel.write_checks:
        if states[bi] is st and kernel.partial_write(bi, params, st.nbytes, count):
            return True
    return False


class StreamState:
    """Server-side state of one logical stream."""

    __slots__ = ("id", "raw", "pos", "synced", "event", "event_pos", "errors", "state",
                 "pool", "warm", "warm_bytes", "warm_peak", "warm_pool_free",
                 "window", "primed", "fences", "done_pos", "graphs")

    def __init__(self, sid, raw):
        self.id, self.raw = sid, raw  # id: a plain int, never the client's StreamId
        self.pos = 0                  # operations executed (enqueued to the backend) so far
        self.fences = collections.deque()   # (position, tick) of reads, syncs, fences
        self.done_pos = 0             # every operation up to here is known to have run
        self.synced: dict = {}        # other stream id -> position this stream already waited for
        self.event, self.event_pos = None, -1
        self.errors: list = []        # queued errors of fire-and-forget work
        self.state = cap.NO_CAPTURE
        self.window: cap.Window | None = None
        self.primed: list = []        # slots freed during warm-up, held until start_capture
        self.pool = None              # the GraphPool (memory.py) of the capture being prepared
        self.warm: set = set()        # handles allocated on it since graph_prepare, still live
        self.warm_bytes = self.warm_peak = 0   # their bytes, and the most at once (estimate)
        self.warm_pool_free = 0       # what its graph pool could serve at graph_prepare
        self.graphs = 0               # live graphs that replay on it (not reclaimed meanwhile)


#: ``ComputeServer.replay``'s answer when the server was not idle (the caller queues the call).
BUSY = object()


class HandleState:
    """Server-side state of one handle: its pooled slot and its access history."""

    __slots__ = ("id", "slot", "nbytes", "writes", "reads", "mark", "graphs", "replayed",
                 "stream", "arg")

    def __init__(self, hid, slot, nbytes, stream):
        self.id, self.slot, self.nbytes, self.stream = hid, slot, nbytes, stream
        self.arg = (slot.buf, nbytes)    # what a launch binds (Backend.launch's args item)
        self.writes = dict(slot.fences)  # a reused buffer inherits its earlier uses as writes
        self.reads: dict = {}
        self.mark = CLEAN                # the Mark of its last writer (marks.py)
        self.graphs: dict = {}           # {GraphState: None} of the graphs that use it
        self.replayed: dict = {}         # {stream: position} of replays of destroyed graphs


class ComputeServer:
    """One device: a backend, its tables and its queue.

    Clients call ``submit`` (fire-and-forget) or ``call`` (blocking) with a handler; see
    ``runtime.client`` for the public API built on top.

    Args:
        backend: a constructed ``runtime.backends.base.Backend``.
        name: the device thread's name, e.g. ``"runtime-cpu:0"``.
        check: turn on the stream-ordering checker (``RUNTIME_CHECK=1``).
        max_idle_bytes: bound on the pool's idle bytes (default ``memory.MAX_IDLE``); past it
            the oldest idle buffers go back to the device.

    Streams: a stream nobody can name any more (its last ``StreamId`` was dropped: a
    per-request stream, a ``StaticGraph``'s, the default stream of a thread that ended) is
    reclaimed, server and backend, once its queued work ran and no graph that replays on it
    lives; a capture left open on it is aborted (its pool reservations go back) and errors
    queued on it are raised by the next blocking call on any stream. Every table keyed by
    stream id is pruned of reclaimed ids (``_sweep``), so all of them are bounded by live
    streams.
    """

    def __init__(self, backend, name: str, check: bool = False, max_idle_bytes: int | None = None):
        self.backend = backend
        self.name = name
        self.pool = Pool(backend, max_idle_bytes)
        self.streams: dict = {}        # {int stream id: StreamState}
        self.ended: set = set()        # ids nobody can name any more, not yet reclaimed
        #: of those, the ones whose work had not run yet (not a live graph): a blocking call
        #: reclaims them first, so the errors their work left are raised (``_reap_busy``)
        self.ended_busy: set = set()
        self._reaped = 0               # streams reclaimed since the last _sweep
        self.handles: dict = {}
        self.graphs: dict = {}
        self.graph_pools: dict = {}     # pool id -> memory.GraphPool
        self.graph_pool_of: dict = {}   # graph id -> its GraphPool (graphs captured into one)
        self.released_pools: set = set()
        self.marks = marks = Marks(backend, self.streams, self.handles, self.graphs)
        self.capture = cap.Capture(backend, marks, self._release_slot, self._event_at)
        self.programs: dict = {}
        self.checker = None
        if check:
            from .checker import Checker
            self.checker = marks.checker = Checker(self)
        self.queue = q = DeviceQueue(name, self._on_async_error, backend.is_alive, backend.load,
                                     reentrant=getattr(backend, "reentrant", None),
                                     in_kernel=getattr(backend, "in_kernel", None))
        try:
            q.run_lazy = self._run_lazy
            q.on_death = backend.close          # SOAK6: a dead server's workers end too
            self.marks.before_take = self._reap_busy
            q.message_error = self._on_async_error
            backend.on_room = q.notify_room
            backend.on_broken = q._check_backend     # (cpu: an interrupted helper)
            watch_thread_ends(self)
        except BaseException:           # SOAK7: an asynchronous exception landing here left
            q.closed = True             # the device thread waiting for ever for a server
            q._wake.set()               # nobody had (the caller closes the backend)
            raise
        self.submit = self.queue.submit
        self.post = self.queue.post
        self.release = self.queue.release
        self.call = self.queue.call
        self.wait = self.queue.wait

    # -- helpers ------------------------------------------------------------------------------
    def _stream(self, sid) -> StreamState:
        s = self.streams.get(sid)
        if s is None:
            if self.ended:
                self._reap_streams()
            sid = int(sid)                # a table never holds a StreamId (client/stream.py)
            s = self.streams[sid] = StreamState(sid, self.backend.new_stream())
        return s

    def stream_dropped(self, sid: int) -> None:
        """The last ``StreamId`` naming stream ``sid`` was dropped (called from its finalizer,
        on any thread, by ``runtime.client.stream``): queue its reclamation. Never blocks."""
        self.release(self.h_stream_ended, sid)

    def h_stream_ended(self, sid) -> None:
        """Reclaim ``sid`` now if nothing uses it, else when its work ran (``_reap_busy``, at
        the next blocking call; ``_reap_streams``, at the next new stream, graph destroy or
        ``memory_usage``) or its last graph went."""
        if sid in self.streams:
            self.ended.add(sid)
            self._reap(sid)

    def _reap_streams(self) -> None:
        """Try to reclaim every stream nobody can name any more (``_reap``)."""
        for sid in list(self.ended):
            self._reap(sid)

    def _reap_busy(self) -> None:
        """Before a blocking call takes the errors it raises (``Marks.before_take``): reclaim
        the ended streams whose work had not run when they ended (``ended_busy``), so errors
        that work left since are raised by this call (docs/contract.md section 3: the next
        blocking call on any stream), not at some later new stream or ``memory_usage``."""
        for sid in list(self.ended_busy):
            self._reap(sid)

    def h_reap_ended(self) -> None:
        """Reclaim the ended streams whose work was not known to have run (``_reap_busy``):
        ``ComputeClient.sync`` sends it after its wait when some are left, since that wait
        may be what they waited for (the wgpu backend frees an ended stream only once a fence
        behind its work completed, polled, never waited for: without this a table of ended
        streams stayed until some later blocking call, and every read and sync meanwhile
        took the slow path)."""
        self._reap_busy()

    def _reap(self, sid) -> bool:
        """Reclaim ``sid`` (nobody can name it: ``ended``) from the server's table and the
        backend's (``release_stream``) unless a live graph replays on it or its queued work has
        not run yet (then False: tried again later). A capture or warm-up left open on it is
        aborted (its window's buffers and primed slots go back to the pool); errors queued on
        it go to the next blocking call of any stream (``Marks.on_reclaim``; the backend's
        through ``failures``), bounded (``_bound_async_errors``)."""
        s = self.streams.get(sid)
        if s is None:
            self.ended.discard(sid)
            self.ended_busy.discard(sid)
            return True
        if s.graphs:
            self.ended_busy.discard(sid)    # (its last graph's destroy reclaims it)
            return False
        if s.state != cap.NO_CAPTURE or s.window is not None or s.primed:
            self.capture.abort(s)
        if not self.backend.release_stream(s.raw):
            self.ended_busy.add(sid)
            return False
        del self.streams[sid]
        self.ended.discard(sid)
        self.ended_busy.discard(sid)
        self.marks.on_reclaim(s)      # its queued errors: to the next blocking call (bounded)
        self.marks.collect()          # (release_stream handed the backend's to failures)
        self._bound_async_errors()
        if self.checker is not None:
            self.checker.on_reclaim(sid)
        self._reaped += 1
        if self._reaped > 64 + len(self.handles) + len(self.graphs) + len(self.streams):
            self._sweep()
        return True

    def _sweep(self) -> None:
        """Forget reclaimed stream ids in every table keyed by stream id: handles' accesses,
        idle pool slots' and graphs' fences, streams' ``synced`` (a reclaimed stream's work
        ran or was submitted in order: nothing is left to wait for). Amortised: runs once per
        as many reclaims as there are live entries."""
        self._reaped = 0
        live = self.streams

        def prune(d: dict) -> None:
            for k in [k for k in d if k not in live]:
                del d[k]
        for st in self.handles.values():
            prune(st.writes)
            prune(st.reads)
            prune(st.replayed)
            prune(st.slot.fences)
        for lst in self.pool._free.values():
            for slot in lst:
                prune(slot.fences)
        for g in self.graphs.values():
            prune(g.fences)
        for s in self.streams.values():
            prune(s.synced)

    #: compiled programs kept (``programs``, by ``Kernel``); past it the oldest is dropped.
    MAX_PROGRAMS = 1024

    #: unattributed errors kept for the next blocking call; past it the rest are folded.
    MAX_ASYNC_ERRORS = MAX_QUEUED_ERRORS

    def _bound_async_errors(self) -> None:
        """Keep the errors waiting for the next blocking call of any stream
        (``Marks.async_errors``: of reclaimed streams, of fire-and-forget messages) bounded:
        past ``MAX_ASYNC_ERRORS`` the rest are folded into one ``FoldedErrors`` that counts
        them and keeps the latest (nothing is dropped silently)."""
        fold_errors(self.marks.async_errors, self.MAX_ASYNC_ERRORS)

    def _on_async_error(self, exc, fn=None, args=()) -> None:
        # a fire-and-forget message raised past its own error handling: the next blocking call
        self.marks.on_async_error(exc)
        self._bound_async_errors()
        if fn is not None:
            self._mark_unfinished(exc, fn, args)

    def _mark_unfinished(self, exc, fn, args) -> None:
        """A launch, write or create (``fn(*args)``) raised past its own error handling (an
        asynchronous exception landed in it, or a bug): it may not have run, or run in part.
        What it would have written is marked with the error (``ReplayFailed`` on read until a
        later write lands), as for a launch that failed, so the values from before it are never
        read as if it ran once the error itself was raised; on a capturing stream the window is
        refused (``stop_capture`` raises ``CaptureRefused``: a graph never silently lacks it).
        (ADV5)"""
        fn = getattr(fn, "fn", fn)                  # a message carrying host data (_Counted)
        f = getattr(fn, "__func__", None)
        if f is ComputeServer.h_launch:
            sid, kernel, _, hids = args[:4]
            states = [self.handles.get(h) for b, h in zip(kernel.bindings, hids)
                      if b.access != "read"]
            op = ("launch", kernel.name, sid)
        elif f is ComputeServer.h_write or f is ComputeServer.h_alloc:
            sid, hid = args[:2]
            states, op = [self.handles.get(hid)], ("write", hid, sid)
        else:
            return
        what = (f"{op[0]} on stream {int(sid)} was interrupted ({type(exc).__name__}: {exc}); "
                "it may not have run")
        s = self.streams.get(sid)
        if s is not None and s.window is not None:   # a window that may lack it makes no graph
            self.capture.refuse(s, what)
        states = [st for st in states if st is not None]
        if states:
            err = exc if isinstance(exc, ServerError) else LaunchError(
                what + ": what it writes is marked until a later write lands")
            self.marks.fail(states, op, Mark(op).fail(err))

    def _handle(self, s: StreamState, hid: int, what: str):
        st = self.handles.get(hid)
        if st is None:
            err = InvalidHandle(f"{what}: handle {hid} is unknown or freed on server {self.name}; "
                                "keep the Handle alive while it is in use")
            s.errors.append(err)
            fold_errors(s.errors)            # a stream that never blocks: bounded
        return st

    def _event_at(self, src: StreamState, pos: int):
        """An event of ``src`` recorded at a position >= ``pos``, and that position."""
        if src.event is not None and src.event_pos >= pos:
            return src.event, src.event_pos
        if src.window is not None and src.window.event_pos >= pos:
            return src.window.event, src.window.event_pos  # never record on a capturing stream
        src.event, src.event_pos = self.backend.record_event(src.raw), src.pos
        if self.checker is not None:
            self.checker.on_record(src)
        return src.event, src.pos

    def _wait_for(self, s: StreamState, fences: dict) -> None:
        """Make ``s`` wait for every fence ``{stream id: position}`` of another stream (a
        reclaimed stream's work is done: nothing to wait for)."""
        for sid, pos in fences.items():
            if sid != s.id and s.synced.get(sid, 0) < pos:
                src = self.streams.get(sid)
                if src is None:
                    continue
                ev, epos = self._event_at(src, pos)
                self.backend.wait_event(s.raw, ev)
                s.synced[sid] = epos
                if self.checker is not None:
                    self.checker.on_event_wait(s, sid, epos)

    def _program(self, s: StreamState, kernel):
        prog = self.programs.get(kernel)
        if prog is None:
            try:
                prog = self.backend.compile(kernel)
            except ServerError as e:
                s.errors.append(detach(e))  # (its frames would keep the caller's alive)
                return None
            except Exception as e:  # noqa: BLE001 - a backend compiler's own exception type
                s.errors.append(LaunchError(f"kernel {kernel.name} failed to compile on "
                                            f"{self.backend.name}: {e}"))
                return None
            if len(self.programs) >= self.MAX_PROGRAMS:  # kernels made per request: bounded
                old = next(iter(self.programs))           # (the oldest; recompiled if used)
                self.backend.release_program(self.programs.pop(old))
            self.programs[kernel] = prog
        return prog

    def _release_slot(self, st: HandleState) -> None:
        """Give ``st``'s buffer back to the pool carrying the fences of all work pending on it:
        its accesses, the replays of graphs using it (live or destroyed). A slot a live graph
        pins waits (orphaned) until the graph's destroy hands it back."""
        fences = dict(st.writes)
        merge(fences, st.reads)
        merge(fences, st.replayed)
        for g in st.graphs:            # replays that may still use it (see module doc)
            merge(fences, {g.stream: g.last_pos})
            if st.id in g.required:
                g.freed.append(st.id)
        st.graphs = {}
        slot = st.slot
        if slot.pins:
            merge(fences, slot.fences)
            slot.fences = fences
            slot.orphan = True          # (last: an orphan always carries its handle's fences)
            gp = slot.graph_pool                # the next window of its graph pool may take it
            if gp is not None and self._shareable(slot, gp):
                gp.give(slot)
        else:
            self.pool.give(slot, fences)
            if self.pool.idle_bytes > self.pool.max_idle:
                self._trim(self.pool.max_idle)

    def _shareable(self, slot, gp) -> bool:
        """Whether orphan ``slot`` (its handle freed, graphs still retain it) may be handed to
        the next window of graph pool ``gp`` as a temporary: every live graph retaining it is
        a member of ``gp`` that writes it before it reads it (not one of its sources). A graph
        outside the pool (``stop_capture(retain=True)``, ``runtime.capture`` without the pool)
        replays in no order with the pool's graphs, and a graph reading the buffer before it
        writes it (its input: another graph's output whose handle was freed while it kept the
        buffer) reads whatever the temporary's next owner writes there: before ADV8 both read
        another graph's temporaries back with no error. Walks the live graphs: only when a
        handle on a pool buffer some graph retains is freed, or such a graph is destroyed."""
        members = gp.graphs
        for g in self.graphs.values():
            for r in g.retained:
                if r is slot:
                    if g.id not in members or any(st.slot is slot for st in g.sstates):
                        return False
                    break
        return True

    # -- memory ---------------------------------------------------------------------------------
    def _trim(self, keep: int) -> int:
        """Give idle pool buffers back to the device until at most ``keep`` idle bytes remain;
        returns the bytes freed. Nothing while a stream is prepared or capturing (the warm pool
        is what the recorded run allocates from)."""
        if self.capture.windows or any(st.state != cap.NO_CAPTURE for st in self.streams.values()):
            return 0
        return self.pool.trim(keep)

    def h_empty_cache(self) -> int:
        """Free every idle pool buffer to the device (``torch.cuda.empty_cache``); returns the
        bytes given back (0 while a stream is prepared or capturing)."""
        self.queue.run_releases()
        return self._trim(0)

    def h_alloc(self, sid, hid: int, nbytes: int, data) -> None:
        """``create`` / ``empty``: reserve a pooled buffer for ``hid``; write ``data`` if given.
        On ``OutOfMemory`` the idle pool is given back to the device and the allocation retried
        once before the error is queued on the stream. A stream prepared or capturing with a
        graph pool takes a buffer its graphs share first (``memory.GraphPool.take``)."""
        s = self._stream(sid)
        gp = s.pool if s.state != cap.NO_CAPTURE else None
        slot = gp.take(nbytes) if gp is not None else None
        taken, fresh = slot is not None, False
        if slot is None:
            try:
                try:
                    slot, fresh = self.pool.take(nbytes)
                except OutOfMemory:
                    if not self._trim(0):
                        raise
                    slot, fresh = self.pool.take(nbytes)
            except ServerError as e:
                if isinstance(e, OutOfMemory):   # raised by a later call: name the handle
                    e = OutOfMemory(f"create/empty of handle {hid} ({nbytes} bytes): {e} (after "
                                    "giving the idle pool back); the handle is unusable: "
                                    "release handles you no longer need, or allocate less")
                s.errors.append(detach(e))
                fold_errors(s.errors)            # a stream that never blocks: bounded
                return
        st = self.handles[hid] = HandleState(hid, slot, nbytes, sid)
        if s.state == cap.PREPARE:              # the estimate of what the window will need
            s.warm.add(hid)
            s.warm_bytes += slot.nbytes
            if s.warm_bytes > s.warm_peak:
                s.warm_peak = s.warm_bytes
        self.capture.on_alloc(s, st, fresh)
        if taken:                               # another graph's temporary: it rewrites it
            self._pool_aliases(gp)
        if data is not None:
            self.h_write(sid, hid, data)

    def h_free(self, sid, hid: int) -> None:
        """Free ``hid`` into the pool (the last ``Handle`` drop or ``release()``)."""
        st = self.handles.pop(hid, None)
        if st is None:
            return
        ws = self.streams.get(st.stream)
        if ws is not None and hid in ws.warm:
            ws.warm.discard(hid)
            ws.warm_bytes -= st.slot.nbytes
        if not self.capture.on_free(self.streams.get(sid), st):
            self._release_slot(st)
        gp = st.slot.graph_pool
        if gp is not None and any(st in self.graphs[g].clobbers for g in gp.graphs
                                  if g in self.graphs):
            self._pool_aliases(gp)          # (its graphs forget it: deferred again)

    # -- copies ---------------------------------------------------------------------------------
    def h_write(self, sid, hid: int, data) -> None:
        """In-place host-to-device copy on stream ``sid`` (``data``: a private uint8 array)."""
        s = self._stream(sid)
        st = self._handle(s, hid, "write")
        if st is None:
            return
        if self.capture.on_write(s, st):      # (refused: marked, not applied)
            return
        self._wait_for(s, st.writes)
        self._wait_for(s, st.reads)
        if self.checker is not None:
            self.checker.on_access(s, st, "write", True)
        try:
            self.backend.copy_in(s.raw, st.slot.buf, data)
        except ServerError as e:              # queued on the stream like any fire-and-forget error
            s.errors.append(detach(e))
            fold_errors(s.errors)            # a stream that never blocks: bounded
            self.marks.fail((st,), ("write", hid, sid), e)
            return
        s.pos += 1
        st.writes = {sid: s.pos}
        st.reads = {}
        st.mark = CLEAN

    def read(self, sid, hid: int, dtype=None):
        """``ComputeClient.read``'s entry: :meth:`h_read` on the calling thread while the server
        is idle (``DeviceQueue.call``'s combining path written out, as :meth:`replay`), else
        :data:`BUSY` (the caller then makes the blocking ``call(h_read, ...)``). Returns and
        raises what ``h_read`` does.

        Deferred work (``queue.lazy``) runs first, as every owner runs it. When it is one
        replay on the read's stream that :meth:`_run_lazy` would run at once (no source's mark
        may carry a failure) and the read would take ``h_read``'s fast path (a clean buffer
        whose writes are on this stream only, on an idle stream with nothing to report), the
        replay and the copy run in one backend call (``Backend.launch_graph_now`` with the
        buffer: a replay then a read of what it wrote is issue 26's core path); a failure is
        recorded as :meth:`_run_lazy` records it (``_ran_and_failed``) and the read then goes
        through ``h_read`` (which raises it). An asynchronous exception landing in that run
        stops the server, as in :meth:`_run_lazy` (the replay may have been lost or half run).
        """
        queue = self.queue
        tok = queue._tok
        if not queue._q and tok:
            try:
                tok.pop()                   # the owner lock taken (queue.OwnerLock)
            except IndexError:              # (by another thread meanwhile)
                return BUSY
            try:
                if not queue._q and not queue.closed:
                    lazy = queue.lazy
                    if lazy:                # deferred work first: one replay, with the copy?
                        g = lazy[0]
                        if len(lazy) == 1 and g.__class__ is not tuple:
                            s = g.sstate            # (in the table while g lives:
                            st = self.handles.get(hid)  # StreamState.graphs)
                            if (st is not None and s.id == sid
                                    and s.window is None and self.checker is None
                                    and not (s.errors or self.marks.async_errors
                                             or self.backend.failures or self.ended_busy)):
                                w = st.writes       # (h_read's fast path, written out:
                                #                     change both together; writes here only)
                                if not (len(w) > 1 or sid not in w and w):
                                    for x in g.sstates:     # (as in _run_lazy: a source's
                                        if x.mark is not CLEAN and self._marked_sources(g):
                                            break           # mark may carry a failure)
                                    else:
                                        try:
                                            lazy.clear()    # (run once, whatever lands)
                                            data = self.backend.launch_graph_now(
                                                s.raw, g.graph, st.slot.buf, st.nbytes, dtype)
                                            if data is False:   # not run at once: below
                                                lazy.append(g)
                                            else:           # ran (as in _run_lazy)
                                                s.done_pos = g.last_pos = s.pos = p = s.pos + 1
                                                for x in g.wstates:
                                                    x.mark = CLEAN
                                        except LaunchError as e:
                                            self._ran_and_failed(g, s, e)
                                            return self.h_read(sid, hid, dtype)
                                        except BaseException as e:
                                            lazy.clear()    # (as in _run_lazy: it may be
                                            queue._die(e)   # lost or half run)
                                            raise
                                        if data is not False:   # and read it (h_read's fast
                                            if s.synced:        # path, from here)
                                                self.marks.ran(s)
                                            if st.mark is CLEAN or self.marks.clean(st):
                                                st.reads[sid] = s.done_pos = s.pos = p + 1
                                                return data
                                            return self.h_read(sid, hid, dtype)
                        self._run_lazy()
                    return self.h_read(sid, hid, dtype)
            except queue.FATAL as e:
                queue._die(e)
                raise queue.closed_error() from None
            except BaseException:
                queue._check_backend()      # (its flush interrupted: CpuBackend.broken)
                raise
            finally:                        # (DeviceQueue._release, inlined)
                tok.append(True)
                if queue.room_waiters:
                    queue.notify_room()
                if queue._q and not queue.closed and queue._owner.acquire(False):
                    queue._drain()
        return BUSY

    queue_mod.OWNER_CODES.add(read.__code__)        # it takes the owner lock (queue.py)

    def h_read(self, sid, hid: int, dtype=None) -> tuple:
        """Device-to-host copy of ``hid``; returns ``(completion, mark, errors)``: the caller
        waits on the completion, then raises ``mark.stale(hid, ...)`` if the write it observed
        failed (found here or meanwhile), else ``errors`` (with the completion's own) if any.

        A read that will raise (its buffer is marked, or errors are queued on the stream) copies
        nothing: it waits like a read that returns (for the buffer's last writer on any stream)
        and its completion is a fence of the stream (``Marks.fence_then_raise``), so it raises every
        error of the work before it, once, after that work ran.

        Raises: ``CaptureRefused`` (capturing stream), ``InvalidHandle``; through the client:
        ``ReplayFailed`` (its last writer failed; with the stream's queued errors),
        ``ServerUnhealthy`` (queued errors of this stream).

        Fast path (issue 26): a clean buffer on an idle stream with nothing to report is copied
        at once (``Backend.copy_out_now``) and the answer is the copy itself, an ``np.ndarray``
        of ``dtype`` when the backend makes it (``uint8`` bytes when ``dtype`` is None or the
        backend leaves it: the caller views them). (:meth:`read` runs a deferred replay first,
        with the copy when it can.)
        """
        s = self.streams.get(sid) or self._stream(sid)
        st = self.handles.get(hid)
        # (these conditions are written out again in read()'s fused replay + copy, to spare
        # the core path a call: change both together)
        if (st is not None and s.window is None and self.checker is None
                and not (s.errors or self.marks.async_errors or self.backend.failures
                         or self.ended_busy)):
            w = st.writes
            if len(w) > 1 or sid not in w and w:
                self._wait_for(s, w)        # (an event wait queued: not idle any more)
            data = self.backend.copy_out_now(s.raw, st.slot.buf, st.nbytes, dtype)
            if data is not None:            # idle: everything before it ran
                if s.done_pos < s.pos or s.synced:  # (else Marks.ran would learn nothing)
                    self.marks.ran(s)
                if st.mark is CLEAN or self.marks.clean(st):
                    st.reads[sid] = s.done_pos = s.pos = s.pos + 1
                    return data
        if s.window is not None:            # (the message is built only when it refuses)
            self.capture.on_event(s, f"read of handle {hid}")
        if st is None:
            raise InvalidHandle(f"read: handle {hid} is unknown or freed on server {self.name} (or "
                                "its allocation failed: the OutOfMemory is queued on the "
                                "stream that created it)")
        self._flush(s)                      # failures of its batch surface now, on this stream
        errs = self.marks.take_errors(s)
        if errs or (st.mark is not CLEAN and self.marks.error_of(st.mark) is not None):
            self._wait_for(s, st.writes)    # as a read that returns: after the buffer's writer
            comp, errs = self.marks.fence_then_raise(s, errs)
            return comp, st.mark, errs
        self._wait_for(s, st.writes)
        if self.checker is not None:
            self.checker.on_access(s, st, "read", False)
        comp = self.backend.copy_out(s.raw, st.slot.buf, st.nbytes)
        s.pos += 1
        self.marks.fence(s, comp)
        st.reads[sid] = s.pos
        if self.checker is not None:
            self.checker.on_sync(s)     # the read returns only once s ran up to it
        return comp, st.mark, []

    # -- kernels --------------------------------------------------------------------------------
    def launch(self, sid, kernel, count, hids, params):
        """``ComputeClient.launch``'s entry: :meth:`h_launch` on the caller's thread while the
        server is idle (``DeviceQueue.submit``'s combining path written out, as :meth:`replay`;
        what escapes the handler goes where a fire-and-forget message's error goes:
        ``_on_async_error``, the next blocking call). A launch of tiny work (``Backend.defers``:
        the cpu backend's plain kernels over at most 64 KiB; not indirect, no checker) is
        deferred instead, as a replay is (:meth:`replay`): appended to ``queue.lazy`` and run
        through ``h_launch`` by the next owner before anything else, so nothing runs before it
        (``h_launch`` raises nothing to the caller either way: its errors are queued on the
        stream). Returns what ``h_launch`` returns (True: enqueued, the caller then looks for
        room in the queue; None when deferred), or :data:`BUSY` when the server was not idle:
        the caller then submits it (``DeviceQueue.submit``, which waits for room first;
        ``ServerClosed`` once the server stopped)."""
        queue = self.queue
        tok = queue._tok
        if not queue._q and tok:
            try:
                tok.pop()                   # the owner lock taken (queue.OwnerLock)
            except IndexError:              # (by another thread meanwhile)
                return BUSY
            try:
                if not queue._q and not queue.closed:
                    if count.__class__ is tuple:    # tiny work: deferred (as in replay)
                        handles, nbytes = self.handles, 0
                        for hid in hids:
                            st = handles.get(hid)
                            if st is None:
                                break
                            nbytes += st.nbytes
                        else:
                            if self.checker is None and self.backend.defers(kernel, nbytes):
                                lazy = queue.lazy
                                lazy.append((sid, kernel, count, hids, params))
                                if queue.lazy_asleep:
                                    queue.wake_for_lazy()
                                if len(lazy) >= LAZY_MAX:
                                    return self._run_lazy()
                                return None
                    if queue.lazy:
                        self._run_lazy()
                    return self.h_launch(sid, kernel, count, hids, params)
            except queue.FATAL as e:
                queue._die(e)
                return None
            except BaseException as e:  # noqa: BLE001 - queued on a stream, as in _drain
                self._on_async_error(e, self.h_launch, (sid, kernel, count, hids))
                return None
            finally:
                queue._release()
        return BUSY

    queue_mod.OWNER_CODES.add(launch.__code__)      # it takes the owner lock (queue.py)

    def h_launch(self, sid, kernel, count, hids, params):
        """Enqueue (or, inside a window, record) one launch of ``kernel`` on stream ``sid``.

        ``count`` is ``(x, y, z)`` workgroups or a handle id (indirect: three u32 read at run).
        A failure found here is queued on the stream and marks what the launch would have
        written; so does one the backend finds later (``Mark.fail``). A launch reading a marked
        buffer through a ``read`` or ``read_write`` binding marks what it writes (the failure
        propagates, also when it is found after this launch was enqueued: ``Marks.inherit``);
        only a ``write`` binding does not read (docs/contract.md section 4), except in an
        indirect launch, whose count may be 0 (it may write nothing: its outputs keep their
        marks, as a graph's buffers written only by such launches do, section 4b).

        Returns True when the launch was enqueued on the backend (the caller of :meth:`launch`
        then looks for room in the queue), else None or False (it ran at once, was recorded or
        refused).
        """
        s = self.streams.get(sid) or self._stream(sid)
        handles = self.handles
        states = [handles.get(hid) for hid in hids]
        cst = None
        if count.__class__ is not tuple:
            cst = self.handles.get(count)
            if cst is None:
                states.append(None)
                hids = list(hids) + [count]
        bindings = kernel.bindings
        w = s.window
        if None in states:
            outs = [st for b, st in zip(bindings, states)
                    if st is not None and b.access != "read"]
            hid = hids[states.index(None)]
            err = InvalidHandle(f"launch of {kernel.name}: handle {hid} is unknown or freed on "
                                f"server {self.name}; keep the Handle alive while it is in use")
            s.errors.append(err)
            self._launch_failed(s, outs, kernel, err)
            return
        prog = self.programs.get(kernel) or self._program(s, kernel)
        if prog is None:
            outs = [st for b, st in zip(bindings, states) if b.access != "read"]
            self._launch_failed(s, outs, kernel, s.errors[-1])
            return
        if cst is not None:
            count = (cst.slot.buf, cst.nbytes)
        args = [st.arg for st in states]
        try:
            for bi, pi, size in kernel.element_checks:     # (empty unless declared: Kernel)
                if params[pi] * size > states[bi].nbytes:  # n past a buffer: refused, never
                    raise LaunchError(kernel.elements_error(   # clamped or out of bounds
                        params, [st.nbytes for st in states], hids))
            if kernel.product_checks:                       # (M*K past a matmul's a, ...)
                msg = kernel.elements_error(params, [st.nbytes for st in states], hids)
                if msg is not None:
                    raise LaunchError(msg)
            if kernel.count_error is not None and cst is None and count[0] and count[1] \
                    and count[2]:                           # (a zero count is a no-op)
                msg = kernel.count_error(count, params)     # a grid short of the work
                if msg is not None:
                    raise LaunchError(msg)
            if w is not None:
                self.capture.record(s, kernel, prog, count, args, params, states, cst)
                return
            reads = None
            for acc, st in zip(kernel.accesses, states):
                w = st.writes
                if len(w) > 1 or sid not in w and w:    # (only this stream's: nothing to wait)
                    self._wait_for(s, w)
                if acc != "read":
                    if st.reads:
                        self._wait_for(s, st.reads)
                if st.mark is not CLEAN and (acc != "write" or cst is not None or (
                        kernel.write_checks and _partly(kernel, params, states, st, count))) and (
                        not Marks.clean(st)):   # (an indirect count may be 0: writes nothing;
                    # a write covering part of the buffer leaves the rest as it was: ADV6)
                    if reads is None:
                        reads = []
                    reads.append((st.id, st.mark))
            if cst is not None:
                if not self.backend.indirect_dispatch:
                    raise LaunchError(f"indirect launch of {kernel.name}: the "
                                      f"{self.backend.name} backend does not read counts on "
                                      "the device; launch through ComputeClient.launch, which "
                                      "reads them first")
                self._wait_for(s, cst.writes)
                if cst.mark is not CLEAN and not Marks.clean(cst):  # counts from a failed
                    if reads is None:           # writer: what it writes is stale (ADV8)
                        reads = []
                    reads.append((cst.id, cst.mark))
            if self.checker is not None:
                for b, st in zip(bindings, states):
                    self.checker.on_access(s, st, kernel, b.access != "read")
            if (reads is None and cst is None and self.checker is None
                    and self.backend.launch_now(s.raw, prog, count, args, params)):
                mark = CLEAN                    # it ran, in order, and cannot fail later
                s.done_pos = s.pos + 1          # its idle stream ran everything before it too
            else:                               # enqueued: a mark for a failure found later
                mark = Mark(("launch", kernel.name, sid), None, (), s, s.pos + 1)
                if reads is not None:
                    self.marks.inherit(mark, reads)
                self.backend.launch(s.raw, prog, count, args, params, mark)
        except Exception as e:  # noqa: BLE001 - a device API's own exception type
            err = detach(e) if isinstance(e, ServerError) else LaunchError(
                f"launch of {kernel.name} on stream {sid} failed: {e}")
            s.errors.append(err)            # (detached: its frames keep no caller alive)
            outs = [st for b, st in zip(bindings, states) if b.access != "read"]
            self._launch_failed(s, outs, kernel, err)
            return
        s.pos += 1
        pos = s.pos
        for acc, st in zip(kernel.accesses, states):
            if acc == "read":
                st.reads[sid] = pos
            else:
                w = st.writes               # (every reader copies it: updated in place)
                if len(w) == 1 and sid in w:
                    w[sid] = pos
                else:
                    st.writes = {sid: pos}
                if st.reads:
                    st.reads = {}
                st.mark = mark
        if cst is not None:
            cst.reads[sid] = pos
        return mark is not CLEAN                # enqueued on the backend

    def _flush(self, s: StreamState) -> None:
        """``Backend.flush`` of ``s``, which every handler that blocks or raises the stream's
        errors calls first, before it takes them (so a refusal here loses none). Raises
        ``UnsupportedError`` when the calling thread runs ``s``'s work itself (a cpu kernel body
        reading or syncing its own stream: it would wait for that body forever; CUDA host
        functions may not call CUDA either)."""
        if self.backend.held_by_caller(s.raw):
            raise UnsupportedError(
                "a blocking runtime call (read, sync, ...) from inside a cpu kernel body on its "
                "own stream would wait for that body forever; call the runtime outside kernel "
                "bodies (as CUDA host functions may not call CUDA)")
        self.backend.flush(s.raw)

    def _launch_failed(self, s: StreamState, outs, kernel, err) -> None:
        """A launch on ``s`` was refused with ``err`` (queued on ``s`` already): mark what it
        would have written, or, inside a window, invalidate the window (``Capture.refuse``)."""
        fold_errors(s.errors)             # a stream that never blocks: bounded
        if s.window is None:
            self.marks.fail(outs, ("launch", kernel.name, s.id), err)
        else:
            self.capture.refuse(s, f"launch of {kernel.name} ({type(err).__name__}: {err})")

    def h_indirect_count(self, sid, hid: int):
        """For ``launch`` on a backend without ``indirect_dispatch``: ``h_read`` of the count
        handle ``hid`` on ``sid`` (the caller waits and decodes it, so no handler waits for the
        device), or None while ``sid`` is capturing (the launch then goes to the window, which
        refuses it: ``Capture.record``)."""
        s = self._stream(sid)
        if s.window is not None:
            return None
        return self.h_read(sid, hid)

    # -- synchronisation ------------------------------------------------------------------------
    def h_sync(self, sid) -> tuple:
        """``(completion of everything enqueued on sid, queued errors)``: the caller waits on
        the completion, then raises the queued errors together with the completion's own
        (``Marks.fence_then_raise``: a sync that raises has waited too)."""
        s = self.streams.get(sid) or self._stream(sid)
        if s.window is not None:
            self.capture.on_event(s, "sync")
        self._flush(s)
        return self.marks.fence_then_raise(s, self.marks.take_errors(s))

    def sync_idle(self, sid) -> bool:
        """The fast path of ``sync()`` (issue 26): True when stream ``sid`` is idle with nothing
        to report, so the sync is done; False sends the caller to ``h_sync``. Runs on the
        caller's thread holding the owner lock, only when no message is queued (every message
        the caller queued before ran), so it is ordered like a message. Records that the stream
        ran up to its position (``done_pos``: its marks are final), as a fence would."""
        queue = self.queue
        tok = queue._tok
        if queue._q or not tok:
            return False
        try:
            tok.pop()                       # the owner lock taken (queue.OwnerLock)
        except IndexError:                  # (by another thread meanwhile)
            return False
        try:
            if queue.lazy:
                self._run_lazy()
            s = self.streams.get(sid)
            if (s is None or s.window is not None or s.errors or self.marks.async_errors
                    or self.checker is not None or self.backend.failures or self.ended_busy
                    or queue._q or queue.closed or not self.backend.idle(s.raw)):
                return False
            s.done_pos = s.pos
            return True
        finally:                            # (DeviceQueue._release, inlined)
            tok.append(True)
            if queue.room_waiters:
                queue.notify_room()
            if queue._q and not queue.closed and queue._owner.acquire(False):
                queue._drain()

    queue_mod.OWNER_CODES.add(sync_idle.__code__)    # it takes the owner lock (queue.py)

    def h_flush(self, sid) -> None:
        """Hand batched work to the device and raise queued errors (not refused in a window:
        window refusals are reported by ``stop_capture``)."""
        s = self._stream(sid)
        self._flush(s)
        self.marks.drain(s)

    def h_record_event(self, sid):
        """An event on ``sid`` after its work so far (for ``ComputeClient.record_event``).

        Raises: ``CaptureRefused`` (``sid`` is capturing).
        """
        s = self._stream(sid)
        self.capture.on_event(s, "record_event")
        ev, pos = self._event_at(s, s.pos)
        return (sid, pos)

    def h_wait_event(self, sid, token) -> None:
        """Make ``sid`` wait for an event token from ``h_record_event``.

        Raises: ``CaptureRefused`` (``sid`` is capturing: the joined work would be missing from
        the graph).
        """
        src_id, pos = token
        s = self._stream(sid)
        self.capture.on_event(s, "wait_event")
        self._wait_for(s, {src_id: pos})
        if self.checker is not None:
            self.checker.on_event_wait(s, src_id, pos)

    # -- capture --------------------------------------------------------------------------------
    def h_graph_prepare(self, sid, pool_id=None) -> None:
        """``NO_CAPTURE -> PREPARE`` and arm warm-up priming (see ``capture.py``); with
        ``pool_id`` the window allocates from that graph pool first (``memory.GraphPool``).

        Raises: ``GraphStateError`` (already prepared or capturing; or the pool's graphs live
        on another stream: graphs of one pool replay in order on one stream). Nothing changes.
        """
        self.queue.run_releases()     # frees dropped before it are not primed
        s = self._stream(sid)
        gp = None
        if pool_id is not None:
            gp = self.graph_pools.get(pool_id)
            if gp is not None and gp.stream is not None and gp.stream != sid and (
                    gp.graphs or any(st.pool is gp for st in self.streams.values()
                                     if st.state != cap.NO_CAPTURE)):
                raise GraphStateError(
                    f"graph_prepare(pool={pool_id}) on stream {int(sid)}: the graphs of that pool "
                    f"capture and replay on stream {int(gp.stream)} (they share buffers, so they "
                    "must run in order on one stream); capture on that stream or use another "
                    "pool")
        self.capture.prepare(s)
        if pool_id is not None:
            if gp is None:
                gp = self.graph_pools[pool_id] = GraphPool(pool_id)
            gp.stream = sid
        s.pool = gp
        s.warm, s.warm_bytes, s.warm_peak = set(), 0, 0
        s.warm_pool_free = 0 if gp is None else gp.usage()["free_bytes"]

    def h_graph_estimate(self, sid) -> dict:
        """``ComputeClient.graph_estimate``: what the window of ``sid`` will need, from its
        warm-up so far: ``{"bytes": the most bytes its allocations held at once since
        graph_prepare, "pool_free_bytes": what its graph pool could serve when graph_prepare
        ran (before the warm-up took from it; 0 without one), "new_bytes": bytes - pool_free_bytes,
        at least 0: what the pool cannot serve}``."""
        s = self._stream(sid)
        return {"bytes": s.warm_peak, "pool_free_bytes": s.warm_pool_free,
                "new_bytes": max(0, s.warm_peak - s.warm_pool_free)}

    def h_warmup_fence(self, sid) -> Completion:
        """First half of ``start_capture``: hand the warm-up to the device and return a
        completion of it, which the caller waits for outside the server (failures found at
        submit are queued on the stream). Raises ``GraphStateError`` when ``begin`` would."""
        self.queue.run_releases()     # frees dropped in the warm-up are primed
        s = self._stream(sid)
        self.capture.check_begin(s)
        try:
            self._flush(s)
        except ServerError as e:
            s.errors.append(detach(e))
            return Completion.ready()
        # also when errors are queued already: the warm-up's failures found at execution are
        # raised with them by start_capture, never left for a later call
        comp = self.backend.synchronize(s.raw)
        self.marks.fence(s, comp)
        return comp

    def h_start_capture(self, sid, warmup_error=None) -> None:
        """``PREPARE -> CAPTURE`` (``Capture.begin``): refuse a failed warm-up, open a recording.

        Args:
            warmup_error: what the completion of ``h_warmup_fence`` failed with, or None.
        Raises: ``GraphStateError`` (out of order, unchanged); ``ServerUnhealthy`` (the warm-up
        left errors: the stream goes back to ``NO_CAPTURE``); ``UnsupportedError``.
        """
        self.capture.begin(self._stream(sid), warmup_error)

    def h_abort_capture(self, sid) -> None:
        """Back to ``NO_CAPTURE`` from any state, dropping the recording (``Capture.abort``)."""
        self.capture.abort(self._stream(sid))

    def h_stop_capture(self, sid, retain: bool = False) -> tuple:
        """``CAPTURE -> NO_CAPTURE``; returns ``(graph id, is_hardware)``.

        Args:
            retain: the graph keeps every buffer it uses (freeing its handles does not break
                it); else a replay after the free of a caller-owned handle raises
                ``LivenessError``. Either way no buffer it uses changes owner while it lives.
        Raises: ``GraphStateError`` (nothing recording, unchanged); ``CaptureRefused`` naming the
        window's refusals, first first (at once or late: any refusal invalidates the window; no
        graph is made), with the errors queued in the window; ``ServerUnhealthy`` (errors
        queued in the window). See ``Capture.end``.
        """
        self.queue.run_releases()     # frees dropped in the window are refused
        s = self._stream(sid)
        if s.pool is not None and s.window is not None:
            self._refuse_shared_state(s)
        g = self.capture.end(s, next(_graph_ids), retain)
        self.graphs[g.id] = g
        s.graphs += 1                 # the stream is not reclaimed while a graph replays there
        g.sstate = s
        gp, s.pool = s.pool, None
        s.warm, s.warm_bytes = set(), 0
        if gp is not None:                      # its window's buffers join the graph pool
            gp.graphs.add(g.id)
            self.graph_pool_of[g.id] = gp
            state = {id(st.slot) for st in g.sstates}
            for slot in g.alloc_slots:
                if id(slot) not in state:       # its state (read before written) stays its own
                    gp.adopt(slot, not slot.orphan or self._shareable(slot, gp))
            self._pool_aliases(gp)
        if self.checker is not None:
            self.checker.on_graph(g)
        return g.id, bool(self.backend.hardware_graphs)

    def _refuse_shared_state(self, s: StreamState) -> None:
        """A window of a graph pool may share only temporaries (buffers each replay writes
        before it reads them): a buffer the window allocated from the pool's shared buffers
        (another graph's temporary) that the recording reads before writing it would be state
        the other graphs overwrite on every replay. ``GraphStateError`` (the window is aborted,
        no graph is made) naming the handle; its own new buffers holding state are simply kept
        out of the pool (``h_stop_capture``)."""
        w = s.window
        shared = [st for st in w.allocs if st.slot.graph_pool is s.pool]
        if not shared:
            return
        src = cap.sources(w.ops, {st.id: st.nbytes for st in w.states.values()})
        bad = [st.id for st in shared if st.id in src]
        if bad:
            pid = s.pool.id
            self.capture.abort(s)
            s.pool, s.warm, s.warm_bytes = None, set(), 0
            raise GraphStateError(
                f"stop_capture on stream {int(s.id)}: handle {bad[0]}, allocated in the window "
                f"from graph pool {pid}'s shared buffers (another graph's temporary), is "
                "read by the recording before it is written (state: an accumulator, a KV "
                "cache; or a read past the part a launch wrote); the pool's other graphs "
                "overwrite it on every replay, so no graph was "
                "made. Allocate state before graph_prepare, or capture this graph without the "
                "pool")

    def replay(self, gid: int):
        """``Graph.replay``'s entry. While the server is idle the caller runs it, holding the
        owner lock (``DeviceQueue.call``'s combining path, written out: a replay is the hot path
        of issue 26). A replay of small work (``GraphState.defer``: the cpu backend's ufunc-only
        graphs whose launches a waiter would run anyway, no buffer written only inside
        conditional nodes) with no capture window on its stream, no freed handle, no
        first-replay fences and no checker is deferred: appended to ``queue.lazy`` and run by the next owner before
        anything else (:meth:`_run_lazy`: tiny work at once on that thread when nothing needs
        the enqueue path, else enqueued; by the device thread within ``LAZY_S`` if no call
        came), so no read, launch, sync or message ever runs before it. Everything else goes to
        :meth:`_enqueue_replay`. Returns what ``h_replay`` returns (None when deferred; when it
        ran the ``LAZY_MAX`` deferred items: True if one was enqueued) and
        raises what it raises (``ServerClosed`` once the server stopped); :data:`BUSY` when the
        server was not idle: the caller then makes the blocking ``call(h_replay, gid)`` itself
        (so no frame of this function, one of the owner lock's holders,
        ``queue.OWNER_CODES``, is on a stack that only waits)."""
        queue = self.queue
        tok = queue._tok
        if not queue._q and tok:
            try:
                tok.pop()                   # the owner lock taken (queue.OwnerLock)
            except IndexError:              # (by another thread meanwhile)
                return BUSY
            try:
                if not queue._q and not queue.closed:
                    g = self.graphs.get(gid)
                    if g is None:
                        return self.h_replay(gid)
                    s = g.sstate
                    # deferred when tiny and nothing sends it down the enqueue path but maybe
                    # its sources, decided when it runs (a deferred replay before it may fail)
                    if (g.defer and s.window is None and not g.freed and not g.fences
                            and self.checker is None):
                        lazy = queue.lazy
                        lazy.append(g)
                        if queue.lazy_asleep:    # (the device thread runs it if no call comes)
                            queue.wake_for_lazy()
                        if len(lazy) >= LAZY_MAX:     # (True: enqueued work; the caller looks for
                            return self._run_lazy()     # room in the queue)
                        return None
                    if queue.lazy:
                        self._run_lazy()
                    return self._enqueue_replay(g, s)
            except queue.FATAL as e:
                queue._die(e)
                raise queue.closed_error() from None
            finally:                        # (DeviceQueue._release, inlined)
                tok.append(True)
                if queue.room_waiters:
                    queue.notify_room()
                if queue._q and not queue.closed and queue._owner.acquire(False):
                    queue._drain()
        return BUSY

    queue_mod.OWNER_CODES.add(replay.__code__)      # it takes the owner lock (queue.py)

    def _run_lazy(self) -> bool:
        """Owner only: run the deferred launches and replays (``queue.lazy``: :meth:`launch`,
        :meth:`replay`) in order; True when one of them was enqueued on the backend (the caller
        that deferred the ``LAZY_MAX``-th then looks for room in the queue, as an enqueue's
        caller does). A launch goes through ``h_launch`` (at once when its stream is idle). A
        replay of tiny work (``graph.inline``) none of whose sources' marks may carry a failure
        (a failed deferred launch or replay before it marks its outputs, so a replay reading
        them inherits) runs at once on this thread when its stream is idle (``Backend.launch_graph_now``: no mark,
        no hand-off; a failure is recorded as one found at execution: on the stream, which the
        next blocking call raises, and on the graph's write set, ``ReplayFailed`` on read);
        the others go to :meth:`_enqueue_replay`. Nothing else ran between a deferral and here
        (every owner runs this first), so each sees the state its deferral checked. An error
        escaping one is a fire-and-forget error (a replay's also marks its write set). An
        asynchronous exception (KeyboardInterrupt) landing here may have lost one: the server
        stops (``ServerClosed`` for every call) rather than answer from stale buffers."""
        lazy = self.queue.lazy
        room = False
        try:
            for g in lazy:      # (nothing appends meanwhile: this thread holds the owner lock)
                if g.__class__ is tuple:    # a deferred launch (:meth:`launch`)
                    try:
                        if self.h_launch(*g):
                            room = True
                    except Exception as e:  # noqa: BLE001 - as in launch: a fire-and-forget's
                        self._on_async_error(e, self.h_launch, g)
                    continue
                s = g.sstate
                for st in g.sstates:        # a source's mark may carry a failure
                    if st.mark is not CLEAN and self._marked_sources(g):
                        break
                else:
                    try:                    # (a graph the backend would not run at once: False)
                        ran = self.backend.launch_graph_now(s.raw, g.graph)
                    except LaunchError as e:    # it ran and failed: as if found at execution
                        self._ran_and_failed(g, s, e)
                        continue
                    if ran:
                        s.done_pos = g.last_pos = s.pos = s.pos + 1
                        for st in g.wstates:
                            st.mark = CLEAN
                        continue
                try:
                    if self._enqueue_replay(g, s):
                        room = True
                except Exception as e:  # noqa: BLE001 - a fire-and-forget's error
                    err = e if isinstance(e, ServerError) else UnsupportedError(
                        f"deferred replay of graph {g.id} failed on {self.backend.name}: {e!r}")
                    self.marks.fail(g.wstates, g.op, Mark(g.op).fail(err))
                    self._on_async_error(err)
        except BaseException as e:
            lazy.clear()
            self.queue._die(e)
            raise
        lazy.clear()
        return room

    def _ran_and_failed(self, g, s, e) -> None:
        """Record a deferred replay of ``g`` on ``s`` that ran at once and raised ``e``
        (``LaunchError``) as a failure found at execution: queued on ``s`` (the next blocking
        call raises it) and on the graph's write set (``ReplayFailed`` on read)."""
        failed = Mark(g.op).fail(e)
        s.errors.append(failed)
        fold_errors(s.errors)               # a stream that never blocks: bounded
        self.marks.fail(g.wstates, g.op, failed)
        s.pos += 1
        s.done_pos = g.last_pos = s.pos

    def h_replay(self, gid: int):
        """Enqueue one replay of graph ``gid`` on its capture stream; returns once enqueued:
        True (the caller looks for room in the queue) or False (enqueued where the backend knows
        its backlog is small: ``Backend.launch_graph``). (:meth:`replay`, the caller's entry,
        runs tiny work on an idle stream at once instead.)

        The first replay waits for the work other streams had pending on the graph's buffers at
        record time (``Window.fences``). Raises: ``UnknownGraph``; ``CaptureRefused`` (its stream
        is capturing); ``LivenessError`` (a caller-owned handle it uses was freed); the
        backend's refusal. Any failure, here or later while it executes, marks the graph's
        write set (``ReplayFailed`` on read) until a later write to each buffer lands; so does
        a failure of the last writer of a buffer the graph reads before it writes it (an input,
        or state it reads and writes: ``GraphState.sources``), whenever it is found. A graph
        whose state is marked keeps failing until the state is written from the host.
        """
        g = self.graphs.get(gid)
        if g is None:
            raise UnknownGraph(f"replay of graph {gid}: unknown or already destroyed on server "
                               f"{self.name}; keep a Graph clone alive while you replay it")
        return self._enqueue_replay(g, self.streams[g.stream])

    def _enqueue_replay(self, g, s):
        """:meth:`h_replay` of graph state ``g`` on its stream's state ``s``."""
        gid = g.id
        reads = None
        for st in g.sstates:                # sources whose marks may carry a failure
            if st.mark is not CLEAN:
                reads = self._marked_sources(g)
                break
        graph = g.graph
        mark = Mark(g.op, None, (), s, s.pos + 1)
        try:
            if s.window is not None:
                self.capture.on_event(s, f"replay of graph {gid}")
            if g.freed:
                hid = g.freed[0]
                err = LivenessError(
                    f"replay of graph {gid} on stream {int(s.id)} uses handle {hid}, which was "
                    "freed: keep the Handle alive while the graph replays (or allocate it inside "
                    "the capture window, or use runtime.capture, so the graph retains it)")
                err.handle, err.graph = hid, gid
                if self.checker is not None:
                    self.checker.record(err)
                raise err
            if g.fences:                    # once: the stream's waits (``synced``) remain
                self._wait_for(s, g.fences)
                g.fences = {}
            if self.checker is not None:
                self.checker.on_replay(s, g)
            if reads:
                self.marks.inherit(mark, reads)
            kept = None
            if g.mstates:                   # written only inside conditional nodes
                kept, pending = self._kept_marks(g)
                for st, old in pending:     # fails if its last writer or this replay does
                    m = Mark(mark.op, None, (), s, mark.pos)
                    self.marks.inherit(m, [(st.id, old), (st.id, mark)])
                    mark.also += (m,)       # finished with the replay (Mark.finished)
                    kept.append((st, m))
            room = self.backend.launch_graph(s.raw, graph, mark)
        except Exception as e:
            err = e if isinstance(e, ServerError) else UnsupportedError(
                f"replay of graph {gid} failed on {self.backend.name}: {e}")
            mark.error = err
            for st in g.wstates:
                st.mark = mark
            raise err from (None if err is e else e)
        s.pos += 1
        g.last_pos = s.pos
        for st in g.wstates:
            st.mark = mark
        if kept:
            for st, m in kept:
                st.mark = m
        return room is not False

    def _kept_marks(self, g) -> tuple:
        """For the buffers graph ``g`` writes only inside conditional nodes
        (``GraphState.mstates``): a replay may not write them (the branch is decided on the
        device), so a failure of their last writer outlives it. Returns ``(kept, pending)``:
        ``kept`` = ``[(handle state, mark)]`` of failed marks, left in place after the replay;
        ``pending`` = ``[(handle state, mark)]`` of marks that may still fail: an enqueued
        replay gives such a buffer a mark of its own that fails if either that mark or the
        replay's does (finished with the replay, so chains stay short: ``Mark.also``); a replay
        run at once leaves them in place."""
        kept, pending = [], []
        clobbers = g.clobbers
        for st in g.mstates:
            if clobbers and st in clobbers:     # another handle on a buffer it rewrites
                kept.append((st, clobbers[st]))
                continue
            old = st.mark
            if old is CLEAN or self.marks.clean(st):
                continue
            if old._error is not None:
                kept.append((st, old))
            else:
                pending.append((st, old))
        return kept, pending

    def _pool_aliases(self, gp) -> None:
        """Give each graph of graph pool ``gp`` the live handles outside it that share a buffer
        it writes (``GraphState.clobbers``): a window of the pool that takes another graph's
        temporary (``GraphPool.take``) and keeps the handle (an output) holds a buffer that
        graph's replays rewrite. Such a replay leaves the handle marked with a
        ``GraphStateError`` (a read raises ``ReplayFailed`` naming the graph, launches reading
        it inherit) until it is written again (its own graph's replay, a launch, a host
        write), instead of reading back the other graph's temporaries with no error (ADV7).
        Capture-time only (a window takes from the pool, a graph joins it, an update or
        instance changes what it writes): one pass over the handles; a graph with clobbers is
        not deferred (``GraphState.set_defer``). Kept as long as the handles live."""
        live: dict = {}
        for st in self.handles.values():
            if st.slot.graph_pool is gp:
                live.setdefault(id(st.slot), []).append(st)
        for gid in gp.graphs:
            g = self.graphs.get(gid)
            if g is None:
                continue
            old, new = g.clobbers, {}
            if live:
                mine = {st.id for st in g.handles}
                for ws in g.wstates:
                    for st in live.get(id(ws.slot), ()):
                        if st.id not in mine:
                            m = old.get(st)
                            if m is None:
                                m = Mark(("pool", f"replay of graph {g.id}, which rewrites its "
                                                  f"buffer (a temporary of graph pool {gp.id})"),
                                         GraphStateError(
                                    f"handle {st.id} was allocated in a capture window of graph "
                                    f"pool {gp.id} on a buffer graph {g.id} of the pool uses as "
                                    f"a temporary, and a replay of graph {g.id} overwrote it; "
                                    "read a pool graph's outputs right after its replay, before "
                                    "another graph of the pool replays, or allocate outputs "
                                    "before graph_prepare (runtime.capture does)"))
                            new[st] = m
            if new or old:
                g.mstates = [st for st in g.mstates if st not in old] + list(new)
                g.clobbers = new
                g.set_defer()

    @staticmethod
    def _marked_sources(g) -> list:
        """``[(handle id, Mark)]`` of the sources of graph ``g`` (buffers it reads before it
        writes them) whose marks may carry a failure: marks known final and clean (their
        stream ran past them, or the backend said they ran: ``Mark.ran``) are skipped."""
        reads = []
        for st in g.sstates:                # (Marks.clean's test, inlined: every replay; read
            m = st.mark                     # in its order, Mark.settled: error last)
            if m is CLEAN:
                continue
            if (m.parents or m.stream is None or m.pos > m.stream.done_pos and not m.ran
                    or m._error is not None):
                reads.append((st.id, m))
            else:
                st.mark = CLEAN                 # final and clean: the cheap test next time
        return reads

    def h_graph_destroy(self, gid: int) -> None:
        """Destroy graph ``gid`` after the work enqueued on its stream; unknown id: no-op.

        Its buffers carry the fence of its last replay to their next owner; slots it pinned
        whose handles were freed go back to the pool now (with that fence)."""
        g = self.graphs.pop(gid, None)
        if g is None:
            return
        s = self.streams[g.stream]
        s.graphs -= 1
        if not self.capture.on_destroy(s, g.graph):
            self.backend.destroy_graph(s.raw, g.graph)
        for st in g.handles:              # O(1) each: destroying N graphs is linear in N
            if st.graphs.pop(g, 0) is None:
                merge(st.replayed, {g.stream: g.last_pos})
        fence = {g.stream: s.pos}
        gp = self.graph_pool_of.pop(gid, None)
        if gp is not None:
            gp.graphs.discard(gid)
        for slot in g.retained:
            slot.pins -= 1
            if slot.pins == 0 and slot.graph_pool is not None:
                slot.graph_pool.drop(slot)      # no graph of its pool retains it any more
            if slot.orphan and slot.pins == 0:
                f = dict(slot.fences)
                merge(f, fence)
                self.pool.give(slot, f)
            elif slot.orphan and slot.graph_pool is not None and (
                    self._shareable(slot, slot.graph_pool)):    # (what kept it unshared went)
                merge(slot.fences, fence)
                slot.graph_pool.give(slot)
        if gp is not None and not gp.graphs and gp.id in self.released_pools:
            self.released_pools.discard(gp.id)
            self.graph_pools.pop(gp.id, None)
        if self.pool.idle_bytes > self.pool.max_idle:
            self._trim(self.pool.max_idle)
        if self.checker is not None:
            self.checker.on_graph_destroy(g)
        if not s.graphs and s.id in self.ended:
            self._reap(s.id)
        return 1 + len(g.handles) // 8    # its cost in a batch of releases (queue.release)

    # -- graphs that change (graphs.py) ---------------------------------------------------------
    def _graph(self, gid: int, what: str):
        g = self.graphs.get(gid)
        if g is None:
            raise UnknownGraph(f"{what} of graph {gid}: unknown or already destroyed on server "
                               f"{self.name}; keep a Graph clone alive while you use it")
        return g

    def h_graph_launches(self, gid: int) -> list:
        """``Graph.launches()``: the recorded launches as plain data (``graphs.launches``)."""
        return graphs.launches(self._graph(gid, "launches"), self)

    def h_graph_describe(self, gid: int) -> dict:
        """``Graph.describe()`` (``graphs.describe``)."""
        return graphs.describe(self._graph(gid, "describe"), self)

    def h_graph_update(self, gid: int, rebind: dict, params: dict, count: dict):
        """``Graph.update``: patch graph ``gid`` for the replays enqueued after it, all or
        nothing (``graphs.update``); returns its ``fallback_reason``."""
        g = self._graph(gid, "update")
        graphs.update(self, g, rebind, params, count)
        gp = self.graph_pool_of.get(gid)
        if gp is not None and self.graphs.get(gid) is g:   # (its sets were rebuilt)
            self._pool_aliases(gp)
        return g.fallback_reason

    def h_graph_instantiate(self, gid: int, rebind: dict, sid) -> tuple:
        """``Graph.instantiate``: a new graph from the recording of ``gid`` against other
        buffers; returns ``(graph id, stream id, is_hardware)``.

        An instance that keeps buffers of ``gid``'s graph pool (temporaries the pool's graphs
        share, not rebound) joins that pool: its replays rewrite them like any graph of the
        pool, so it must replay in order with them, on the pool's stream. Raises
        ``GraphStateError`` for such an instance on another stream (nothing made)."""
        g = self._graph(gid, "instantiate")
        gp = self.graph_pool_of.get(gid)
        if gp is not None:
            shared = {st.id for st in g.handles if id(st.slot) in gp.slots}
            shared -= set(rebind or ())
            target = g.stream if sid is None else int(sid)
            if not shared:
                gp = None
            elif gp.stream is not None and target != gp.stream:
                raise GraphStateError(
                    f"instantiate of graph {gid} on stream {target}: it would keep buffers "
                    f"{sorted(shared)[:8]} of graph pool {gp.id}, which the pool's graphs share "
                    f"and rewrite in order on stream {int(gp.stream)}; instantiate on that "
                    "stream, or rebind those buffers to handles of your own")
        ng = graphs.instantiate(self, g, rebind, next(_graph_ids),
                                None if sid is None else int(sid))
        self.graphs[ng.id] = ng
        ng.sstate = self.streams[ng.stream]
        ng.sstate.graphs += 1
        if gp is not None:                      # it rewrites the pool's buffers: a member
            gp.graphs.add(ng.id)
            self.graph_pool_of[ng.id] = gp
            self._pool_aliases(gp)
        if self.checker is not None:
            self.checker.on_graph(ng)
        return ng.id, ng.stream, bool(self.backend.hardware_graphs)

    def h_cond_begin(self, sid, kind: str, hid: int, max_iterations, dtype: str = "i32") -> bool:
        """Open a ``capture_if``/``capture_while`` node in ``sid``'s window; False when ``sid``
        is not capturing (the client runs it eagerly)."""
        return graphs.cond_begin(self, self._stream(sid), kind, hid, max_iterations, dtype)

    def h_position(self, sid) -> int:
        """The position of stream ``sid`` (operations enqueued on it so far)."""
        return self._stream(sid).pos

    def h_written_since_failed(self, sid, since: int, err) -> None:
        """An eager ``capture_while`` on ``sid`` stopped at its limit with ``err`` (or early, by
        an error: ``ComputeClient._stopped_loop``): mark every
        buffer written on ``sid`` after position ``since`` (what the loop wrote) as written by
        the failed loop, as a replay's write set is (``ReplayFailed`` on read until a later
        write lands), the write sets of graphs the loop replayed on ``sid`` included (a replay
        does not update ``HandleState.writes``: before ADV7 a body of ``g.replay()`` left
        ``g``'s outputs with the truncated values and no error). Walks the handle and graph
        tables: only on this failure."""
        states = {id(st): st for st in self.handles.values()
                  if st.writes.get(sid, -1) > since or st.replayed.get(sid, -1) > since}
        for g in self.graphs.values():
            if g.stream == sid and g.last_pos > since:
                states.update((id(st), st) for st in g.wstates)
        self.marks.fail(list(states.values()), ("loop", f"capture_while on stream {int(sid)}"),
                        err)

    def h_cond_else(self, sid) -> None:
        graphs.cond_else(self, self._stream(sid))

    def h_cond_end(self, sid, error=None) -> None:
        graphs.cond_end(self, self._stream(sid), error)

    # -- introspection --------------------------------------------------------------------------
    def h_memory_usage(self) -> dict:
        """Pool bytes reserved from the device, handed to live handles and idle; counts of
        handles, graphs and streams (runs every pending release and reclaims unnamed streams
        first, so the counts are of live objects)."""
        self.queue.run_releases()
        if self.ended:
            self._reap_streams()
        self.marks.collect()              # errors waiting for a blocking call: bounded
        self._bound_async_errors()
        graph_bytes = sum(sl.nbytes for sl in {id(sl): sl for g in self.graphs.values()
                                                for sl in g.alloc_slots}.values())
        return {"bytes_reserved": self.pool.bytes_reserved, "bytes_in_use": self.pool.bytes_in_use,
                "bytes_idle": self.pool.idle_bytes, "handles": len(self.handles),
                "graphs": len(self.graphs), "streams": len(self.streams),
                "graph_bytes": graph_bytes,
                "graph_pools": {pid: gp.usage() for pid, gp in self.graph_pools.items()}}

    def h_graph_memory(self, gid: int) -> dict:
        """``Graph.memory_usage()``: ``{"nbytes": what graph gid keeps alive, "own_bytes": its
        window's buffers no graph pool shares, "pool": the pool id or None, "pool_bytes": the
        pool's shared bytes, "pool_share": pool_bytes / its graphs, "used_bytes": the bytes of
        every buffer it binds, caller-owned ones included}`` (bytes; ``nbytes`` =
        ``own_bytes + pool_share``). Raises ``UnknownGraph``."""
        g = self._graph(gid, "memory_usage")
        gp = self.graph_pool_of.get(gid)
        own = sum(sl.nbytes for sl in {id(sl): sl for sl in g.alloc_slots}.values()
                  if sl.graph_pool is None)
        share = gp.bytes // max(1, len(gp.graphs)) if gp is not None else 0
        used = sum(st.nbytes for st in {id(st): st for st in g.handles}.values())
        return {"nbytes": own + share, "own_bytes": own, "pool": None if gp is None else gp.id,
                "pool_bytes": 0 if gp is None else gp.bytes, "pool_share": share,
                "used_bytes": used}

    def h_graph_pool_usage(self, pool_id: int) -> dict:
        """``GraphPool.memory_usage()`` (``memory.GraphPool.usage``); an unused pool: zeros."""
        gp = self.graph_pools.get(pool_id)
        return (gp or GraphPool(pool_id)).usage()

    def h_graph_pool_release(self, pool_id: int) -> None:
        """The last reference to a ``runtime.GraphPool`` was dropped: forget it once its graphs
        are gone (the table stays bounded by live pools)."""
        gp = self.graph_pools.get(pool_id)
        if gp is None:
            return
        if gp.graphs:
            self.released_pools.add(pool_id)
        else:
            del self.graph_pools[pool_id]

    def h_graph_info(self, gid: int) -> dict:
        g = self.graphs.get(gid)
        if g is None:
            raise UnknownGraph(f"graph {gid} is unknown or destroyed on server {self.name}")
        return {"id": gid, "stream": g.stream, "launches": g.launches, "reads": sorted(g.reads),
                "writes": sorted(g.writes), "retained": g.allocated,
                "pinned": len(g.retained)}

    # -- lifetime -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the server: queued work runs, then the backend closes; later calls and every
        waiting caller get ``ServerClosed``; the first of them also gets the errors still
        queued then (on streams, unattributed, in the backend): never dropped. Idempotent."""
        self.queue.close(self._close)

    def _close(self) -> None:
        """The last message: close the backend, then hand every error still queued to the
        queue's next ``ServerClosed`` (``DeviceQueue.leftover``)."""
        try:
            self.backend.close()
        finally:
            left = list(self.marks.async_errors)
            self.marks.async_errors = []
            for s in self.streams.values():
                left += s.errors
                s.errors = []
                raw = getattr(s.raw, "errors", None)     # found at execution, not reported yet
                while raw:
                    left.append(raw.popleft() if hasattr(raw, "popleft") else raw.pop(0))
            left += self.backend.take_failures()
            self.queue.leftover = left

    @property
    def closed(self) -> bool:
        return self.queue.closed
