"""The backend interface: the device verbs a server calls, and nothing else.

A backend touches device APIs and decides no policy. Ordering across streams, capture-window
refusals, retention, error recording and the memory pool live once in ``runtime.server``; the
server calls these verbs from its single owner (the device thread or a caller holding the
server's lock), never two at a time (CubeCL's runner-thread rule; wgpu-py objects are not shared).

Objects returned by a backend (buffers, streams, events, programs, recordings, graphs) never
leave the server: clients only see ids (CubeCL ``id.rs``).

Terms:
- ``buf``: a raw device buffer of at least the requested bytes (from :meth:`Backend.alloc`).
- ``args``: a list of ``(buf, nbytes)`` pairs, one per kernel binding; ``nbytes`` is the handle's
  size in bytes (the pool may hand out a larger buffer).
- ``mark``: the failure protocol of ``launch``/``launch_graph``, one for every backend. A
  failure found during the call is raised (a ``ServerError``; the server queues it on the
  stream and marks what the work would have written). A failure found after the call returned
  (at execution on a worker, at a later submit, on a queue thread) is handed to
  ``mark.fail(error)`` (any thread; ``mark`` is the operation's
  ``runtime.server.marks.Mark``, or None), which marks what the work would have written and
  returns the error to report; the backend reports that on ``stream`` by failing the stream's
  next completion (``synchronize``, ``copy_out``) with it, as CUDA reports an asynchronous
  error at the next synchronize. Errors no stream owns (wgpu: a refused ``write_buffer``) go to
  ``failures``, raised by the next blocking call on any stream.
- ``count``: a 3-tuple ``(x, y, z)`` of workgroups, or (``indirect_dispatch`` backends only) a
  2-tuple ``(buf, nbytes)``, ``nbytes >= 12`` (checked by the client), for an indirect dispatch
  whose three ``u32`` counts are read from the buffer when the launch executes (WebGPU
  ``dispatch_workgroups_indirect``); tell them apart by length.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from .. import _threads
from ..errors import ErrorQueue, UnsupportedError


class Completion:
    """A result the device produces later: a read's bytes, a stream drain.

    The server hands it back from a blocking call; the caller waits on it outside the server's
    lock, so one client's wait never stalls the others. ``wait(timeout)`` returns whether it is
    done; the caller polls server health between waits (never a hang).
    """

    __slots__ = ("_event", "done", "value", "error", "helper", "tick")

    def __init__(self, helper=None):
        self._event = None
        self.done = False
        self.value = None
        self.error = None
        #: optional one-element list set to ``[True]`` when it finishes (the server learns that
        #: the stream ran up to it without keeping the completion, or its value, alive).
        self.tick = None
        #: optional callable the waiting thread runs first (the cpu backend lets the waiter run
        #: its own stream's queued work instead of handing it to a worker thread and back).
        self.helper = helper

    @classmethod
    def ready(cls, value=None) -> "Completion":
        """An already finished completion holding ``value``."""
        c = cls()
        c.value, c.done = value, True
        return c

    def set(self, value=None) -> None:
        self.value = value
        self._finish()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._finish()

    def _finish(self):
        self.done = True          # before reading _event: see wait()
        tick = self.tick
        if tick is not None:
            tick[0] = True
        ev = self._event
        if ev is not None:
            ev.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block up to ``timeout`` seconds; True once done."""
        if self.done:
            return True
        if self.helper is not None:
            helper, self.helper = self.helper, None
            helper()
            if self.done:
                return True
        if self._event is None:
            self._event = _threads.Event()     # (SOAK8: no lock an interrupt leaves held)
            if self.done:         # finished between the check and the event's creation
                return True
        return self._event.wait(timeout)

    def result(self):
        """The value, or raise the recorded error (call after ``wait`` returned True)."""
        if self.error is not None:
            raise self.error
        return self.value


