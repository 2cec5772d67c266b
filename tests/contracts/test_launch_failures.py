"""A launch that fails after it was enqueued is reported on its own stream, never moves, never
takes other work with it (issue 13 case 3; docs/contract.md section 4).

The failing kernel writes element 63 of its binding: WGSL declares ``array<f32, 64>``, so wgpu
refuses a 16-byte binding when the batch is finished; the numpy body raises ``IndexError`` on
the 4-element view. The same program runs on both backends and is checked against numpy.
(cuda: an out-of-bounds store is undefined behaviour there, not an error: not run.)
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.backends.cpu import ThreadScheduler
from runtime.errors import LaunchError, ReplayFailed, ServerUnhealthy
from runtime.testing import backend_unavailable

from helpers import PAST_END  # fails once it runs (cpu, wgpu)

ONES = np.ones(4, np.float32)


@pytest.fixture
def ab(client, backend):
    if backend == "cuda":
        pytest.skip("an out-of-bounds store is undefined behaviour on cuda, not an error")
    return client, client.with_stream(runtime.StreamId.new())


def _add(c, x, y, alpha):
    c.launch(K.add_scalar, 1, [x, y], {"alpha": alpha, "n": 4})


def test_one_bad_launch_fails_alone_on_its_own_stream(ab):
    a, b = ab
    x, y0, y1, small = a.create(ONES), a.empty(4, np.float32), a.empty(4, np.float32), a.empty(4, np.float32)
    z = b.create(np.zeros(4, np.float32))
    b.sync()
    _add(a, x, y0, 1.0)
    a.launch(PAST_END, 1, [small])
    _add(a, x, y1, 2.0)
    b.write(z, np.full(4, 9, np.float32))       # wgpu: this write submits a's batch
    np.testing.assert_array_equal(b.read(z), np.full(4, 9, np.float32))   # b: no error, write kept
    with pytest.raises(LaunchError, match="past_end"):
        a.read(y0)                               # reported on a, naming the kernel
    np.testing.assert_array_equal(a.read(y0), ONES + 1)     # the good launches ran
    np.testing.assert_array_equal(a.read(y1), ONES + 2)
    with pytest.raises(ReplayFailed, match="past_end"):
        a.read(small)                            # what it would have written is marked
    b.sync()


def test_a_failing_replay_keeps_the_eager_launch_queued_before_it(ab, backend):
    a, b = ab
    x, out, y2, small = a.create(ONES), a.empty(4, np.float32), a.empty(4, np.float32), a.empty(4, np.float32)
    a.graph_prepare()
    a.start_capture()
    _add(a, x, out, 3.0)
    a.launch(PAST_END, 1, [small])
    g = a.stop_capture()
    _add(a, x, y2, 5.0)                          # eager, batched before the replay
    g.replay()
    with pytest.raises(LaunchError, match="past_end") as info:
        a.read(y2)
    assert f"graph {g.id}" in str(info.value)
    for h in (small, out):                       # the replay's whole write set is marked
        with pytest.raises(ReplayFailed, match="past_end"):
            a.read(h)
    np.testing.assert_array_equal(a.read(y2), ONES + 5)
    b.sync()                                     # nothing moved to another stream


# -- every error of the work before a blocking call is raised by that call, once -----------------
# (found by the kit's property test with failing kernels, issue 17: a read of a marked buffer
# raised the mark but left the stream's own failure queued, and a later sync raised it again;
# a read or sync that raised had not waited for its stream, so the host's ordering was lost)
ONLY_CUDA = runtime.Kernel("only_cuda", [runtime.Binding("y", "f32", "read_write")],
                           cuda='extern "C" __global__ void only_cuda(float* y) {}')


def _streams(param):
    """``(root client to shut down or None, a, b)``: two streams of the backend ``param``, or
    of a cpu server with the seeded interleaving ``param`` (an int; the checker on for even
    seeds)."""
    if isinstance(param, int):
        c = runtime.client("cpu", scheduler="interleave", seed=param, check=param % 2 == 0)
        return c, c.with_stream(runtime.StreamId.new()), c.with_stream(runtime.StreamId.new())
    why = backend_unavailable(param)
    if why:
        pytest.skip(why)
    if param == "cuda":
        pytest.skip("an out-of-bounds store is undefined behaviour on cuda, not an error")
    c = runtime.client(param)
    return None, c.with_stream(runtime.StreamId.new()), c.with_stream(runtime.StreamId.new())


def _done(root):
    if root is not None:
        if root.capabilities["checked"]:
            assert root.checker_violations() == []
        root.shutdown()


ALL_BACKENDS = [b.strip() for b in os.environ.get("RUNTIME_TEST_BACKENDS", "cpu,wgpu,cuda").split(",")
                if b.strip()]


@pytest.fixture(params=[*ALL_BACKENDS, *range(4)])
def ab_or_seed(request):
    """A backend's name, then the cpu backend's interleaving seeds (see ``_streams``)."""
    return request.param


def test_a_read_that_raises_a_mark_raises_its_streams_own_failure_with_it_once(ab_or_seed):
    root, a, b = _streams(ab_or_seed)
    small, z = a.empty(4, np.float32), b.create(np.zeros(4, np.float32))
    b.sync()
    a.launch(PAST_END, 1, [small])
    b.write(z, np.full(4, 9, np.float32))        # wgpu: this write submits a's batch
    with pytest.raises(ReplayFailed, match="past_end"):
        b.read(small)                            # another stream: the failure stays on a
    with pytest.raises(ReplayFailed) as info:
        a.read(small)
    assert isinstance(info.value, LaunchError) and "past_end" in str(info.value.errors[1])
    a.sync()                                     # raised once: nothing left for a later call
    with pytest.raises(ReplayFailed):
        a.read(small)                            # the mark stays until a write lands
    a.sync()
    _done(root)


def test_a_sync_raises_failures_found_at_enqueue_and_at_execution_together(ab_or_seed):
    root, a, b = _streams(ab_or_seed)
    small, y = a.empty(4, np.float32), a.create(np.ones(4, np.float32))
    a.sync()
    a.launch(PAST_END, 1, [small])               # fails when it runs (wgpu: at submit)
    a.launch(ONLY_CUDA, 1, [y])                  # fails at enqueue (no source here)
    with pytest.raises(ServerUnhealthy) as info:
        a.sync()
    names = " ".join(str(e) for e in info.value.errors)
    assert len(info.value.errors) == 2 and "past_end" in names and "only_cuda" in names
    a.sync()                                     # nothing left for a later call
    _done(root)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("call", ["read", "sync"])
def test_a_blocking_call_that_raises_has_waited_for_its_stream(seed, call):
    """A replay reading x is pending on a; a blocking call on a raises (a failure queued at
    enqueue). Like a call that returns, it returned only once a's earlier work ran, so the host
    may refresh x from another stream: the replay read the old x and the checker flags nothing."""
    root, a, b = _streams(seed)
    x, y, z = a.create(ONES), a.empty(4, np.float32), a.create(ONES)
    a.graph_prepare()
    a.start_capture()
    _add(a, x, y, 1.0)
    g = a.stop_capture()
    g.replay()                                   # reads x, pending on a
    a.launch(ONLY_CUDA, 1, [z])                  # fails at enqueue: queued on a, z marked
    with pytest.raises(LaunchError, match="only_cuda"):
        a.read(z) if call == "read" else a.sync()
    b.write(x, np.full(4, 5, np.float32))        # after the host saw a finish: no race
    b.sync()
    np.testing.assert_array_equal(a.read(y), ONES + 1)
    g.release()
    _done(root)


# -- a mark propagates whenever the failure is found: also after the reader was enqueued ---------
# (found by the kit's property test, issue 17: a launch or replay reading a buffer through a
# ``read`` binding was marked only if the writer's failure was known when it was enqueued; a
# failure found later at execution or submit left its output silently stale)
class _Gate:
    """Holds a cpu thread-scheduler stream until ``open()`` (20 s at most): the failing launch
    is then still pending when its readers are enqueued (the interleaving scheduler defers all
    work by itself; wgpu finds the failure at the batch's submit)."""

    def __init__(self, c, root):
        self.event = threading.Event()
        if root is None and c.backend == "cpu":
            kernel = runtime.Kernel("gate", [runtime.Binding("y", "f32", "read_write")],
                                    cpu=lambda y, count: self.event.wait(20.0))
            c.launch(kernel, 1, [c.empty(4, np.float32)])

    def open(self):
        self.event.set()


@pytest.mark.parametrize("reader", ["launch", "replay"])
def test_a_reader_enqueued_before_its_inputs_writer_failed_is_marked(ab_or_seed, reader):
    root, a, b = _streams(ab_or_seed)
    x, y, z = a.create(ONES), a.empty(4, np.float32), a.empty(4, np.float32)
    if reader == "replay":
        a.graph_prepare()
        a.start_capture()
        _add(a, x, y, 1.0)                       # g: y = x + 1 (x is a read-only input)
        g = a.stop_capture()
    a.sync()
    gate = _Gate(a, root)
    a.launch(PAST_END, 1, [x])                   # x's writer: fails once it runs
    if reader == "launch":
        _add(a, x, y, 1.0)                       # reads x before the failure is known
    else:
        g.replay()
    _add(a, y, z, 2.0)                           # and on: y's reader is marked too
    gate.open()
    for c in (a, b, a):                          # on every stream, on every read
        for h in (y, z):
            with pytest.raises(ReplayFailed, match="past_end"):
                c.read(h)
    a.write(x, ONES)
    _add(a, x, y, 1.0)                           # a later write lands: the mark is gone
    np.testing.assert_array_equal(a.read(y), ONES + 1)
    if reader == "replay":
        g.release()
    _done(root)


def test_a_read_that_raises_waited_for_the_buffers_writer_on_another_stream():
    """Like a read that returns, a read that raises (its buffer is marked) returns only after
    the buffer's last writer, on any stream, ran: here a replay on stream a before that writer
    is then done, so a third stream may refresh the replay's input (issue 17)."""
    c = runtime.client("cpu", check=True, scheduler=ThreadScheduler())   # a server of its own
    a, b, d = (c.with_stream(runtime.StreamId.new()) for _ in range(3))
    x, y, t = a.create(ONES), a.empty(4, np.float32), a.empty(4, np.float32)
    a.graph_prepare()
    a.start_capture()
    _add(a, x, y, 1.0)
    g = a.stop_capture()
    g.replay()                                   # reads x, on a
    a.launch(PAST_END, 1, [t])                   # t's writer, after the replay: fails
    server = c._server                           # private: wait for the server's failure mark
    for _ in range(2000):                        # the failure is known before b reads
        if server.handles[t.id].mark.error is not None:
            break
        time.sleep(0.005)
    with pytest.raises(ReplayFailed):
        b.read(t)                                # raises after a's writer (and the replay) ran
    d.write(x, np.full(4, 5, np.float32))        # so this is ordered after the replay
    d.sync()
    with pytest.raises(LaunchError):
        a.sync()                                 # a's own failure, reported on a
    np.testing.assert_array_equal(a.read(y), ONES + 1)
    assert server.checker.violations == []
    g.release()
    c.shutdown()


class _Unprintable(Exception):
    """An exception whose message cannot be formatted (its ``__str__`` raises)."""

    def __str__(self):
        raise RuntimeError("no message")


def _unprintable(x, y, *, n, count):
    if x[0] < 0:
        raise _Unprintable()
    y[:n] = x[:n] * 2


def _unprintable_fast(x, y, *, n, count):
    _unprintable(x, y, n=n, count=count)


_unprintable_fast.bind = lambda x, y, *, count, n: (
    lambda: _unprintable(x, y, n=n, count=count))
#: ``y = 2x``, raising an exception whose ``str`` raises on a negative input; the second has a
#: ``bind`` (tiny launches and replays of it run on the caller's thread: issue 26's fast paths)
UNPRINTABLE = {
    "worker": runtime.Kernel("unprintable", [("x", "f32", "read"), ("y", "f32", "write")],
                             [("n", "u32")], cpu=_unprintable),
    "fast": runtime.Kernel("unprintable_fast", [("x", "f32", "read"), ("y", "f32", "write")],
                           [("n", "u32")], cpu=_unprintable_fast)}


@pytest.mark.parametrize("path", ["worker", "fast"])
@pytest.mark.parametrize("how", ["launch", "replay"])
def test_a_kernel_raising_an_exception_whose_message_fails_still_marks_its_outputs(path, how):
    # formatting the LaunchError called str() of the body's exception, which raised inside the
    # handler: the mark was never failed, so after the stream's error was raised once, reads of
    # y returned the stale zeros as if the launch had landed
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    n = 16
    x = c.create(np.arange(n, dtype=np.float32))
    y = c.create(np.zeros(n, np.float32))
    kern = UNPRINTABLE[path]
    if how == "replay":
        c.graph_prepare()
        c.launch(kern, 1, [x, y], {"n": n})
        c.sync()
        c.start_capture()
        c.launch(kern, 1, [x, y], {"n": n})
        g = c.stop_capture()
    c.write(x, np.full(n, -1, np.float32))
    c.sync()
    g.replay() if how == "replay" else c.launch(kern, 1, [x, y], {"n": n})
    for i in range(3):
        with pytest.raises(ReplayFailed) as e:
            c.read(y)
        assert "_Unprintable" in str(e.value)
    c.write(x, np.ones(n, np.float32))              # recovery: a launch from clean inputs
    g.replay() if how == "replay" else c.launch(kern, 1, [x, y], {"n": n})
    np.testing.assert_array_equal(c.read(y), np.full(n, 2, np.float32))
