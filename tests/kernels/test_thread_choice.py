"""One thread or all for kernels dealt out in pieces on a busy host
(``runtime.cpu_threads.ThreadChoice``): chosen from measured work per second, shape by shape,
with hysteresis, all threads again as soon as the host is free. A fake clock and a fake
"starved" source: no test here times anything."""

from __future__ import annotations

import numpy as np
import pytest

import runtime.cpu_threads as ct
from runtime.kernels import nn

A, B = (16, 1536, 384), (24, 384, 1536)          # two kernel shapes (M, N, K)
WORK = {A: 16 * 1536 * 384, B: 24 * 384 * 1536}


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class _Host:
    def __init__(self):
        self.starved = True

    def __call__(self):
        return self.starved


def _choice(**kw):
    clock, host = _Clock(), _Host()
    kw.setdefault("window_s", 0.05)
    c = ct.ThreadChoice(host, mode="auto", clock=clock, **kw)
    return c, clock, host


def _window(c, clock, speed, shapes=(A, B), n=2, tick=0.01):
    """Run kernels at the count the choice gives now until its window closes; ``speed``:
    ``{threads: multiply-adds per second}`` (per shape, or one for all). Returns the count."""
    t = c.threads(n)
    start = c.comparisons, len(c._plan)
    for i in range(1000):
        shape = shapes[i % len(shapes)]
        s = speed[t][shape] if isinstance(speed[t], dict) else speed[t]
        clock.t += tick
        c.record(WORK[shape], WORK[shape] / s, t, shape)
        if (c.comparisons, len(c._plan)) != start:
            return t
    raise AssertionError("the window never closed")


def _compare(c, clock, speed, **kw):
    """A whole comparison (the kernel that starts it, then its four windows); returns the
    counts its windows ran at."""
    clock.t += 0.01
    c.record(WORK[A], 0.001, c.threads(2), A)         # starts the comparison (not counted)
    assert len(c._plan) == 4
    return [_window(c, clock, speed, **kw) for _ in range(4)]


def test_one_thread_is_chosen_when_its_windows_did_more_work_per_second():
    c, clock, _ = _choice()
    assert c.threads(2) == 2 and not c.one            # all threads until measured
    # the other count first, the incumbent twice, the other again (two pairs, opposite orders)
    ran = _compare(c, clock, {1: 3e10, 2: 2e10})
    assert ran == [1, 2, 2, 1]
    assert c.one and c.changes == 1 and c.comparisons == 1
    assert c.speedups == pytest.approx((1.5, 1.5))
    assert c.threads(2) == 1 and c.threads(1) == 1
    clock.t += 0.5                                    # within hold_s: no comparison
    c.record(WORK[A], 0.001, 1, A)
    assert not c._plan and c.threads(2) == 1
    # two threads faster again: taken back once a comparison says so
    clock.t += 1.0
    assert _compare(c, clock, {1: 2e10, 2: 3e10}) == [2, 1, 1, 2]
    assert not c.one and c.changes == 2 and c.threads(2) == 2


def test_the_choice_does_not_flap_on_small_or_inconsistent_differences():
    c, clock, _ = _choice(margin=0.1, hold_s=1.0, max_hold_s=4.0)
    _compare(c, clock, {1: 2.1e10, 2: 2e10})          # one thread 5% faster: under the margin
    assert not c.one and c.changes == 0
    # one pair says one thread by 50%, the other pair says all threads: kept
    speeds = iter([{1: 3e10, 2: 2e10}, {1: 3e10, 2: 2e10}, {1: 1e10, 2: 2e10}, {1: 1e10, 2: 2e10}])
    clock.t += 10
    c.record(WORK[A], 0.001, 2, A)
    for _ in range(4):
        _window(c, clock, next(speeds))
    assert not c.one and c.changes == 0 and c.comparisons == 2
    assert c.speedups[0] > 1.1 and c.speedups[1] < 1
    # the host slowing down through a comparison (both counts alike, 4 -> 1e10/s): the first
    # pair favours the other count by 33%, the second (opposite order) the incumbent: kept
    drift = iter([4e10, 3e10, 2e10, 1e10])
    clock.t += 10
    c.record(WORK[A], 0.001, 2, A)
    for _ in range(4):
        v = next(drift)
        _window(c, clock, {1: v, 2: v})
    assert c.speedups[0] == pytest.approx(4 / 3) and c.speedups[1] == pytest.approx(0.5)
    assert not c.one and c.changes == 0 and c.comparisons == 3
    # confirmed choices wait longer each time (4 = max_hold_s): fewer comparisons
    for hold in (4.0, 4.0):
        clock.t += hold - 0.1
        c.record(WORK[A], 0.001, 2, A)
        assert not c._plan                            # not yet
        clock.t += 0.2
        _compare(c, clock, {1: 2e10, 2: 2e10})
        assert not c.one
    assert c.changes == 0 and c.comparisons == 5


