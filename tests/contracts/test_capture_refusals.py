"""A capture never silently lacks work the caller ordered into it (issue 23 item 2).

CUDA's rule (``cudaErrorStreamCaptureInvalidated``): any operation refused inside a capture
window invalidates it. ``read``, ``sync``, ``replay``, ``record_event`` and ``wait_event`` on the
capturing stream raise ``CaptureRefused`` at once, and so does a refused launch at
``stop_capture``; even when the caller catches the refusal and goes on, ``stop_capture`` raises
``CaptureRefused`` naming the first refused operation (and every other failure recorded in the
window), makes no graph, and leaves the stream with no capture. ``abort_capture`` unwinds.
"""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import CaptureRefused, InvalidHandle

N = 64


def _add(c, x, y, alpha):
    c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": alpha, "n": N})


def _refusals(c, side, x, out):
    """Each refused call, caught as library code does."""
    return {
        "wait_event": lambda: c.wait_event(side.record_event()),
        "record_event": lambda: c.record_event(),
        "read": lambda: c.read(x),
        "sync": lambda: c.sync(),
    }


@pytest.mark.parametrize("call", ["wait_event", "record_event", "read", "sync", "replay"])
def test_a_caught_refusal_invalidates_the_window(client, call):
    """The issue's case: A joins a side stream inside its window; the join is refused, the
    caller goes on; without the rule the graph computes ``out`` from what the side buffer held
    at capture (4 instead of 10)."""
    a = client
    b = a.with_stream(runtime.StreamId.new())
    x = a.create(np.full(N, 4.0, np.float32))
    side, out = a.empty(N, np.float32), a.empty(N, np.float32)
    g0 = None
    if call == "replay":                          # a graph of a's stream (its own buffers)
        junk = a.empty(N, np.float32)
        a.graph_prepare()
        a.start_capture()
        _add(a, x, junk, 0.0)
        g0 = a.stop_capture()
    a.sync()
    a.graph_prepare()
    a.start_capture()
    b.launch(K.add_scalar, K.grid(N), [x, side], {"alpha": 6.0, "n": N})   # side = 10
    try:
        if call == "replay":
            g0.replay()
        else:
            _refusals(a, b, x, out)[call]()
    except CaptureRefused:
        pass                                      # what library code that "handles" it does
    _add(a, side, out, 0.0)
    with pytest.raises(CaptureRefused, match=f"first refused operation: {call}"):
        a.stop_capture()
    a.graph_prepare()                             # the stream is back to no capture
    a.abort_capture()
    a.wait_event(b.record_event())
    _add(a, side, out, 0.0)
    np.testing.assert_array_equal(a.read(out), np.full(N, 10.0, np.float32))
    if g0 is not None:
        g0.release()


def test_a_refused_launch_invalidates_the_window_and_every_error_is_raised(client):
    c = client
    x, y = c.create(np.ones(N, np.float32)), c.empty(N, np.float32)
    gone = c.empty(N, np.float32)
    gone_id = gone.id
    c.graph_prepare()
    c.start_capture()
    gone.release()                                # freed before use: the launch is refused
    srv = c._server                               # private: the client refuses a released Handle
    srv.submit(srv.h_launch, c.stream, K.add_scalar, K.grid(N), [x.id, gone_id],
               K.add_scalar.pack_params({"alpha": 1.0, "n": N}))
    with pytest.raises(CaptureRefused):
        c.read(y)
    with pytest.raises(CaptureRefused, match="first refused operation: launch of add_scalar "
                                             r"\(InvalidHandle.*then: read of handle") as info:
        c.stop_capture()
    assert isinstance(info.value, InvalidHandle)  # a refusal never hides another error
    c.sync()                                      # raised once: nothing left queued
    _add(c, x, y, 1.0)
    np.testing.assert_array_equal(c.read(y), np.full(N, 2.0, np.float32))


def test_abort_still_unwinds_an_invalidated_window(client):
    c = client
    x, y = c.create(np.ones(N, np.float32)), c.empty(N, np.float32)
    c.graph_prepare()
    c.start_capture()
    _add(c, x, y, 1.0)
    with pytest.raises(CaptureRefused):
        c.sync()
    c.abort_capture()
    _add(c, x, y, 2.0)
    np.testing.assert_array_equal(c.read(y), np.full(N, 3.0, np.float32))


