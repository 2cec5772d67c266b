"""Fused replays of pointwise chains on the cpu backend (issue 26; runtime.backends.cpu_fuse).

A software graph runs each run of consecutive fill/copy/add/mul/add_scalar/mul_scalar/
accumulate/noop launches as one compiled call. These tests pin what fusion must keep:

- the values, bit for bit, against the unfused replay (one numpy call per launch) and an
  independent numpy reference, over random chains (in place, ping-pong, short and 2-D counts,
  zero counts, -0.0/NaN payloads/signalling NaN/inf/subnormal values and params, runs broken by
  a bitwise int32 copy, an indirect count or a kernel without a ``fuse`` description). The one
  freedom: a NaN computed from two NaN operands may carry either payload (IEEE 754 leaves it
  open, and numpy itself picks the first operand's in its vector body and the second's in the
  tail), so there the reference only asks for a NaN;
- views into one allocation (an arena) that overlap at different offsets never share a run;
- ``Graph.update(params=)`` fuses again with the new params;
- a failing fused call reports the run's kernels and marks the replay's write set; a launch
  numpy would refuse stays an unfused call that fails with its own name;
- no interpreter (numba missing, a compile error): the unfused calls, never a broken capture;
- the inline rule counts a fused call by its work;
- the testing kit's programs make graphs that fuse.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import runtime
from runtime import kernels as K
from runtime.backends import cpu as C, cpu_fuse as F
from runtime.backends.cpu import CpuBackend, CpuBuffer, CpuGraph
from runtime.errors import LaunchError, ReplayFailed

ELEMS = 40


def _negate_bind(x, y, *, count, n):
    m = min(n, count[0] * count[1] * K.WORKGROUP)
    return lambda: np.negative(x[:m], y[:m])


def _negate(x, y, *, count, n):
    _negate_bind(x, y, count=count, n=n)()


_negate.bind = _negate_bind
#: ``y = -x`` with a ``bind`` and no ``fuse`` description: a launch that ends a run
NEGATE = runtime.Kernel("negate", [("x", "f32", "read"), ("y", "f32", "write")],
                        [("n", "u32")], cpu=_negate)


@pytest.fixture(scope="module")
def be():
    b = CpuBackend(scheduler="interleave")
    yield b
    b.close()


@contextlib.contextmanager
def _fusion(on: bool):
    was = F.ENABLED
    F.ENABLED = on
    try:
        yield
    finally:
        F.ENABLED = was


#: bit patterns inputs draw from: ±0, ±inf, quiet NaNs with payloads and signs, signalling
#: NaNs, subnormals, the largest finite, values whose sums and products round
SPECIAL_BITS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                0x7FC12345, 0xFFD00001, 0x7F800001, 0xFF812345, 0x00000001, 0x807FFFFF,
                0x7F7FFFFF, 0xFF7FFFFF, 0x3F800001, 0x3EAAAAAB, 0x4B800001]
PARAMS = [0.0, -0.0, 1.5, -2.0, 1e-45, 3e38, 1e39, float("inf"), float("-inf"), float("nan"),
          0.1, 16777217.0]


def _values(draw, n):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
    bits = v.view(np.uint32)
    for i in draw(st.lists(st.integers(0, n - 1), max_size=8)):
        bits[i] = draw(st.sampled_from(SPECIAL_BITS))
    return v


#: kernel -> (buffer bindings, param names)
FUSABLE = [K.fill, K.copy, K.add, K.mul, K.add_scalar, K.mul_scalar, K.accumulate, K.noop]
BREAKERS = ["copy_words", "indirect", "negate"]


@st.composite
def _chains(draw, buffers=4, max_len=12):
    """``(initial values per buffer, steps)``; a step: ``(kind, buffer indices, n, count,
    params)``, ``kind`` a fusable kernel or one of ``BREAKERS``."""
    init = [_values(draw, ELEMS) for _ in range(buffers)]
    steps = []
    for _ in range(draw(st.integers(1, max_len))):
        kind = draw(st.sampled_from(FUSABLE * 3 + BREAKERS))
        kern = {"copy_words": K.copy_words, "indirect": K.add_scalar, "negate": NEGATE}.get(
            kind, kind)
        bufs = [draw(st.integers(0, buffers - 1)) for _ in kern.bindings]
        n = draw(st.one_of(st.just(ELEMS), st.integers(0, ELEMS + 30)))
        count = draw(st.sampled_from([K.grid(ELEMS), (1, 1, 1), (0, 1, 1), (1, 2, 1),
                                      (1, 0, 1), (3, 1, 0)]))
        if kind == "indirect":
            count = (draw(st.integers(0, 1)), 1, draw(st.integers(0, 1)))
        params = {p: draw(st.sampled_from(PARAMS)) for p in kern.param_names if p != "n"}
        steps.append((kind, bufs, n, count, params))
    return init, steps


def _launches(be, bufs, steps):
    """The resolved launches of ``steps`` over the ``CpuBuffer`` s ``bufs``."""
    out = []
    for kind, idx, n, count, params in steps:
        kern = {"copy_words": K.copy_words, "indirect": K.add_scalar, "negate": NEGATE}.get(
            kind, kind)
        args = [(bufs[i], bufs[i].data.nbytes) for i in idx]
        ps = tuple({**params, "n": n}[p] for p in kern.param_names)
        if kind == "indirect":
            cbuf = CpuBuffer(np.frombuffer(np.array(count, np.uint32).tobytes(), np.uint8).copy())
            count = (cbuf, 12)
        out.append(be._resolve(kern, count, args, ps))
    return tuple(out)


def _replay(graph):
    for f in graph.calls:
        f()


def _run(be, init, steps, fused):
    """Bytes of every buffer after one replay of ``steps`` captured with fusion on/off, and
    the graph."""
    bufs = [CpuBuffer(v.view(np.uint8).copy()) for v in init]
    with _fusion(fused), np.errstate(all="ignore"):      # a 1e39 param warns at bind
        g = CpuGraph(_launches(be, bufs, steps))
    with np.errstate(all="ignore"):
        _replay(g)
    return [b.data.view(np.float32).copy() for b in bufs], g


def _reference(init, steps):
    """Independent numpy reference, with a mask per buffer of elements whose NaN payload is
    open (computed from two NaN operands somewhere along the way)."""
    vals = [v.copy() for v in init]
    open_ = [np.zeros(len(v), bool) for v in init]
    nan = np.isnan
    with np.errstate(all="ignore"):
        for kind, idx, n, count, params in steps:
            if not (count[0] and count[1] and count[2]):
                continue
            m = min(n, count[0] * count[1] * K.WORKGROUP, ELEMS)
            x = [vals[i][:m].copy() for i in idx]
            o = [open_[i][:m].copy() for i in idx]
            dst = idx[-1]
            if kind is K.fill:
                r, ro = np.full(m, np.float32(params["value"]), np.float32), np.zeros(m, bool)
            elif kind in (K.copy, "copy_words"):
                r, ro = x[0], o[0]
            elif kind in (K.add, K.mul):
                r = x[0] + x[1] if kind is K.add else x[0] * x[1]
                ro = (nan(x[0]) & nan(x[1])) | o[0] | o[1]
            elif kind in (K.add_scalar, K.mul_scalar, "indirect"):
                a = np.float32(params["alpha"])
                r = x[0] + a if kind is not K.mul_scalar else x[0] * a
                ro = (nan(x[0]) & nan(a)) | o[0]
            elif kind is K.accumulate:
                r, ro = x[1] + x[0], (nan(x[0]) & nan(x[1])) | o[0] | o[1]
            elif kind == "negate":
                r, ro = -x[0], o[0]
            else:                                     # noop
                continue
            vals[dst][:m], open_[dst][:m] = r, ro
    return vals, open_


def _assert_same(got, want, open_=None):
    """Bit for bit, except a NaN where ``open_`` (or, without it, wherever ``want`` is NaN)."""
    for i, (g, w) in enumerate(zip(got, want)):
        free = np.isnan(w) if open_ is None else open_[i]
        same = (g.view(np.uint32) == w.view(np.uint32)) | (free & np.isnan(g) & np.isnan(w))
        assert same.all(), (i, np.nonzero(~same)[0], g[~same], w[~same])


def _expected_runs(steps) -> int:
    """Fused calls a chain over separate buffers must get: maximal runs of launches that do
    work (zero counts are dropped) of fusable kernels, with at least two that are not noop."""
    runs, cur = 0, 0
    for kind, _, _, count, _ in steps:
        if kind == "indirect" or (count[0] and count[1] and count[2]):
            if kind in BREAKERS:
                runs, cur = runs + (cur >= 2), 0
            elif kind is not K.noop:
                cur += 1
    return runs + (cur >= 2)


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(_chains())
def test_fused_replays_equal_unfused_replays_and_numpy_bit_for_bit(be, chain):
    init, steps = chain
    fused, g = _run(be, init, steps, True)
    plain, g0 = _run(be, init, steps, False)
    want, open_ = _reference(init, steps)
    _assert_same(plain, want, open_)
    _assert_same(fused, want, open_)
    assert not any(F.is_fused(f) for f in g0.calls)
    assert sum(F.is_fused(f) for f in g.calls) == _expected_runs(steps)


def _replay_until_failure(graph):
    """Replay; the name of the call that raised (its exception type too), or None."""
    for f, name in zip(graph.calls, graph.names):
        try:
            f()
        except Exception as e:  # noqa: BLE001 - numpy refusing a launch
            return name, type(e)
    return None


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(_chains(buffers=3), st.lists(st.sampled_from([0, 0, 4, 8, 40, 80, 160, 320, 2, 6]),
                                    min_size=3, max_size=3),
       st.lists(st.sampled_from([ELEMS, ELEMS, ELEMS // 2]), min_size=3, max_size=3),
       st.integers(0, 2**32 - 1))
def test_views_into_one_arena_fuse_only_where_they_are_the_same_memory_or_disjoint(
        be, chain, offsets, sizes, seed):
    """Handles that are views into one allocation at different offsets (partial overlaps,
    identical starts with other lengths, misaligned starts): the fused replay equals the
    unfused one, also when a launch numpy refuses (operands of other lengths) stops both at
    the same launch."""
    _, steps = chain
    fill = np.random.default_rng(seed).standard_normal(256).astype(np.float32)
    results, failed = [], []
    for on in (True, False):
        arena = np.zeros(1024, np.uint8)
        arena[:] = fill.view(np.uint8)
        bufs = [CpuBuffer(arena[off:off + 4 * size]) for off, size in zip(offsets, sizes)]
        with _fusion(on), np.errstate(all="ignore"):
            g = CpuGraph(_launches(be, bufs, steps))
        with np.errstate(all="ignore"):
            failed.append(_replay_until_failure(g))
        results.append(arena.view(np.float32).copy())
    assert failed[0] == failed[1]
    _assert_same([results[0]], [results[1]])


def test_a_partial_overlap_ends_the_run_and_disjoint_views_of_one_arena_fuse(be):
    """x and y overlap by all but one element (y starts one float later): ``x -> y -> x``
    element by element would read values the run wrote at another index; launch by launch
    (numpy) reads them after the whole launch. The run is cut; disjoint views fuse."""
    n = ELEMS

    def chain(bufs):
        x, y = bufs
        return tuple(be._resolve(K.add_scalar, K.grid(n), [(a, 4 * n), (b, 4 * n)], (1.0, n))
                     for a, b in ((x, y), (y, x), (x, y)))

    start = np.arange(2 * n + 1, dtype=np.float32)
    for offset, runs in ((4, 0), (4 * n, 1)):
        arena = np.zeros(4 * (2 * n + 1), np.uint8)
        arena.view(np.float32)[:] = start
        bufs = [CpuBuffer(arena[:4 * n]), CpuBuffer(arena[offset:offset + 4 * n])]
        g = CpuGraph(chain(bufs))
        _replay(g)
        want = start.copy()                           # numpy, launch by launch
        x, y = want[:n], want[offset // 4:offset // 4 + n]
        for a, b in ((x, y), (y, x), (x, y)):
            np.add(a, np.float32(1), b)
        np.testing.assert_array_equal(arena.view(np.float32), want)
        assert sum(F.is_fused(f) for f in g.calls) == runs
        assert len(g.calls) == (3 if runs == 0 else 1)


def test_a_fused_call_keeps_the_memory_it_addresses_alive(be):
    """A queued replay holds the graph's calls, not the graph (an update or a release may drop
    the launch list meanwhile): the fused call alone keeps its buffers' memory alive."""
    x = CpuBuffer(np.arange(64, dtype=np.float32).view(np.uint8).copy())
    y = CpuBuffer(np.zeros(256, np.uint8))
    alive = weakref.ref(x.data), weakref.ref(y.data)
    g = CpuGraph((be._resolve(K.add_scalar, K.grid(64), [(x, 256), (y, 256)], (1.0, 64)),
                  be._resolve(K.mul_scalar, K.grid(64), [(y, 256), (x, 256)], (2.0, 64))))
    calls = g.calls
    del g, x, y
    gc.collect()
    assert all(r() is not None for r in alive)
    calls[0]()
    np.testing.assert_array_equal(alive[0]().view(np.float32),
                                  (np.arange(64, dtype=np.float32) + 1) * 2)


