"""Graph pools (docs/contract.md section 4c; issue 26 items 2 and 3): graphs captured into one
``runtime.GraphPool`` share their window allocations, replay in order on one stream, keep
giving the numpy reference's results, and report their memory.

Each graph computes ``out = (x + a) * b`` through a temporary allocated and dropped inside
its window (the shape that a pool shares); sizes differ per graph.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import runtime
from runtime import kernels as K


def _graph(c, x, out, n, a, b, pool=None):
    """Capture ``out = (x + a) * b`` over ``n`` floats with a window temporary."""
    def body():
        t = c.empty(n, np.float32)
        c.launch(K.add_scalar, K.grid(n), [x, t], {"alpha": a, "n": n})
        c.launch(K.mul_scalar, K.grid(n), [t, out], {"alpha": b, "n": n})
        del t
    c.graph_prepare(pool=pool)
    body()
    c.start_capture()
    body()
    return c.stop_capture()


def _setup(c, sizes):
    xs = {n: c.create(np.arange(n, dtype=np.float32)) for n in sizes}
    outs = {n: c.empty(n, np.float32) for n in sizes}
    return xs, outs


SIZES = (4096, 1024, 256, 2048)


def _private():
    return runtime.client("cpu", max_idle_bytes=(1 << 30) + 26)   # a server of its own


def test_pool_graphs_share_temporaries_and_give_equal_results():
    c = _private()
    c = c.with_stream(runtime.StreamId.new())
    xs, outs = _setup(c, SIZES)
    pool = runtime.GraphPool()
    graphs = {}
    for k, n in enumerate(sorted(SIZES, reverse=True)):        # the largest first
        graphs[n] = _graph(c, xs[n], outs[n], n, float(k + 1), 2.0, pool)
    gc.collect()
    c.sync()
    usage = pool.memory_usage()
    assert usage["graphs"] == len(SIZES)
    # one temporary of the largest size class serves every window
    assert usage["bytes"] == 4096 * 4 and usage["high_water"] == 4096 * 4
    assert usage["shared_bytes"] > 0
    for rnd in range(3):
        for n in (256, 4096, 1024, 2048, 256):                  # any order, one stream
            graphs[n].replay()
            k = sorted(SIZES, reverse=True).index(n)
            np.testing.assert_array_equal(c.read(outs[n]), (np.arange(n, dtype=np.float32)
                                                            + (k + 1)) * 2)
    # per graph: its share of the pool
    shares = [graphs[n].memory_usage() for n in SIZES]
    assert all(m["pool"] == pool.id and m["own_bytes"] == 0 for m in shares)
    assert sum(m["nbytes"] for m in shares) <= usage["bytes"]
    assert graphs[256].nbytes == shares[SIZES.index(256)]["nbytes"]


def test_without_a_pool_each_graph_keeps_its_own_temporaries():
    c = _private().with_stream(runtime.StreamId.new())
    xs, outs = _setup(c, SIZES)
    graphs = [_graph(c, xs[n], outs[n], n, 1.0, 2.0) for n in SIZES]
    gc.collect()
    mem = [g.memory_usage() for g in graphs]
    assert [m["own_bytes"] for m in mem] == [n * 4 for n in SIZES]
    assert all(m["pool"] is None for m in mem)
    # every buffer it binds: the caller's input and output and its own temporary
    assert [m["used_bytes"] for m in mem] == [3 * n * 4 for n in SIZES]
    assert c.memory_usage()["graph_bytes"] == sum(n * 4 for n in SIZES)


def _two_streams_one_pool():
    """Clients on two streams of a private server, and a pool with one graph on the first."""
    c = _private()
    a = c.with_stream(runtime.StreamId.new())
    b = c.with_stream(runtime.StreamId.new())
    xs, outs = _setup(a, (256,))
    pool = runtime.GraphPool()
    return a, b, xs, outs, pool, _graph(a, xs[256], outs[256], 256, 1.0, 1.0, pool)


def test_a_pool_is_refused_on_a_second_stream_and_nothing_changes():
    a, b, xs, outs, pool, g = _two_streams_one_pool()
    with pytest.raises(runtime.GraphStateError, match="pool"):
        b.graph_prepare(pool=pool)
    b.graph_prepare()                            # the refusal left the stream as it was
    b.abort_capture()
    assert pool.memory_usage()["stream"] == int(a.stream)
    g.replay()
    np.testing.assert_array_equal(a.read(outs[256]), np.arange(256, dtype=np.float32) + 1)
    with pytest.raises(TypeError):
        a.graph_prepare(pool="not a pool")


def test_a_pool_of_released_graphs_may_move_to_another_stream():
    a, b, xs, outs, pool, g = _two_streams_one_pool()
    g.release()
    a.sync()
    assert pool.memory_usage()["graphs"] == 0 and pool.memory_usage()["bytes"] == 0
    g2 = _graph(b, xs[256], outs[256], 256, 3.0, 1.0, pool)
    g2.replay()
    np.testing.assert_array_equal(b.read(outs[256]), np.arange(256, dtype=np.float32) + 3)


def test_checker_sees_a_pool_buffer_shared_by_two_graphs():
    """Graph B's output lives in graph A's temporary (the pool handed it over); using it
    from another stream after a replay of A, with nothing ordering the two, is a race on that
    buffer, though the launch names another handle than A ever used."""
    c = runtime.client("cpu", check=True, max_idle_bytes=(1 << 30) + 27)   # its own server
    s = c.with_stream(runtime.StreamId.new())
    other = c.with_stream(runtime.StreamId.new())
    n = 256
    x = s.create(np.ones(n, np.float32))
    y = s.empty(n, np.float32)
    pool = runtime.GraphPool()
    ga = _graph(s, x, y, n, 1.0, 1.0, pool)           # its temporary goes to the pool
    gc.collect()
    s.graph_prepare(pool=pool)
    s.start_capture()
    out = s.empty(n, np.float32)                       # takes A's temporary
    s.launch(K.add_scalar, K.grid(n), [x, out], {"alpha": 5.0, "n": n})
    gb = s.stop_capture()
    srv = c._server                                    # private: where the buffer came from
    assert srv.handles[out.id].slot.graph_pool is not None
    gb.replay()
    np.testing.assert_array_equal(s.read(out), np.full(n, 6, np.float32))
    np.testing.assert_array_equal(other.read(out), np.full(n, 6, np.float32))  # ordered: fine
    ga.replay()                                        # overwrites B's output
    z = other.empty(n, np.float32)
    other.launch(K.copy, K.grid(n), [out, z], {"n": n})    # unordered after it: a race
    with pytest.raises(runtime.StreamRaceError):
        other.sync()
    with pytest.raises(runtime.ReplayFailed, match=f"graph {ga.id}"):
        s.read(out)                                    # and it holds A's temporary (ADV7)
    s.sync()
    assert len(srv.checker.violations) == 1
    c.shutdown()


def test_capture_with_a_pool_keeps_outputs_out_of_the_pool():
    c = _private().with_stream(runtime.StreamId.new())
    pool = runtime.GraphPool()
    xs = {n: runtime.Tensor.from_numpy(c, np.arange(n, dtype=np.float32)) for n in (512, 128)}
    gs = {n: runtime.capture(lambda n=n: xs[n].add(xs[n]).add(xs[n]), client=c, pool=pool)
          for n in (512, 128)}
    for _ in range(2):
        got = {n: gs[n].replay().numpy() for n in (128, 512)}
        for n in (128, 512):                           # each output survives the other replay
            np.testing.assert_allclose(gs[n].output.numpy(), np.arange(n) * 3.0)
            np.testing.assert_allclose(got[n], np.arange(n) * 3.0)


def test_graph_estimate_reports_the_warmup_peak():
    c = _private().with_stream(runtime.StreamId.new())
    x = c.create(np.ones(1000, np.float32))
    c.graph_prepare()
    t1 = c.empty(1000, np.float32)
    t2 = c.empty(3000, np.float32)
    c.launch(K.add_scalar, K.grid(1000), [x, t1], {"alpha": 1.0, "n": 1000})
    del t1, t2
    t3 = c.empty(500, np.float32)
    est = c.graph_estimate()
    assert est["bytes"] >= 4000 + 12000 and est["bytes"] < 4000 + 12000 + 4096
    assert est["pool_free_bytes"] == 0 and est["new_bytes"] == est["bytes"]
    del t3
    c.abort_capture()


def test_graph_estimate_counts_what_the_pool_could_serve_before_the_warmup_took_it():
    """With a pool whose graphs left a free temporary, the estimate says the pool serves the
    window (new_bytes 0): what it could serve is taken when graph_prepare runs, not after the
    warm-up took the temporary (which read 0 before)."""
    c = _private().with_stream(runtime.StreamId.new())
    xs, outs = _setup(c, (1024,))
    pool = runtime.GraphPool()
    g = _graph(c, xs[1024], outs[1024], 1024, 1.0, 2.0, pool)   # leaves one 4 KiB temporary
    gc.collect()
    c.sync()
    free = pool.memory_usage()["free_bytes"]
    assert free >= 1024 * 4
    c.graph_prepare(pool=pool)
    t = c.empty(1024, np.float32)                               # the warm-up takes it
    est = c.graph_estimate()
    assert est == {"bytes": 1024 * 4, "pool_free_bytes": free, "new_bytes": 0}
    del t
    c.abort_capture()
    g.release()


def _state_graph(c, x, out, n, pool, keep):
    """Capture ``state += x; out = state`` with the state allocated inside the window (kept in
    ``keep["state"]``): a buffer the graph reads before it writes it."""
    def body():
        state = c.empty(n, np.float32)
        c.launch(K.accumulate, K.grid(n), [x, state], {"n": n})
        c.launch(K.copy, K.grid(n), [state, out], {"n": n})
        keep["state"] = state
    c.graph_prepare(pool=pool)
    body()
    keep.clear()                  # the warm-up's buffer: primed for the recorded run
    c.start_capture()
    body()
    return c.stop_capture()


def test_a_pool_graphs_state_is_never_handed_to_another_graph_of_the_pool():
    # graph A keeps state in a buffer its window allocated; once the caller drops the handle
    # (A retains it), the next window of the pool must not take it as a temporary: B's
    # warm-up and replays would overwrite A's state (A read 7 + 1 instead of 1, then 2)
    n = 256
    c = _private().with_stream(runtime.StreamId.new())
    x = c.create(np.ones(n, np.float32))
    out, out_b = c.empty(n, np.float32), c.empty(n, np.float32)
    pool = runtime.GraphPool()
    keep = {}
    ga = _state_graph(c, x, out, n, pool, keep)
    c.write(keep["state"], np.zeros(n, np.float32))      # the state, from the host
    keep.clear()
    gc.collect()
    c.sync()

    def body():
        t = c.empty(n, np.float32)
        c.launch(K.fill, K.grid(n), [t], {"value": 7.0, "n": n})
        c.launch(K.copy, K.grid(n), [t, out_b], {"n": n})
        del t
    c.graph_prepare(pool=pool)
    body()
    c.start_capture()
    body()
    gb = c.stop_capture()
    gc.collect()
    for k in range(1, 4):
        ga.replay()
        np.testing.assert_array_equal(c.read(out), np.full(n, k, np.float32))
        gb.replay()
        np.testing.assert_array_equal(c.read(out_b), np.full(n, 7, np.float32))


def test_a_window_that_takes_a_pool_temporary_as_its_state_is_refused():
    # the window's buffer comes from the pool's shared temporaries (graph P's), and the
    # recording reads it before writing it: P would overwrite that state on every replay
    n = 256
    c = _private().with_stream(runtime.StreamId.new())
    xs, outs = _setup(c, (n,))
    pool = runtime.GraphPool()
    gp = _graph(c, xs[n], outs[n], n, 1.0, 2.0, pool)
    gc.collect()
    assert pool.memory_usage()["free_bytes"] == n * 4
    out = c.empty(n, np.float32)
    with pytest.raises(runtime.GraphStateError, match="read by the recording before"):
        _state_graph(c, xs[n], out, n, pool, {})
    gc.collect()
    # nothing was made, the stream is back to no capture, the pool graph still works
    gp.replay()
    np.testing.assert_array_equal(c.read(outs[n]), (np.arange(n, dtype=np.float32) + 1) * 2)
    g = _graph(c, xs[n], out, n, 3.0, 1.0, pool)
    g.replay()
    np.testing.assert_array_equal(c.read(out), np.arange(n, dtype=np.float32) + 3)


def test_an_instance_that_keeps_pool_buffers_joins_the_pool_and_stays_on_its_stream():
    """``Graph.instantiate`` of a pool graph keeps the pool temporaries it does not rebind:
    before, an instance on another stream replayed them there while the pool's other graphs
    rewrote them on the pool's stream (a race no error reported, nothing in the user's code
    naming those buffers). Now that is refused with GraphStateError (nothing made), and an
    instance on the pool's stream joins the pool and replays in order with its graphs."""
    c = _private()
    c = c.with_stream(runtime.StreamId.new())
    xs, outs = _setup(c, (256, 1024))
    pool = runtime.GraphPool()
    g1 = _graph(c, xs[1024], outs[1024], 1024, 1.0, 2.0, pool)
    g2 = _graph(c, xs[256], outs[256], 256, 3.0, 4.0, pool)
    gc.collect()
    c.sync()
    before = len(c._server.graphs)
    with pytest.raises(runtime.GraphStateError, match="graph pool"):
        g1.instantiate(stream=runtime.StreamId.new())
    assert len(c._server.graphs) == before                 # nothing made
    out2 = c.empty(1024, np.float32)
    inst = g1.instantiate(rebind={outs[1024]: out2})        # same stream: a member
    assert pool.memory_usage()["graphs"] == 3
    assert inst.memory_usage()["pool"] == g1.memory_usage()["pool"]
    x = np.arange(1024, dtype=np.float32)
    for _ in range(3):                                      # interleaved, in order
        inst.replay()
        g2.replay()
        g1.replay()
    np.testing.assert_allclose(c.read(out2), (x + 1.0) * 2.0)
    np.testing.assert_allclose(c.read(outs[1024]), (x + 1.0) * 2.0)
    np.testing.assert_allclose(c.read(outs[256]), (x[:256] + 3.0) * 4.0)
    inst.release()
    c.sync()
    assert pool.memory_usage()["graphs"] == 2


