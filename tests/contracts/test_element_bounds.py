"""A kernel's declared element count (``Kernel(elements=...)``, set by every ``elementwise``
kernel) is checked against the bound buffers: a launch whose ``n`` exceeds a handle's element
count is refused with a ``LaunchError`` (eagerly, inside a capture window, and in
``Graph.update(params=...)``), never clamped (cpu numpy slicing, wgpu robust buffer access) or
run out of bounds (cuda). The check is the server's (``h_launch``), so it covers every backend.
"""

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import LaunchError, ReplayFailed

from graph_kernels import capture

N = 4


def _xy(c, n=N):
    x = c.create(np.arange(n, dtype=np.float32))
    y = c.create(np.full(n, 7, np.float32))
    return x, y


def test_eager_launch_past_the_buffer_is_refused_and_marks_the_output(client):
    x, y = _xy(client)
    client.launch(K.add_scalar, K.grid(400), [x, y], {"alpha": 1.0, "n": 400})
    with pytest.raises(LaunchError) as info:
        client.sync()
    msg = str(info.value)
    assert "add_scalar" in msg and "n=400" in msg and "4 elements" in msg and str(x.id) in msg
    with pytest.raises(ReplayFailed):               # the write it would have done: marked
        client.read(y)
    np.testing.assert_array_equal(client.read(x), np.arange(N, dtype=np.float32))  # input: clean
    # the server keeps going: a good launch clears y's mark (a write binding, clean input)
    client.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
    np.testing.assert_array_equal(client.read(y), np.arange(N, dtype=np.float32) + 1)


def test_a_short_output_is_refused_too(client):
    x = client.create(np.arange(8, dtype=np.float32))
    y = client.create(np.zeros(4, np.float32))
    client.launch(K.copy, K.grid(8), [x, y], {"n": 8})
    with pytest.raises(LaunchError, match=r"copy: param n=8 exceeds the 4 elements"):
        client.sync()
    with pytest.raises(ReplayFailed):
        client.read(y)


@pytest.mark.parametrize("n", [N, 3, 0])
def test_n_equal_to_or_below_the_element_count_runs_against_numpy(client, n):
    x, y = _xy(client)
    client.launch(K.add_scalar, K.grid(max(n, 1)), [x, y], {"alpha": 1.0, "n": n})
    ref = np.full(N, 7, np.float32)
    ref[:n] = np.arange(n, dtype=np.float32) + 1
    np.testing.assert_array_equal(client.read(y), ref)


def test_a_buffer_larger_than_n_runs_against_numpy(client):
    a = client.create(np.arange(10, dtype=np.float32))
    b = client.create(np.full(6, 2, np.float32))
    out = client.create(np.zeros(8, np.float32))
    client.launch(K.mul, K.grid(6), [a, b, out], {"n": 6})
    ref = np.zeros(8, np.float32)
    ref[:6] = np.arange(6, dtype=np.float32) * 2
    np.testing.assert_array_equal(client.read(out), ref)


def test_a_launch_past_the_buffer_inside_capture_refuses_the_window(client):
    x, y = _xy(client)
    with pytest.raises(runtime.CaptureRefused) as info:
        capture(client, lambda: client.launch(K.add_scalar, K.grid(400), [x, y],
                                              {"alpha": 1.0, "n": 400}), warmup=False)
    assert "n=400" in str(info.value) and "4 elements" in str(info.value)
    # nothing ran; the stream and the buffers are usable; an in-bounds capture works
    np.testing.assert_array_equal(client.read(y), np.full(N, 7, np.float32))
    g = capture(client, lambda: client.launch(K.add_scalar, K.grid(N), [x, y],
                                              {"alpha": 2.0, "n": N}))
    g.replay()
    np.testing.assert_array_equal(client.read(y), np.arange(N, dtype=np.float32) + 2)


def test_graph_update_params_past_the_buffer_is_a_value_error_and_changes_nothing(client):
    x, y = _xy(client)
    g = capture(client, lambda: client.launch(K.add_scalar, K.grid(N), [x, y],
                                              {"alpha": 1.0, "n": N}))
    with pytest.raises(ValueError, match=r"n=400 exceeds the 4 elements"):
        g.update(params={0: {"n": 400}})
    with pytest.raises(ValueError, match=r"n=5 exceeds"):
        g.update(params={0: {"alpha": 3.0, "n": 5}})
    assert g.launches()[0]["params"] == {"alpha": 1.0, "n": N}     # nothing changed
    g.replay()
    np.testing.assert_array_equal(client.read(y), np.arange(N, dtype=np.float32) + 1)
    g.update(params={0: {"alpha": 3.0, "n": 2}})                    # smaller: still works
    g.replay()
    np.testing.assert_array_equal(client.read(y), np.array([3, 4, 3, 4], np.float32))


