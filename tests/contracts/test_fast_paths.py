"""The cpu backend's fast paths keep the contract (issue 26; docs/contract.md section 1).

On an idle stream of the thread scheduler (the default), a tiny launch of a kernel with a
``bind`` and a replay of at most four such launches run on the calling thread at once, and a
read of a clean buffer is copied at once: no mark, fence or completion is allocated for work
that can no longer fail. These tests pin what must not change on those paths: the values (against
numpy), a failure found there (reported like one found at execution: the outputs are marked,
the stream raises it once), a graph whose state failed (it keeps failing until the state is
written from the host), and the cached resolved launches (params, sizes and pooled buffers
change the call). And that the common path allocates nothing only a failure needs.
"""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.backends.base import Completion
from helpers import captured_once
from runtime.errors import LaunchError, ReplayFailed, ServerUnhealthy
from runtime.server import marks as marks_module
from runtime.server import queue as queue_mod

N = 64


def _raising(x, y, *, n, count):
    if (x[:n] < 0).any():
        raise ValueError("a negative input")
    y[:n] = x[:n] * 2


def _bind_raising(x, y, *, count, n):
    return lambda: _raising(x, y, n=n, count=count)


_raising.bind = _bind_raising
#: ``y = 2x``, raising on a negative input; with a ``bind``, so it takes the fast paths
DOUBLE = runtime.Kernel("checked_double_bound", [("x", "f32", "read"), ("y", "f32", "write")],
                        [("n", "u32")], cpu=_raising)


def _acc(x, s, *, n, count):
    if (x[:n] < 0).any():
        raise ValueError("a negative input")
    s[:n] += x[:n]


_acc.bind = lambda x, s, *, count, n: (lambda: _acc(x, s, n=n, count=count))
#: ``s += x``, raising on a negative input: state read and written by one graph
ACC = runtime.Kernel("checked_accumulate_bound", [("x", "f32", "read"), ("s", "f32", "read_write")],
                     [("n", "u32")], cpu=_acc)


def _captured(c, kernel, bufs, n=N):
    """One launch of ``kernel`` over ``bufs`` captured after a warm-up (each runs it once)."""
    return captured_once(c, kernel, bufs, {}, n)


@pytest.fixture
def c():
    """A client of the default cpu server (thread scheduler) on a fresh stream."""
    cl = runtime.client("cpu")
    cl.set_stream(runtime.StreamId.new())
    return cl


def _counting(monkeypatch, cls) -> list:
    """A list that grows by one entry (the first argument) per ``cls`` object made."""
    made = []
    init = cls.__init__

    def counted(self, *a, **k):
        made.append(a[0] if a else None)
        init(self, *a, **k)
    monkeypatch.setattr(cls, "__init__", counted)
    return made


def test_tiny_launches_replays_and_reads_on_an_idle_stream_allocate_no_mark_or_completion(
        monkeypatch):
    # a server of its own whose device thread makes no timed look at deferred work (every
    # LAZY_S): a look landing between a deferral and the next call (a loaded host) runs the
    # deferred work on the device thread, and the caller's next call, finding the owner lock
    # held, queues (a mark, a completion): the common path counted here is the caller's own
    monkeypatch.setattr(queue_mod, "LAZY_S", 3600.0)
    c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 7)
    try:
        _no_allocation_on_the_common_path(c, monkeypatch)
    finally:
        c.shutdown()


def _no_allocation_on_the_common_path(c, monkeypatch):
    x = c.create(np.arange(N, dtype=np.float32))
    y = c.empty(N, np.float32)
    c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
    c.sync()
    c.graph_prepare()
    c.launch(K.add_scalar, K.grid(N), [y, x], {"alpha": 1.0, "n": N})
    c.sync()
    c.start_capture()
    c.launch(K.add_scalar, K.grid(N), [y, x], {"alpha": 1.0, "n": N})
    g = c.stop_capture()
    c.write(x, np.arange(N, dtype=np.float32))
    c.sync()
    made = _counting(monkeypatch, marks_module.Mark)
    completions = _counting(monkeypatch, Completion)
    ref = np.arange(N, dtype=np.float32)
    for i in range(50):
        c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 2.0, "n": N})
        ref_y = ref + 2
        np.testing.assert_array_equal(c.read(y), ref_y)
        g.replay()
        ref = ref_y + 1
        np.testing.assert_array_equal(c.read(x), ref)
    assert made == [], f"{len(made)} marks made on the common path, e.g. {made[:3]}"
    assert len(completions) == 0, f"{len(completions)} completions made on the common path"