def test_a_pool_whose_server_stopped_serves_the_next_server():
    """ADV4: a ``GraphPool`` stayed bound to the first server that captured into it, so after
    ``runtime.shutdown()`` (or in a forked child: tests/test_fork.py) every capture into a
    module-level pool raised ``ValueError: GraphPool 1 belongs to server runtime-cpu:0``: the
    pool was unusable for ever. Its shared buffers went with that server; it binds to the next.
    A pool still bound to a live server keeps refusing another one."""
    pool = runtime.GraphPool()
    for _ in range(2):                          # a server, stopped; then a new one
        c = _private().with_stream(runtime.StreamId.new())
        xs, outs = _setup(c, (256,))
        g = _graph(c, xs[256], outs[256], 256, 1.0, 2.0, pool)
        g.replay()
        np.testing.assert_array_equal(c.read(outs[256]), (np.arange(256) + 1) * 2)
        assert pool.memory_usage()["graphs"] == 1
        other = runtime.client("cpu", max_idle_bytes=(1 << 30) + 27).with_stream(
            runtime.StreamId.new())
        with pytest.raises(ValueError, match="belongs to server"):
            other.graph_prepare(pool=pool)
        other.shutdown()
        c.shutdown()


def _output_on_a_temporary(n=256):
    """Graph A of a pool (``t = x + 100``, a temporary, ``out_a = t``), then graph B of the
    pool whose window takes A's ``t`` for its output ``o = 2x``, kept alive. Returns
    ``(c, x, out_a, ga, gb, o, pool)``."""
    c = _private().with_stream(runtime.StreamId.new())
    x = c.create(np.arange(n, dtype=np.float32))
    out_a = c.empty(n, np.float32)
    pool = runtime.GraphPool()
    ga = _graph(c, x, out_a, n, 100.0, 1.0, pool)
    gc.collect()
    c.sync()
    keep = {}

    def body():
        o = c.empty(n, np.float32)                              # from the pool: A's t
        c.launch(K.mul_scalar, K.grid(n), [x, o], {"alpha": 2.0, "n": n})
        keep["o"] = o
    c.graph_prepare(pool=pool)
    body()
    keep.clear()
    c.start_capture()
    body()
    gb = c.stop_capture()
    return c, x, out_a, ga, gb, keep.pop("o"), pool


