"""A timeline of the runtime: Chrome trace-event JSON for Perfetto and ``chrome://tracing``.

    with runtime.trace("run.json"):          # or RUNTIME_TRACE=run.json for a whole process
        ...

Lanes (the trace-event format's processes and threads):

- process "clients": one lane per client thread. Each API call is a slice named after its
  message (``launch``, ``read``, ``replay``...), containing ``queue wait`` (from the enqueue
  until the device thread started the handler) and ``wait`` (a blocking wait for the device:
  the copy of a read, a sync's completion). A flow arrow runs from each call to its handler.
- one process per server (``runtime-cpu:0``...): lane ``device thread`` holds each handler
  (whichever thread ran it: the device thread or a caller on the combining fast path, one at a
  time), and one lane per stream shows its work as executed: each launch, write and read copy
  on cpu (timed on the worker that ran it); inside a replay, one child slice per recorded
  launch on cpu and wgpu (on cpu a run of pointwise launches fused into one call is one slice,
  ``"<kernels> (N launches fused)"``); one slice per graph launch on cuda. An arrow runs from a handler to
  the work it enqueued (so ``replay()`` -> its handler -> the replay's execution), and from an
  event's record to the wait that released another stream (cpu: as executed; wgpu: the one
  queue orders them at submit, so the arrow joins the submits). On wgpu and cuda the stream
  lanes are host-side: encoding and submits (the device's own timing needs timestamp queries).
- instant events mark failures (a handler, a kernel or a blocking call that raised, with the
  error); counter tracks per server sample the queue length, the pool's bytes and the live
  streams (at most every millisecond).

Memory is bounded: the last ``capacity`` events are kept (a ring; default
:data:`DEFAULT_CAPACITY`, ``RUNTIME_TRACE_EVENTS=N``), and a slice whose begin fell out of the
ring is dropped when the file is written (``otherData.dropped`` counts them).

Cost when off: nothing. Tracing is switched on by swapping traced versions of the few hooked
methods into their classes (``DeviceQueue.submit``/``call``/``wait``, the backends' enqueue,
launch and replay verbs) and rebinding the live servers' cached methods; switching off puts the
originals back. No code path checks a flag while tracing is off.

:func:`validate` checks a trace against the trace-event format's rules (every ``B`` has its
``E`` on the same lane, slices nest per lane, each flow id has one start and one end, after
it); the tests and ``python -m runtime trace check FILE`` use it.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import json
import os
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

#: events a tracer keeps (the ring's length) unless told otherwise.
DEFAULT_CAPACITY = 200_000
#: seconds between two counter samples of one server.
COUNTER_PERIOD_S = 0.001
#: stream lanes a tracer remembers (``Tracer.stream_lane``); past it the oldest is forgotten.
MAX_STREAM_LANES = 4096
#: client lanes (calling threads) a tracer remembers (``Tracer.client_lane``); past it the oldest
#: is forgotten.
MAX_CLIENT_LANES = 4096
#: collected backends whose lane names a tracer keeps (for their events still in the ring).
MAX_GONE_BACKENDS = 64

_active = None                 # the Tracer while tracing is on
_env_path = None               # RUNTIME_TRACE's file while the tracer on is from_env's
_lock = threading.Lock()


def _handler_name(fn) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    inner = getattr(fn, "fn", None)                 # a wrapper (the queue's _Counted, ...)
    if name in ("_Counted", "_Sited", "__call__") and inner is not None:
        return _handler_name(inner)
    return name[2:] if name.startswith("h_") else name


def _owner_server(fn):
    """The server a message's handler belongs to (its bound ``self``), or None."""
    while fn is not None:
        srv = getattr(fn, "__self__", None)
        if srv is not None and hasattr(srv, "backend"):
            return srv
        fn = getattr(fn, "fn", None)
    return None