class Backend:
    """The device verbs (about a dozen, as tinygrad's ``Compiled`` and CubeCL's ``ComputeServer``).

    Subclasses live one per file in ``runtime/backends/`` and implement every verb below; the
    graph verbs have defaults that say "unsupported", so a backend without graphs adds no graph
    code. ``check_interface`` runs when the server constructs a backend, so a missing verb fails
    at start-up, not mid-run (wgpu-py ``backends/__init__.py``).

    Class attributes:
        name: ``"cpu"``, ``"wgpu"`` or ``"cuda"``.
        hardware_graphs: True when a graph is a driver graph (one dispatch per replay); the server
            then refuses fresh allocations inside a capture window (they would be memory nodes).
    """

    name = "base"
    hardware_graphs = False
    #: True when the device reads an indirect launch's three u32 counts when it executes (also
    #: in a graph replay): ``launch``/``record_launch`` then take ``count = (buf, nbytes)``.
    #: False: the backend only takes ``(x, y, z)``; the client reads the counts first and a
    #: capture window refuses an indirect launch (policy in ``runtime.server.capture``).
    indirect_dispatch = True
    #: a human-readable device description (adapter name, GPU name), set in ``__init__``.
    device_name = "unknown"
    #: the largest workgroup count per dimension ``(x, y, z)``, or ``None`` for no limit; the
    #: client refuses a larger count with ``LaunchError`` before anything is queued.
    max_workgroups = None

    @classmethod
    def probe(cls) -> dict:
        """Whether this backend can open a device here, without opening one.

        Returns: ``{"hardware": bool, "device": str}`` exactly (:data:`PROBE_KEYS`):
            ``hardware`` is True on a real GPU (``runtime.client(None)`` prefers those),
            ``device`` describes what ``__init__`` would open.
        Raises: ``UnsupportedError`` with the reason (no library, no device).
        """
        raise NotImplementedError

    def __init__(self, device: int = 0, **options: Any):
        self.device = device
        #: set by the server: called (from any thread) when ``load()`` shrank, so producers
        #: waiting for room in the device queue re-check (docs/contract.md section 1).
        self.on_room = _nothing
        #: errors no stream owns, found after enqueue (see ``take_failures``); any thread.
        self.failures = ErrorQueue()

    # -- memory --------------------------------------------------------------------------
    def alloc(self, nbytes: int):
        """A new device buffer of at least ``nbytes`` bytes. Raises ``OutOfMemory``."""
        raise NotImplementedError

    def free(self, buf) -> None:
        """Return ``buf`` to the device. The server calls it for a buffer no *later* work uses;
        work already enqueued on it may still be pending, so a backend whose allocator reuses
        memory at once must defer the release until that work ran (wgpu: ``destroy`` after the
        pending submits; cpu: numpy keeps the array while queued work references it)."""
        raise NotImplementedError

    def load(self) -> tuple:
        """The backlog ``(items, bytes)``: work enqueued on streams and not yet run (or
        submitted), and the host bytes it holds. The device queue bounds it
        (docs/contract.md section 1). Default ``(0, 0)``: the device API bounds its own queue (cuda)."""
        return (0, 0)

    def take_failures(self) -> list:
        """Errors no stream owns found after enqueue (``ServerError`` s), emptied; the server
        raises them at the next blocking call on any stream (see the module doc: ``mark``)."""
        return self.failures.take()

    # -- streams and events -----------------------------------------------------------------
    def new_stream(self):
        """A new in-order device queue (CUDA stream; a logical stream on WebGPU's one queue)."""
        raise NotImplementedError

    def release_stream(self, stream) -> bool:
        """Forget ``stream`` if its work is done (True); False: work is pending, ask again
        later. The server calls it for the default stream of a thread that ended. Errors the
        stream's work left and did not report yet go to ``failures`` (never dropped)."""
        return True

    def record_event(self, stream):
        """An event that completes once everything enqueued on ``stream`` so far has run."""
        raise NotImplementedError

    def wait_event(self, stream, event) -> None:
        """Make later work on ``stream`` wait for ``event`` (``cudaStreamWaitEvent``)."""
        raise NotImplementedError

    def synchronize(self, stream) -> Completion:
        """A completion for everything enqueued on ``stream`` so far; it carries the first
        asynchronous execution error of that work, if any."""
        raise NotImplementedError

    def flush(self, stream) -> None:
        """Hand batched work of ``stream`` to the device now (wgpu: submit the encoder)."""

    def idle(self, stream) -> bool:
        """True only when every piece of work enqueued on ``stream`` has run and left no error
        to report (a sync of it may return at once: ``ComputeServer.sync_idle``); False when
        unknown (the default: the server then synchronizes as usual)."""
        return False

    # -- copies ---------------------------------------------------------------------------
    def copy_in(self, stream, buf, data: np.ndarray) -> None:
        """Stream-ordered host-to-device copy of ``data`` (a contiguous ``uint8`` array the
        backend may keep: the server made it a private copy) to the start of ``buf``."""
        raise NotImplementedError

    def copy_out(self, stream, buf, nbytes: int) -> Completion:
        """Stream-ordered device-to-host copy of the first ``nbytes`` bytes of ``buf``; the
        completion's value is a ``uint8`` numpy array of ``nbytes``."""
        raise NotImplementedError

    def copy_out_now(self, stream, buf, nbytes: int, dtype=None):
        """The first ``nbytes`` of ``buf`` copied to the host at once (a new array: of numpy
        ``dtype`` when given and the backend types it, e.g. from a cached typed view, saving the
        reader a view; else ``uint8``), when ``stream`` is idle (nothing queued, running or
        failed) and the copy is cheap enough to make on the calling thread (the server's
        owner); None otherwise (the server then uses :meth:`copy_out`). Default: None (never)."""
        return None

    # -- kernels --------------------------------------------------------------------------
    def compile(self, kernel):
        """A program for ``kernel`` (a pipeline, a ``RawKernel``, the numpy callable). Raises
        ``LaunchError`` (no source for this backend, or a compile failure)."""
        raise NotImplementedError

    def release_program(self, program) -> None:
        """The server dropped ``program`` from its table (kernels made per request: the oldest
        past ``ComputeServer.MAX_PROGRAMS``): forget what the backend caches for it, so the
        compiled program lives only as long as queued work and graphs use it. Default: nothing
        cached."""

    def launch(self, stream, program, count, args, params: tuple, mark=None) -> None:
        """Enqueue one dispatch of ``program`` on ``stream``; ``mark``: see the module doc."""
        raise NotImplementedError

    def defers(self, kernel, nbytes: int) -> bool:
        """Whether a launch of ``kernel`` over buffers of ``nbytes`` bytes in all is work so
        small that running it at the server's next entry costs less than anything else done
        now (``ComputeServer.launch`` defers it: ``DeviceQueue.lazy``). Default: False."""
        return False

    def launch_now(self, stream, program, count, args, params: tuple) -> bool:
        """Run one dispatch at once on the calling thread (the server's owner) instead of
        enqueuing it, where that is cheaper than a hand-off and keeps the stream's order (its
        stream is idle: nothing queued, running or failed). Returns False when it did nothing
        (the server then enqueues it with :meth:`launch`), True when it ran. Raises
        ``LaunchError``: it ran and failed (the server queues the error on the stream and marks
        what it wrote, as for a failure found at execution). Default: False (never)."""
        return False

    # -- graphs ---------------------------------------------------------------------------
    def begin_graph(self, stream):
        """Open a recording on ``stream`` (hardware: begin stream capture)."""
        raise UnsupportedError(f"graph capture is not supported by the {self.name} backend")

    def record_launch(self, recording, program, count, args, params: tuple) -> None:
        """Add one dispatch to ``recording``: software graphs resolve it now (pipeline, bind
        group, uniforms), hardware graphs launch on the capturing stream."""
        raise UnsupportedError(f"graph capture is not supported by the {self.name} backend")

    def end_graph(self, recording):
        """Close ``recording`` and return the backend graph (hardware: instantiate, upload)."""
        raise UnsupportedError(f"graph capture is not supported by the {self.name} backend")

    def abort_graph(self, recording) -> None:
        """Drop an unfinished recording (a refused window)."""

    def launch_graph(self, stream, graph, mark=None) -> None:
        """Enqueue one replay of ``graph`` on ``stream``; return once it is enqueued; ``mark``:
        see the module doc (a launch of the graph failed while it executed). Returns None, or
        False when the backlog is known to be far below the device queue's bounds (the cpu
        backend's deferred work, at most ``DEFER_MAX`` items): the replay then skips looking
        for room in the queue (``Graph.replay``)."""
        raise UnsupportedError(f"graph replay is not supported by the {self.name} backend")

    def held_by_caller(self, stream) -> bool:
        """Whether the calling thread is itself running ``stream``'s work now (a cpu kernel
        body): the server then refuses the thread's blocking calls on ``stream``, which would
        wait for that work forever. Default: False (device work never runs host code)."""
        return False

    def launch_graph_now(self, stream, graph, buf=None, nbytes: int = 0, dtype=None):
        """:meth:`launch_now` for one replay of ``graph``: False (not run: enqueue it with
        :meth:`launch_graph`), True (it ran), or ``LaunchError`` (it ran and failed; the launches
        after the failing one did not run). With ``buf`` (a read of ``nbytes`` bytes of it as
        ``dtype`` follows, issue 26: one call for a replay and its read) it returns, instead of
        True, the copy :meth:`copy_out_now` would return right after (an ``np.ndarray``; the
        stream is idle then). Default: False (never). The server asks only for
        deferred replays (``ComputeServer._run_lazy``, ``_read_lazy``); the backend's own tests
        decide."""
        return False

    def destroy_graph(self, stream, graph) -> None:
        """Free ``graph`` once the work already enqueued on ``stream`` no longer needs it."""

    # -- graphs that change (runtime.server.graphs) ---------------------------------------
    #: True when ``capture_while`` is unrolled to ``max_iterations`` (then required).
    unrolls_loops = False
    #: why ``update_graph`` cannot patch (``Graph.fallback_reason`` after an update), or None.
    update_fallback_reason = None

    def update_graph(self, stream, graph, changes: dict, conds: dict):
        """Patch ``graph`` for the replays enqueued after this call (those enqueued before keep
        the old dispatches): ``changes`` = ``{launch index: (program, count, args, params)}``
        (launches in recording order, bodies of conditional nodes included), ``conds`` =
        ``{node index: (buf, nbytes)}`` (a new condition buffer). All or nothing: raise before
        changing anything. Returns the graph to use from now on (the same object or a new one;
        the server destroys the old one), or None: cannot patch, the server rebuilds the graph
        from its recording (``begin_graph`` ... ``end_graph``)."""
        return None

    def begin_cond(self, recording, kind: str, cond, max_iterations) -> None:
        """Open a conditional node in ``recording``: ``kind`` ``"if"`` (the launches recorded
        until ``else_cond``/``end_cond`` run when the 1-element i32/u32 at ``cond`` =
        ``(buf, nbytes)`` is non-zero at replay) or ``"while"`` (they run while it is non-zero,
        at most ``max_iterations`` times, else the replay fails with ``LoopLimitExceeded``).
        Raises ``UnsupportedError`` (at capture, never at replay) where there are none."""
        raise UnsupportedError(f"capture_if/capture_while are not supported by the {self.name} "
                               "backend")

    def else_cond(self, recording) -> None:
        """Switch the innermost open ``"if"`` node to its false branch."""
        raise UnsupportedError(f"capture_if is not supported by the {self.name} backend")

    def end_cond(self, recording) -> None:
        """Close the innermost open conditional node."""
        raise UnsupportedError(f"capture_if/capture_while are not supported by the {self.name} "
                               "backend")

    # -- lifetime -------------------------------------------------------------------------
    def is_alive(self) -> bool:
        """False once a backend worker died; waiting callers then get ``ServerClosed``."""
        return True

    def close(self) -> None:
        """Stop workers and fail every pending completion; called once, by the server."""