def test_a_launch_that_raises_on_the_fast_path_marks_its_output_and_raises_once(c):
    x = c.create(-np.ones(N, np.float32))
    y = c.create(np.zeros(N, np.float32))
    c.sync()
    c.launch(DOUBLE, K.grid(N), [x, y], {"n": N})     # runs at once, and raises there
    with pytest.raises(ReplayFailed) as e:
        c.read(y)
    assert isinstance(e.value, ServerUnhealthy) and isinstance(e.value, LaunchError)
    assert "checked_double_bound" in str(e.value)
    with pytest.raises(ReplayFailed):                 # the mark stays ...
        c.read(y)
    c.sync()                                          # ... the stream's error was raised once
    c.write(x, np.arange(N, dtype=np.float32))
    c.launch(DOUBLE, K.grid(N), [x, y], {"n": N})     # a later write lands: clean again
    np.testing.assert_array_equal(c.read(y), 2 * np.arange(N, dtype=np.float32))


def test_a_replay_that_raises_on_the_fast_path_marks_the_write_set_until_a_replay_lands(c):
    x = c.create(np.ones(N, np.float32))
    y = c.create(np.zeros(N, np.float32))
    g = _captured(c, DOUBLE, [x, y])
    c.write(x, -np.ones(N, np.float32))
    c.sync()
    g.replay()                                        # runs at once, raises there, returns
    with pytest.raises(ReplayFailed) as e:
        c.read(y)
    assert "replay of graph" in str(e.value) and isinstance(e.value, LaunchError)
    with pytest.raises(ReplayFailed):
        c.read(y)
    c.sync()                                          # raised once already
    c.write(x, np.full(N, 3, np.float32))
    g.replay()
    np.testing.assert_array_equal(c.read(y), np.full(N, 6, np.float32))


def test_a_stateful_graph_that_failed_on_the_fast_path_keeps_failing_until_its_state_is_written(c):
    x = c.create(np.ones(N, np.float32))
    s = c.create(np.zeros(N, np.float32))
    g = _captured(c, ACC, [x, s])
    c.write(s, np.zeros(N, np.float32))
    for _ in range(3):
        g.replay()
    np.testing.assert_array_equal(c.read(s), np.full(N, 3, np.float32))
    c.write(x, -np.ones(N, np.float32))
    g.replay()                                        # fails: the state is stale from here
    c.write(x, np.ones(N, np.float32))                # the input is fine again, the state not
    for i in range(3):
        g.replay()
        with pytest.raises(ReplayFailed) as e:
            c.read(s)
        # the stream's own LaunchError comes with the first read only (raised once)
        assert isinstance(e.value, LaunchError) == (i == 0)
    c.sync()
    c.write(s, np.full(N, 10, np.float32))            # the state written from the host
    g.replay()
    np.testing.assert_array_equal(c.read(s), np.full(N, 11, np.float32))