def test_all_threads_at_once_when_the_host_is_free_again_and_no_comparisons_meanwhile():
    c, clock, host = _choice()
    _compare(c, clock, {1: 3e10, 2: 1e10})
    assert c.one and c.threads(2) == 1
    host.starved = False                              # the busy processes ended
    assert c.threads(2) == 2 and not c.one and c.changes == 2
    clock.t += 100                                    # a free host never compares
    for _ in range(50):
        clock.t += 0.01
        c.record(WORK[A], 0.001, 2, A)
    assert not c._plan and c.comparisons == 1
    host.starved = True                               # busy again: compared at once
    clock.t += 0.01
    c.record(WORK[A], 0.001, 2, A)
    assert c._plan and c.threads(2) == 1              # the window of one thread first
    host.starved = False                              # freed mid-comparison: dropped
    assert c.threads(2) == 2 and not c._plan


def test_windows_are_compared_shape_by_shape():
    # one thread ran the cheap shape, all threads ran the cheap and a slow shape: only the
    # shape both ran counts (the slow shape's windows would have made one thread look faster)
    c, clock, _ = _choice()
    speed = {1: {A: 3e10, B: 3e10}, 2: {A: 2.4e10, B: 0.5e10}}
    clock.t += 0.01
    c.record(WORK[A], 0.001, 2, A)
    for _ in range(4):
        t = c.threads(2)
        _window(c, clock, speed, shapes=(A,) if t == 1 else (A, B))
    assert c.speedups == pytest.approx((1.25, 1.25))  # 3 / 2.4 on A alone
    assert c.one
    assert ct._speedup({A: [1.0, 1.0]}, {B: [1.0, 1.0]}) is None    # nothing in common
    c2, clock2, _ = _choice()
    clock2.t += 0.01
    c2.record(WORK[A], 0.001, 2, A)
    for _ in range(4):
        t = c2.threads(2)
        _window(c2, clock2, speed, shapes=(A,) if t == 1 else (B,))
    assert c2.speedups == (None, None) and not c2.one and c2.changes == 0


def test_kernels_of_the_wrong_count_and_stale_windows_are_not_counted():
    c, clock, _ = _choice(stale_s=2.0)
    clock.t += 0.01
    c.record(WORK[A], 0.001, 2, A)                    # starts: a window of one thread
    c.record(WORK[A], 10.0, 2, A)                     # started before the window: ignored
    assert c._win == 0 and c._plan == [True, False, False, True]
    c.record(WORK[A], 0.01, 1, A)
    assert c._win == pytest.approx(0.01)
    clock.t += 2.5                                    # idle longer than stale_s: dropped
    c.record(WORK[A], 0.01, 1, A)
    assert not c._plan and c.comparisons == 0 and not c.one and c.threads(2) == 2
    clock.t += 0.5                                    # next try after hold_s
    c.record(WORK[A], 0.001, 2, A)
    assert not c._plan
    clock.t += 0.6
    c.record(WORK[A], 0.001, 2, A)
    assert c._plan
    # shapes per window are bounded
    for i in range(ct.ThreadChoice.MAX_SHAPES + 10):
        c.record(1.0, 1e-6, 1, ("shape", i))
    assert len(c._cur) == ct.ThreadChoice.MAX_SHAPES


