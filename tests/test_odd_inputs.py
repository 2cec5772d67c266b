"""Odd values to public calls are typed errors at the call (ADV4, /tmp/adv4/p_fuzz.py: every
public call with None, +-2**70, 1.5, nan, inf, bytes, numpy scalars and arrays, containers).

Before: an integer param given ``inf`` (``launch``, ``Graph.update``) raised OverflowError;
``StreamId(1.5)`` named stream 1 (someone else's) and ``StreamId(inf)`` raised OverflowError;
``runtime.trace(capacity=2**70)`` raised OverflowError; ``runtime.client(max_idle_bytes=inf)``
raised OverflowError and left the backend's worker threads running (any failure after the
backend was made did).
"""

import threading

import numpy as np
import pytest

import runtime
from runtime import kernels as K


def test_an_integer_param_that_is_not_finite_is_a_value_error():
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    x = c.create(np.ones(4, np.float32))
    y = c.create(np.zeros(4, np.float32))
    for bad in (float("inf"), float("-inf"), float("nan"), np.float32("inf")):
        with pytest.raises(ValueError, match="param n"):
            c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": bad})
    c.graph_prepare()
    c.start_capture()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    g = c.stop_capture()
    with pytest.raises(ValueError, match="param n"):
        g.update(params={0: {"n": float("inf")}})
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.full(4, 2, np.float32))


def test_a_stream_id_is_made_from_an_integer_only():
    for bad in (1.5, float("inf"), "3", True, None, [1]):
        with pytest.raises(TypeError, match="StreamId takes an int"):
            runtime.StreamId(bad)
    assert runtime.StreamId(np.int64(3)) == 3 and runtime.StreamId(7) == 7
    assert runtime.StreamId(2**70) == 2**70          # a plain name, however large
    assert runtime.StreamId.new() > 0


def test_a_trace_capacity_past_what_a_ring_holds_is_a_value_error():
    with pytest.raises(ValueError, match="capacity"):
        with runtime.trace(capacity=2**70):
            pass
    with runtime.trace(capacity=8):                  # tracing was not left on
        pass


def test_a_bad_max_idle_bytes_is_a_value_error_and_leaves_no_threads():
    before = threading.active_count()
    for _ in range(3):
        with pytest.raises(ValueError, match="max_idle_bytes"):
            runtime.client("cpu", max_idle_bytes=float("inf"))
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]


def test_a_bad_runtime_backend_variable_is_named_in_the_error(monkeypatch):
    # runtime.client() with no backend reads RUNTIME_BACKEND: the error names the variable,
    # since the caller passed no name (USER5)
    monkeypatch.setenv("RUNTIME_BACKEND", "bogus")
    with pytest.raises(ValueError, match="RUNTIME_BACKEND"):
        runtime.client()


def test_an_option_the_cpu_backend_does_not_take_is_a_type_error_listing_what_it_takes():
    # as the wgpu backend's (USER5): the option named, and the ones the backend takes
    with pytest.raises(TypeError, match=r"takes no option 'threds': it takes .*threads="):
        runtime.client("cpu", threds=2)


def test_servers_of_one_device_with_other_options_have_other_names():
    # errors, thread names and trace lanes name the server: a checked server and the default
    # one of the same device must not read the same (USER5)
    plain, checked = runtime.client("cpu")._server, runtime.client("cpu", check=True)._server
    assert plain is not checked and plain.name == "runtime-cpu:0"
    assert checked.name == "runtime-cpu:0 (check=True)"


def test_a_write_of_floats_to_an_int_buffer_names_the_handle_and_the_conversion():
    """``c.write(int32_handle, float64_array)`` raised numpy's bare "Cannot cast array data from
    dtype('float64') to dtype('int32') according to the rule 'same_kind'" (no handle, nothing to
    do; USER7); a kind that casts (float64 to a float32 buffer, int64 to int32) still writes."""
    c = runtime.client("cpu")
    i = c.create(np.array([7, 7, 7], np.int32))
    with pytest.raises(TypeError, match=rf"write to handle {i.id}: float64 data does not cast to "
                                        r"the handle's int32 .*\.astype\(np\.int32\)"):
        c.write(i, np.array([1.5, 2.0, 3.0]))
    np.testing.assert_array_equal(c.read(i), [7, 7, 7])          # nothing written
    c.write(i, np.array([1, 2, 3], np.int64))
    np.testing.assert_array_equal(c.read(i), [1, 2, 3])
    f = c.create(np.zeros(2, np.float32))
    c.write(f, np.array([0.5, -2.25]))
    np.testing.assert_array_equal(c.read(f), np.array([0.5, -2.25], np.float32))


