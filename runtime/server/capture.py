"""The capture lifecycle and the window's hooks, written once for every backend.

States per stream (CubeCL ``stream/capture.rs``): ``NO_CAPTURE -> PREPARE -> CAPTURE -> NO_CAPTURE``.

- ``prepare`` (``graph_prepare``): from ``NO_CAPTURE`` only. Arms warm-up priming: buffers freed
  on this stream are held back from the pool until ``begin``, so the pool grows to the warm-up's
  working set and the recorded run finds every buffer it needs already allocated.
- ``begin`` (``start_capture``): from ``PREPARE`` only. The client first waits for the warm-up
  to finish; if it left errors (found at enqueue, at submit or at execution), ``begin`` raises
  ``ServerUnhealthy`` with them and aborts: nothing is recorded over a failed warm-up.
- ``record``: a launch on the capturing stream is added to the recording (not run).
- ``end`` (``stop_capture``): from ``CAPTURE`` only; makes the :class:`GraphState`.
- ``abort``: back to ``NO_CAPTURE`` from anywhere, unwinding the window (the backend recording
  is dropped, held buffers go back to the pool, deferred graph destroys run). Used by a refused
  or failed window, a failed ``begin`` and ``ComputeClient.abort_capture``.

Hooks (:class:`Capture` ``on_*``): every server handler that may meet an open window asks here
first: allocation, free, host write, record/wait event, replay, graph destroy.

Errors: a transition out of order raises ``GraphStateError`` and leaves the state untouched.
"""

from __future__ import annotations

from ..errors import CaptureRefused, GraphStateError, ServerUnhealthy, unhealthy
from .ops import CondRec, LaunchRec

NO_CAPTURE, PREPARE, CAPTURE = "no capture", "prepared", "capturing"


def transition(state: str, op: str, stream_id) -> str:
    """The state after ``op`` (``"prepare"``, ``"begin"``, ``"end"``) from ``state``.

    Raises:
        GraphStateError: the transition is out of order; nothing changed.
    """
    if op == "prepare":
        if state == NO_CAPTURE:
            return PREPARE
        why = "it is already prepared" if state == PREPARE else "a capture is already recording on it"
        raise GraphStateError(f"graph_prepare on stream {stream_id}: {why}; finish it with "
                              "start_capture()/stop_capture() first")
    if op == "begin":
        if state == PREPARE:
            return CAPTURE
        if state == NO_CAPTURE:
            raise GraphStateError(f"start_capture on stream {stream_id}: call graph_prepare() "
                                  "first, then run the work once as a warm-up")
        raise GraphStateError(f"start_capture on stream {stream_id}: a capture is already "
                              "recording on it; call stop_capture() first")
    if op == "end":
        if state == CAPTURE:
            return NO_CAPTURE
        raise GraphStateError(f"stop_capture on stream {stream_id}: no capture is recording on "
                              "it (call graph_prepare(), warm up, start_capture() first)")
    raise ValueError(op)


def merge(fences: dict, more: dict, skip=None) -> None:
    """Fold ``{stream id: position}`` ``more`` into ``fences`` (max per stream), except ``skip``."""
    for sid, pos in more.items():
        if sid != skip and fences.get(sid, -1) < pos:
            fences[sid] = pos


def surely_runs(op) -> bool:
    """Whether every replay runs launch ``op`` (an ``ops.LaunchRec``): outside conditional
    nodes, with a direct workgroup count none of whose dimensions is 0. A launch inside a node
    may be skipped, a zero count (``Graph.update(count=...)``) runs nothing, and an indirect
    count is read on the device, so it may be 0: such a launch may leave what it writes
    unwritten."""
    c = op.count
    return not op.scope and c.__class__ is tuple and bool(c[0] and c[1] and c[2])


