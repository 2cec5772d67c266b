"""The size-class memory pool: freed buffers are reused, which is what makes liveness matter.

A freed buffer keeps *fences*: ``{stream id: position}`` of the last accesses made to it. The
handle that reuses it inherits them as writes, so the server orders its first use after every
earlier use on another stream (a stream-ordered allocator, like CUDA's ``cudaFreeAsync``).
Reuse is LIFO: the buffer freed last is handed out first.
"""

from __future__ import annotations

#: smallest size class in bytes.
MIN_BYTES = 256


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its size class: 256 B minimum, then 4 classes per power of two."""
    if nbytes <= MIN_BYTES:
        return MIN_BYTES
    step = 1 << max(0, (nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


class Slot:
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
    hardware graph refuses that inside a capture window).
    """

    def __init__(self, backend):
        self._backend = backend
        self._free: dict[int, list[Slot]] = {}
        self.bytes_reserved = 0
        self.bytes_in_use = 0

    def take(self, nbytes: int):
        cls = size_class(nbytes)
        lst = self._free.get(cls)
        if lst:
            slot = lst.pop()
            self.bytes_in_use += cls
            return slot, False
        slot = Slot(self._backend.alloc(cls), cls)
        self.bytes_reserved += cls
        self.bytes_in_use += cls
        return slot, True

    def give(self, slot: Slot, fences: dict) -> None:
        slot.fences = fences
        slot.orphan = False
        self.bytes_in_use -= slot.nbytes
        self._free.setdefault(slot.nbytes, []).append(slot)

    def cleanup(self) -> int:
        """Free every idle buffer to the backend; returns the bytes released. The server only
        calls it when no stream is inside a capture window."""
        freed = 0
        for lst in self._free.values():
            for slot in lst:
                self._backend.free(slot.buf)
                freed += slot.nbytes
            lst.clear()
        self.bytes_reserved -= freed
        return freed