class Tracer:
    """Collects trace events in a ring and writes them as Chrome trace-event JSON.

    Args:
        capacity: events kept (the last ones; >= 1).
    Raises: ``ValueError`` (``capacity < 1``).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1 or capacity > sys.maxsize:
            raise ValueError(f"a trace keeps >= 1 events (at most sys.maxsize), got "
                             f"capacity={capacity}")
        self.capacity = capacity
        self.ring: collections.deque = collections.deque(maxlen=capacity)
        self.emitted = 0
        self._t0 = time.perf_counter_ns()
        self._ids = itertools.count(1)
        self._pids = itertools.count(2)
        self.names: dict = {(1, None): "clients"}     # (pid, tid or None) -> name
        self._clients: dict = {}                      # thread ident -> tid, bounded
        self._client_tids = itertools.count(1)
        self._backends: dict = {}                     # id(backend) -> pid
        self._streams: dict = {}                      # (pid, id(stream) or index) -> tid
        self._unindexed: dict = {}                    # pid -> last number given a stream
        self._events: dict = {}                       # id(event) -> (pid, tid, ts), bounded
        self._sampled: dict = {}                      # pid -> last counter sample (s)
        self._gone: collections.deque = collections.deque()   # pids of collected backends
        self.current = None                           # the handler running now (a _Message)
        self.pending: dict = {}                       # client lane -> (name, end) of its call

    # -- time and ids ----------------------------------------------------------------------
    def now(self) -> float:
        """Microseconds since the tracer started."""
        return (time.perf_counter_ns() - self._t0) / 1000.0

    def flow_id(self) -> int:
        return next(self._ids)

    # -- lanes -----------------------------------------------------------------------------
    def client_lane(self) -> tuple:
        """``(pid, tid)`` of the calling thread's client lane.

        Bounded by live work, not work done: past :data:`MAX_CLIENT_LANES` threads the oldest
        lane's entry and name are forgotten (a service calling from a thread per request would
        otherwise grow the table, and the trace's names, by one per thread the OS did not give
        a recycled ident; SOAK9 saw 22 -> 34 over 4 soak rounds)."""
        ident = threading.get_ident()
        tid = self._clients.get(ident)
        if tid is None:
            tid = self._clients[ident] = next(self._client_tids)
            self.names[(1, tid)] = threading.current_thread().name
            if len(self._clients) > MAX_CLIENT_LANES:
                old = next(iter(self._clients))
                self.names.pop((1, self._clients.pop(old)), None)
        return (1, tid)

    def backend_pid(self, backend, server_name: str | None = None) -> int:
        """The process of ``backend``'s lanes (named after its server once one is known)."""
        key = id(backend)
        pid = self._backends.get(key)
        if pid is None:
            pid = self._backends[key] = next(self._pids)
            self.names[(pid, 0)] = "device thread (handlers)"
            self.names[(pid, None)] = f"{getattr(backend, 'name', '?')} backend"
            try:                    # bounded by live backends, not servers made (SOAK6)
                weakref.finalize(backend, _backend_gone, weakref.ref(self), key, pid)
            except TypeError:       # not weakly referenceable: kept
                pass
        if server_name and self.names.get((pid, None), "").endswith(" backend"):
            self.names[(pid, None)] = server_name
        return pid

    def stream_lane(self, backend, stream) -> tuple:
        """``(pid, tid)`` of a backend stream's lane (``stream <index>``).

        Bounded by live work, not work done: past :data:`MAX_STREAM_LANES` streams the oldest
        lane's entry and name are forgotten (a service making a stream per request would
        otherwise grow the table, and the trace's names, by one per request; a stream seen
        again gets its lane back: cpu lanes are numbered by the stream's index)."""
        pid = self.backend_pid(backend)
        index = getattr(stream, "index", None)
        key = (pid, index if index is not None else id(stream))
        tid = self._streams.get(key)
        if tid is None:
            if index is None:
                n = self._unindexed[pid] = self._unindexed.get(pid, -1) + 1
            label = index if index is not None else n
            tid = self._streams[key] = 1000 + label
            self.names[(pid, tid)] = f"{getattr(backend, 'name', '?')} stream {label}"
            if len(self._streams) > MAX_STREAM_LANES:
                old, otid = next(iter(self._streams.items()))
                del self._streams[old]
                self.names.pop((old[0], otid), None)
        return (pid, tid)

    def forget_backend(self, key, pid) -> None:
        """A backend was collected: forget its id (ids are reused: a new backend must not take
        its lanes) and its counter time; its lane names stay for its events still in the ring,
        those of the oldest past :data:`MAX_GONE_BACKENDS` collected ones go."""
        if self._backends.get(key) == pid:
            del self._backends[key]
        self._sampled.pop(pid, None)
        self._gone.append(pid)
        if len(self._gone) > MAX_GONE_BACKENDS:
            old = self._gone.popleft()
            for k in [k for k in list(self.names) if k[0] == old]:
                self.names.pop(k, None)
            for k in [k for k in list(self._streams) if k[0] == old]:
                self._streams.pop(k, None)

    # -- events ----------------------------------------------------------------------------
    def emit(self, ph, name, lane, ts, dur=None, args=None, fid=None, bind=None, cat="runtime"):
        """Append one event: ``ph`` (``B``, ``E``, ``X``, ``i``, ``s``, ``t``, ``f``, ``C``),
        ``lane`` ``(pid, tid)``, ``ts``/``dur`` in µs."""
        self.ring.append((ph, name, lane[0], lane[1], ts, dur, args, fid, bind, cat))
        self.emitted += 1

    def instant(self, name, lane, args=None) -> None:
        """A thread-scoped instant event (a failure, a mark) at now."""
        self.emit("i", name, lane, self.now(), args=args)

    def sample(self, server, pid) -> None:
        """Counter events of ``server`` (queue length, pool bytes, live streams), at most every
        :data:`COUNTER_PERIOD_S`."""
        t = time.perf_counter()
        if t - self._sampled.get(pid, 0.0) < COUNTER_PERIOD_S:
            return
        self._sampled[pid] = t
        ts = self.now()
        try:
            q = server.queue
            self.emit("C", "queue", (pid, 0), ts, args={
                "messages": len(q._q), "host bytes": q.bytes})
            pool = server.pool
            self.emit("C", "pool bytes", (pid, 0), ts, args={
                "reserved": pool.bytes_reserved, "in use": pool.bytes_in_use})
            self.emit("C", "live streams", (pid, 0), ts, args={"streams": len(server.streams)})
        except Exception:  # noqa: BLE001 - a counter is a nicety; never break a handler
            pass

    def event_recorded(self, event, lane) -> None:
        """An event was recorded (executed) on ``lane``: remember where, for the arrow."""
        if len(self._events) > 4096:          # bounded by events still awaited
            self._events.pop(next(iter(self._events)))
        self._events[id(event)] = (lane, self.now())

    def event_waited(self, event, lane) -> None:
        """``lane`` went past a wait on ``event``: an arrow from its record, if known."""
        rec = self._events.get(id(event))
        ts = self.now()
        self.emit("X", "event wait", lane, ts, 0.0)
        if rec is not None:
            fid = self.flow_id()
            self.emit("s", "event", rec[0], rec[1], fid=fid)
            self.emit("f", "event", lane, ts, fid=fid, bind="e")

    # -- output ----------------------------------------------------------------------------
    def events(self) -> list:
        """The trace as a list of trace-event dicts (metadata first), repaired: a slice whose
        ``B`` or ``E`` fell out of the ring is dropped, as is a flow missing an end."""
        raw = list(self.ring)
        out, dropped = [], 0
        stacks: dict = {}
        keep = [True] * len(raw)
        for i, ev in enumerate(raw):
            ph, lane = ev[0], (ev[2], ev[3])
            if ph == "B":
                stacks.setdefault(lane, []).append(i)
            elif ph == "E":
                st = stacks.get(lane)
                if st:
                    st.pop()
                else:
                    keep[i] = False
                    dropped += 1
        for st in stacks.values():            # still open: close at the lane's last event
            for i in st:
                keep[i] = False
                dropped += 1
        flows: dict = {}
        for i, ev in enumerate(raw):
            if ev[0] in "stf" and keep[i]:
                flows.setdefault(ev[7], set()).add(ev[0])
        for i, ev in enumerate(raw):
            if ev[0] in "stf" and not {"s", "f"} <= flows.get(ev[7], set()):
                keep[i] = False
        for i, (ph, name, pid, tid, ts, dur, args, fid, bind, cat) in enumerate(raw):
            if not keep[i]:
                continue
            e = {"ph": ph, "name": name, "pid": pid, "tid": tid, "ts": round(ts, 3),
                 "cat": cat}
            if dur is not None:
                e["dur"] = round(max(dur, 0.0), 3)
            if args:
                e["args"] = args
            if fid is not None:
                e["id"] = fid
            if bind:
                e["bp"] = bind
            if ph == "i":
                e["s"] = "t"
            out.append(e)
        meta = []
        for (pid, tid), name in self.names.items():
            if tid is None:
                meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                             "args": {"name": name}})
            else:
                meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                             "args": {"name": name}})
        self.dropped = dropped + max(0, self.emitted - len(raw))
        return meta + out

    def write(self, path) -> Path:
        """Write the trace (``{"traceEvents": [...], ...}``) to ``path``; returns the path.

        Raises: ``OSError`` (the file cannot be written).
        """
        events = self.events()
        doc = {"traceEvents": events, "displayTimeUnit": "ms",
               "otherData": {"producer": "runtime.tracing", "capacity": self.capacity,
                             "emitted": self.emitted, "dropped": self.dropped}}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))
        return path


