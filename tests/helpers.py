"""Helpers shared by test modules: the CubeCL scenario kernels and the standard prelude
(cubecl-scenarios.md: ``add_one``, ``mul_two``, input [1,2,3,4] -> output), the import of a
backend module that skips its test module when the backend's library is missing, and the
service loop's failing producer and its consumer (``FAIL_FILL``, ``produce_then_consume``)."""

import importlib
import pkgutil
import time

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import CaptureRefused, LaunchError, ReplayFailed, UnsupportedError
from runtime.kernel import Binding, Kernel
from runtime.server import backend_class


def backend_module_or_skip(name: str, hint: str):
    """The module of backend ``name`` (e.g. ``runtime.backends.cuda``), or skip the calling test
    module with the reason and ``hint`` when its library is missing or broken.

    ``pytest.importorskip`` is not used: a backend module raises ``ImportError`` (not
    ``ModuleNotFoundError``) for a missing library, which pytest >= 9.1 reports as a collection
    error, and wgpu's raises ``UnsupportedError``; ``backend_class`` turns both into
    ``UnsupportedError``.
    """
    try:
        return importlib.import_module(backend_class(name).__module__)
    except UnsupportedError as e:
        pytest.skip(f"{e} ({hint})", allow_module_level=True)


def add_one(c, x, y, n=4):
    """``y[i] = x[i] + 1`` over ``n`` floats."""
    c.launch(K.add_scalar, K.grid(n), [x, y], {"alpha": 1.0, "n": n})


def mul_two(c, x, y, n=4):
    """``y[i] = x[i] * 2`` over ``n`` floats."""
    c.launch(K.mul_scalar, K.grid(n), [x, y], {"alpha": 2.0, "n": n})


def prelude(c):
    """Standard prelude: input [1,2,3,4], output empty(16 bytes), graph_prepare, warm-up, read."""
    inp = c.create(np.array([1, 2, 3, 4], np.float32))
    out = c.empty(4, np.float32)
    c.graph_prepare()
    add_one(c, inp, out)
    np.testing.assert_array_equal(c.read(out), [2, 3, 4, 5])
    return inp, out


def captured_add_one(c):
    """``y = x + 1`` over 4 floats, warmed up and captured on ``c``'s stream: ``(x, y, graph)``."""
    x = c.create(np.ones(4, np.float32))
    y = c.empty(4, np.float32)
    c.graph_prepare()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    c.start_capture()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    return x, y, c.stop_capture()


def captured(c, run):
    """``run()`` (launches on ``c``'s stream) run, run again after ``graph_prepare`` (the
    warm-up), then captured: the ``Graph``."""
    run()
    c.sync()
    c.graph_prepare()
    run()
    c.sync()
    c.start_capture()
    run()
    return c.stop_capture()


def captured_once(c, kernel, bufs, params: dict, n: int):
    """One launch of ``kernel`` over ``bufs`` (``params`` plus ``n``), :func:`captured`."""
    return captured(c, lambda: c.launch(kernel, K.grid(n), bufs, {**params, "n": n}))


#: modules of ``runtime.kernels`` whose kernels are cpu-only by design (their docstring says
#: so: no WGSL or CUDA source; the cpu panel matmul of issue 30)
CPU_ONLY_MODULES = ("runtime.kernels.panels",)


def library_kernels() -> dict:
    """Every Kernel of ``runtime.kernels``, by qualified name: each module's Kernel attributes and
    the Kernels in its dict attributes (the matmul tile variants), plus the attention kernels for
    head dims 24 and 64 (``attention_for`` builds them on demand; 32 is ``attention``). Not the
    kernels of :data:`CPU_ONLY_MODULES` (checked to have no GPU source at all)."""
    found = {}
    for info in pkgutil.walk_packages(K.__path__, K.__name__ + "."):
        if info.name in CPU_ONLY_MODULES:
            module = importlib.import_module(info.name)
            assert not [a for a, v in vars(module).items()
                        if isinstance(v, Kernel) and (v.wgsl or v.cuda)], info.name
            continue
        module = importlib.import_module(info.name)
        for attr, value in vars(module).items():
            values = value.items() if isinstance(value, dict) else [(None, value)]
            for key, v in values:
                if isinstance(v, Kernel):
                    name = f"{info.name}.{attr}" + ("" if key is None else f"[{key!r}]")
                    found.setdefault(id(v), (name, v))
    for hd in (24, 64):
        k = K.nn.attention_for(hd)
        found.setdefault(id(k), (f"runtime.kernels.nn.attention_for({hd})", k))
    return dict(found.values())


_PAST_END_WGSL = """
@group(0) @binding(0) var<storage, read_write> y: array<f32, 64>;
@compute @workgroup_size(1)
fn main() { y[63] = 5.0; }
"""


def _past_end_cpu(y, *, count):
    y[63] = 5.0


#: A kernel that fails once it runs, on cpu and wgpu: it writes element 63 of its binding.
#: WGSL declares ``array<f32, 64>``, so wgpu refuses a 16-byte binding when the batch is
#: finished; the numpy body raises ``IndexError`` on a 4-element view. (cuda: an
#: out-of-bounds store is undefined behaviour there, not an error.)
PAST_END = Kernel("past_end", [("y", "f32", "read_write")], workgroup_size=(1, 1, 1),
                  wgsl=_PAST_END_WGSL, cpu=_past_end_cpu)


