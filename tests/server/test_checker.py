"""The stream-ordering checker (``check=True``): seed 001's three safety obligations.

For each violation kind a program that commits it is flagged with the checker on, and the same
program without it, under the seeded interleaving scheduler, really gives stale or corrupt data
for at least one seed (the checker is not crying wolf). Correct programs (same-stream refresh,
host sync, event wait, ordinary cross-stream work) pass under every seed.
"""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.server import get_server

SEEDS = range(16)


def f32(*values):
    return np.array(values, dtype=np.float32)


class Prog:
    """A fresh interleaving server with two clients: ``a`` on the capture stream S, ``b`` on T,
    and a graph ``g`` on S computing ``y = x + 1`` from caller-owned ``x`` and ``y``."""

    def __init__(self, seed=0, check=True, scheduler="interleave"):
        opts = {"scheduler": scheduler, "seed": seed} if scheduler == "interleave" else {}
        self.c = runtime.client("cpu", check=check, **opts)
        self.S, self.T = runtime.StreamId.new(), runtime.StreamId.new()
        self.a, self.b = self.c.with_stream(self.S), self.c.with_stream(self.T)
        self.x = self.a.create(f32(1, 2, 3, 4))
        self.y = self.a.create(f32(0, 0, 0, 0))
        self.a.sync()
        self.a.graph_prepare()
        self.a.start_capture()
        self.a.launch(K.add_scalar, 1, [self.x, self.y], {"alpha": 1.0, "n": 4})
        self.g = self.a.stop_capture()

    def violations(self):
        return self.c.checker_violations()

    def close(self):
        self.c.shutdown()


def run_seeds(program, check):
    """``program(p)`` on a fresh server per seed; returns ``{seed: result or exception}``."""
    out = {}
    for seed in SEEDS:
        p = Prog(seed, check)
        try:
            out[seed] = program(p)
        except runtime.ServerError as e:
            out[seed] = e
        finally:
            p.close()
    return out


def diverged(results, expected):
    return [s for s, r in results.items()
            if isinstance(r, Exception) or not np.array_equal(r, expected)]


# -- the three violations: flagged with the checker, really corrupt without it -----------------
def refresh_from_other_stream(p):
    p.b.write(p.x, f32(10, 20, 30, 40))      # refresh on T, replay on S: unordered
    p.g.replay()
    return p.a.read(p.y)


def read_output_from_other_stream(p):
    p.g.replay()
    return p.b.read(p.y)                     # read on T of what the replay on S writes


def use_output_from_other_stream(p):
    p.g.replay()
    w = p.b.empty(4, np.float32)
    p.b.launch(K.copy, 1, [p.y, w], {"n": 4})   # fire-and-forget on T, unordered after the replay
    return p.b.read(w)


def overwrite_input_during_replay(p):
    p.g.replay()
    p.b.write(p.x, f32(10, 20, 30, 40))      # T overwrites what the replay on S still reads
    p.b.sync()
    return p.a.read(p.y)


def replay_with_freed_input(p):
    p.x.release()
    p.a.create(f32(100, 100, 100, 100))      # the pool hands x's buffer to the new handle
    p.g.replay()
    return p.a.read(p.y)


def test_refresh_from_another_stream_is_flagged_at_the_replay():
    p = Prog()
    try:
        p.b.write(p.x, f32(10, 20, 30, 40))
        with pytest.raises(runtime.StreamRaceError) as ei:
            p.g.replay()
        msg = str(ei.value)
        assert f"write to handle {p.x.id} on stream {int(p.T)}" in msg
        assert f"replay of graph {p.g.id}" in msg and f"on stream {int(p.S)}" in msg
        assert "wait on an event" in msg
        assert ei.value.handle == p.x.id and ei.value.streams == (p.T, p.S)
        with pytest.raises(runtime.ReplayFailed):   # the refused replay did not run
            p.a.read(p.y)
    finally:
        p.close()


def test_refresh_from_another_stream_gives_stale_data_without_the_checker():
    res = run_seeds(refresh_from_other_stream, check=False)
    assert diverged(res, f32(11, 21, 31, 41))
    assert all(isinstance(r, runtime.StreamRaceError)
               for r in run_seeds(refresh_from_other_stream, check=True).values())


def test_output_read_from_another_stream_is_flagged_at_the_read():
    p = Prog()
    try:
        p.g.replay()
        with pytest.raises(runtime.StreamRaceError) as ei:
            p.b.read(p.y)
        msg = str(ei.value)
        assert f"replay of graph {p.g.id} (writing handle {p.y.id}) on stream {int(p.S)}" in msg
        assert f"read of handle {p.y.id} on stream {int(p.T)}" in msg
    finally:
        p.close()


