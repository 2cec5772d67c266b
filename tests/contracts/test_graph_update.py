"""Graphs that change without recapture (issue 27 item 1; docs/contract.md section 4b):
``Graph.launches()``, ``update(rebind=, params=, count=)``, ``instantiate(rebind=)`` on every
backend, checked against numpy; and ``describe()`` / ``str`` / ``to_dot()`` (issue 28 item 2).
"""

import json
import threading

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import InvalidHandle, LivenessError, UnknownGraph

from graph_kernels import capture


def _axpy_graph(c, n=4, alpha=1.0):
    """``y = x + alpha`` over ``n`` floats, captured: ``(x, y, graph)``."""
    x = c.create(np.arange(n, dtype=np.float32))
    y = c.create(np.zeros(n, np.float32))
    g = capture(c, lambda: c.launch(K.add_scalar, K.grid(n), [x, y], {"alpha": alpha, "n": n}))
    return x, y, g


def test_launches_are_plain_data_of_what_was_recorded(client):
    x, y, g = _axpy_graph(client, 4, 1.5)
    out = client.empty(4, np.float32)
    g2 = capture(client, lambda: (
        client.launch(K.add_scalar, 1, [x, y], {"alpha": 1.5, "n": 4}),
        client.launch(K.mul, (1, 1, 1), [x, y, out], {"n": 4})))
    ls = g2.launches()
    json.dumps(ls)                                   # plain data
    assert [ln["kernel"] for ln in ls] == ["add_scalar", "mul"]
    assert ls[0]["params"] == {"alpha": 1.5, "n": 4} and ls[0]["count"] == [1, 1, 1]
    assert [(b["name"], b["access"], b["handle"], b["nbytes"]) for b in ls[1]["bindings"]] == [
        ("a", "read", x.id, 16), ("b", "read", y.id, 16), ("out", "write", out.id, 16)]
    assert all(ln["scope"] == [] for ln in ls)
    assert len(g.launches()) == 1