def test_an_output_on_another_graphs_temporary_raises_once_that_graph_overwrote_it():
    """Graph B's window takes graph A's temporary from the pool for its output ``o`` (kept
    alive). A replay of A rewrites that buffer: a read of ``o`` then raises ``ReplayFailed``
    naming A (before ADV7 it returned A's temporary, ``x + 100``, with no error), and so does
    work computed from it; B's next replay (or a host write) makes it good again."""
    n = 256
    c, x, out_a, ga, gb, o, pool = _output_on_a_temporary(n)
    y = c.empty(n, np.float32)
    assert pool.memory_usage()["shared_bytes"] > 0              # o is A's temporary
    twice = np.arange(n, dtype=np.float32) * 2
    for _ in range(2):
        gb.replay()
        np.testing.assert_array_equal(c.read(o), twice)
        ga.replay()
        np.testing.assert_array_equal(c.read(out_a), np.arange(n, dtype=np.float32) + 100)
        with pytest.raises(runtime.ReplayFailed, match=f"graph {ga.id}"):
            c.read(o)
        c.launch(K.add_scalar, K.grid(n), [o, y], {"alpha": 1.0, "n": n})
        with pytest.raises(runtime.ReplayFailed):
            c.read(y)                                           # computed from it: raises too
    c.write(o, np.ones(n, np.float32))
    np.testing.assert_array_equal(c.read(o), np.ones(n, np.float32))