def sources(ops, nbytes=None) -> frozenset:
    """Handle ids whose contents a graph of ``ops`` (``ops.LaunchRec``/``CondRec``, in recorded
    order) may read before it writes them: its inputs and its state (a buffer it reads and
    writes, a KV cache, an accumulator). A ``read`` or ``read_write`` binding, an indirect count
    or a condition reads; a ``write`` binding does not. A write hides the later reads in its
    own scope and the scopes nested in it (if the branch or loop body runs, the write ran
    before them: a loop body's temporaries are not state), but not reads after its
    conditional node or in another branch, and a write that may not run where it sits (a zero
    or indirect count) hides nothing; what both branches of an if with an else write hides
    the reads after the node (:func:`_both_branches`). A failure mark on a source marks what a replay writes
    (docs/contract.md section 4). (Before ADV6 only writes outside every node hid a read: a
    loop graph's temporaries counted as state, so a graph with a loop that failed once failed
    on every later replay, its state rewritten or not.)

    With ``nbytes`` (``{handle id: bytes}``) a write hides a later read only where it covers
    what that read touches (``Kernel.touched_bytes``: a declared element count, or what a
    workgroup count covers, is a prefix of the buffer; a binding declaring none touches all of
    it): a ``fill`` of half of ``y`` then a ``copy`` of all of ``y`` reads the other half as
    the graph found it, so ``y`` is a source (its failure mark reaches the copy's output, and
    a pool never shares it as a temporary); a ``copy`` of that half only is not (ADV7: every
    write hid every later read, and the copy's output read back the failed half with no
    error). Without ``nbytes`` any write hides the reads after it."""
    out, written = set(), {}            # {handle: {scope: bytes covered}}: few scopes each
    nodes: dict = {}                    # node index -> its CondRec
    whole = nbytes is None

    def hidden(h, scope, need) -> bool:
        ws = written.get(h)
        if ws is None:
            return False
        top = ws.get(())
        if top is not None and top >= need:
            return True
        return any(cov >= need and scope[:len(w)] == w for w, cov in ws.items())

    def size(h):
        return 0 if whole else nbytes.get(h, 0)
    for op in ops:
        if isinstance(op, LaunchRec):
            sc, k, c = op.scope, op.kernel, op.count
            for bi, (acc, h) in enumerate(zip(k.accesses, op.hids)):
                if acc != "write" and h not in out:
                    need = None if whole else k.touched_bytes(bi, op.params, c)
                    if not hidden(h, sc, size(h) if need is None else min(need, size(h))):
                        out.add(h)
            if not isinstance(c, tuple):
                if not hidden(c, sc, size(c)):
                    out.add(c)
            elif c[0] and c[1] and c[2]:
                for bi, (acc, h) in enumerate(zip(k.accesses, op.hids)):
                    if acc == "write":
                        cov = float("inf") if whole else k.touched_bytes(bi, op.params, c)
                        cov = size(h) if cov is None else cov
                        ws = written.get(h)
                        if ws is None:
                            written[h] = {sc: cov}
                        elif ws.get(sc, -1) < cov:
                            ws[sc] = cov
        elif hasattr(op, "cond"):
            nodes[op.index] = op
            if not hidden(op.cond, op.scope, size(op.cond)):
                out.add(op.cond)
        elif op[0] == "end":
            _both_branches(nodes[op[1]], written)
    return frozenset(out)


def _both_branches(node, written: dict) -> None:
    """At the end of conditional node ``node`` (an ``ops.CondRec``): what both branches of a
    ``capture_if`` with an else branch write (``written``: ``{handle: {scope: bytes covered}}``)
    is written whichever runs, so it counts as written in the scope the node sits in (the
    smaller of the two prefixes), for the reads after the node and :func:`maybe_written`. A
    loop body may run zero times and an if without an else may run nothing: they add nothing.
    (Before ADV8 a buffer written in both branches stayed a source and maybe-written: one
    failure of its writer made every later replay fail for good, though each rewrote it.)"""
    if node.kind != "if":
        return
    then, other = node.scope + ((node.index, "then"),), node.scope + ((node.index, "else"),)
    for ws in written.values():
        a, b = ws.get(then), ws.get(other)
        if a is not None and b is not None:
            cov = a if a < b else b
            if ws.get(node.scope, -1) < cov:
                ws[node.scope] = cov


