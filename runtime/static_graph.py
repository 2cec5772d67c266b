"""``runtime.StaticGraph``: a captured graph with an explicit, checked signature.

``runtime.capture(fn)`` (seed 000) leaves three duties to its caller: keep every buffer alive,
touch them from no other stream, and refresh/read them on the capture stream. A ``StaticGraph``
discharges all three by construction (the "safe structured API" of seed 000's last paragraph):

- **Signature.** Named ``inputs``, ``outputs`` and optional ``state``, each with a shape and a
  dtype (``"f32"`` or ``"i32"``). The graph allocates these tensors and owns them for its life, so
  liveness holds; the body receives them and can only use those.
- **One stream.** The graph makes its own client pinned to a fresh stream; the body's work, every
  refresh, every replay and every read go there, so they are ordered by construction.
- **Checked calls.** ``g(**inputs)`` takes host data (numpy arrays, Python numbers or lists) for
  *every* input, checks names, shapes and dtypes before anything is written (``TypeError`` /
  ``ValueError``: no stale buffer is ever read), writes them in place, replays, and returns the
  outputs as numpy arrays. A device buffer (``Handle``/``Tensor``) other than the graph's own input
  buffer is refused: the graph replays against its captured buffers only.
- **Thread-safe.** One lock serialises whole calls: concurrent callers each get the outputs of
  their own inputs, never an interleaving.

Example::

    g = runtime.StaticGraph(
        client,
        inputs={"x": ((4, 8), "f32")},
        outputs={"y": ((4, 3), "f32")},
        body=lambda x, y: {"y": x.matmul(w).gelu()},      # w: a weight Tensor (read only)
    )
    g(x=np.ones((4, 8), np.float32))["y"]                  # -> np.ndarray [4, 3] f32

The body ``body(**tensors)`` is called with one keyword per name (inputs, outputs and state
together, so names must be distinct) bound to the graph's ``runtime.Tensor`` s. It launches its
work through ``Tensor`` ops or ``t.client.launch`` (the graph's pinned client) and either writes
the outputs in place and returns ``None``, or returns ``{output name: Tensor}`` (or one Tensor when
there is one output): those results are copied into the owned outputs by a recorded device copy.
It may read other tensors it closes over (weights); those must stay alive and unwritten while the
graph is used. The body runs ``warmup`` times plus once recorded, at construction only (see
``runtime.capture`` for which Python effects happen when): on inputs filled with their initial
values (zeros unless given) and on the initial state, which is restored afterwards.

State: buffers that persist across calls and that the body both reads and writes (a KV cache, a
position, a token fed back on the device). Set them with :meth:`write`, read them with
:meth:`read`, restore the initial values with :meth:`reset`; :meth:`replay` runs steps without
host data for graphs that feed themselves (``runtime.models.decoder``). A failed call marks the
state (docs/contract.md section 4): every later call raises ``ReplayFailed`` rather than return
outputs computed from the stale state, until the state is written (:meth:`write`, :meth:`reset`;
:meth:`reset` also zeroes the outputs, which a ``loop=`` graph writes only inside its loop).

Loop: ``loop="go"`` (an ``i32 [1]`` state slot) records the body inside
``ComputeClient.capture_while(go, body, max_iterations)``: one replay (one call) runs the body
while ``go`` is non-zero, the body deciding on the device whether to go on (a decode loop with
its end test on the device: one replay per sequence instead of one per token). Past
``max_iterations`` the replay fails with ``LoopLimitExceeded`` on the state (never a silent
truncation). Warm-up runs execute the body once each (compiling and sizing everything), not
the loop. Example, greedy decoding until an end token (``runtime.models.decoder``:
``Decoder.sequence_graph``)::

    def body(token, pos, k_cache, v_cache, hist, next, go, stop):
        dec.step(token, pos, k_cache, v_cache, hist, next)      # next token, pos += 1
        c.launch(decode_continue, 1, [next.handle, pos.handle, stop.handle, go.handle])
    g = runtime.StaticGraph(c, inputs={}, outputs={"next": ((1,), "i32")},
                            state={**dec.state_spec(), "go": ((1,), "i32"), "stop": ((2,), "i32")},
                            body=body, loop="go", max_iterations=64)
    g.write(token=[1], stop=[end_token, 64], go=[1])
    g.replay()                                                   # the whole sequence
    g.read("hist")

Fallback: where the backend cannot record (or the body reads to the host), the graph re-runs the
body on every call with the same checks and ordering; ``is_hardware``/``recorded``/
``fallback_reason`` say so (see ``runtime.capture``). (A backend without loop nodes raises
``UnsupportedError`` at construction for ``loop=``: cuda without CUDA 12.4 conditional nodes.)
"""

