"""Stream ids and the thread-end watcher (docs/contract.md section 3).

Below both the client and the server (CubeCL keeps its stream id below both too,
``cubecl-environment/src/stream/id.rs``): the client mints ids, the server reclaims a thread's
stream when the thread ends. Imports nothing of the runtime."""

from __future__ import annotations

import itertools
import os
import threading
import weakref

_ids = itertools.count(1)
_local = threading.local()
_watchers: "weakref.WeakSet" = weakref.WeakSet()
_watchers_lock = threading.Lock()


def watch_thread_ends(server) -> None:
    """Call ``server.thread_ended(sid)`` whenever a thread whose default stream ``sid`` was
    minted ends (held weakly; ``ComputeServer`` registers itself). The call runs on the ending
    thread and must not block."""
    with _watchers_lock:
        _watchers.add(server)


def _thread_ended(sid) -> None:
    with _watchers_lock:
        servers = list(_watchers)
    for server in servers:
        try:
            server.thread_ended(sid)
        except Exception:  # noqa: BLE001 - a closed server, interpreter shutdown
            pass


def _after_fork_in_child() -> None:
    global _watchers_lock
    _watchers_lock = threading.Lock()      # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _ThreadEnd:
    """Lives in the thread's ``threading.local`` only: finalized when the thread ends."""

    __slots__ = ("__weakref__",)


class StreamId(int):
    """The id of a logical stream: an in-order queue of device work.

    An unpinned client uses its calling thread's own stream (a fresh id per OS thread,
    ``StreamId.current()``); ``ComputeClient.set_stream`` pins a client to one. Work on different
    streams may run in any order and overlap unless ordered by an event (the server inserts
    those for ordinary operations; graph replays order only against their capture stream).
    """

    __slots__ = ()

    @classmethod
    def new(cls) -> "StreamId":
        """A fresh stream id, distinct from every other (thread-safe)."""
        return cls(next(_ids))

    @classmethod
    def current(cls) -> "StreamId":
        """The calling thread's own stream id (stable on one thread). When the thread ends,
        servers reclaim the stream once its work is done; the id is never minted again."""
        sid = getattr(_local, "sid", None)
        if sid is None:
            sid = _local.sid = cls(next(_ids))
            end = _local.end = _ThreadEnd()
            weakref.finalize(end, _thread_ended, sid).atexit = False
        return sid

    def __repr__(self):
        return f"StreamId({int(self)})"


class Event:
    """A point in one stream's work: everything enqueued on ``stream`` before
    ``ComputeClient.record_event()`` returned it (CUDA's ``cudaEventRecord``; CuPy's
    ``cupy.cuda.Event`` and Warp's ``wp.Event`` are objects too).

    Pass it to ``ComputeClient.wait_event`` of any client of the same server (same backend,
    device and options) to order that client's stream after it; a client of another server
    raises ``ValueError``. Users do not construct one.

    Attributes:
        stream: the ``StreamId`` it was recorded on.
        position: how many operations had been enqueued on that stream before it (an int).
    """

    __slots__ = ("stream", "position", "_server")

    def __init__(self, stream, position: int, server=None):
        self.stream = StreamId(stream)
        self.position = int(position)
        self._server = server

    def __iter__(self):
        """``stream, position = event``, as when ``record_event()`` returned a tuple
        (deprecated: read ``.stream`` and ``.position``)."""
        import warnings
        warnings.warn("unpacking an Event is deprecated; read event.stream and event.position",
                      DeprecationWarning, stacklevel=2)
        return iter((self.stream, self.position))

    def __repr__(self):
        return f"Event(stream={int(self.stream)}, position={self.position})"
