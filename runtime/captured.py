"""``runtime.capture(fn)``: record a tensor-level closure once, replay it with one call (seed 000).

This is the high-level entry point to capture. It does the whole recipe of
``ComputeClient.graph_prepare`` / ``start_capture`` / ``stop_capture`` for you:

1. **Pin.** The graph's stream is the stream ``fn``'s work goes to (``client.stream`` at the call:
   the client's pinned stream, or the calling thread's own stream for an unpinned client). Every
   replay runs there, for the life of the graph; :attr:`CapturedGraph.client` is a client pinned
   to it, for refreshes and reads from any thread.
2. **Prepare.** ``graph_prepare()`` on that stream: buffers freed from here on are held back from
   the pool until recording starts, so the recorded run finds every buffer it needs.
3. **Warm up.** ``fn()`` runs ``warmup`` times (default 1) and executes normally: kernels are
   compiled, the pool grows to ``fn``'s working set, host reads are allowed. Its outputs are
   dropped before recording.
4. **Record.** ``start_capture()``, ``fn()`` once more (its launches are recorded, not run),
   ``stop_capture()``. The outputs of this run are :attr:`CapturedGraph.output`: the buffers every
   replay overwrites.
5. **Replay.** ``g.replay()`` enqueues the recorded launches on the capture stream against the
   exact buffers they used, and returns ``g.output``.

Fallback: when recording is impossible, ``capture`` does not fail: the graph re-runs ``fn()`` on
every ``replay()`` and returns the fresh output; ``is_hardware`` is False and ``fallback_reason``
says why (``None`` on the graph path). The cases:

- the backend has no graphs (``start_capture`` raises ``UnsupportedError``);
- ``fn`` reads to the host or syncs on the capture stream (``Tensor.numpy``, ``client.read``,
  ``client.sync`` raise ``CaptureRefused`` inside the window);
- ``fn`` writes host data (``Tensor.write``, ``client.write``, ``Tensor.from_numpy``/``create``),
  frees a buffer the window used, or (hardware graphs) allocates a buffer the warm pool could not
  serve: ``stop_capture`` refuses the window;
- nothing was recorded: ``fn`` launched no work on the capture stream (its tensors live on another
  stream or server; pass ``client=``). Re-running ``fn`` is then the only correct replay.

Python effects of ``fn`` (the JIT footguns). On the graph path only the recorded **device
launches** happen on a replay; ``fn``'s Python code does not run again. Concretely:

- Once per warm-up run and once at recording, never on replay: ``print``/logging, counters and
  list appends, reads of globals or attributes, host random draws (``np.random``; a seed or noise
  made on the host is baked into the graph), host reads (not allowed at recording anyway), branches
  and loop trip counts, and every launch parameter: shapes, sizes, scalar params and workgroup
  counts are fixed at recording (an indirect dispatch reads its counts from a device buffer at
  each replay). Device-side randomness advances only if a recorded kernel updates its state buffer.
- Every replay: the recorded kernels, reading whatever the input buffers hold *now* and writing
  the same output buffers (the same :attr:`output` object is returned every time: copy what you
  need, e.g. ``.numpy()``, before the next replay overwrites it).
- On the fallback path all of ``fn`` runs on every replay (side effects included), and each
  replay returns a new output. Code that behaves the same on both paths keeps its effects on the
  device.
- Runs inside ``capture()`` itself: ``warmup`` + 1 (the recorded run, whose launches do not
  execute); one more before them with ``client=None`` (to find the client); and on a fallback
  one more after them, executed, whose result is :attr:`CapturedGraph.output`.

Inputs: ``fn`` must read its inputs from, and write its outputs to, stable tensors held across the
loop (closure variables). Refresh inputs **in place** before each replay (``g.write(x, array)`` or
``x.write(array)`` from a client on the capture stream); a new tensor made by
``Tensor.from_numpy`` is a different buffer the graph never sees. The graph keeps every buffer its
recording touched alive (``stop_capture(retain=True)``): rebinding or deleting a tensor ``fn``
used never hands its buffer to another tensor while the graph lives (seed 000 safety contract).
For a graph that owns its inputs and outputs and checks every call, see ``runtime.StaticGraph``.
"""

from __future__ import annotations


import numpy as np

from . import _fork
from .frontend import ComputeClient, Handle
from .errors import CaptureRefused, UnknownGraph, UnsupportedError
from .tensor import Tensor

__all__ = ["capture", "CapturedGraph"]


