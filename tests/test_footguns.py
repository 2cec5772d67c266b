"""Known pitfalls of capture and replay, one test each, worst first (tinygrad keeps such a list).

Silent mismatches (the graph replays happily and the numbers are wrong):
  1. A new input tensor instead of an in-place refresh: the graph never sees it.
  2. Python values read by ``fn`` (scalars, shapes, params) are baked in at capture.
  3. Python side effects of ``fn`` happen at capture only, never on replay.
  4. ``replay()`` returns the same output tensor every time: the next replay overwrites it.
  5. Freeing a buffer the graph uses: the next replay raises LivenessError (the graph pins the
     buffer, so no one else gets it; with or without check=True).
  6. Refreshing an input from another stream races the replay (check=True catches it).
 11. The same unpinned client used from another thread is on that thread's stream (so 6.);
     ``c.with_stream(g.stream)`` there.
Errors raised (loud, so less bad):
  7. Reading or syncing the capturing stream inside the window.
  8. start_capture() without graph_prepare().
  9. A cpu kernel body that calls the runtime and waits (CUDA: a host function may not call
     CUDA): it raises UnsupportedError in the body instead of waiting for itself forever.
 10. ``np.asarray(handle or tensor)``: a TypeError naming the explicit copy (``client.read``,
     ``.numpy()``), as cupy and torch do, not a 0-d object array.
"""

import threading

import numpy as np
import pytest

import runtime
from runtime import Tensor
from runtime import kernels as K

from helpers import captured_add_one


@pytest.fixture
def c():
    c = runtime.client("cpu")
    c.set_stream(runtime.StreamId.new())
    return c


def test_1_a_new_input_tensor_is_not_seen_by_the_graph(c):
    x = Tensor.from_numpy(c, np.ones(4, np.float32))
    g = runtime.capture(lambda: x.add(x), client=c)
    x_new = Tensor.from_numpy(c, np.full(4, 5, np.float32))   # a different buffer ...
    np.testing.assert_array_equal(g.replay().numpy(), [2, 2, 2, 2])   # ... the graph ignores
    g.write(x, np.full(4, 5, np.float32))                    # refresh in place instead
    np.testing.assert_array_equal(g.replay().numpy(), [10, 10, 10, 10])
    del x_new


def test_2_python_values_are_baked_in_at_capture(c):
    x = c.create(np.zeros(4, np.float32))
    y = c.empty(4, np.float32)
    scale = {"alpha": 1.0}
    c.graph_prepare()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": scale["alpha"], "n": 4})
    c.start_capture()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": scale["alpha"], "n": 4})
    g = c.stop_capture()
    scale["alpha"] = 100.0                                   # too late: the graph holds 1.0
    g.replay()
    np.testing.assert_array_equal(c.read(y), [1, 1, 1, 1])


def test_3_python_side_effects_run_at_capture_only(c):
    x = Tensor.from_numpy(c, np.ones(4, np.float32))
    calls = []

    def fn():
        calls.append(1)
        return x.add(x)
    g = runtime.capture(fn, client=c, warmup=1)
    ran_at_capture = len(calls)
    for _ in range(5):
        g.replay()
    assert g.recorded and len(calls) == ran_at_capture      # replays ran no Python


def test_4_replay_overwrites_the_output_it_returned_before(c):
    x = Tensor.from_numpy(c, np.ones(4, np.float32))
    g = runtime.capture(lambda: x.add(x), client=c)
    first = g.replay()
    g.write(x, np.full(4, 3, np.float32))
    second = g.replay()
    assert first is second                                   # one output buffer
    np.testing.assert_array_equal(first.numpy(), [6, 6, 6, 6])   # "first" changed too


def test_5_freeing_a_captured_buffer_is_caught_with_or_without_check():
    c = runtime.client("cpu", seed=5)
    x, y, g = captured_add_one(c)
    hid = x.id
    del x                                                    # its buffer goes back to the pool
    with pytest.raises(runtime.LivenessError, match=f"handle {hid}"):
        g.replay()
    c.shutdown()


def test_6_a_refresh_from_another_stream_races_the_replay_and_check_says_so():
    c = runtime.client("cpu", check=True, scheduler="interleave", seed=6)
    x, y, g = captured_add_one(c)
    other = c.with_stream(runtime.StreamId.new())
    other.write(x, np.full(4, 9, np.float32))                # not the capture stream
    with pytest.raises(runtime.StreamRaceError):
        g.replay()
        c.read(y)
    c.shutdown()


def test_7_reading_the_capturing_stream_is_refused(c):
    x = c.create(np.ones(4, np.float32))
    c.graph_prepare()
    c.start_capture()
    with pytest.raises(runtime.CaptureRefused):
        c.read(x)
    with pytest.raises(runtime.CaptureRefused, match="first refused operation: read"):
        c.stop_capture()                          # the refusal invalidated the window


def test_8_start_capture_needs_graph_prepare(c):
    with pytest.raises(runtime.GraphStateError, match="graph_prepare"):
        c.start_capture()


def _blocking_body(c, where, other=None, ready=None):
    """A cpu kernel whose body blocks on ``c``'s stream (``where`` = "sync" or "read"), or
    syncs client ``other`` (another stream) when given, once ``ready`` (a threading.Event,
    when given) is set."""
    from runtime import Kernel
    from runtime.kernel import Binding

    def body(y, *, count):
        if ready is not None:
            ready.wait(10)
        if other is not None:
            other.sync()
        elif where == "sync":
            c.sync()
        else:
            c.read(c._blocked_on)
    return Kernel(f"blocks_{where}", [Binding("y", "f32", "read_write")], cpu=body)