def _nothing() -> None:
    return None


def written_buffers(kernel, args) -> tuple:
    """The raw buffers a launch of ``kernel`` over ``args`` writes (its read_write bindings)."""
    return tuple(buf for (buf, _), b in zip(args, kernel.bindings) if b.access != "read")


VERBS = ("alloc", "free", "new_stream", "record_event", "wait_event", "synchronize", "copy_in",
         "copy_out", "compile", "launch", "probe")
#: the graph verbs: a backend implements all of them or none (then capture is unsupported).
GRAPH_VERBS = ("begin_graph", "record_launch", "end_graph", "launch_graph")
#: the keys of ``Backend.probe()``'s answer, and their types.
PROBE_KEYS = {"hardware": bool, "device": str}


def check_interface(backend_cls) -> None:
    """Raise ``TypeError`` naming what a backend class leaves unimplemented: a verb, part of the
    graph verbs, or a ``name``."""
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, Backend)):
        raise TypeError(f"a backend must be a subclass of runtime.backends.base.Backend, got "
                        f"{backend_cls!r}")
    def inherited(verb):
        return inspect.getattr_static(backend_cls, verb) is inspect.getattr_static(Backend, verb)
    missing = [v for v in VERBS if inherited(v)]
    graph = [v for v in GRAPH_VERBS if inherited(v)]
    if graph and len(graph) < len(GRAPH_VERBS):
        missing += graph
    if backend_cls.name == Backend.name:
        missing.append("name")
    if missing:
        raise TypeError(f"backend {backend_cls.__name__} does not implement {missing}")


def check_probe(backend_cls, info) -> dict:
    """``info`` if it has the declared shape of ``probe()`` (:data:`PROBE_KEYS`), else raise
    ``TypeError`` naming the backend."""
    if not (isinstance(info, dict) and set(info) == set(PROBE_KEYS)
            and all(isinstance(info[k], t) for k, t in PROBE_KEYS.items())):
        raise TypeError(f"backend {backend_cls.__name__}: probe() must return "
                        f"{{'hardware': bool, 'device': str}}, got {info!r}")
    return info
