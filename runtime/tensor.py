"""``runtime.Tensor``: a device buffer with a shape, and ops that launch library kernels.

A thin layer over a client so a model reads like a model::

    x = embedding(ids, types, word, pos, ttab).layer_norm(g, b)
    qkv = x.matmul(w_qkv, b_qkv)                      # [B, S, 3H]
    x = qkv.attention(mask, heads=12).matmul(w_o, b_o).layer_norm(g1, b1, residual=x)

Every op enqueues one kernel launch on the tensor's client (fire-and-forget, on that client's
stream) and returns a new ``Tensor`` for the output; nothing blocks until ``numpy()``. Tensors are
dense, row-major, ``f32`` (``i32`` for token ids). Ops never write their inputs, so a tensor can be
used any number of times.

Output buffers come from ``client.empty`` and are freed when the last ``Tensor`` (or view) of
them is dropped -- or, inside ``with arena:``, from an :class:`Arena`, which keeps dropped buffers
for reuse. Running the same code twice under one arena then reuses the same buffers, which is what
capture needs: the warm-up run fills the arena and the recorded run allocates nothing new (see
``runtime.models.minilm``).
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

from . import kernels as K
from .frontend import Handle
from .kernel import DTYPES

#: the kernel dtypes a Tensor may have (``runtime.kernel.DTYPES`` less ``u32``).
TENSOR_DTYPES = {d: DTYPES[d] for d in ("f32", "i32")}
_local = threading.local()


class Arena:
    """A pool of device buffers for tensor outputs, reused by size.

    Args:
        client: the ``ComputeClient`` whose ``empty`` makes new buffers.
        best_fit: hand out the smallest free buffer at least as large as asked (a tensor may
            live in a larger buffer), not only one of the same size: one arena then serves
            work of several shapes, e.g. the bucket graphs of a model sharing a
            ``runtime.GraphPool`` (capture the largest first and the others fit in its buffers).

    ``with arena:`` makes it the current arena of this thread: tensor ops then take their output
    buffers from its free lists (same ``nbytes``), or allocate and remember new ones. A tensor
    made under the arena gives its buffer back when its last view is dropped (CPython's reference
    counting makes this deterministic, so the same code run twice asks for the same buffers).
    Buffers stay allocated until :meth:`release`.
    """

    def __init__(self, client, best_fit: bool = False):
        self.client = client
        self.best_fit = bool(best_fit)
        self._free: dict[tuple, list] = {}
        self._all: list[Handle] = []

    def __enter__(self) -> "Arena":
        stack = getattr(_local, "arenas", None)
        if stack is None:
            stack = _local.arenas = []
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _local.arenas.pop()

    def take(self, shape, dtype) -> Handle:
        """A buffer of ``prod(shape)`` elements of ``dtype`` (reused when one is free)."""
        key = (int(np.prod(shape, dtype=np.int64)), np.dtype(dtype).str)
        free = self._free.get(key)
        if free:
            return free.pop()
        if self.best_fit:
            need = key[0] * np.dtype(dtype).itemsize
            fits = [(h.nbytes, k) for k, lst in self._free.items() if lst
                    for h in lst[-1:] if h.nbytes >= need]
            if fits:
                return self._free[min(fits)[1]].pop()
        h = self.client.empty(shape, dtype)
        self._all.append(h)
        return h

    def give_back(self, handle: Handle) -> None:
        """Return ``handle`` (taken from this arena) to the free list."""
        self._free.setdefault((handle.size, handle.dtype.str), []).append(handle)

    @property
    def nbytes(self) -> int:
        """Bytes held by this arena (free or in use)."""
        return sum(h.nbytes for h in self._all)

    def trim(self, keep=()) -> int:
        """Free the arena's idle buffers (those no live tensor holds) but the handles whose
        ids are in ``keep``; returns the bytes freed.

        A graph that recorded work on a buffer keeps it alive (``runtime.capture`` retains what
        its recording used), so trimming never breaks a live graph; it bounds the arena by the
        work still live instead of every shape it ever served: ``runtime.models.MiniLM`` trims
        all but its live bucket graphs' buffers (``keep``, shared on) when it evicts one.
        Later tensors of a size no longer free allocate afresh."""
        keep = set(keep)
        freed, gone = 0, set()
        for key in list(self._free):
            stay = [h for h in self._free[key] if h.id in keep]
            for h in self._free[key]:
                if h.id not in keep:
                    freed += h.nbytes
                    gone.add(id(h))
                    h.release()
            if stay:
                self._free[key] = stay
            else:
                del self._free[key]
        self._all = [h for h in self._all if id(h) not in gone]
        return freed

    def release(self) -> None:
        """Free every buffer of the arena (tensors still using them must not be used again)."""
        for h in self._all:
            h.release()
        self._all.clear()
        self._free.clear()


class _Buffer:
    """Owner of one handle shared by a tensor and its views; gives it back to its arena."""

    __slots__ = ("handle", "arena")

    def __init__(self, handle, arena):
        self.handle, self.arena = handle, arena

    def __del__(self):
        if self.arena is not None:
            try:
                self.arena.give_back(self.handle)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class Tensor:
    """A dense row-major device tensor: a ``Handle`` plus a shape and a dtype.

    Attributes:
        client: the ``ComputeClient`` its ops launch through (and whose stream orders them).
        handle: the device buffer (``Handle``); may be larger than the tensor.
        shape: tuple of ints; dtype: ``"f32"`` or ``"i32"``.

    Build one with :meth:`from_numpy` or :meth:`empty`; read it with :meth:`numpy`
    (``np.asarray(tensor)`` raises ``TypeError``: the copy to the host is explicit, as cupy's). The
    constructor wraps an existing handle (4 bytes an element) and raises ``ValueError`` for
    another dtype or a handle smaller than ``shape`` needs.
    """

    __slots__ = ("client", "shape", "dtype", "_buf")

    def __init__(self, client, handle: Handle, shape, dtype: str = "f32", *, _buf=None):
        _check_dtype(dtype)
        self.client = client
        self.shape = _check_shape(shape)
        self.dtype = dtype
        self._buf = _buf if _buf is not None else _Buffer(handle, None)
        if self.size * 4 > handle.nbytes:
            raise ValueError(f"Tensor of shape {self.shape} needs {self.size * 4} bytes; handle "
                             f"{handle.id} holds {handle.nbytes}")

    # -- making and reading -------------------------------------------------------------------
    @classmethod
    def from_numpy(cls, client, array) -> "Tensor":
        """Copy a host array to a new device tensor (floats -> ``f32``, integers -> ``i32``).

        Raises: ``TypeError`` for other dtypes; ``ValueError`` for an integer outside ``i32``'s
            range (it would wrap: a token id 2**32 + 5 read as 5).
        """
        a = np.asarray(array)
        if a.dtype.kind == "f":
            dtype = "f32"
        elif a.dtype.kind in "iub":
            dtype = "i32"
            _check_i32_range(a, "Tensor.from_numpy")
        else:
            raise TypeError(f"Tensor.from_numpy takes a float or integer array, got {a.dtype}")
        a = np.ascontiguousarray(a, dtype=TENSOR_DTYPES[dtype])
        return cls(client, client.create(a), a.shape, dtype)

    @classmethod
    def empty(cls, client, shape, dtype: str = "f32") -> "Tensor":
        """A new tensor with undefined contents, from the current arena if one is active.

        Raises: ``ValueError`` for a dtype other than ``"f32"``/``"i32"`` or a negative dim."""
        _check_dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        arenas = getattr(_local, "arenas", None)
        arena = arenas[-1] if arenas else None
        if arena is not None and arena.client is client:
            h = arena.take(shape, TENSOR_DTYPES[dtype])
            return cls(client, h, shape, dtype, _buf=_Buffer(h, arena))
        return cls(client, client.empty(shape, TENSOR_DTYPES[dtype]), shape, dtype)

    @property
    def handle(self) -> Handle:
        """The underlying ``runtime.Handle`` (the device buffer; pass it to ``client.launch``)."""
        return self._buf.handle

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    def __copy__(self) -> "Tensor":
        """Another view of the same buffer (as a shallow copy of a torch tensor)."""
        return Tensor(self.client, self._buf.handle, self.shape, self.dtype, _buf=self._buf)

    def __deepcopy__(self, memo):
        raise TypeError(f"Tensor {self.shape} {self.dtype} is a device buffer: it cannot be "
                        "deep-copied; Tensor.from_numpy(client, t.numpy()) copies it")

    def __reduce__(self):
        raise TypeError(f"Tensor {self.shape} {self.dtype} is a device buffer on this process's "
                        "server: it cannot be pickled; send t.numpy() and Tensor.from_numpy it "
                        "in the other process")

    def __array__(self, dtype=None, copy=None):
        # as Handle.__array__: no silent 0-d object array; the copy to the host is explicit
        raise TypeError("a runtime.Tensor lives on its device: copy it to the host with "
                        ".numpy() (blocks until its last write ran)")

    def numpy(self) -> np.ndarray:
        """Read the tensor to the host: a new ``np.ndarray`` of :attr:`shape` and ``float32`` /
        ``int32``. Blocks; raises what ``ComputeClient.read`` raises (the stream's queued errors,
        ``ReplayFailed`` when the work that wrote it failed)."""
        raw = self.client.read(self.handle).reshape(-1).view(np.uint8)
        return raw[:self.size * 4].view(TENSOR_DTYPES[self.dtype]).reshape(self.shape).copy()

    def write(self, array) -> None:
        """Overwrite the tensor in place with ``array`` (same number of elements; cast).

        Raises: ``ValueError`` when the sizes differ, or (an ``i32`` tensor) for a value that is
            not finite or outside ``i32``'s range (it would wrap).
        """
        if self.dtype == "i32":
            _check_i32_range(np.asarray(array), "Tensor.write")
        a = np.ascontiguousarray(array, dtype=TENSOR_DTYPES[self.dtype]).reshape(-1)
        if a.size != self.size:
            raise ValueError(f"write of {a.size} elements into a tensor of shape {self.shape}")
        if self.handle.size != a.size:
            a = np.concatenate([a, np.zeros(self.handle.nbytes // 4 - a.size, a.dtype)])
        self.client.write(self.handle, a)

    def reshape(self, *shape) -> "Tensor":
        """A view with another shape (same buffer and dtype; one ``-1`` is inferred).

        Raises: ``ValueError`` when the element counts differ, for more than one ``-1`` or
            another negative dim."""
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = tuple(int(d) for d in shape)
        if -1 in shape:
            known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
            if shape.count(-1) > 1 or known <= 0 or self.size % known:
                raise ValueError(f"cannot reshape {self.shape} to {shape}")
            shape = tuple(self.size // known if d == -1 else d for d in shape)
        _check_shape(shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return Tensor(self.client, self.handle, shape, self.dtype, _buf=self._buf)

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, handle={self.handle.id})"

    # -- ops ----------------------------------------------------------------------------------
    def _out(self, shape) -> "Tensor":
        return Tensor.empty(self.client, shape, "f32")

    def _launch(self, kernel, count, tensors, params) -> None:
        _launch(self.client, kernel, count, tensors, params)

    def matmul(self, w: "Tensor", bias: "Tensor | None" = None,
               activation: str | None = None) -> "Tensor":
        """``self [..., K] @ w [K, N] (+ bias [N])``, then ``activation`` (``None`` or ``"gelu"``).

        Returns: ``[..., N]``. Raises: ``ValueError`` (shapes, or gelu without a bias).
        """
        K_, N = _shape2(w, "matmul weight")
        if not self.shape or self.shape[-1] != K_ or K_ == 0:
            raise ValueError(f"matmul: {self.shape} @ {w.shape}: inner dimensions differ or "
                             "are 0")
        M = self.size // K_
        out = self._out(self.shape[:-1] + (N,))
        if bias is not None and bias.shape != (N,):
            raise ValueError(f"matmul: bias shape {bias.shape}, expected ({N},)")
        if activation not in (None, "gelu"):
            raise ValueError(f"matmul: activation must be None or 'gelu', got {activation!r}")
        if activation == "gelu" and bias is None:
            raise ValueError("matmul: activation='gelu' needs a bias (the fused kernel takes one)")
        kern, count = K.nn.matmul_for(M, N, bias is not None, activation)
        args = [self, w] + ([bias] if bias is not None else []) + [out]
        self._launch(kern, count, args, {"M": M, "N": N, "K": K_})
        return out

    def add(self, other: "Tensor") -> "Tensor":
        """``self + other`` (f32): same shape, or ``other`` a ``[N]`` bias broadcast over the last
        dim ``N``; a new tensor of ``self``'s shape.

        Raises: ``ValueError`` for shapes that do not broadcast so."""
        n = self.size
        out = self._out(self.shape)
        if other.shape == self.shape:
            self._launch(K.add, K.grid(n), [self, other, out], {"n": n})
        elif other.shape == self.shape[-1:]:
            self._launch(K.add_bias, K.grid(n), [self, other, out], {"N": other.size, "n": n})
        else:
            raise ValueError(f"add: shapes {self.shape} and {other.shape} do not broadcast")
        return out

    __add__ = add

    def gelu(self) -> "Tensor":
        """``0.5 x (1 + erf(x / sqrt 2))`` elementwise (erf to ~1.2e-7): a new f32 tensor of
        ``self``'s shape. Raises: ``TypeError`` for an ``i32`` tensor."""
        out = self._out(self.shape)
        self._launch(K.gelu, K.grid(self.size), [self, out], {"n": self.size})
        return out

    def layer_norm(self, gamma: "Tensor", beta: "Tensor", eps: float = 1e-12,
                   residual: "Tensor | None" = None) -> "Tensor":
        """Layer norm over the last dim of ``self (+ residual)``; ``gamma``/``beta`` are ``[n]``.

        Raises: ``ValueError`` on shape mismatches.
        """
        n = self.shape[-1] if self.shape else 1
        if gamma.shape != (n,) or beta.shape != (n,):
            raise ValueError(f"layer_norm: gamma/beta must be ({n},), got {gamma.shape}, "
                             f"{beta.shape}")
        if n == 0:                                  # rows of nothing: nothing to normalize
            return self._out(self.shape)
        rows = self.size // n
        out = self._out(self.shape)
        params = {"rows": rows, "n": n, "eps": eps}
        if residual is None:
            self._launch(K.layer_norm, K.rows_count(rows), [self, gamma, beta, out], params)
        else:
            if residual.shape != self.shape:
                raise ValueError(f"layer_norm: residual {residual.shape} != input {self.shape}")
            self._launch(K.add_layer_norm, K.rows_count(rows), [self, residual, gamma, beta, out],
                         params)
        return out

    def attention(self, mask: "Tensor", heads: int) -> "Tensor":
        """Multi-head attention of a packed ``[B, S, 3H]`` QKV tensor (q | k | v on the last dim).

        Args:
            mask: ``[B, S]`` f32, 1 for real tokens and 0 for padding (keys with 0 are masked).
            heads: number of heads (``H % heads == 0``).
        Returns: ``[B, S, H]`` context. See :func:`attention`.
        Raises: ``ValueError`` (not ``[B, S, 3H]``, a mask that is not ``[B, S]``, ``heads``
            not a positive int dividing ``H``); ``TypeError`` (a tensor that is not ``f32``).
        """
        if len(self.shape) != 3 or self.shape[2] % 3:
            raise ValueError(f"attention: a packed QKV tensor is [B, S, 3H], got {self.shape}")
        B, S, H3 = self.shape
        H = H3 // 3
        return attention(self, self, self, mask, heads, offsets=(0, H, 2 * H))

    def mean_pool(self, mask: "Tensor") -> "Tensor":
        """Mean over the tokens of ``self [B, S, H]`` (f32) weighted by ``mask [B, S]`` (0/1
        f32): a new ``[B, H]`` tensor.

        Raises: ``ValueError`` when ``mask`` is not ``[B, S]``."""
        if len(self.shape) != 3:
            raise ValueError(f"mean_pool: the input is [B, S, H], got {self.shape}")
        B, S, H = self.shape
        if mask.shape != (B, S):
            raise ValueError(f"mean_pool: mask {mask.shape}, expected {(B, S)}")
        out = self._out((B, H))
        self._launch(K.mean_pool, K.grid(B * H), [self, mask, out], {"S": S, "H": H, "n": B * H})
        return out

    def l2_normalize(self) -> "Tensor":
        """Each row over the last dim divided by ``max(its L2 norm, 1e-12)``: a new f32 tensor
        of ``self``'s shape (an all-zero row stays zero). Raises: ``TypeError`` for an ``i32``
        tensor."""
        n = self.shape[-1] if self.shape else 1
        if n == 0:                                  # rows of nothing: nothing to normalize
            return self._out(self.shape)
        rows = self.size // n
        out = self._out(self.shape)
        self._launch(K.l2_normalize, K.rows_count(rows), [self, out], {"rows": rows, "n": n})
        return out


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, str) or dtype not in TENSOR_DTYPES:
        hint = ""
        try:                            # np.float32 / "float32": name the kernel dtype to pass
            name = next(k for k, v in TENSOR_DTYPES.items() if np.dtype(dtype) == v)
            hint = f": pass {name!r} (Tensor dtypes are kernel dtype names)"
        except (TypeError, ValueError, StopIteration):
            pass
        raise ValueError(f"Tensor dtype must be one of {list(TENSOR_DTYPES)}, got {dtype!r}{hint}")


