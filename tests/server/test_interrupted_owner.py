"""A thread interrupted while it holds the server's owner lock never hangs the server.

An asynchronous exception (KeyboardInterrupt or an exception a signal handler raises, on the
main thread; ``PyThreadState_SetAsyncExc`` on any thread) can land between a caller taking the
owner lock on the combining fast path (queue.py) and the ``try`` that releases it, or right
after the drain loop took a message off the queue. Before, the first left the lock held for
ever (the device thread blocked in ``acquire``, every later caller waited for ever: the server
was alive and healthy), and the second lost the message (its caller waited for ever; a lost
launch would have vanished without an error). Now the server stops and every waiter gets
``ServerClosed``: loud, never a hang (ADV3).

The interruption is placed deterministically with a trace function that raises right after
the ``acquire`` (or ``popleft``) call returned, where CPython runs a pending signal handler.
"""

import dis
import inspect
import sys
import threading

import numpy as np
import pytest

import runtime
from helpers import after_calls, interrupting_tracer
from runtime import kernels as K
from runtime.errors import ServerClosed, ServerError
from runtime.server import queue as queue_mod
from runtime.backends import cpu as cpu_mod
from runtime.backends.cpu import CpuBackend
from runtime.backends.cpu_schedule import ThreadScheduler
from runtime.server.server import ComputeServer

#: seconds a bounded wait in these tests lasts at most
LIMIT_S = 15.0


def _line_of(fn, text: str) -> int:
    """The first line of ``fn``'s source containing ``text`` (a test that no longer finds the
    place it interrupts fails instead of passing vacuously)."""
    lines, first = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if text in line:
            return first + i
    raise AssertionError(f"{fn.__qualname__} no longer contains {text!r}")


def _interrupt_after(fn, text: str, exc, queue, hit: list, nth: int = 1):
    """A trace function raising ``exc`` in ``fn`` right after the last call on its line with
    ``text`` returned (where CPython runs a pending signal handler: after a call), the
    ``nth`` time it gets there, once,
    provided the owner lock of ``queue`` is held then (``queue`` None: always). Instruction-level, as a signal lands: a line-level
    trace would also raise at ``try:`` lines, which no handler covers (an artefact)."""
    code, line = fn.__code__, _line_of(fn, text)
    ins = list(dis.get_instructions(code))
    calls = [i for i, x in enumerate(ins) if x.positions.lineno == line
             and x.opname.startswith("CALL")]
    assert calls, f"no call on line {line} of {fn.__qualname__}"
    target = ins[calls[-1] + 1].offset
    return interrupting_tracer(code, target, exc, hit, nth,
                               when=None if queue is None else queue._owner.locked)


