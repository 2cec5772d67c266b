"""An interrupt while a release is queued or run never loses it (ADV4).

Releases (a ``Handle``'s free, a ``Graph``'s destroy with its last clone, a dropped
``StreamId``'s reclaim) are queued by finalizers, which run on any thread, the main thread
included, and run in batches by whoever drains the queue, a caller on the combining path
included. An asynchronous exception (KeyboardInterrupt, a signal handler's exception: both land
on the main thread, right after any call) could land in either place. Before:

- in ``DeviceQueue.release`` after the new batch was made and before it was queued: the
  release was lost (a graph kept for ever with its stream and retained buffers);
- in ``streams._dropped`` with two servers: the servers after the interrupted one never heard
  of the dropped stream (kept for ever);
- in ``DeviceQueue._run`` right after a release was taken off its batch: that release and the
  whole rest of the batch (7 frees, a graph destroy, a stream reclaim here) were lost.

Now each is queued (again) or left in its batch and run later (releases are idempotent), and
afterwards the server's tables are back to where they were, or (a KeyboardInterrupt inside a
message run under the server's lock) the server stopped: ``ServerClosed``, never a hang.

The interruption is placed with an instruction-level trace right after each call of the
function, where CPython runs a pending signal handler (tests/server/test_interrupted_owner.py
explains why not line-level). A release's own handler interrupted half-way by an exception
that is not a KeyboardInterrupt may keep that one buffer/graph/stream (never a wrong value);
the exception is raised by the next blocking call: not swept here.
"""

from __future__ import annotations

import gc
import sys
import threading
import time

import numpy as np
import pytest

import runtime
from helpers import after_calls, interrupting_tracer
from runtime import kernels as K
from runtime import streams as streams_mod
from runtime.errors import ServerClosed, ServerError
from runtime.frontend import graph as graph_mod
from runtime.frontend.handle import Handle
from runtime.server import queue as queue_mod

LIMIT_S = 15.0
N = 64
#: every case collects: the earlier tests' heap frozen out of it (conftest; 45 s of the suite)
pytestmark = pytest.mark.usefixtures("frozen_gc")
COUNTS = ("handles", "graphs", "streams", "bytes_in_use")

SITES = {
    "queue release": [f for f in (queue_mod.DeviceQueue.release,
                                  getattr(queue_mod.DeviceQueue, "_join_batch", None)) if f],
    "batch run": [queue_mod.DeviceQueue._run, queue_mod.DeviceQueue._run_batch],
    "stream dropped": [streams_mod._dropped, streams_mod._Minted.__del__],
    "finalizers": [Handle.__del__, graph_mod.Graph.__del__, graph_mod._Owner.drop],
}