# -- the traced versions of the hooked methods -------------------------------------------------
class _Message:
    """A server message that draws its handler on the device lane, with the client's arrow."""

    __slots__ = ("tracer", "fn", "name", "fid", "started", "taken", "work", "__name__")

    def __init__(self, tracer, fn, name, fid, args=()):
        self.tracer, self.fn, self.name, self.fid = tracer, fn, name, fid
        self.started = None
        self.taken = False
        self.work = _work_name(name, args)
        self.__name__ = getattr(fn, "__name__", name)

    def __call__(self, *args):
        T = self.tracer
        srv = _owner_server(self.fn)
        pid = T.backend_pid(srv.backend, srv.name) if srv is not None else 1
        lane = (pid, 0)
        self.started = ts = T.now()
        T.emit("B", self.name, lane, ts)
        if self.fid is not None:
            T.emit("t", "call", lane, ts, fid=self.fid, bind="e")
        outer, T.current = T.current, self
        try:
            return self.fn(*args)
        except BaseException as e:
            T.instant(f"failure: {type(e).__name__}", lane, {"error": str(e)[:500]})
            raise
        finally:
            T.current = outer
            end = T.now()
            if self.fid is not None and not self.taken:
                T.emit("f", "call", lane, end, fid=self.fid, bind="e")
            T.emit("E", self.name, lane, end)
            if srv is not None:
                T.sample(srv, pid)