def test_runtime_capture_falls_back_when_fn_reads_or_swallows_a_refusal(client):
    c = client
    x = runtime.Tensor.from_numpy(c, np.arange(N, dtype=np.float32))

    def reads():
        y = x.add(x)
        y.numpy()                                 # a host read inside the window
        return y

    def swallows():
        y = x.add(x)
        try:
            y.numpy()
        except CaptureRefused:
            pass
        return y
    for fn in (reads, swallows):
        g = runtime.capture(fn, client=c)
        assert g.fallback_reason is not None
        np.testing.assert_array_equal(g.replay().numpy(), np.arange(N) * 2)
        g.release()


def test_indirect_launch_reads_counts_on_the_caller_without_device_indirect_dispatch():
    """A backend whose device does not read indirect counts (cuda: ``indirect_dispatch`` False)
    gets a plain ``(x, y, z)``: the client reads the counts first, on its stream, so no server
    handler waits for the device; inside a window the launch is refused by the server's capture
    policy (``Capture.record``), not by the backend. Modelled on a cpu server."""
    c = runtime.client("cpu", scheduler="interleave", seed=3)
    be = c._server.backend                        # private: declare what cuda declares
    be.indirect_dispatch = False                  # what cuda declares
    assert c.capabilities["indirect_dispatch"] is False
    launched = []
    real = be.launch

    def launch(stream, program, count, args, params, mark=None):
        launched.append(count)
        real(stream, program, count, args, params, mark)
    be.launch = launch
    x, y = c.create(np.ones(N, np.float32)), c.create(np.zeros(N, np.float32))
    counts = c.create(np.array([1, 1, 1], np.uint32))
    c.launch(K.add_scalar, counts, [x, y], {"alpha": 2.0, "n": N})
    np.testing.assert_array_equal(c.read(y), np.full(N, 3.0, np.float32))
    assert launched[-1] == (1, 1, 1)              # a static count reached the backend
    c.graph_prepare()
    c.start_capture()
    c.launch(K.add_scalar, counts, [x, y], {"alpha": 2.0, "n": N})
    with pytest.raises(CaptureRefused, match="indirect launch of add_scalar"):
        c.stop_capture()
    srv = c._server                               # private: a raw indirect launch, refused typed
    srv.submit(srv.h_launch, c.stream, K.add_scalar, counts.id, [x.id, y.id],
               K.add_scalar.pack_params({"alpha": 2.0, "n": N}))
    with pytest.raises(runtime.LaunchError, match="does not read counts on the device"):
        c.sync()
    c.shutdown()


def test_a_create_refused_inside_a_window_is_never_read_back_as_if_made(client):
    """``create(array)`` inside a window: its write is refused late and not applied, so the
    new handle holds no data (a pooled buffer's old bytes). Before ADV9 a read returned those
    bytes with no error once ``abort_capture`` (which reports no refusal) dropped the window,
    or from another stream after ``stop_capture`` raised. Now it raises ``ReplayFailed``
    naming the refused write, until a write lands. (A refused write to a handle made before
    the window leaves it as it was: scenario 18, test_capture_replay.py.)"""
    c = client
    other = c.with_stream(runtime.StreamId.new())
    junk = c.create(np.full(N, 7.0, np.float32))
    junk.release()                                     # the pool's next buffer holds 7s
    c.graph_prepare()
    c.start_capture()
    made = c.create(np.full(N, 3.0, np.float32))
    c.abort_capture()
    for reader in (c, other):
        with pytest.raises(runtime.ReplayFailed, match="inside the capture window"):
            reader.read(made)
    c.graph_prepare()
    c.start_capture()
    made2 = c.create(np.full(N, 3.0, np.float32))
    with pytest.raises(CaptureRefused, match=f"write to handle {made2.id}"):
        c.stop_capture()
    with pytest.raises(runtime.ReplayFailed):
        other.read(made2)
    c.write(made, np.full(N, 9.0, np.float32))         # written: applied, clean
    np.testing.assert_array_equal(other.read(made), np.full(N, 9.0, np.float32))
    _add(c, made, made2, 1.0)                          # a launch rewriting it clears it too
    np.testing.assert_array_equal(c.read(made2), np.full(N, 10.0, np.float32))