def test_a_fixed_choice_is_never_measured(monkeypatch):
    clock = _Clock()
    for mode, want in (("all", 2), ("1", 1)):
        c = ct.ThreadChoice(lambda: True, mode=mode, clock=clock)
        for _ in range(20):
            clock.t += 1
            c.record(1e6, 0.01, want, A)
        assert c.threads(2) == want and c.comparisons == 0 and not c._plan
        assert c.threads(1) == 1
    monkeypatch.setenv("RUNTIME_CPU_CHOICE", "1")
    assert ct.ThreadChoice(lambda: True).threads(4) == 1
    monkeypatch.setenv("RUNTIME_CPU_CHOICE", "all")
    assert ct.ThreadChoice(lambda: True).threads(4) == 4
    monkeypatch.setenv("RUNTIME_CPU_CHOICE", "two")     # a typo warns (read at import)
    with pytest.warns(RuntimeWarning, match="RUNTIME_CPU_CHOICE='two'"):
        assert ct.ThreadChoice().mode == "auto"
    with pytest.raises(ValueError, match="mode must be auto, all or 1"):
        ct.ThreadChoice(mode="two")


def test_the_rule_counts_pieces_only_of_an_item_executing_alone_and_starved(monkeypatch):
    rule = ct.ThreadRule(cores=2)
    rule.cpu = ct.CpuShare(read=lambda: None)          # share 1.0: a free host
    rule.whole = ct.WholeCalls(mode="0")
    clock = _Clock()
    rule.choice = ct.ThreadChoice(rule._starved, mode="auto", clock=clock)
    rule.active = 1
    rule.record(1e6, 0.01, 2, A)
    assert not rule.choice._plan                      # free host: nothing to choose
    rule.cpu.share = 0.5                              # its threads wait for cores
    rule.active = 2                                   # two items: one thread each, no choice
    assert rule.threads() == 1
    rule.record(1e6, 0.01, 1, A)
    assert not rule.choice._plan
    rule.active = 1
    rule.record(1e6, 0.01, 2, A)
    assert rule.choice._plan and rule.threads() == 1  # the window of one thread
    for _ in range(100):                              # one thread twice as fast
        if rule.choice.comparisons:
            break
        t = rule.threads()
        clock.t += 0.01
        rule.record(1e6, 0.01 if t == 1 else 0.02, t, A)
    assert rule.choice.one and rule.threads() == 1
    assert rule.share() == 2                          # whole calls still see both cores
    rule.cpu.share = 0.95                             # free again
    assert rule.threads() == 2
    rule.cpu.share, rule.cpu.used = 0.5, 1.9          # waiting for its own threads: not starved
    rule.record(1e6, 0.01, 2, A)
    assert not rule.choice._plan and rule.threads() == 2
    rule.cpu.used = 0.9                               # for other processes: compared
    clock.t += 100
    rule.record(1e6, 0.01, 2, A)
    assert rule.choice._plan


def test_the_matmul_runs_at_the_chosen_count_and_reports_its_pieces(monkeypatch):
    seen, ran = [], []

    class Rule:
        active = 1

        def whole_call(self):
            return 0

        def threads(self):
            return 1

        def record(self, work, wall, threads, shape=None):
            seen.append((work, threads, shape))

    class Pool:
        def run(self, fn, pieces, threads):
            ran.append((len(list(pieces)), threads))
            for p in pieces:
                fn(p)

    monkeypatch.setattr(nn, "RULE", Rule())
    monkeypatch.setattr(nn, "FAN_OUT", Pool())
    rng = np.random.default_rng(0)
    M, N, K = 32, 1536, 384
    a = rng.standard_normal(M * K).astype(np.float32)
    w = rng.standard_normal(K * N).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    out = np.zeros(M * N, np.float32)
    nn._matmul_cpu(True, None)(a, w, b, out, M=M, N=N, K=K, count=(1, 1, 1))
    want = a.reshape(M, K) @ w.reshape(K, N) + b
    np.testing.assert_allclose(out.reshape(M, N), want, rtol=1e-4, atol=1e-3)
    assert ran == [(1, 1)]                            # one thread: one piece
    assert seen == [(M * N * K, 1, (M, N, K))]
