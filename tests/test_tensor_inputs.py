"""runtime.Tensor refuses bad input at the call instead of computing garbage (ADV4).

Before: an ``i32`` tensor passed to an ``f32`` op (``gelu``, ``add``, ``matmul``, a
``mean_pool`` mask) was read as its bits (``gelu`` of [0..5] gave denormals), an int64 token id
past ``i32`` wrapped (2**40 -> 0), a NaN or 1e20 written to an ``i32`` tensor became -2**31,
``reshape(-2, -3)`` made a tensor of negative shape, ``reshape(-1, 0)``, ``attention(heads=0)``
and ``l2_normalize`` of a ``[2, 0]`` tensor raised ZeroDivisionError, a packed QKV width that is
not a multiple of 3 ran on the first 6 of 7 columns, ``Tensor.empty(c, 4, "f64")`` a KeyError.
Now a ``TypeError``/``ValueError`` at the call (nothing launched), or the empty result.
"""

import numpy as np
import pytest

import runtime
from runtime import Tensor
from runtime.tensor import attention, embedding


@pytest.fixture
def c():
    return runtime.client("cpu").with_stream(runtime.StreamId.new())


def test_an_op_on_a_tensor_of_the_wrong_dtype_is_a_type_error(c):
    x = Tensor.from_numpy(c, np.arange(6, dtype=np.float32))
    i = Tensor.from_numpy(c, np.arange(6, dtype=np.int32))
    w = Tensor.from_numpy(c, np.ones((3, 2), np.float32))
    for name, op in (("gelu", i.gelu), ("add", lambda: x.add(i)), ("add", lambda: i.add(x)),
                     ("matmul", lambda: i.reshape(2, 3).matmul(w)),
                     ("mean_pool", lambda: Tensor.from_numpy(c, np.ones((1, 2, 3),
                                                                        np.float32)).mean_pool(
                         Tensor.from_numpy(c, np.ones((1, 2), np.int32)))),
                     ("l2_normalize", lambda: i.reshape(2, 3).l2_normalize())):
        # the error names the Tensor op called, not only its kernel (matmul_m16; USER5)
        with pytest.raises(TypeError, match=rf"^Tensor\.{name} .*takes a f32 tensor, got i32"):
            op()
    ids = Tensor.from_numpy(c, np.zeros((1, 2), np.float32))        # ids must be i32
    tab = Tensor.from_numpy(c, np.ones((4, 4), np.float32))
    with pytest.raises(TypeError, match="i32"):
        embedding(ids, ids, tab, tab, tab)
    np.testing.assert_array_equal(x.gelu().numpy() > 0, np.arange(6) > 0)   # still works
    np.testing.assert_array_equal(i.numpy(), np.arange(6))


def test_integers_an_i32_tensor_cannot_hold_are_refused_not_wrapped(c):
    for a in (np.array([2**40, 1]), np.array([2**63], np.uint64), np.array([-2**31 - 1])):
        with pytest.raises(ValueError, match="do not fit i32"):
            Tensor.from_numpy(c, a)
    t = Tensor.from_numpy(c, np.array([7, -2**31, 2**31 - 1], np.int64))   # the edges fit
    np.testing.assert_array_equal(t.numpy(), [7, -2**31, 2**31 - 1])
    for bad in (np.full(3, np.nan), np.full(3, 1e20), np.array([2**31, 0, 0])):
        with pytest.raises(ValueError, match="i32"):
            t.write(bad)
    np.testing.assert_array_equal(t.numpy(), [7, -2**31, 2**31 - 1])   # unchanged
    t.write(np.array([1.0, 2.0, 3.0]))
    np.testing.assert_array_equal(t.numpy(), [1, 2, 3])


def test_shapes_dims_and_dtypes_are_checked_at_the_call(c):
    x = Tensor.from_numpy(c, np.arange(6, dtype=np.float32))
    for shape in ((-1, 0), (-2, -3), (-1, -1), (-1, 4)):
        with pytest.raises(ValueError, match="reshape|non-negative"):
            x.reshape(*shape)
    with pytest.raises(ValueError, match="non-negative"):
        Tensor(c, x.handle, (-2, -3))
    with pytest.raises(ValueError, match="dtype"):
        Tensor.empty(c, 4, "f64")
    np.testing.assert_array_equal(x.reshape(-1, 3).numpy(), np.arange(6).reshape(2, 3))
    packed = Tensor.from_numpy(c, np.ones((1, 2, 7), np.float32))
    mask = Tensor.from_numpy(c, np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match="3H"):
        packed.attention(mask, 1)
    qkv = Tensor.from_numpy(c, np.ones((1, 2, 6), np.float32))
    for heads in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="heads"):
            attention(qkv, qkv, qkv, mask, heads)
    with pytest.raises(ValueError, match="inner"):
        Tensor.from_numpy(c, np.ones((2, 0), np.float32)).matmul(
            Tensor.from_numpy(c, np.ones((0, 3), np.float32)))
    empty = Tensor.from_numpy(c, np.ones((2, 0), np.float32))
    assert empty.l2_normalize().numpy().shape == (2, 0)
    g = Tensor.from_numpy(c, np.ones(0, np.float32))
    assert empty.layer_norm(g, g).numpy().shape == (2, 0)


def test_a_numpy_dtype_for_a_tensor_names_the_kernel_dtype_to_pass():
    """USER8: ``Tensor.empty(c, (2, 2), np.float32)`` (PyTorch/CuPy habit) said only "Tensor
    dtype must be one of ['f32', 'i32'], got <class 'numpy.float32'>"; it now says to pass
    'f32' (and 'i32' for np.int32)."""
    c = runtime.client("cpu")
    with pytest.raises(ValueError, match=r"got <class 'numpy.float32'>: pass 'f32'"):
        runtime.Tensor.empty(c, (2, 2), np.float32)
    with pytest.raises(ValueError, match=r"got 'int32': pass 'i32'"):
        runtime.Tensor.empty(c, (2,), "int32")
    with pytest.raises(ValueError, match=r"got 'f16'$"):
        runtime.Tensor.empty(c, (2,), "f16")
    assert runtime.Tensor.empty(c, (2, 2), "f32").shape == (2, 2)