#: the longest any bounded wait in the tests polls (seconds).
LIMIT_S = 20.0


def until(pred, what: str, limit_s: float = LIMIT_S) -> None:
    """Poll ``pred`` (a cheap check or one server round trip) until True, at most ``limit_s``;
    ``AssertionError`` naming ``what`` after that."""
    deadline = time.monotonic() + limit_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s} s waiting for {what}")
        time.sleep(0.001)


def after_calls(fn) -> list:
    """Offsets of ``fn``'s (a function or code object) instructions right after a call returned: where CPython runs a
    pending signal handler, so where an asynchronous exception (a signal handler's
    TimeoutError, KeyboardInterrupt, ``PyThreadState_SetAsyncExc``) lands."""
    import dis
    ins = list(dis.get_instructions(getattr(fn, "__code__", fn)))
    return [x.offset for i, x in enumerate(ins) if i and ins[i - 1].opname.startswith("CALL")]


def interrupting_tracer(code, offsets, exc, hit: list, nth: int = 1, when=None):
    """A ``sys.settrace`` function raising ``exc("interrupted (injected by the test)")`` in
    ``code`` at an instruction of ``offsets`` (an offset or a collection), the ``nth`` time
    execution gets to one of them (while ``when()`` is true, if given), once: ``hit`` gets the
    offset. Instruction-level, as a signal lands: a line-level trace would also raise at
    ``try:`` lines, which no handler covers (an artefact)."""
    where = {offsets} if isinstance(offsets, int) else set(offsets)
    seen = []

    def local(frame, event, arg):
        frame.f_trace_opcodes = True
        if (event == "opcode" and not hit and frame.f_lasti in where
                and (when is None or when())):
            seen.append(1)
            if len(seen) < nth:
                return local
            hit.append(frame.f_lasti)
            raise exc("interrupted (injected by the test)")
        return local

    def tracer(frame, event, arg):
        if frame.f_code is code:
            frame.f_trace_opcodes = True
            return local
        return None
    return tracer


def profile_interrupt_at(k: int, fired: list):
    """A ``sys.setprofile`` function raising KeyboardInterrupt at the ``k``-th delivery point
    (a Python function's entry, a C function's return), once; ``fired`` gets the event."""
    import sys

    count = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_return") and not fired:
            count[0] += 1
            if count[0] == k:
                fired.append(event)
                sys.setprofile(None)
                raise KeyboardInterrupt
    return profile


def _fail_if(flag, y, *, count):
    if flag[0] != 0:
        raise ValueError("flag set")
    y[:] = 7


#: ``y = 7``, raising while ``flag[0] != 0`` (a producer that fails at execution; a cpu
#: kernel without a ``bind``: a worker runs it)
FAIL_FILL = Kernel("fail_fill", [Binding("flag", "f32", "read"), Binding("y", "f32", "write")],
                   cpu=_fail_if)


def produce_then_consume(client, ok, bad, i: int, n: int = 16):
    """One request of the service loop's shape (test_bounded_tables.py; RACE7's race): on two
    fresh streams a producer on a (``FAIL_FILL``, failing when ``i % 3 == 0``: ``bad``'s flag,
    else ``ok``'s), an event, a tiny consumer on b (``z = y + i % 5``, deferred), a read of
    ``z`` on b, a sync of a. Returns ``(wrong, keep)``: ``wrong`` is None when every call did
    what the contract says (a failed request's read raises ``ReplayFailed`` and its sync
    ``LaunchError``, another's read returns ``7 + i % 5``), else ``(i, what happened)``;
    ``keep`` = ``(a, y, z)``, the request's client of stream a and its buffers."""
    a = client.with_stream(runtime.StreamId.new())
    b = client.with_stream(runtime.StreamId.new())
    y, z = a.empty(n, np.float32), b.empty(n, np.float32)
    failing = i % 3 == 0
    a.launch(FAIL_FILL, 1, [bad if failing else ok, y])
    b.wait_event(a.record_event())
    b.launch(K.add_scalar, 1, [y, z], {"alpha": float(i % 5), "n": n})
    wrong = None
    try:
        v = b.read(z)
        if failing or v[0] != 7 + i % 5:
            wrong = (i, f"read returned {v[:2]}")
    except ReplayFailed:
        if not failing:
            wrong = (i, "read raised")
    try:
        a.sync()
        if failing:
            wrong = wrong or (i, "sync returned")
    except LaunchError:
        if not failing:
            wrong = wrong or (i, "sync raised")
    return wrong, (a, y, z)


def fail_write_set(c, g):
    """Mark graph ``g``'s write set failed the same way on every backend: a replay refused
    inside a capture window of its stream (``c``: a client on that stream; docs/contract.md
    section 4: a failure found at enqueue marks the write set too)."""
    c.graph_prepare()
    c.start_capture()
    with pytest.raises(CaptureRefused):
        g.replay()
    c.abort_capture()