def _bounded(fn):
    """Run ``fn`` on another thread; its value or exception, or AssertionError if it hangs."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(LIMIT_S)
    assert not t.is_alive(), "the call hung: the owner lock or its message was lost"
    return out


def _check_answers(c, c2, x, z):
    """Every later call answers: the right value or ServerClosed, never a hang."""
    for client, h, want in ((c2, z, 7.0), (c, x, 1.0)):
        out = _bounded(lambda: client.read(h))
        if "error" in out:
            assert isinstance(out["error"], ServerClosed), out["error"]
            assert "interrupted" in str(out["error"]) or "died" in str(out["error"])
        else:
            np.testing.assert_array_equal(out["value"], np.full(4, want, np.float32))


@pytest.fixture
def private(monkeypatch):
    """A server of its own (this test may stop it) with a second client on its own stream."""
    monkeypatch.setattr(queue_mod, "OWNER_CHECK_S", 0.2, raising=False)
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 3)
    c2 = c.with_stream(runtime.StreamId.new())
    x = c.create(np.ones(4, np.float32))
    z = c2.create(np.full(4, 7, np.float32))
    c.sync()
    c2.sync()
    yield c, c2, x, z
    _bounded(c.shutdown)


def _captured_replay(c, x, y):
    """Capture ``y = x + 1`` (one tiny launch) and replay it: ``ComputeServer.replay``."""
    c.graph_prepare()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    c.start_capture()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    g = c.stop_capture()
    c.sync()
    g.replay()


SITES = {
    # fn, the line that takes the lock, what the main thread runs, the exception
    "submit": (queue_mod.DeviceQueue.submit, "elif not q and self._owner.acquire(False)",
               lambda c, x, y: c.empty(4, np.float32), KeyboardInterrupt),
    "launch": (ComputeServer.launch, "tok.pop()",
               lambda c, x, y: c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4}),
               KeyboardInterrupt),
    "call": (queue_mod.DeviceQueue.call, "owner = tok.pop()",
             lambda c, x, y: c.flush(), TimeoutError),
    "sync_idle": (ComputeServer.sync_idle, "tok.pop()",
                  lambda c, x, y: c.sync(), KeyboardInterrupt),
    "replay": (ComputeServer.replay, "tok.pop()",
               _captured_replay, KeyboardInterrupt),
    "read": (ComputeServer.read, "tok.pop()",
             lambda c, x, y: c.read(x), KeyboardInterrupt),
}


@pytest.mark.parametrize("site", sorted(SITES))
def test_an_interrupt_after_the_owner_lock_was_taken_never_hangs_the_server(private, site):
    c, c2, x, z = private
    y = c.empty(4, np.float32)
    c.sync()
    fn, text, op, exc = SITES[site]
    q = c._server.queue
    hit = []
    for _ in range(100):                # (until the call finds the server idle: fast path)
        sys.settrace(_interrupt_after(fn, text, exc, q, hit))
        try:
            op(c, x, y)
        except exc:
            pass
        finally:
            sys.settrace(None)
        if hit:
            break
        c.sync()
    assert hit, f"the interruption after {text!r} never ran"
    _check_answers(c, c2, x, z)


def test_an_interrupt_right_after_the_drain_took_a_message_never_strands_its_caller(private):
    """The main thread drains (it holds the owner lock) and takes another thread's read off the
    queue; the interruption lands before the read runs. Before, that read waited for ever."""
    c, c2, x, z = private
    q = c._server.queue
    hit = []
    q._owner.acquire()              # as a caller on the combining path: messages queue up
    try:
        reader = {}

        def read():
            try:
                reader["value"] = c2.read(z)
            except BaseException as e:  # noqa: BLE001
                reader["error"] = e
        t = threading.Thread(target=read, daemon=True)
        t.start()
        for _ in range(int(LIMIT_S * 1000)):
            if q._q:
                break
            t.join(0.001)
        assert q._q, "the reader's message was never queued"
        sys.settrace(_interrupt_after(queue_mod.DeviceQueue._drain, "q.popleft()",
                                      TimeoutError, q, hit))
        try:
            q._drain()                  # releases the lock
        except TimeoutError:
            pass
        finally:
            sys.settrace(None)
    finally:
        if q._owner.locked() and not hit:
            q._owner.release()
    assert hit, "the interruption after popleft never ran"
    t.join(LIMIT_S)
    assert not t.is_alive(), "the reader whose message was taken waits for ever"
    assert isinstance(reader.get("error"), ServerClosed), reader
    _check_answers(c, c2, x, z)


def test_a_long_message_is_not_taken_for_a_lost_owner(private):
    """The check for a lost owner lock looks at what the threads run: a message that holds the
    lock for several checks (a slow handler) is waited for, not taken for a lost lock."""
    c, c2, x, z = private
    q = c._server.queue
    import time
    out = _bounded(lambda: q.call(time.sleep, 1.0))   # 5 checks of 0.2 s on the way
    assert out == {"value": None}
    np.testing.assert_array_equal(c2.read(z), np.full(4, 7, np.float32))
    assert not q.closed


#: where a caller's thread runs a stream's queued work itself: a waiting read's helper (outside
#: the owner lock) and a read's flush of tiny items (inside it)
RUNNERS = {
    # fn, the call after which the interruption lands, its exception, buffer size, which time
    "help": (ThreadScheduler.help, "q.popleft()", KeyboardInterrupt, 1 << 15, 2),
    "flush": (CpuBackend.flush, "q.popleft()", TimeoutError, 64, 2),
    # the helper claimed the stream (busy) and had not entered its try: the stream stayed busy
    # for ever, so no worker or helper ran it again (every later read hung)
    "help-claim": (ThreadScheduler.help, "threading.get_ident()", KeyboardInterrupt, 1 << 15, 1),
    # inside the launch item, before its own try: the launch never ran and its outputs were
    # left unmarked (the stream's error went to the next sync, then a read was stale)
    "launch-item": (cpu_mod._run_launch, "if not isinstance(count, tuple)", KeyboardInterrupt,
                    1 << 15, 2),
}


@pytest.mark.parametrize("site", sorted(RUNNERS))
def test_an_interrupt_while_a_caller_runs_its_streams_work_never_leaves_a_stale_value(
        private, site):
    """The main thread reads a buffer with launches queued on its stream and runs them itself
    (issue 26); the interruption lands right after it took a launch off the stream's queue.
    Before, that launch was lost without a trace: a later read returned the buffer without it
    (an accumulator one short), no error (a Ctrl-C during a read or sync in a notebook). Now
    the backend reports itself broken and the server stops: every later call raises
    ``ServerClosed``, never a stale value."""
    c, c2, x, z = private
    fn, text, exc, n, nth = RUNNERS[site]
    one = c.create(np.ones(n, np.float32))
    acc = c.create(np.zeros(n, np.float32))
    c.sync()
    hit, launched = [], 0
    for _ in range(100):
        c.write(one, np.ones(n, np.float32))      # queued first: the launches queue behind it
        for _ in range(4):
            c.launch(K.accumulate, K.grid(n), [one, acc], {"n": n})
            launched += 1
        sys.settrace(_interrupt_after(fn, text, exc, None, hit, nth=nth))
        try:
            got = c.read(acc)
        except (exc, ServerError):      # (the interrupt, or the read saw what it broke)
            pass
        else:
            np.testing.assert_array_equal(got, np.full(n, launched, np.float32))
        finally:
            sys.settrace(None)
        if hit:
            break
    assert hit, f"the interruption after {text!r} in {fn.__qualname__} never ran"
    for client, h, want in ((c, acc, launched), (c2, z, 7)):
        out = _bounded(lambda: client.sync() or client.read(h))
        if "error" in out:
            assert isinstance(out["error"], ServerClosed), out["error"]
        else:                                       # nothing was lost: every launch is in it
            np.testing.assert_array_equal(out["value"], np.full(len(out["value"]), want,
                                                                np.float32),
                                          err_msg=f"{launched} launches queued")


def _after_each_call(code, exc, nth_call: int, hit: list):
    """A trace function raising ``exc`` in ``code`` right after its ``nth_call``-th call
    instruction (in execution order) returned, once."""
    return interrupting_tracer(code, after_calls(code), exc, hit, nth_call)


def _accumulating(c):
    """``(one, acc, g)``: a captured graph of ``acc += one`` (4 floats), acc zeroed, synced."""
    one = c.create(np.ones(4, np.float32))
    acc = c.create(np.zeros(4, np.float32))
    c.graph_prepare()
    c.launch(K.accumulate, 1, [one, acc], {"n": 4})
    c.start_capture()
    c.launch(K.accumulate, 1, [one, acc], {"n": 4})
    g = c.stop_capture()
    c.write(acc, np.zeros(4, np.float32))
    c.sync()
    return one, acc, g


def _closed_or_right(c, acc, want):
    """After an interrupted call: the server stopped (``ServerClosed``) or ``acc`` reads ``want``."""
    out = _bounded(lambda: c.sync() or c.read(acc))
    if "error" in out:
        assert isinstance(out["error"], ServerClosed), out["error"]
    else:
        np.testing.assert_array_equal(out["value"], want)


@pytest.mark.parametrize("nth_call", range(1, 9))
@pytest.mark.parametrize("where", ["run_lazy", "read_with_copy"])
def test_an_interrupt_while_deferred_work_runs_never_leaves_a_stale_value(nth_call, where,
                                                                          monkeypatch):
    """Deferred launches and replays (issue 26) run at the next call into the server
    (``ComputeServer._run_lazy``; one replay before a read on its stream runs inside
    ``ComputeServer.read``, together with the read's copy); an interruption right after any call inside
    that run may have lost one, so the server stops (``ServerClosed`` for every later call)
    or, where it landed before anything was taken, every later read is right: never a stale
    value, never a replay run twice."""
    monkeypatch.setattr(queue_mod, "OWNER_CHECK_S", 0.2, raising=False)
    # no timed look of the device thread runs the deferred items first (a loaded host)
    monkeypatch.setattr(queue_mod, "LAZY_S", 3600.0)
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 5)       # a server of its own
    try:
        one, acc, g = _accumulating(c)
        code = (ComputeServer._run_lazy if where == "run_lazy" else ComputeServer.read).__code__
        before = 0.0
        for _ in range(5):      # (the device thread may run the items first: a wake-up from
            g.replay()          # a finalizer's release on a loaded host; then again)
            if where == "run_lazy":                 # deferred: acc += 1
                c.launch(K.accumulate, 1, [one, acc], {"n": 4})     # deferred: acc += 1
                g.replay()                                  # deferred: acc += 1
            want = np.full(4, before + (3 if where == "run_lazy" else 1), np.float32)
            hit = []
            sys.settrace(_after_each_call(code, KeyboardInterrupt, nth_call, hit))
            try:
                got = c.read(acc)
            except (KeyboardInterrupt, ServerError):
                got = None
            finally:
                sys.settrace(None)
            if hit:
                break
            np.testing.assert_array_equal(got, want)    # ran through (here or elsewhere)
            if nth_call > 3:                # fewer calls than nth_call: may run through
                return
            before = float(want[0])
        assert hit, "the first calls of the run were never reached"
        _closed_or_right(c, acc, want)
    finally:
        _bounded(c.shutdown)