def _bounded(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(LIMIT_S)
    assert not t.is_alive(), "the call hung"
    return out


def _one_case(fn, offset, exc, nth=1) -> str | None:
    """Drop a graph (two clones), its stream, handles, with work pending, and sync, with the
    interruption armed at the ``nth`` time ``fn`` gets to ``offset`` (the second clone's drop
    is the last). None when it never got there; else "ok"."""
    other = runtime.client("cpu", max_idle_bytes=(1 << 30) + 21)   # a second, older server
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 23)
    try:
        keep = c.create(np.full(N, 3, np.float32))
        c.sync()
        base = c.memory_usage()
        s = runtime.StreamId.new()
        c2 = c.with_stream(s)
        one = c2.create(np.ones(N, np.float32))
        acc = c2.create(np.zeros(N, np.float32))
        c2.graph_prepare()
        t = c2.empty(N, np.float32)
        c2.launch(K.add_scalar, K.grid(N), [one, t], {"alpha": 1.0, "n": N})
        c2.launch(K.accumulate, K.grid(N), [t, acc], {"n": N})
        c2.start_capture()
        t = c2.empty(N, np.float32)                     # allocated in the window: retained
        c2.launch(K.add_scalar, K.grid(N), [one, t], {"alpha": 1.0, "n": N})
        c2.launch(K.accumulate, K.grid(N), [t, acc], {"n": N})
        del t
        g = c2.stop_capture()
        g2 = g.clone()
        hs = [c2.create(np.ones(N, np.float32)) for _ in range(5)]
        g.replay()
        hit = []
        sys.settrace(interrupting_tracer(fn.__code__, offset, exc, hit, nth))
        try:
            del g, g2, hs, one, acc, c2, s
            c.sync()
        except (exc, ServerError):
            pass
        finally:
            sys.settrace(None)
        if not hit:
            return None
        gc.collect()
        cm = c.with_stream(runtime.StreamId.current())

        def after():
            try:
                cm.sync()
            except ServerError as e:        # the injected exception, raised by the next call
                if isinstance(e, ServerClosed):
                    raise
            got = cm.read(keep)
            deadline = time.monotonic() + 5     # a dropped stream is reclaimed once its work ran
            while True:
                now = cm.memory_usage()
                if all(now[k] == base[k] for k in COUNTS) or time.monotonic() > deadline:
                    return got, now
                time.sleep(0.01)
        out = _bounded(after)
        if "error" in out:
            assert isinstance(out["error"], ServerClosed), out["error"]
            return "ok"
        got, now = out["value"]
        np.testing.assert_array_equal(got, np.full(N, 3, np.float32))
        kept = {k: (base[k], now[k]) for k in COUNTS if now[k] != base[k]}
        assert not kept, (f"an interrupt after offset {offset} of {fn.__qualname__} kept "
                          f"(before, after): {kept}")
        return "ok"
    finally:
        _bounded(c.shutdown)
        _bounded(other.shutdown)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, TimeoutError])
@pytest.mark.parametrize("site", sorted(SITES))
def test_an_interrupt_while_releases_are_queued_or_run_never_loses_one(site, exc, monkeypatch):
    monkeypatch.setattr(queue_mod, "OWNER_CHECK_S", 0.2, raising=False)
    # an exception escaping a finalizer goes to sys.unraisablehook; pytest's keeps it (with its
    # frames: the dropped objects) until the test ends, the default one prints and drops it
    monkeypatch.setattr(sys, "unraisablehook", lambda info: None)
    ran = 0
    for fn in SITES[site]:
        for offset in after_calls(fn):
            for nth in (1, 2):
                ran += _one_case(fn, offset, exc, nth) == "ok"
    assert ran, f"no interruption in {site} ever ran"


@pytest.mark.parametrize("exc", [KeyboardInterrupt, TimeoutError])
def test_an_interrupt_while_a_graph_is_cloned_never_keeps_it_for_ever(exc, monkeypatch):
    """``Graph.clone`` counted the new clone (``_Owner.acquire``) before the clone object was
    complete: an interrupt right after left a count that no clone would ever drop, so the
    graph (its stream, its retained buffers) was kept for ever. Now the count and the clone's
    liveness change together."""
    monkeypatch.setattr(sys, "unraisablehook", lambda info: None)
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 25)
    try:
        c.sync()
        base = c.memory_usage()
        c2 = c.with_stream(runtime.StreamId.new())
        x = c2.create(np.ones(N, np.float32))
        y = c2.empty(N, np.float32)
        c2.graph_prepare()
        c2.start_capture()
        c2.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
        g = c2.stop_capture()
        hits = 0
        for offset in after_calls(graph_mod.Graph.__init__):
            hit = []
            sys.settrace(interrupting_tracer(graph_mod.Graph.__init__.__code__, offset, exc, hit))
            try:
                g.clone()
            except exc:
                pass
            finally:
                sys.settrace(None)
            hits += bool(hit)
        assert hits, "no interruption in Graph.__init__ ran"
        del g, x, y, c2
        gc.collect()
        cm = c.with_stream(runtime.StreamId.current())      # (not the checking thread's own)
        out = _bounded(lambda: cm.sync() or cm.memory_usage())
        now = out["value"]
        assert {k: now[k] for k in COUNTS} == {k: base[k] for k in COUNTS}, now
    finally:
        _bounded(c.shutdown)