def test_output_read_from_another_stream_gives_stale_data_without_the_checker():
    assert diverged(run_seeds(read_output_from_other_stream, check=False), f32(2, 3, 4, 5))
    assert all(isinstance(r, runtime.StreamRaceError)
               for r in run_seeds(read_output_from_other_stream, check=True).values())


def test_concurrent_use_by_a_launch_is_queued_and_raised_by_the_next_blocking_call():
    p = Prog()
    try:
        p.g.replay()
        w = p.b.empty(4, np.float32)
        p.b.launch(K.copy, 1, [p.y, w], {"n": 4})
        with pytest.raises(runtime.StreamRaceError) as ei:
            p.b.sync()
        assert isinstance(ei.value, runtime.ServerUnhealthy)
        assert f"launch of copy (reading handle {p.y.id})" in str(ei.value)
        # the racy launch was ordered after the replay, so its data is still right
        np.testing.assert_array_equal(p.b.read(w), f32(2, 3, 4, 5))
    finally:
        p.close()


def test_concurrent_use_gives_stale_data_without_the_checker():
    assert diverged(run_seeds(use_output_from_other_stream, check=False), f32(2, 3, 4, 5))
    assert all(isinstance(r, runtime.StreamRaceError)
               for r in run_seeds(use_output_from_other_stream, check=True).values())


def test_overwriting_an_input_while_the_replay_reads_it_is_flagged():
    res = run_seeds(overwrite_input_during_replay, check=True)
    assert all(isinstance(r, runtime.StreamRaceError) and "write to handle" in str(r)
               for r in res.values())
    assert diverged(run_seeds(overwrite_input_during_replay, check=False), f32(2, 3, 4, 5))


def test_replay_with_a_freed_buffer_raises_liveness_error_naming_the_handle():
    p = Prog()
    try:
        xid = p.x.id
        p.x.release()
        p.a.create(f32(100, 100, 100, 100))
        with pytest.raises(runtime.LivenessError) as ei:
            p.g.replay()
        assert f"handle {xid}" in str(ei.value) and f"graph {p.g.id}" in str(ei.value)
        assert p.violations() == [ei.value]
    finally:
        p.close()


def test_replay_with_a_freed_buffer_raises_even_without_the_checker():
    """The graph pins the buffer (it never reaches the new handle) and the server refuses the
    replay: no corrupt data, checker or not (issue 13)."""
    for check in (False, True):
        assert all(isinstance(r, runtime.LivenessError)
                   for r in run_seeds(replay_with_freed_input, check=check).values())


# -- correct programs pass, under every seed ---------------------------------------------------
def same_stream_loop(p):
    outs = []
    for k in range(3):
        p.a.write(p.x, f32(k, k, k, k))
        p.g.replay()
        outs.append(p.a.read(p.y))
    return np.concatenate(outs)


def host_sync_orders_streams(p):
    p.b.write(p.x, f32(10, 20, 30, 40))
    p.b.sync()                   # the host saw T finish: T's write happens-before the replay
    p.g.replay()
    p.a.sync()
    return p.b.read(p.y)


def event_orders_streams(p):
    p.b.write(p.x, f32(10, 20, 30, 40))
    p.a.wait_event(p.b.record_event())
    p.g.replay()
    p.b.wait_event(p.a.record_event())
    return p.b.read(p.y)


def read_on_capture_stream_orders_later_use(p):
    p.g.replay()
    p.a.read(p.y)                # returns only once S ran the replay
    w = p.b.empty(4, np.float32)
    p.b.launch(K.copy, 1, [p.y, w], {"n": 4})
    return p.b.read(w)


ONLY_CUDA = runtime.Kernel("only_cuda", [runtime.Binding("y", "f32", "read_write")],
                           cuda='extern "C" __global__ void only_cuda(float* y) {}')


def raising_read_on_capture_stream_orders_later_use(p):
    z = p.a.create(f32(0, 0, 0, 0))
    p.g.replay()
    p.a.launch(ONLY_CUDA, 1, [z])    # fails at enqueue on S (no cpu body): z is marked
    with pytest.raises(runtime.ReplayFailed):
        p.a.read(z)                  # raises, but only once S ran the replay (issue 17)
    w = p.b.empty(4, np.float32)
    p.b.launch(K.copy, 1, [p.y, w], {"n": 4})
    return p.b.read(w)


def ordinary_cross_stream_work(p):
    u = p.b.create(f32(5, 6, 7, 8))
    v = p.a.empty(4, np.float32)
    p.a.launch(K.add, 1, [u, p.x, v], {"n": 4})     # the server orders T's create before it
    p.b.launch(K.mul_scalar, 1, [v, u], {"alpha": 2.0, "n": 4})
    return p.a.read(u)