def test_update_params_and_count_against_numpy(client):
    n = 256                                           # 4 workgroups of 64
    x = client.create(np.arange(n, dtype=np.float32))
    y = client.create(np.zeros(n, np.float32))
    g = capture(client, lambda: client.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": n}))
    g.replay()
    ref = np.zeros(n, np.float32)
    ref[:64] = np.arange(64) + 1
    np.testing.assert_array_equal(client.read(y), ref)
    g.update(params={0: {"alpha": 5.0}}, count={0: (4, 1, 1)})
    g.replay()
    np.testing.assert_array_equal(client.read(y), np.arange(n, dtype=np.float32) + 5)
    assert g.launches()[0]["params"]["alpha"] == 5.0 and g.launches()[0]["count"] == [4, 1, 1]


def test_rebind_inputs_and_outputs_against_numpy(client):
    x, y, g = _axpy_graph(client)
    x2 = client.create(np.full(4, 10, np.float32))
    y2 = client.create(np.zeros(4, np.float32))
    g.update(rebind={x: x2, y: y2})
    client.write(y, np.full(4, -1, np.float32))
    g.replay()
    np.testing.assert_array_equal(client.read(y2), [11, 11, 11, 11])
    np.testing.assert_array_equal(client.read(y), [-1, -1, -1, -1])     # no longer written
    d = g.describe()
    assert d["writes"] == [y2.id] and set(d["reads"]) == {x2.id, y2.id}
    client.write(x2, np.arange(4, dtype=np.float32))                    # refresh the new input
    g.replay()
    np.testing.assert_array_equal(client.read(y2), [1, 2, 3, 4])


def test_update_errors_change_nothing(client):
    x, y, g = _axpy_graph(client)
    other = client.create(np.zeros(4, np.float32))
    cases = [
        dict(rebind={y: client.empty(8, np.float32)}),                  # nbytes
        dict(rebind={y: client.empty(4, np.int32)}),                    # dtype
        dict(rebind={other: client.empty(4, np.float32)}),              # not used by the graph
        dict(params={1: {"alpha": 2.0}}),                               # index out of range
        dict(params={0: {"beta": 2.0}}),                                # unknown param
        dict(count={3: (1, 1, 1)}),
        # all or nothing: a valid change with an invalid one
        dict(params={0: {"alpha": 7.0}}, rebind={y: client.empty(8, np.float32)}),
        dict(params={0: {"alpha": 7.0}}, count={0: (-1, 1, 1)}),
        dict(rebind={x: y}),                     # y bound read and read_write in one launch
    ]
    for kw in cases:
        with pytest.raises(ValueError):
            g.update(**kw)
    with pytest.raises(TypeError):
        g.update(rebind={y.id: other.id})
    for bad in ("x", None, [1]):             # not a number: the TypeError launch() raises
        with pytest.raises(TypeError, match="must be a number"):
            g.update(params={0: {"alpha": bad}})
    g.replay()
    np.testing.assert_array_equal(client.read(y), [1, 2, 3, 4])
    assert g.launches()[0]["params"]["alpha"] == 1.0
    released = client.empty(4, np.float32)
    released.release()
    with pytest.raises(InvalidHandle):
        g.update(rebind={y: released})
    g.release()
    with pytest.raises(UnknownGraph):
        g.update(params={0: {"alpha": 2.0}})


def test_instantiate_gives_an_independent_graph(client):
    x, y, g = _axpy_graph(client)
    x2 = client.create(np.full(4, 100, np.float32))
    y2 = client.create(np.zeros(4, np.float32))
    g2 = g.instantiate(rebind={x: x2, y: y2})
    assert g2.id != g.id and g2.stream == g.stream
    g.replay()
    g2.replay()
    np.testing.assert_array_equal(client.read(y), [1, 2, 3, 4])
    np.testing.assert_array_equal(client.read(y2), [101, 101, 101, 101])
    g.update(params={0: {"alpha": 2.0}})              # the instance keeps its own params
    g.release()
    client.write(x2, np.full(4, 1, np.float32))
    g2.replay()
    np.testing.assert_array_equal(client.read(y2), [2, 2, 2, 2])
    assert g2.launches()[0]["params"]["alpha"] == 1.0


def test_instantiate_on_another_stream(client):
    x, y, g = _axpy_graph(client)
    s2 = runtime.StreamId.new()
    c2 = client.with_stream(s2)
    x2 = c2.create(np.full(4, 3, np.float32))
    y2 = c2.create(np.zeros(4, np.float32))
    g2 = g.instantiate(rebind={x: x2, y: y2}, stream=s2)
    assert g2.stream == s2
    g2.replay()
    np.testing.assert_array_equal(c2.read(y2), [4, 4, 4, 4])


def test_liveness_follows_the_new_bindings(client):
    x, y, g = _axpy_graph(client)
    y2 = client.create(np.zeros(4, np.float32))
    g.update(rebind={y: y2})
    y.release()                                       # no longer used: the graph does not care
    g.replay()
    np.testing.assert_array_equal(client.read(y2), [1, 2, 3, 4])
    y2.release()                                      # used now: the next replay refuses
    with pytest.raises(LivenessError):
        g.replay()


def test_rebind_orders_after_the_new_buffers_pending_writes(client):
    """The new input was written on another stream: the next replay waits for that write (the
    fences of the new bindings), as a launch would."""
    x, y, g = _axpy_graph(client, 1 << 14)
    other = client.with_stream(runtime.StreamId.new())
    for k in range(3):
        x2 = other.create(np.full(1 << 14, 7 + k, np.float32))       # on the other stream
        g.update(rebind={x: x2})
        g.replay()
        np.testing.assert_array_equal(client.read(y), np.full(1 << 14, 8 + k, np.float32))
        g.update(rebind={x2: x})


def test_update_never_races_a_replay_in_flight(client):
    """One thread replays ``y += x`` in a loop while this one rebinds ``y`` to ``y2``: every
    replay lands whole in exactly one of them (an update takes effect in queue order)."""
    n, reps = 1024, 60
    x = client.create(np.ones(n, np.float32))
    y = client.create(np.zeros(n, np.float32))
    y2 = client.create(np.zeros(n, np.float32))
    g = capture(client, lambda: client.launch(K.accumulate, K.grid(n), [x, y], {"n": n}),
                warmup=False)
    started = threading.Event()

    def replays():
        for i in range(reps):
            g.replay()
            if i == 5:
                started.set()
    t = threading.Thread(target=replays)
    t.start()
    started.wait(30)
    g.update(rebind={y: y2})
    t.join(60)
    a, b = client.read(y), client.read(y2)
    np.testing.assert_array_equal(a + b, np.full(n, reps, np.float32))
    assert len(set(a.tolist())) == 1 and len(set(b.tolist())) == 1   # never torn
    assert a[0] >= 6


def test_describe_str_and_dot(client):
    x, y, g = _axpy_graph(client)
    d = g.describe()
    json.dumps(d)
    assert d["id"] == g.id and d["stream"] == int(g.stream) and d["backend"] == client.backend
    assert d["hardware"] == g.is_hardware
    assert [b["buffer"] for b in d["buffers"]] == ["b0", "b1"]
    assert [b["handle"] for b in d["buffers"]] == [x.id, y.id]
    assert d["buffers"][1]["access"] == "read_write" and d["buffers"][0]["dtype"] == "f32"
    assert d["writes"] == [y.id] and d["retained"] >= 2
    assert d["retained_bytes"] >= 32
    text = str(g)
    assert "add_scalar" in text and "x=b0:r" in text and "y=b1:w" in text
    # x and y are caller-owned: the graph pins them (out of the pool) but does not keep them
    # alive (freeing x makes a replay raise LivenessError), so the header must not say
    # "retained", the word of stop_capture(retain=True) (USER5)
    assert f"{d['retained']} buffers pinned ({d['retained_bytes']} B)" in text.splitlines()[0]
    assert "retained" not in text.splitlines()[0], text
    assert g.info()["pinned"] == d["retained"] and g.info()["retained"] == 0
    dot = g.to_dot()
    assert dot.startswith("digraph") and '"0: add_scalar' in dot and "b0 -> L0" in dot


def _same_recording(c):
    """The same three-launch recording over 8 floats: ``(graph, (x, t, y))`` (keep the
    buffers alive while the graph replays)."""
    x = c.create(np.arange(8, dtype=np.float32))
    t = c.create(np.zeros(8, np.float32))
    y = c.create(np.zeros(8, np.float32))

    def work():
        c.launch(K.add_scalar, 1, [x, t], {"alpha": 2.0, "n": 8})
        c.launch(K.mul, 1, [x, t, y], {"n": 8})
        c.launch(K.accumulate, 1, [t, y], {"n": 8})
    return capture(c, work), (x, t, y)


def test_describe_and_dot_match_across_backends():
    """Issue 28 item 2: the same recording describes and prints the same on cpu and wgpu
    (ids, stream and backend aside)."""
    from runtime.testing import backend_unavailable

    if backend_unavailable("wgpu"):
        pytest.skip(backend_unavailable("wgpu"))
    graphs = {b: _same_recording(runtime.client(b).with_stream(runtime.StreamId.new()))[0]
              for b in ("cpu", "wgpu")}

    def norm(d):
        d = json.loads(json.dumps(d))
        for k in ("id", "stream", "backend", "reads", "writes"):
            d.pop(k)
        for ln in d["launches"]:
            for b in ln["bindings"]:
                b.pop("handle")
        for b in d["buffers"]:
            b.pop("handle")
        return d
    a, b = (graphs[k].describe() for k in ("cpu", "wgpu"))
    assert norm(a) == norm(b)
    assert graphs["cpu"].to_dot() == graphs["wgpu"].to_dot()
    assert str(graphs["cpu"]).splitlines()[1:] == str(graphs["wgpu"]).splitlines()[1:]


@pytest.mark.parametrize("seed", range(8))
def test_rebind_fences_under_the_interleaving_scheduler(seed):
    """The same ordering, checked deterministically: the interleaving scheduler runs stream
    heads in a seeded random order, so a replay not ordered after the new input's write on
    another stream reads stale data for some seed."""
    from runtime.backends.cpu import InterleavingScheduler

    # a scheduler object gives a server of its own (a printed program's
    # runtime.client("cpu", scheduler="interleave", seed=s) must not meet this one)
    c = runtime.client("cpu", scheduler=InterleavingScheduler(seed)).with_stream(
        runtime.StreamId.new())
    try:
        x, y, g = _axpy_graph(c, 64)
        other = c.with_stream(runtime.StreamId.new())
        x2 = other.create(np.zeros(64, np.float32))
        other.sync()
        other.write(x2, np.full(64, 41, np.float32))
        g.update(rebind={x: x2})
        g.replay()
        np.testing.assert_array_equal(c.read(y), np.full(64, 42, np.float32))
    finally:
        c.shutdown()


def test_wgpu_update_rebuilds_only_the_changed_bind_groups():
    """wgpu patches its software graph: an update of one launch of three creates one bind
    group (that launch's), and the replay uses it (issue 27 item 1)."""
    from runtime.testing import backend_unavailable

    if backend_unavailable("wgpu"):
        pytest.skip(backend_unavailable("wgpu"))
    c = runtime.client("wgpu").with_stream(runtime.StreamId.new())
    g, (x, t, y) = _same_recording(c)
    be = c._server.backend               # private: count the wgpu bind groups made
    made = []
    real = be.dev.create_bind_group

    def counting(**kw):
        made.append(kw)
        return real(**kw)
    be.dev.create_bind_group = counting
    try:
        g.update(params={0: {"alpha": 3.0}})
    finally:
        del be.dev.create_bind_group
    assert len(made) == 1
    g.replay()
    xs = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(c.read(y), xs * (xs + 3) + (xs + 3))


def test_update_and_instantiate_refused_while_the_stream_captures(client):
    from runtime.errors import CaptureRefused

    x, y, g = _axpy_graph(client)
    client.graph_prepare()
    client.start_capture()
    with pytest.raises(CaptureRefused):
        g.update(params={0: {"alpha": 2.0}})
    with pytest.raises(CaptureRefused):
        g.instantiate()
    client.abort_capture()
    g.replay()
    np.testing.assert_array_equal(client.read(y), [1, 2, 3, 4])


def test_fallback_reason_says_why_the_last_update_rebuilt_and_clears_after_a_patch(monkeypatch):
    """``fallback_reason`` belongs to the last update: set when it rebuilt the graph (here the
    cpu backend is made to refuse the patch once, as cuda does for a launch it cannot patch),
    None again after one that patched in place; the values follow numpy either way."""
    from runtime.backends.cpu import CpuBackend
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    x, y, g = _axpy_graph(c)
    patch = CpuBackend.update_graph
    monkeypatch.setattr(CpuBackend, "update_graph", lambda self, *a: None)
    g.update(params={0: {"alpha": 2.0}})
    assert g.fallback_reason and "rebuilt" in g.fallback_reason
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.arange(4, dtype=np.float32) + 2)
    monkeypatch.setattr(CpuBackend, "update_graph", patch)
    g.update(params={0: {"alpha": 3.0}})
    assert g.fallback_reason is None
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.arange(4, dtype=np.float32) + 3)