def test_an_allocation_that_fails_names_its_handle_when_a_later_call_raises_it():
    """USER8: ``c.empty(10**13, np.float32)`` returns a Handle at once and its ``OutOfMemory``
    comes from the stream's next blocking call, which said only "cpu: could not allocate
    43980465111040 bytes" (the pool's size class, not the request): not which handle, nor
    what to do. The message now names the handle, the bytes asked for and what to do."""
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    h = c.empty(10**13, np.float32)
    x = c.create(np.arange(4, dtype=np.float32))
    with pytest.raises(runtime.OutOfMemory,
                       match=rf"create/empty of handle {h.id} \(40000000000000 bytes\): cpu: could "
                             r"not allocate \d+ bytes .*release handles you no longer need"):
        c.sync()
    np.testing.assert_array_equal(c.read(x), [0, 1, 2, 3])
    with pytest.raises(runtime.InvalidHandle, match="its allocation failed"):
        c.read(h)


def test_a_kernel_without_a_cpu_body_says_what_the_cpu_backend_needs():
    """USER8: a Kernel with only a WGSL source launched on cpu failed with "kernel k has no cpu
    implementation" (the wgpu and cuda refusals name the argument to give); it now names
    ``Kernel(..., cpu=fn)`` and fn's signature."""
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    x = c.create(np.ones(4, np.float32))
    k = runtime.Kernel("only_wgsl", [("x", "f32", "read_write")], wgsl="// none")
    c.launch(k, 1, [x])
    with pytest.raises(runtime.ServerUnhealthy) as ei:
        c.sync()
    assert "has no cpu implementation; the cpu backend needs Kernel(..., cpu=fn)" in str(ei.value)


def test_a_kernel_binding_or_param_given_as_a_bare_string_is_a_type_error():
    """USER8: ``Kernel("k", ["x"], ...)`` unpacked the string letter by letter: ``"x"`` became
    a read f32 binding silently, ``"yy"`` raised "binding y has dtype 'y'", and a param ``"n"``
    a NamedTuple TypeError. Now a TypeError naming the tuple to give."""
    body = lambda *a, **k: None                          # noqa: E731
    for bindings in (["x"], ["yy"], [("x", "f32", "read", "more")], [5]):
        with pytest.raises(TypeError, match=r"each binding is a runtime\.Binding or a tuple "
                                            r"\(name, dtype, access\), e\.g\. \('x', 'f32'"):
            runtime.Kernel("k", bindings, cpu=body)
    with pytest.raises(TypeError, match=r"each param is a runtime\.Param or a tuple \(name, dtype\)"):
        runtime.Kernel("k", [("x", "f32")], params=["n"], cpu=body)
    k = runtime.Kernel("k", [("x",), runtime.Binding("y", "i32", "write")], [["n", "u32"]], cpu=body)
    assert k.bindings[0] == ("x", "f32", "read") and k.params[0] == ("n", "u32")


@pytest.mark.parametrize("backend", ["cpu", "wgpu"])
def test_a_big_endian_array_is_created_in_native_order_and_an_object_array_refused(backend):
    """USER8: ``c.create(np.arange(4, dtype=">f4"))`` kept the big-endian bytes (handle dtype
    ``>f4``) and a kernel read them as little-endian floats: ``add_scalar`` of [0, 1, 2, 3] gave
    [1, 1, 1, 1] silently (torch refuses such arrays, cupy converts). An object array raised
    numpy's "Cannot change data-type for array of references"."""
    try:
        c = runtime.client(backend).with_stream(runtime.StreamId.new())
    except runtime.UnsupportedError as e:
        pytest.skip(str(e))
    x = c.create(np.arange(4, dtype=">f4"))
    assert x.dtype == np.dtype(np.float32) and x.dtype.isnative
    y = c.empty(4, np.float32)
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    np.testing.assert_array_equal(c.read(y), [1, 2, 3, 4])
    np.testing.assert_array_equal(c.read(c.create(np.array([1, -2], dtype=">i4"))), [1, -2])
    with pytest.raises(TypeError, match=r"dtype object \(Python objects have no device layout\)"):
        c.create(np.array([object()]))