def _work_name(name: str, args) -> str:
    """What a message's device work is called on the stream lane (the kernel of a launch)."""
    try:
        if name == "launch":
            return args[1].name
        if name == "replay":
            return f"replay of graph {args[0]}"
    except (IndexError, AttributeError):
        pass
    return {"read": "read (copy out)", "write": "write (copy in)",
            "alloc": "create (copy in)"}.get(name, name)


def _flush_pending(T, lane=None) -> None:
    """Close the open call slice of ``lane`` (every lane: None): a call's slice stays open
    after it returned, so that the blocking wait after it (``DeviceQueue.wait``) joins it."""
    for ln in ([lane] if lane is not None else list(T.pending)):
        done = T.pending.pop(ln, None)
        if done is not None:
            T.emit("E", done[0], ln, done[1])


def _client_call(plain):
    """The traced ``DeviceQueue.call``/``submit``: the client's slice around ``plain``."""
    def traced(queue, fn, *args, **kw):
        T = _active
        if T is None:
            return plain(queue, fn, *args, **kw)
        lane = T.client_lane()
        _flush_pending(T, lane)
        name = _handler_name(fn)
        t0 = T.now()
        fid = T.flow_id()
        msg = _Message(T, fn, name, fid, args)
        T.emit("B", name, lane, t0)
        T.emit("s", "call", lane, t0, fid=fid)
        try:
            return plain(queue, msg, *args, **kw)
        except BaseException as e:
            T.instant(f"failure: {type(e).__name__}", lane, {"error": str(e)[:500]})
            raise
        finally:
            end = T.now()
            if msg.started is not None and msg.started > t0:
                T.emit("X", "queue wait", lane, t0, min(msg.started, end) - t0)
            T.pending[lane] = (name, end)         # a blocking wait may extend the call
    traced.__wrapped__ = plain
    traced.__name__ = plain.__name__
    traced.__doc__ = plain.__doc__
    return traced


def _queued_replay(server, gid: int):
    """The traced ``ComputeServer.replay``: through the (traced) ``DeviceQueue.call``, so every
    replay shows its client slice and its handler's (while tracing none runs at once)."""
    return server.queue.call(server.h_replay, gid)


def _queued_read(server, sid, hid: int, dtype=None):
    """The traced ``ComputeServer.read``: through the (traced) ``DeviceQueue.call``."""
    return server.queue.call(server.h_read, sid, hid, dtype)


def _queued_launch(server, *args):
    """The traced ``ComputeServer.launch``: through the (traced) ``DeviceQueue.submit``."""
    server.queue.submit(server.h_launch, *args)


def _client_wait(plain):
    """The traced ``DeviceQueue.wait``: a ``wait`` slice inside the call that asked for it."""
    def traced(queue, waitable, msg=None):
        T = _active
        if T is None:
            return plain(queue, waitable, msg)
        lane = T.client_lane()
        t0 = T.now()
        try:
            return plain(queue, waitable, msg)
        finally:
            end = T.now()
            T.emit("X", "wait", lane, t0, end - t0)
            if lane in T.pending:
                T.pending[lane] = (T.pending[lane][0], end)
    traced.__wrapped__ = plain
    traced.__name__ = plain.__name__
    traced.__doc__ = plain.__doc__
    return traced


class _Work:
    """A stream item's work, timed where it runs (a slice on the stream's lane)."""

    __slots__ = ("tracer", "lane", "name", "fid", "fn")

    def __init__(self, tracer, lane, name, fid, fn):
        self.tracer, self.lane, self.name, self.fid, self.fn = tracer, lane, name, fid, fn

    def __call__(self):
        T = self.tracer
        t0 = T.now()
        try:
            return self.fn()
        except BaseException as e:
            T.instant(f"failure: {type(e).__name__}", self.lane, {"error": str(e)[:500]})
            raise
        finally:
            end = T.now()
            T.emit("X", self.name, self.lane, t0, end - t0)
            if self.fid is not None:
                T.emit("f", "call", self.lane, t0, fid=self.fid, bind="e")