def test_a_freed_output_on_another_graphs_temporary_is_forgotten_and_the_graph_deferred_again():
    """The graph that overwrites such an output keeps it only while the handle lives: once it
    is freed the graph forgets it (its table is bounded by live handles) and its replays are
    deferred again like any tiny graph's (ADV7)."""
    n = 256
    c, x, out_a, ga, gb, o, pool = _output_on_a_temporary(n)
    state = c._server.graphs[ga.id]                             # private: the graph's table
    assert len(state.clobbers) == 1 and not state.defer
    del o
    gc.collect()
    c.sync()
    assert state.clobbers == {} and state.defer
    ga.replay()
    np.testing.assert_array_equal(c.read(out_a), np.arange(n, dtype=np.float32) + 100)


def _output_then_reader(c, pool, reader_pool, n=64):
    """Pool graph A: ``out = x + 1``, ``out`` allocated in A's window and kept; graph C (in
    ``reader_pool``, or none) reads it: ``res = out + 10``, retaining what it uses; then
    ``out``'s handle is freed (C keeps its buffer) and pool graph B takes a window temporary
    ``t = 1000`` (copied to ``res_b``). Returns ``(A, B, C, res, res_b, x)``."""
    x = c.create(np.full(n, 5, np.float32))
    res, res_b = c.create(np.zeros(n, np.float32)), c.create(np.zeros(n, np.float32))

    def a_body():
        o = c.empty(n, np.float32)
        c.launch(K.add_scalar, 1, [x, o], {"alpha": 1.0, "n": n})
        return o
    c.graph_prepare(pool=pool)
    a_body()
    c.start_capture()
    out = a_body()
    A = c.stop_capture()
    c.graph_prepare(pool=reader_pool)
    c.launch(K.add_scalar, 1, [out, res], {"alpha": 10.0, "n": n})
    c.start_capture()
    c.launch(K.add_scalar, 1, [out, res], {"alpha": 10.0, "n": n})
    C = c.stop_capture(retain=True)
    out.release()
    del out

    def b_body():
        t = c.empty(n, np.float32)
        c.launch(K.fill, 1, [t], {"value": 1000.0, "n": n})
        c.launch(K.copy, 1, [t, res_b], {"n": n})
    c.graph_prepare(pool=pool)
    b_body()
    c.start_capture()
    b_body()
    B = c.stop_capture()
    return A, B, C, res, res_b, x


