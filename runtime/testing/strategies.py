"""``programs()``: a hypothesis strategy for multi-client, multi-stream programs over your kernels.

The builder draws one call at a time from what the state allows (live buffers, open capture
windows, made graphs, recorded events), so every program is well formed and hypothesis shrinks
it by drawing fewer and simpler calls.

Contract programs (``contract=True``, the default) keep the replay contract by construction
(seed 001): before a replay, every access another stream made to the graph's buffers is
ordered before it, and before an ordinary call touches a buffer a replay on another stream
used, that replay is ordered before it. The builder knows what orders what through vector
clocks over streams (program order per stream, the event waits the server inserts between
ordinary calls, the user's events, host syncs: a ``sync`` or ``read`` of a stream, also one
that raises, since it returns only after the stream's earlier work ran); where an ordering is
missing it inserts one, a ``sync`` of the other stream or an event wait (drawn), and skips the
call when neither is possible (the other stream is recording a graph). Every read of a
contract program must then match the sequential model under every schedule.

With kernels that may raise (``failures=True``) a capture window may not open (a failed
warm-up, or an error still queued on the stream, makes ``start_capture`` raise), and the calls
meant for it then run as ordinary calls: the builder orders them as if they ran, with host
syncs only (``Builder._maybe``).
"""

from __future__ import annotations

from ..kernel import DTYPES, normalize_count
from . import program as P

_KINDS = ("create", "launch", "read", "write", "sync", "free", "event", "wait", "capture",
          "end", "scratch", "replay", "release", "refuse", "clone", "handover", "cond",
          "update", "thread", "instantiate")
#: how many times a kind is listed among the choices: graphs are worth replaying often; racy
#: programs (contract=False) write, free and replay more, so more races reach the device
_WEIGHT = {"capture": 2, "end": 5, "replay": 4, "update": 3}
_WEIGHT_RACY = {"capture": 2, "end": 5, "replay": 5, "write": 3, "launch": 2, "free": 2}


def _choices(weight) -> tuple:
    """The fixed list each step draws from (a kind the state does not allow becomes a create,
    or nothing), so deleting a step rarely changes what the later steps' choices mean:
    hypothesis then shrinks a program call by call."""
    return tuple(k for k in _KINDS for _ in range(weight.get(k, 1)))


class _Window:
    __slots__ = ("client", "uses", "allocs", "refused", "launches", "pooled")

    def __init__(self, client, pooled=False):
        self.client = client
        self.pooled = pooled             # prepared with a graph pool (its allocations: freed)
        self.uses: dict = {}             # buf -> True if a recorded launch writes it
        self.allocs: set = set()
        self.refused = False
        self.launches: list = []         # the recorded Launch ops, in g.launches() order


class _Graph:
    __slots__ = ("stream", "uses", "required", "launches", "pooled")

    def __init__(self, stream, uses, required, launches=(), pooled=False):
        self.stream, self.uses, self.required = stream, uses, required
        self.launches = tuple(launches)
        self.pooled = pooled