def _leaves(obj):
    """The Tensors and Handles inside ``obj`` (a Tensor, Handle, or nested tuple/list/dict)."""
    if isinstance(obj, (Tensor, Handle)):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _leaves(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)


class CapturedGraph:
    """A closure recorded by :func:`runtime.capture`; ``replay()`` re-runs it (seed 000).

    Users do not construct one; :func:`runtime.capture` returns it.

    Attributes:
        output: what ``fn`` returned at recording (graph path: the tensors every replay
            overwrites, stable across replays, contents undefined until the first replay) or at
            the latest run (fallback path).
        is_hardware: True when ``replay`` is one recorded dispatch (a driver graph: cuda); False
            for a software graph (cpu, wgpu: the recorded launch list, re-run without Python)
            *and* for the fallback. ``recorded`` tells the last two apart.
        recorded: True on the graph path (any backend), False on the fallback path.
        fallback_reason: ``None`` on the graph path, else why ``fn`` is re-run on every replay.
        stream: the capture stream (``StreamId``); replays run there.
        client: a ``ComputeClient`` pinned to ``stream``: refresh inputs and read outputs with it
            (or with :meth:`write` / :meth:`read`) from any thread.
        graph: the client-level ``runtime.Graph`` (``None`` on the fallback path).

    Thread safety: ``replay``, ``write`` and ``read`` take one lock, so callers on several threads
    never interleave a refresh of one with the replay of another *within* those calls; a
    refresh-replay-read sequence spanning calls needs the caller's own lock (or
    ``runtime.StaticGraph``, which does it).
    """

    def __init__(self, fn, output, client, graph, reason):
        # only the fallback path runs fn again: a recorded graph keeps no reference to it
        # (SOAK7: a closure over its owner, MiniLM's bucket forward, made a cycle that kept
        # the model's weights until the cyclic gc ran: up to 5 models, 750 MB, in a service)
        self._fn = fn if graph is None else None
        self.output = output
        self.client = client
        self.stream = client.stream
        self.graph = graph
        self.recorded = graph is not None
        self.is_hardware = bool(graph is not None and graph.is_hardware)
        self.fallback_reason = reason
        _fork.lock_for(self)              # self._lock (a forked child gets it afresh)

    def replay(self):
        """Run the captured work once more and return its output.

        Returns:
            graph path: :attr:`output` (the same object every time; its buffers now hold this
            replay's results once the capture stream reaches them; ``Tensor.numpy()`` from a
            client on the capture stream, or :meth:`read`, waits for that).
            fallback path: the fresh output of ``fn()`` (also stored in :attr:`output`).
        Raises:
            UnknownGraph: the graph was released.
            Whatever ``fn`` raises (fallback path), or ``Graph.replay``'s errors.
        Streams: on the capture stream; orders only against work on that stream.
        Capture: refused (``CaptureRefused``) while the capture stream is recording.
        """
        with self._lock:
            if self.graph is None:
                if self._fn is None:
                    raise UnknownGraph("replay of a released captured graph")
                out = self._fn()
                self.output = out
                return out
            self.graph.replay()
            return self.output

    __call__ = replay

    def write(self, target, data) -> None:
        """Refresh an input in place on the capture stream.

        Args:
            target: a ``Tensor`` or ``Handle`` ``fn`` reads (the same buffer it used at capture).
            data: a numpy array with the target's number of elements (cast to its dtype).
        Raises: ``TypeError`` (not a Tensor/Handle), ``ValueError``/``InvalidHandle`` (size).
        Streams: on the capture stream, so it is ordered before the next replay.
        """
        with self._lock:
            if isinstance(target, Tensor):
                Tensor(self.client, target.handle, target.shape, target.dtype,
                       _buf=target._buf).write(data)
            elif isinstance(target, Handle):
                self.client.write(target, np.asarray(data))
            else:
                raise TypeError(f"write takes a Tensor or a Handle, got {type(target).__name__}")

    def read(self, target=None):
        """Read a tensor (default: :attr:`output`, which must then be one Tensor) to the host.

        Returns: ``np.ndarray`` (the tensor's shape and dtype). Blocks until the capture stream
            has run everything enqueued before (the replay included).
        Raises: ``TypeError``; ``ReplayFailed`` (a failed replay wrote it); ``ServerUnhealthy``.
        Streams: on the capture stream.
        """
        with self._lock:
            target = self.output if target is None else target
            if isinstance(target, Tensor):
                return Tensor(self.client, target.handle, target.shape, target.dtype,
                              _buf=target._buf).numpy()
            if isinstance(target, Handle):
                return self.client.read(target)
            raise TypeError(f"read takes a Tensor or a Handle, got {type(target).__name__}")

    def memory_usage(self) -> dict:
        """The recorded graph's ``Graph.memory_usage()`` (bytes: ``nbytes``, ``own_bytes``,
        ``pool``, ``pool_bytes``, ``pool_share``, ``used_bytes``); zeros (pool None) on the
        fallback path or once released: no graph keeps anything alive then. Blocks."""
        graph = self.graph
        if graph is None:
            return {"nbytes": 0, "own_bytes": 0, "pool": None, "pool_bytes": 0,
                    "pool_share": 0, "used_bytes": 0}
        return graph.memory_usage()

    @property
    def nbytes(self) -> int:
        """Bytes the recorded graph keeps alive (``memory_usage()["nbytes"]``). Blocks."""
        return self.memory_usage()["nbytes"]

    def release(self) -> None:
        """Drop the graph, ``fn`` and the output (idempotent); later replays raise
        ``UnknownGraph``."""
        with self._lock:
            if self.graph is not None:
                self.graph.release()
            self.graph = None
            self._fn = None
            self.output = None

    def __repr__(self):
        how = ("hardware graph" if self.is_hardware else "software graph") if self.recorded \
            else f"fallback ({self.fallback_reason})"
        return f"CapturedGraph(stream={int(self.stream)}, {how})"