@pytest.mark.parametrize("reader", ["no pool", "same pool"])
def test_a_pool_never_shares_a_buffer_another_graph_reads_as_its_input(client, hardware,
                                                                       reader):
    # ADV8: C kept A's output (its handle freed, C retains the buffer); the pool handed that
    # buffer to B's window as a temporary, so after A, B, C the result was B's 1000 + 10, not
    # (5 + 1) + 10, with no error (cpu, wgpu): whether C is outside the pool or a member
    # reading it before writing it, the buffer is not a temporary anyone may take.
    if hardware:
        pytest.skip("a driver graph refuses window allocations the warm pool cannot serve")
    pool = runtime.GraphPool()
    A, B, C, res, res_b, x = _output_then_reader(client, pool,
                                              pool if reader == "same pool" else None)
    for _ in range(2):
        A.replay()
        B.replay()
        C.replay()
        np.testing.assert_array_equal(client.read(res), np.full(64, 16, np.float32))
        np.testing.assert_array_equal(client.read(res_b), np.full(64, 1000, np.float32))
    assert pool.memory_usage()["shared_bytes"] == 0
    C.release()
    del C
    client.sync()
    gc.collect()
    assert pool.memory_usage()["free_bytes"] >= 256   # C gone: A's buffer may be shared again