class _Child:
    """One recorded launch of a replay: a child slice on the stream's lane."""

    __slots__ = ("tracer", "lane", "name", "fn")

    def __init__(self, tracer, lane, name, fn):
        self.tracer, self.lane, self.name, self.fn = tracer, lane, name, fn

    def __call__(self, *args, **kw):
        T = self.tracer
        t0 = T.now()
        try:
            return self.fn(*args, **kw)
        finally:
            T.emit("X", self.name, self.lane, t0, T.now() - t0)


def _take(T):
    """``(name, flow id)`` of the running handler for the work it enqueues (first item only
    takes the arrow)."""
    msg = T.current
    if msg is None:
        return "work", None
    fid = None if msg.taken else msg.fid
    msg.taken = True
    return msg.work, fid


def _cpu_hooks():
    from .backends.cpu import CpuBackend as Cpu, CpuEvent
    from .backends.cpu_schedule import CALL, SIGNAL, WAIT
    plain_enqueue, plain_graph = Cpu._enqueue, Cpu.launch_graph

    def _enqueue(self, s, kind, payload, defer=False):
        T = _active
        if T is None:
            return plain_enqueue(self, s, kind, payload, defer)
        lane = T.stream_lane(self, s)
        if kind == WAIT:
            plain_enqueue(self, s, kind, payload, defer)
            return plain_enqueue(self, s, CALL,
                                 lambda ev=payload: T.event_waited(ev, lane), defer)
        if kind == SIGNAL:
            if isinstance(payload, CpuEvent):
                plain_enqueue(self, s, CALL,
                              lambda ev=payload: T.event_recorded(ev, lane), defer)
            return plain_enqueue(self, s, kind, payload, defer)
        name, fid = _take(T)
        if isinstance(payload, _Work):
            return plain_enqueue(self, s, kind, payload, defer)
        return plain_enqueue(self, s, kind, _Work(T, lane, name, fid, payload), defer)

    def launch_graph(self, stream, graph, mark=None):
        T = _active
        if T is None:
            return plain_graph(self, stream, graph, mark)
        lane = T.stream_lane(self, stream)
        if not graph.nodes:                      # nodes: one slice for the whole replay
            proxy = object.__new__(type(graph))
            for slot in type(graph).__slots__:
                setattr(proxy, slot, getattr(graph, slot))
            proxy.calls = tuple(_Child(T, lane, n, c) for c, n in zip(graph.calls, graph.names))
            graph = proxy
        # launch_graph pushes its replay to the scheduler itself (its _enqueue inlined): the
        # item is wrapped here, as _enqueue wraps the others (the owner alone pushes)
        sched = self.scheduler
        push = sched.push

        def traced(s, item, defer=False):
            kind, payload = item
            if kind != SIGNAL and kind != WAIT and not isinstance(payload, _Work):
                name, fid = _take(T)
                item = (kind, _Work(T, lane, name, fid, payload))
            return push(s, item, defer)
        sched.push = traced
        try:
            return plain_graph(self, stream, graph, mark)
        finally:
            del sched.push

    def not_now(self, *args):
        """While tracing, no work takes the fast paths (run at once on the caller's thread),
        so every launch, replay and copy shows as a slice on its stream's lane."""
        return None

    return Cpu, {"_enqueue": _enqueue, "launch_graph": launch_graph, "launch_now": not_now,
                 "launch_graph_now": not_now, "copy_out_now": not_now}


class _PassProxy:
    """A compute pass that draws each dispatch encoded through it as a child slice."""

    def __init__(self, cpass, tracer, lane, names):
        self._p, self._T, self._lane, self._names = cpass, tracer, lane, iter(names)
        self._t = tracer.now()

    def __getattr__(self, name):
        return getattr(self._p, name)

    def _dispatch(self, fn, *args):
        fn(*args)
        T, end = self._T, self._T.now()
        T.emit("X", f"{next(self._names, 'dispatch')} (encode)", self._lane, self._t,
               end - self._t)
        self._t = end

    def dispatch_workgroups(self, *xyz):
        self._dispatch(self._p.dispatch_workgroups, *xyz)

    def dispatch_workgroups_indirect(self, *args):
        self._dispatch(self._p.dispatch_workgroups_indirect, *args)