#: how :attr:`CapturedGraph.fallback_reason` starts when ``fn`` launched no work on the capture
#: stream (``StaticGraph`` refuses such a body).
NOTHING_RECORDED = "nothing was recorded"


def capture(fn, *, client: ComputeClient | None = None, warmup: int = 1,
            pool=None) -> CapturedGraph:
    """Record ``fn()`` once and return a graph whose ``replay()`` re-runs it (seed 000).

    The recipe (module docstring): pin the stream, ``graph_prepare()``, run ``fn()`` ``warmup``
    times (executed: compiles kernels, warms the pool), ``start_capture()``, ``fn()`` once more
    (recorded, not run), ``stop_capture()``. Then, in the loop::

        x = Tensor.from_numpy(c, x0); w = ...                 # stable buffers, held across the loop
        g = runtime.capture(lambda: x.matmul(w).gelu(), client=c)
        for batch in data:
            g.write(x, batch)                                # in place, on the capture stream
            y = g.replay().numpy()                           # same output tensor every replay

    Args:
        fn: a callable of no arguments launching work through ``runtime.Tensor`` ops or a client,
            on ``client``'s stream. It may return a Tensor, a Handle, ``None``, or tuples, lists
            and dicts of them (the output).
        client: the ``ComputeClient`` whose stream ``fn``'s work goes to (the client of ``fn``'s
            tensors). ``None``: found by running ``fn()`` once more first, before
            ``graph_prepare``, and taking the client of the first Tensor in its output (so ``fn``
            runs ``warmup + 1`` times before recording).
        warmup: warm-up runs before recording (``>= 0``).
        pool: a ``runtime.GraphPool`` (docs/contract.md section 4c): the window allocates from
            the buffers the pool's graphs share, so graphs of one pool (captured on one stream)
            cost about what the largest costs alone. The outputs are then kept in buffers of
            their own, allocated before the window (``fn`` runs once more first, to learn their
            shapes; the recording ends with a copy into them), so a replay of another graph of
            the pool never overwrites them.
    Returns:
        a :class:`CapturedGraph`; ``is_hardware``, ``recorded`` and ``fallback_reason`` say
        which path it took.
    Raises:
        TypeError: ``fn`` is not callable; ``warmup`` is not an int.
        ValueError: ``warmup < 0``; no ``client`` and no Tensor in ``fn``'s output; ``fn``'s
            output lives on another server or stream than the capture stream (its work would
            not be recorded).
        GraphStateError: the capture stream is already preparing or recording a capture.
        Whatever ``fn`` raises (the stream is first brought back out of capture).
    Streams: everything on the capture stream; other streams work normally meanwhile.
    Capture: not re-entrant on one stream (``GraphStateError``); a nested capture must use
        another stream.
    """
    if not callable(fn):
        raise TypeError(f"capture takes a callable of no arguments, got {type(fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, (int, np.integer)):
        raise TypeError(f"warmup must be an int, got {warmup!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if client is None:
        out = fn()       # find fn's client from its output (before graph_prepare: a plain run)
        tensors = [t for t in _leaves(out) if isinstance(t, Tensor)]
        if not tensors:
            raise ValueError("capture(fn) without client=: fn returned no runtime.Tensor to tell "
                             "which client (and stream) it launches on; pass client=")
        client = tensors[0].client
        del out, tensors
    if not isinstance(client, ComputeClient):
        raise TypeError(f"client must be a ComputeClient, got {type(client).__name__}")
    pinned = client.with_stream(client.stream)
    c = pinned
    owned = None
    if pool is not None:              # outputs in buffers of their own, made outside the window
        out = fn()
        _check_output(out, pinned)
        owned = _owned_like(out, pinned)
        del out
    c.graph_prepare(pool=pool)
    try:
        for _ in range(int(warmup)):
            out = fn()
            _check_output(out, pinned)
            del out
    except BaseException:
        c.abort_capture()
        raise
    try:
        c.start_capture()
    except UnsupportedError as e:
        return CapturedGraph(fn, fn(), pinned, None,
                             f"the {client.backend} backend cannot record graphs ({e}); "
                             "fn is re-run on every replay")
    try:
        out = fn()
        if owned is not None:
            out = _copy_into(out, owned, pinned)
    except CaptureRefused as e:
        c.abort_capture()
        return CapturedGraph(fn, fn(), pinned, None,
                             f"fn reads to the host or syncs inside the capture window ({e}); "
                             "fn is re-run on every replay")
    except BaseException:
        c.abort_capture()
        raise
    try:
        graph = c.stop_capture(retain=True)
    except CaptureRefused as e:
        return CapturedGraph(fn, fn(), pinned, None,
                             f"the capture window was refused ({e}); fn is re-run on every "
                             "replay")
    if graph.info()["launches"] == 0:
        graph.release()
        return CapturedGraph(fn, fn(), pinned, None,
                             f"{NOTHING_RECORDED} on stream {int(pinned.stream)}: fn launched "
                             "no work there (pass client= with the client fn's tensors use); "
                             "fn is re-run on every replay")
    _check_output(out, pinned)
    return CapturedGraph(fn, out, pinned, graph, None)


def _owned_like(out, client):
    """Buffers shaped like the Tensors and Handles in ``out`` (same nesting), allocated now."""
    if isinstance(out, Tensor):
        return Tensor(client, client.empty(max(4, out.size * 4)), out.shape, out.dtype)
    if isinstance(out, Handle):
        return client.empty(out.shape, out.dtype)
    if isinstance(out, (tuple, list)):
        return type(out)(_owned_like(v, client) for v in out)
    if isinstance(out, dict):
        return {k: _owned_like(v, client) for k, v in out.items()}
    return out


def _copy_into(out, owned, client):
    """Launch a copy of each Tensor/Handle of ``out`` into its twin in ``owned``; returns
    ``owned`` (its nesting), the graph's output."""
    from .kernels import copy_words, grid

    def one(src, dst):
        if isinstance(src, Tensor):
            if src.shape != dst.shape:
                raise ValueError(f"capture(pool=...): fn's output changed shape between runs "
                                 f"({dst.shape} -> {src.shape})")
            words = src.size
            src, dst_h = src.handle, dst.handle
        elif isinstance(src, Handle):
            dst_h = dst
            if src.nbytes % 4 or dst_h.nbytes != src.nbytes:
                raise ValueError(f"capture(pool=...): output handle {src.id} changed size or is "
                                 "not a whole number of 4-byte words between runs of fn")
            words = src.nbytes // 4
        elif isinstance(src, (tuple, list)):
            return type(src)(one(a, b) for a, b in zip(src, dst))
        elif isinstance(src, dict):
            return {k: one(v, dst[k]) for k, v in src.items()}
        else:
            return src
        if words:
            client.launch(copy_words, grid(words), [src, dst_h], {"n": words})
        return dst
    return one(out, owned)


def _check_output(out, client: ComputeClient) -> None:
    """Refuse outputs made on another server or stream than the capture stream."""
    for t in _leaves(out):
        if isinstance(t, Tensor):
            tc = t.client
            if tc._server is not client._server:
                raise ValueError(f"capture: fn returned {t!r} from the {tc.backend} server, but "
                                 f"the capture runs on the {client.backend} server; pass the "
                                 "client fn's tensors use as client=")
            if tc.stream != client.stream:
                raise ValueError(f"capture: fn returned {t!r} made on stream {int(tc.stream)}, "
                                 f"but the capture stream is {int(client.stream)}; its work "
                                 "would not be recorded. Pass the client fn's tensors use as "
                                 "client= (or pin them to one stream)")
