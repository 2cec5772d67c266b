"""Stream ids (docs/contract.md section 3; CubeCL ``cubecl-environment/src/stream/id.rs``)."""

from __future__ import annotations

import itertools
import threading

_ids = itertools.count(1)
_local = threading.local()


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
        """The calling thread's own stream id (stable on one thread)."""
        sid = getattr(_local, "sid", None)
        if sid is None:
            sid = _local.sid = cls(next(_ids))
        return sid

    def __repr__(self):
        return f"StreamId({int(self)})"
