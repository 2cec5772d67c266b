"""``runtime.GraphPool``: graphs that share their window allocations (docs/contract.md 4c)."""

from __future__ import annotations

import itertools
import threading

from .. import _fork

_ids = itertools.count(1)


class GraphPool:
    """A memory pool shared by the graphs captured into it (PyTorch ``graph_pool_handle``,
    vLLM's shared pool).

    Pass it to ``ComputeClient.graph_prepare(pool=p)`` (or ``runtime.capture(fn, pool=p)``):
    the buffers each graph's capture window allocates and drops (its temporaries) are retained
    by the graph as usual, but the next window of the same pool allocates from them instead of
    new memory, since graphs of one pool replay in order on one stream and a replay rewrites its
    temporaries before reading them. A set of bucket graphs then costs about what its largest
    member costs alone, not their sum.

    Rules (docs/contract.md section 4c):
    - one stream: every graph of a pool is captured (and so replays) on one stream, the stream
      of the first capture; ``graph_prepare(pool=p)`` on another stream while the pool has
      graphs raises ``GraphStateError``;
    - outputs: a buffer a graph's window allocated and still holds a live handle to (an output)
      may be a buffer another graph of the pool uses as a temporary: the next replay of that
      graph overwrites it. Read outputs right after the replay, on the pool's stream, or keep
      them in buffers allocated before ``graph_prepare`` (``runtime.capture(pool=...)`` copies
      its outputs into such buffers for you);
    - the checker (``check=True``) knows the sharing: a pool buffer used on another stream is a
      ``StreamRaceError``.

    Attributes:
        id: the pool id (process-unique int).
    One pool may serve one server at a time (the first that captures into it; after that server
    stopped, the next: a module-level pool keeps working after ``runtime.shutdown()`` and in a
    forked child). Cheap; thread-safe.
    """

    __slots__ = ("id", "_server", "_lock", "__weakref__")

    def __init__(self):
        self.id = next(_ids)
        self._server = None
        _fork.lock_for(self, "_lock", threading.Lock)  # (a forked child gets it afresh)

    def _bind(self, server) -> int:
        """Bind to ``server`` on first use; returns the id. Raises ``ValueError`` for another
        live server. A pool whose server stopped (``runtime.shutdown()``, or the parent's in a
        forked child) binds to the new one: its shared buffers went with the old server."""
        with self._lock:
            if self._server is None or (self._server is not server and self._server.closed):
                self._server = server
            elif self._server is not server:
                raise ValueError(f"GraphPool {self.id} belongs to server {self._server.name}; "
                                 "use one pool per device")
        return self.id

    def memory_usage(self) -> dict:
        """``{"id", "stream", "graphs", "bytes", "free_bytes", "high_water", "shared_bytes"}``:
        bytes its graphs share now, those free for the next window, the most ever shared
        (high-water mark) and the allocations it served from shared buffers so far (bytes).
        All zero before the first capture. Blocks (one round trip)."""
        srv = self._server
        if srv is None:
            return {"id": self.id, "stream": None, "graphs": 0, "bytes": 0, "free_bytes": 0,
                    "high_water": 0, "shared_bytes": 0}
        return srv.call(srv.h_graph_pool_usage, self.id)

    @property
    def nbytes(self) -> int:
        """Bytes the pool's graphs share now (``memory_usage()["bytes"]``)."""
        return self.memory_usage()["bytes"]

    def __del__(self):
        srv = self._server
        try:
            if srv is not None and not srv.closed:
                srv.release(srv.h_graph_pool_release, self.id)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self):
        return f"GraphPool(id={self.id})"
