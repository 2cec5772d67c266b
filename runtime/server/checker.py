"""The stream-ordering checker (``check=True`` / ``RUNTIME_CHECK=1``): seed 001's safety contract.

Ordinary operations are ordered across streams by the server itself (``_wait_for``). A graph
replay is not: by contract it orders only against its capture stream. This module finds the
ways a replay (or a buffer's change of owner) then goes wrong and raises instead of letting the
data go stale (liveness, a replay after the free of a handle it uses, is refused by the server
itself, checker or not: ``LivenessError``):

- pool reuse: a buffer handed to a new handle (freed into the pool and taken again, inside or
  outside a capture window) whose first use is not ordered after the previous owner's pending
  accesses -> ``StreamRaceError`` naming both handles. The history is kept per pooled buffer,
  not per handle, so the checker models the reuse instead of trusting the pool's fences;
- concurrent use: another stream uses a buffer the replay writes (or writes one it reads) with
  no ordering between them -> ``StreamRaceError``;
- cross-stream refresh: an input written, or an output read, on a stream other than the capture
  stream without ordering -> ``StreamRaceError``.

Model. Each operation sits at a position ``p`` of its stream (``StreamState.pos`` after it is
enqueued). Per pooled buffer (``PooledBuffer``, whichever handle holds it) the checker keeps
the last write and the latest read per stream since, each as ``(stream, position, operation)``. Per stream it keeps a vector clock
``{other stream: position}``: the positions of other streams that happen-before its next
operation. Clocks advance through

- event waits, including the automatic ones the server inserts (``_wait_for``): the waiting
  stream joins the clock the source stream had when the event was recorded;
- host syncs: a ``sync`` of stream S, or a ``read`` on S (it returns only once S ran up to it;
  one that raises the stream's errors or a stale mark has waited for S as well), orders
  everything S did so far before whatever the host issues next, on any stream. The host
  is taken as one sequence, in the server's message order: two threads that issue concurrently
  without ordering each other on the host are treated as if the queue order were that order.

Two accesses conflict when at least one writes and they come from different streams; the later
one must find the earlier one's position in its clock, else they race. A replay of graph G on
stream S counts as reads of G's read set and writes of its write set at one position of S.

Where the error is raised (docs/contract.md section 1: fire-and-forget errors go on the stream):

- blocking calls (``read``, ``replay``) raise at the call and do not run: a racy read returns
  nothing rather than stale bytes, a refused replay is marked on the graph's write set like any
  failed replay (``ReplayFailed`` on read until a replay lands);
- fire-and-forget calls (``write``, ``launch``) already returned. The checker queues the error on
  the stream (raised by its next blocking call) and makes the operation wait on an event after
  the conflicting access before it is enqueued, so it runs in program order: the program is
  told it broke the contract and its data still comes out as written. We chose ordering over
  dropping the operation because a dropped write would leave other streams reading stale data
  with no error of their own.

Cost: one dictionary lookup and a few integer comparisons per buffer access, a copy of a small
clock per recorded event; see ``benchmarks/checker_cost.py``. The checker sits in the server,
so it runs the same on every backend.

Not checked: the counts buffer of an indirect launch (not reported as an access).
"""

from __future__ import annotations

from ..errors import StreamRaceError

#: violations a checker keeps (the oldest: the first race is usually the one to fix); later
#: ones are counted (``Checker.found``), so a long run with a race grows no list
MAX_VIOLATIONS = 10_000


class _Buf:
    """The access history of one pooled buffer since its last write (any handle holding it)."""

    __slots__ = ("w_sid", "w_pos", "w_op", "w_hid", "reads")

    def __init__(self):
        self.w_sid, self.w_pos, self.w_op, self.w_hid = None, 0, None, None
        self.reads: dict = {}       # stream id -> (position, op, handle id) of its latest read

    def may_conflict(self, sid, is_write: bool) -> bool:
        """Fast path: False when everything so far was on stream ``sid`` (nothing to check)."""
        reads = self.reads
        return (self.w_sid is not None and self.w_sid != sid) or (
            is_write and bool(reads) and (len(reads) > 1 or sid not in reads))

    def record(self, sid, pos: int, op, is_write: bool, hid: int) -> None:
        """Note an access by stream ``sid`` at position ``pos`` through handle ``hid``."""
        if is_write:
            self.w_sid, self.w_pos, self.w_op, self.w_hid = sid, pos, op, hid
            if self.reads:
                self.reads.clear()
        else:
            self.reads[sid] = (pos, op, hid)


class _Replay:
    """The operation tag of a replay (kept instead of a string so the hot path formats nothing)."""

    __slots__ = ("gid",)

    def __init__(self, gid):
        self.gid = gid


