"""The cpu thread rule's leaf module (``runtime.cpu_threads``): it stands alone (imports nothing
from ``runtime``), the old import paths still reach the same objects, and the fan-out pool hands
pieces out one at a time, so a thread that does not get to run holds up one piece only."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import runtime.cpu_threads as ct
from helpers import profile_interrupt_at

LEAF = os.path.join(os.path.dirname(ct.__file__), "cpu_threads.py")


def test_the_thread_rule_module_loads_alone_without_any_of_runtime():
    # loaded from its file, under another name, in a fresh process: nothing of runtime comes in
    code = f"""if True:
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("leaf", {LEAF!r})
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        assert m.RULE.threads() >= 1 and m.available_cores() >= 1
        print(sorted(k for k in sys.modules if k == "runtime" or k.startswith("runtime.")))
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_old_import_paths_reach_the_same_rule_and_blas_setting():
    from runtime.backends import cpu
    from runtime.kernels import threads
    from runtime.serving import limit_blas_threads
    assert threads.RULE is ct.RULE and threads.ThreadRule is ct.ThreadRule
    assert threads.available_cores is ct.available_cores
    assert cpu.limit_blas_threads is ct.limit_blas_threads is limit_blas_threads


def test_fan_out_runs_every_piece_once_on_up_to_the_threads_asked():
    pool, seen, lock = ct.FanOutPool(), [], threading.Lock()

    def fn(p):
        with lock:
            seen.append((p, threading.get_ident()))

    pool.run(fn, range(50), 3)
    assert sorted(p for p, _ in seen) == list(range(50))
    assert len({t for _, t in seen}) <= 3
    seen.clear()
    pool.run(fn, [7], 4)                                  # one piece: on the caller
    assert seen == [(7, threading.get_ident())]


def test_a_stalled_fan_out_thread_holds_up_one_piece_not_a_share():
    # the first piece a pool thread takes stalls until the caller has done every other piece:
    # with a fixed partition (half the pieces each) the caller would wait on the stalled
    # thread's remaining half, and the stall would time out
    pool, caller = ct.FanOutPool(), threading.get_ident()
    n, done, lock = 20, [], threading.Lock()
    rest_done, timed_out = threading.Event(), []

    def fn(p):
        if threading.get_ident() != caller and not rest_done.is_set():
            if not rest_done.wait(10):
                timed_out.append(p)
        with lock:
            done.append((p, threading.get_ident() == caller))
            if sum(c for _, c in done) == n - 1:
                rest_done.set()

    pool.run(fn, range(n), 2)
    assert not timed_out
    assert sorted(p for p, _ in done) == list(range(n))
    assert sum(not c for _, c in done) <= 1               # the stalled thread ran one piece


def test_fan_out_raises_the_first_error_and_skips_pieces_not_started():
    pool, ran = ct.FanOutPool(), []

    def fn(p):
        ran.append(p)
        if p == 3:
            raise KeyError("piece 3")
        time.sleep(0.002)          # the others cannot all run before the error is recorded

    with pytest.raises(KeyError, match="piece 3"):
        pool.run(fn, range(200), 2)
    assert len(ran) < 200
    assert ct.RULE.fan_outs == 0                          # BLAS back under the rule
    pool.run(lambda p: ran.append(p), range(4), 2)        # the pool still works


def test_an_interrupt_anywhere_in_fan_out_gives_its_count_back():
    """SUITE9: a KeyboardInterrupt landing in ``ThreadRule.fan_out`` while it set BLAS for the
    pieces (``_apply_blas``, after the count went up, before its ``try``) left ``fan_outs``
    up for good: BLAS stayed at one thread and whole calls off for the rest of the process
    (tests/server/test_interrupt_anywhere.py then this module: ``fan_outs`` 2-3, not 0). Each
    delivery point (a Python function's entry, a C function's return) interrupted in turn."""
    import sys

    rule = ct.ThreadRule(cores=2)
    rule.adapt_blas, rule._blas_now = True, None
    rule._apply_blas = lambda n: rule.__dict__.setdefault("applied", n)   # a Python call
    points = 0
    for k in range(1, 200):
        fired = []
        sys.setprofile(profile_interrupt_at(k, fired))
        try:
            with rule.fan_out():
                pass
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        assert rule.fan_outs == 0, (k, fired)
        if not fired:
            break
        points += 1
    assert points >= 3, points


# -- the CPU quota (cgroup v2 cpu.max, v1 cfs quota/period), on fake trees ---------------------
V2_MOUNT = "41 31 0:38 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = ("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n"
             "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
             "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")