def _timed(plain, what):
    """A backend verb drawn as one slice on its stream's lane (host side)."""
    def traced(self, stream, *args, **kw):
        T = _active
        if T is None:
            return plain(self, stream, *args, **kw)
        lane = T.stream_lane(self, stream)
        name, fid = _take(T)
        t0 = T.now()
        try:
            return plain(self, stream, *args, **kw)
        finally:
            T.emit("X", what(name, args), lane, t0, T.now() - t0)
            if fid is not None:
                T.emit("f", "call", lane, t0, fid=fid, bind="e")
    traced.__wrapped__ = plain
    traced.__name__ = plain.__name__
    traced.__doc__ = plain.__doc__
    return traced


def _wgpu_hooks(Wgpu):
    plain_graph = Wgpu.launch_graph
    plain_record, plain_wait = Wgpu.record_event, Wgpu.wait_event

    def launch_graph(self, stream, graph, mark=None):
        T = _active
        if T is None:
            return plain_graph(self, stream, graph, mark)
        lane = T.stream_lane(self, stream)
        names = [t[4].name for t in getattr(graph, "tasks", ())]
        plain_pass = self._pass
        self._pass = lambda s: _PassProxy(plain_pass(s), T, lane, names)
        try:
            return plain_graph(self, stream, graph, mark)
        finally:
            del self._pass

    def record_event(self, stream):
        ev = plain_record(self, stream)
        T = _active
        if T is not None:
            lane = T.stream_lane(self, stream)
            T.emit("X", "record event", lane, T.now(), 0.0)
            T.event_recorded(ev, lane)
        return ev

    def wait_event(self, stream, event):
        plain_wait(self, stream, event)
        T = _active
        if T is not None:
            T.event_waited(event, T.stream_lane(self, stream))

    return {"launch": _timed(Wgpu.launch, lambda n, a: n),
            "launch_graph": _timed(launch_graph, lambda n, a: f"replay of {len(a[0].tasks)} "
                                                              "launches (encode + submit)"),
            "record_event": record_event, "wait_event": wait_event}


def _cuda_hooks(Cuda):
    return {"launch": _timed(Cuda.launch, lambda n, a: n),
            "launch_graph": _timed(Cuda.launch_graph, lambda n, a: "graph launch")}


# -- switching on and off -----------------------------------------------------------------------
_saved: list = []              # (class, name, original) while tracing is on


def _swap(cls, name, fn) -> None:
    _saved.append((cls, name, cls.__dict__[name]))
    setattr(cls, name, fn)


def _patch_backend(cls) -> None:
    """Swap the traced verbs into backend class ``cls`` (once)."""
    if any(c is cls for c, _, _ in _saved):
        return
    hooks = {}
    if cls.__name__ == "CpuBackend":
        hooks = _cpu_hooks()[1]
    elif cls.__name__ == "WgpuBackend":
        hooks = _wgpu_hooks(cls)
    elif cls.__name__ == "CudaBackend":
        hooks = _cuda_hooks(cls)
    for name, fn in hooks.items():
        _swap(cls, name, fn)


def _servers() -> list:
    from . import server
    return list(server._servers.values())


def _rebind(srv) -> None:
    """Point a server's cached ``submit``/``call``/``wait`` at its queue's current methods
    (only those still bound to the queue: a wrapper someone installed stays)."""
    q = srv.queue
    for name in ("submit", "call", "wait"):
        if getattr(getattr(srv, name, None), "__self__", None) is q:
            setattr(srv, name, getattr(q, name))


def _after_fork_in_child() -> None:
    # only the forking thread comes along: a parent thread inside start()/stop() (or a traced
    # backend_class) at the fork held _lock for ever, and the child's runtime.trace() and first
    # runtime.client() waited on it for ever
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class TracingActive(RuntimeError):
    """``start()`` while tracing is on already (``RUNTIME_TRACE``, a ``runtime.trace`` block or
    an earlier ``start()``): one tracer at a time per process. ``runtime.trace()`` never raises
    it: inside a running trace its block shares that trace."""


