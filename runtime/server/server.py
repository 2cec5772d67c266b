"""The per-device compute server: the handle, stream and graph tables, and every policy.

Each ``h_*`` method is one message handler; it runs on the single owner of the server (the
device thread, or a caller on the combining fast path, see ``queue.py``) and is the only code
that touches the tables or the backend. Policy lives here once for every backend (style.md
section 2): cross-stream ordering of ordinary operations, the capture window's refusals,
retention of window allocations, queued errors, the replay-failure mark on a graph's write set.

Positions: each stream counts the operations it executed (``StreamState.pos``). A handle keeps
``writes`` and ``reads`` as ``{stream id: position}``; a use on stream B waits on an event of
stream A recorded at or after A's position when A != B (CUDA ``cudaStreamWaitEvent``). Replays
update none of this: by contract (seed 001) a replay orders only against its capture stream.
"""

from __future__ import annotations

import itertools

from ..backends.base import Completion
from ..client.stream import watch_thread_ends
from ..errors import (CaptureRefused, InvalidHandle, LaunchError, OutOfMemory, ReplayFailed,
                      ServerError, UnknownGraph, UnsupportedError, unhealthy)
from . import capture as cap
from .memory import Pool
from .queue import DeviceQueue

_graph_ids = itertools.count(1)


class StreamState:
    """Server-side state of one logical stream."""

    __slots__ = ("id", "raw", "pos", "synced", "event", "event_pos", "errors", "state",
                 "window", "primed")

    def __init__(self, sid, raw):
        self.id, self.raw = sid, raw
        self.pos = 0                  # operations executed (enqueued to the backend) so far
        self.synced: dict = {}        # other stream id -> position this stream already waited for
        self.event, self.event_pos = None, -1
        self.errors: list = []        # queued errors of fire-and-forget work
        self.state = cap.NO_CAPTURE
        self.window: cap.Window | None = None
        self.primed: list = []        # slots freed during warm-up, held until start_capture


class HandleState:
    """Server-side state of one handle: its pooled slot and its access history."""

    __slots__ = ("id", "slot", "nbytes", "writes", "reads", "error", "graphs", "stream")

    def __init__(self, hid, slot, nbytes, stream):
        self.id, self.slot, self.nbytes, self.stream = hid, slot, nbytes, stream
        self.writes = dict(slot.fences)  # a reused buffer inherits its earlier uses as writes
        self.reads: dict = {}
        self.error = None                # (graph id, cause) of a failed replay writing it
        self.graphs: list = []           # GraphStates that use it