class Builder:
    """Draws one program call by call (see the module doc); ``program()`` is the result."""

    def __init__(self, draw, cfg):
        self.draw, self.cfg = draw, cfg
        self.S = cfg["streams"]
        self.ops: list = []
        self.live: dict = {}             # buf -> dtype
        self.windows: dict = {}          # stream -> _Window
        self.graphs: dict = {}           # graph -> _Graph (made, not released)
        self.events: dict = {}           # event -> clock snapshot at its record
        self.nbuf = self.ngraph = self.nevent = self.nthread = 0
        self.pos = [0] * self.S          # positions: calls executed on each stream
        self.clock = [{} for _ in range(self.S)]
        self.host: dict = {}             # what host syncs established
        self.acc: dict = {}              # buf -> [(stream, pos, writes, by replay, clock)]
        self.recent: list = []           # the buffers written last (reads favour them)
        self.flags: dict = {}            # (stream, "if" | "loop") -> 1-element i32 buffer
        self.counts: dict = {}           # stream -> its u32 count buffer (``_indirect``)

    # -- drawing helpers --------------------------------------------------------------------
    def pick(self, seq):
        from hypothesis import strategies as st
        return self.draw(st.sampled_from(list(seq)))

    def flag(self):
        from hypothesis import strategies as st
        return self.draw(st.booleans())

    def values(self, dtype):
        from hypothesis import strategies as st
        return tuple(self.draw(st.lists(self.cfg["values"][dtype], min_size=self.cfg["size"],
                                        max_size=self.cfg["size"])))

    def stream(self, k) -> int:
        return k % self.S

    def idle_clients(self):
        return [k for k in range(self.cfg["clients"]) if self.stream(k) not in self.windows]

    # -- vector clocks ----------------------------------------------------------------------
    @staticmethod
    def _join(vc, other):
        for k, v in other.items():
            if vc.get(k, 0) < v:
                vc[k] = v

    def _vc(self, s):
        self._join(self.clock[s], self.host)
        return self.clock[s]

    def _needs(self, s, buf, writes, replay):
        """Streams whose accesses to ``buf`` the user must order before this one."""
        vc = self._vc(s)
        return {t for t, p, w, rep, _ in self.acc.get(buf, ())
                if t != s and (w or writes) and (rep or replay) and vc.get(t, 0) < p}

    def _order(self, s, streams, sync_only=False) -> bool:
        """Order ``streams`` before stream ``s``'s next call (a sync or an event wait, drawn;
        ``sync_only``: a host sync, for a call whose stream may or may not be capturing)."""
        for t in sorted(streams):
            if t in self.windows or t >= self.S:
                return False             # a recording stream takes no sync and records no
                                         # event; an ended thread's stream has no client
        for t in sorted(streams):
            if sync_only or self.flag():
                self._sync(t)
            else:
                e = self._record(t)
                self._wait(s, e)
        return True

    def _access(self, s, uses: dict, replay: bool, may_skip: bool = False) -> bool:
        """Check, order and record an access to ``uses`` (``{buf: writes}``) on stream ``s``.
        ``may_skip``: the access may not happen (the body of an eager ``capture_if`` or
        ``capture_while`` whose condition is off): it is ordered, but the waits the server would
        insert for it are not counted on (it inserts none for a launch that never ran)."""
        if self.cfg["contract"]:
            need = set()
            for b, w in uses.items():
                need |= self._needs(s, b, w, replay)
            if need and not self._order(s, need):
                return False
        vc = self._vc(s)
        if may_skip:
            self.pos[s] += 1
            for b, w in uses.items():
                self.acc.setdefault(b, []).append((s, self.pos[s], w, replay, None))
            self._wrote(uses)
            return True
        if not replay:                   # the waits the server inserts between ordinary calls
            for b, w in uses.items():
                for t, p, pw, _, snap in self.acc.get(b, ()):
                    if t != s and (pw or w) and snap is not None:
                        self._join(vc, snap)
                        self._join(vc, {t: p})
        self.pos[s] += 1
        snap = dict(vc)
        for b, w in uses.items():
            self.acc.setdefault(b, []).append((s, self.pos[s], w, replay, snap))
        self._wrote(uses)
        return True

    def _wrote(self, uses: dict) -> None:
        self.recent = ([b for b, w in uses.items() if w] + self.recent)[:3]

    def _maybe(self, s, uses: dict, replay: bool) -> bool:
        """A call on stream ``s``, whose capture window may not have opened: with kernels that
        may fail (``failures=True``) a warm-up, or an earlier launch's error still queued on the
        stream, makes ``start_capture`` raise, and the calls the builder meant for the window
        then run (a launch runs eagerly, a refused read, write or replay runs). So the builder
        orders them as if they ran, with host syncs only (a ``wait_event`` on ``s`` is refused
        while it records), and records them as accesses that order nothing after them (a
        recorded launch makes the server insert no event wait; ``snap`` None). True when the
        call may be issued."""
        if not self.cfg["failures"]:
            return True                  # no kernel fails: every window opens
        if self.cfg["contract"]:
            need = set()
            for b, w in uses.items():
                need |= self._needs(s, b, w, replay)
            if need and not self._order(s, need, sync_only=True):
                return False
        self.pos[s] += 1
        for b, w in uses.items():
            self.acc.setdefault(b, []).append((s, self.pos[s], w, replay, None))
        self._wrote(uses)
        return True

    def _host_sync(self, s):
        self._join(self.host, self._vc(s))
        self._join(self.host, {s: self.pos[s]})

    def _sync(self, s):
        self.ops.append(P.Sync(s))
        self._host_sync(s)

    def _record(self, s):
        e = self.nevent
        self.nevent += 1
        self.ops.append(P.RecordEvent(s, e))
        self.events[e] = {**self._vc(s), s: self.pos[s]}
        return e

    def _wait(self, s, e):
        self.ops.append(P.WaitEvent(s, e))
        self._join(self._vc(s), self.events[e])

    # -- calls ------------------------------------------------------------------------------
    def kinds(self) -> set:
        """The kinds of call the state allows now."""
        idle, live = self.idle_clients(), bool(self.live)
        ok = {"create": idle and len(self.live) < self.cfg["buffers"],
              "launch": live, "read": idle and live, "write": idle and live,
              "sync": idle, "free": live, "event": idle, "wait": idle and self.events,
              "capture": self.cfg["capture"] and live and idle,
              "end": self.windows, "scratch": self.windows and live,
              "replay": self.graphs, "release": self.graphs, "clone": self.graphs,
              "handover": self.cfg["capture"] and live and len(idle) > 1,
              "refuse": self.windows and self.cfg["refusals"],
              "cond": self.cfg["capture"] and live,
              "update": self.cfg["capture"] and self.graphs and live,
              "instantiate": self.cfg["capture"] and self.graphs and live,
              "thread": live}
        return {k for k in _KINDS if ok[k]}

    def create(self, k=None, dtype=None) -> int:
        """``b = c.create(values)`` on client ``k`` (drawn when None); returns ``b``."""
        k = self.pick(self.idle_clients()) if k is None else k
        dtype = self.pick(self.cfg["dtypes"]) if dtype is None else dtype
        b = self.nbuf
        self.nbuf += 1
        op = P.Create(k, b, dtype, self.values(dtype))
        self._access(self.stream(k), {b: True}, False)
        self.ops.append(op)
        self.live[b] = dtype
        return b

    def _bind(self, spec, fresh=()):
        """Distinct live buffers of the bindings' dtypes, or None; a written binding takes a
        buffer not in ``fresh`` when one fits (a body that writes what nothing else in its
        window writes: a buffer written only inside a conditional node)."""
        chosen = []
        for bind in spec.kernel.bindings:
            cands = [b for b, d in sorted(self.live.items()) if d == bind.dtype and b not in chosen]
            if not cands:
                return None
            if fresh and bind.access != "read":
                cands = [b for b in cands if b not in fresh] or cands
            chosen.append(self.pick(cands))
        return tuple(chosen)

    def _launch_op(self, k, ki, fresh=()):
        spec = self.cfg["kernels"][ki]
        bufs = self._bind(spec, fresh)
        if bufs is None:
            return None
        params = []
        size = self.cfg["size"]
        for name in spec.kernel.param_names:
            v = spec.params.get(name, size if name == "n" else None)
            if (v is size and name == "n" and self.cfg.get("partial")
                    and spec.kernel.write_checks and ki < self.cfg["user_kernels"]):
                # a write over part of its buffers (ADV7): the rest keeps what it held, a
                # failure's mark included, and a later read of all of it reads that rest
                v = self.pick((size, size, max(size // 2, 1), 1))
            params.append((name, self.draw(v) if hasattr(v, "example") else v))
        return P.Launch(k, ki, bufs, tuple(params))

    def _issue(self, op):
        """Append a launch: recorded inside a window, else an ordered access."""
        s = self.stream(op.client)
        spec = self.cfg["kernels"][op.kernel]
        uses = {b: bind.access != "read" for b, bind in zip(op.bufs, spec.kernel.bindings)}
        w = self.windows.get(s)
        if w is not None:
            if not self._maybe(s, uses, False):
                return
            for b, wr in uses.items():
                w.uses[b] = w.uses.get(b, False) or wr
            w.launches.append(op)
        elif not self._access(s, uses, False):
            return
        self.ops.append(op)

    def launch(self):
        op = self._launch_op(self.pick(range(self.cfg["clients"])),
                             self.pick(range(self.cfg["user_kernels"])))
        if op is not None:
            if self.cfg.get("indirect") and self.stream(op.client) not in self.windows \
                    and self.flag():
                return self._indirect(op)
            self._issue(op)

    def _indirect(self, op):
        """``op`` as an indirect launch (``LaunchIndirect``, ``indirect=True``) over its
        stream's u32 count buffer (made now: ``[x, 1, 1, ...]``, x 0, 1 or 2), which half the
        time ``set_counts`` first rewrites from a live f32 buffer it reads: a failure of that
        buffer's writer reaches the counts, and from them what the launch writes (ADV8)."""
        k, s = op.client, self.stream(op.client)
        cb = self.counts.get(s)
        if cb is None:
            cb = self.nbuf
            self.nbuf += 1
            self._access(s, {cb: True}, False)
            self.ops.append(P.Create(k, cb, "u32", (self.pick([0, 1, 2]),)
                                     + (1,) * (self.cfg["size"] - 1)))
            self.counts[s] = cb
        floats = [b for b, d in sorted(self.live.items()) if d == "f32"]
        recent = [b for b in self.recent if b in floats]
        if recent and self.flag():      # (a buffer written last: where a failure's marks are)
            floats = recent
        if floats and self.flag():
            f = self.pick(floats)
            if self._access(s, {f: False, cb: True}, False):
                self.ops.append(P.Launch(k, self.cfg["set_counts"], (f, cb),
                                         (("x", self.pick([0, 1, 2])),)))
        spec = self.cfg["kernels"][op.kernel]
        uses = {b: bind.access != "read" for b, bind in zip(op.bufs, spec.kernel.bindings)}
        uses[cb] = uses.get(cb, False)
        if self._access(s, uses, False):
            self.ops.append(P.LaunchIndirect(k, op.kernel, op.bufs, op.params, cb))

    def read(self):
        """``c.read(b)``: half the time of a buffer written by the last calls (what a program
        reads back; where a failure's marks show), else of any live buffer."""
        k = self.pick(self.idle_clients())
        recent = [b for b in self.recent if b in self.live]
        b = self.pick(recent if recent and self.flag() else sorted(self.live))
        if self._access(self.stream(k), {b: False}, False):
            self.ops.append(P.Read(k, b))
            self._host_sync(self.stream(k))

    def write(self):
        k = self.pick(self.idle_clients())
        b = self.pick(sorted(self.live))
        if self._access(self.stream(k), {b: True}, False):
            self.ops.append(P.Write(k, b, self.live[b], self.values(self.live[b])))

    def sync(self):
        k = self.pick(self.idle_clients())
        self.ops.append(P.Sync(k))
        self._host_sync(self.stream(k))

    def free(self):
        """Release a buffer no open window uses (that one is a ``refuse`` shape)."""
        cands = [b for b in sorted(self.live) if not any(b in w.uses for w in self.windows.values())]
        if cands:
            self._free(self.pick(cands))

    def _free(self, b):
        self.ops.append(P.Free(self.pick(range(self.cfg["clients"])), b))
        del self.live[b]
        for w in self.windows.values():
            if b in w.uses and b not in w.allocs:
                w.refused = True
        if self.cfg["contract"]:          # a graph whose input is gone is never replayed again
            for g in [g for g, info in self.graphs.items() if b in (info.required or ())]:
                self.graphs[g].required = None

    def event(self):
        self._record(self.stream(self.pick(self.idle_clients())))

    def wait(self):
        self._wait(self.stream(self.pick(self.idle_clients())), self.pick(sorted(self.events)))

    def capture(self):
        """``graph_prepare``, an optional warm-up, ``start_capture``, the same launches
        (recorded); the window stays open for more calls until ``end``."""
        from hypothesis import strategies as st
        k = self.pick(self.idle_clients())
        launches = [self._launch_op(k, self.pick(range(self.cfg["user_kernels"])))
                    for _ in range(self.draw(st.integers(1, 3)))]
        launches = [op for op in launches if op is not None]
        if launches and self.flag():     # stateful: the graph feeds an output back to an input
            back = self._feed_back(k, launches)
            if back is not None:
                launches.append(back)
        if launches and self.cfg.get("partial") and self.flag():
            past = self._read_past(k, launches)     # reads what a partial write left
            if past is not None:
                launches.append(past)
        node = self.flag() and self.flag()  # the window records a conditional node: buffers
        loop = node and self.flag()         # written only in its bodies keep a failure mark
        if node:                            # across replays that skip them (contract 4b)
            self._flag(k, "loop" if loop else "if")     # made while the stream is idle
        # a graph pool (one per stream: its graphs replay in order there): the window's
        # allocations may be other pool graphs' temporaries, so _end frees them in the window
        pooled = self.cfg.get("pools", False) and self.flag()
        self.ops.append(P.PreparePool(k, self.stream(k)) if pooled else P.Prepare(k))
        if self.flag():
            for op in launches:
                self._issue(op)
        self.ops.append(P.StartCapture(k))
        self.windows[self.stream(k)] = _Window(k, pooled)
        for op in launches:
            self._issue(op)
        if pooled:                          # a temporary the pool shares with the stream's
            t = self.scratch(self.stream(k))    # other pool graphs, read back into a buffer,
            filled = isinstance(self.ops[-1], P.Launch) and self.ops[-1].bufs[-1] == t
            dsts = [b for b, d in sorted(self.live.items()) if d == self.live[t] and b != t]
            if filled and dsts and self.flag():     # (only once written: else it is state)
                self._issue(P.Launch(k, self.cfg["copy32"], (t, self.pick(dsts)),
                                     (("n", self.cfg["size"]),)))
            self._free(t)                   # and freed at once: a pool buffer is used on the
            #                                 pool's stream only (contract 4c; the checker flags
            #                                 another stream's use, ordered or not)
        if node:
            self.cond(k, loop)

    def _feed_back(self, k, launches):
        """``copy32(out -> state)``: a buffer the launches write copied back into one they read
        before writing it (a decode step feeding its own state, an accumulator): the graph
        then reads and writes its state, and a failure marks it for every later replay until
        the state is written from the host (docs/contract.md section 4). None if none fits."""
        written, sources = set(), []
        for op in launches:
            binds = list(zip(op.bufs, self.cfg["kernels"][op.kernel].kernel.bindings))
            sources += [b for b, bind in binds if bind.access != "write" and b not in written]
            written.update(b for b, bind in binds if bind.access != "read")
        pairs = [(o, i) for o in sorted(written) for i in sorted(set(sources))
                 if o != i and self.live[o] == self.live[i]]
        if not pairs:
            return None
        out, state = self.pick(pairs)
        return P.Launch(k, self.cfg["copy32"], (out, state), (("n", self.cfg["size"]),))

    def _read_past(self, k, launches):
        """``copy32(b -> dst)`` of all of a buffer ``b`` the launches write only in part (a
        ``write`` whose ``n`` is less than the size): the graph reads the rest of ``b`` as it
        found it, so ``b`` is one of its sources and a failure mark on it reaches ``dst``
        (docs/contract.md section 4; ADV7: such a read was hidden by the partial write and
        ``dst`` read back the failed rest with no error). None if none fits."""
        size, part = self.cfg["size"], []
        for op in launches:
            n = dict(op.params).get("n", size)
            binds = self.cfg["kernels"][op.kernel].kernel.bindings
            part += [b for b, bind in zip(op.bufs, binds) if bind.access == "write" and n < size]
        pairs = [(b, d) for b in sorted(set(part)) for d in sorted(self.live)
                 if d != b and self.live[d] == self.live[b]]
        if not pairs:
            return None
        b, dst = self.pick(pairs)
        return P.Launch(k, self.cfg["copy32"], (b, dst), (("n", size),))

    def thread(self):
        """A thread that writes and copies on its own stream and ends (with a sync, then its
        stream is reclaimed, or with work pending); the program's streams use those buffers
        afterwards (issue 23 item 4). It touches no buffer an open window or a live graph uses
        and orders the replays that used its buffers before it with host syncs."""
        from hypothesis import strategies as st
        busy = set()
        for w in self.windows.values():
            busy |= set(w.uses)
        for info in self.graphs.values():
            busy |= set(info.uses)
        free = [b for b in sorted(self.live) if b not in busy]
        if not free:
            return
        k = self.pick(range(self.cfg["clients"]))
        t = self.S + self.nthread         # a stream id no client has
        subs, uses = [], {}
        for _ in range(self.draw(st.sampled_from((1, 2, 1, 3, 17)))):
            b = self.pick(free)
            srcs = [s for s in free if s != b and self.live[s] == self.live[b]]
            if srcs and self.flag():
                src = self.pick(srcs)
                subs.append(P.Launch(k, self.cfg["copy32"], (src, b), (("n", self.cfg["size"]),)))
                uses[src] = uses.get(src, False)
            else:
                subs.append(P.Write(k, b, self.live[b], self.values(self.live[b])))
            uses[b] = True
        vc = dict(self.host)              # the thread starts after what the host knows
        need = set()
        for b, w in uses.items():
            need |= {s for s, p, pw, rep, _ in self.acc.get(b, ())
                     if (pw or w) and rep and vc.get(s, 0) < p}
        if need and not self._order(0, need, sync_only=True):
            return
        vc = dict(self.host)
        for b, w in uses.items():         # the waits the server inserts before its calls
            for s, p, pw, _, snap in self.acc.get(b, ()):
                if (pw or w) and snap is not None:
                    self._join(vc, snap)
                    self._join(vc, {s: p})
        sync = self.flag()
        self.nthread += 1
        self.ops.append(P.Thread(k, self.nthread - 1, tuple(subs), sync))
        for b, w in uses.items():
            self.acc.setdefault(b, []).append((t, len(subs), w, False, dict(vc)))
        if sync:
            self._join(self.host, vc)
            self._join(self.host, {t: len(subs)})
        self._wrote(uses)

    def end(self):
        s = self.pick(sorted(self.windows))
        self._end(s)

    def _end(self, s):
        w = self.windows[s]
        if w.pooled:                     # temporaries only: a live one may be another pool
            for t in sorted(w.allocs):   # graph's temporary (its replays would rewrite it)
                if t in self.live:
                    self._free(t)
        del self.windows[s]
        g = self.ngraph
        self.ngraph += 1
        self.ops.append(P.StopCapture(w.client, g))
        if not w.refused:
            self.graphs[g] = _Graph(s, dict(w.uses), set(w.uses) - w.allocs, w.launches,
                                    w.pooled)

    def scratch(self, s=None):
        """A buffer allocated inside the window (of stream ``s``, drawn when None; not a
        window with a graph pool, whose one temporary ``capture`` makes), filled by the graph
        from a live buffer."""
        if s is None:
            opened = [w for w in sorted(self.windows) if not self.windows[w].pooled]
            if not opened:
                return None
            s = self.pick(opened)
        w = self.windows[s]
        src = self.pick(sorted(self.live))
        t = self.nbuf
        self.nbuf += 1
        self.ops.append(P.Empty(w.client, t, self.live[src]))
        self.live[t] = self.live[src]
        w.allocs.add(t)
        self._issue(P.Launch(w.client, self.cfg["copy32"], (src, t),
                             (("n", self.cfg["size"]),)))
        return t

    def replay(self, g=None):
        """``g.replay()`` of a made graph (``g``, drawn when None), once, twice, three times or
        17 times in a row (past the 16 launches and replays the cpu backend defers before it
        runs them: issue 26), ordered after the other streams' accesses to its buffers; inside
        a window of its stream, a refused replay."""
        g = self.pick(sorted(self.graphs)) if g is None else g
        info = self.graphs[g]
        if self.cfg["contract"] and info.required is None:
            return
        if info.stream in self.windows:
            # refused at once, marking the graph's write set (or run: see _maybe)
            if self.cfg["refusals"] and self._maybe(info.stream, info.uses, True):
                self.ops.append(P.Replay(self.windows[info.stream].client, g))
                self.windows[info.stream].refused = True   # invalidates the window
            return
        from hypothesis import strategies as st
        self._set_flags(info.stream)
        for _ in range(self.draw(st.sampled_from((1, 2, 1, 3, 17)))):
            if self._access(info.stream, info.uses, True):
                self.ops.append(P.Replay(info.stream, g))

    def handover(self):
        """A buffer created on one stream and freed at once (its write still pending), then a
        capture window on another stream allocates (the pool hands it that buffer), fills it
        from a live buffer, and its graph replays at once: the allocation must be ordered after
        the previous owner's work (issue 13's window-allocation fence)."""
        idle = self.idle_clients()
        if not self.live or len(self.live) >= self.cfg["buffers"] or not self.cfg["capture"]:
            return
        j = self.pick(idle)
        others = [k for k in idle if self.stream(k) != self.stream(j)]
        if not others:
            return
        k = self.pick(others)
        src = self.pick(sorted(self.live))
        t = self.create(j, self.live[src])
        self.ops.append(P.Free(j, t))
        del self.live[t]
        s = self.stream(k)
        self.ops += [P.Prepare(k), P.StartCapture(k)]
        self.windows[s] = _Window(k)
        self.scratch(s)
        self._end(s)
        if self.ngraph - 1 in self.graphs:
            self.replay(self.ngraph - 1)

    def release(self):
        g = self.pick(sorted(self.graphs))
        self.ops.append(P.Release(self.graphs.pop(g).stream, g))

    def clone(self):
        """``g2 = g.clone()``, and maybe ``g.release()`` at once (the clone keeps the backend
        graph alive)."""
        g = self.pick(sorted(self.graphs))
        info = self.graphs[g]
        c = self.ngraph
        self.ngraph += 1
        self.ops.append(P.Clone(info.stream, g, c))
        self.graphs[c] = _Graph(info.stream, info.uses, info.required, info.launches,
                                info.pooled)
        if self.flag():
            del self.graphs[g]
            self.ops.append(P.Release(info.stream, g))

    def refuse(self):
        """A call the capture window refuses: at once (read, sync, record_event, wait_event)
        or at ``stop_capture`` (a write, the free of a buffer the window uses)."""
        s = self.pick(sorted(self.windows))
        w = self.windows[s]
        kinds = ["read", "sync", "record", "write", "free"] + (["wait"] if self.events else [])
        kind = self.pick(kinds)
        if kind in ("read", "write") and not self.live:
            return
        if kind == "free":
            used = [b for b in sorted(w.uses) if b in self.live and b not in w.allocs]
            if used:                      # refused by every open window that uses it
                self._free(self.pick(used))
            return
        if kind == "read":              # refused at once: invalidates the window (CUDA's rule)
            b = self.pick(sorted(self.live))
            if self._maybe(s, {b: False}, False):
                self.ops.append(P.Read(w.client, b))
                w.refused = True
        elif kind == "sync":
            self.ops.append(P.Sync(w.client))
            w.refused = True
        elif kind == "record":
            self.ops.append(P.RecordEvent(w.client, self.nevent))
            self.nevent += 1              # never made: a wait on it is skipped
            w.refused = True
        elif kind == "wait":
            self.ops.append(P.WaitEvent(w.client, self.pick(sorted(self.events))))
            w.refused = True
        else:
            b = self.pick(sorted(self.live))
            if self._maybe(s, {b: True}, False):
                self.ops.append(P.Write(w.client, b, self.live[b], self.values(self.live[b])))
                w.refused = True

    # -- graphs that change (issue 27) ------------------------------------------------------
    def _flag(self, k, role: str):
        """The 1-element i32 condition (``role="if"``) or loop counter (``"loop"``) of client
        ``k``'s stream, made now when the stream is idle; None when there is none. A flag is
        only ever used on its own stream (no cross-stream ordering to keep)."""
        s = self.stream(k)
        b = self.flags.get((s, role))
        if b is None and s not in self.windows:
            b = self.nbuf
            self.nbuf += 1
            self.ops.append(P.CreateFlag(k, b, self.pick([0, 1]) if role == "if" else 0))
            self._access(s, {b: True}, False)
            self.flags[(s, role)] = b
        return b

    def _set_flags(self, s) -> None:
        """Maybe write new values to stream ``s``'s ``if`` condition (not while it records)."""
        b = self.flags.get((s, "if"))
        if b is not None and s not in self.windows and self.flag():
            if self._access(s, {b: True}, False):
                self.ops.append(P.Write(s, b, "i32", (self.pick([0, 1, 2]),)))

    def _body(self, k, most: int) -> tuple:
        from hypothesis import strategies as st
        w = self.windows.get(self.stream(k))
        fresh = {b for b, wr in w.uses.items() if wr} if w is not None else ()
        ops = [self._launch_op(k, self.pick(range(self.cfg["user_kernels"])), fresh)
               for _ in range(self.draw(st.integers(0, most)))]
        return tuple(op for op in ops if op is not None)

    def cond(self, k=None, loop=None):
        """``capture_if`` over a flag, or ``capture_while`` over a counter the op sets to at
        most ``max_iterations`` (so the loop always ends), with 0-2 of your launches per body:
        eager on an idle stream, recorded as a conditional node inside a window. ``k``,
        ``loop``: the client and the kind (drawn when None)."""
        if k is None:
            k = self.pick(range(self.cfg["clients"]))
        s = self.stream(k)
        if loop is None:
            loop = self.flag()
        b = self._flag(k, "loop" if loop else "if")
        if b is None:
            return
        if not loop:
            self._set_flags(s)
            then = self._body(k, 2)
            if then and self.flag():    # both branches rewrite the same buffers (ADV8): the
                last = then[-1]         # buffer counts as written whichever runs
                alt = self._launch_op(k, last.kernel)
                other = (last if alt is None else alt._replace(bufs=last.bufs),)
            else:
                other = self._body(k, 1)
            op = P.CaptureIf(k, b, then, other)
            uses = {b: False}
        else:
            m = self.pick([1, 2, 3])
            init = P.Launch(k, self.cfg["set_counter"], (b,), (("value", self.pick(range(m + 1))),))
            body = (P.Launch(k, self.cfg["count_down"], (b,), ()),) + self._body(k, 2)
            op = P.CaptureWhile(k, b, (init,), body, m)
            uses = {b: True}
        for launch in op.launches():
            spec = self.cfg["kernels"][launch.kernel]
            for buf, bind in zip(launch.bufs, spec.kernel.bindings):
                uses[buf] = uses.get(buf, False) or bind.access != "read"
        w = self.windows.get(s)
        if w is not None:
            if not self._maybe(s, uses, False):
                return
            for buf, wr in uses.items():
                w.uses[buf] = w.uses.get(buf, False) or wr
            w.launches.extend(op.launches())
        elif not self._access(s, uses, False, may_skip=True):
            return
        self.ops.append(op)

    def update(self):
        """``g.update(rebind={old: new})`` of a made graph whose stream is not recording:
        ``old`` one of its buffers, ``new`` a live buffer of the same dtype it does not use;
        half the time ``g.update(count={i: ...})`` instead (:meth:`update_count`)."""
        g = self.pick(sorted(self.graphs))
        info = self.graphs[g]
        if info.stream in self.windows or info.required is None:
            return
        if info.launches and self.flag():
            return self.update_count(g)
        flags = set(self.flags.values())
        olds = [b for b in sorted(info.uses) if b in self.live and b not in flags]
        if not olds:
            return
        old = self.pick(olds)
        news = [b for b, d in sorted(self.live.items())
                if d == self.live[old] and b not in info.uses]
        if news:
            new = self.pick(news)
        elif len(self.live) < self.cfg["buffers"] and self.idle_clients():
            new = self.create(dtype=self.live[old])
        else:
            return
        self.ops.append(P.Update(info.stream, g, old, new))
        info.launches = tuple(la._replace(bufs=tuple(new if b == old else b for b in la.bufs))
                              for la in info.launches)
        info.uses[new] = info.uses.pop(old)        # shared by its clones, like the graph
        info.required.discard(old)
        info.required.add(new)

    def instantiate(self):
        """``g2 = g.instantiate(rebind=..., stream=...)`` of a made graph whose buffers are all
        live: half the time rebinding one buffer (its state, an input or an output) to a live
        buffer of the same dtype it does not use, else sharing all of them (state included);
        on another idle stream when the graph uses no condition flag (a flag is used on its own
        stream only), else on its own. Then maybe a replay of the instance."""
        g = self.pick(sorted(self.graphs))
        info = self.graphs[g]
        if info.required is None or any(b not in self.live for b in info.required):
            return                       # (a freed caller-owned buffer: InvalidHandle)
        flags = set(self.flags.values())
        targets = [k for k in self.idle_clients() if self.stream(k) < self.S]
        if any(b in flags for b in info.uses) or info.pooled:    # (a pool graph's temporaries
            targets = [k for k in targets if self.stream(k) == info.stream]   # stay on its stream)
        if not targets:
            return
        k = self.pick(targets)
        old = new = -1
        olds = [b for b in sorted(info.uses) if b in self.live and b not in flags]
        if olds and self.flag():
            old = self.pick(olds)
            news = [b for b, d in sorted(self.live.items())
                    if d == self.live[old] and b not in info.uses]
            if not news:
                return
            new = self.pick(news)
        n = self.ngraph
        self.ngraph += 1
        self.ops.append(P.Instantiate(info.stream, g, n, old, new, k))

        def rb(b):
            return new if b == old else b
        uses = {}
        for b, wr in info.uses.items():
            uses[rb(b)] = uses.get(rb(b), False) or wr
        required = {rb(b) for b in info.required}
        if old != -1 and old not in info.required:   # the graph's own window buffer rebound to
            required.add(new)                        # a caller's: the instance needs it alive
        launches = tuple(la._replace(bufs=tuple(rb(b) for b in la.bufs))
                         for la in info.launches)
        self.graphs[n] = _Graph(self.stream(k), uses, required, launches, info.pooled)
        if self.flag():
            self.replay(n)

    def draw_third(self) -> bool:
        from hypothesis import strategies as st
        return self.draw(st.integers(0, 2)) == 0

    def update_count(self, g):
        """``g.update(count={i: (0, 1, 1)})`` (two times in three: launch ``i`` then runs
        nothing: what it writes keeps a failure mark, and it hides no later read,
        docs/contract.md section 4b), or back to the launch's own count. Not a loop's counter
        launches (the loop must end)."""
        info = self.graphs[g]
        idx = [i for i, la in enumerate(info.launches)
               if la.kernel not in (self.cfg["set_counter"], self.cfg["count_down"])]
        if not idx:
            return
        i = self.pick(idx)
        count = (0, 1, 1) if not self.draw_third() else normalize_count(
            self.cfg["kernels"][info.launches[i].kernel].count)
        self.ops.append(P.UpdateCount(info.stream, g, i, *count))

    def program(self) -> P.Program:
        for s in sorted(self.windows):
            self._end(s)
        final = [P.Sync(s) for s in range(self.S)] + [P.Read(0, b) for b in sorted(
            list(self.live) + list(self.flags.values()))]
        return P.Program(tuple(self.ops), tuple(final), self.cfg["kernels"], self.cfg["size"],
                         self.S, self.cfg["clients"], self.cfg["contract"])


def programs(kernels, buffers: int = 4, streams: int = 2, clients=None, capture: bool = True,
             *, size: int = 8, steps: int = 30, values=None, contract: bool = True,
             refusals: bool = True, failures: bool = False, pools: bool = True,
             partial: bool = True, indirect: bool = False):
    """A hypothesis strategy of ``Program`` s over your kernels.

    Args:
        kernels: ``runtime.Kernel`` s, or ``(kernel, params)`` / ``(kernel, params, count)``
            tuples, or ``KernelSpec`` s; params are values or hypothesis strategies, and a
            param ``n`` left out is ``size``. Each launch binds distinct live buffers whose dtype
            is the binding's.
        buffers: the most buffers alive at once.
        streams: streams (``StreamId`` s) of the program.
        clients: clients, each issuing from its own thread; client ``k`` is pinned to stream
            ``k % streams`` (default: one per stream).
        capture: include capture windows (``graph_prepare``, warm-up, ``start_capture``,
            recorded launches, window allocations, ``stop_capture``), replays, clones and
            releases; ``capture_if``/``capture_while`` (eager, and recorded as conditional
            nodes inside a window) over per-stream 1-element i32 flags and loop counters
            (``CreateFlag``; the builtins ``set_counter``/``count_down`` bound each loop by its
            ``max_iterations``); ``Graph.update(rebind=...)`` of a made graph, and
            ``Graph.update(count=...)`` setting a launch's count to 0 (it runs nothing: what it
            writes keeps a failure mark) or back; ``Graph.instantiate(rebind=..., stream=...)``:
            an independent graph of the same recording on the same or another stream, sharing
            every buffer (state included) or with one rebound.
        size: elements per buffer.
        steps: the most calls drawn (ordering calls the builder inserts come on top).
        values: ``{dtype: strategy of one element}``; default small integers (exact in f32).
        contract: keep the replay contract (see the module doc); ``False`` draws programs that
            may race or replay freed buffers (what ``check=True`` must flag).
        refusals: include calls a capture window refuses: at once (``read``, ``sync``,
            ``record_event``, ``wait_event``, a replay of a graph of that stream, which marks
            the graph's write set until a later write lands) or at ``stop_capture`` (a write,
            the free of a buffer the window uses, refused by every open window that uses it).
        failures: your kernels may raise (their cpu bodies, on some inputs; pass such kernels
            only with ``failures=True``). The model expects what the contract promises: the
            failed launch or replay marks what it would have written (a read raises
            ``ReplayFailed`` until a later write lands; a launch or replay reading it marks
            what it writes), the stream that issued it raises the ``LaunchError`` at its next
            blocking call, a failed warm-up makes ``start_capture`` raise. The builder then
            orders every call meant for a capture window as if it ran eagerly, with host syncs
            (the window may not have opened). Default False: with kernels that never raise,
            windows always open and calls inside them need no ordering, so the programs
            explore more of your windows' interleavings, and the failure shapes test the
            runtime's promises more than your code (the project's own property test turns them
            on, with a kernel that fails on some inputs).
        pools: with ``capture``, some windows are prepared with a ``runtime.GraphPool`` (one
            per stream: ``PreparePool``), whose graphs share their temporaries (docs/contract.md
            section 4c); such a window frees its allocations before ``stop_capture`` (a live
            one could be another pool graph's temporary) and its graphs are instantiated on
            their own stream only.
        partial: a launch of a kernel that declares the elements it writes
            (``Kernel(elements=...)``, every elementwise kernel's ``n``) whose ``n`` you leave
            out is drawn over all of each buffer, half of it or one element: a write over part
            of a buffer keeps its failure mark (the rest still holds what the failed writer
            left), and a graph that reads past the part it wrote reads the buffer as it found
            it, so that buffer is one of its sources (docs/contract.md section 4; ADV7).
        indirect: some launches outside capture windows are indirect (``LaunchIndirect``):
            their counts come from a per-stream u32 buffer (``[x, 1, 1, ...]``, x 0, 1 or 2;
            0 runs nothing and leaves what the launch writes as it was, its failure mark
            included) that the builtin ``set_counts`` may rewrite from an f32 buffer it reads,
            so a failure of that buffer's writer reaches the counts and what the launch
            writes (ADV8). cpu only (``set_counts`` has no GPU source); default False.
    Returns: a strategy of ``Program``.
    Raises: ``TypeError``/``ValueError`` for bad kernels or params (at the call).
    """
    from hypothesis import strategies as st

    cfg = config(kernels, buffers, streams, clients, capture, size=size, steps=steps,
                 values=values, contract=contract, refusals=refusals, failures=failures,
                 pools=pools, partial=partial, indirect=indirect)
    choices = _choices(_WEIGHT if contract else _WEIGHT_RACY)

    @st.composite
    def build(draw):
        b = Builder(draw, cfg)
        for _ in range(draw(st.integers(1, steps))):
            kind, allowed = b.pick(choices), b.kinds()
            if kind not in allowed:
                kind = "create" if "create" in allowed else None
            if kind is not None:
                getattr(b, kind)()
        return b.program()

    return build()


def config(kernels, buffers: int = 4, streams: int = 2, clients=None, capture: bool = True,
           *, size: int = 8, steps: int = 30, values=None, contract: bool = True,
           refusals: bool = True, failures: bool = False, pools: bool = False,
           partial: bool = False, indirect: bool = False) -> dict:
    """The checked arguments of ``programs()`` as the ``Builder`` 's configuration (a dict;
    ``pools`` and ``partial`` off unless asked: a scripted builder's choices stay those it was
    written for).
    Raises what ``programs()`` raises."""
    from hypothesis import strategies as st

    specs = [P.KernelSpec.of(k) for k in kernels]
    if not specs:
        raise ValueError("programs() needs at least one kernel")
    for spec in specs:
        if spec.kernel.cpu is None:
            raise ValueError(f"kernel {spec.kernel.name} has no cpu body: the model runs it")
        missing = [n for n in spec.kernel.param_names if n not in spec.params and n != "n"]
        if missing:
            raise ValueError(f"kernel {spec.kernel.name}: give params {missing} (values or "
                             f"strategies): pass KernelSpec({spec.kernel.name}, {{"
                             + ", ".join(f"{m!r}: ..." for m in missing) + "}) (runtime.testing),"
                             " or that (kernel, params) tuple, in kernels=")
    for name, v in (("buffers", buffers), ("streams", streams), ("size", size), ("steps", steps)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    clients = streams if clients is None else clients
    dtypes = sorted({b.dtype for s in specs for b in s.kernel.bindings})
    ints = st.integers(-8, 8)
    vals = {"f32": ints.map(float), "i32": ints, "u32": st.integers(0, 16)}
    vals.update(values or {})
    if indirect and size < 3:
        raise ValueError(f"indirect=True needs size >= 3 (three u32 counts), got {size}")
    return {"kernels": tuple(specs + [P.KernelSpec(P.copy32), P.KernelSpec(P.set_counter),
                                      P.KernelSpec(P.count_down),
                                      P.KernelSpec(P.set_counts, {"x": 0})]),
            "user_kernels": len(specs), "copy32": len(specs), "set_counter": len(specs) + 1,
            "count_down": len(specs) + 2, "set_counts": len(specs) + 3,
            "indirect": bool(indirect), "buffers": buffers, "streams": min(streams, clients),
            "clients": clients, "capture": capture, "size": size, "values": vals,
            "dtypes": dtypes, "contract": contract, "refusals": refusals, "failures": failures,
            "pools": bool(pools) and capture, "partial": bool(partial)}
