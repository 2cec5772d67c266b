"""An exception that interrupts a launch, write or create never leaves stale values readable
(ADV5).

A fire-and-forget message (``launch``, ``write``, ``create``) runs on whichever thread holds
the server: the device thread, a caller on the combining path, or the next caller into the
server for a deferred tiny launch (issue 26). An exception that is not a KeyboardInterrupt
landing in it (a signal handler's exception on the main thread, ``PyThreadState_SetAsyncExc``,
a bug) went to the next blocking call as an internal error, once, and the message was lost or
half done. Before: the first read raised it (``ServerUnhealthy``) and every later read of the
buffer returned the values from before the launch or write as if it had run (found by
/tmp/adv5/p_launch_sweep.py: a ``TimeoutError`` right after a call in ``ComputeServer.launch``
or in a deferred ``h_launch``). Now what the message would have written is marked with the
error (``ReplayFailed`` on read until a later write lands), as a launch that failed is
(docs/contract.md section 1); a KeyboardInterrupt still stops the server (``ServerClosed``).

The exception is placed with an instruction-level trace right after each call of the
function (where CPython runs a pending signal handler: tests/server/test_interrupted_owner.py).
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import runtime
from helpers import after_calls, interrupting_tracer
from runtime import kernels as K
from runtime.errors import ServerError, ServerUnhealthy
from runtime.server import queue as queue_mod, server as server_mod

LIMIT_S = 15.0
N = 16
S = server_mod.ComputeServer
SITES = {
    "launch": [S.launch, S._run_lazy, S.h_launch],
    "write": [S.h_write, queue_mod.DeviceQueue.submit],
    "create": [S.h_alloc, S.h_write],
}


def _run_bounded(work, hit: list, res: dict):
    """Run ``work`` on a thread of its own (a trace is per thread), bounded by ``LIMIT_S``: an
    interruption that leaves a wait with no way out fails the test instead of hanging it;
    then stop the test's server. Returns ``(hit, res)``."""
    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(LIMIT_S)
    assert not t.is_alive(), "a call hung after the interruption"
    runtime.shutdown()
    return bool(hit), res


def _interrupted(code, off, op):
    """Run ``op(c)`` then read its output on a fresh server, with a TimeoutError raised right
    after the call ending at ``off`` in ``code`` (the first time it is reached). Returns
    ``(hit, raised by op, read values or error)``."""
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 37).with_stream(runtime.StreamId.new())
    x = c.create(np.arange(N, dtype=np.float32))
    y = c.create(np.zeros(N, np.float32))
    c.sync()
    hit, res = [], {}

    tracer = interrupting_tracer(code, off, TimeoutError, hit)

    def work():
        sys.settrace(tracer)
        try:
            try:
                out = op(c, x, y)
            except TimeoutError as e:
                res["raised"], out = e, y
            for _ in range(4):       # past the queued errors, raised once each
                try:
                    res["value"] = c.read(out)
                    res.pop("error", None)
                    return
                except ServerUnhealthy as e:
                    res["error"] = e
                except ServerError as e:
                    res["error"] = e
                    return
                except TimeoutError:         # the injected one, inside the read: again
                    pass
        finally:
            sys.settrace(None)

    return _run_bounded(work, hit, res)


def _launch(c, x, y):
    c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})     # deferred: tiny
    return y


def _write(c, x, y):
    c.write(y, np.arange(N, dtype=np.float32) + 1)
    return y


def _create(c, x, y):
    return c.create(np.arange(N, dtype=np.float32) + 1)


OPS = {"launch": _launch, "write": _write, "create": _create}


@pytest.mark.parametrize("kind", sorted(SITES))
def test_an_interrupted_launch_write_or_create_never_leaves_stale_values_readable(kind):
    want = np.arange(N, dtype=np.float32) + 1
    stale, cases = [], 0
    for fn in SITES[kind]:
        for off in after_calls(fn):
            hit, res = _interrupted(fn.__code__, off, OPS[kind])
            if not hit:
                continue
            cases += 1
            if "value" not in res or np.array_equal(res["value"], want):
                continue
            if "raised" in res and not res["value"].any():
                continue        # the call itself raised: it may not have run (old values)
            stale.append(f"{fn.__qualname__}+{off}: read {res['value'][:3].tolist()}, "
                         f"the call raised {res.get('raised')!r}")
    assert cases >= 5, f"the sweep reached only {cases} interrupt points"
    assert not stale, "stale values read as if the work ran:\n" + "\n".join(stale)


