"""``runtime.StaticGraph``: checked signature, owned buffers on one stream, serialised calls."""

import threading

import numpy as np
import pytest

import runtime
from runtime import StaticGraph, Tensor
from runtime import kernels as K
from runtime.errors import UnknownGraph


def two_in_two_out(c, w):
    """y = gelu(x @ w + b) (returned, copied in), s = x + x (written in place by the body)."""
    def body(x, b, y, s):
        c2 = x.client
        c2.launch(K.add, K.grid(x.size), [x.handle, x.handle, s.handle], {"n": x.size})
        return {"y": x.matmul(w, b, activation="gelu")}
    return StaticGraph(c, inputs={"x": ((4, 6), "f32"), "b": ((3,), "f32")},
                       outputs={"y": ((4, 3), "f32"), "s": ((4, 6), "f32")}, body=body)


@pytest.fixture
def weights(client):
    rng = np.random.default_rng(7)
    return Tensor.from_numpy(client, rng.standard_normal((6, 3)).astype(np.float32))


def test_calls_equal_eager_across_changing_inputs(client, weights):
    g = two_in_two_out(client, weights)
    assert g.recorded and g.stream != client.stream
    assert g.signature["inputs"] == {"x": ((4, 6), "f32"), "b": ((3,), "f32")}
    rng = np.random.default_rng(3)
    for _ in range(10):
        x = rng.standard_normal((4, 6)).astype(np.float32)
        b = rng.standard_normal(3).astype(np.float32)
        out = g(x=x, b=b)
        assert set(out) == {"y", "s"} and out["y"].dtype == np.float32
        eager = Tensor.from_numpy(client, x).matmul(weights, Tensor.from_numpy(client, b),
                                                    activation="gelu").numpy()
        np.testing.assert_array_equal(out["y"], eager)
        np.testing.assert_array_equal(out["s"], x + x)
    g.release()
    with pytest.raises(UnknownGraph):
        g(x=x, b=b)


def test_wrong_shapes_dtypes_and_names_are_refused(client, weights):
    g = two_in_two_out(client, weights)
    x, b = np.ones((4, 6), np.float32), np.ones(3, np.float32)
    want = g(x=x, b=b)
    with pytest.raises(ValueError, match=r"input 'x' must have shape \(4, 6\), got \(6, 4\)"):
        g(x=x.T.copy(), b=b)
    with pytest.raises(TypeError, match="input 'x' must be f32.*float64"):
        g(x=x.astype(np.float64), b=b)
    with pytest.raises(TypeError, match="missing inputs \\['b'\\]"):
        g(x=x)
    with pytest.raises(TypeError, match="unknown inputs \\['z'\\]"):
        g(x=x, b=b, z=x)
    # a failed check writes nothing: x is still all ones
    with pytest.raises(ValueError):
        g(x=np.full((4, 6), 9, np.float32), b=np.ones(4, np.float32))
    np.testing.assert_array_equal(g.read("x"), x)
    # Python data of the right shape and kind is converted
    np.testing.assert_array_equal(g(x=x.tolist(), b=[1, 1, 1])["y"], want["y"])
    with pytest.raises(TypeError, match="must be f32"):
        g(x=x, b=["a", "b", "c"])


def test_foreign_buffers_are_refused(client, weights):
    g = two_in_two_out(client, weights)
    x, b = np.ones((4, 6), np.float32), np.ones(3, np.float32)
    g(x=x, b=b)
    foreign = Tensor.from_numpy(client, x)
    with pytest.raises(TypeError, match="device buffer.*not the graph's own"):
        g(x=foreign, b=b)
    with pytest.raises(TypeError, match="device buffer.*Handle"):
        g(x=foreign.handle, b=b)
    with pytest.raises(TypeError, match="device buffer"):
        g.write(x=foreign)
    own = g._tensors["x"]                           # the graph's own buffer: "keep it"
    np.testing.assert_array_equal(g(x=own, b=b)["s"], x + x)
    with pytest.raises(TypeError, match="not an input or state"):
        g.write(y=np.zeros((4, 3), np.float32))


def test_signature_errors(client, weights):
    def body(x, y):
        return {"y": x.gelu()}
    with pytest.raises(ValueError, match="used twice"):
        StaticGraph(client, inputs={"x": ((4,), "f32")}, outputs={"x": ((4,), "f32")}, body=body)
    with pytest.raises(TypeError, match="dtype"):
        StaticGraph(client, inputs={"x": ((4,), "f64")}, outputs={"y": ((4,), "f32")}, body=body)
    with pytest.raises(ValueError, match="at least one output"):
        StaticGraph(client, inputs={"x": ((4,), "f32")}, outputs={}, body=body)
    with pytest.raises(ValueError, match="declared"):
        StaticGraph(client, inputs={"x": ((4,), "f32")}, outputs={"y": ((5,), "f32")}, body=body)


def test_state_replay_read_and_reset(client):
    def body(inc, acc, out):
        inc.client.launch(K.accumulate, 1, [inc.handle, acc.handle], {"n": 2})
        return {"out": acc.add(inc)}
    g = StaticGraph(client, inputs={"inc": ((2,), "f32")}, outputs={"out": ((2,), "f32")},
                    state={"acc": np.array([10, 20], np.float32)}, body=body)
    np.testing.assert_array_equal(g.read("acc"), [10, 20])        # warm-up undone
    np.testing.assert_array_equal(g(inc=np.array([1, 2], np.float32))["out"], [12, 24])
    g.replay(steps=3)                                             # inputs kept: +[1, 2] x 3
    np.testing.assert_array_equal(g.read("acc"), [14, 28])
    np.testing.assert_array_equal(g.read("out"), [15, 30])
    np.testing.assert_array_equal(g.read()["out"], [15, 30])
    g.write(acc=np.zeros(2, np.float32))
    np.testing.assert_array_equal(g(inc=np.ones(2, np.float32))["out"], [2, 2])
    g.reset()
    np.testing.assert_array_equal(g.read("acc", "inc")["acc"], [10, 20])


