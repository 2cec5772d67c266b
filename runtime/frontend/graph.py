"""Graph: the clonable client-side handle of a captured graph (seed 001)."""

from __future__ import annotations

import threading

from ..errors import UnknownGraph


class _Owner:
    """Shared by every clone of one graph; the last release destroys the backend graph."""

    __slots__ = ("server", "id", "count", "lock")

    def __init__(self, server, gid):
        self.server, self.id, self.count = server, gid, 0
        self.lock = threading.Lock()

    def acquire(self):
        with self.lock:
            self.count += 1

    def drop(self):
        with self.lock:
            self.count -= 1
            last = self.count == 0
        if last and not self.server.closed:
            # enqueue only: the server destroys it after the work already enqueued against it
            self.server.post(self.server.h_graph_destroy, self.id)


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
        owner.acquire()
        self._owner = owner
        self.id = owner.id
        self.stream = stream
        self.is_hardware = is_hardware
        self._released = False

    def replay(self) -> None:
        """Replay the recorded launches on the capture stream.

        Blocks only until the device thread has accepted the enqueue (not until the device ran
        it); read an output or ``sync`` on the capture stream to wait for the results. Waits for
        room first while the device queue is full (design.md section 1).

        Returns: None.
        Raises:
            UnknownGraph: this clone was released, or the graph was destroyed.
            CaptureRefused: the capture stream is recording a graph right now.
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
        if srv.queue.full():             # a replay loop with no read cannot pile up work
            srv.queue.wait_room()
        return srv.call(srv.h_replay, self.id)

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
        """Server-side facts: launches recorded, read and write sets (handle ids), buffers
        retained. Blocks. Raises ``UnknownGraph``."""
        if self._released:
            raise UnknownGraph(f"graph {self.id}: this clone was released")
        srv = self._owner.server
        return srv.call(srv.h_graph_info, self.id)

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
