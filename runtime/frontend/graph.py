"""Graph: the clonable client-side handle of a captured graph (seed 001)."""

from __future__ import annotations

import threading

from .. import _fork
from ..errors import UnknownGraph
from ..server.server import BUSY
from . import graph_text


class _Owner:
    """Shared by every clone of one graph; the last release destroys the backend graph."""

    __slots__ = ("server", "id", "count", "lock", "fallback_reason", "__weakref__")

    def __init__(self, server, gid):
        self.server, self.id, self.count = server, gid, 0
        _fork.lock_for(self, "lock", threading.Lock)   # (a forked child gets it afresh)
        self.fallback_reason = None      # set by Graph.update when the graph was rebuilt

    def acquire(self):
        with self.lock:
            self.count += 1

    def drop(self):
        if self.server.closed:  # nothing to release (also in a forked child, where a thread of
            return              # the parent may have held the lock at the fork: never taken)
        with self.lock:
            self.count -= 1
            if self.count == 0 and not self.server.closed:
                # enqueue only (never blocks): the server destroys it after the work already
                # enqueued against it. Inside the with: an asynchronous exception landing after
                # the lock's release (a signal handler's) can no longer lose it
                self.server.release(self.server.h_graph_destroy, self.id)


class Graph:
    """A captured graph: the recorded launch sequence, replayed against its original buffers.

    Users cannot construct one: ``ComputeClient.stop_capture()`` returns it (as CuPy's
    ``Graph`` comes only from stream capture). Cheap to ``clone()``: clones share one backend
    graph, destroyed when the last clone is released or dropped, after the replays already
    enqueued have run.

    Attributes:
        id: the ``GraphId`` (process-unique int); the backend graph never leaves the server.
        stream: the capture stream (``StreamId``); every replay runs there.
        is_hardware: True for a driver graph (cuda: one dispatch per replay), False for a
            software graph (cpu: the resolved launch list; wgpu: prebuilt dispatches re-encoded
            into one submit).

    Stream ordering (seed 001): a replay orders only against work on its capture stream. Write
    fresh inputs and read outputs on that stream (pin the client with ``set_stream(g.stream)``,
    or use one unpinned client on one thread); from another stream they race the replay.
    For a structured graph that does this for you, see ``runtime.StaticGraph``.
    """

    __slots__ = ("_owner", "id", "stream", "is_hardware", "_released", "__weakref__")

    def __init__(self, owner: _Owner, stream, is_hardware: bool):
        self._released = True           # (until counted below: __del__ drops nothing)
        self._owner = owner
        self.id = owner.id
        self.stream = stream
        self.is_hardware = is_hardware
        with owner.lock:                # counted and live together, no call in between: an
            owner.count += 1            # asynchronous exception cannot leave a count that no
            self._released = False      # clone will ever drop (the graph kept for ever)

    def replay(self) -> None:
        """Replay the recorded launches on the capture stream.

        Blocks only until the device thread has accepted the enqueue (not until the device ran
        it); read an output or ``sync`` on the capture stream to wait for the results. On the
        cpu backend a replay of a graph of numpy-call kernels (a ``bind``) each touching at
        most 1 MiB, on an idle server, is deferred instead (issue 26: cheaper than the
        enqueue): recorded, and run by the next call into the server from any thread before
        anything else that call does (at the latest when 16 are pending, or by the device
        thread within 20 ms when no call comes); tiny work (64 KiB touched in all, at most 4
        calls: a run of fused pointwise launches counts as one call plus its work) runs at once
        on that thread when its stream is idle, the rest is enqueued then; failures are
        reported as failures found at execution. Waits for room afterwards while the device
        queue is full (docs/contract.md section 1).

        Returns: None.
        Raises:
            UnknownGraph: this clone was released, or the graph was destroyed.
            CaptureRefused: the capture stream is recording a graph right now (that window is
                invalidated: its ``stop_capture`` raises too).
            ServerClosed: the server stopped.
            The backend's refusal (e.g. ``UnsupportedError``).
            Any failure is also recorded on the graph's write set: reading one of those buffers
            raises ``ReplayFailed`` until a replay of this graph lands.
        Safety (seed 001): until the replay's work completes, every buffer the graph touches
            must stay alive, no other stream may use them, and refreshes/reads must be issued
            on the capture stream. ``runtime.client(..., check=True)`` verifies all three.
        See also: ``cudaGraphLaunch`` (cuda), CubeCL ``Graph::replay``.
        """
        if self._released:
            raise UnknownGraph(f"replay of graph {self.id}: this clone was released")
        srv = self._owner.server
        room = srv.replay(self.id)
        if room is BUSY:                # the server was not idle: queued like any call
            room = srv.call(srv.h_replay, self.id)
        if room and srv.queue.full():
            srv.queue.wait_room()        # a replay loop with no read cannot pile up work


    def clone(self) -> "Graph":
        """Another handle to the same backend graph (no copy).

        Raises: ``UnknownGraph`` if this clone was released.
        """
        if self._released:
            raise UnknownGraph(f"clone of graph {self.id}: this clone was released")
        return Graph(self._owner, self.stream, self.is_hardware)

    def release(self) -> None:
        """Release this clone (idempotent); the last release destroys the backend graph once
        the replays already enqueued have finished."""
        if not self._released:
            self._released = True
            self._owner.drop()

    def info(self) -> dict:
        """Server-side facts: ``{"id", "stream", "launches" (recorded, a count), "reads",
        "writes" (handle ids: every buffer bound, and the write set), "retained" (window
        allocations the graph keeps alive), "pinned" (buffers it holds out of the pool,
        caller-owned ones included: ``describe()["retained"]``)}``. Blocks. Raises
        ``UnknownGraph``."""
        if self._released:
            raise UnknownGraph(f"graph {self.id}: this clone was released")
        srv = self._owner.server
        return srv.call(srv.h_graph_info, self.id)

    def memory_usage(self) -> dict:
        """``{"nbytes", "own_bytes", "pool", "pool_bytes", "pool_share", "used_bytes"}``: the
        bytes this graph keeps alive (``nbytes`` = its window's buffers no pool shares + its
        share of its ``GraphPool``'s buffers, ``pool_bytes / graphs of the pool``), the pool id
        or None, and the bytes of every buffer it binds (``used_bytes``: caller-owned buffers
        too, e.g. a model's shared scratch, which ``nbytes`` does not count since the caller
        keeps them alive). Blocks. Raises ``UnknownGraph``."""
        srv = self._srv("memory_usage")
        return srv.call(srv.h_graph_memory, self.id)

    @property
    def nbytes(self) -> int:
        """Bytes this graph keeps alive: its own window allocations and its share of a pool
        (``memory_usage()["nbytes"]``). Blocks. Raises ``UnknownGraph``."""
        return self.memory_usage()["nbytes"]

    # -- graphs that change (docs/contract.md section 4b) ----------------------------------------
    def _srv(self, what: str):
        if self._released:
            raise UnknownGraph(f"{what} of graph {self.id}: this clone was released")
        return self._owner.server

    @property
    def fallback_reason(self):
        """None, or why the last ``update`` rebuilt the graph instead of patching it in place
        (cuda: the instantiated graph recaptured from its recording); None again after an
        update that patched in place."""
        return self._owner.fallback_reason

    def launches(self) -> list:
        """The recorded launches in recording order, as plain data (printable, JSON-able).

        Returns: a list of ``{"index": int, "kernel": name, "bindings": [{"name", "access"
            ("read" | "read_write" | "write", as the kernel declares it), "dtype" ("f32" |
            "i32" | "u32"), "handle": handle id, "nbytes": int}], "params": {name: value},
            "count": [x, y, z] (workgroups) or
            {"indirect": handle id}, "scope": [[node index, "then" | "else" | "body"], ...]}``;
            launches inside ``capture_if``/``capture_while`` bodies are listed in place, with
            their scope. The index is what ``update(params=, count=)`` takes.
        Raises: ``UnknownGraph`` (released or destroyed). Blocks (one round trip).
        """
        srv = self._srv("launches")
        return srv.call(srv.h_graph_launches, self.id)

    def describe(self) -> dict:
        """The graph as plain data: ``{"id", "stream", "backend", "hardware", "launches"
        (as :meth:`launches`, each binding also naming its ``"buffer"`` label), "nodes" (the
        conditional nodes: ``{"index", "kind" ("if" | "while"), "cond" (handle id),
        "cond_buffer", "max_iterations", "scope"}``), "buffers" (``{"buffer": "b0", "handle",
        "nbytes", "dtype", "access" ("read", or "read_write" for a buffer the graph writes
        through any binding), "freed"}`` in first-use order), "reads" (handle ids of every
        buffer the graph binds, written ones included), "writes" (those it writes: the write
        set), "retained" (how many buffers the graph pins: held out of the pool while it
        lives, its window allocations and the caller-owned buffers it binds alike; only the
        former does it keep alive, a caller-owned one freed still makes a replay raise
        ``LivenessError`` unless captured with ``retain=True``; ``info()["pinned"]``),
        "retained_bytes" (their bytes), "fallback_reason"}``. ``str(g)`` prints it as a table
        whose header says "N buffers pinned".

        Buffer labels ``b0, b1, ...`` follow first use, so two recordings of the same work give
        the same launches, nodes and buffers on every backend (only ids, stream and backend
        differ). Raises: ``UnknownGraph``. Blocks.
        """
        srv = self._srv("describe")
        return srv.call(srv.h_graph_describe, self.id)

    def to_dot(self) -> str:
        """Graphviz DOT of the graph: launches as boxes, data dependencies as edges labelled
        with the buffer (an edge from the launch that last wrote it), buffers first read
        from outside the graph as ellipses, ``capture_if``/``capture_while`` bodies as
        clusters under a diamond for their condition. The same text on every backend for the
        same recording (no ids). Raises: ``UnknownGraph``."""
        return graph_text.to_dot(self.describe())

    def __str__(self):
        try:
            return graph_text.table(self.describe())
        except Exception:  # noqa: BLE001 - released, destroyed, server closed: say what it is
            return repr(self)

    def update(self, rebind=None, params=None, count=None) -> None:
        """Change the recorded graph for the replays enqueued after this call, without
        recapturing (CUDA ``cudaGraphExecKernelNodeSetParams`` / ``cudaGraphExecUpdate``).

        Args:
            rebind: ``{old Handle: new Handle}``: every use of ``old`` (bindings, indirect
                counts, conditions) now uses ``new``; same ``nbytes`` and ``dtype``.
            params: ``{launch index: {"name": value}}``: new values for some params.
            count: ``{launch index: (x, y, z)}``: new workgroup counts (an indirect launch
                becomes a static one).
        Ordering: applied on the server in queue order, like a replay on the capture stream: a
            replay enqueued before it runs the old graph, one enqueued after it the new one;
            never a mix, never racing a replay in flight.
        All or nothing: any error leaves the graph unchanged.
        Follows the new bindings: the read and write sets (failure marks, ``ReplayFailed``),
            liveness (freeing a new caller-owned handle breaks the graph, not the old one),
            retained buffers, the checker, and the cross-stream fences of the new buffers.
        Backends: cpu and wgpu patch the software graph (wgpu rebuilds only the bind groups and
            uniforms that changed); cuda patches the instantiated graph's kernel nodes in place
            (``cuGraphExecKernelNodeSetParams``) where it can, else rebuilds the graph from its
            recording and says why in :attr:`fallback_reason` (None after an update that
            patched in place).
        Raises: ``TypeError`` (not Handles / dicts; a param value that is not a number, as
            ``launch`` raises); ``ValueError`` (a rebind changing nbytes or dtype, a handle the
            graph does not use, an index out of range, an unknown param name, a value out of
            its dtype's range); ``UnknownGraph``; ``CaptureRefused`` (the capture stream is
            recording); ``InvalidHandle`` (a released handle).
        """
        srv = self._srv("update")
        rb = _rebind_ids(srv, rebind, "update")
        for what, table in (("params", params), ("count", count)):
            if table is not None and not isinstance(table, dict):
                raise TypeError(f"update of graph {self.id}: {what} must be a dict "
                                f"{{launch index: ...}}, got {type(table).__name__}")
        reason = srv.call(srv.h_graph_update, self.id, rb, dict(params or {}),
                          dict(count or {}))
        self._owner.fallback_reason = reason

    def instantiate(self, rebind=None, stream=None) -> "Graph":
        """A new, independent ``Graph`` from this recording against other buffers: no warm-up,
        no capture (e.g. one graph per client's own KV cache).

        Args:
            rebind: ``{old Handle: new Handle}`` as in :meth:`update`.
            stream: the new graph's capture stream (a ``StreamId``; default: this graph's).
                Buffers not rebound are shared with this graph: replays on another stream must
                not overlap a replay of this one (seed 001: no concurrent use). An instance
                that keeps temporaries of this graph's ``GraphPool`` joins the pool and must
                stay on the pool's stream (the pool's graphs rewrite those buffers in order).
        Returns: a ``Graph`` (its own id, released independently).
        Raises: as :meth:`update`; ``InvalidHandle`` when a caller-owned handle it would use
            was freed and is not rebound; ``GraphStateError`` for an instance on another stream
            that would keep buffers of this graph's pool.
        """
        from ..streams import StreamId

        srv = self._srv("instantiate")
        rb = _rebind_ids(srv, rebind, "instantiate")
        if stream is not None and not isinstance(stream, StreamId):
            raise TypeError(f"instantiate: stream must be a StreamId, got {stream!r}")
        target = self.stream if stream is None else stream    # the Graph keeps its StreamId
        gid, _, hw = srv.call(srv.h_graph_instantiate, self.id, rb, int(target))
        return Graph(_Owner(srv, gid), target, hw)

    def __copy__(self) -> "Graph":
        """:meth:`clone` (a plain copy would share this reference's count and release the
        graph under it when dropped)."""
        return self.clone()

    def __deepcopy__(self, memo):
        raise TypeError(f"graph {self.id} lives on this process's device server: it cannot be "
                        "deep-copied (it records launches on these buffers); clone() gives "
                        "another reference, instantiate(rebind=...) a copy on other buffers")

    def __reduce__(self):
        raise TypeError(f"graph {self.id} lives on this process's device server: it cannot be "
                        "pickled; capture it again in the other process")

    def __del__(self):
        try:
            if not self._released:
                self._released = True
                self._owner.drop()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self):
        kind = "hardware" if self.is_hardware else "software"
        state = ", released" if self._released else ""
        return f"Graph(id={self.id}, stream={int(self.stream)}, {kind}{state})"


def _rebind_ids(srv, rebind, what: str) -> dict:
    """``{old Handle: new Handle}`` as ``{old id: new id}``, checked at the call.

    Raises: ``TypeError`` (not a dict of Handles); ``ValueError`` (nbytes or dtype differ);
    ``InvalidHandle`` (the new handle is released or from another server).
    """
    from .handle import Handle

    if rebind is None:
        return {}
    if not isinstance(rebind, dict):
        raise TypeError(f"{what}: rebind must be a dict {{old Handle: new Handle}}, got "
                        f"{type(rebind).__name__}")
    out = {}
    for old, new in rebind.items():
        if not (isinstance(old, Handle) and isinstance(new, Handle)):
            raise TypeError(f"{what}: rebind maps Handles to Handles, got "
                            f"{type(old).__name__} -> {type(new).__name__}")
        if old.nbytes != new.nbytes or old.dtype != new.dtype:
            raise ValueError(f"{what}: rebind of handle {old.id} ({old.nbytes} bytes of "
                             f"{old.dtype}) to handle {new.id} ({new.nbytes} bytes of "
                             f"{new.dtype}): a rebind must keep nbytes and dtype")
        out[old.id] = new._check(srv, f"{what} (rebind)")
    return out