@pytest.mark.parametrize("program, expected", [
    (same_stream_loop, f32(1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)),
    (host_sync_orders_streams, f32(11, 21, 31, 41)),
    (event_orders_streams, f32(11, 21, 31, 41)),
    (read_on_capture_stream_orders_later_use, f32(2, 3, 4, 5)),
    (raising_read_on_capture_stream_orders_later_use, f32(2, 3, 4, 5)),
    (ordinary_cross_stream_work, f32(12, 16, 20, 24)),
], ids=lambda v: getattr(v, "__name__", ""))
def test_a_correctly_ordered_program_passes_under_every_seed(program, expected):
    for seed, r in run_seeds(program, check=True).items():
        assert not isinstance(r, Exception), (seed, r)
        np.testing.assert_array_equal(r, expected)


def test_a_window_allocation_freed_by_the_caller_stays_alive_in_the_graph():
    c = runtime.client("cpu", scheduler="interleave", seed=1, check=True)
    try:
        a = c.with_stream(runtime.StreamId.new())
        x = a.create(f32(1, 2, 3, 4))
        out = a.empty(4, np.float32)
        a.sync()
        a.graph_prepare()
        a.start_capture()
        tmp = a.empty(4, np.float32)        # retained by the (software) graph
        a.launch(K.add_scalar, 1, [x, tmp], {"alpha": 1.0, "n": 4})
        a.launch(K.copy, 1, [tmp, out], {"n": 4})
        g = a.stop_capture()
        tmp.release()
        a.create(f32(9, 9, 9, 9))
        g.replay()
        np.testing.assert_array_equal(a.read(out), f32(2, 3, 4, 5))
        assert c.checker_violations() == []
    finally:
        c.shutdown()


def test_the_checker_works_with_the_default_thread_scheduler():
    p = Prog(scheduler="thread")
    try:
        p.b.write(p.x, f32(10, 20, 30, 40))
        with pytest.raises(runtime.StreamRaceError):
            p.g.replay()
        p.b.sync()
        p.g.replay()
        np.testing.assert_array_equal(p.a.read(p.y), f32(11, 21, 31, 41))
    finally:
        p.close()


def test_runtime_check_env_turns_the_checker_on(monkeypatch):
    monkeypatch.setenv("RUNTIME_CHECK", "1")
    srv = get_server("cpu", scheduler="interleave", seed=12345)
    try:
        assert srv.checker is not None
    finally:
        srv.shutdown()
    monkeypatch.setenv("RUNTIME_CHECK", "0")
    srv = get_server("cpu", scheduler="interleave", seed=12346)
    try:
        assert srv.checker is None
    finally:
        srv.shutdown()


def test_the_checker_flags_each_violation_on_every_backend(backend):
    """The checker sits in the server: the same three violations are caught on each backend."""
    c = runtime.client(backend, check=True)
    S, T = runtime.StreamId.new(), runtime.StreamId.new()
    a, b = c.with_stream(S), c.with_stream(T)
    x, y = a.create(f32(1, 2, 3, 4)), a.create(f32(0, 0, 0, 0))
    a.sync()
    a.graph_prepare()
    a.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    a.start_capture()
    a.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    g = a.stop_capture()
    b.write(x, f32(10, 20, 30, 40))                      # cross-stream refresh
    with pytest.raises(runtime.StreamRaceError):
        g.replay()
    b.sync()
    g.replay()
    with pytest.raises(runtime.StreamRaceError):         # output read on another stream
        b.read(y)
    np.testing.assert_array_equal(a.read(y), f32(11, 21, 31, 41))
    g.replay()
    w = b.empty(4, np.float32)
    b.launch(K.copy, 1, [y, w], {"n": 4})                # concurrent use, queued
    with pytest.raises(runtime.StreamRaceError):
        b.sync()
    np.testing.assert_array_equal(b.read(w), f32(11, 21, 31, 41))
    x.release()
    with pytest.raises(runtime.LivenessError):
        g.replay()
    g.release()


def test_the_violations_kept_are_bounded_and_every_one_is_still_raised(monkeypatch):
    """A long run with a race found on every request kept every violation (a list growing with
    work done; found by ADV2): the checker keeps the first MAX_VIOLATIONS, counts them all, and
    each is still raised to its call."""
    from runtime.server import checker as C
    monkeypatch.setattr(C, "MAX_VIOLATIONS", 5)
    p = Prog()
    try:
        xid = p.x.id
        p.x.release()
        p.a.create(f32(100, 100, 100, 100))
        for _ in range(40):
            with pytest.raises(runtime.LivenessError, match=f"handle {xid}"):
                p.g.replay()
        assert len(p.violations()) == 5
        assert p.a._server.checker.found == 40
    finally:
        p.close()