def test_cached_fast_launches_follow_params_sizes_and_reused_buffers(c):
    rng = np.random.default_rng(0)
    data = rng.standard_normal(N).astype(np.float32)
    x = c.create(data)
    y = c.empty(N, np.float32)
    for alpha in (1.0, 2.5, -3.0, 1.0):
        c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": alpha, "n": N})
        np.testing.assert_array_equal(c.read(y), data + np.float32(alpha))
    for n in (N, 17, 1, N):                           # the same buffers, other element counts
        c.write(y, np.zeros(N, np.float32))
        c.launch(K.add_scalar, K.grid(n), [x, y], {"alpha": 1.0, "n": n})
        want = np.zeros(N, np.float32)
        want[:n] = data[:n] + 1
        np.testing.assert_array_equal(c.read(y), want)
    for size in (N, N // 2, N, 3):                    # freed buffers come back from the pool
        a = c.create(np.arange(size, dtype=np.float32))
        b = c.empty(size, np.float32)
        c.launch(K.mul_scalar, K.grid(size), [a, b], {"alpha": 3.0, "n": size})
        np.testing.assert_array_equal(c.read(b), 3 * np.arange(size, dtype=np.float32))
        a.release()
        b.release()
        c.sync()


def test_a_read_after_queued_tiny_work_runs_it_and_returns_its_values(c):
    x = c.create(np.zeros(N, np.float32))
    y = c.create(np.zeros(N, np.float32))
    c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
    c.sync()
    c.graph_prepare()
    for _ in range(10):
        c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
        c.launch(K.add_scalar, K.grid(N), [y, x], {"alpha": 1.0, "n": N})
    c.sync()
    c.start_capture()
    for _ in range(10):                               # 20 launches: enqueued, not run at once
        c.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
        c.launch(K.add_scalar, K.grid(N), [y, x], {"alpha": 1.0, "n": N})
    g = c.stop_capture()
    c.write(x, np.zeros(N, np.float32))
    for k in range(1, 4):
        g.replay()
        np.testing.assert_array_equal(c.read(x), np.full(N, 20 * k, np.float32))


def test_a_graph_that_waited_for_another_stream_once_takes_the_fast_path_after(monkeypatch):
    """A graph whose buffers were last written on another stream waits for it at its first
    replay (``Window.fences``); later replays on the idle capture stream run at once (no mark),
    with the values numpy gives."""
    root = runtime.client("cpu")
    a = root.with_stream(runtime.StreamId.new())
    b = root.with_stream(runtime.StreamId.new())
    x = a.create(np.arange(N, dtype=np.float32))
    y = b.empty(N, np.float32)
    b.graph_prepare()
    b.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
    b.sync()
    a.write(x, np.full(N, 5, np.float32))             # x's last write, on a: the window's fence
    b.start_capture()
    b.launch(K.add_scalar, K.grid(N), [x, y], {"alpha": 1.0, "n": N})
    g = b.stop_capture()
    assert b._server.call(lambda: dict(b._server.graphs[g.id].fences))  # (private: it has one)
    g.replay()                                        # orders after a's write, once
    np.testing.assert_array_equal(b.read(y), np.full(N, 6, np.float32))
    made = _counting(monkeypatch, marks_module.Mark)
    for _ in range(5):
        g.replay()
        np.testing.assert_array_equal(b.read(y), np.full(N, 6, np.float32))
    assert made == []


def test_a_negative_zero_param_is_not_served_the_cached_call_of_zero(c):
    # the cached resolved launch is keyed by its params, and -0.0 == 0.0 as a key: a launch
    # with alpha=-0.0 ran the call bound with 0.0 (y = x * 0.0 = +0.0 instead of -0.0)
    data = np.arange(1, N + 1, dtype=np.float32)
    x = c.create(data)
    y = c.empty(N, np.float32)
    c.sync()
    for alpha in (0.0, 0.0, -0.0, -0.0, 0.0, -0.0):
        c.launch(K.mul_scalar, K.grid(N), [x, y], {"alpha": alpha, "n": N})
        got = c.read(y)
        want = data * np.float32(alpha)
        np.testing.assert_array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want)), alpha


@pytest.mark.parametrize("call", ["read", "sync", "replay"])
def test_a_kernel_body_that_calls_the_runtime_on_the_fast_path_raises_instead_of_hanging(call):
    # a tiny launch of a kernel with a bind runs on the calling thread under the server's lock;
    # a blocking call from its body queued a message only the lock's holder (this very thread)
    # could run, and waited forever. Now the call raises (UnsupportedError, a LaunchError of
    # the kernel, its output marked) and the message is taken back: it never runs later.
    import threading
    root = runtime.client("cpu", max_idle_bytes=(1 << 30) + 41)   # a server of its own
    a = root.with_stream(runtime.StreamId.new())
    b = root.with_stream(runtime.StreamId.new())
    other = b.create(np.full(4, 7, np.float32))
    bumped = b.create(np.zeros(4, np.float32))
    g = None
    if call == "replay":
        b.graph_prepare()
        b.sync()
        b.start_capture()
        b.launch(K.add_scalar, 1, [other, bumped], {"alpha": 1.0, "n": 4})
        g = b.stop_capture()
    b.sync()

    def body(x, y, *, n, count):
        {"read": lambda: b.read(other), "sync": b.sync, "replay": lambda: g.replay()}[call]()
        y[:n] = x[:n]
    body.bind = lambda x, y, *, count, n: (lambda: body(x, y, n=n, count=count))
    calling = runtime.Kernel("calls_the_runtime", [("x", "f32", "read"), ("y", "f32", "write")],
                             [("n", "u32")], cpu=body)
    x = a.create(np.ones(4, np.float32))
    y = a.create(np.zeros(4, np.float32))
    a.sync()
    got = []

    def run():
        try:
            a.launch(calling, 1, [x, y], {"n": 4})
            got.append(a.read(y))
        except BaseException as e:  # noqa: BLE001 - what the caller got
            got.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "the launch's caller still waits: a hang"
    assert len(got) == 1 and isinstance(got[0], ReplayFailed), got
    assert "UnsupportedError" in str(got[0]) and "kernel bod" in str(got[0])
    b.sync()
    np.testing.assert_array_equal(b.read(bumped), np.zeros(4, np.float32))  # never replayed
    root.shutdown()