from __future__ import annotations

import numpy as np

from . import _fork
from .captured import NOTHING_RECORDED, capture
from .frontend import ComputeClient, Handle
from .streams import StreamId
from .errors import UnknownGraph
from .kernels.pointwise import copy_words, grid
from .tensor import TENSOR_DTYPES, Tensor

__all__ = ["StaticGraph"]

def _dtype_name(dtype, where: str) -> str:
    if isinstance(dtype, str) and dtype in TENSOR_DTYPES:
        return dtype
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    for name, d in TENSOR_DTYPES.items():
        if dt == d:
            return name
    raise TypeError(f"StaticGraph: {where} has dtype {dtype!r}; use 'f32' or 'i32' "
                    "(np.float32 / np.int32)")


class _Spec:
    """One named slot of the signature: shape, dtype, initial contents."""

    __slots__ = ("name", "kind", "shape", "dtype", "init")

    def __init__(self, name: str, kind: str, spec):
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"StaticGraph: {kind} name {name!r} must be a Python identifier "
                             "(the body receives it as a keyword)")
        self.name, self.kind = name, kind
        if isinstance(spec, np.ndarray):
            self.dtype = _dtype_name(spec.dtype, f"{kind} {name!r}")
            self.shape = tuple(spec.shape)
            self.init = np.ascontiguousarray(spec, TENSOR_DTYPES[self.dtype]).copy()
            return
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2):
            raise TypeError(f"StaticGraph: {kind} {name!r} must be (shape, dtype) or a numpy "
                            f"array of initial contents, got {spec!r}")
        shape, dtype = spec
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0
                   for d in shape):
            raise ValueError(f"StaticGraph: {kind} {name!r} shape must be positive ints, "
                             f"got {spec[0]!r}")
        self.shape = tuple(int(d) for d in shape)
        self.dtype = _dtype_name(dtype, f"{kind} {name!r}")
        self.init = np.zeros(self.shape, TENSOR_DTYPES[self.dtype])

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __repr__(self):
        return f"{self.shape} {self.dtype}"


