"""Programs: lists of client calls over your kernels, each op knowing how it runs and prints.

A :class:`Program` is plain data (hypothesis shrinks it, ``repr`` prints it as Python you can
paste). Every op names the client that issues it; client ``k`` is pinned to stream
``k % program.streams``. Buffers (``b0, b1...``), graphs (``g0...``) and events (``e0...``) are
numbered in the order the program makes them. Buffers are 1-D with ``program.size`` elements.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..kernel import DTYPES, Kernel, normalize_count
from .. import kernels as library
from ..kernels.shader import program as _shader_program


#: ``y[i] = x[i]`` over ``n`` 4-byte elements of any dtype, bitwise (the library's
#: ``copy_words``): fills a buffer allocated inside a capture window, so the graph writes it
#: before anything reads it.
copy32 = library.copy_words


def _set_counter(c, *, value, count):
    c[0] = value


def _count_down(c, *, count):
    c[0] -= 1


#: ``c[0] = value`` on a 1-element i32 loop counter (``CaptureWhile`` starts its loop with it).
set_counter = _shader_program("set_counter", [("c", "i32", "read_write")],
                                     [("value", "i32")], (1, 1, 1), "c[0] = p.value;",
                                     cpu=_set_counter)
#: ``c[0] -= 1`` on a 1-element i32 loop counter (the first launch of a ``CaptureWhile`` body).
count_down = _shader_program("count_down", [("c", "i32", "read_write")], [], (1, 1, 1),
                                    "c[0] = c[0] - 1;", cpu=_count_down)


def _set_counts(flag, c, *, x, count):
    c[:] = 1
    c[0] = x


#: ``c = [x, 1, 1, 1, ...]`` on a u32 buffer: the three workgroup counts an indirect launch reads
#: (``LaunchIndirect``), computed from ``flag`` (an f32 buffer it reads and ignores, so a failure
#: of ``flag``'s writer reaches the counts: contract section 4). cpu only (``indirect=True``).
set_counts = Kernel("set_counts", [("flag", "f32", "read"), ("c", "u32", "write")],
                    [("x", "u32")], cpu=_set_counts)
_BUILTINS = {"copy32": copy32, "set_counter": set_counter, "count_down": count_down,
             "set_counts": set_counts}


class KernelSpec(NamedTuple):
    """One of your kernels as ``programs()`` launches it.

    Args:
        kernel: a ``runtime.Kernel`` whose ``cpu`` body is the model's reference.
        params: ``{name: value or hypothesis strategy}``; a param called ``n`` that you leave out
            is the buffer length in elements (the library's elementwise convention).
        count: workgroups, an int or ``(x, y, z)`` (default 1).
    """

    kernel: Kernel
    params: dict = {}
    count: object = 1

    @classmethod
    def of(cls, entry) -> "KernelSpec":
        """A spec from a ``Kernel``, a ``(kernel, params)`` or ``(kernel, params, count)`` tuple,
        or a spec. Raises ``TypeError`` for anything else, ``ValueError`` for unknown params."""
        if isinstance(entry, KernelSpec):
            spec = entry
        elif isinstance(entry, Kernel):
            spec = cls(entry)
        elif isinstance(entry, tuple) and entry and isinstance(entry[0], Kernel):
            spec = cls(*entry)
        else:
            raise TypeError(f"kernels: expected a runtime.Kernel or (kernel, params[, count]), "
                            f"got {entry!r}")
        unknown = set(spec.params) - set(spec.kernel.param_names)
        if unknown:
            raise ValueError(f"kernel {spec.kernel.name}: unknown params {sorted(unknown)}; it "
                             f"takes {list(spec.kernel.param_names)}")
        normalize_count(spec.count)
        return spec._replace(params=dict(spec.params))


def _kernel_expr(kernel: Kernel) -> str:
    for name, k in _BUILTINS.items():
        if kernel is k:
            return name
    if getattr(library, kernel.name, None) is kernel:
        return f"K.{kernel.name}"
    return kernel.name


def _values(values, dtype: str) -> str:
    return f"np.array({list(values)!r}, np.{DTYPES[dtype].name})"


class Objects:
    """The live runtime objects of one run, by program number."""

    def __init__(self, size: int, kernels):
        self.size, self.kernels = size, kernels
        self.bufs: dict = {}
        self.graphs: dict = {}
        self.events: dict = {}
        self.streams: list = []          # the StreamId of each client (run.py sets it)
        self.pools: dict = {}            # pool number -> runtime.GraphPool (made on first use)

    def pool(self, i: int):
        """Graph pool ``i`` of the run (a ``runtime.GraphPool``, made on first use)."""
        p = self.pools.get(i)
        if p is None:
            from ..frontend.pool import GraphPool
            p = self.pools[i] = GraphPool()
        return p


class Create(NamedTuple):
    """``b = c.create(values)``: a buffer of ``dtype`` (``"f32"``, ``"i32"``, ``"u32"``)."""
    client: int
    buf: int
    dtype: str
    values: tuple

    def _run(self, c, objs):
        objs.bufs[self.buf] = c.create(np.array(self.values, DTYPES[self.dtype]))

    def _code(self):
        return f"b{self.buf} = c{self.client}.create({_values(self.values, self.dtype)})"


class Empty(NamedTuple):
    """``b = c.empty(size, dtype)``: contents undefined until written."""
    client: int
    buf: int
    dtype: str

    def _run(self, c, objs):
        objs.bufs[self.buf] = c.empty(objs.size, DTYPES[self.dtype])

    def _code(self):
        return f"b{self.buf} = c{self.client}.empty(SIZE, np.{DTYPES[self.dtype].name})"


class Write(NamedTuple):
    """``c.write(b, values)``."""
    client: int
    buf: int
    dtype: str
    values: tuple

    def _run(self, c, objs):
        c.write(objs.bufs[self.buf], np.array(self.values, DTYPES[self.dtype]))

    def _code(self):
        return f"c{self.client}.write(b{self.buf}, {_values(self.values, self.dtype)})"


class Launch(NamedTuple):
    """``c.launch(kernel, count, [bufs], params)``; ``kernel`` indexes ``program.kernels``."""
    client: int
    kernel: int
    bufs: tuple
    params: tuple

    def _run(self, c, objs):
        spec = objs.kernels[self.kernel]
        c.launch(spec.kernel, self._count(spec, objs), [objs.bufs[b] for b in self.bufs],
                 dict(self.params))

    @staticmethod
    def _count(spec, objs):
        return spec.count

    def _count_code(self, spec) -> str:
        return repr(spec.count)

    def _code(self, kernels):
        spec = kernels[self.kernel]
        bufs = ", ".join(f"b{b}" for b in self.bufs)
        params = "{" + ", ".join(f"{k!r}: {v!r}" for k, v in self.params) + "}"
        return (f"c{self.client}.launch({_kernel_expr(spec.kernel)}, {self._count_code(spec)}, "
                f"[{bufs}], {params})")


class LaunchIndirect(NamedTuple):
    """``c.launch(kernel, b_counts, [bufs], params)``: an indirect launch (outside capture
    windows), its three workgroup counts read from the u32 buffer ``counts`` when it executes
    (a count of 0 runs nothing); ``kernel`` indexes ``program.kernels``."""
    client: int
    kernel: int
    bufs: tuple
    params: tuple
    counts: int

    _run, _code = Launch._run, Launch._code

    def _count(self, spec, objs):
        return objs.bufs[self.counts]

    def _count_code(self, spec) -> str:
        return f"b{self.counts}"


def _simple_op(name: str, fields: str, code: str, run, doc: str):
    """An op type whose line is ``code`` formatted with its fields and whose call is ``run``."""
    base = NamedTuple(name, [(f, int) for f in fields.split()])
    return type(name, (base,), {"__slots__": (), "__doc__": doc, "__module__": __name__,
                                "_run": lambda self, c, objs: run(self, c, objs),
                                "_code": lambda self: code.format(**self._asdict())})


def _record(op, c, objs):
    objs.events[op.event] = c.record_event()


def _stop(op, c, objs):
    objs.graphs[op.graph] = c.stop_capture()


Read = _simple_op("Read", "client buf", "c{client}.read(b{buf})",
                  lambda op, c, objs: c.read(objs.bufs[op.buf]),
                  "``c.read(b)``: the only op that returns data.")
Free = _simple_op("Free", "client buf", "b{buf}.release()",
                  lambda op, c, objs: objs.bufs.pop(op.buf).release(),
                  "``b.release()`` (freed on the stream that created it).")
Sync = _simple_op("Sync", "client", "c{client}.sync()", lambda op, c, objs: c.sync(),
                  "``c.sync()``.")
RecordEvent = _simple_op("RecordEvent", "client event", "e{event} = c{client}.record_event()",
                         _record, "``e = c.record_event()``.")
WaitEvent = _simple_op("WaitEvent", "client event", "c{client}.wait_event(e{event})",
                       lambda op, c, objs: c.wait_event(objs.events[op.event]),
                       "``c.wait_event(e)``.")
Prepare = _simple_op("Prepare", "client", "c{client}.graph_prepare()",
                     lambda op, c, objs: c.graph_prepare(), "``c.graph_prepare()``.")
PreparePool = _simple_op("PreparePool", "client pool", "c{client}.graph_prepare(pool=p{pool})",
                         lambda op, c, objs: c.graph_prepare(pool=objs.pool(op.pool)),
                         "``c.graph_prepare(pool=p)``: the window allocates from graph pool "
                         "``p`` (``runtime.GraphPool``) first; its graphs share their "
                         "temporaries (docs/contract.md section 4c).")
StartCapture = _simple_op("StartCapture", "client", "c{client}.start_capture()",
                          lambda op, c, objs: c.start_capture(), "``c.start_capture()``.")
StopCapture = _simple_op("StopCapture", "client graph", "g{graph} = c{client}.stop_capture()",
                         _stop, "``g = c.stop_capture()``.")
Replay = _simple_op("Replay", "client graph", "g{graph}.replay()",
                    lambda op, c, objs: objs.graphs[op.graph].replay(),
                    "``g.replay()`` (issued from ``client``'s thread; it runs on the capture "
                    "stream).")
Release = _simple_op("Release", "client graph", "g{graph}.release()",
                     lambda op, c, objs: objs.graphs.pop(op.graph).release(), "``g.release()``.")


def _clone(op, c, objs):
    objs.graphs[op.clone] = objs.graphs[op.graph].clone()


Clone = _simple_op("Clone", "client graph clone", "g{clone} = g{graph}.clone()", _clone,
                   "``g2 = g.clone()``: one more owner of the same backend graph (a graph is "
                   "destroyed when its last clone is released).")


class Thread(NamedTuple):
    """A thread that issues ``ops`` (``Write`` / ``Launch``; their ``client`` is ignored) on its
    own default stream and ends, issued from ``client``'s thread, which joins it. ``sync``: the
    thread syncs its stream before it ends, and the caller then waits (bounded) until the
    server reclaimed that stream; else its work may still be pending when it ends (reclaimed
    later, or not, as the schedule goes). Issue 23 item 4: a reclaimed stream's work counts as
    synchronized for the checker."""
    client: int
    thread: int
    ops: tuple
    sync: bool

    def _run(self, c, objs):
        failed = []

        def body():
            t = c.with_stream(None)               # this thread's own stream
            try:
                for op in self.ops:
                    op._run(t, objs)
                if self.sync:
                    t.sync()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                failed.append(e)
        before = c.memory_usage()["streams"]
        th = threading.Thread(target=body, name=f"runtime-testing-t{self.thread}")
        th.start()
        th.join()
        if failed:
            raise failed[0]
        if self.sync:                             # idle: reclaimed at the server's next look
            deadline = time.monotonic() + 5.0
            while c.memory_usage()["streams"] > before and time.monotonic() < deadline:
                time.sleep(0.001)

    def _code(self, kernels):
        body = [(op._code(kernels) if isinstance(op, Launch) else op._code())
                .replace(f"c{op.client}.", "t.", 1) for op in self.ops]
        lines = [f"def thread{self.thread}():  # a thread on its own stream that ends",
                 "    t = c.with_stream(None)"] + [f"    {ln}" for ln in body]
        if self.sync:
            lines.append("    t.sync()")
        lines.append(f"th = threading.Thread(target=thread{self.thread}); th.start(); th.join()")
        if self.sync:
            lines.append("c.memory_usage()  # its stream is reclaimed")
        return "\n".join(lines)

    def launches(self) -> tuple:
        """Its ``Launch`` ops."""
        return tuple(op for op in self.ops if isinstance(op, Launch))


class CreateFlag(NamedTuple):
    """``b = c.create(np.array([value], np.int32))``: a 1-element condition or loop counter."""
    client: int
    buf: int
    value: int

    def _run(self, c, objs):
        objs.bufs[self.buf] = c.create(np.array([self.value], np.int32))

    def _code(self):
        return f"b{self.buf} = c{self.client}.create(np.array([{self.value}], np.int32))"


def _body(c, objs, launches):
    for op in launches:
        op._run(c, objs)


def _lambda(launches, kernels) -> str:
    if not launches:
        return "lambda: None"
    return "lambda: (" + ", ".join(op._code(kernels) for op in launches) + ",)"


class CaptureIf(NamedTuple):
    """``c.capture_if(b, lambda: (launches...), lambda: (launches...))``: ``cond`` is a flag
    (``CreateFlag``); ``then``/``other`` are ``Launch`` ops of the same client."""
    client: int
    cond: int
    then: tuple
    other: tuple

    def _run(self, c, objs):
        c.capture_if(objs.bufs[self.cond], lambda: _body(c, objs, self.then),
                     (lambda: _body(c, objs, self.other)) if self.other else None)

    def _code(self, kernels):
        other = f", {_lambda(self.other, kernels)}" if self.other else ""
        return f"c{self.client}.capture_if(b{self.cond}, {_lambda(self.then, kernels)}{other})"

    def launches(self) -> tuple:
        """Every ``Launch`` of both branches (then, else)."""
        return self.then + self.other


class CaptureWhile(NamedTuple):
    """``c.launch(set_counter, ...); c.capture_while(b, lambda: (count_down, launches...),
    max_iterations=m)``: ``init`` sets the counter to at most ``max_iterations``, the body's
    first launch counts it down, so the loop runs ``init``'s value times."""
    client: int
    counter: int
    init: tuple
    body: tuple
    max_iterations: int

    def _run(self, c, objs):
        self.init[0]._run(c, objs)
        c.capture_while(objs.bufs[self.counter], lambda: _body(c, objs, self.body),
                        max_iterations=self.max_iterations)

    def _code(self, kernels):
        return (f"{self.init[0]._code(kernels)}; c{self.client}.capture_while(b{self.counter}, "
                f"{_lambda(self.body, kernels)}, max_iterations={self.max_iterations})")

    def launches(self) -> tuple:
        """Every ``Launch`` of the op: the counter's ``set_counter``, then the body."""
        return self.init + self.body


def flat_launches(items) -> list:
    """The ``Launch`` ops of ``items``, conditional ops expanded (their bodies, once)."""
    out = []
    for op in items:
        out.extend(op.launches() if isinstance(op, (CaptureIf, CaptureWhile, Thread)) else [op])
    return out


Update = _simple_op("Update", "client graph old new",
                    "g{graph}.update(rebind={{b{old}: b{new}}})",
                    lambda op, c, objs: objs.graphs[op.graph].update(
                        rebind={objs.bufs[op.old]: objs.bufs[op.new]}),
                    "``g.update(rebind={old: new})``: the graph uses ``new`` instead of ``old`` "
                    "for the replays enqueued after it.")


UpdateCount = _simple_op("UpdateCount", "client graph index x y z",
                         "g{graph}.update(count={{{index}: ({x}, {y}, {z})}})",
                         lambda op, c, objs: objs.graphs[op.graph].update(
                             count={op.index: (op.x, op.y, op.z)}),
                         "``g.update(count={i: (x, y, z)})``: launch ``i`` of the graph (in "
                         "``g.launches()`` order) runs ``(x, y, z)`` workgroups in the replays "
                         "enqueued after it; ``(0, 1, 1)`` runs nothing (what it writes keeps its "
                         "failure marks: docs/contract.md section 4b).")


class Instantiate(NamedTuple):
    """``g2 = g.instantiate(rebind={old: rebound}, stream=cK.stream)``: a new, independent graph
    of ``g``'s recording (no warm-up, no capture) on client ``target``'s stream; ``old ==
    rebound``: no rebind, so the instance shares every buffer with ``g``, its state too."""
    client: int
    graph: int
    new: int
    old: int
    rebound: int
    target: int

    def _run(self, c, objs):
        rb = {} if self.old == self.rebound else {objs.bufs[self.old]: objs.bufs[self.rebound]}
        objs.graphs[self.new] = objs.graphs[self.graph].instantiate(
            rebind=rb, stream=objs.streams[self.target])

    def _code(self):
        rb = "{}" if self.old == self.rebound else f"{{b{self.old}: b{self.rebound}}}"
        return (f"g{self.new} = g{self.graph}.instantiate(rebind={rb}, "
                f"stream=c{self.target}.stream)")


@dataclass(frozen=True, repr=False)
class Program:
    """A generated program: ``ops`` then ``final`` (a sync of every stream and a read of every
    live buffer, the end-of-program check).

    Attributes:
        ops, final: tuples of ops (``Create``, ``Launch``, ``Read``, ...).
        kernels: the ``KernelSpec`` s that ``Launch.kernel`` indexes.
        size: elements per buffer.
        streams, clients: client ``k`` is pinned to stream ``k % streams``.
        contract: True when the program keeps the replay contract by construction (then every
            read must match the sequential model); False for programs that may race.

    ``len(program)`` is the number of calls in ``ops``; ``repr`` (and ``to_python()``) prints it
    as Python calls you can paste (``repr`` opens the client as a failing ``run_program`` of an
    equal program did: backend, smallest failing seed, ``check``); ``dataclasses.replace``
    makes a variant.
    """

    ops: tuple
    final: tuple
    kernels: tuple
    size: int
    streams: int
    clients: int
    contract: bool = True

    def __len__(self):
        return len(self.ops)

    def line(self, op) -> str:
        """One op as a line of Python."""
        return op._code(self.kernels) if isinstance(op, (Launch, CaptureIf, CaptureWhile,
                                                         Thread, LaunchIndirect)) \
            else op._code()

    def to_python(self, backend="cpu", seed=0, check=False, notes=None) -> str:
        """The program as Python calls on a fresh server.

        Args:
            backend, seed, check: how the printed ``runtime.client(...)`` is opened (the seed
                only on cpu, where it picks the interleaving).
            notes: ``{op index: comment}`` appended to those lines (``len(ops) + i`` for
                ``final[i]``).
        Returns: the source text, one call per line.
        """
        notes = notes or {}
        kernels = [s.kernel for s in self.kernels]
        lines = ["import numpy as np", "import runtime"]
        if any(isinstance(op, Thread) for op in self.ops):
            lines.insert(0, "import threading")
        if any(getattr(library, k.name, None) is k for k in kernels):
            lines.append("from runtime import kernels as K")
        used = {_kernel_expr(kernels[op.kernel]) for op in flat_launches(self.ops)
                if isinstance(op, (Launch, LaunchIndirect))}
        builtins = [name for name in _BUILTINS if name in used]
        if builtins:
            lines.append(f"from runtime.testing import {', '.join(builtins)}")
        own = sorted({k.name for k in kernels if _kernel_expr(k) == k.name
                      and k not in _BUILTINS.values()})
        if own:
            lines.append(f"# your kernels, in scope as: {', '.join(own)}")
        opts = [repr(backend)]
        if backend == "cpu":
            opts += ["scheduler='interleave'", f"seed={seed}"]
        if check:
            opts.append("check=True")
        lines += [f"SIZE = {self.size}", f"c = runtime.client({', '.join(opts)})",
                  "streams = [runtime.StreamId.new() for _ in range(%d)]" % self.streams]
        lines += [f"c{k} = c.with_stream(streams[{k % self.streams}])" for k in range(self.clients)]
        pools = sorted({op.pool for op in self.ops if isinstance(op, PreparePool)})
        lines += [f"p{i} = runtime.GraphPool()" for i in pools]
        for i, op in enumerate(self.ops + self.final):
            if i == len(self.ops) and self.final:
                lines.append("# end of program: sync every stream, read every live buffer")
            text = self.line(op)
            lines.append(f"{text}  # {notes[i]}" if i in notes else text)
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))          # hypothesis prints a falsifying Program as Python

    def __repr__(self):
        # hypothesis prints its falsifying example before the final run: the client line is
        # that of a failing run of an equal program (backend, check=True, the smallest failing
        # seed: the one hypothesis shrinks to), so the paste reproduces what failed, the
        # happens-before checker included
        how = _failed_run(self)
        if how is not None:
            return "\n# a Program (runtime.testing), opened as a failing run of it was\n" \
                + self.to_python(*how)
        return "\n# a Program (runtime.testing); the failing seed is in the error message\n" \
            + self.to_python()