def start(capacity: int = DEFAULT_CAPACITY) -> Tracer:
    """Switch tracing on (process-wide) and return the new ``Tracer``.

    Raises: ``TracingActive`` (a ``RuntimeError``: tracing is on already; the message says
    what switched it on and how to share or stop it); ``ValueError`` (``capacity < 1``).
    """
    global _active
    from .backends.cpu import CpuBackend
    from .server.queue import DeviceQueue
    from .server.server import ComputeServer
    with _lock:
        if _active is not None:
            if _env_path is not None:
                raise TracingActive(
                    f"tracing is on already: RUNTIME_TRACE={_env_path} traces this whole "
                    "process (one tracer at a time): use runtime.trace(), whose block shares "
                    "that trace, or unset RUNTIME_TRACE to start one of your own")
            raise TracingActive(
                "tracing is on already (a runtime.trace block or runtime.tracing.start(); one "
                "tracer at a time): use runtime.trace(), whose block shares the running trace, "
                "or runtime.tracing.stop() the running one first")
        tracer = Tracer(capacity)
        _swap(ComputeServer, "replay", _queued_replay)
        _swap(ComputeServer, "read", _queued_read)
        _swap(ComputeServer, "launch", _queued_launch)
        _swap(DeviceQueue, "submit", _client_call(DeviceQueue.submit))
        _swap(DeviceQueue, "call", _client_call(DeviceQueue.call))
        _swap(DeviceQueue, "wait", _client_wait(DeviceQueue.wait))
        _patch_backend(CpuBackend)
        for mod, cls in (("runtime.backends.wgpu", "WgpuBackend"),
                         ("runtime.backends.cuda", "CudaBackend")):
            if mod in sys.modules:
                _patch_backend(getattr(sys.modules[mod], cls))
        _active = tracer
        for srv in _servers():
            _rebind(srv)
        _hook_backend_imports()
    return tracer


def stop() -> Tracer | None:
    """Switch tracing off (the originals go back); returns the tracer that was on, or None."""
    global _active, _env_path
    with _lock:
        tracer, _active, _env_path = _active, None, None
        while _saved:
            cls, name, fn = _saved.pop()
            setattr(cls, name, fn)
        for srv in _servers():
            _rebind(srv)
        if tracer is not None:
            _flush_pending(tracer)
    return tracer


def _hook_backend_imports() -> None:
    """Backends imported while tracing is on (wgpu, cuda load lazily) get their hooks too:
    ``runtime.server.backend_class`` is swapped like the methods (the caller holds _lock)."""
    from . import server
    plain = server.backend_class

    def backend_class(name):
        cls = plain(name)
        if _active is not None:
            with _lock:
                if _active is not None:
                    _patch_backend(cls)
        return cls
    backend_class.__wrapped__ = plain
    backend_class.__doc__ = plain.__doc__
    _swap(server, "backend_class", backend_class)


def active() -> Tracer | None:
    """The tracer while tracing is on, else None."""
    return _active


def _backend_gone(tracer_ref, key, pid) -> None:
    tracer = tracer_ref()
    if tracer is not None:
        tracer.forget_backend(key, pid)


@contextmanager
def trace(path=None, capacity: int = DEFAULT_CAPACITY):
    """Trace the runtime while the block runs; write Chrome trace-event JSON to ``path``.

    Args:
        path: the file written when the block ends (also when it raises); None writes nothing
            (read ``tracer.events()``).
        capacity: events kept, the last ones (a ring; memory stays bounded).
    Yields: the ``Tracer``.
    Raises: ``ValueError`` (``capacity < 1``); ``OSError`` (``path`` cannot be written).

    Inside a running trace (``RUNTIME_TRACE=FILE``, an outer ``runtime.trace`` block, another
    thread's block, ``runtime.tracing.start()``) the block shares it: it yields the running
    ``Tracer`` (``capacity`` is ignored), leaves tracing on when it ends, and ``path`` gets
    everything that tracer holds then, events from before the block included.

    Example: ``with runtime.trace("run.json"): ...`` then open run.json in
    https://ui.perfetto.dev or chrome://tracing.
    """
    if capacity < 1:
        raise ValueError(f"a trace keeps >= 1 events, got capacity={capacity}")
    try:
        tracer, own = start(capacity), True
    except TracingActive:
        tracer, own = _active, False
        if tracer is None:            # switched off in between: ours after all
            tracer, own = start(capacity), True
    try:
        yield tracer
    finally:
        if own:
            stop()
        if path is not None:
            tracer.write(path)


def from_env() -> None:
    """``RUNTIME_TRACE=FILE``: trace the whole process, written to FILE at exit
    (``RUNTIME_TRACE_EVENTS=N`` sets the ring's length). Called by ``import runtime``."""
    path = os.environ.get("RUNTIME_TRACE")
    if not path or _active is not None:
        return
    global _env_path
    from ._env import env_positive_int
    n = env_positive_int("RUNTIME_TRACE_EVENTS", DEFAULT_CAPACITY)   # a typo: a ValueError naming it
    tracer = start(n)
    _env_path = path                  # named by start()'s TracingActive; stop() clears it

    def write():
        stop()
        try:
            tracer.write(path)
        except OSError as e:
            print(f"runtime: RUNTIME_TRACE={path}: {e}", file=sys.stderr)
    atexit.register(write)


