"""The sequential model: a program run in issue order on numpy arrays with the kernels' cpu
bodies, and the contract's rules for what must raise (docs/contract.md sections 2, 4 and 5).

``Model.step(op, value, error)`` takes what the runtime answered for one op and returns a
mismatch (a sentence) or None. Where the model cannot know the answer it accepts either and
follows what happened: a buffer computed from an unknown input has unknown contents, a kernel
run on unknown inputs may or may not fail (so a buffer of unknown contents may be marked, and a
replay of a graph with such a source may mark its whole write set), a capture window that depended on it may or may not
have been opened.

Failures (contract.md sections 2, 4 and 5): a kernel whose cpu body raises marks what it would
have written, and so does a replay that fails or is refused (its whole write set); a launch
that reads a marked buffer through a ``read`` or ``read_write`` binding marks what it writes,
and so does a replay of a graph that reads a marked buffer before it writes it (an input, or
state the graph reads and writes): its whole write set. A read of a marked buffer must raise
``ReplayFailed`` until a write computed from clean data lands: a host write, or a launch or
replay none of whose inputs (``read``/``read_write`` bindings; a graph's sources) is marked.
A graph whose state is marked therefore keeps failing until the state is written from the
host; the model never accepts "any value" for it. The stream whose work failed raises its
``LaunchError`` at its next blocking call (``read``, ``sync``, ``start_capture``), together
with everything else queued there, once.
"""

from __future__ import annotations

import numpy as np

from ..errors import (CaptureRefused, GraphStateError, LaunchError, LoopLimitExceeded,
                      ReplayFailed, ServerError)
from ..kernel import DTYPES, normalize_count
from ..server import capture as cap
from . import program as P

NONE, CERTAIN, MAYBE = 0, 1, 2          # a stream's queued errors: none, some, perhaps some


class _Misdeclared(Exception):
    """A kernel's cpu body wrote a binding declared ``read`` (the message says which)."""


class _Buf:
    __slots__ = ("value", "failed", "dtype")

    def __init__(self, value, dtype):
        self.value = value               # np.ndarray, or None: unknown contents
        self.failed = False              # its last writer failed: a read must raise
        self.dtype = dtype               # numpy dtype


class _Zero(tuple):
    """A recorded launch whose workgroup count ``g.update(count=...)`` set to 0: a replay runs
    nothing for it, so what it writes keeps its state (a failure mark included: it is written
    only by a launch that may not run, ``runtime.server.capture.maybe_written``) and it hides no
    later read; its ``read`` bindings still count as the graph's sources (as the server counts
    them)."""

    __slots__ = ()

    def __new__(cls, launch):
        return tuple.__new__(cls, (launch,))

    @property
    def launch(self):
        return self[0]

    @property
    def bufs(self):
        return self[0].bufs


def _flat(items) -> list:
    """The recorded launches of ``items`` in ``g.launches()`` order (``_Zero`` s kept)."""
    return P.flat_launches(items)


def _renamed(items, old: int, new: int) -> tuple:
    """A new tuple of ``items`` with buffer ``old`` replaced by ``new`` everywhere."""
    def rb(b):
        return new if b == old else b

    def rename(item):
        if isinstance(item, _Zero):
            return _Zero(rename(item.launch))
        if isinstance(item, P.Launch):
            return item._replace(bufs=tuple(rb(b) for b in item.bufs))
        if isinstance(item, P.CaptureIf):
            return item._replace(cond=rb(item.cond), then=tuple(map(rename, item.then)),
                                 other=tuple(map(rename, item.other)))
        return item._replace(counter=rb(item.counter), init=tuple(map(rename, item.init)),
                             body=tuple(map(rename, item.body)))
    return tuple(rename(i) for i in items)


def _map_launches(items, fn, counter):
    """``items`` with each recorded launch (or ``_Zero``) ``x`` replaced by ``fn(i, x)``, ``i``
    its index in ``g.launches()`` order (``counter``: a one-element list, the next index)."""
    out = []
    for it in items:
        if isinstance(it, P.CaptureIf):
            out.append(it._replace(then=_map_launches(it.then, fn, counter),
                                   other=_map_launches(it.other, fn, counter)))
        elif isinstance(it, P.CaptureWhile):
            init = _map_launches(it.init, fn, counter)
            out.append(it._replace(init=init, body=_map_launches(it.body, fn, counter)))
        else:
            out.append(fn(counter[0], it))
            counter[0] += 1
    return tuple(out)