class StaticGraph:
    """A captured graph with named, owned, checked inputs, outputs and state on one stream.

    Args:
        client: a ``ComputeClient`` of the device to run on; the graph makes its own client on
            the same server, pinned to a fresh stream (``client`` itself is not pinned or used).
        inputs: ``{name: (shape, dtype)}`` (or ``{name: np.ndarray}``: shape, dtype and the
            contents used by the warm-up). Host data for every input is given on every call.
        outputs: ``{name: (shape, dtype)}``: read back by every call.
        body: ``body(**tensors)`` launching the work (module docstring); returns ``None`` or
            ``{output name: Tensor}`` (or one Tensor for a single output) to copy into outputs.
        state: ``{name: (shape, dtype)}`` (zeros) or ``{name: np.ndarray}`` (initial contents):
            persistent buffers the body reads and writes; never passed to calls.
        warmup: warm-up runs of the body before recording (``runtime.capture``).
        loop: the name of an ``i32 [1]`` state slot: record the body inside
            ``capture_while`` on it (module docstring, "Loop"); None: the body once per replay.
        max_iterations: the loop's bound (``capture_while``'s; required on wgpu, which unrolls
            the loop to it); only with ``loop``.
    Raises:
        TypeError / ValueError: a malformed signature (bad name, shape or dtype; a name used
            twice), a ``loop`` that is not an ``i32 [1]`` state slot, ``max_iterations``
            without ``loop``, or the body returned something that does not fit the outputs, or
            it launched no work on the graph's stream and returned no outputs.
        UnsupportedError: ``loop`` on a backend without loop nodes.
        Whatever the body raises (nothing is kept).
    Streams: everything on :attr:`stream`, the graph's own; the body's tensors are on it.
    Capture: at construction, via ``runtime.capture`` (warm-up, record, fallback).

    Attributes:
        client: the graph's client, pinned to :attr:`stream`.
        stream: the graph's stream (``StreamId``); every replay runs there.
        signature: ``{"inputs": {...}, "outputs": {...}, "state": {...}}`` of ``(shape, dtype)``.
        is_hardware, recorded, fallback_reason: see ``runtime.CapturedGraph``.
    """

    def __init__(self, client: ComputeClient, *, inputs, outputs, body, state=None,
                 warmup: int = 1, loop: str | None = None, max_iterations: int | None = None):
        if not isinstance(client, ComputeClient):
            raise TypeError(f"StaticGraph takes a ComputeClient, got {type(client).__name__}")
        if not callable(body):
            raise TypeError(f"StaticGraph: body must be callable, got {type(body).__name__}")
        self._specs: dict[str, _Spec] = {}
        for kind, group in (("input", inputs), ("output", outputs), ("state", state or {})):
            if not isinstance(group, dict):
                raise TypeError(f"StaticGraph: {kind}s must be a dict name -> (shape, dtype), "
                                f"got {type(group).__name__}")
            for name, spec in group.items():
                if name in self._specs:
                    raise ValueError(f"StaticGraph: name {name!r} is used twice (inputs, outputs "
                                     "and state share one namespace: the body's keywords)")
                self._specs[name] = _Spec(name, kind, spec)
        if not any(s.kind == "output" for s in self._specs.values()):
            raise ValueError("StaticGraph: give at least one output")
        if loop is not None:
            spec = self._specs.get(loop) if isinstance(loop, str) else None
            if spec is None or spec.kind != "state" or spec.shape != (1,) or spec.dtype != "i32":
                raise ValueError(f"StaticGraph: loop={loop!r} must name an i32 state slot of "
                                 f"shape (1,) (the loop's condition), got "
                                 f"{spec.kind + ' ' + repr(spec) if spec else 'no such state'}")
        elif max_iterations is not None:
            raise ValueError("StaticGraph: max_iterations is given without loop=")
        self._loop, self._max_iterations = loop, max_iterations
        self._warmups = warmup if isinstance(warmup, (int, np.integer)) else 0
        self.client = client.with_stream(StreamId.new())
        self.stream = self.client.stream
        _fork.lock_for(self)                # self._lock (a forked child gets it afresh)
        self._tensors = {n: Tensor.from_numpy(self.client, s.init) for n, s in self._specs.items()}
        self._body = body
        self._cap = capture(self._run_body, client=self.client, warmup=warmup)
        if not self._cap.recorded and self._cap.fallback_reason.startswith(NOTHING_RECORDED):
            outs = [n for n, s in self._specs.items() if s.kind == "output"]
            raise ValueError(f"StaticGraph: the body launched no work on the graph's stream and "
                             f"returned no outputs, so every call would return {outs} as they "
                             "are: launch through the tensors it receives (body(**tensors)) or "
                             "return {output name: Tensor}")
        self._reset(outputs=False)     # (the outputs keep what the warm-up wrote)

    # -- the recorded work ----------------------------------------------------------------------
    def _run_body(self):
        if self._loop is None:
            return self._run_once()
        if self._warmups > 0:            # a warm-up: the body once (kernels, pool sizes)
            self._warmups -= 1
            return self._run_once()
        self.client.capture_while(self._tensors[self._loop].handle, self._run_once,
                                  self._max_iterations)
        return None

    def _run_once(self):
        result = self._body(**self._tensors)
        if result is None:
            return None
        outs = [n for n, s in self._specs.items() if s.kind == "output"]
        if isinstance(result, Tensor):
            if len(outs) != 1:
                raise TypeError(f"StaticGraph: body returned one Tensor but the graph has outputs "
                                f"{outs}; return a dict name -> Tensor")
            result = {outs[0]: result}
        if not isinstance(result, dict):
            raise TypeError(f"StaticGraph: body must return None, a Tensor or a dict of output "
                            f"Tensors, got {type(result).__name__}")
        for name, t in result.items():
            spec = self._specs.get(name)
            if spec is None or spec.kind != "output":
                raise ValueError(f"StaticGraph: body returned {name!r}, which is not an output "
                                 f"(outputs: {outs})")
            if not isinstance(t, Tensor):
                raise TypeError(f"StaticGraph: body returned {type(t).__name__} for output "
                                f"{name!r}; return a runtime.Tensor")
            if t.size != spec.size or t.dtype != spec.dtype:
                raise ValueError(f"StaticGraph: body returned {t.shape} {t.dtype} for output "
                                 f"{name!r}, declared {spec!r}")
            dst = self._tensors[name]
            if t.handle is not dst.handle:
                self.client.launch(copy_words, grid(spec.size), [t.handle, dst.handle],
                                   {"n": spec.size})
        return None

    # -- checks -----------------------------------------------------------------------------------
    def _host_value(self, name: str, value, what: str) -> np.ndarray | None:
        """Checked host copy of ``value`` for slot ``name`` (``None``: the slot's own buffer)."""
        spec = self._specs[name]
        own = self._tensors[name]
        if isinstance(value, (Tensor, Handle)):
            h = value.handle if isinstance(value, Tensor) else value
            if h is own.handle:
                return None
            raise TypeError(f"{what}: {spec.kind} {name!r} was given a device buffer "
                            f"({type(value).__name__} of handle {h.id}), not the graph's own "
                            f"(handle {own.handle.id}). The graph replays against the buffers it "
                            "captured and never reads another; pass host data (a numpy array) "
                            "to be copied in place")
        if isinstance(value, np.ndarray) or isinstance(value, np.generic):
            arr = np.asarray(value)
            if arr.dtype != TENSOR_DTYPES[spec.dtype]:
                raise TypeError(f"{what}: {spec.kind} {name!r} must be {spec.dtype} "
                                f"({TENSOR_DTYPES[spec.dtype]}), got {arr.dtype}; convert it with "
                                f".astype(np.{TENSOR_DTYPES[spec.dtype]})")
        else:
            try:
                arr = np.asarray(value)
            except Exception as e:  # noqa: BLE001 - reported as a type error
                raise TypeError(f"{what}: {spec.kind} {name!r} must be array-like, got "
                                f"{type(value).__name__}") from e
            kinds = "iub" if spec.dtype == "i32" else "iubf"
            if arr.dtype.kind not in kinds:
                raise TypeError(f"{what}: {spec.kind} {name!r} must be {spec.dtype}, got "
                                f"{type(value).__name__} of {arr.dtype}")
            if spec.dtype == "i32" and arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
                raise ValueError(f"{what}: {spec.kind} {name!r} has values outside i32")
            arr = arr.astype(TENSOR_DTYPES[spec.dtype])
        if arr.shape != spec.shape:
            raise ValueError(f"{what}: {spec.kind} {name!r} must have shape {spec.shape}, got "
                             f"{arr.shape}")
        return arr

    def _check_inputs(self, given: dict, what: str) -> dict:
        names = [n for n, s in self._specs.items() if s.kind == "input"]
        unknown = [n for n in given if n not in names]
        if unknown:
            raise TypeError(f"{what}: unknown inputs {unknown}; the graph's inputs are {names}")
        missing = [n for n in names if n not in given]
        if missing:
            raise TypeError(f"{what}: missing inputs {missing}; every call gives every input "
                            "(an input left out would be read stale from the last call)")
        return {n: self._host_value(n, v, what) for n, v in given.items()}

    # -- calls ------------------------------------------------------------------------------------
    def __call__(self, **inputs) -> dict:
        """Write ``inputs`` in place, replay, and return the outputs.

        Args:
            **inputs: host data for every input: numpy arrays of exactly the declared shape and
                dtype (numpy scalars too), or Python numbers/lists of that shape (converted). The
                graph's own input Tensor is accepted as "keep its contents".
        Returns: ``{output name: np.ndarray}`` (declared shape and dtype; fresh copies).
        Raises:
            TypeError: a missing or unknown input name, a wrong dtype, or a foreign device
                buffer. ValueError: a wrong shape. Nothing is written when a check fails.
            ``Graph.replay``'s errors; ``ReplayFailed``/``ServerUnhealthy`` from the reads.
        Streams: the writes, the replay and the reads all run on :attr:`stream`, in that order.
        Thread safety: a whole call holds the graph's lock.
        """
        self._alive("call")
        arrays = self._check_inputs(inputs, "StaticGraph call")
        with self._lock:
            self._write(arrays)
            self._cap.replay()
            return {n: self._tensors[n].numpy() for n, s in self._specs.items()
                    if s.kind == "output"}

    def replay(self, steps: int = 1) -> None:
        """Run the graph ``steps`` times with the buffers as they are (no host data, no reads).

        For graphs that feed themselves through their state (a decode step writing its next
        token and position on the device): inputs keep what the last call or :meth:`write`
        put there. Returns once the replays are enqueued; :meth:`read` waits for them. To run
        a whole loop, with its end test on the device, in one replay, record the step inside
        ``ComputeClient.capture_while`` (``runtime.models.decoder.Decoder.loop_graph``).

        Raises: ``ValueError`` (``steps < 0``); ``Graph.replay``'s errors.
        Streams: on :attr:`stream`.
        """
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
            raise ValueError(f"replay: steps must be a non-negative int, got {steps!r}")
        self._alive("replay")
        with self._lock:
            for _ in range(int(steps)):
                self._cap.replay()

    def write(self, **values) -> None:
        """Set inputs or state in place (checked like a call; the body is not run).

        Raises: ``TypeError`` (an output or unknown name, a wrong dtype, a foreign buffer);
            ``ValueError`` (a wrong shape). Nothing is written when a check fails.
        Streams: on :attr:`stream`, ordered before the next replay.
        """
        self._alive("write")
        for n in values:
            spec = self._specs.get(n)
            if spec is None or spec.kind == "output":
                settable = [m for m, s in self._specs.items() if s.kind != "output"]
                raise TypeError(f"StaticGraph.write: {n!r} is not an input or state (settable: "
                                f"{settable})")
        arrays = {n: self._host_value(n, v, "StaticGraph.write") for n, v in values.items()}
        with self._lock:
            self._write(arrays)

    def _alive(self, what: str) -> None:
        if not self._tensors:
            raise UnknownGraph(f"StaticGraph.{what}: the graph was released")

    def _write(self, arrays: dict) -> None:
        for n, a in arrays.items():
            if a is not None:
                self.client.write(self._tensors[n].handle, a)

    def read(self, *names):
        """Read outputs, state or inputs to the host.

        Args:
            *names: one or more slot names; none: every output.
        Returns: one ``np.ndarray`` for one name, else ``{name: np.ndarray}``.
        Raises: ``KeyError`` (unknown name); the read's errors.
        Streams: on :attr:`stream`: waits for every replay enqueued before.
        """
        self._alive("read")
        for n in names:
            if n not in self._specs:
                raise KeyError(f"StaticGraph.read: no slot {n!r}; slots: {list(self._specs)}")
        with self._lock:
            if len(names) == 1:
                return self._tensors[names[0]].numpy()
            names = names or [n for n, s in self._specs.items() if s.kind == "output"]
            return {n: self._tensors[n].numpy() for n in names}

    def reset(self) -> None:
        """Restore every state slot and every output to its initial contents (zeros unless
        given; on :attr:`stream`): the recovery after a failed call (module doc). The outputs: a
        graph may write an output only inside a conditional node (``loop=``: in the loop's
        body, which may run zero times), so a replay leaves its failure mark in place
        (docs/contract.md section 4b) and, before ADV8, every later call raised
        ``ReplayFailed`` for it however often the state was reset."""
        self._alive("reset")
        self._reset(outputs=True)

    def _reset(self, outputs: bool) -> None:
        with self._lock:
            for n, s in self._specs.items():
                if s.kind == "state" or outputs and s.kind == "output":
                    self.client.write(self._tensors[n].handle, s.init)

    def release(self) -> None:
        """Release the graph and its buffers (idempotent); later calls raise ``UnknownGraph``."""
        with self._lock:
            self._cap.release()
            self._tensors = {}

    def __enter__(self) -> "StaticGraph":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- facts ------------------------------------------------------------------------------------
    @property
    def signature(self) -> dict:
        """``{"inputs": {...}, "outputs": {...}, "state": {...}}`` of ``name: (shape, dtype)``."""
        out = {"inputs": {}, "outputs": {}, "state": {}}
        key = {"input": "inputs", "output": "outputs", "state": "state"}
        for n, s in self._specs.items():
            out[key[s.kind]][n] = (s.shape, s.dtype)
        return out

    @property
    def is_hardware(self) -> bool:
        """True when a replay is one driver-graph dispatch (cuda)."""
        return self._cap.is_hardware

    @property
    def graph(self):
        """The recorded :class:`~runtime.Graph` calls replay (``info()``, ``describe()``,
        ``to_dot()``), or ``None`` on the fallback (:attr:`fallback_reason`) and after
        ``release``. Owned by this StaticGraph: do not release it yourself."""
        return self._cap.graph

    @property
    def recorded(self) -> bool:
        """True when calls replay a recorded graph; False on the fallback (body re-run)."""
        return self._cap.recorded

    @property
    def fallback_reason(self):
        """``None`` when recorded, else why the body is re-run on every call."""
        return self._cap.fallback_reason

    def __repr__(self):
        sig = ", ".join(f"{k}={ {n: f'{s[0]} {s[1]}' for n, s in v.items()} }"
                        for k, v in self.signature.items() if v)
        how = "recorded" if self.recorded else "fallback"
        return f"StaticGraph({sig}, stream={int(self.stream)}, {how})"