class GraphState:
    """Server-side state of one captured graph."""

    __slots__ = ("id", "stream", "graph", "reads", "writes", "retained", "failed", "last_pos",
                 "launches", "handles")

    def __init__(self, gid, stream, graph, reads, writes, retained, launches):
        self.id, self.stream, self.graph = gid, stream, graph
        self.reads, self.writes = frozenset(reads), frozenset(writes)
        self.retained = retained        # slots allocated in the window, pinned until destroy
        self.failed = False
        self.last_pos = 0               # capture-stream position of the last replay
        self.launches = launches
        self.handles: list = []


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

    Streams: the default stream of a thread that ended is reclaimed (server and backend) once
    its work is done and no graph or capture uses it; stream ids are never reused.
    """

    def __init__(self, backend, name: str, check: bool = False, max_idle_bytes: int | None = None):
        self.backend = backend
        self.name = name
        self.pool = Pool(backend, max_idle_bytes)
        self.streams: dict = {}
        self.ended: set = set()        # default streams of ended threads, not yet reclaimed
        self.handles: dict = {}
        self.graphs: dict = {}
        self.windows: dict = {}        # stream id -> open capture Window (frees check these)
        self.programs: dict = {}
        self.async_errors: list = []
        self.checker = None
        if check:
            from .checker import Checker
            self.checker = Checker(self)
        self.queue = DeviceQueue(name, self._on_async_error, backend.is_alive, backend.load)
        backend.on_room = self.queue.notify_room
        watch_thread_ends(self)
        self.submit = self.queue.submit
        self.post = self.queue.post
        self.call = self.queue.call
        self.wait = self.queue.wait

    # -- helpers ------------------------------------------------------------------------------
    def _stream(self, sid) -> StreamState:
        s = self.streams.get(sid)
        if s is None:
            if self.ended:
                self._reap_streams()
            s = self.streams[sid] = StreamState(sid, self.backend.new_stream())
        return s

    def thread_ended(self, sid) -> None:
        """The thread whose default stream is ``sid`` ended (called on that thread, by
        ``runtime.client.stream``): queue its reclamation. Never blocks."""
        self.post(self.h_stream_ended, sid)

    def h_stream_ended(self, sid) -> None:
        """Reclaim ``sid`` now if its work is done, else at a later message."""
        if sid in self.streams:
            self.ended.add(sid)
            self._reap_streams()

    def _reap_streams(self) -> None:
        """Drop every ended thread's stream whose work is done, from the server's table and the
        backend's (``release_stream``); a stream a graph, window or warm-up still uses stays."""
        busy = {g.stream for g in self.graphs.values()}
        for sid in list(self.ended):
            s = self.streams.get(sid)
            if s is None:
                self.ended.discard(sid)
                continue
            if (sid in busy or s.state != cap.NO_CAPTURE or s.window is not None or s.primed
                    or not self.backend.release_stream(s.raw)):
                continue
            del self.streams[sid]
            self.ended.discard(sid)
            for other in self.streams.values():
                other.synced.pop(sid, None)

    def _collect_failures(self) -> None:
        """Attribute the backend's ``LaunchFailure`` records: each error goes to the stream that
        enqueued the launch (never another), naming the graph for a replay, and marks the
        handles the launch would have written (``ReplayFailed`` on read)."""
        failures = self.backend.take_failures()
        if not failures:
            return
        by_raw = {id(st.raw): st for st in self.streams.values()}
        for f in failures:
            gid = next((g.id for g in self.graphs.values() if g.graph is f.graph), None)
            err = f.error
            if gid is not None:
                err = type(err)(f"{err} (in a replay of graph {gid}: the dispatch did not run)")
            s = by_raw.get(id(f.stream))
            if f.reported:
                pass                      # the backend raises it on its stream itself
            elif s is not None:
                s.errors.append(err)
            else:
                self.async_errors.append(err)
            written = {id(b) for b in f.written}
            fsid = s.id if s is not None else None
            for st in self.handles.values():
                if id(st.slot.buf) not in written:
                    continue
                if f.pos is not None and (st.writes.get(fsid, -1) > f.pos or (
                        gid is None and st.writes.get(fsid) != f.pos)):
                    continue                  # a later write was enqueued after it
                st.error = (gid, err)

    def _on_async_error(self, exc) -> None:
        # a fire-and-forget handler raised past its own error handling: report at the next drain
        self.async_errors.append(exc if isinstance(exc, ServerError)
                                 else ServerError(f"internal error in a queued message: {exc!r}"))

    def _drain_errors(self, s: StreamState) -> None:
        """Raise the errors queued on ``s`` (and unattributed ones) together, emptying the queue."""
        self._collect_failures()
        if s.errors or self.async_errors:
            errs = s.errors + self.async_errors
            s.errors, self.async_errors = [], []
            raise unhealthy(errs)

    def _handle(self, s: StreamState, hid: int, what: str):
        st = self.handles.get(hid)
        if st is None:
            err = InvalidHandle(f"{what}: handle {hid} is unknown or freed on server {self.name}; "
                                "keep the Handle alive while it is in use")
            s.errors.append(err)
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
                s.errors.append(e)
                return None
            except Exception as e:  # noqa: BLE001 - a backend compiler's own exception type
                s.errors.append(LaunchError(f"kernel {kernel.name} failed to compile on "
                                            f"{self.backend.name}: {e}"))
                return None
            self.programs[kernel] = prog
        return prog

    def _release_slot(self, st: HandleState, extra_fences=None) -> None:
        fences = dict(st.writes)
        for sid, pos in st.reads.items():
            if fences.get(sid, -1) < pos:
                fences[sid] = pos
        for g in st.graphs:            # replays that may still use it (see module doc)
            if fences.get(g.stream, -1) < g.last_pos:
                fences[g.stream] = g.last_pos
            g.handles.remove(st)
        st.graphs = []
        if extra_fences:
            fences.update(extra_fences)
        slot = st.slot
        if slot.pins:
            slot.orphan = True
            slot.fences = fences
        else:
            self.pool.give(slot, fences)
            if self.pool.idle_bytes > self.pool.max_idle:
                self._trim(self.pool.max_idle)

    # -- memory ---------------------------------------------------------------------------------
    def _trim(self, keep: int) -> int:
        """Give idle pool buffers back to the device until at most ``keep`` idle bytes remain;
        returns the bytes freed. Nothing while a stream is prepared or capturing (the warm pool
        is what the recorded run allocates from)."""
        if self.windows or any(st.state != cap.NO_CAPTURE for st in self.streams.values()):
            return 0
        return self.pool.trim(keep)

    def h_empty_cache(self) -> int:
        """Free every idle pool buffer to the device (``torch.cuda.empty_cache``); returns the
        bytes given back (0 while a stream is prepared or capturing)."""
        return self._trim(0)

    def h_alloc(self, sid, hid: int, nbytes: int, data) -> None:
        """``create`` / ``empty``: reserve a pooled buffer for ``hid``; write ``data`` if given.
        On ``OutOfMemory`` the idle pool is given back to the device and the allocation retried
        once before the error is queued on the stream."""
        s = self._stream(sid)
        try:
            try:
                slot, fresh = self.pool.take(nbytes)
            except OutOfMemory:
                if not self._trim(0):
                    raise
                slot, fresh = self.pool.take(nbytes)
        except ServerError as e:
            s.errors.append(e)
            return
        st = self.handles[hid] = HandleState(hid, slot, nbytes, sid)
        w = s.window
        if w is not None:
            w.allocs.append(st)
            if fresh and self.backend.hardware_graphs:
                w.refusals.append(f"handle {hid} ({nbytes} bytes) was allocated inside the window "
                                  "and grew the pool: a hardware graph cannot hold a memory node; "
                                  "run the work once after graph_prepare() so the pool is warm")
        if data is not None:
            self.h_write(sid, hid, data)

    def h_free(self, sid, hid: int) -> None:
        """Free ``hid`` into the pool (the last ``Handle`` drop or ``release()``)."""
        st = self.handles.pop(hid, None)
        if st is None:
            return
        if self.checker is not None:
            self.checker.on_free(st)
        for wsid, w in self.windows.items():   # a capture window that uses it keeps it alive
            allocated = any(a is st for a in w.allocs)
            if allocated or w.uses(hid):
                if not allocated:
                    w.refusals.append(f"handle {hid} was freed while the window on stream "
                                      f"{wsid} uses it; keep it alive until stop_capture()")
                w.deferred.append(st)
                return
        s = self.streams.get(sid)
        if s is not None and s.state == cap.PREPARE:
            s.primed.append(st)                # held until start_capture (warm-up priming)
            return
        self._release_slot(st)

    # -- copies ---------------------------------------------------------------------------------
    def h_write(self, sid, hid: int, data) -> None:
        """In-place host-to-device copy on stream ``sid`` (``data``: a private uint8 array)."""
        s = self._stream(sid)
        st = self._handle(s, hid, "write")
        if st is None:
            return
        if s.window is not None:
            s.window.refusals.append(f"write to handle {hid} inside the capture window (a graph "
                                     "cannot record a host write; it was not applied)")
            return
        self._wait_for(s, st.writes)
        self._wait_for(s, st.reads)
        if self.checker is not None:
            self.checker.on_access(s, st, "write", True)
        try:
            self.backend.copy_in(s.raw, st.slot.buf, data)
        except ServerError as e:              # queued on the stream like any fire-and-forget error
            s.errors.append(e)
            return
        s.pos += 1
        st.writes = {sid: s.pos}
        st.reads = {}

    def h_read(self, sid, hid: int) -> Completion:
        """Device-to-host copy of ``hid``; returns the completion the caller waits on.

        Raises: ``CaptureRefused`` (capturing stream), ``InvalidHandle``, ``ReplayFailed``
        (a failed replay wrote it), ``ServerUnhealthy`` (queued errors of this stream).
        """
        s = self._stream(sid)
        if s.window is not None:
            raise CaptureRefused(f"read of handle {hid} on stream {sid}: the stream is recording a "
                                 "graph; read after stop_capture() or from another stream")
        st = self.handles.get(hid)
        if st is None:
            raise InvalidHandle(f"read: handle {hid} is unknown or freed on server {self.name}")
        self.backend.flush(s.raw)           # failures of its batch surface now, on this stream
        self._collect_failures()
        if st.error is not None and st.error[0] is None:
            raise ReplayFailed(f"read of handle {hid}: the last launch that writes it did not run "
                               f"({st.error[1]}); it holds stale data until a later write lands",
                               st.error[1])
        if st.error is not None:
            gid, cause = st.error
            raise ReplayFailed(f"read of handle {hid}: the last replay of graph {gid}, which writes "
                               f"it, failed ({cause}); it holds stale data until a replay of "
                               f"graph {gid} lands", cause)
        self._drain_errors(s)
        self._wait_for(s, st.writes)
        if self.checker is not None:
            self.checker.on_access(s, st, "read", False)
        comp = self.backend.copy_out(s.raw, st.slot.buf, st.nbytes)
        s.pos += 1
        st.reads[sid] = s.pos
        if self.checker is not None:
            self.checker.on_sync(s)     # the read returns only once s ran up to it
        return comp

    # -- kernels --------------------------------------------------------------------------------
    def h_launch(self, sid, kernel, count, hids, params) -> None:
        """Enqueue (or, inside a window, record) one launch of ``kernel`` on stream ``sid``.

        ``count`` is ``(x, y, z)`` workgroups or a handle id (indirect: three u32 read at run).
        """
        s = self._stream(sid)
        prog = self._program(s, kernel)
        if prog is None:
            return
        states = []
        for hid in hids:
            st = self._handle(s, hid, f"launch of {kernel.name}")
            if st is None:
                return
            states.append(st)
        cst = None
        if not isinstance(count, tuple):
            cst = self._handle(s, count, f"indirect launch of {kernel.name}")
            if cst is None:
                return
            count = (cst.slot.buf, cst.nbytes)
        args = [(st.slot.buf, st.nbytes) for st in states]
        w = s.window
        try:
            if w is not None:
                self.backend.record_launch(w.recording, prog, count, args, params)
                w.launches += 1
                for b, st in zip(kernel.bindings, states):
                    (w.reads if b.access == "read" else w.writes).add(st.id)
                    if b.access != "read":
                        w.reads.add(st.id)
                if cst is not None:
                    w.reads.add(cst.id)
                return
            for b, st in zip(kernel.bindings, states):
                self._wait_for(s, st.writes)
                if b.access != "read":
                    self._wait_for(s, st.reads)
            if cst is not None:
                self._wait_for(s, cst.writes)
            if self.checker is not None:
                for b, st in zip(kernel.bindings, states):
                    self.checker.on_access(s, st, kernel, b.access != "read")
            self.backend.issue_pos = s.pos + 1      # carried by a LaunchFailure, if any
            self.backend.launch(s.raw, prog, count, args, params)
        except ServerError as e:
            s.errors.append(e)
            return
        except Exception as e:  # noqa: BLE001 - a device API's own exception type
            s.errors.append(LaunchError(f"launch of {kernel.name} on stream {sid} failed: {e}"))
            return
        s.pos += 1
        pos = s.pos
        for b, st in zip(kernel.bindings, states):
            if b.access == "read":
                st.reads[sid] = pos
            else:
                st.writes = {sid: pos}
                st.reads = {}
                st.error = None               # a later write replaces a failed one's mark
        if cst is not None:
            cst.reads[sid] = pos

    # -- synchronisation ------------------------------------------------------------------------
    def h_sync(self, sid) -> Completion:
        """Completion of everything enqueued on ``sid``; raises its queued errors first."""
        s = self._stream(sid)
        if s.window is not None:
            raise CaptureRefused(f"sync on stream {sid}: the stream is recording a graph; "
                                 "sync after stop_capture()")
        self.backend.flush(s.raw)
        self._drain_errors(s)
        if self.checker is not None:
            self.checker.on_sync(s)
        return self.backend.synchronize(s.raw)

    def h_flush(self, sid) -> None:
        """Hand batched work to the device and raise queued errors (not refused in a window:
        window refusals are reported by ``stop_capture``)."""
        s = self._stream(sid)
        self.backend.flush(s.raw)
        self._drain_errors(s)

    def h_record_event(self, sid):
        """An event on ``sid`` after its work so far (for ``ComputeClient.record_event``)."""
        s = self._stream(sid)
        if s.window is not None:
            raise CaptureRefused(f"record_event on stream {sid}: the stream is recording a graph")
        ev, pos = self._event_at(s, s.pos)
        return (sid, pos)

    def h_wait_event(self, sid, token) -> None:
        """Make ``sid`` wait for an event token from ``h_record_event``."""
        src_id, pos = token
        s = self._stream(sid)
        self._wait_for(s, {src_id: pos})
        if self.checker is not None:
            self.checker.on_event_wait(s, src_id, pos)

    # -- capture --------------------------------------------------------------------------------
    def h_graph_prepare(self, sid) -> None:
        """``NO_CAPTURE -> PREPARE`` and arm warm-up priming (see ``capture.py``)."""
        s = self._stream(sid)
        s.state = cap.transition(s.state, "prepare", sid)

    def h_start_capture(self, sid) -> None:
        """``PREPARE -> CAPTURE``: drain warm-up errors, release primed buffers, open a recording.

        Raises: ``GraphStateError`` (out of order, unchanged); ``ServerUnhealthy`` (the warm-up
        left errors: the stream goes back to ``NO_CAPTURE``); ``UnsupportedError``.
        """
        s = self._stream(sid)
        new_state = cap.transition(s.state, "begin", sid)
        self._release_primed(s)
        if s.errors or self.async_errors:
            s.state = cap.NO_CAPTURE
            self._drain_errors(s)
        ev, epos = self._event_at(s, s.pos)
        try:
            recording = self.backend.begin_graph(s.raw)
        except ServerError:
            s.state = cap.NO_CAPTURE
            raise
        s.window = self.windows[sid] = cap.Window(recording, ev, epos)
        s.state = new_state

    def _release_primed(self, s: StreamState) -> None:
        primed, s.primed = s.primed, []
        for st in primed:
            self._release_slot(st)

    def h_stop_capture(self, sid) -> tuple:
        """``CAPTURE -> NO_CAPTURE``; returns ``(graph id, is_hardware)``.

        Raises: ``GraphStateError`` (nothing recording, unchanged); ``CaptureRefused`` naming the
        late refusals (no graph is made); ``ServerUnhealthy`` (errors queued in the window).
        """
        s = self._stream(sid)
        s.state = cap.transition(s.state, "end", sid)
        w, s.window = s.window, None
        del self.windows[sid]
        try:
            if w.refusals or s.errors:
                self.backend.abort_graph(w.recording)
                if w.refusals:
                    s.errors = []
                    raise CaptureRefused(f"stop_capture on stream {sid}: the window was refused, "
                                         "no graph was made: " + "; ".join(w.refusals))
                self._drain_errors(s)
            graph = self.backend.end_graph(w.recording)
        except BaseException:
            for st in w.deferred:
                self._release_slot(st)
            raise
        gid = next(_graph_ids)
        retained = []
        for st in w.allocs:
            st.slot.pins += 1
            retained.append(st.slot)
        g = GraphState(gid, sid, graph, w.reads, w.writes, retained, w.launches)
        for hid in g.reads | g.writes:
            st = self.handles.get(hid)
            if st is not None:
                st.graphs.append(g)
                g.handles.append(st)
        for st in w.deferred:
            self._release_slot(st)
        self.graphs[gid] = g
        if self.checker is not None:
            self.checker.on_graph(g)
        return gid, bool(self.backend.hardware_graphs)

    def h_replay(self, gid: int) -> None:
        """Enqueue one replay of graph ``gid`` on its capture stream; returns once enqueued.

        Raises: ``UnknownGraph``; ``CaptureRefused`` (its stream is capturing); the backend's
        refusal. Any failure also marks the graph's write set (``ReplayFailed`` on read) until a
        replay of this graph lands.
        """
        g = self.graphs.get(gid)
        if g is None:
            raise UnknownGraph(f"replay of graph {gid}: unknown or already destroyed on server "
                               f"{self.name}; keep a Graph clone alive while you replay it")
        s = self.streams[g.stream]
        try:
            if s.window is not None:
                raise CaptureRefused(f"replay of graph {gid} on stream {g.stream}: the stream is "
                                     "recording a graph; replay after stop_capture()")
            if self.checker is not None:
                self.checker.on_replay(s, g)
            self.backend.issue_pos = s.pos + 1
            self.backend.launch_graph(s.raw, g.graph)
        except Exception as e:
            err = e if isinstance(e, ServerError) else UnsupportedError(
                f"replay of graph {gid} failed on {self.backend.name}: {e}")
            self._mark_failed(g, err)
            raise err from (None if err is e else e)
        s.pos += 1
        g.last_pos = s.pos
        if g.failed:
            g.failed = False
            for st in g.handles:
                if st.error is not None and st.error[0] == gid:
                    st.error = None
        self._collect_failures()       # dispatches of this replay refused at submit

    def _mark_failed(self, g: GraphState, err) -> None:
        g.failed = True
        for st in g.handles:
            if st.id in g.writes:
                st.error = (g.id, err)

    def h_graph_destroy(self, gid: int) -> None:
        """Destroy graph ``gid`` after the work enqueued on its stream; unknown id: no-op."""
        g = self.graphs.pop(gid, None)
        if g is None:
            return
        s = self.streams[g.stream]
        self.backend.destroy_graph(s.raw, g.graph)
        for st in g.handles:
            st.graphs.remove(g)
            if st.error is not None and st.error[0] == gid:
                st.error = None
        fence = {g.stream: s.pos}
        for slot in g.retained:
            slot.pins -= 1
            if slot.orphan and slot.pins == 0:
                f = dict(slot.fences)
                f.update(fence)
                self.pool.give(slot, f)
        if self.pool.idle_bytes > self.pool.max_idle:
            self._trim(self.pool.max_idle)
        if self.checker is not None:
            self.checker.on_graph_destroy(g)
        if self.ended:
            self._reap_streams()

    # -- introspection --------------------------------------------------------------------------
    def h_memory_usage(self) -> dict:
        """Pool bytes reserved from the device, handed to live handles and idle; counts of
        handles, graphs and streams (reclaims ended threads' streams first)."""
        if self.ended:
            self._reap_streams()
        return {"bytes_reserved": self.pool.bytes_reserved, "bytes_in_use": self.pool.bytes_in_use,
                "bytes_idle": self.pool.idle_bytes, "handles": len(self.handles),
                "graphs": len(self.graphs), "streams": len(self.streams)}

    def h_graph_info(self, gid: int) -> dict:
        g = self.graphs.get(gid)
        if g is None:
            raise UnknownGraph(f"graph {gid} is unknown or destroyed on server {self.name}")
        return {"id": gid, "stream": g.stream, "launches": g.launches, "reads": sorted(g.reads),
                "writes": sorted(g.writes), "retained": len(g.retained)}

    # -- lifetime -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the server: queued work runs, then the backend closes; later calls and every
        waiting caller get ``ServerClosed``. Idempotent."""
        self.queue.close(self.backend.close)

    @property
    def closed(self) -> bool:
        return self.queue.closed