def test_add_bias_checks_x_and_out_against_n_and_the_bias_against_n_of_a_row(client):
    x = client.create(np.arange(6, dtype=np.float32))
    b = client.create(np.array([10, 20, 30], np.float32))          # N = 3: fewer than n
    out = client.create(np.zeros(6, np.float32))
    client.launch(K.add_bias, K.grid(6), [x, b, out], {"N": 3, "n": 6})
    np.testing.assert_array_equal(client.read(out), np.arange(6, dtype=np.float32)
                                  + np.tile([10, 20, 30], 2).astype(np.float32))
    client.launch(K.add_bias, K.grid(7), [x, b, out], {"N": 3, "n": 7})
    with pytest.raises(LaunchError, match=r"add_bias: param n=7 exceeds the 6 elements"):
        client.sync()
    short = client.create(np.array([10, 20], np.float32))          # N = 3: one short
    client.launch(K.add_bias, K.grid(6), [x, short, out], {"N": 3, "n": 6})
    with pytest.raises(LaunchError, match=r"param N=3 exceeds the 2 elements \(f32\) of binding b"):
        client.sync()                   # (cpu read b[2] past its end, wgpu clamped: no error)
    with pytest.raises(ReplayFailed):
        client.read(out)


def test_elements_must_name_an_integer_param_and_a_binding():
    with pytest.raises(ValueError, match="integer params"):
        runtime.Kernel("k", [("y", "f32", "write")], [("alpha", "f32")], cpu=print,
                       elements="alpha")
    with pytest.raises(ValueError, match="binding 'z'"):
        runtime.Kernel("k", [("y", "f32", "write")], [("n", "u32")], cpu=print,
                       elements={"z": "n"})
    k = runtime.Kernel("k", [("y", "f32", "write")], [("n", "u32")], cpu=print, elements="n")
    assert k.elements_error((4,), [16]) is None and "n=5" in k.elements_error((5,), [16])


#: kernels whose buffers hold a product of params: (kernel, params, [(binding, elements)] of a
#: launch that fits, the binding to shrink by one row, the message's product)
PRODUCTS = {
    "matmul a": (K.matmul, {"M": 3, "N": 2, "K": 4}, [12, 8, 6], 0, "M*K = 12"),
    "matmul w": (K.matmul, {"M": 3, "N": 2, "K": 4}, [12, 8, 6], 1, "K*N = 8"),
    "matmul out": (K.matmul, {"M": 3, "N": 2, "K": 4}, [12, 8, 6], 2, "M*N = 6"),
    "matmul_bias bias": (K.matmul_bias, {"M": 3, "N": 2, "K": 4}, [12, 8, 2, 6], 2, "N=2"),
    "layer_norm x": (K.layer_norm, {"rows": 3, "n": 4, "eps": 1e-5}, [12, 4, 4, 12], 0,
                     "rows*n = 12"),
    "add_layer_norm res": (K.add_layer_norm, {"rows": 3, "n": 4, "eps": 1e-5}, [12, 12, 4, 4, 12],
                           1, "rows*n = 12"),
    "l2_normalize out": (K.l2_normalize, {"rows": 3, "n": 4}, [12, 12], 1, "rows*n = 12"),
}


@pytest.mark.parametrize("case", list(PRODUCTS))
def test_a_buffer_shorter_than_a_product_of_params_is_refused(client, case):
    """A matmul's ``a`` holds ``M*K`` elements, a layer norm's rows ``rows*n``: one element
    short, the GPU read clamped (wgpu) or out of bounds (cuda) values while cpu raised; now the
    server refuses the launch on every backend (``LaunchError`` naming the product) and marks
    its output; the same launch with the full buffer matches numpy."""
    kernel, params, sizes, short, what = PRODUCTS[case]
    rng = np.random.default_rng(3)
    vals = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    bufs = [client.create(v[:-1] if i == short else v) for i, v in enumerate(vals)]
    count = (4, 4, 1)
    client.launch(kernel, count, bufs, params)
    with pytest.raises(LaunchError, match=what.replace("*", r"\*")):
        client.sync()
    with pytest.raises(ReplayFailed):
        client.read(bufs[-1])
    full = [client.create(v) for v in vals]
    if kernel is K.matmul:
        count = K.nn.matmul_count(params["M"], params["N"])
        client.launch(kernel, count, full, params)
        a, w = vals[0].reshape(3, 4), vals[1].reshape(4, 2)
        np.testing.assert_allclose(client.read(full[-1]), (a @ w).reshape(-1), rtol=1e-5)


def test_graph_update_of_a_matmul_past_its_buffers_is_a_value_error(client):
    rng = np.random.default_rng(5)
    a, w = rng.standard_normal(12).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    ha, hw, ho = client.create(a), client.create(w), client.create(np.zeros(6, np.float32))
    count = K.nn.matmul_count(3, 2)
    g = capture(client, lambda: client.launch(K.matmul, count, [ha, hw, ho],
                                              {"M": 3, "N": 2, "K": 4}))
    with pytest.raises(ValueError, match=r"M\*K = 16"):
        g.update(params={0: {"M": 4}})
    g.replay()                                  # unchanged: the old params
    np.testing.assert_allclose(client.read(ho), (a.reshape(3, 4) @ w.reshape(4, 2)).reshape(-1),
                               rtol=1e-5)