def _check_shape(shape) -> tuple:
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"Tensor shape must be non-negative ints, got {shape}")
    return shape


def _check_i32_range(a: np.ndarray, what: str) -> None:
    """``ValueError`` when ``a`` holds a value ``i32`` cannot (a cast would wrap or be
    undefined): an integer past its range, a float that is not finite or past it."""
    if a.size == 0 or a.dtype.kind == "b" or (a.dtype.kind in "iu" and a.dtype.itemsize < 4) \
            or a.dtype == np.int32:
        return
    lo, hi = a.min(), a.max()
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise ValueError(f"{what}: an i32 tensor cannot hold {a.dtype} values that are not "
                         "finite")
    if lo < -2**31 or hi > 2**31 - 1:
        raise ValueError(f"{what}: values {lo}..{hi} do not fit i32 (-2**31..2**31-1); a cast "
                         "would wrap them")


def _caller() -> str:
    """The public operation of this module that is launching (``Tensor.matmul``,
    ``attention``): the first caller up the stack whose name has no leading underscore; an
    error names it rather than only the kernel (``matmul_m16``). Only on error paths."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename == __file__:
        if not f.f_code.co_name.startswith("_"):
            return f.f_code.co_qualname
        f = f.f_back
    return "runtime.tensor"


def _launch(client, kernel, count, tensors, params) -> None:
    """Launch ``kernel`` over ``tensors``; ``TypeError`` when a tensor's dtype is not its
    binding's (an ``i32`` tensor read as ``f32`` gives its bits, not its values)."""
    for t, b in zip(tensors, kernel.bindings):
        if t.dtype != b.dtype:
            raise TypeError(f"{_caller()} (kernel {kernel.name}): binding {b.name} takes a "
                            f"{b.dtype} tensor, got {t.dtype} {t.shape}")
    client.launch(kernel, count, [t.handle for t in tensors], params)