def test_a_handle_of_another_server_names_both_servers():
    """USER8: a handle of ``runtime.client("cpu")`` used by ``runtime.client("cpu", check=True)``
    said "belongs to another server (runtime-cpu:0)": the user's other client is cpu device 0
    too. The message now names both servers and why they differ."""
    a, b = runtime.client("cpu"), runtime.client("cpu", check=True)
    h = a.create(np.ones(2, np.float32))
    with pytest.raises(runtime.InvalidHandle,
                       match=r"handle \d+ belongs to another server, runtime-cpu:0; this "
                             r"client's is runtime-cpu:0 \(check=True\) .*options, e\.g\. "
                             r"check=True"):
        b.read(h)


def test_a_0d_array_or_numpy_scalar_keeps_its_shape():
    """USER8: ``c.create(np.array(3.0, np.float32))`` made a handle of shape (1,) (numpy's
    ascontiguousarray promotes 0-d) and ``c.create(np.float32(3))`` was refused ("expected a
    numpy array or bytes, got float32"); both are 0-d handles now, as ``torch.tensor(3.0)``."""
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    for data in (np.array(3.0, np.float32), np.float32(3.0)):
        h = c.create(data)
        assert h.shape == () and h.nbytes == 4
        out = c.read(h)
        assert out.shape == () and out == 3.0
    y = c.empty(1, np.float32)
    c.launch(K.add_scalar, 1, [h, y], {"alpha": 1.0, "n": 1})
    np.testing.assert_array_equal(c.read(y), [4.0])


def test_empty_of_a_tuple_without_a_dtype_is_refused():
    """USER8: ``c.empty((4,))`` (torch/cupy habit: a shape) made a 4-byte uint8 buffer, so an
    f32 launch over 4 elements failed later with "exceeds the 1 elements". ``empty(nbytes)``
    (an int) stays raw bytes, as documented; a tuple needs its dtype."""
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    for shape in ((4,), (2, 3), [4]):
        with pytest.raises(TypeError, match=r"needs a dtype: empty\(shape, np\.float32\)"):
            c.empty(shape)
    assert c.empty(4).nbytes == 4 and c.empty(np.int64(4)).dtype == np.uint8
    assert c.empty((2, 3), np.float32).nbytes == 24


def test_copy_pickle_and_deepcopy_of_device_objects():
    """USER8: ``copy.copy(handle)`` / ``copy.copy(graph)`` made a second object of the same
    buffer / graph reference whose drop freed it under the first (the next read raised
    "unknown or freed", the next replay UnknownGraph); pickle and deepcopy of a Handle, Graph,
    Tensor or client failed with "cannot pickle '_thread.lock' object". Now copy.copy shares
    (a Graph clones its reference), deepcopy of a client is the client, and the rest is a
    TypeError saying what to send instead."""
    import copy
    import gc
    import pickle

    from helpers import captured_add_one
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    x, y, g = captured_add_one(c)
    t = runtime.Tensor.from_numpy(c, np.arange(3, dtype=np.float32))
    assert copy.copy(x) is x and copy.deepcopy(c) is c and copy.copy(c).stream == c.stream
    g2, t2 = copy.copy(g), copy.copy(t)
    assert g2 is not g and g2.id == g.id
    del g2, t2
    gc.collect()
    g.replay()
    np.testing.assert_array_equal(c.read(y), [2, 2, 2, 2])
    np.testing.assert_array_equal(t.numpy(), [0, 1, 2])
    for obj, says in ((x, "client.read"), (g, "capture it again"), (t, "t.numpy()"),
                      (c, "runtime.client")):
        with pytest.raises(TypeError, match=says.replace(".", r"\.").replace("(", r"\(")
                           .replace(")", r"\)")):
            pickle.dumps(obj)
    for obj in (x, g, t):
        with pytest.raises(TypeError, match="cannot be deep-copied"):
            copy.deepcopy(obj)