class _Window:
    __slots__ = ("launches", "allocs", "uses", "refused")

    def __init__(self):
        self.launches: list = []
        self.allocs: set = set()
        self.uses: set = set()
        self.refused: list = []


class Model:
    """The expected answers of one program, step by step.

    Args:
        program: the ``Program``.
        hardware_graphs: the backend makes driver graphs (cuda): a window allocation may then
            be refused by ``stop_capture`` (a cold pool), so either answer is accepted.
        rtol, atol: tolerance of value comparisons; ``None``: exact (the cpu backend runs the
            very bodies the model runs).
    """

    def __init__(self, program, hardware_graphs: bool = False, rtol=None, atol=None):
        self.p = program
        self.hardware = hardware_graphs
        self.rtol, self.atol = rtol, atol
        self.bufs: dict = {}
        self.live: set = set()
        self.pending = [NONE] * program.streams
        self.state = [cap.NO_CAPTURE] * program.streams
        self.windows: dict = {}
        self.graphs: dict = {}           # graph -> (stream, launches, write set, sources)
        self.events: set = set()

    # -- helpers ----------------------------------------------------------------------------
    def stream(self, op) -> int:
        return op.client % self.p.streams

    def skip(self, op):
        """Why ``op`` cannot be issued (it names a graph or event that was never made), or None."""
        if isinstance(op, (P.Replay, P.Release, P.Clone, P.Update, P.UpdateCount,
                           P.Instantiate)) and (
                op.graph not in self.graphs):
            return f"g{op.graph} was not made"
        if isinstance(op, P.WaitEvent) and op.event not in self.events:
            return f"e{op.event} was not recorded"
        return None

    def _same(self, got, want) -> bool:
        if got.shape != want.shape or got.dtype != want.dtype:
            return False
        if self.rtol is None:
            if want.dtype.kind != "f":
                return bool(np.array_equal(got, want))
            zero = want == 0                      # -0.0 and 0.0 differ too (1 / x, copysign)
            return bool(np.array_equal(got, want, equal_nan=True)
                        and np.array_equal(np.signbit(got[zero]), np.signbit(want[zero])))
        return bool(np.allclose(got, want, rtol=self.rtol, atol=self.atol, equal_nan=True))

    def _extent(self, launch, bi: int) -> int:
        """Bytes of binding ``bi``'s buffer ``launch`` touches (a ``write`` binding: what it
        rewrites), a prefix: ``Kernel.touched_bytes``, or the whole buffer where the kernel
        declares nothing (``runtime.server.capture.sources``' rule)."""
        spec = self.p.kernels[launch.kernel]
        k = spec.kernel
        whole = self.p.size * DTYPES[k.bindings[bi].dtype].itemsize
        try:
            got = k.touched_bytes(bi, k.pack_params(dict(launch.params)),
                                  normalize_count(spec.count))
        except (TypeError, ValueError):
            return whole
        return whole if got is None else min(got, whole)

    def _partial(self, launch, bi: int) -> bool:
        """Whether ``launch`` rewrites only part of binding ``bi``'s buffer (a ``write`` whose
        declared count, or grid, covers less: ``Kernel.partial_write``): it keeps the buffer's
        failure mark, the rest still holding what the failed writer left (contract 4)."""
        k = self.p.kernels[launch.kernel].kernel
        if k.accesses[bi] != "write" or not k.write_checks:
            return False
        return self._extent(launch, bi) < self.p.size * DTYPES[k.bindings[bi].dtype].itemsize

    def _apply(self, launch, propagate: bool = True, count=None) -> str:
        """Run one launch on the model's arrays: ``"ok"``, ``"failed"``, ``"unknown"``, or a
        sentence when the body wrote a binding declared ``read`` (the server orders launches
        by the declared access, so such a kernel races). ``propagate``: a marked buffer bound
        ``read`` or ``read_write`` marks what the launch writes (an eager launch; a replay checks
        its sources once, in ``_replay``). A ``write`` binding is not read: its earlier contents
        do not matter, unless the launch leaves part of it unwritten (then they stay unknown)."""
        spec = self.p.kernels[launch.kernel]
        binds = spec.kernel.bindings
        bufs = [self.bufs[b] for b in launch.bufs]
        outs = [b for b, bind in zip(launch.bufs, binds) if bind.access != "read"]
        ins = [buf for buf, bind in zip(bufs, binds) if bind.access != "write"]
        if propagate and any(b.failed for b in ins):
            for b in outs:               # the mark propagates; the body ran on stale data
                self.bufs[b].value, self.bufs[b].failed = None, True
            return "unknown"
        if any(b.value is None or b.failed for b in ins):
            for b in outs:
                self.bufs[b].value, self.bufs[b].failed = None, False
            return "unknown"
        blank = [bind.access == "write" and (b.value is None or b.failed)
                 for b, bind in zip(bufs, binds)]
        runs = []
        for fill in ((0, 1) if any(blank) else (None,)):
            work = [np.full(self.p.size, fill, b.dtype) if unknown else b.value.copy()
                    for b, unknown in zip(bufs, blank)]
            try:
                self._run_body(spec, launch, work, binds, readonly=None, count=count)
            except Exception:  # noqa: BLE001 - the user's kernel failing is what we model
                wrote = self._writes_read_bindings(spec, launch, bufs, blank, fill, binds,
                                                   count)
                if wrote:
                    return (f"kernel {spec.kernel.name} writes binding {', '.join(wrote)}, "
                            "declared 'read' (its view is read-only: the launch fails with "
                            "a LaunchError): declare it 'read_write' (the server orders "
                            "launches by the declared access)")
                for b in outs:
                    self.bufs[b].value, self.bufs[b].failed = None, True
                return "failed"
            runs.append(work)
        work = runs[0]
        if len(runs) == 2:               # what the launch left unwritten stays unknown
            for i, unknown in enumerate(blank):
                if unknown and not np.array_equal(runs[0][i], runs[1][i]):
                    work[i] = None
        for bi, (b, bind, w) in enumerate(zip(launch.bufs, binds, work)):
            if bind.access == "write" and self.bufs[b].failed and self._partial(launch, bi):
                self.bufs[b].value = None     # a write over part of it keeps its mark (ADV7)
            elif w is None:
                self.bufs[b].value, self.bufs[b].failed = None, False
            elif bind.access != "read":
                self.bufs[b].value, self.bufs[b].failed = w, False
            elif not np.array_equal(w, self.bufs[b].value, equal_nan=w.dtype.kind == "f"):
                return (f"kernel {spec.kernel.name} wrote binding {bind.name}, declared 'read': "
                        "declare it 'read_write' (the server orders launches by the declared "
                        "access)")
        return "ok"

    @staticmethod
    def _run_body(spec, launch, work, binds, readonly, count=None) -> None:
        """Call the kernel's cpu body on ``work`` as the cpu backend does: the arrays of the
        bindings declared ``read`` (``readonly``: a set of binding indices; None: all of
        them) are read-only views, so a body writing one raises (docs/contract.md section 2).
        ``count``: the workgroup count (an indirect launch's, read from its buffer), else the
        spec's."""
        views = []
        for i, (w, bind) in enumerate(zip(work, binds)):
            if bind.access == "read" and (readonly is None or i in readonly):
                w = w.view()
                w.flags.writeable = False
            views.append(w)
        spec.kernel.cpu(*views, count=normalize_count(spec.count) if count is None else count,
                        **dict(launch.params))

    def _writes_read_bindings(self, spec, launch, bufs, blank, fill, binds, count=None) -> list:
        """The names of the ``read`` bindings the body writes, when it raised only because
        their views are read-only (it runs on writable copies); [] when it fails anyway."""
        def attempt(readonly) -> bool:
            work = [np.full(self.p.size, fill, b.dtype) if unknown else b.value.copy()
                    for b, unknown in zip(bufs, blank)]
            try:
                self._run_body(spec, launch, work, binds, readonly, count)
            except Exception:  # noqa: BLE001 - the user's kernel failing is what we model
                return False
            return True
        reads = [i for i, bind in enumerate(binds) if bind.access == "read"]
        if not reads or not attempt(set()):
            return []
        named = [binds[i].name for i in reads if not attempt({i})]
        return named or [binds[i].name for i in reads]

    def _error(self, s: int, status: str) -> None:
        if status not in ("ok", "failed", "unknown"):
            raise _Misdeclared(status)
        if status == "failed":
            self.pending[s] = CERTAIN
        elif status == "unknown" and self.pending[s] == NONE:
            self.pending[s] = MAYBE

    @staticmethod
    def _expect_raise(error, kind, what):
        if error is None:
            return f"{what} returned, but it must raise {kind.__name__}"
        if not isinstance(error, kind):
            return f"{what} raised {type(error).__name__}: {error}; expected {kind.__name__}"
        return None

    @staticmethod
    def _expect_ok(error, what):
        if error is not None:
            return f"{what} raised {type(error).__name__}: {error}; the model says it succeeds"
        return None

    def _drain(self, s: int, error, what: str):
        """A blocking call on stream ``s`` raises its queued errors (and clears them): the
        ``LaunchError`` of a kernel that failed on ``s`` is raised there, once."""
        p, self.pending[s] = self.pending[s], NONE
        if p == CERTAIN:
            return True, self._expect_raise(error, LaunchError, what + " (a launch on its stream "
                                            "failed)")
        if p == MAYBE and isinstance(error, ServerError):
            return True, None
        return False, None

    # -- one op -----------------------------------------------------------------------------
    def step(self, op, value, error):
        """Check the runtime's answer to ``op`` (``value`` returned, or ``error`` raised) and
        advance the model. Returns a mismatch sentence or None."""
        try:
            return getattr(self, "_" + type(op).__name__.lower())(op, value, error)
        except _Misdeclared as e:
            return str(e)

    def _refused(self, op, error):
        """Calls refused at once on a capturing stream (docs/contract.md section 4); each
        invalidates the window: its ``stop_capture`` raises ``CaptureRefused`` and makes no graph."""
        what = P.Program.line(self.p, op)
        self.windows[self.stream(op)].refused.append(f"{what} (refused at once)")
        return self._expect_raise(error, CaptureRefused, what)

    def _create(self, op, value, error):
        s = self.stream(op)
        self.live.add(op.buf)
        w = self.windows.get(s)
        self.bufs[op.buf] = _Buf(None if w else np.array(op.values, DTYPES[op.dtype]),
                                 DTYPES[op.dtype])
        if w:                           # (not applied: it holds no data, marked, ADV9)
            w.allocs.add(op.buf)
            w.refused.append(f"create of b{op.buf} inside the window (a host write)")
            self.bufs[op.buf].failed = True
        return self._expect_ok(error, "create")

    def _empty(self, op, value, error):
        self.live.add(op.buf)
        self.bufs[op.buf] = _Buf(None, DTYPES[op.dtype])
        w = self.windows.get(self.stream(op))
        if w:
            w.allocs.add(op.buf)
        return self._expect_ok(error, "empty")

    def _write(self, op, value, error):
        w = self.windows.get(self.stream(op))
        if w:                           # not applied (a buffer made in the window: marked)
            w.refused.append(f"write to b{op.buf} inside the window")
            if op.buf in w.allocs:
                self.bufs[op.buf].failed = True
        else:
            b = self.bufs[op.buf]
            b.value, b.failed = np.array(op.values, DTYPES[op.dtype]), False
        return self._expect_ok(error, "write")

    def _launch(self, op, value, error):
        s = self.stream(op)
        w = self.windows.get(s)
        if w:
            w.launches.append(op)
            w.uses.update(op.bufs)
        else:
            self._error(s, self._apply(op))
        return self._expect_ok(error, "launch")

    def _launchindirect(self, op, value, error):
        """An indirect launch (eager): its counts are an input (ADV8: a failure of the count
        buffer's writer reaches what it writes); a count of 0 runs nothing; what it writes
        keeps a failure mark whatever the count (it may write nothing: contract section 4b)."""
        s = self.stream(op)
        binds = self.p.kernels[op.kernel].kernel.bindings
        outs = [b for b, bind in zip(op.bufs, binds) if bind.access != "read"]
        ins = [self.bufs[b] for b, bind in zip(op.bufs, binds) if bind.access != "write"]
        cb = self.bufs[op.counts]
        ins.append(cb)
        count = None if cb.value is None or cb.failed else tuple(int(v) for v in cb.value[:3])
        if any(b.failed for b in ins):   # stale counts or inputs, whatever the count: marked
            for b in outs:
                self.bufs[b].value, self.bufs[b].failed = None, True
            if count is None or 0 not in count:
                self._error(s, "unknown")
            return self._expect_ok(error, "launch")
        if count is None or (0 in count and any(b.value is None for b in ins)):
            for b in outs:               # unknown counts or inputs (perhaps marked): unknown
                self.bufs[b].value = None     # (a failed one stays failed: its mark is kept)
            if count is None:
                self._error(s, "unknown")
            return self._expect_ok(error, "launch")
        if 0 in count:
            return self._expect_ok(error, "launch")     # runs nothing: all as it was
        kept = [b for b in outs if self.bufs[b].failed]
        self._error(s, self._apply(op, count=count))
        for b in kept:                   # (an indirect launch keeps their marks)
            self.bufs[b].value, self.bufs[b].failed = None, True
        return self._expect_ok(error, "launch")

    def _read(self, op, value, error):
        s = self.stream(op)
        what = f"read of b{op.buf} on c{op.client}"
        if s in self.windows:
            return self._refused(op, error)
        drained, bad = self._drain(s, error, what)
        if bad is not None:
            return bad
        b = self.bufs[op.buf]
        if b.failed:
            return self._expect_raise(error, ReplayFailed, what + " (its last writer failed)")
        if drained or b.value is None:
            return None                  # unknown contents: any answer
        if error is not None:
            return self._expect_ok(error, what)
        if not self._same(value, b.value):
            return f"{what} returned {value.tolist()}, the sequential model says {b.value.tolist()}"
        return None

    def _free(self, op, value, error):
        self.live.discard(op.buf)
        for w in self.windows.values():
            if op.buf in w.uses and op.buf not in w.allocs:
                w.refused.append(f"free of b{op.buf}, which the window uses")
        return self._expect_ok(error, "release")

    def _sync(self, op, value, error):
        s = self.stream(op)
        if s in self.windows:
            return self._refused(op, error)
        drained, bad = self._drain(s, error, f"sync of c{op.client}")
        return bad if drained else self._expect_ok(error, f"sync of c{op.client}")

    def _recordevent(self, op, value, error):
        if self.stream(op) in self.windows:
            return self._refused(op, error)
        self.events.add(op.event)
        return self._expect_ok(error, "record_event")

    def _waitevent(self, op, value, error):
        if self.stream(op) in self.windows:
            return self._refused(op, error)
        return self._expect_ok(error, "wait_event")

    def _transition(self, op, step: str, error, what: str):
        """The capture state machine (``runtime.server.capture``): ``(stream, None)`` when
        ``step`` is in order, else ``(None, the check of the GraphStateError)``."""
        s = self.stream(op)
        try:
            self.state[s] = cap.transition(self.state[s], step, s)
        except GraphStateError:
            return None, self._expect_raise(error, GraphStateError, what)
        return s, None

    def _prepare(self, op, value, error):
        s, bad = self._transition(op, "prepare", error, "graph_prepare")
        return bad if s is None else self._expect_ok(error, "graph_prepare")

    _preparepool = _prepare              # (the pool changes where window buffers come from)

    def _startcapture(self, op, value, error):
        s, bad = self._transition(op, "begin", error, "start_capture")
        if s is None:
            return bad
        drained, bad = self._drain(s, error, "start_capture after a failed warm-up")
        if drained:
            self.state[s] = cap.NO_CAPTURE
            return bad
        self.windows[s] = _Window()
        return self._expect_ok(error, "start_capture")

    def _stopcapture(self, op, value, error):
        s, bad = self._transition(op, "end", error, "stop_capture")
        if s is None:
            return bad
        w = self.windows.pop(s)
        if w.refused:
            return self._expect_raise(error, CaptureRefused, "stop_capture of a window with "
                                      + "; ".join(w.refused))
        if self.hardware and w.allocs and isinstance(error, CaptureRefused):
            return None                  # a cold pool: the driver graph refuses the allocation
        self.graphs[op.graph] = (s,) + self._sets(tuple(w.launches))
        return self._expect_ok(error, "stop_capture")

    def _sets(self, items) -> tuple:
        """``(items, write set, sources)`` of a recording: sources are read before the graph
        writes them (``runtime.server.capture.sources``); a condition reads; a write inside a
        conditional node may not run, so it does not hide a later read."""
        writes, sources = set(), set()
        whole = self.p.size * 4                   # (every dtype of the kit is 4 bytes)

        def walk(items, written):
            # ``written``: ``{buffer: bytes}`` surely written (a prefix) before here in this
            # scope or an enclosing one (a write inside a branch or loop body hides the reads
            # after it in that body, not those after the node; a write hides a read only where
            # it covers what the read touches: runtime.server.capture.sources)
            for it in items:
                if isinstance(it, P.CaptureIf):
                    if written.get(it.cond, 0) < whole:
                        sources.add(it.cond)
                    a, b = dict(written), dict(written)
                    walk(it.then, a)
                    walk(it.other, b)
                    if it.other:          # written by both branches: whichever runs (ADV8)
                        for buf in a.keys() & b.keys():
                            written[buf] = max(written.get(buf, 0), min(a[buf], b[buf]))
                elif isinstance(it, P.CaptureWhile):
                    walk(it.init, written)
                    if written.get(it.counter, 0) < whole:
                        sources.add(it.counter)
                    walk(it.body, dict(written))
                else:
                    zero = isinstance(it, _Zero)
                    launch = it.launch if zero else it
                    spec = self.p.kernels[launch.kernel]
                    binds = list(zip(it.bufs, spec.kernel.bindings))
                    sources.update(b for bi, (b, bind) in enumerate(binds)
                                   if bind.access != "write"
                                   and written.get(b, 0) < self._extent(launch, bi))
                    writes.update(b for b, bind in binds if bind.access != "read")
                    if not zero:                  # a count of 0 may write nothing
                        for bi, (b, bind) in enumerate(binds):
                            if bind.access == "write":
                                written[b] = max(written.get(b, 0), self._extent(launch, bi))
        walk(items, {})
        return items, writes, sources

    def _replay(self, op, value, error):
        s, launches, writes, sources = self.graphs[op.graph]
        if s in self.windows:
            for b in writes:               # a refused replay marks its write set
                self.bufs[b].failed = True
            return self._refused(op, error)
        if any(self.bufs[b].failed for b in sources):
            for b in writes:               # a marked input or state marks the whole write set
                self.bufs[b].value, self.bufs[b].failed = None, True
            self._error(s, "unknown")      # its launches ran on stale data: they may fail
            return self._expect_ok(error, f"replay of g{op.graph}")
        if any(self.bufs[b].value is None for b in sources):
            # a source of unknown contents may be marked (a kernel run on unknown inputs may
            # have failed); the server counts it even where no launch reads it (a count of 0,
            # a branch not taken), so the whole write set may be marked: any answer
            for b in writes:
                self.bufs[b].value, self.bufs[b].failed = None, False
            self._error(s, "unknown")
            return self._expect_ok(error, f"replay of g{op.graph}")
        # the server cannot see which branch ran: a buffer written only inside a node keeps
        # a failure (and one whose state is unknown, which may have failed, stays unknown)
        kept = [(b, self.bufs[b].failed) for b in self._cond_only(launches)
                if self.bufs[b].failed or self.bufs[b].value is None]
        status = self._run_items(launches)
        if status != "ok":
            for b in writes:
                self.bufs[b].value = None
                self.bufs[b].failed = status == "failed"
        for b, failed in kept:
            self.bufs[b].value, self.bufs[b].failed = None, failed
        self._error(s, status)
        return self._expect_ok(error, f"replay of g{op.graph}")

    def _cond_only(self, items) -> set:
        """Buffers a recording writes only inside conditional nodes, or only in part
        (``runtime.server.capture.maybe_written``): a replay may leave them unwritten, so a
        failure on them outlives a replay that succeeds (docs/contract.md section 4b)."""
        written = set()

        def walk(items) -> set:
            sure = set()                    # wholly written whenever ``items`` run
            for it in items:
                if isinstance(it, P.CaptureIf):
                    a, b = walk(it.then), walk(it.other)
                    if it.other:            # both branches write it: whichever runs (ADV8)
                        sure |= a & b
                elif isinstance(it, P.CaptureWhile):
                    sure |= walk(it.init)
                    walk(it.body)           # (it may run zero times)
                else:
                    zero = isinstance(it, _Zero)
                    launch = it.launch if zero else it
                    spec = self.p.kernels[launch.kernel]
                    for bi, (b, bind) in enumerate(zip(it.bufs, spec.kernel.bindings)):
                        if bind.access != "read":   # (a write over part of it may leave a
                            written.add(b)          # failure's rest: maybe_written)
                            if not zero and not self._partial(launch, bi):
                                sure.add(b)
            return sure
        return written - walk(items)

    def _thread(self, op, value, error):
        """A thread's writes and launches on its own stream (never capturing), in order; its
        stream's errors (none: the builder gives it non-failing launches) go with it."""
        for sub in op.ops:
            if isinstance(sub, P.Write):
                b = self.bufs[sub.buf]
                b.value, b.failed = np.array(sub.values, DTYPES[sub.dtype]), False
            else:
                status = self._apply(sub)
                if status not in ("ok", "failed", "unknown"):
                    raise _Misdeclared(status)
        return self._expect_ok(error, f"thread {op.thread}")

    def _release(self, op, value, error):
        del self.graphs[op.graph]
        return self._expect_ok(error, f"release of g{op.graph}")

    def _clone(self, op, value, error):
        self.graphs[op.clone] = self.graphs[op.graph]
        return self._expect_ok(error, f"clone of g{op.graph}")

    # -- graphs that change (issue 27) --------------------------------------------------------
    def _run_items(self, items) -> str:
        """A replay's launches in order, conditional nodes evaluated on the model's values:
        ``"ok"``, or the first other status (the rest does not run)."""
        for item in items:
            if isinstance(item, P.CaptureIf):
                cond = self.bufs[item.cond].value
                if cond is None:
                    return "unknown"
                status = self._run_items(item.then if cond[0] != 0 else item.other)
            elif isinstance(item, P.CaptureWhile):
                status = self._run_items(item.init)
                done = 0
                while status == "ok":
                    cnt = self.bufs[item.counter].value
                    if cnt is None or done > item.max_iterations:
                        return "unknown"
                    if cnt[0] == 0:
                        break
                    status = self._run_items(item.body)
                    done += 1
            elif isinstance(item, _Zero):
                status = "ok"                     # a count of 0: runs nothing
            else:
                status = self._apply(item, propagate=False)
            if status != "ok":
                return status
        return "ok"

    def _unknown(self, s: int, launches) -> None:
        """``launches`` may or may not have run: what they write is unknown."""
        for launch in launches:
            spec = self.p.kernels[launch.kernel]
            for b, bind in zip(launch.bufs, spec.kernel.bindings):
                if bind.access != "read":
                    self.bufs[b].value, self.bufs[b].failed = None, False
        if launches:
            self._error(s, "unknown")

    def _createflag(self, op, value, error):
        self.live.add(op.buf)
        self.bufs[op.buf] = _Buf(np.array([op.value], np.int32), np.dtype(np.int32))
        return self._expect_ok(error, "create")

    def _cond_read(self, s: int, buf: int, error, what: str):
        """The host read of a condition by an eager ``capture_if``/``capture_while``:
        ``(value or None, done, mismatch)``; ``done``: the call raised here (or may have: an
        unknown condition), so nothing after it is checked."""
        drained, bad = self._drain(s, error, what)
        if bad is not None:
            return None, True, bad
        if drained and error is not None:
            return None, True, None
        b = self.bufs[buf]
        if b.failed:
            return None, True, self._expect_raise(error, ReplayFailed, what + " (its condition's "
                                                  "last writer failed)")
        if b.value is None:
            return None, True, None
        return int(b.value[0]), False, None

    def _record_node(self, op, s) -> None:
        w = self.windows[s]
        w.launches.append(op)
        for launch in op.launches():
            w.uses.update(launch.bufs)
        w.uses.add(op.cond if isinstance(op, P.CaptureIf) else op.counter)

    def _captureif(self, op, value, error):
        s = self.stream(op)
        what = f"capture_if on c{op.client}"
        if s in self.windows:
            self._record_node(op, s)
            return self._expect_ok(error, what)
        cond, done, bad = self._cond_read(s, op.cond, error, what)
        if done:
            if bad is None and cond is None and error is None:
                self._unknown(s, op.launches())
            return bad
        for launch in (op.then if cond != 0 else op.other):
            self._error(s, self._apply(launch))
        return self._expect_ok(error, what)

    def _capturewhile(self, op, value, error):
        s = self.stream(op)
        what = f"capture_while on c{op.client}"
        if s in self.windows:
            self._record_node(op, s)
            return self._expect_ok(error, what)
        self._error(s, self._apply(op.init[0]))
        for k in range(op.max_iterations + 1):
            certain = self.pending[s] == CERTAIN
            cnt, done, bad = self._cond_read(s, op.counter, error, what)
            if done:
                if bad is None and not (certain and error is not None):
                    # unknown condition, or an error that may have been raised by a later
                    # read: later iterations may have run
                    self._unknown(s, op.launches())
                elif bad is None and k:     # stopped early by that error: marked (ADV9)
                    self._stopped(op)
                return bad
            if cnt == 0:
                break
            if k == op.max_iterations:
                if k:                   # what the stopped loop wrote is marked (server rule)
                    self._stopped(op)
                return self._expect_raise(error, LoopLimitExceeded, what)
            for launch in op.body:
                self._error(s, self._apply(launch))
        return self._expect_ok(error, what)

    def _stopped(self, op) -> None:
        """An eager loop stopped before its condition said so (its limit, or an error after an
        iteration ran): what its body writes is marked (``ReplayFailed`` until rewritten)."""
        for launch in op.body:
            spec = self.p.kernels[launch.kernel]
            for b, bind in zip(launch.bufs, spec.kernel.bindings):
                if bind.access != "read":
                    self.bufs[b].value, self.bufs[b].failed = None, True

    def _update(self, op, value, error):
        s, items, writes, sources = self.graphs[op.graph]
        what = f"update of g{op.graph}"
        if s in self.windows:
            return self._expect_raise(error, CaptureRefused, what + " (its stream is capturing)")
        used = {b for la in P.flat_launches(items) for b in la.bufs} | sources
        if op.old not in used:
            return self._expect_raise(error, ValueError, what + f" (b{op.old} is not used)")

        new = (s,) + self._sets(_renamed(items, op.old, op.new))
        for g, info in list(self.graphs.items()):   # clones share the backend graph
            if info[1] is items:
                self.graphs[g] = new
        return self._expect_ok(error, what)

    def _instantiate(self, op, value, error):
        """A new graph of the recording (rebound when ``old != rebound``) on the target's
        stream; it shares the other buffers, so their marks and values (state included), and
        later updates of either graph leave the other alone."""
        s, items, writes, sources = self.graphs[op.graph]
        t = op.target % self.p.streams
        what = f"instantiate of g{op.graph}"
        if t in self.windows:
            return self._expect_raise(error, CaptureRefused, what + " (its stream is capturing)")
        self.graphs[op.new] = (t,) + self._sets(_renamed(items, op.old, op.rebound))
        return self._expect_ok(error, what)

    def _updatecount(self, op, value, error):
        s, items, writes, sources = self.graphs[op.graph]
        what = f"update of g{op.graph} (count of launch {op.index})"
        if s in self.windows:
            return self._expect_raise(error, CaptureRefused, what + " (its stream is capturing)")
        if op.index >= len(_flat(items)):
            return self._expect_raise(error, ValueError, what + " (no such launch)")
        zero = 0 in (op.x, op.y, op.z)

        def swap(i, it):
            if i != op.index:
                return it
            launch = it.launch if isinstance(it, _Zero) else it
            return _Zero(launch) if zero else launch
        new = (s,) + self._sets(_map_launches(items, swap, [0]))
        for g, info in list(self.graphs.items()):   # clones share the backend graph
            if info[1] is items:
                self.graphs[g] = new
        return self._expect_ok(error, what)