def _describe(op, hid: int, is_write: bool) -> str:
    if op == "write" or op == "read":
        return f"{op} {'to' if op == 'write' else 'of'} handle {hid}"
    what = "writing" if is_write else "reading"
    if isinstance(op, _Replay):
        return f"replay of graph {op.gid} ({what} handle {hid})"
    return f"launch of {getattr(op, 'name', op)} ({what} handle {hid})"


def _kind(op) -> str:
    if op == "write" or op == "read":
        return op
    if isinstance(op, _Replay):
        return f"replay of graph {op.gid}"
    return f"launch of {getattr(op, 'name', op)}"


class Checker:
    """Happens-before bookkeeping for one ``ComputeServer``; every hook runs on its owner.

    Attributes:
        violations: the ``LivenessError`` / ``StreamRaceError`` s found so far, in order (also
            the ones queued on a stream and not raised yet): the first :data:`MAX_VIOLATIONS`.
        found: how many were found in all (each is raised to its call either way).
    """

    def __init__(self, server):
        self.server = server
        self.clocks: dict = {}      # stream id -> [clock {other sid: pos}, host version joined]
        self.host: dict = {}        # what the host knows has finished: {sid: pos}
        self.host_ver = 0
        self.events: dict = {}      # stream id -> {event position: clock snapshot}
        self.bufs: dict = {}        # PooledBuffer -> _Buf (outlives the handles that held it)
        self.replays: dict = {}     # graph id -> (op tag, ((slot, handle id, writes it), ...))
        self.violations: list = []
        self.found = 0
        # a buffer given back to the device leaves bufs (its history and the buffer itself
        # were kept for every buffer ever pooled: a server churning sizes grew without bound)
        server.pool.on_free = self.on_free

    def on_free(self, slot) -> None:
        """Pooled buffer ``slot`` went back to the device (``Pool.trim``): forget it."""
        self.bufs.pop(slot, None)

    # -- clocks ---------------------------------------------------------------------------------
    def _clock(self, sid) -> dict:
        """The clock of ``sid``'s next operation (joins what the host learned since)."""
        ent = self.clocks.get(sid)
        if ent is None:
            ent = self.clocks[sid] = [{}, -1]
        vc = ent[0]
        if ent[1] != self.host_ver:
            ent[1] = self.host_ver
            self._join(vc, self.host, sid)
        return vc

    @staticmethod
    def _join(vc: dict, other: dict, own) -> None:
        for k, v in other.items():
            if k != own and vc.get(k, 0) < v:
                vc[k] = v

    def on_record(self, src) -> None:
        """An event was recorded on ``src`` after its work so far (``src.pos``)."""
        snap = dict(self._clock(src.id))
        snap[src.id] = src.pos
        evs = self.events.get(src.id)
        if evs is None:
            evs = self.events[src.id] = {}
        elif len(evs) > 2:
            # the server only ever waits on the latest event or the open window's one
            keep = {src.event_pos, src.window.event_pos if src.window is not None else None}
            for k in [k for k in evs if k not in keep]:
                del evs[k]
        evs[src.pos] = snap

    def on_event_wait(self, s, src_id, pos: int) -> None:
        """Stream ``s`` now waits for stream ``src_id`` up to position ``pos``."""
        if src_id == s.id:
            return
        vc = self._clock(s.id)
        if vc.get(src_id, 0) >= pos:
            return
        snap = None
        evs = self.events.get(src_id)
        if evs:
            at = [k for k in evs if k >= pos]
            if at:
                snap = evs[min(at)]
        self._join(vc, snap if snap is not None else {src_id: pos}, s.id)

    def on_sync(self, s) -> None:
        """The host saw stream ``s`` finish everything enqueued on it so far."""
        vc = self._clock(s.id)
        host = self.host
        if host.get(s.id, 0) >= s.pos and all(host.get(k, 0) >= v for k, v in vc.items()):
            return
        self._join(host, vc, None)
        if host.get(s.id, 0) < s.pos:
            host[s.id] = s.pos
        self.host_ver += 1

    def on_reclaim(self, sid) -> None:
        """Stream ``sid`` was reclaimed: its work is done and everything issued later on any
        stream runs after it (the server orders nothing against it any more). So its accesses
        count as synchronized: they leave every buffer's history, and its clock and events go
        (the checker's tables stay bounded by live streams)."""
        self.clocks.pop(sid, None)
        self.events.pop(sid, None)
        self.host.pop(sid, None)
        for ent in self.clocks.values():
            ent[0].pop(sid, None)
        for b in self.bufs.values():
            if b.w_sid == sid:
                b.w_sid, b.w_pos, b.w_op, b.w_hid = None, 0, None, None
            if b.reads:
                b.reads.pop(sid, None)

    # -- accesses -------------------------------------------------------------------------------
    def _conflicts(self, b: _Buf, sid, vc: dict, is_write: bool) -> list:
        out = []
        if b.w_sid is not None and b.w_sid != sid and vc.get(b.w_sid, 0) < b.w_pos:
            out.append((b.w_sid, b.w_pos, b.w_op, True, b.w_hid))
        if is_write:
            for rsid, (rpos, rop, rhid) in b.reads.items():
                if rsid != sid and vc.get(rsid, 0) < rpos:
                    out.append((rsid, rpos, rop, False, rhid))
        return out

    def _race(self, hid: int, first, sid, op, is_write: bool) -> StreamRaceError:
        psid, _, pop, pwrite, phid = first
        psid, sid = int(psid), int(sid)
        a, b = _describe(pop, phid, pwrite), _describe(op, hid, is_write)
        if phid != hid:
            b += (f" (its buffer was handle {phid}'s: a buffer changing owner must be ordered "
                  "after the previous owner's work)")
        if isinstance(op, _Replay):
            fix = (f"a replay orders only against its capture stream: issue the {_kind(pop)} on "
                   f"stream {sid}, or sync stream {psid} or make stream {sid} wait on an event "
                   f"recorded on stream {psid} before replaying")
        elif isinstance(pop, _Replay):
            fix = (f"a replay orders only against its capture stream: issue the {_kind(op)} on "
                   f"stream {psid}, or sync stream {psid} or wait on an event recorded there "
                   "after the replay")
        else:
            fix = f"order them with an event or a sync of stream {psid}"
        err = StreamRaceError(f"{a} on stream {psid} is not ordered before {b} on stream {sid}; "
                              f"{fix}")
        err.handle, err.streams, err.ops = hid, (psid, sid), (_kind(pop), _kind(op))
        self.record(err)
        return err

    def record(self, err) -> None:
        """Keep violation ``err`` (the first :data:`MAX_VIOLATIONS`), count it (``found``)."""
        self.found += 1
        if len(self.violations) < MAX_VIOLATIONS:
            self.violations.append(err)

    def on_access(self, s, st, op, is_write: bool) -> None:
        """Stream ``s`` is about to enqueue ``op`` (``"write"``, ``"read"`` or a launch's kernel)
        touching handle ``st`` at position ``s.pos + 1``.

        Raises: ``StreamRaceError`` for a racy ``read`` (the read does not run). A racy write or
        launch is ordered after the conflicting access and the error is queued on ``s``.
        """
        sid = s.id
        ent = self.clocks.get(sid)
        vc = ent[0] if ent is not None and ent[1] == self.host_ver else self._clock(sid)
        b = self.bufs.get(st.slot)
        if b is None:
            b = self.bufs[st.slot] = _Buf()
        elif b.may_conflict(sid, is_write):
            self._check_access(s, st, b, vc, op, is_write)
        b.record(sid, s.pos + 1, op, is_write, st.id)

    def _check_access(self, s, st, b: _Buf, vc: dict, op, is_write: bool) -> None:
        bad = self._conflicts(b, s.id, vc, is_write)
        if bad:
            err = self._race(st.id, bad[0], s.id, op, is_write)
            if op == "read":
                raise err
            fences: dict = {}
            for psid, ppos, _, _, _ in bad:
                fences[psid] = max(fences.get(psid, 0), ppos)
            self.server._wait_for(s, fences)
            s.errors.append(err)

    def on_replay(self, s, g) -> None:
        """Graph ``g`` is about to be replayed on its capture stream ``s``.

        Raises: ``StreamRaceError`` (an access on another stream, or the previous owner of a
        buffer it uses, is not ordered before it). Nothing is recorded when it raises.
        """
        sid = s.id
        vc = self._clock(sid)
        op, uses = self.replays[g.id]
        bufs = self.bufs
        for slot, hid, is_write in uses:
            b = bufs.get(slot)
            if b is not None and b.may_conflict(sid, is_write):
                bad = self._conflicts(b, sid, vc, is_write)
                if bad:
                    raise self._race(hid, bad[0], sid, op, is_write)
        pos = s.pos + 1
        for slot, hid, is_write in uses:
            b = bufs.get(slot)
            if b is None:
                b = bufs[slot] = _Buf()
            b.record(sid, pos, op, is_write, hid)

    # -- lifetimes ---------------------------------------------------------------------------------
    def on_graph(self, g) -> None:
        """Graph ``g`` was made: remember the buffers a replay touches."""
        self.replays[g.id] = (_Replay(g.id), tuple(
            (st.slot, st.id, st.id in g.writes) for st in sorted(g.handles, key=lambda t: t.id)))

    def on_graph_destroy(self, g) -> None:
        """Graph ``g`` was destroyed."""
        self.replays.pop(g.id, None)