def maybe_written(ops, nbytes=None) -> frozenset:
    """Handle ids a graph of ``ops`` writes only through launches that may not run
    (:func:`surely_runs`: inside conditional nodes, a zero or indirect workgroup count): a
    replay may leave them unwritten (the branch not taken, a loop run zero times, a count of
    0), and the server cannot see which ran (it is decided on the device); a buffer both
    branches of an if with an else rewrite is written whichever runs (:func:`_both_branches`). A failure mark on
    such a buffer therefore outlives a replay that succeeds: only a write that surely runs, a
    launch or a host write clears it (docs/contract.md section 4b). The same holds for a
    buffer (of ``nbytes[handle id]`` bytes) the graph writes only in part: a ``write`` whose
    declared element count covers less than the buffer (``Kernel.partial_write``) leaves the
    rest as it was (ADV6)."""
    cond, written, nodes = set(), {}, {}   # written: {handle: {scope: 1}}, whole writes
    for op in ops:
        if isinstance(op, LaunchRec):
            k, c = op.kernel, op.count
            runs = c.__class__ is tuple and bool(c[0] and c[1] and c[2])   # where it sits
            for bi, (b, h) in enumerate(zip(k.bindings, op.hids)):
                if b.access == "read":
                    continue
                cond.add(h)
                if runs and not (nbytes and k.write_checks and b.access == "write"
                                 and k.partial_write(bi, op.params, nbytes.get(h, 0), c)):
                    written.setdefault(h, {})[op.scope] = 1
        elif isinstance(op, CondRec):
            nodes[op.index] = op
        elif op[0] == "end":
            _both_branches(nodes[op[1]], written)  # (both branches of an if write it)
    return frozenset(h for h in cond if () not in written.get(h, ()))


class Window:
    """What one capture window touched and refused.

    Attributes:
        recording: the backend recording (``Backend.begin_graph``).
        reads / writes: handle ids the recorded launches read / write (the graph's read and
            write sets; a ``read_write`` binding counts in both). ``inputs``: ids bound ``read``
            only (the graph's sources, whose marks a replay inherits: :func:`sources`).
        states: ``{handle id: HandleState}`` of every handle the recorded launches use.
        fences: ``{stream id: position}`` of work on other streams pending on those handles at
            record time (their earlier writers and readers, and a reused buffer's previous
            owner): the first replay waits for them, as an eager launch would have.
        allocs: handle states allocated on the capturing stream inside the window (retained by
            the graph on software graphs).
        refusals: messages of late refusals (a write, a free of a used handle, a fresh
            allocation on a hardware graph); ``stop_capture`` raises ``CaptureRefused`` with them.
        deferred: handle states freed during the window whose buffers must outlive it.
        graveyard: backend graphs destroyed while the stream captures (no event may be recorded
            on a capturing stream); destroyed when the window ends.
        event / event_pos: an event recorded on the stream as the window opened, so other
            streams can order against the work before it without recording on a capturing stream.
    """

    __slots__ = ("recording", "reads", "writes", "inputs", "states", "fences", "allocs",
                 "refusals", "deferred", "graveyard", "event", "event_pos", "launches", "ops",
                 "scopes")

    def __init__(self, recording, event, event_pos):
        self.recording = recording
        self.reads: set = set()
        self.writes: set = set()
        self.inputs: set = set()
        self.states: dict = {}
        self.fences: dict = {}
        self.allocs: list = []
        self.refusals: list[str] = []
        self.deferred: list = []
        self.graveyard: list = []
        self.event, self.event_pos = event, event_pos
        self.launches = 0
        self.ops: list = []       # what was recorded, in order (graphs.py: launches, nodes)
        self.scopes: list = []    # the open capture_if/capture_while nodes (graphs.CondRec)

    def uses(self, hid: int) -> bool:
        return hid in self.states


