"""Stream ids and the thread-end watcher (docs/contract.md section 3).

Below both the client and the server (CubeCL keeps its stream id below both too,
``cubecl-environment/src/stream/id.rs``): the client mints ids, the server reclaims a stream once
the last id naming it is dropped (a per-request id, a thread's own id when the thread ended).
Imports nothing of the runtime."""

from __future__ import annotations

import itertools
import operator
import os
import threading
import weakref

_ids = itertools.count(1)
_local = threading.local()
_watchers: tuple = ()              # weakrefs of servers; replaced whole (read without a lock)
_watchers_lock = threading.Lock()


def watch_thread_ends(server) -> None:
    """Call ``server.stream_dropped(key)`` whenever the last reference to a minted stream id
    (``StreamId.new()``, or a thread's ``StreamId.current()`` once the thread ended) is dropped;
    ``key`` is the plain int id. Servers are held weakly; ``ComputeServer`` registers itself.
    The call runs inside a finalizer, on any thread: it must not block."""
    global _watchers
    with _watchers_lock:
        _watchers = tuple(r for r in _watchers if r() is not None) + (weakref.ref(server),)


def _dropped(key) -> None:
    """Tell every server that the stream ``key`` (a ``StreamId`` or int) can no longer be named.

    An asynchronous exception (a signal handler's: finalizers run on the main thread too) would
    lose the news, and the stream would be kept for ever: each server is told once more after
    one (a stream reported twice is reclaimed once), every other server still is, then the
    exception goes on."""
    interrupted = None
    for ref in _watchers:             # no lock: this runs in finalizers, even inside one
        for _ in (0, 1):
            try:
                server = ref()
                if server is not None:
                    server.stream_dropped(int(key))
                break
            except Exception:  # noqa: BLE001 - a closed server, interpreter shutdown
                break
            except BaseException as e:  # noqa: BLE001 - raised below
                interrupted = e
    if interrupted is not None:
        raise interrupted


def _after_fork_in_child() -> None:
    global _watchers_lock, _watchers
    _watchers_lock = threading.Lock()      # another thread may have held it at the fork
    _watchers = ()                         # the parent's servers are closed in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: the table ``current_key`` reads: ``THREAD_KEYS.key`` is the calling thread's stream key once
#: ``StreamId.current()`` ran on it (AttributeError before); read directly on a read's hot path
THREAD_KEYS = _local


def current_key() -> int:
    """The plain int id of the calling thread's own stream (``StreamId.current()``)."""
    try:
        return _local.key
    except AttributeError:
        StreamId.current()
        return _local.key


class StreamId(int):
    """The id of a logical stream: an in-order queue of device work.

    An unpinned client uses its calling thread's own stream (a fresh id per OS thread,
    ``StreamId.current()``); ``ComputeClient.set_stream`` pins a client to one. Work on different
    streams may run in any order and overlap unless ordered by an event (the server inserts
    those for ordinary operations; graph replays order only against their capture stream).

    Lifetime: an id minted here (``new()``, ``current()``) names its stream for as long as a
    reference to it lives (a pinned client, a ``Graph``, a ``StaticGraph``, the thread for
    ``current()``). Once the last one is dropped nobody can enqueue on the stream again: servers
    reclaim it as soon as nothing else uses it (its queued work ran, no graph was captured on it;
    an open capture on it is aborted; errors queued on it are raised by the next blocking call
    on any stream). An id is never minted twice. ``copy``/``deepcopy`` return the same object.
    ``StreamId(n)`` made from an int is a plain name: dropping it tells nobody, so a stream
    named only that way is kept until the server stops (mint ids with ``new()``).
    """

    __slots__ = ()

    def __new__(cls, value=0):
        # an integer only: StreamId(1.5) named stream 1 (another's), StreamId(inf) raised
        # OverflowError; operator.index takes ints and numpy integers, refuses the rest
        if value.__class__ is not int:
            if isinstance(value, bool):
                raise TypeError(f"StreamId takes an int, got {value!r}")
            try:
                value = operator.index(value)
            except TypeError:
                raise TypeError(f"StreamId takes an int, got {value!r}") from None
        return super().__new__(cls, value)

    @classmethod
    def new(cls) -> "StreamId":
        """A fresh stream id, distinct from every other (thread-safe)."""
        return _Minted(next(_ids))

    @classmethod
    def current(cls) -> "StreamId":
        """The calling thread's own stream id (stable on one thread). When the thread ends (and
        no other reference to the id lives), servers reclaim the stream."""
        sid = getattr(_local, "sid", None)
        if sid is None:
            sid = _local.sid = _Minted(next(_ids))
            _local.key = int(sid)
        return sid

    def __copy__(self):
        return self

    def __reduce__(self):
        return (StreamId, (int(self),))

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return f"StreamId({int(self)})"


class _Minted(StreamId):
    """A minted ``StreamId``: tells the servers when its last reference is dropped (an int
    subclass cannot be weakly referenced, hence ``__del__``)."""

    __slots__ = ()

    def __del__(self):
        try:
            _dropped(self)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_Minted.__name__ = _Minted.__qualname__ = "StreamId"   # pickles and prints as a StreamId


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