def _raising_kernel():
    from runtime import Kernel
    from runtime.kernel import Binding

    def body(y, *, count):
        raise ValueError("raised on purpose")
    return Kernel("raises_first", [Binding("y", "f32", "read_write")], cpu=body)


@pytest.mark.parametrize("path", ["helper", "worker", "replay"])
@pytest.mark.parametrize("where", ["sync", "read"])
def test_9_a_kernel_body_that_waits_for_its_own_stream_raises_instead_of_hanging(path, where):
    """Before: the body's sync/read waited for the completion of the work it is part of, and
    the stream (and every caller after it) hung forever. Each path a body runs on: the waiter
    helping its stream (a sync runs the queued body), a worker (the body ran before the sync),
    a graph replay's body. An error queued before the body is not lost: the refusal comes
    before the body's call takes the stream's errors."""
    import time
    c = runtime.client("cpu")
    c.set_stream(runtime.StreamId.new())
    x = c.create(np.zeros(1 << 18, np.float32))      # 1 MiB: past the fast paths' sizes
    c._blocked_on = c.create(np.zeros(4, np.float32))
    k = _blocking_body(c, where)
    if path == "replay":
        c.graph_prepare()
        c.start_capture()
        c.launch(k, (1, 1, 1), [x])
        g = c.stop_capture()
        c.launch(_raising_kernel(), (1, 1, 1), [c._blocked_on])    # a failure queued before
        g.replay()
    else:
        c.launch(_raising_kernel(), (1, 1, 1), [c._blocked_on])
        c.launch(k, (1, 1, 1), [x])
    if path == "worker":
        time.sleep(0.3)                               # a worker runs it (and it gives up)
    with pytest.raises(runtime.ServerError) as info:
        c.sync()
    text = str(info.value)
    assert "kernel body on its own stream" in text and "blocks_" in text, text
    assert "raises_first" in text, text                       # the earlier failure, raised with it
    c.write(x, np.ones(1 << 18, np.float32))          # the stream goes on
    np.testing.assert_array_equal(c.read(x)[:4], np.ones(4, np.float32))


def test_9_a_kernel_body_waiting_for_a_stream_that_waits_for_it_raises_after_a_poll():
    """A cycle through another stream (the body syncs stream B, B waits for an event recorded
    after the body): the body's wait gives up after one poll interval (``in_kernel``) with
    UnsupportedError instead of hanging both streams."""
    a = runtime.client("cpu")
    a.set_stream(runtime.StreamId.new())
    b = a.with_stream(runtime.StreamId.new())
    x = a.create(np.zeros(1 << 18, np.float32))
    issued = threading.Event()          # a worker may start the body at once: it syncs B only
    a.launch(_blocking_body(a, "sync", other=b, ready=issued), (1, 1, 1), [x])
    b.wait_event(a.record_event())
    issued.set()                        # ... once B waits for the event after it (the cycle)
    with pytest.raises(runtime.ServerError) as info:
        a.sync()
    assert "from inside a cpu kernel body" in str(info.value), str(info.value)
    b.sync()                                          # both streams go on
    a.write(x, np.ones(1 << 18, np.float32))
    np.testing.assert_array_equal(a.read(x)[:4], np.ones(4, np.float32))


def test_10_numpy_does_not_silently_wrap_a_handle_or_tensor(c):
    # np.asarray(handle) used to return a 0-d object array holding the handle (no error, no
    # data); cupy and torch refuse implicit device-to-host conversion with a TypeError too
    h = c.create(np.arange(4, dtype=np.float32))
    t = Tensor.from_numpy(c, np.ones((2, 2), np.float32))
    for obj, hint in ((h, "client.read"), (t, ".numpy()")):
        with pytest.raises(TypeError, match=hint.replace(".", r"\.").replace("(", r"\(")
                           .replace(")", r"\)")):
            np.asarray(obj)
        with pytest.raises(TypeError):
            np.array([obj, obj])
    with pytest.raises(TypeError):
        Tensor.from_numpy(c, t)                  # a tensor is not host data either
    np.testing.assert_array_equal(c.read(h), [0, 1, 2, 3])      # the explicit copies work
    np.testing.assert_array_equal(t.numpy(), np.ones((2, 2)))


def test_11_an_unpinned_client_in_another_thread_uses_that_threads_stream():
    """USER8: the README's Use example refreshes and reads "on the capture stream"; the same
    client object used from a worker thread (the usual PyTorch habit: capture in main, serve in
    a thread) works on the worker's own stream, so ``c.write``/``c.read`` there race the replay
    (19 of 20 reads stale without check; check=True raises). Pinned to the graph's stream
    (``c.with_stream(g.stream)``), as the README now says, the worker gets the right values."""
    c = runtime.client("cpu", check=True, scheduler="interleave", seed=11)
    x, y, g = captured_add_one(c)
    out = {}

    def racy():
        try:
            c.write(x, np.full(4, 9, np.float32))               # the worker's stream
            g.replay()
            out["racy"] = c.read(y)
        except runtime.StreamRaceError as e:
            out["racy"] = e

    def pinned():
        w = c.with_stream(g.stream)
        for i in range(3):
            w.write(x, np.full(4, i, np.float32))
            g.replay()
            out.setdefault("pinned", []).append(w.read(y).tolist())

    for fn in (racy, pinned):
        th = threading.Thread(target=fn)
        th.start()
        th.join(60)
        assert not th.is_alive()
    assert isinstance(out["racy"], runtime.StreamRaceError), out
    assert out["pinned"] == [[1.0] * 4, [2.0] * 4, [3.0] * 4]
    c.shutdown()
