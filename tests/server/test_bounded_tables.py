"""Nothing grows with work done (issue 24, items 1 and 3).

1. Streams nobody can name any more are reclaimed: per-request streams, ``StaticGraph``s, a
   stream dropped in any capture state (its window aborted, its reservations returned), its
   queued errors handed to the next blocking call; the cpu scheduler looks only at streams
   with work, never at every stream ever used.
3. Finalizer bursts stay inside the queue bound: one message stands for many frees/destroys,
   another client's blocking call waits for at most one batch of them, and destroying N graphs
   that share buffers is linear in N.

Counts and bounds are asserted, never times; waits are bounded (``_until``). The private
reaches (``c._server``: stream table, queue, backend) are the server's tables under test.
"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.backends.cpu import ThreadScheduler
from runtime.errors import LaunchError
from runtime.server import capture as cap
from runtime.server.queue import RELEASE_BATCH
from helpers import captured_add_one, produce_then_consume

LIMIT_S = 20.0
ONES = np.ones(4, np.float32)


def _until(pred, what: str, limit_s: float = LIMIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s} s waiting for {what}")
        time.sleep(0.002)


def _streams(c) -> int:
    return c.memory_usage()["streams"]


def _backend_streams(c):
    s = getattr(c._server.backend, "streams", None)
    return None if s is None else len(s)


@pytest.fixture(params=[False, True], ids=["", "check"])
def own(backend, request):
    """A client of a server of its own (its tables hold this test's objects only), with and
    without the stream-ordering checker."""
    c = runtime.client(backend, check=request.param, max_idle_bytes=(1 << 30) - 7)
    yield c
    c.shutdown()


# -- item 1: streams ------------------------------------------------------------------------------
def test_per_request_streams_are_reclaimed_once_their_stream_id_is_dropped(own):
    c = own
    w = c.create(np.full(4, 3, np.float32))          # a long-lived buffer every request reads
    c.sync()
    base, be_base = _streams(c), _backend_streams(c)
    for k in range(300):
        r = c.with_stream(runtime.StreamId.new())
        x = r.create(np.full(4, k, np.float32))
        y = r.empty(4, np.float32)
        r.launch(K.add, 1, [x, w, y], {"n": 4})
        np.testing.assert_array_equal(r.read(y), np.full(4, k + 3, np.float32))
        del r, x, y
    _until(lambda: _streams(c) <= base, "the dropped streams to be reclaimed")
    if be_base is not None:
        assert _backend_streams(c) <= be_base
    srv = c._server
    st = srv.handles[w.id]            # its read history: live streams and one sweep's worth
    assert len(st.reads) <= 64 + 2 * (len(srv.handles) + len(srv.graphs) + len(srv.streams))
    np.testing.assert_array_equal(c.read(w), np.full(4, 3, np.float32))


def test_static_graphs_made_and_released_leave_no_streams(backend):
    c = runtime.client(backend)
    gc.collect()                 # graphs earlier tests dropped: destroyed before the count
    c.sync()
    use = c.memory_usage()

    def body(x, y):
        x.client.launch(K.add_scalar, 1, [x.handle, y.handle], {"alpha": 1.0, "n": 4})
    for k in range(100):
        g = runtime.StaticGraph(c, inputs={"x": ((4,), "f32")}, outputs={"y": ((4,), "f32")},
                                body=body)
        out = g(x=np.full(4, k, np.float32))
        np.testing.assert_array_equal(out["y"], np.full(4, k + 1, np.float32))
        if k % 2:
            g.release()                              # released, or just dropped
        del g, out
    gc.collect()
    _until(lambda: _streams(c) <= use["streams"], "the graphs' streams to be reclaimed")
    after = c.memory_usage()
    assert after["graphs"] == use["graphs"] and after["handles"] == use["handles"]


@pytest.mark.parametrize("state", ["prepared", "capturing"])
def test_a_stream_dropped_in_a_capture_state_is_aborted_and_returns_its_buffers(backend, state):
    c = runtime.client(backend)
    c.sync()
    before = c.memory_usage()
    r = c.with_stream(runtime.StreamId.new())
    x = r.create(ONES)
    y = r.empty(4, np.float32)
    r.graph_prepare()
    tmp = r.empty(4, np.float32)                     # freed in the warm-up: primed, held back
    r.launch(K.add_scalar, 1, [x, tmp], {"alpha": 1.0, "n": 4})
    r.launch(K.add_scalar, 1, [tmp, y], {"alpha": 1.0, "n": 4})
    del tmp
    if state == "capturing":
        r.start_capture()
        inner = r.empty(4, np.float32)               # allocated in the window
        r.launch(K.add_scalar, 1, [x, inner], {"alpha": 1.0, "n": 4})
        del inner
    sid = int(r.stream)
    srv = c._server
    assert srv.call(lambda: srv.streams[sid].state) == state
    del r, x, y
    gc.collect()
    _until(lambda: _streams(c) <= before["streams"], "the abandoned capture stream to go")
    after = c.memory_usage()
    assert after["handles"] == before["handles"]
    assert after["bytes_in_use"] == before["bytes_in_use"]      # every reservation came back
    assert not srv.capture.windows.get(sid)
    assert c.memory_usage()["graphs"] == before["graphs"]
    x = c.create(ONES)                               # the server goes on
    np.testing.assert_array_equal(c.read(x), ONES)


def test_errors_queued_on_a_dropped_stream_are_raised_by_the_next_blocking_call(backend):
    if backend == "cuda":
        pytest.skip("an out-of-bounds store is undefined behaviour on cuda, not an error")
    from helpers import PAST_END
    c = runtime.client(backend)
    c.set_stream(runtime.StreamId.new())
    c.sync()
    base = _streams(c)
    r = c.with_stream(runtime.StreamId.new())
    small = r.empty(4, np.float32)
    r.launch(PAST_END, 1, [small])                   # fails at execution; nobody syncs r
    del r, small
    gc.collect()
    _until(lambda: _streams(c) <= base, "the failed request's stream to be reclaimed")
    with pytest.raises(LaunchError, match="past_end"):
        c.sync()                                     # handed over, not dropped
    c.sync()                                         # raised once


def test_the_cpu_scheduler_looks_only_at_streams_with_work():
    c = runtime.client("cpu", scheduler=ThreadScheduler())     # a server of its own
    try:
        be = c._server.backend
        idle = [c.with_stream(runtime.StreamId.new()) for _ in range(400)]
        hs = [r.create(ONES) for r in idle]          # 400 live streams, each used once
        for r, h in zip(idle, hs):
            np.testing.assert_array_equal(r.read(h), ONES)
        looked = [0]
        base = type(be.streams)

        class Counting(base):
            def __getitem__(self, k):
                looked[0] += 1
                return base.__getitem__(self, k)

            def __iter__(self):
                looked[0] += len(self)
                return base.__iter__(self)

            def values(self):
                looked[0] += len(self)
                return base.values(self)

            def get(self, k, default=None):
                looked[0] += 1
                return base.get(self, k, default)
        be.streams = Counting(be.streams)
        x = c.create(ONES)
        y = c.empty(4, np.float32)
        for _ in range(200):
            c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
        c.sync()
        np.testing.assert_array_equal(c.read(y), ONES + 1)
        assert looked[0] < 50, f"{looked[0]} stream lookups for 200 launches"
    finally:
        c.shutdown()


# -- item 3: finalizer bursts ----------------------------------------------------------------------
def _record_queue_length(monkeypatch, srv) -> list:
    """Wrap every way a finalizer queues a message; returns ``[max queue length seen]``."""
    seen = [0]
    q = srv.queue
    for name in ("post", "release"):
        fn = getattr(srv, name, None)
        if fn is None:
            continue

        def wrapped(*args, _fn=fn):
            _fn(*args)
            seen[0] = max(seen[0], len(q._q))
        monkeypatch.setattr(srv, name, wrapped)
    return seen


def test_a_burst_of_handle_drops_stays_within_the_queue_bound(backend, monkeypatch):
    c = runtime.client(backend)
    c.set_stream(runtime.StreamId.new())
    before = c.memory_usage()["handles"]
    hs = [c.empty(16) for _ in range(20000)]
    c.sync()
    seen = _record_queue_length(monkeypatch, c._server)
    del hs                                           # 20,000 finalizers at once
    assert seen[0] <= c._server.queue.max_messages, seen
    assert c.memory_usage()["handles"] == before     # every free ran


def test_another_clients_read_waits_for_at_most_one_batch_of_graph_destroys(backend,
                                                                            monkeypatch):
    c = runtime.client(backend)
    c.set_stream(runtime.StreamId.new())
    srv = c._server
    graphs = [captured_add_one(c)[2] for _ in range(2000)]
    other = c.with_stream(runtime.StreamId.new())
    z = other.create(ONES)
    other.sync()
    destroyed = [0]
    destroy = srv.h_graph_destroy

    def counting(gid):
        destroyed[0] += 1
        return destroy(gid)
    monkeypatch.setattr(srv, "h_graph_destroy", counting)
    at_read = []
    read = srv.h_read

    def reading(*args):
        at_read.append(destroyed[0])
        return read(*args)
    monkeypatch.setattr(srv, "h_read", reading)
    seen = _record_queue_length(monkeypatch, srv)
    gate, holding = threading.Event(), threading.Event()

    def hold():                                      # keep the device thread busy meanwhile
        holding.set()
        gate.wait(LIMIT_S)
    srv.queue.post(hold)
    assert holding.wait(LIMIT_S)
    del graphs                                       # 2,000 graph drops at once
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("z", other.read(z)))
    t.start()
    _until(lambda: len(srv.queue._q) >= 2, "the read to be queued")
    gate.set()
    t.join(LIMIT_S)
    np.testing.assert_array_equal(out["z"], ONES)
    assert seen[0] <= srv.queue.max_messages, seen
    assert at_read and at_read[0] <= RELEASE_BATCH, at_read
    _until(lambda: c.memory_usage()["graphs"] == 0 or destroyed[0] >= 2000, "the destroys")
    assert destroyed[0] == 2000


def test_destroying_graphs_that_share_buffers_is_linear(backend, monkeypatch):
    compared = [0]

    class Counted(cap.GraphState):
        __slots__ = ()
        __hash__ = object.__hash__

        def __eq__(self, other):
            compared[0] += 1
            return self is other
    monkeypatch.setattr(cap, "GraphState", Counted)
    c = runtime.client(backend)
    c.set_stream(runtime.StreamId.new())
    x, y, g = captured_add_one(c)
    graphs = [g]
    for _ in range(299):                             # 300 graphs over the same two buffers
        c.graph_prepare()
        c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
        c.start_capture()
        c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
        graphs.append(c.stop_capture())
    base = c.memory_usage()["graphs"]
    while graphs:
        graphs.pop().release()                       # newest first: the worst order for a list
    assert c.memory_usage()["graphs"] == base - 300
    assert compared[0] <= 300, f"{compared[0]} comparisons destroying 300 graphs"
    x2 = c.create(ONES)
    np.testing.assert_array_equal(c.read(x2), ONES)


def test_a_free_never_runs_before_a_message_queued_before_the_drop(backend):
    c = runtime.client(backend)
    c.set_stream(runtime.StreamId.new())
    srv = c._server
    a = c.create(ONES)
    b = c.create(np.full(4, 5, np.float32))
    y = c.empty(4, np.float32)
    c.sync()
    gate, holding = threading.Event(), threading.Event()

    def hold():
        holding.set()
        gate.wait(LIMIT_S)
    srv.queue.post(hold)
    assert holding.wait(LIMIT_S)
    try:
        del a                                        # a release message is now queued...
        c.launch(K.add_scalar, 1, [b, y], {"alpha": 1.0, "n": 4})   # ...then a launch using b
        del b                                        # b's free must not join the first batch
    finally:
        gate.set()
    np.testing.assert_array_equal(c.read(y), np.full(4, 6, np.float32))


def test_errors_of_many_dropped_failing_streams_stay_bounded_and_are_all_reported(own):
    from helpers import PAST_END
    c = own
    if c.backend == "cuda":
        pytest.skip("an out-of-bounds store is undefined behaviour on cuda, not an error")
    c.set_stream(runtime.StreamId.new())
    c.sync()
    srv = c._server
    for _ in range(150):
        r = c.with_stream(runtime.StreamId.new())
        small = r.empty(4, np.float32)
        r.launch(PAST_END, 1, [small])               # fails; nobody syncs r
        del r, small
    gc.collect()
    _until(lambda: _streams(c) <= 1, "the failed requests' streams to be reclaimed")
    _until(lambda: srv.backend.load()[0] == 0, "the backend to run what was submitted")
    c.memory_usage()                                 # (errors found since are folded here)
    waiting = srv.call(lambda: len(srv.marks.async_errors) + len(srv.backend.failures))
    assert waiting <= srv.MAX_ASYNC_ERRORS
    with pytest.raises(LaunchError) as ei:
        c.sync()
    text = str(ei.value)
    assert "past_end" in text and "more queued errors" in text
    c.sync()


def test_a_failed_kernel_keeps_no_caller_alive_through_its_error(backend):
    """A failure mark keeps its error; the error must not keep the frames of the call that ran
    the kernel (the cpu scheduler runs kernels on the waiting caller's thread), or the caller's
    handles and streams would live as long as the mark."""
    import weakref
    from helpers import PAST_END
    from runtime.errors import ServerError
    if backend == "cuda":
        pytest.skip("an out-of-bounds store is undefined behaviour on cuda, not an error")
    c = runtime.client(backend)
    c.set_stream(runtime.StreamId.new())
    c.sync()
    before = c.memory_usage()
    alive = []

    def failing_request():
        r = c.with_stream(runtime.StreamId.new())
        small = r.empty(4, np.float32)
        alive.append(weakref.ref(small))
        r.launch(PAST_END, 1, [small])
        with pytest.raises(ServerError, match="past_end"):
            r.sync()
    for _ in range(20):
        failing_request()
    np.testing.assert_array_equal(c.read(c.create(ONES)), ONES)   # (wgpu: its queue thread
    gc.collect()                                 # lets go of the last fence it ran)
    assert not [w for w in alive if w() is not None]
    _until(lambda: _streams(c) <= before["streams"], "the failed requests' streams to go")
    assert c.memory_usage()["handles"] == before["handles"]


def test_a_stream_that_never_blocks_keeps_a_bounded_error_queue():
    """Failing fire-and-forget work on a stream nobody syncs: its queued errors (server and cpu
    stream) stay bounded by folding, and the next blocking call still reports them all."""
    from helpers import PAST_END
    from runtime.errors import MAX_QUEUED_ERRORS, ServerError
    from contracts.test_launch_failures import ONLY_CUDA
    c = runtime.client("cpu")
    c.set_stream(runtime.StreamId.new())
    srv = c._server
    small = c.empty(4, np.float32)
    c.sync()
    for _ in range(150):
        c.launch(PAST_END, 1, [small])               # fails at execution (cpu stream errors)
        c.launch(ONLY_CUDA, 1, [small])              # refused at enqueue (server stream errors)
    sid = int(c.stream)
    _until(lambda: srv.backend.load()[0] == 0, "the launches to run")
    sizes = srv.call(lambda: (len(srv.streams[sid].errors), len(srv.streams[sid].raw.errors)))
    assert max(sizes) <= MAX_QUEUED_ERRORS, sizes
    with pytest.raises(ServerError) as ei:
        c.sync()
    text = str(ei.value)
    assert "past_end" in text and "only_cuda" in text and "more queued errors" in text
    c.sync()


def test_an_error_queue_filled_from_many_threads_stays_bounded_and_counts_every_error():
    """``ErrorQueue`` (every backend's stream errors and ``failures``): bounded by folding
    however many threads append, and no error is lost (the fold counts them)."""
    from runtime.errors import MAX_QUEUED_ERRORS, ErrorQueue, FoldedErrors
    q = ErrorQueue()

    def fill(k):
        for i in range(2500):
            q.append(LaunchError(f"thread {k} error {i}"))
    threads = [threading.Thread(target=fill, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(q) <= MAX_QUEUED_ERRORS
    errs = q.take()
    assert not q and q.take() == []
    assert sum(e.count if isinstance(e, FoldedErrors) else 1 for e in errs) == 10_000


def test_a_wgpu_stream_that_never_blocks_keeps_bounded_error_queues(monkeypatch):
    """Failures a wgpu stream reports after the enqueue (a failed submit, a validation error at
    ``finish``), on a stream nobody syncs, and the backend's unattributed ``failures``: both
    queues stay bounded; the next blocking call reports them all (folded)."""
    from runtime.errors import MAX_QUEUED_ERRORS, ServerError
    from runtime.testing import backend_unavailable
    why = backend_unavailable("wgpu")
    if why:
        pytest.skip(why)
    c = runtime.client("wgpu").with_stream(runtime.StreamId.new())
    srv = c._server
    be = srv.backend
    x = c.create(np.zeros(4, np.float32))
    y = c.empty(4, np.float32)
    c.sync()
    launch = be.launch

    def late(stream, program, count, args, params, mark=None):   # private: inject failures
        launch(stream, program, count, args, params, mark)
        err = LaunchError("add_scalar: injected failure (reported after the enqueue)")
        stream.errors.append(mark.fail(err) if mark is not None else err)
        be.failures.append(ServerError("an injected failure no stream owns"))
    monkeypatch.setitem(vars(be), "launch", late)
    for _ in range(300):
        c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    sid = int(c.stream)
    sizes = srv.call(lambda: (len(srv.streams[sid].raw.errors), len(be.failures)))
    assert max(sizes) <= MAX_QUEUED_ERRORS, sizes
    monkeypatch.setitem(vars(be), "launch", launch)
    with pytest.raises(ServerError) as ei:
        c.sync()
    text = str(ei.value)
    assert "injected failure" in text and "more queued errors" in text
    c.sync()


def test_kernels_made_per_request_keep_a_bounded_program_table():
    from runtime.kernel import Kernel

    def plus_one(y, *, count):
        y += 1
    c = runtime.client("cpu")
    c.set_stream(runtime.StreamId.new())
    srv = c._server
    y = c.create(np.zeros(4, np.float32))
    n = srv.MAX_PROGRAMS + 100
    for k in range(n):                               # a fresh Kernel object per "request"
        c.launch(Kernel(f"plus_one_{k}", [("y", "f32", "read_write")], cpu=plus_one), 1, [y])
    np.testing.assert_array_equal(c.read(y), np.full(4, n, np.float32))
    assert srv.call(lambda: len(srv.programs)) <= srv.MAX_PROGRAMS


def test_batches_cut_short_are_forgotten_once_they_ran(backend):
    """A burst past ``RELEASE_BATCH`` runs in several messages; the queue remembers the batch
    only while part of it waits (found by the soak: every burst left one behind)."""
    c = runtime.client(backend)
    c.set_stream(runtime.StreamId.new())
    srv = c._server
    for _ in range(5):
        hs = [c.empty(16) for _ in range(3 * RELEASE_BATCH)]
        c.sync()
        del hs
    _until(lambda: srv.call(lambda: srv.queue.pending_releases) == 0, "the releases to run")
    assert srv.call(lambda: len(srv.queue._carry)) == 0


def test_allocations_refused_on_a_stream_that_never_blocks_keep_a_bounded_error_queue():
    """``empty`` past the device's memory is refused at the server (``OutOfMemory`` queued on
    the stream, fire-and-forget): 2,000 of them on a stream nobody syncs kept 2,000 errors; now
    they are folded like every queued error and the next blocking call reports them all."""
    from runtime.errors import MAX_QUEUED_ERRORS, OutOfMemory
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) - 9)     # a server of its own
    c.set_stream(runtime.StreamId.new())
    srv = c._server
    sid = int(c.stream)
    try:
        for _ in range(2000):
            c.empty(1 << 46)                      # 64 TiB: numpy refuses at once
        size = srv.call(lambda: len(srv.streams[sid].errors))
        assert size <= MAX_QUEUED_ERRORS, size
        with pytest.raises(OutOfMemory) as ei:
            c.sync()
        assert "more queued errors" in str(ei.value)
        c.sync()
    finally:
        c.shutdown()


def test_a_service_loop_of_per_request_streams_graphs_and_failures_stays_bounded():
    """2,000 requests, each on two fresh streams: a producer (failing every third request)
    ordered before a consumer by an event, a stateful graph captured into a GraphPool with a
    conditional node, updated (params) and instantiated, a fast-path launch per request, a
    StaticGraph and a runtime.capture every tenth; everything dropped at the end of the
    request. Every table of the server and backend, the live marks and events, and the pool
    table are back at the baseline of live work (found held by ADV2; guards the paths added
    last: the fast paths, ErrorQueue folding, GraphPool, conditional nodes, update)."""
    from runtime.backends.cpu import CpuEvent, CpuGraph, CpuStream
    from runtime.server.marks import Mark
    from runtime.tensor import Tensor

    root = runtime.client("cpu", max_idle_bytes=(1 << 30) - 9)      # a server of its own
    srv = root._server
    n = 16
    x = root.create(np.ones(n, np.float32))
    ok, bad = root.create(np.zeros(1, np.float32)), root.create(np.ones(1, np.float32))
    cond = root.create(np.array([1], np.int32))
    out = root.empty(n, np.float32)
    one = Tensor.from_numpy(root, np.ones(n, np.float32))

    def request(i):
        wrong, (a, y, z) = produce_then_consume(root, ok, bad, i, n)
        assert wrong is None, wrong
        state, res = a.create(np.zeros(n, np.float32)), a.empty(n, np.float32)
        pool = runtime.GraphPool()

        def body():
            t = a.empty(n, np.float32)
            a.launch(K.accumulate, 1, [x, state], {"n": n})
            a.launch(K.add_scalar, 1, [state, t], {"alpha": 1.0, "n": n})
            a.capture_if(cond, lambda: a.launch(K.mul_scalar, 1, [t, res], {"alpha": 2.0, "n": n}))
        a.graph_prepare(pool=pool)
        body()
        a.start_capture()
        body()
        g = a.stop_capture()
        g.replay()
        g.update(params={1: {"alpha": 3.0}})
        g.replay()
        g.instantiate().replay()
        assert a.read(res)[0] == 2 * (4 + 3)          # state 1 + 3 replays, + 3, * 2
        root.launch(K.add_scalar, 1, [x, out], {"alpha": float(i), "n": n})    # cached calls
        if i % 10 == 0:
            sg = runtime.StaticGraph(root, inputs={"u": ((n,), "f32")},
                                     outputs={"v": ((n,), "f32")}, body=lambda u, v: {"v": u.add(one)})
            assert sg(u=np.full(n, i, np.float32))["v"][0] == i + 1
            sg.release()
        if i % 10 == 5:
            cg = runtime.capture(lambda: one.add(one), client=root)
            cg.replay()
            assert cg.read()[0] == 2
            cg.release()

    def tables():
        gc.collect()
        root.sync()
        # the last requests' dropped streams are reclaimed once their work ran: on a loaded
        # machine that work may still be queued right after the sync (a count, not a leak)
        _until(lambda: root.memory_usage() and not srv.ended and srv.backend.load()[0] == 0,
               "the last requests' streams to be reclaimed")
        u = root.memory_usage()
        be = srv.backend
        return dict(handles=u["handles"], graphs=u["graphs"], streams=u["streams"],
                    pools=len(srv.graph_pools), released_pools=len(srv.released_pools),
                    pool_of=len(srv.graph_pool_of), ended=len(srv.ended),
                    fenced=len(srv.marks.fenced), async_errors=len(srv.marks.async_errors),
                    backend_streams=len(be.streams), failures=len(be.failures),
                    carried=len(srv.queue._carry),
                    marks=sum(type(o) is Mark for o in gc.get_objects()),
                    events=sum(type(o) is CpuEvent for o in gc.get_objects()),
                    cpu_streams=sum(type(o) is CpuStream for o in gc.get_objects()),
                    cpu_graphs=sum(type(o) is CpuGraph for o in gc.get_objects()))
    try:
        for i in range(20):
            request(i)
        base = tables()
        for i in range(2000):
            request(i)
        after = tables()
        views = max(len(st.slot.buf.views) for st in srv.handles.values())
    finally:
        root.shutdown()
    # other servers of the process hold marks, events, streams and graphs of their own
    # (objects of the gc): those counts may differ by what other threads did meanwhile, but
    # never by anything like the 2,000 requests run here
    for k in ("marks", "events", "cpu_streams", "cpu_graphs"):
        assert after[k] <= base[k] + 16, (k, base, after)
        base.pop(k), after.pop(k)
    assert after == base, (base, after)
    assert views <= 16


def test_the_checker_forgets_buffers_given_back_to_the_device():
    """With the stream-ordering checker on, every pooled buffer ever used kept an entry (and
    with it the buffer's memory) in the checker's history, also after the pool gave the
    buffer back to the device: 3,000 requests over 50 sizes with a small idle bound grew it
    by one per buffer trimmed (found by ADV2). Now bounded by the buffers the pool holds."""
    c = runtime.client("cpu", check=True, max_idle_bytes=(1 << 16) + 11)   # a server of its own
    srv = c._server
    try:
        for i in range(3000):
            n = 16 + (i % 50) * 4
            x = c.create(np.ones(n, np.float32))
            y = c.empty(n, np.float32)
            c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": n})
            assert c.read(y)[0] == 2
            del x, y
        c.empty_cache()
        u = c.memory_usage()
        assert u["handles"] == 0 and u["bytes_reserved"] == 0
        assert len(srv.checker.bufs) == 0, len(srv.checker.bufs)
    finally:
        c.shutdown()


def _raise_now(y, *, count):
    raise ValueError("planned")


_raise_now.bind = lambda y, *, count: (lambda: _raise_now(y, count=count))
#: a tiny kernel with a ``bind`` that raises: on an idle cpu stream it runs (and fails) at once
#: on the caller's thread, inside the launch's handler (issue 26's fast path)
RAISE_NOW = runtime.Kernel("raise_now", [runtime.Binding("y", "f32", "write")], cpu=_raise_now)
NO_CPU = runtime.Kernel("no_cpu_body", [runtime.Binding("y", "f32", "read_write")], wgsl="x")


@pytest.mark.parametrize("failure", ["compile", "allocation", "fast launch"])
def test_a_request_whose_error_stays_queued_keeps_nothing_of_it_alive(failure):
    """An error found at enqueue and queued on the request's stream (nobody blocks on it: a
    fire-and-forget request) kept its traceback, whose frames reach the caller's: the
    request's handles, its StreamId and so its stream (never reclaimed: it holds the error),
    for ever; a kernel that fails to compile left every such request alive (found by ADV2).
    Queued errors are detached; the errors are still raised by a later blocking call."""
    import weakref
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) - 13)       # a server of its own
    c.set_stream(runtime.StreamId.new())
    alive = []

    class Marker:
        pass

    def request():
        r = c.with_stream(runtime.StreamId.new())
        big = r.empty(1 << 16, np.float32)
        marker = Marker()
        alive.extend([weakref.ref(big), weakref.ref(marker)])
        y = r.empty(4, np.float32)
        if failure == "compile":
            r.launch(NO_CPU, 1, [y])
        elif failure == "allocation":
            r.empty(1 << 46)
        else:
            r.launch(RAISE_NOW, 1, [y])
    try:
        for _ in range(5):
            request()
        gc.collect()
        assert not [w for w in alive if w() is not None]
        _until(lambda: _streams(c) <= 1, "the requests' streams to be reclaimed")
        kind = {"compile": LaunchError, "allocation": runtime.OutOfMemory,
                "fast launch": LaunchError}[failure]
        with pytest.raises(kind):                # never dropped: the next blocking call
            c.sync()
    finally:
        c.shutdown()


def test_servers_stopped_with_client_shutdown_leave_the_server_table():
    """ADV4: ``runtime.server._servers`` kept every server stopped by ``client.shutdown()`` (the
    kit's ``run_program`` does it once per program; a service making servers with per-tenant
    options), with its buffers, until the same options were asked for again or
    ``runtime.shutdown()``: 400 kit programs grew it to 400 entries and RSS by ~27 KB each;
    300 clients with 256 KiB each by 87 MB. A new server now drops the stopped ones."""
    import weakref

    from runtime.server import _servers

    before = {k for k, s in _servers.items() if not s.closed}
    refs = []
    for i in range(40):
        c = runtime.client("cpu", max_idle_bytes=(1 << 20) + 7 * i)     # a server each
        c.read(c.create(np.ones(1 << 14, np.float32)))
        refs.append(weakref.ref(c._server))
        c.shutdown()
        del c
    assert len(_servers) <= len(before) + 1, len(_servers)
    gc.collect()
    assert sum(r() is not None for r in refs) <= 1      # the last one waits for the next server


@pytest.mark.parametrize("where", ["device thread", "caller"])
def test_servers_that_died_leave_no_backend_threads(where):
    """SOAK6: a server whose device thread died (an asynchronous exception, KeyboardInterrupt,
    in a handler) never closed its backend: ``shutdown()`` of a stopped queue returns at once,
    so the cpu backend's four stream workers (and through them the backend, its buffers and
    streams) stayed for ever: a soak interrupting one call in a hundred grew the process by
    4 threads per death (7 -> 43 threads over 30,000 requests). The backend now closes when
    the device thread ends after a death."""
    from runtime.errors import ServerClosed
    from runtime.server.queue import _Fatal

    before = {t for t in threading.enumerate() if t.is_alive()}
    for i in range(6):
        c = runtime.client("cpu", max_idle_bytes=(1 << 22) + 31 + i)    # a server each
        srv = c._server
        x = c.create(ONES)
        np.testing.assert_array_equal(c.read(x), ONES)

        def die():
            raise _Fatal("test: kill the server")
        if where == "device thread":
            srv.post(die)
        else:
            try:                        # an idle server runs it on this thread
                srv.call(die)
            except (_Fatal, ServerClosed):
                pass
        with pytest.raises(ServerClosed):
            c.sync()
        c.shutdown()
        del c, srv, x
    _until(lambda: not [t for t in threading.enumerate() if t.is_alive() and t not in before],
           "the dead servers' threads to end")


def test_wgpu_graphs_with_conditional_nodes_leave_no_cached_bind_groups():
    """SOAK6: a wgpu conditional node allocates its own buffers (flags, the gate's count table
    and indirect args) and binds them in gate bind groups the backend caches; destroying the
    graph left those groups and buffers in the cache (``_groups``, ``_groups_of``) until it
    held ``_CACHE_MAX`` = 4,096 groups: 3 buffers and a group or more per graph made (a soak of
    16,000 mixed requests kept ~2,000 such buffers). Destroying (and updating) a graph now
    forgets them. (Groups over long-lived buffers with other params stay cached, up to
    ``_CACHE_MAX``: the params here take two values.)"""
    from runtime.testing import backend_unavailable
    why = backend_unavailable("wgpu")
    if why:
        pytest.skip(why)
    c = runtime.client("wgpu", max_idle_bytes=(1 << 30) - 21)      # a server of its own
    be = c._server.backend
    try:
        x = c.create(ONES)
        cond = c.create(np.array([1], np.int32))

        def one(k):
            y = c.empty(4, np.float32)
            c.graph_prepare()
            c.start_capture()
            c.capture_if(cond, lambda: c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4}),
                         lambda: c.launch(K.mul_scalar, 1, [x, y], {"alpha": 3.0, "n": 4}))
            g = c.stop_capture()
            g.replay()
            g.update(params={0: {"alpha": float(k % 2)}})   # rebuilds the node's gate
            g.replay()
            np.testing.assert_array_equal(c.read(y), ONES + k % 2)
            g.release()
        one(0)
        c.sync()
        base = c._server.call(lambda: (len(be._groups), len(be._groups_of)))
        for k in range(60):
            one(k)
        c.sync()
        after = c._server.call(lambda: (len(be._groups), len(be._groups_of)))
        assert after[0] <= base[0] + 8 and after[1] <= base[1] + 8, (base, after)
    finally:
        c.shutdown()


def test_a_dead_server_whose_scheduler_lock_was_left_held_still_ends_its_threads():
    """SOAK6 (traced soak): an asynchronous exception landing in a caller between the
    scheduler's ``with cv`` acquire and its block left the cpu scheduler's lock held for ever;
    the server died of it and its backend's close (and the four workers) waited for the lock
    for ever: 5 threads per such death. ``ThreadScheduler.close`` takes the lock back after
    ``CLOSE_LOCK_S``."""
    from runtime.errors import ServerClosed
    from runtime.server.queue import _Fatal

    before = {t for t in threading.enumerate() if t.is_alive()}
    c = runtime.client("cpu", max_idle_bytes=(1 << 22) + 37)       # a server of its own
    srv = c._server
    np.testing.assert_array_equal(c.read(c.create(ONES)), ONES)
    t = threading.Thread(target=srv.backend.scheduler.cv.acquire)   # orphaned: never released
    t.start()
    t.join()

    def die():
        raise _Fatal("test: kill the server")
    srv.post(die)
    with pytest.raises(ServerClosed):
        c.sync()
    c.shutdown()
    _until(lambda: not [t for t in threading.enumerate() if t.is_alive() and t not in before],
           "the dead server's threads to end")


def test_a_wgpu_queue_lock_left_held_by_an_interrupted_caller_is_taken_back():
    """SOAK7 (wgpu soak with interrupts): a KeyboardInterrupt landing in a caller between its
    acquire of the wgpu queue thread's lock and its ``with`` block left the lock held for ever;
    the device thread's next push waited for it for ever, and so did every blocking call. A
    push now takes the lock back after ``LOCK_S``."""
    from runtime.testing import backend_unavailable
    why = backend_unavailable("wgpu")
    if why:
        pytest.skip(why)
    c = runtime.client("wgpu", max_idle_bytes=(1 << 30) - 23)      # a server of its own
    try:
        x = c.create(ONES)
        np.testing.assert_array_equal(c.read(x), ONES)
        t = threading.Thread(target=c._server.backend.qt.cv.acquire)   # orphaned: never released
        t.start()
        t.join()
        box = []

        def use():
            y = c.empty(4, np.float32)
            c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
            box.append(c.read(y))
        u = threading.Thread(target=use, daemon=True)
        u.start()
        u.join(LIMIT_S)
        assert not u.is_alive(), "the call waited for the orphaned lock"
        np.testing.assert_array_equal(box[0], ONES + 1)
    finally:
        c.shutdown()


def test_wgpu_servers_stopped_with_an_orphaned_native_object_leave_no_thread_each():
    """SOAK7/SOAK8's open item: wgpu-native frees a device (on lavapipe: a queue thread of its
    own) only when the last native object made from it is released, and an interrupt landing
    in a wgpu-py call right after its native create (``create_bind_group``,
    ``create_command_encoder``: where the interrupts that stop a server land) leaves an object
    no Python object owns. Each server stopped so kept its device and thread for good (OS
    threads 27 -> 39 over two soak rounds). A closed backend's device now serves the next
    server of its adapter: the threads stay flat however many such servers stop."""
    import gc
    import os

    from runtime.testing import backend_unavailable
    why = backend_unavailable("wgpu")
    if why:
        pytest.skip(why)
    from wgpu.backends.wgpu_native._api import ffi, libf

    counts = []
    for i in range(5):
        c = runtime.client("wgpu", max_idle_bytes=(1 << 30) - 29 - i)      # a server of its own
        try:
            x, y = c.create(ONES), c.empty(4, np.float32)
            c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
            np.testing.assert_array_equal(c.read(y), ONES + 1)
            # what such an interrupt leaves: a native object made from the device, never freed
            libf.wgpuDeviceCreateCommandEncoder(c._server.backend.dev._internal, ffi.NULL)
        finally:
            c.shutdown()
        del c, x, y
        gc.collect()
        counts.append(len(os.listdir("/proc/self/task")))
    assert counts[-1] <= counts[1], f"OS threads after each server: {counts}"