def _shape2(t: Tensor, what: str) -> tuple:
    if len(t.shape) != 2:
        raise ValueError(f"{what} must be 2-D, got shape {t.shape}")
    return t.shape


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, heads: int,
              offsets=(0, 0, 0)) -> Tensor:
    """``softmax(q k^T / sqrt(hd) + (1 - mask) * -1e9) v`` per head.

    Args:
        q, k, v: ``[B, S, W]`` f32 tensors (may be the same packed tensor); the heads of each
            are the ``H`` columns starting at its entry of ``offsets``.
        mask: ``[B, S]`` f32 key mask (1 keep, 0 masked).
        heads: number of heads; head dim ``hd = H / heads`` must be at most 64.
        offsets: column offsets of q, k, v inside their rows.
    Returns: ``[B, S, H]`` with ``H = W - max(offsets)`` for packed input, else ``W``.
    Raises: ``ValueError`` on shape mismatches or ``hd > 64``.
    """
    if not (q.shape == k.shape == v.shape) or len(q.shape) != 3:
        raise ValueError(f"attention: q, k, v must share a [B, S, W] shape, got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    B, S, W = q.shape
    H = W - max(offsets)
    if mask.shape != (B, S):
        raise ValueError(f"attention: mask {mask.shape}, expected {(B, S)}")
    if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or heads < 1:
        raise ValueError(f"attention: heads must be a positive int, got {heads!r}")
    if H <= 0 or H % heads:
        raise ValueError(f"attention: width {H} is not a multiple of heads={heads}")
    hd = H // heads
    if hd > K.nn.ATTN_MAX_HEAD_DIM:
        raise ValueError(f"attention: head dim {hd} exceeds {K.nn.ATTN_MAX_HEAD_DIM}")
    out = Tensor.empty(q.client, (B, S, H))
    params = {"S": S, "heads": heads, "hd": hd, "ld_in": W, "q_off": offsets[0],
              "k_off": offsets[1], "v_off": offsets[2], "ld_out": H, "scale": 1 / math.sqrt(hd)}
    _launch(q.client, K.nn.attention_for(hd), K.attention_count(B, S, heads),
            [q, k, v, mask, out], params)
    return out


def embedding(ids: Tensor, types: Tensor, word: Tensor, pos: Tensor, ttab: Tensor) -> Tensor:
    """BERT input embeddings: ``word[ids] + pos[position] + ttab[types]``.

    Args:
        ids, types: ``[B, S]`` i32 token and token-type ids (must index inside their tables).
        word, pos, ttab: ``[V, H]``, ``[P, H]`` (``P >= S``), ``[T, H]`` f32 tables.
    Returns: ``[B, S, H]``; positions restart at 0 in every sequence.
    Raises: ``ValueError`` on shape mismatches.
    """
    if len(ids.shape) != 2 or any(len(t.shape) != 2 for t in (word, pos, ttab)):
        raise ValueError(f"embedding: ids [B, S] and tables [rows, H], got {ids.shape}, "
                         f"{word.shape}, {pos.shape}, {ttab.shape}")
    B, S = ids.shape
    H = word.shape[1]
    if types.shape != ids.shape or pos.shape[1] != H or ttab.shape[1] != H or pos.shape[0] < S:
        raise ValueError(f"embedding: ids {ids.shape}, types {types.shape}, tables {word.shape}, "
                         f"{pos.shape}, {ttab.shape} do not fit")
    out = Tensor.empty(ids.client, (B, S, H))
    n = B * S * H
    _launch(ids.client, K.embedding, K.grid(n), [ids, types, word, pos, ttab, out],
            {"H": H, "S": S, "n": n})
    return out


__all__ = ["Tensor", "Arena", "attention", "embedding"]
