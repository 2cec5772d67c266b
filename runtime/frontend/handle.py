"""Handles: client-side references to server buffers (docs/contract.md sections 1-2)."""

from __future__ import annotations

import itertools

import numpy as np

from ..errors import InvalidHandle

_ids = itertools.count(1)


class Handle:
    """A reference to one device buffer owned by a server.

    Attributes:
        id: the handle id (minted here, so ``create`` returns without a round trip).
        nbytes: size in bytes.
        dtype, shape: how ``read`` interprets the bytes (``uint8``, ``(nbytes,)`` for raw bytes).

    ``np.asarray(handle)`` raises ``TypeError``: read it with ``client.read(handle)`` (as cupy's
    ``.get()``, torch's ``.cpu()``).

    Lifetime: Python's reference count is the handle's refcount; the last drop, or an explicit
    ``release()``, frees the buffer into the server's pool (fire-and-forget, on the stream the
    handle was created on). The pool reuses freed buffers: a graph that still uses a freed
    buffer reads or corrupts whatever lands there (seed 001: liveness).
    """

    __slots__ = ("id", "nbytes", "dtype", "shape", "_server", "_stream", "released", "_bindable",
                 "_flat", "__weakref__")

    def __init__(self, server, stream, nbytes: int, dtype, shape):
        self.id = next(_ids)
        self.nbytes = int(nbytes)
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self._flat = len(self.shape) == 1     # (a read returns the bytes' view as they are)
        self._server = server
        self._stream = stream
        self.released = False
        # the server while the handle is live and a kernel may bind it (4-byte or raw bytes):
        # the one identity test a launch makes per handle (ComputeClient.launch)
        self._bindable = server if self.dtype.itemsize in (1, 4) else None

    # copy.copy made a second Handle of the same buffer whose drop freed it under the first;
    # pickle and deepcopy failed with "cannot pickle '_thread.lock' object" (USER8)
    def __copy__(self) -> "Handle":
        """The handle itself: a handle names one buffer (a second one would free it)."""
        return self

    def __deepcopy__(self, memo):
        raise TypeError(f"handle {self.id} is a buffer on this process's device server: it "
                        "cannot be deep-copied; copy its contents with client.create("
                        "client.read(handle)), or share the handle (copy.copy returns it)")

    def __reduce__(self):
        raise TypeError(f"handle {self.id} is a buffer on this process's device server: it "
                        "cannot be pickled; send client.read(handle) (host data) and create it "
                        "in the other process")

    @property
    def size(self) -> int:
        """Number of elements (``nbytes // dtype.itemsize``)."""
        return self.nbytes // self.dtype.itemsize

    def release(self) -> None:
        """Free the buffer now (idempotent). Later use of this handle raises ``InvalidHandle``."""
        if not self.released:
            self.released = True
            self._bindable = None
            srv = self._server
            if not srv.closed:
                srv.release(srv.h_free, self._stream, self.id)

    def __del__(self):
        try:
            if not self.released:
                self.released = True
                self._bindable = None
                srv = self._server
                if not srv.closed:
                    srv.release(srv.h_free, self._stream, self.id)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _check(self, server, what: str) -> int:
        if self.released:
            raise InvalidHandle(f"{what}: handle {self.id} was released; it cannot be used again")
        if self._server is not server:
            if self._server.queue.forked_from is not None:
                raise self._server.queue.closed_error()       # a parent's handle, after fork
            raise InvalidHandle(f"{what}: handle {self.id} belongs to another server, "
                                f"{self._server.name}; this client's is {server.name} "
                                "(runtime.client() with another "
                                "backend, device or options, e.g. check=True, has a server of its "
                                "own); use a client of the handle's server, or copy it through "
                                "the host")
        return self.id

    def __array__(self, dtype=None, copy=None):
        # np.asarray(handle) would otherwise be a 0-d object array holding the handle: a
        # silent wrong answer. cupy (.get()) and torch (.cpu()) refuse implicit conversion too.
        raise TypeError(f"handle {self.id} is a device buffer, not host data: copy it with "
                        "client.read(handle) (blocks until its last write ran)")

    def __repr__(self):
        state = " released" if self.released else ""
        return f"Handle(id={self.id}, nbytes={self.nbytes}, dtype={self.dtype}, shape={self.shape}{state})"
