"""The size-class memory pool: freed buffers are reused, which is what makes liveness matter.

A freed buffer keeps *fences*: ``{stream id: position}`` of the last accesses made to it. The
handle that reuses it inherits them as writes, so the server orders its first use after every
earlier use on another stream (a stream-ordered allocator, like CUDA's ``cudaFreeAsync``).
Reuse is LIFO: the buffer freed last is handed out first.
"""

from __future__ import annotations

#: smallest size class in bytes.
MIN_BYTES = 256
#: default bound on the pool's idle bytes (``ComputeServer(max_idle_bytes=...)``).
MAX_IDLE = 1 << 30


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its size class: 256 B minimum, then 4 classes per power of two."""
    if nbytes <= MIN_BYTES:
        return MIN_BYTES
    step = 1 << max(0, (nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


class PooledBuffer:
    """One pooled device buffer: ``buf`` (backend object), ``nbytes`` (its size class), the
    ``fences`` it carries while free, ``pins`` (graphs retaining it), ``orphan`` (its handle
    was freed while pinned: it goes back to the pool when the last pin drops) and ``graph_pool``
    (the :class:`GraphPool` whose graphs share it, or None)."""

    __slots__ = ("buf", "nbytes", "fences", "pins", "orphan", "graph_pool")

    def __init__(self, buf, nbytes: int):
        self.buf, self.nbytes = buf, nbytes
        self.fences: dict = {}
        self.pins = 0
        self.orphan = False
        self.graph_pool = None


class Pool:
    """Size-class free lists over a backend's ``alloc``.

    ``take`` returns ``(slot, fresh)``: ``fresh`` is True when the backend had to allocate (a
    hardware graph refuses that inside a capture window). ``idle_bytes`` counts the free lists;
    ``trim`` gives the oldest idle buffers of the largest classes back to the backend.

    Args:
        backend: the ``Backend`` whose ``alloc``/``free`` it calls.
        max_idle: bound on idle bytes the server keeps (default ``MAX_IDLE``, 1 GiB).
    """

    def __init__(self, backend, max_idle: int | None = None):
        self._backend = backend
        self._free: dict[int, list[PooledBuffer]] = {}
        self.bytes_reserved = 0
        self.bytes_in_use = 0
        self.idle_bytes = 0
        try:
            self.max_idle = MAX_IDLE if max_idle is None else int(max_idle)
        except OverflowError:                               # inf
            raise ValueError(f"max_idle_bytes must be a number of bytes, got {max_idle!r}") \
                from None
        #: called with each slot :meth:`trim` gives back to the device (the checker forgets it)
        self.on_free = None

    def take(self, nbytes: int):
        """A slot of ``size_class(nbytes)``: reused (LIFO) or fresh. Raises ``OutOfMemory``."""
        cls = size_class(nbytes)
        lst = self._free.get(cls)
        if lst:
            slot = lst.pop()
            self.bytes_in_use += cls
            self.idle_bytes -= cls
            return slot, False
        slot = PooledBuffer(self._backend.alloc(cls), cls)
        self.bytes_reserved += cls
        self.bytes_in_use += cls
        return slot, True

    def give(self, slot: PooledBuffer, fences: dict) -> None:
        """Put ``slot`` on its free list carrying ``fences`` (``{stream id: position}``)."""
        slot.fences = fences
        slot.orphan = False
        self.bytes_in_use -= slot.nbytes
        self.idle_bytes += slot.nbytes
        self._free.setdefault(slot.nbytes, []).append(slot)

    def trim(self, keep: int = 0) -> int:
        """Free idle buffers to the backend (``Backend.free``), oldest of the largest classes
        first, until at most ``keep`` idle bytes remain; returns the bytes released. The server
        calls it only when no stream is prepared or capturing."""
        freed = 0
        for cls in sorted(self._free, reverse=True):
            lst = self._free[cls]
            while lst and self.idle_bytes > keep:
                slot = lst.pop(0)
                self._backend.free(slot.buf)
                if self.on_free is not None:
                    self.on_free(slot)
                self.idle_bytes -= cls
                freed += cls
            if not lst:
                del self._free[cls]
            if self.idle_bytes <= keep:
                break
        self.bytes_reserved -= freed
        return freed


class GraphPool:
    """The server side of a ``runtime.GraphPool``: window allocations shared by the graphs
    captured into it (issue 26 item 2; PyTorch's ``graph_pool_handle``, vLLM's shared pool).

    A graph keeps the buffers its capture window allocated (its temporaries) for as long as it
    lives. Graphs of one pool replay in order on one stream (``stream``: the stream of the
    first capture; a capture into the pool from another stream is refused), and a replay
    rewrites its temporaries before it reads them, so the temporaries of one graph can serve
    as the temporaries of the next: a buffer a graph of the pool retains whose handle was
    freed (an orphan) waits in ``free`` and is handed to the next window of the pool that
    allocates (best fit: the smallest free buffer at least as large), instead of a new one.
    Buffers whose handles are alive (a graph's outputs, its inputs) are never shared.

    Attributes:
        id: the pool id (``runtime.GraphPool.id``).
        stream: the stream id its graphs capture and replay on (None until the first capture).
        graphs: ids of its live graphs.
        slots: ``{id(slot): slot}``: buffers the pool's graphs share (retained by one of them).
        free: orphans of those, ready for the next window (``{size class: [slot]}``).
        bytes: bytes of ``slots``; ``high_water``: the most ``bytes`` ever reached.
    """

    __slots__ = ("id", "stream", "graphs", "slots", "free", "bytes", "high_water", "shared")

    def __init__(self, pid: int):
        self.id, self.stream = pid, None
        self.graphs: set = set()
        self.slots: dict = {}
        self.free: dict = {}
        self.bytes = self.high_water = 0
        self.shared = 0                 # bytes handed out again from ``free`` (reuse so far)

    def adopt(self, slot: PooledBuffer, share: bool = True) -> None:
        """Make ``slot`` (retained by a graph of this pool) one of its shared buffers; an
        orphan (its handle freed) is free for reuse at once unless ``share`` is False (another
        graph still reads it: ``ComputeServer._shareable``; it is given when that one goes)."""
        if slot.graph_pool is None:
            slot.graph_pool = self
            self.slots[id(slot)] = slot
            self.bytes += slot.nbytes
            self.high_water = max(self.high_water, self.bytes)
        if slot.orphan and share:
            self.give(slot)

    def give(self, slot: PooledBuffer) -> None:
        """``slot``'s handle was freed while graphs of the pool retain it: free for reuse."""
        lst = self.free.setdefault(slot.nbytes, [])
        if not any(x is slot for x in lst):
            lst.append(slot)

    def take(self, nbytes: int):
        """The smallest free buffer of at least ``size_class(nbytes)`` bytes (no longer an
        orphan: a handle holds it now), or None."""
        cls = size_class(nbytes)
        fits = [c for c in self.free if c >= cls and self.free[c]]
        if not fits:
            return None
        c = min(fits)
        slot = self.free[c].pop()
        if not self.free[c]:
            del self.free[c]
        slot.orphan = False
        self.shared += slot.nbytes
        return slot

    def drop(self, slot: PooledBuffer) -> None:
        """No graph of the pool retains ``slot`` any more: it leaves the pool."""
        if self.slots.pop(id(slot), None) is not None:
            self.bytes -= slot.nbytes
        lst = self.free.get(slot.nbytes)
        if lst:
            lst[:] = [x for x in lst if x is not slot]
            if not lst:
                del self.free[slot.nbytes]
        slot.graph_pool = None

    def usage(self) -> dict:
        """``{"id", "stream", "graphs", "bytes", "free_bytes", "high_water", "shared_bytes"}``
        (bytes; ``shared_bytes``: allocations served from the pool instead of new buffers)."""
        return {"id": self.id, "stream": None if self.stream is None else int(self.stream),
                "graphs": len(self.graphs), "bytes": self.bytes,
                "free_bytes": sum(sl.nbytes for lst in self.free.values() for sl in lst),
                "high_water": self.high_water, "shared_bytes": self.shared}