def test_an_update_to_negative_zero_is_an_update(client):
    # -0.0 == 0.0 in Python, but x * -0.0 is -0.0: an update from alpha=0.0 to -0.0 (and
    # back) changes what the graph computes, so it must not be taken for "no change"
    n = 8
    x = client.create(np.arange(1, n + 1, dtype=np.float32))
    y = client.create(np.ones(n, np.float32))
    g = capture(client, lambda: client.launch(K.mul_scalar, K.grid(n), [x, y],
                                              {"alpha": 0.0, "n": n}))
    for alpha in (0.0, -0.0, 0.0, -0.0):
        g.update(params={0: {"alpha": alpha}})
        g.replay()
        got = client.read(y)
        want = np.arange(1, n + 1, dtype=np.float32) * np.float32(alpha)
        np.testing.assert_array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want)), alpha


def test_an_f32_param_past_float32s_range_is_inf_on_every_backend(client):
    """alpha=1e40 rounds to +inf in float32, as numpy (the cpu backend) computes it. wgpu
    packed params with struct, which raised OverflowError: an eager launch queued a
    LaunchError, and Graph.update raised the raw OverflowError (neither the ValueError of a
    bad value nor a ServerError; found by ADV2). A program behaves the same everywhere."""
    x = client.create(np.arange(4, dtype=np.float32))
    y = client.create(np.zeros(4, np.float32))
    with np.errstate(over="ignore"):
        client.launch(K.mul_scalar, 1, [x, y], {"alpha": 1e40, "n": 4})
        np.testing.assert_array_equal(client.read(y), [np.nan, np.inf, np.inf, np.inf])
        g = capture(client, lambda: client.launch(K.mul_scalar, 1, [x, y],
                                                  {"alpha": 2.0, "n": 4}))
        g.update(params={0: {"alpha": -1e40}})
        g.replay()
        np.testing.assert_array_equal(client.read(y), [np.nan, -np.inf, -np.inf, -np.inf])
