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
    ``fences`` it carries while free, ``pins`` (graphs retaining it) and ``orphan`` (its handle
    was freed while pinned: it goes back to the pool when the last pin drops)."""

    __slots__ = ("buf", "nbytes", "fences", "pins", "orphan")

    def __init__(self, buf, nbytes: int):
        self.buf, self.nbytes = buf, nbytes
        self.fences: dict = {}
        self.pins = 0
        self.orphan = False


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
        self.max_idle = MAX_IDLE if max_idle is None else int(max_idle)

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
                self.idle_bytes -= cls
                freed += cls
            if not lst:
                del self._free[cls]
            if self.idle_bytes <= keep:
                break
        self.bytes_reserved -= freed
        return freed