def test_inline_counts_a_fused_call_by_its_work(be):
    """A replay of at most INLINE_CALLS tiny calls runs on the caller; a fused chain of 10 (and
    100) launches over 64 floats counts by its work and may; 10,000 may not (the replay's
    enqueue would then wait for its execution)."""
    x = CpuBuffer(np.zeros(256, np.uint8))
    y = CpuBuffer(np.zeros(256, np.uint8))

    def graph(length, on=True):
        one = (be._resolve(K.add_scalar, K.grid(64), [(x, 256), (y, 256)], (1.0, 64)),
               be._resolve(K.add_scalar, K.grid(64), [(y, 256), (x, 256)], (1.0, 64)))
        with _fusion(on):
            return CpuGraph(one * (length // 2))

    assert graph(10).inline and len(graph(10).calls) == 1
    assert not graph(10, on=False).inline
    assert graph(100).inline
    g = graph(10000)
    assert not g.inline and len(g.calls) == 1 and F.is_fused(g.calls[0])
    assert g.calls[0].func is F.kernel()[1] and graph(100).calls[0].func is F.kernel()[0]
    _replay(g)
    np.testing.assert_array_equal(x.data.view(np.float32), np.full(64, 10000, np.float32))


@pytest.fixture
def c():
    cl = runtime.client("cpu")
    cl.set_stream(runtime.StreamId.new())
    return cl


@pytest.fixture
def graphs(monkeypatch):
    """The ``CpuGraph`` s built (captures and updates), newest last."""
    made = []
    rebind = CpuGraph.rebind

    def spy(self):
        rebind(self)
        made.append(self)
    monkeypatch.setattr(CpuGraph, "rebind", spy)
    return made


def _capture(c, work):
    c.graph_prepare()
    work()
    c.sync()
    c.start_capture()
    work()
    return c.stop_capture()


def test_a_ping_pong_chain_replays_as_one_fused_call_with_numpy_values(c, graphs):
    n = 64
    a = c.create(np.arange(n, dtype=np.float32))
    b = c.create(np.zeros(n, np.float32))
    out = c.create(np.zeros(n, np.float32))

    def work():
        for i in range(10):
            c.launch(K.add_scalar, K.grid(n), [a, b] if i % 2 == 0 else [b, a],
                     {"alpha": 1.0, "n": n})
        c.launch(K.mul, K.grid(n), [a, b, out], {"n": n})
        c.launch(K.accumulate, K.grid(n), [a, out], {"n": n})
    g = _capture(c, work)
    assert [F.is_fused(f) for f in graphs[-1].calls] == [True]
    assert graphs[-1].inline
    for start in (np.arange(n, dtype=np.float32), np.linspace(-1, 1, n, dtype=np.float32)):
        c.write(a, start)
        g.replay()
        x = start.copy()
        y = np.zeros(n, np.float32)
        for i in range(10):
            (np.add(x, np.float32(1), y) if i % 2 == 0 else np.add(y, np.float32(1), x))
        want = x * y + x
        np.testing.assert_array_equal(c.read(out), want)
        np.testing.assert_array_equal(c.read(a), x)


def test_update_params_fuses_again_with_the_new_params(c, graphs):
    n = 64
    x = c.create(np.arange(n, dtype=np.float32))
    y = c.create(np.zeros(n, np.float32))
    z = c.create(np.zeros(n, np.float32))

    def work():
        c.launch(K.add_scalar, K.grid(n), [x, y], {"alpha": 1.0, "n": n})
        c.launch(K.mul_scalar, K.grid(n), [y, z], {"alpha": 2.0, "n": n})
    g = _capture(c, work)
    fused = graphs[-1].calls[0]
    assert F.is_fused(fused)
    src = np.arange(n, dtype=np.float32)
    for alpha, beta in ((5.0, 2.0), (5.0, -0.0), (0.5, 3.0)):
        g.update(params={0: {"alpha": alpha}, 1: {"alpha": beta}})
        assert F.is_fused(graphs[-1].calls[0]) and graphs[-1].calls[0] is not fused
        g.replay()
        got = c.read(z)
        want = (src + np.float32(alpha)) * np.float32(beta)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (alpha, beta)


@pytest.mark.parametrize("n", [64, 1 << 15], ids=["inline", "queued"])
def test_a_failing_fused_call_names_its_kernels_and_marks_the_write_set(c, monkeypatch, n):
    def broken(prog):
        raise RuntimeError("interpreter failed")
    monkeypatch.setattr(F, "kernel", lambda: broken)
    x = c.create(np.ones(n, np.float32))
    y = c.create(np.zeros(n, np.float32))
    z = c.create(np.zeros(n, np.float32))

    def work():
        c.launch(K.add_scalar, K.grid(n), [x, y], {"alpha": 1.0, "n": n})
        c.launch(K.mul_scalar, K.grid(n), [y, z], {"alpha": 2.0, "n": n})
    c.graph_prepare()
    work()
    c.sync()
    c.start_capture()
    work()
    g = c.stop_capture()
    g.replay()
    errors = []
    for buf in (z, y, z):
        with pytest.raises(ReplayFailed) as e:
            c.read(buf)
        errors.append(e.value)
    first = errors[0]                                 # the stream's error comes with it
    assert isinstance(first, LaunchError)
    assert "add_scalar, mul_scalar (2 launches fused)" in str(first), str(first)
    assert "interpreter failed" in str(first)
    c.sync()                                          # raised once already
    c.write(x, np.ones(n, np.float32))                 # x is clean: reads of it work
    np.testing.assert_array_equal(c.read(x), np.ones(n, np.float32))


def test_a_launch_numpy_refuses_stays_unfused_and_fails_with_its_own_name(c, graphs):
    """``y`` holds 32 floats, the launch covers 64: numpy refuses to broadcast 64 into 32. That
    launch ends the run and stays an unfused call that fails with its own name. (``K.mul``
    declares ``elements="n"``, so the server would refuse it at capture: this ``mul`` is the
    same kernel without the declaration, so that it fails when it runs.)"""
    mul = runtime.Kernel("mul", K.mul.bindings, K.mul.params, K.mul.workgroup_size,
                         cpu=K.mul.cpu)
    x = c.create(np.arange(64, dtype=np.float32))
    w = c.create(np.zeros(64, np.float32))
    v = c.create(np.zeros(64, np.float32))
    y = c.create(np.zeros(32, np.float32))

    def work():
        c.launch(K.add_scalar, K.grid(64), [x, w], {"alpha": 1.0, "n": 64})
        c.launch(K.mul_scalar, K.grid(64), [w, v], {"alpha": 3.0, "n": 64})
        c.launch(mul, K.grid(64), [x, v, y], {"n": 64})
    c.graph_prepare()
    with pytest.raises(LaunchError):
        work()
        c.sync()
    c.start_capture()
    work()
    g = c.stop_capture()
    assert [F.is_fused(f) for f in graphs[-1].calls] == [True, False]
    c.write(v, np.zeros(64, np.float32))
    g.replay()
    with pytest.raises(ReplayFailed) as e:
        c.read(y)
    assert "kernel mul " in str(e.value) and "fused" not in str(e.value), str(e.value)
    with pytest.raises(ReplayFailed):                 # the whole write set is marked
        c.read(v)


def test_without_the_interpreter_a_capture_keeps_the_unfused_calls(c, graphs, monkeypatch):
    def no_numba():
        raise ImportError("no module named numba")
    monkeypatch.setattr(F, "_compile", no_numba)
    monkeypatch.setattr(F, "_kernel", None)
    monkeypatch.setitem(F.STATE, "compiled", None)
    monkeypatch.setitem(F.STATE, "error", None)
    x = c.create(np.arange(64, dtype=np.float32))
    y = c.create(np.zeros(64, np.float32))

    def work():
        c.launch(K.add_scalar, K.grid(64), [x, y], {"alpha": 1.0, "n": 64})
        c.launch(K.mul_scalar, K.grid(64), [y, x], {"alpha": -2.0, "n": 64})
    g = _capture(c, work)
    assert len(graphs[-1].calls) == 2 and not any(F.is_fused(f) for f in graphs[-1].calls)
    assert F.STATE == {"compiled": False, "error": "ImportError: no module named numba"}
    c.write(x, np.arange(64, dtype=np.float32))
    g.replay()
    np.testing.assert_array_equal(c.read(x), (np.arange(64, dtype=np.float32) + 1) * -2)


def test_the_interpreter_matches_numpy_on_special_values():
    """The check the first compile runs (it turns fusion off on a mismatch) passes here, and
    signalling NaNs and payloads move through copies, fills and one-NaN arithmetic exactly."""
    k = F.kernel()
    assert k is not None and F.STATE["compiled"], F.STATE
    for variant in k:                                 # the GIL kept and released
        F._self_check(variant)
    bits = np.array([0x7F800001, 0xFF812345, 0x7FC00007, 0x80000000, 1, 0x7F800000],
                    np.uint32)
    x = bits.view(np.float32).copy()
    y, z = np.empty_like(x), np.empty_like(x)
    F._fused_call(k, F._array_ops([("copy", y, x, None, None),
                                   ("add_scalar", z, y, None, np.float32(2)),
                                   ("mul_scalar", z, z, None, np.float32(-1))]), 3)()
    want = np.empty_like(x)
    with np.errstate(all="ignore"):
        np.multiply(np.add(x, np.float32(2)), np.float32(-1), want)
    assert np.array_equal(y.view(np.uint32), bits)
    assert np.array_equal(z.view(np.uint32), want.view(np.uint32))


def test_the_kits_programs_make_graphs_that_fuse(monkeypatch):
    """The testing kit's property programs (tests/testing/test_property_kit.py) record chains
    of pointwise launches that fuse, so its model checks fused replays too."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[2] / "testing"))
    try:
        import test_property_kit as kit
    finally:
        sys.path.pop(0)
    from runtime.testing import programs, run_program
    seen = {"fused": 0}
    real = C.fuse

    def spy(launches, calls, names):
        out = real(launches, calls, names)
        seen["fused"] += sum(F.is_fused(f) for f in out[0])
        return out
    monkeypatch.setattr(C, "fuse", spy)

    @settings(max_examples=25, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(programs(kit.THREAD_KERNELS, buffers=5, streams=2, clients=3, steps=60,
                    failures=True))
    def run(program):
        run_program(program, scheduler="thread")
    run()
    assert seen["fused"] > 0


def test_a_fork_while_the_first_fusion_compiles_leaves_the_child_able_to_fuse():
    """Only the forking thread comes along into a child: a thread compiling the interpreter at
    the fork (holding cpu_fuse's lock) left a child whose first fused capture would wait for
    that lock forever. The child fuses and replays on its own."""
    from test_fork import _run_fresh
    out = _run_fresh("""
        from runtime import kernels as K
        from runtime.backends import cpu_fuse as F
        held, go = threading.Event(), threading.Event()

        def compiling():
            with F._lock:                     # as the first fused capture does
                held.set()
                go.wait(30)
        threading.Thread(target=compiling, daemon=True).start()
        assert held.wait(30)

        def child():
            c = runtime.client("cpu")
            x = c.create(np.arange(64, dtype=np.float32))
            y = c.empty(64, np.float32)
            z = c.empty(64, np.float32)
            c.graph_prepare()
            c.start_capture()
            c.launch(K.add_scalar, K.grid(64), [x, y], {"alpha": 1.0, "n": 64})
            c.launch(K.mul_scalar, K.grid(64), [y, z], {"alpha": 2.0, "n": 64})
            g = c.stop_capture()
            g.replay()
            assert (c.read(z) == (np.arange(64) + 1) * 2).all()
            assert F.STATE["compiled"], F.STATE
        print("child", in_child(child))
        go.set()
    """)
    assert out.split() == ["child", "0"]


def test_without_a_writable_cache_the_interpreter_compiles_in_memory():
    """A read-only install with no writable cache directory: numba finds no cache locator
    (it raises at ``cache=True``), and the interpreter is compiled in memory instead."""
    import subprocess
    import sys
    script = (
        "import numba.core.caching as c\n"
        "c.CacheImpl._locator_classes = []\n"          # as where no directory is writable
        "import numpy as np\n"
        "from runtime.backends import cpu_fuse as F\n"
        "k = F.kernel()\n"
        "assert F.STATE == {'compiled': True, 'error': None}, F.STATE\n"
        "x = np.arange(8, dtype=np.float32); y = np.empty_like(x)\n"
        "F._fused_call(k, F._array_ops([('add_scalar', y, x, None, np.float32(1)),\n"
        "                               ('mul', y, y, x, None)]), 2)()\n"
        "assert (y == (x + 1) * x).all()\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-3000:]