def test_a_window_temporary_another_streams_graph_reads_is_not_shared_at_stop_capture(
        client, hardware):
    # ADV9 (ADV8's open item): pool graph A's window allocates t and frees it there (a
    # temporary); meanwhile a graph B captured on another stream (outside the pool, retain)
    # reads t. stop_capture gave t to the pool at once (GraphPool.adopt skipped _shareable), so
    # pool graph C's window took it as its temporary: after A, C, B the result was C's
    # 1000 + 10, not (1 + 1) + 10, with no error (cpu, wgpu).
    if hardware:
        pytest.skip("a driver graph refuses window allocations the warm pool cannot serve")
    n = 64
    a = client
    b = a.with_stream(runtime.StreamId.new())
    pool = runtime.GraphPool()
    x = a.create(np.ones(n, np.float32))
    out, res = a.create(np.zeros(n, np.float32)), b.create(np.zeros(n, np.float32))
    a.sync()

    def add(c, src, dst, alpha):
        c.launch(K.add_scalar, 1, [src, dst], {"alpha": alpha, "n": n})
    a.graph_prepare(pool=pool)
    a.start_capture()
    t = a.empty(n, np.float32)
    add(a, x, t, 1.0)                                  # t = 2
    b.graph_prepare()
    add(b, t, res, 10.0)
    b.start_capture()
    add(b, t, res, 10.0)                               # B: res = t + 10
    B = b.stop_capture(retain=True)
    add(a, t, out, 0.0)
    t.release()                                        # freed in A's own window
    A = a.stop_capture()
    a.graph_prepare(pool=pool)                         # C: a temporary of 1000s
    a.start_capture()
    u = a.empty(n, np.float32)
    a.launch(K.fill, 1, [u], {"value": 1000.0, "n": n})
    add(a, u, out, 0.0)
    u.release()
    C = a.stop_capture()
    for _ in range(2):
        A.replay()
        C.replay()
        b.wait_event(a.record_event())
        B.replay()
        np.testing.assert_array_equal(b.read(res), np.full(n, 12, np.float32))
    assert pool.memory_usage()["shared_bytes"] == 0
    B.release()
    del B
    a.sync()
    gc.collect()
    assert pool.memory_usage()["free_bytes"] >= 256    # B gone: t may be shared again