def _window(code, off):
    """A launch recorded into a capture window with a TimeoutError right after the call ending
    at ``off`` in ``code``; returns ``(hit, the call raised, stop_capture's error or the graph's
    replayed y)`` (the replay retried past queued errors)."""
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 41).with_stream(runtime.StreamId.new())
    x = c.create(np.arange(N, dtype=np.float32))
    y = c.create(np.zeros(N, np.float32))
    c.graph_prepare()
    c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
    c.sync()
    c.start_capture()
    hit, res = [], {}

    tracer = interrupting_tracer(code, off, TimeoutError, hit)

    def work():
        sys.settrace(tracer)
        try:
            try:
                c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
            except TimeoutError as e:
                res["raised"] = e
            try:
                g = c.stop_capture()
            except (ServerError, TimeoutError) as e:
                res["stop"] = e
                return
        finally:
            sys.settrace(None)
        for _ in range(3):
            try:
                c.write(y, np.zeros(N, np.float32))
                g.replay()
                res["value"] = c.read(y)
                return
            except ServerUnhealthy:
                continue

    return _run_bounded(work, hit, res)


def test_a_launch_interrupted_in_a_capture_window_never_leaves_a_graph_without_it():
    """Inside a window, an exception that kept the launch from being recorded used to go to the
    next blocking call only: ``stop_capture`` made a graph without the launch and its replays
    silently left ``y`` alone (8 interrupt points in ``ComputeServer.launch``/``h_launch``).
    Now the window is refused: ``stop_capture`` raises and makes no graph."""
    want = np.arange(N, dtype=np.float32) + 1
    missing, cases = [], 0
    for fn in (S.launch, S.h_launch):
        for off in after_calls(fn):
            hit, res = _window(fn.__code__, off)
            if not hit:
                continue
            cases += 1
            if "value" in res and "raised" not in res and not np.array_equal(res["value"], want):
                missing.append(f"{fn.__qualname__}+{off}: replay gave {res['value'][:3].tolist()}")
    assert cases >= 5, f"the sweep reached only {cases} interrupt points"
    assert not missing, "a graph lacking the interrupted launch:\n" + "\n".join(missing)


def _always_fails(x, y, *, n, count):
    raise ValueError("fails")


ALWAYS_FAILS = runtime.Kernel("always_fails", [("x", "f32", "read"), ("y", "f32", "write")],
                              [("n", "u32")], cpu=_always_fails)


def _update(code, off):
    """``g.update(rebind={x: x2})`` of a graph ``y = x + 1`` with a TimeoutError right after the
    call ending at ``off`` in ``code``; then x2's last writer fails and the graph is replayed.
    Returns ``(hit, what the read of y gave or raised)``."""
    from runtime.errors import UnknownGraph
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 43).with_stream(runtime.StreamId.new())
    x, x2 = c.create(np.arange(N, dtype=np.float32)), c.create(np.full(N, 10, np.float32))
    y = c.create(np.zeros(N, np.float32))
    c.graph_prepare()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": N})
    c.start_capture()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": N})
    g = c.stop_capture()
    c.sync()
    hit, res = [], {}

    tracer = interrupting_tracer(code, off, TimeoutError, hit)

    def work():
        sys.settrace(tracer)
        try:
            g.update(rebind={x: x2})
        except TimeoutError:
            pass
        finally:
            sys.settrace(None)
        c.launch(ALWAYS_FAILS, 1, [c.create(np.zeros(N, np.float32)), x2], {"n": N})
        try:
            c.sync()
        except ServerError:
            pass                        # its LaunchError: x2 is marked now
        c.write(y, np.zeros(N, np.float32))
        try:
            g.replay()
            res["value"] = c.read(y)
        except (ServerError, UnknownGraph) as e:
            res["error"] = e

    return _run_bounded(work, hit, res)


def test_an_interrupted_graph_update_never_replays_a_state_the_marks_do_not_follow():
    """``Graph.update`` interrupted after the backend graph was patched and before the server's
    read/write sets followed (graphs.update, _rebind_state, CpuBackend.update_graph: 14 of 39
    points) left a graph that read x2 while its sources said x: x2's failure did not reach y,
    and the replay returned x2's stale data + 1 silently. Now such an update destroys the
    graph (its replays raise UnknownGraph); an update refused before anything changed keeps
    it, as before (all or nothing)."""
    from runtime.backends.cpu import CpuBackend
    from runtime.server import graphs as graphs_mod
    wrong, cases = [], 0
    for fn in (graphs_mod.update, graphs_mod._rebind_state, CpuBackend.update_graph):
        for off in after_calls(fn):
            hit, res = _update(fn.__code__, off)
            if not hit:
                continue
            cases += 1
            if "value" in res and not np.array_equal(res["value"], np.arange(N) + 1):
                wrong.append(f"{fn.__qualname__}+{off}: read {res['value'][:3].tolist()}")
    assert cases >= 10, f"the sweep reached only {cases} interrupt points"
    assert not wrong, "a replay computed from a failed input, silently:\n" + "\n".join(wrong)