# -- checking a trace ---------------------------------------------------------------------------
def validate(doc) -> list:
    """Problems of a trace against the trace-event format; ``[]`` when it is well formed.

    ``doc``: the JSON object (``{"traceEvents": [...]}``) or the event list. Checked: every
    event has ``ph``, ``pid``, ``tid`` and a numeric ``ts`` (metadata: no ``ts`` needed);
    ``X`` has ``dur >= 0``; per lane (``pid``, ``tid``), in time order, every ``B`` has a
    matching ``E`` (same name) and slices (``B``/``E`` and ``X``) nest without partial
    overlap; every flow id has exactly one start ``s`` and one end ``f``, not before it, and
    any steps ``t`` in between. A document that is not a trace (no ``traceEvents`` list, an
    event that is not an object) is one problem saying so, never an exception.
    """
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        return [f"not a trace: expected {{\"traceEvents\": [...]}} or a list of events, got "
                f"{type(doc).__name__}" + (f" with keys {sorted(doc)[:5]}" if isinstance(doc, dict)
                                           else "")]
    problems = []
    lanes: dict = {}
    flows: dict = {}
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            problems.append(f"event {i} is not an object: {e!r}")
            continue
        ph = e.get("ph")
        if ph is None or "pid" not in e or "tid" not in e:
            problems.append(f"event {i} lacks ph/pid/tid: {e}")
            continue
        if ph == "M":
            continue
        if not isinstance(e.get("ts"), (int, float)):
            problems.append(f"event {i} has no numeric ts: {e}")
            continue
        lane = (e["pid"], e["tid"])
        if ph in ("B", "E", "X"):
            if ph == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
                problems.append(f"event {i}: X without dur >= 0: {e}")
                continue
            lanes.setdefault(lane, []).append((e["ts"], i, e))
        elif ph in ("s", "t", "f"):
            if "id" not in e:
                problems.append(f"event {i}: flow event without id: {e}")
                continue
            flows.setdefault(e["id"], []).append(e)
    for lane, evs in lanes.items():
        # order: by time; at equal times an E closes before a B/X opens, longer X first
        evs.sort(key=lambda t: (t[0], {"E": 0, "X": 1, "B": 2}[t[2]["ph"]],
                                -(t[2].get("dur") or 0), t[1]))
        stack: list = []                   # (name, end or None for B)
        eps = 1e-3
        for ts, i, e in evs:
            while stack and stack[-1][1] is not None and stack[-1][1] <= ts + eps:
                stack.pop()                # X slices that ended
            if e["ph"] == "E":
                if not stack or stack[-1][1] is not None:
                    problems.append(f"lane {lane}: E at {ts} ({e.get('name')}) with no open B"
                                    + (" (an X slice still open)" if stack else ""))
                    continue
                stack.pop()
            elif e["ph"] == "B":
                stack.append((e.get("name"), None))
            else:
                end = ts + e["dur"]
                if stack and stack[-1][1] is not None and end > stack[-1][1] + eps:
                    problems.append(f"lane {lane}: X {e.get('name')!r} [{ts}, {end}] overlaps "
                                    f"the enclosing slice {stack[-1][0]!r} ending at "
                                    f"{stack[-1][1]}")
                stack.append((e.get("name"), end))
        open_b = [name for name, end in stack if end is None]
        if open_b:
            problems.append(f"lane {lane}: B without E: {open_b}")
    for fid, evs in flows.items():
        starts = [e for e in evs if e["ph"] == "s"]
        ends = [e for e in evs if e["ph"] == "f"]
        if len(starts) != 1 or len(ends) != 1:
            problems.append(f"flow {fid}: {len(starts)} start(s) and {len(ends)} end(s)")
        elif ends[0]["ts"] + 1e-3 < starts[0]["ts"]:
            problems.append(f"flow {fid}: ends at {ends[0]['ts']} before it starts at "
                            f"{starts[0]['ts']}")
    return problems


def main(argv=None) -> int:
    """``python -m runtime trace check FILE...``: validate trace files; exit 1 on problems
    (a file that is not JSON or not a trace is one, named; the others are still checked)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: python -m runtime trace check FILE...\nvalidate Chrome trace-event JSON "
              "files: exit 0 when well formed, 1 on problems (each listed)")
        return 0
    if len(argv) < 2 or argv[0] != "check":
        print("usage: python -m runtime trace check FILE...", file=sys.stderr)
        return 2
    bad = 0
    for f in argv[1:]:
        try:                                    # (each file named; the rest still checked)
            doc = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            print(f"{f}: cannot be read as JSON: {type(e).__name__}: {e}")
            bad += 1
            continue
        problems = validate(doc)
        events = doc.get("traceEvents") if isinstance(doc, dict) else doc
        n = len(events) if isinstance(events, list) else 0
        print(f"{f}: {n} events, {len(problems)} problem(s)")
        for p in problems[:20]:
            print(f"  {p}")
        bad += bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
