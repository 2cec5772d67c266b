"""Failure marks never chain without bound (issue 24 item 2): a mark becomes final once its
work is known to have run through any fence: a read or sync on its own stream, or on another
stream that waited for it (the server's automatic event waits, the user's ``wait_event``), a
host read on a third stream included. The marks alive are bounded by the work not yet known
to have completed, not by the work done. Counts are asserted, never times. The private reaches
(``c._server``) are the server's marks under test."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.server.marks import Mark

N = 16
#: each count collects and walks the heap: the earlier tests' part of it frozen out (conftest)
pytestmark = pytest.mark.usefixtures("frozen_gc")


def _chain_marks(server) -> int:
    """Marks reachable from the handles' current marks through ``parents``."""
    seen, stack = set(), [st.mark for st in server.handles.values()]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        stack.extend(p for _, p in m.parents)
    return len(seen)


def _live_marks() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Mark)


def _ping_pong(c, a, b, x, y, steps, read_every=10):
    for i in range(steps):
        a.launch(K.add_scalar, K.grid(N), [y, x], {"alpha": 1.0, "n": N})   # A: x = y + 1
        b.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})   # B: y = x + 1
        if i % read_every == read_every - 1:
            c.read(x)                             # on the main thread's (third) stream


@pytest.mark.parametrize("reads", ["x and y", "x only"])
def test_ping_pong_marks_stay_bounded_by_unfinished_work(client, reads):
    c = client
    a = c.with_stream(runtime.StreamId.new())
    b = c.with_stream(runtime.StreamId.new())
    x, y = c.create(np.zeros(N, np.float32)), c.create(np.zeros(N, np.float32))
    c.sync()
    counts = []
    for steps in (200, 800):
        _ping_pong(c, a, b, x, y, steps)
        if reads == "x and y":
            c.read(y)
        counts.append((_chain_marks(c._server), _live_marks()))
    want = float(2 * 1000)
    np.testing.assert_array_equal(c.read(x), np.full(N, want - 1, np.float32))
    np.testing.assert_array_equal(c.read(y), np.full(N, want, np.float32))
    (chain0, live0), (chain1, live1) = counts
    assert chain1 <= 64, counts                   # bounded by the work since the last reads
    assert chain1 <= chain0 + 8, counts           # flat: four times the work, no more marks
    assert live1 <= live0 + 16, counts


def test_after_an_unrelated_failure_a_read_walks_a_short_chain(client):
    """A failure anywhere makes the next read resolve the chains it meets: they are short."""
    c = client
    a = c.with_stream(runtime.StreamId.new())
    b = c.with_stream(runtime.StreamId.new())
    x, y = c.create(np.zeros(N, np.float32)), c.create(np.zeros(N, np.float32))
    _ping_pong(c, a, b, x, y, 500)
    Mark(("launch", "elsewhere", 0)).fail(runtime.LaunchError("an unrelated failure"))
    a.launch(K.add_scalar, K.grid(N), [y, x], {"alpha": 1.0, "n": N})
    assert _chain_marks(c._server) <= 64
    np.testing.assert_array_equal(c.read(x), np.full(N, 1001.0, np.float32))


def test_event_waits_and_a_sync_on_a_third_stream_make_marks_final(client):
    c = client
    a = c.with_stream(runtime.StreamId.new())
    b = c.with_stream(runtime.StreamId.new())
    x, y = c.create(np.zeros(N, np.float32)), c.create(np.zeros(N, np.float32))
    for i in range(600):
        a.launch(K.add_scalar, K.grid(N), [y, x], {"alpha": 1.0, "n": N})
        b.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
        if i % 10 == 9:                           # no read: the user's events and a sync
            c.wait_event(a.record_event())
            c.wait_event(b.record_event())
            c.sync()
    assert _chain_marks(c._server) <= 64
    np.testing.assert_array_equal(c.read(y), np.full(N, 1200.0, np.float32))


@pytest.mark.parametrize("shape", ["accumulate", "stateful graph", "conditional graph"])
def test_marks_of_work_that_ran_are_dropped_without_a_read_or_sync(shape):
    """A stream that only enqueues (no read, no sync), each step reading what the step before
    wrote (an accumulator, a graph's state, a buffer written only inside a conditional node):
    every mark inherited the one before, and nothing made them final, so 5,000 steps kept a
    chain of 5,000 marks (and it stayed after a sync, until the buffer was touched again). A
    mark whose work ran without failing now drops its parents (``Mark.finished``): the chain
    is as long as the work not yet run, bounded by the queue (``max_load``). cpu only (the
    backend that reports it)."""
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 47).with_stream(runtime.StreamId.new())
    n = 1 << 15                                   # 128 KB: enqueued, never run at once
    x = c.create(np.ones(n, np.float32))
    acc = c.create(np.zeros(n, np.float32))
    flag = c.create(np.array([1], np.int32))

    def step():
        if shape == "conditional graph":
            c.capture_if(flag, lambda: c.launch(K.add_scalar, K.grid(n), [x, acc],
                                                {"alpha": 1.0, "n": n}))
        else:
            c.launch(K.accumulate, K.grid(n), [x, acc], {"n": n})
    run = step
    if shape != "accumulate":
        c.graph_prepare()
        step()
        c.sync()
        c.start_capture()
        step()
        run = c.stop_capture().replay
    c.sync()
    base = _live_marks()
    # per item not yet run: its mark (and a conditional-only buffer's own mark)
    bound = (2 if shape == "conditional graph" else 1) * c._server.queue.max_load + 64
    for i in range(5000):
        run()
        if i % 1000 == 999:
            assert _live_marks() - base <= bound, i
    c.sync()
    assert _live_marks() - base <= 8
    want = {"accumulate": 5000, "stateful graph": 5001, "conditional graph": 2}[shape]
    np.testing.assert_array_equal(c.read(acc), np.full(n, want, np.float32))
    c.shutdown()