#: the last distinct programs that disagreed with the model, each with how it failed
#: ``[program, (backend, seed, check)]`` (its smallest failing seed), noted by ``run_program``
#: for ``Program.__repr__`` (bounded)
_FAILED_RUNS: list = []
_MAX_FAILED_RUNS = 16


def _same(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - params whose == is not a bool
        return False


def _failed_run(program):
    for prog, how in _FAILED_RUNS:
        if _same(prog, program):
            return how
    return None


def note_failed_run(program, backend: str, seed: int, check: bool) -> None:
    """Remember how ``program`` ran when it disagreed with the model (its repr prints that;
    of several failing seeds, the smallest)."""
    how = (backend, seed, check)
    for i, (prog, old) in enumerate(_FAILED_RUNS):
        if _same(prog, program):
            del _FAILED_RUNS[i]
            if old[1] < seed:
                how = old
            break
    _FAILED_RUNS.append((program, how))
    del _FAILED_RUNS[:-_MAX_FAILED_RUNS]


#: every op type, by name
OPS = {cls.__name__: cls for cls in (Create, Empty, Write, Launch, Read, Free, Sync, RecordEvent,
                                     WaitEvent, Prepare, PreparePool, StartCapture, StopCapture,
                                     Replay,
                                     Release, Clone, CreateFlag, CaptureIf, CaptureWhile,
                                     Update, UpdateCount, Instantiate, Thread,
                                     LaunchIndirect)}