def test_concurrent_callers_get_their_own_results(client, weights):
    g = two_in_two_out(client, weights)
    b = np.zeros(3, np.float32)
    errors = []

    def worker(k):
        try:
            for i in range(8):
                x = np.full((4, 6), k * 10 + i, np.float32)
                out = g(x=x, b=b)
                np.testing.assert_array_equal(out["s"], x + x)
                assert out["y"].shape == (4, 3)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_body_reading_to_the_host_falls_back_but_stays_checked(client):
    seen = []

    def body(x, y):
        seen.append(x.numpy().copy())       # host read: recorded graphs cannot do this
        return {"y": x.gelu()}

    g = StaticGraph(client, inputs={"x": ((3,), "f32")}, outputs={"y": ((3,), "f32")}, body=body)
    assert not g.recorded and "host" in g.fallback_reason
    for k in range(3):
        x = np.full(3, k, np.float32)
        want = Tensor.from_numpy(client, x).gelu().numpy()
        np.testing.assert_array_equal(g(x=x)["y"], want)
        np.testing.assert_array_equal(seen[-1], x)
    with pytest.raises(ValueError):
        g(x=np.zeros(4, np.float32))


def test_exported():
    assert runtime.StaticGraph is StaticGraph and "StaticGraph" in runtime.__all__
    assert "capture" in runtime.__all__ and "CapturedGraph" in runtime.__all__


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ordering_holds_under_the_interleaving_scheduler(seed):
    """Refresh, replay and read are ordered by construction: the seeded interleaving scheduler
    (which runs stream heads in a random order) and the checker find nothing to complain about."""
    c = runtime.client("cpu", scheduler="interleave", seed=seed, check=True)
    w = Tensor.from_numpy(c, np.ones((6, 3), np.float32))
    g = StaticGraph(c, inputs={"x": ((4, 6), "f32")}, outputs={"y": ((4, 3), "f32")},
                    body=lambda x, y: {"y": x.matmul(w)})
    for k in range(6):
        np.testing.assert_array_equal(g(x=np.full((4, 6), k, np.float32))["y"],
                                      np.full((4, 3), 6 * k, np.float32))
    x = Tensor.from_numpy(c, np.zeros(4, np.float32))
    cg = runtime.capture(lambda: x.add(x), client=c)
    for k in range(4):
        cg.write(x, np.full(4, k, np.float32))
        np.testing.assert_array_equal(cg.read(cg.replay()), np.full(4, 2 * k, np.float32))


def test_a_loop_graph_recovers_its_outputs_with_reset_after_a_failed_call(client):
    # ADV8: loop= records the body inside capture_while, so the graph writes its output only
    # inside the loop (it may run zero times): a failed call left the output's failure mark
    # in place across every later replay, reset and state writes included (the
    # Decoder.sequence_graph's ``next`` raised ReplayFailed for good after one bad token).
    # reset() now rewrites the outputs too; a replay that runs the loop then reads back.
    from runtime.errors import ReplayFailed, UnsupportedError
    from graph_kernels import add_i32
    from helpers import fail_write_set
    one = Tensor.from_numpy(client, np.ones(4, np.float32))

    def body(go, acc, y):
        c = go.client
        c.launch(K.accumulate, 1, [one.handle, acc.handle], {"n": 4})
        c.launch(K.copy, 1, [acc.handle, y.handle], {"n": 4})
        c.launch(add_i32, 1, [go.handle], {"delta": -1})
    try:
        g = StaticGraph(client, inputs={}, outputs={"y": ((4,), "f32")},
                        state={"go": ((1,), "i32"), "acc": np.full(4, 10, np.float32)},
                        body=body, loop="go", max_iterations=8)
    except UnsupportedError as e:
        pytest.skip(str(e))
    g.write(go=[3])
    g.replay()
    np.testing.assert_array_equal(g.read("y"), np.full(4, 13, np.float32))
    fail_write_set(g.client, g.graph)       # the graph's write set is marked failed
    with pytest.raises(ReplayFailed):
        g.read("y")
    for k in (2, 0, 3):
        g.reset()
        g.write(go=[k])
        g.replay()                          # old: ReplayFailed on every read of y
        np.testing.assert_array_equal(g.read("y"), np.full(4, 10 + k if k else 0, np.float32))
        np.testing.assert_array_equal(g.read("acc"), np.full(4, 10 + k, np.float32))


def test_a_body_that_launches_nothing_and_returns_no_outputs_is_refused():
    """USER8: ``body=lambda x, y: {}`` (or ``None``) with no launch built a fallback StaticGraph
    (fallback_reason: runtime.capture's "pass client=" hint) whose every call returned the
    outputs' initial zeros. Now a ValueError at construction saying what to do."""
    c = runtime.client("cpu")
    for result in ({}, None):
        with pytest.raises(ValueError, match=r"launched no work on the graph's stream and "
                                             r"returned no outputs.*\['y'\]"):
            StaticGraph(c, inputs={"x": ((4,), "f32")}, outputs={"y": ((4,), "f32")},
                        body=lambda x, y, r=result: r)
    g = StaticGraph(c, inputs={"x": ((4,), "f32")}, outputs={"y": ((4,), "f32")},
                    body=lambda x, y: {"y": x})                 # a copy: recorded
    assert g.recorded
    np.testing.assert_array_equal(g(x=np.arange(4, dtype=np.float32))["y"], [0, 1, 2, 3])