class GraphState:
    """Server-side state of one captured graph.

    Attributes:
        id, stream, graph: the graph id, its capture stream id, the backend graph.
        reads / writes: handle ids it reads / writes; ``inputs``: ids it only reads;
            ``sources``: ids it may read before writing them (:func:`sources`).
        handles: the ``HandleState`` s it uses (``wstates``: those it writes; ``istates``: its
            read-only inputs; ``sstates``: its sources, whose marks a replay inherits;
            ``mstates``: those it writes only inside conditional nodes, whose failure marks a
            replay keeps: :func:`maybe_written`, and the ``clobbers``);
            ``retained``: every pooled slot it uses, pinned until destroy, so
            no buffer a replay may touch changes owner while the graph lives.
        required: ids of caller-owned handles whose free breaks the graph (``retain=False``:
            ``ComputeClient.stop_capture``'s contract); ``freed``: those freed so far; a replay
            then raises ``LivenessError``.
        allocated: how many handles the window allocated (retained on software graphs).
        fences: cross-stream fences the first replay waits for (``Window.fences``).
        last_pos: the capture-stream position of its latest replay.
        op: ``("replay", id)``, the operation its replays' marks name (made once).
        sstate: the ``StreamState`` of ``stream`` (set when the server registers the graph; the
            stream is not reclaimed while a graph replays there): one load on the replay path.
    """

    __slots__ = ("op", "id", "stream", "graph", "reads", "writes", "inputs", "sources", "handles",
                 "wstates", "istates", "sstates", "mstates", "retained", "allocated", "required",
                 "freed", "fences", "last_pos", "launches", "ops", "alloc_slots", "retain",
                 "fallback_reason", "defer", "sstate", "clobbers")

    def __init__(self, gid, stream, graph, window: Window, retain: bool):
        self.id, self.stream, self.graph = gid, stream, graph
        self.sstate = None          # its stream's state, set by the server as it registers it
        self.op = ("replay", gid)
        self.reads, self.writes = frozenset(window.reads), frozenset(window.writes)
        self.inputs = frozenset(window.inputs)
        self.sources = sources(window.ops, {st.id: st.nbytes for st in window.states.values()})
        self.handles = list(window.states.values())
        self.wstates = [st for st in self.handles if st.id in self.writes]
        self.istates = [st for st in self.handles if st.id in self.inputs]
        self.sstates = [st for st in self.handles if st.id in self.sources]
        maybe = maybe_written(window.ops, {st.id: st.nbytes for st in self.handles})
        self.mstates = [st for st in self.wstates if st.id in maybe]
        self.set_defer()
        allocated = {st.id for st in window.allocs}
        slots = {id(st.slot): st.slot for st in self.handles}
        for st in window.allocs:
            slots[id(st.slot)] = st.slot
        self.retained = list(slots.values())
        self.allocated = len(window.allocs)
        self.required = frozenset() if retain else frozenset(
            st.id for st in self.handles if st.id not in allocated)
        self.freed: list = []
        self.fences = dict(window.fences)
        self.last_pos = 0
        self.launches = window.launches
        # graphs.py: the recorded ops (update/instantiate/describe), the slots of the window's
        # own allocations, the retain choice, and why an update had to rebuild the graph
        self.ops = list(window.ops)
        self.alloc_slots = [st.slot for st in window.allocs]
        self.retain = retain
        self.fallback_reason = None
        #: ``{HandleState: Mark}``: live handles outside the graph that share a buffer it
        #: writes (a graph pool's temporary handed to another window, kept there as an output:
        #: ``ComputeServer._pool_aliases``); a replay leaves each its failed mark (also in
        #: ``mstates``, so a replay sets them: ``ComputeServer._kept_marks``)
        self.clobbers: dict = {}

    def set_defer(self) -> None:
        """``defer``: a replay may be deferred (``ComputeServer.replay``) as far as the graph
        itself says: its backend graph allows it (``graph.defer``: the cpu backend's) and no
        buffer is written only inside conditional nodes. Called whenever ``graph`` or
        ``mstates`` change (capture, ``graphs.update``)."""
        self.defer = bool(getattr(self.graph, "defer", False)) and not self.mstates