def _tree(tmp_path, cgroup: str, mountinfo: str, files: dict) -> str:
    """A fake root: proc/self/cgroup, proc/self/mountinfo and the cgroup files given."""
    for rel, text in {"proc/self/cgroup": cgroup, "proc/self/mountinfo": mountinfo,
                      **files}.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(tmp_path)


@pytest.fixture
def many_cores(monkeypatch):
    """A process allowed on 64 CPUs, no OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))


def test_cgroup_v2_quota_caps_the_cores_rounded_up(tmp_path, many_cores, monkeypatch):
    root = _tree(tmp_path, "0::/kubepods/pod1/ctr\n", V2_MOUNT, {
        "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "150000 100000\n",   # 1.5 cores
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "max 100000\n",
        "sys/fs/cgroup/kubepods/cpu.max": "400000 100000\n"})
    assert ct.cpu_quota(root) == 1.5
    assert ct.available_cores(root) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert ct.available_cores(root) == 5                  # the user's setting wins


def test_a_parents_tighter_quota_wins_and_no_quota_leaves_the_affinity(tmp_path, many_cores):
    root = _tree(tmp_path, "0::/a/b\n", V2_MOUNT, {
        "sys/fs/cgroup/a/b/cpu.max": "800000 100000\n",
        "sys/fs/cgroup/a/cpu.max": "25000 50000\n"})      # half a core above it
    assert ct.cpu_quota(root) == 0.5
    assert ct.available_cores(root) == 1                  # at least one
    free = _tree(tmp_path / "free", "0::/a\n", V2_MOUNT, {"sys/fs/cgroup/a/cpu.max": "max\n"})
    assert ct.cpu_quota(free) is None
    assert ct.available_cores(free) == 64
    assert ct.cpu_quota(str(tmp_path / "nothing")) is None       # no /proc files: no limit
    assert ct.available_cores(str(tmp_path / "nothing")) == 64


def test_cgroup_v1_cfs_quota_inside_a_container_mount(tmp_path, many_cores):
    # v1, no cgroup namespace: the process's path /docker/abc is the mount's root, so the
    # container's own files sit at the mount point (the hybrid v2 line has no cpu.max)
    cgroup = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n"
    root = _tree(tmp_path, cgroup, V1_MOUNTS.format(root="/docker/abc") + V2_MOUNT.replace(
        "/sys/fs/cgroup ", "/sys/fs/cgroup/unified "), {
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/unified/docker/abc/cpu.pressure": ""})
    assert ct.cpu_quota(root) == 3.0
    assert ct.available_cores(root) == 3
    nolimit = _tree(tmp_path / "n", "4:cpu,cpuacct:/\n", V1_MOUNTS.format(root="/"), {
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert ct.cpu_quota(nolimit) is None


def test_a_quota_above_the_affinity_mask_leaves_the_mask(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    root = _tree(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "1600000 100000\n"})
    assert ct.cpu_quota(root) == 16.0
    assert ct.available_cores(root) == 2


# -- the CPU share: fewer threads while the process gets less CPU than its threads want --------
class _Counters:
    """A fake ``/proc/thread-self/schedstat``: ns on the cpu and ns waiting for one."""

    def __init__(self):
        self.run = self.wait = 0

    def add(self, run_ms, wait_ms):
        self.run += run_ms * 1_000_000
        self.wait += wait_ms * 1_000_000

    def __call__(self):
        return self.run, self.wait


def test_cpu_share_marks_a_busy_host_and_frees_it_with_hysteresis():
    counters, cpu = _Counters(), [0.0]
    share = ct.CpuShare(window_s=0.2, low=0.6, high=0.9, read=counters,
                        cpu_time=lambda: cpu[0])
    t = 100.0
    share.sample(2, t)                                 # the first reading: a baseline
    assert share.cores(2) == 2 and not share.busy
    for run, wait, used, busy, cores in (
            (190, 10, 1.9, False, 2),                  # quiet: 0.95 of what it wanted
            (100, 100, 1.0, True, 1),                  # 2 busy neighbours, 2 threads: 0.5
            (134, 66, 0.7, True, 1),                   # 1 thread: 0.67, still busy
            (5, 5, 0.1, True, 1),                      # under 20 ms runnable: no reading
            (195, 5, 1.0, False, 2),                   # the neighbours left: 0.975
            (80, 120, 1.9, False, 2),                  # waiting for its own threads: not busy
            (80, 120, 0.8, True, 1),                   # for other processes' threads: busy
            (100, 100, 1.6, False, 2)):                # the process has the cores again
        t += 0.25
        counters.add(run, wait)
        cpu[0] += used * 0.25
        share.sample(2, t)
        assert (share.busy, share.cores(2)) == (busy, cores), (run, wait, used)
    counters.add(10, 190)
    share.sample(2, t + 0.1)                           # within the window: not read
    assert share.share == 0.5
    assert ct.CpuShare(read=counters).cores(16) == 16
    share.share, share.busy = 0.5, True
    assert share.cores(16) == 8


def test_the_rule_shares_out_fewer_cores_on_a_busy_host(monkeypatch):
    rule, lib = _rule_with_fake_blas(monkeypatch)
    rule.enter()
    assert rule.threads() == 2 and lib.calls == [1]
    rule.exit()
    rule.cpu.busy, rule.cpu.share = True, 0.3
    rule.enter()
    assert rule.threads() == 1 and lib.calls == [1]    # BLAS stays at one thread
    rule.exit()


def test_the_process_reads_its_threads_scheduler_counters():
    read = ct.ProcessSchedstat()
    got = read()
    if got is None:
        pytest.skip("no /proc/self/task/*/schedstat")

    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass
    run, wait = read()
    assert run - got[0] >= 40_000_000 and wait >= got[1]


def _rule_with_fake_blas(monkeypatch):
    for var in ct.BLAS_ENV:
        monkeypatch.delenv(var, raising=False)

    class Lib:
        def __init__(self):
            self.calls = []

        def set_num_threads(self, n):
            self.calls.append(n)

    rule, lib = ct.ThreadRule(cores=2), Lib()
    rule._blas = [lib]
    rule.cpu = ct.CpuShare(read=lambda: None)
    rule.whole = ct.WholeCalls(mode="0")               # pieces only (whole calls: own tests)
    return rule, lib


def test_fan_out_uses_no_more_threads_than_asked_when_the_pool_is_larger():
    pool, lock, seen = ct.FanOutPool(), threading.Lock(), set()
    pool.run(lambda p: time.sleep(0.001), range(40), 4)         # the pool grows to 3 threads

    def fn(p):
        time.sleep(0.002)
        with lock:
            seen.add(threading.get_ident())

    pool.run(fn, range(40), 2)
    assert len(pool._threads) == 3 and 1 <= len(seen) <= 2


def test_the_default_share_rule_keeps_every_thread_beside_busy_neighbours_even_starved():
    # with the kernels' work dealt out in small pieces to sleeping threads, 2 threads beat 1
    # beside busy processes at every share measured (the CpuShare docstring's figures): the
    # default rule never cuts the threads (before: a share under 0.1 meant 1 thread of 2),
    # while a rule given a threshold still does
    counters, cpu = _Counters(), [0.0]
    share = ct.CpuShare(read=counters, cpu_time=lambda: cpu[0])
    cut = ct.CpuShare(low=0.1, read=counters, cpu_time=lambda: cpu[0])
    t = 100.0
    share.sample(2, t)
    cut.sample(2, t)
    for run, wait, used, cut_cores in (
            (100, 100, 1.0, 2),                        # 2 busy neighbours, 2 threads: 0.5
            (40, 160, 0.4, 2),                         # 8 of them: 0.2
            (10, 190, 0.1, 1),                         # starved: 0.05
            (4, 196, 0.04, 1),                         # 0.02
            (80, 120, 0.4, 2)):                        # 0.4
        t += 0.25
        counters.add(run, wait)
        cpu[0] += used * 0.25
        share.sample(2, t)
        cut.sample(2, t)
        assert not share.busy and share.cores(2) == 2, (run, wait, used)
        assert share.share == pytest.approx(run / (run + wait))     # still read
        assert cut.cores(2) == cut_cores, (run, wait, used)


def test_the_process_share_sums_every_thread_and_never_goes_back(tmp_path):
    # the threads a kernel waits for (fan-out, numba) count, not only the worker; a thread
    # that ends takes its counters with it without the totals going back
    def write(tid, run, wait):
        d = tmp_path / str(tid)
        d.mkdir(exist_ok=True)
        (d / "schedstat").write_text(f"{run} {wait} 7\n")
    write(1, 100, 10)
    write(2, 50, 40)
    read = ct.ProcessSchedstat(str(tmp_path))
    assert read() == (150, 50)
    write(2, 80, 90)
    import shutil
    shutil.rmtree(tmp_path / "1")                      # thread 1 ended
    write(3, 5, 5)                                     # thread 3 started
    assert read() == (185, 105)
    assert ct.ProcessSchedstat(str(tmp_path / "none"))() is None
    real = ct.ProcessSchedstat()()
    if real is not None:                               # this process's own threads
        assert real[0] > 0


def test_the_blas_owner_runs_every_call_on_one_thread_and_hands_errors_back():
    owner, seen = ct.BlasOwner(), []
    for _ in range(2):
        t = threading.Thread(target=lambda: seen.append(owner.call(threading.get_ident)))
        t.start()
        t.join()
    seen.append(owner.call(threading.get_ident))
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        owner.call(lambda: 1 / 0)
    assert owner.call(lambda: 5) == 5


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_whole_calls_stop_on_a_busy_window_and_are_tried_again_after_a_growing_pause(
        monkeypatch):
    # one call on OpenBLAS's own threads while the calling thread is on a core for the whole
    # call; beside busy processes it waits for its partner and is preempted or yields: pieces
    # for a pause that grows while tries fail (0.5, 2, then 4 s here) and is back to 0.5 s after
    # a good window
    clock, used = _Clock(), [0.0]
    w = ct.WholeCalls(low=0.8, window_s=0.03, backoff_s=0.5, max_backoff_s=4.0, growth=4.0,
                      mode="auto", clock=clock, cpu_time=lambda: used[0])
    assert w.windows == 2
    assert w.allowed() and w.on
    w.record(0.03, 0.0)                                # the process's first window: not read
    assert w.on and w.share is None and w.stops == 0
    w.record(0.02, 0.019)                              # under one window: no reading
    assert w.share is None and w.on
    w.record(0.02, 0.019)                              # 0.95: the cores are the process's
    assert w.on and w.share == pytest.approx(0.95)
    w.record(0.03, 0.012)                              # one low window (0.4): a blip
    assert w.on and w.share == pytest.approx(0.4) and w.stops == 0
    w.record(0.01, 0.0095)
    w.record(0.01, 0.003)                              # off its core 7.5 ms of 20: under 0.8
    assert not w.on and w.stops == 1 and not w.allowed()   # before the window is full
    assert w.share == pytest.approx(0.625)
    w.record(0.1, 0.0)                                 # a call that started before the stop
    assert w.stops == 1
    for pause in (0.5, 2.0, 4.0, 4.0):                 # tries that fail: the pause grows
        clock.t += pause - 0.01
        assert not w.allowed()
        clock.t += 0.02
        assert w.allowed() and w.on                    # one window is tried
        w.record(0.03, 0.012)
        assert not w.on
    clock.t += 4.01
    assert w.allowed()
    w.record(0.03, 0.029)                              # free again
    assert w.on and w.stops == 5
    w.record(0.03, 0.0)
    w.record(0.03, 0.0)                                # the next stop pauses 0.5 s again
    clock.t += 0.51
    assert w.allowed()
    # off its core while the process itself used the call's cores (a capture recording beside
    # the worker, its HTTP server): its own threads' doing, no stop
    w.record(0.01, 0.005, 2)
    clock.t += 0.02
    used[0] += 0.0585                                  # 1.95 of its 2 cores over the window
    w.record(0.02, 0.005, 2)
    assert w.on and w.share == pytest.approx(1 / 3) and w.used == pytest.approx(1.95)
    assert w.stops == 6
    for _ in range(2):                                 # 1.6 cores: a server's threads
        w.record(0.01, 0.005, 2)                       # beside busy processes still get
        clock.t += 0.02                                # that much: not the process alone
        used[0] += 0.048
        w.record(0.02, 0.005, 2)
    assert not w.on and w.stops == 7
    for mode, on in (("0", False), ("1", True)):      # fixed: never read, never changes
        f = ct.WholeCalls(mode=mode, clock=clock)
        f.record(1.0, 0.0)
        clock.t += 100
        assert f.allowed() is on and f.stops == 0 and f.share is None
    monkeypatch.setenv("RUNTIME_CPU_WHOLE", "0")
    assert not ct.WholeCalls().allowed()
    monkeypatch.setenv("RUNTIME_CPU_WHOLE", "auto")
    assert ct.WholeCalls().allowed()


def test_the_rule_makes_whole_calls_alone_on_a_free_host_and_sizes_blas_for_them(monkeypatch):
    rule, lib = _rule_with_fake_blas(monkeypatch)
    clock = _Clock()
    rule.whole = ct.WholeCalls(window_s=0.01, clock=clock, cpu_time=lambda: 0.0)
    rule.whole._cold, rule.whole.windows = 0, 1        # no cold first window; stop at once
    rule.enter()                                       # alone, whole calls on: BLAS untouched
    assert lib.calls == []
    assert rule.whole_call() == 2 and lib.calls == [2]
    assert rule.whole_call() == 2 and lib.calls == [2]     # set once
    with rule.fan_out():                               # pieces running: BLAS at 1, no whole
        assert rule.whole_call() == 0
    assert lib.calls == [2, 1]
    rule.enter()                                       # a second item: one thread each
    assert rule.threads() == 1 and rule.whole_call() == 0
    rule.exit()
    assert rule.whole_call() == 2 and lib.calls == [2, 1, 2]
    rule.whole.record(0.02, 0.006)                     # a busy window: pieces from now on
    assert rule.whole_call() == 0
    rule.exit()
    rule.enter()                                       # an item with whole calls off: BLAS 1
    assert lib.calls == [2, 1, 2, 1]
    clock.t += 1.0                                     # the pause is over: tried again
    assert rule.whole_call() == 2
    rule.cpu.busy, rule.cpu.share = True, 0.05         # a starved host: one thread, no whole
    assert rule.whole_call() == 0
    rule.cpu.busy = False
    rule.fix_blas()                                    # BLAS left alone: no whole calls
    assert rule.whole_call() == 0
    rule.exit()


def _interrupted_runs(code, offsets, exc, run, when=None):
    """For each offset: ``run()`` on a thread with ``exc`` injected at that instruction of
    ``code`` (threads started meanwhile are traced: the pool's, the owner's); returns
    ``[(offset, hit, outcome)]``, outcome ``"hang"`` when it did not end within 5 s."""
    from helpers import interrupting_tracer
    outcomes = []
    for off in offsets:
        hit, box = [], []
        threading.settrace(interrupting_tracer(code, off, exc, hit, when=when))
        try:
            def target():
                try:
                    box.append(run())
                except BaseException as e:  # noqa: BLE001 - recorded
                    box.append(type(e).__name__)
            t = threading.Thread(target=target, daemon=True)
            t.start()
            t.join(5.0)
        finally:
            threading.settrace(None)
        outcomes.append((off, bool(hit), "hang" if t.is_alive() else box[0]))
    return outcomes


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("exc", [KeyboardInterrupt, TimeoutError])
def test_an_interrupted_fan_out_thread_never_leaves_its_caller_waiting(exc):
    """Kind 4 (every wait has a way out): an asynchronous exception landing in a pool thread
    between taking a piece and counting it (noticed by ADV5, fixed by ADV6) left the job's
    count above 0 for ever: the caller (a stream worker running attention) and its stream
    hung. Every point after a call in ``_Job.work`` and ``FanOutPool._loop``, on a pool
    thread: ``run`` returns or raises the exception, never hangs."""
    from helpers import after_calls
    on_pool = lambda: threading.current_thread().name.startswith("runtime-cpu-kernel")  # noqa: E731
    bad = []
    for fn in (ct._Job.work, ct.FanOutPool._loop):
        pool = None

        def run():
            nonlocal pool
            pool = ct.FanOutPool()
            pool.run(lambda p: time.sleep(0.002), range(12), 3)
            return "ok"
        for off, hit, outcome in _interrupted_runs(fn.__code__, after_calls(fn), exc, run,
                                                  when=on_pool):
            assert outcome in ("ok", exc.__name__, "hang"), (fn.__name__, off, outcome)
            if outcome == "hang":
                bad.append((fn.__name__, off))
    assert not bad, f"fan-out callers hung after an interrupt at {bad}"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_blas_owner_interrupted_with_a_call_taken_never_leaves_the_caller_waiting():
    """The owner thread interrupted after it took a call and before it answered: the caller
    waited in ``done.wait()`` for ever; now it runs the call itself once the owner is gone."""
    from helpers import after_calls
    fn = ct.BlasOwner._loop

    def run():
        owner = ct.BlasOwner(timeout_s=0.2)
        return [owner.call(lambda: 7) for _ in range(3)]
    outcomes = _interrupted_runs(fn.__code__, after_calls(fn), KeyboardInterrupt, run)
    assert any(hit for _, hit, _ in outcomes)
    assert all(o in ([7, 7, 7], "KeyboardInterrupt") for _, _, o in outcomes), outcomes