class Capture:
    """The capture lifecycle of every stream of one server, and the window's hooks.

    Runs on the server's single owner, like every handler. ``windows`` maps a capturing stream's
    id to its open :class:`Window` (frees on any stream check them).

    Args:
        backend: the server's backend (the graph verbs, ``hardware_graphs``).
        marks: the server's ``Marks`` (queued errors of the stream; ``marks.py``).
        release_slot: ``release_slot(handle state)``: give a buffer back to the pool with the
            fences of its pending work (a window's deferred frees, warm-up priming).
        event_at: ``event_at(stream state, position) -> (event, position)``: an event of the
            stream at or after a position (recorded as the window opens).
    """

    def __init__(self, backend, marks, release_slot, event_at):
        self.backend, self.marks = backend, marks
        self.release_slot, self.event_at = release_slot, event_at
        self.windows: dict = {}

    # -- lifecycle ------------------------------------------------------------------------------
    def prepare(self, s) -> None:
        """``NO_CAPTURE -> PREPARE``. Raises ``GraphStateError`` (unchanged)."""
        s.state = transition(s.state, "prepare", s.id)

    def check_begin(self, s) -> None:
        """Raise ``GraphStateError`` now if ``begin`` would be out of order (nothing changes)."""
        transition(s.state, "begin", s.id)

    def begin(self, s, warmup_error=None) -> None:
        """``PREPARE -> CAPTURE``: release primed buffers, refuse a failed warm-up, open a
        recording.

        Args:
            warmup_error: the error the warm-up's completion failed with (the client waited for
                it), queued on the stream with the others.
        Raises: ``GraphStateError`` (out of order, unchanged); ``ServerUnhealthy`` (the warm-up
            left errors: aborted, back to ``NO_CAPTURE``); ``UnsupportedError`` (aborted).
        """
        marks = self.marks
        new_state = transition(s.state, "begin", s.id)
        marks.collect()                 # failures the backend found after enqueue (submit)
        if warmup_error is not None:
            s.errors.extend(warmup_error.errors if isinstance(warmup_error, ServerUnhealthy)
                            else [warmup_error])
        if s.errors or marks.async_errors:
            self.abort(s)
            marks.drain(s)
        self._release_primed(s)
        ev, epos = self.event_at(s, s.pos)
        try:
            recording = self.backend.begin_graph(s.raw)
        except BaseException:
            self.abort(s)
            raise
        s.window = self.windows[s.id] = Window(recording, ev, epos)
        s.state = new_state

    def record(self, s, kernel, prog, count, args, params, states, cst) -> None:
        """Add one launch to the open window of ``s`` (``h_launch`` inside a window).

        Folds the cross-stream fences of every handle it uses into the window (see
        ``Window.fences``). Raises ``CaptureRefused`` for an indirect launch on a backend
        without ``indirect_dispatch`` (the window is then invalidated by the caller), and what
        ``Backend.record_launch`` raises.
        """
        w = s.window
        if cst is not None and not self.backend.indirect_dispatch:
            raise CaptureRefused(f"indirect launch of {kernel.name} (count handle {cst.id}) "
                                 f"inside the capture window: the {self.backend.name} backend "
                                 "reads indirect counts on the host before the launch, which a "
                                 "graph cannot record; launch it with an (x, y, z) count")
        self.backend.record_launch(w.recording, prog, count, args, params)
        w.launches += 1
        w.ops.append(LaunchRec(kernel, count if cst is None else cst.id,
                               tuple(st.id for st in states), params,
                               tuple(w.scopes)))
        sid = s.id
        for b, st in zip(kernel.bindings, states):
            w.states[st.id] = st
            w.reads.add(st.id)
            merge(w.fences, st.writes, sid)
            if b.access == "read":
                w.inputs.add(st.id)
            else:
                w.writes.add(st.id)
                merge(w.fences, st.reads, sid)
        if cst is not None:
            w.states[cst.id] = cst
            w.reads.add(cst.id)
            w.inputs.add(cst.id)
            merge(w.fences, cst.writes, sid)
        w.inputs -= w.writes

    def end(self, s, gid, retain: bool) -> GraphState:
        """``CAPTURE -> NO_CAPTURE``: the graph of the window, or raise and abort.

        Raises: ``GraphStateError`` (nothing recording, unchanged); ``CaptureRefused`` when any
        operation was refused inside the window (at once or late: the window is invalidated,
        CUDA's ``cudaErrorStreamCaptureInvalidated``), naming the first and the others, and
        combined with the errors queued in the window (one ``ServerUnhealthy`` that is also a
        ``CaptureRefused``); ``ServerUnhealthy`` (errors queued in the window); the backend's
        error. Either way the stream is back to no capture.
        """
        transition(s.state, "end", s.id)
        w = s.window
        if w.scopes:
            w.refusals.append(f"conditional node {w.scopes[-1][0]} was still open (stop_capture "
                              "was called inside a capture_if/capture_while body)")
        if w.refusals:                  # CUDA: cudaErrorStreamCaptureInvalidated
            self.abort(s)
            first, rest = w.refusals[0], w.refusals[1:]
            refused = CaptureRefused(
                f"stop_capture on stream {s.id}: the window was invalidated, no graph was made; "
                f"the first refused operation: {first}"
                + (f"; then: {'; '.join(rest)}" if rest else ""))
            errs = [refused] + self.marks.take_errors(s)   # a refusal never hides an error
            raise unhealthy(errs) if len(errs) > 1 else refused
        if s.errors:
            self.abort(s)
            self.marks.drain(s)
        try:
            graph = self.backend.end_graph(w.recording)
        except BaseException:
            self._close(s, w, recorded=True)
            raise
        g = GraphState(gid, s.id, graph, w, retain)
        for slot in g.retained:
            slot.pins += 1
        for st in g.handles:
            st.graphs[g] = None
        self._close(s, w, recorded=True)
        return g

    def abort(self, s) -> None:
        """Back to ``NO_CAPTURE`` from any state, unwinding what the window or priming holds."""
        w = s.window
        if w is not None:
            try:
                self.backend.abort_graph(w.recording)
            finally:
                self._close(s, w, recorded=False)
        self._release_primed(s)
        s.state = NO_CAPTURE

    def _close(self, s, w: Window, recorded: bool) -> None:
        s.window = None
        s.state = NO_CAPTURE
        self.windows.pop(s.id, None)
        for st in w.deferred:
            self.release_slot(st)
        for graph in w.graveyard:
            self.backend.destroy_graph(s.raw, graph)

    def _release_primed(self, s) -> None:
        primed, s.primed = s.primed, []
        for st in primed:
            self.release_slot(st)

    # -- hooks ----------------------------------------------------------------------------------
    def on_alloc(self, s, st, fresh: bool) -> None:
        """A handle was allocated on ``s``: a window keeps it (hardware graphs refuse a fresh
        buffer: it would be a memory node)."""
        w = s.window
        if w is not None:
            w.allocs.append(st)
            if fresh and self.backend.hardware_graphs:
                w.refusals.append(f"handle {st.id} ({st.nbytes} bytes) was allocated inside the "
                                  "window and grew the pool: a hardware graph cannot hold a "
                                  "memory node; run the work once after graph_prepare() so the "
                                  "pool is warm")

    def on_free(self, s, st) -> bool:
        """Handle ``st`` is freed from stream ``s`` (may be None): True when a window or warm-up
        priming holds its buffer back (the caller must not release the slot)."""
        holder = None                          # the window that keeps its buffer alive
        for wsid, w in self.windows.items():   # every window that uses it refuses the free
            allocated = any(a is st for a in w.allocs)
            if allocated or w.uses(st.id):
                if not allocated:
                    w.refusals.append(f"handle {st.id} was freed while the window on stream "
                                      f"{wsid} uses it; keep it alive until stop_capture()")
                if holder is None or allocated:   # the allocating window's graph retains it
                    holder = w
        if holder is not None:
            holder.deferred.append(st)
            return True
        if s is not None and s.state == PREPARE:
            s.primed.append(st)                # held until start_capture (warm-up priming)
            return True
        return False

    def on_write(self, s, st) -> bool:
        """A host write to handle state ``st`` on ``s``: True when the window refuses it
        (late; never applied: the buffer keeps what it held, scenario 18). A handle the window
        itself allocated (``create(array)`` inside it) held nothing before, so it is marked as
        written by a failed write (``ReplayFailed`` on read until a later write lands): before
        ADV9 it read back whatever the pool's buffer held, with no error, once
        ``abort_capture`` dropped the window or ``stop_capture`` had raised."""
        w = s.window
        if w is None:
            return False
        what = (f"write to handle {st.id} inside the capture window (a graph cannot record a "
                "host write; it was not applied)")
        w.refusals.append(what)
        if any(a is st for a in w.allocs):
            self.marks.fail((st,), ("write", st.id, s.id),
                            CaptureRefused(f"{what} on stream {s.id}, and the handle was made in "
                                           "that window: it holds no data; write it again"))
        return True

    def on_event(self, s, what: str) -> None:
        """``record_event`` / ``wait_event`` / ``read`` / ``sync`` / ``replay`` on ``s``.

        Raises: ``CaptureRefused`` at once when ``s`` is capturing, and invalidates the window
        (``refuse``): only the capture stream's own work is recorded, so a graph never silently
        lacks work the caller ordered into it, even when the caller catches the error.
        """
        if s.window is not None:
            self.refuse(s, f"{what} (refused at once)")
            raise CaptureRefused(f"{what} on stream {s.id}: the stream is recording a graph; "
                                 f"{what.split(' ')[0]} after stop_capture() (or from another "
                                 "stream). The window is invalidated: stop_capture() raises "
                                 "CaptureRefused, abort_capture() unwinds it")

    @staticmethod
    def refuse(s, what: str) -> None:
        """Invalidate the open window of ``s`` (if any): ``stop_capture`` raises
        ``CaptureRefused`` naming ``what`` (the first refusal first) and makes no graph (CUDA's
        rule: any operation refused inside a capture invalidates it)."""
        if s.window is not None:
            s.window.refusals.append(what)

    def on_destroy(self, s, graph) -> bool:
        """A backend graph of stream ``s`` is destroyed: True when the window holds it until it
        ends (an event cannot be recorded on a capturing stream)."""
        if s.window is not None:
            s.window.graveyard.append(graph)
            return True
        return False
