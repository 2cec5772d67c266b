"""A thread the runtime starts that dies before it runs never hangs its starter (SOAK7).

On CPython 3.10/3.11 an asynchronous exception aimed at a thread that is starting another
(``PyThreadState_SetAsyncExc``: a watchdog, a harness interrupting calls) can land in the new
thread, which then dies before ``Thread.start`` hears from it: ``start`` waited for ever. In
``runtime.client()`` that wait held the server table's lock, so the whole process's later
``runtime.client()`` calls hung too (the soak: 1 in ~1,000 interrupted requests). Here the
new thread's death is made certain (its ``_bootstrap`` raises, as the misdirected exception
does) instead of waiting for the race; each scenario runs in a fresh interpreter under a
timeout, so the old code fails the test instead of hanging the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""
    import threading
    import numpy as np
    import runtime
    from runtime import kernels as K
    from runtime.errors import ServerClosed
    try:
        from runtime import _threads
        _threads.START_S = 0.5
    except ImportError:                     # (the code before SOAK7: it hangs)
        pass
    _plain = threading.Thread._bootstrap
    doomed = set()

    def _bootstrap(self):
        # the new thread dies before it runs, as when the starter's async exception lands there
        if self.name in doomed:
            doomed.discard(self.name)
            raise KeyboardInterrupt
        return _plain(self)
    threading.Thread._bootstrap = _bootstrap

    def use(c):
        x, y = c.create(np.arange(4, dtype=np.float32)), c.empty(4, np.float32)
        c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
        return c.read(y).tolist()
""")


def _run(body: str, timeout: float = 60) -> str:
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-4000:]}"
    return out.stdout


@pytest.mark.parametrize("thread", ["runtime-cpu:0", "runtime-cpu-worker-2"])
def test_a_server_thread_that_dies_before_it_runs_fails_runtime_client_and_the_next_one_works(thread):
    """The device thread (started under the server table's lock) or one of the cpu backend's
    workers dies before it runs: ``runtime.client`` raises ``ServerClosed`` naming the thread,
    the workers already started end, and the next ``runtime.client`` (any thread) gets a
    working server."""
    out = _run(f"""
        before = {{t for t in threading.enumerate()}}
        doomed.add({thread!r})
        try:
            runtime.client("cpu")
            raise SystemExit("no error")
        except ServerClosed as e:
            assert {thread!r} in str(e) and "did not start" in str(e), e
        for t in threading.enumerate():
            if t not in before:
                t.join(10)
        left = [t.name for t in threading.enumerate() if t not in before]
        assert not left, left
        box = []
        other = threading.Thread(target=lambda: box.append(use(runtime.client("cpu"))))
        other.start()
        other.join(60)
        assert box == [[1.0, 2.0, 3.0, 4.0]], box
        assert use(runtime.client("cpu")) == [1.0, 2.0, 3.0, 4.0]
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_thread_given_up_on_does_nothing_if_it_starts_late():
    """``_threads.start`` returns False after its limit and drops the target, so a thread that
    was only slow runs nothing when it does start."""
    out = _run("""
        ran = []
        gate = threading.Event()
        _slow = threading.Thread._bootstrap

        def _late(self):
            gate.wait(30)
            return _slow(self)
        threading.Thread._bootstrap = _late
        t = threading.Thread(target=lambda: ran.append(1), daemon=True)
        assert _threads.start(t, limit_s=0.2) is False
        assert t not in threading.enumerate()
        gate.set()
        assert t._started.wait(10)
        t.join(10)
        assert ran == [] and not t.is_alive(), ran
        threading.Thread._bootstrap = _slow
        u = threading.Thread(target=lambda: ran.append(2), daemon=True)
        assert _threads.start(u) is True
        u.join(10)
        assert ran == [2], ran
        print("ok")
    """)
    assert out.strip() == "ok"


def test_cpu_kernel_threads_that_die_before_they_run_leave_the_work_done_on_the_caller():
    """The BLAS owner and a fan-out helper die before they run (their starter interrupted):
    the call runs on the calling thread and the pool's later jobs still use every thread
    (the fan-out held its lock through the hung start, so every later fan-out of the process
    hung with it)."""
    out = _run('''
        from runtime.cpu_threads import BLAS_OWNER, FAN_OUT
        doomed.update({"runtime-blas-owner", "runtime-cpu-kernel-1"})
        assert BLAS_OWNER.call(lambda: 41 + 1) == 42
        assert BLAS_OWNER.call(threading.get_ident) != threading.get_ident()   # a new owner
        got = []
        lock = threading.Lock()

        def piece(p):
            with lock:
                got.append(p * p)
        FAN_OUT.run(piece, range(12), 3)
        assert sorted(got) == [p * p for p in range(12)], got
        names = sorted(t.name for t in FAN_OUT._threads)
        assert names == ["runtime-cpu-kernel-0"], names
        got.clear()
        FAN_OUT.run(piece, range(12), 3)
        assert sorted(got) == [p * p for p in range(12)], got
        assert len(FAN_OUT._threads) == 2 and all(t.is_alive() for t in FAN_OUT._threads)
        print("ok")
    ''')
    assert out.strip() == "ok"


def _until_gone(before, limit_s: float = 20.0) -> list:
    """The threads not in ``before`` still listed after up to ``limit_s`` seconds."""
    import threading
    import time
    deadline = time.monotonic() + limit_s
    while True:
        left = [t for t in threading.enumerate() if t not in before]
        if not left or time.monotonic() > deadline:
            return [t.name for t in left]
        time.sleep(0.01)


@pytest.mark.parametrize("where", ["runtime-cpu-worker-0", "runtime-cpu-worker-2",
                                   "runtime-cpu:0", "after the device thread"])
def test_an_interrupt_landing_while_runtime_client_starts_a_server_leaves_no_thread(
        where, monkeypatch):
    """An asynchronous exception (KeyboardInterrupt) landing in ``runtime.client()`` while it
    builds a server: just after a cpu worker or the device thread started, or after the device
    queue was made. The old code left the threads already started running for a server
    nobody had (a soak making servers per tenant with interrupts: 47 interrupts left 63
    threads). Now they end, nothing is listed in the server table, and the next
    ``runtime.client()`` with the same options works."""
    import threading

    import numpy as np

    import runtime
    from runtime.server import _servers
    from runtime.server import server as server_mod

    before = set(threading.enumerate())
    plain_start, plain_watch = threading.Thread.start, server_mod.watch_thread_ends

    def start(self):
        plain_start(self)
        if self.name.split(" (")[0] == where:
            raise KeyboardInterrupt("test: lands just after the thread started")

    def watch(srv):
        raise KeyboardInterrupt("test: lands after the device queue was made")
    if where == "after the device thread":
        monkeypatch.setattr(server_mod, "watch_thread_ends", watch)
    else:
        monkeypatch.setattr(threading.Thread, "start", start)
    opts = {"max_idle_bytes": (1 << 21) + 17}
    with pytest.raises(KeyboardInterrupt):
        runtime.client("cpu", **opts)
    monkeypatch.setattr(threading.Thread, "start", plain_start)
    monkeypatch.setattr(server_mod, "watch_thread_ends", plain_watch)
    assert _until_gone(before) == []
    assert not [k for k in _servers if dict(k[2]) == opts], list(_servers)
    c = runtime.client("cpu", **opts)
    try:
        x = c.create(np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(c.read(x), [0, 1, 2, 3])
    finally:
        c.shutdown()


def test_a_backend_whose_import_was_interrupted_is_not_unavailable_for_good(tmp_path, monkeypatch):
    """SOAK7: three threads opening the wgpu backend at once, interrupted (KeyboardInterrupt),
    left ``pycparser`` re-imported without its ``c_ast`` attribute (a package binds a
    submodule only when it loads it, and the interrupted import left it loaded), so the probe
    failed with ``AttributeError`` and the backend was cached as "unavailable here" for the
    life of the process. Here a package whose import is interrupted once stands for it."""
    import builtins
    import sys

    import numpy as np

    import runtime
    from runtime import server as S

    pkg = tmp_path / "soak7pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import soak7pkg.a\nimport soak7pkg.b\n")
    (pkg / "a.py").write_text("value = 41\n")
    (pkg / "b.py").write_text("import builtins\n"
                              "if getattr(builtins, 'soak7_interrupt', False):\n"
                              "    builtins.soak7_interrupt = False\n"
                              "    raise KeyboardInterrupt('test: lands in the import')\n")
    (tmp_path / "soak7be.py").write_text(
        "import soak7pkg\n"
        "from runtime.backends.cpu import CpuBackend\n"
        "class Backend(CpuBackend):\n"
        "    @staticmethod\n"
        "    def probe():\n"
        "        assert soak7pkg.a.value == 41\n"
        "        return CpuBackend.probe()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(S.BACKENDS, "soak7", ("soak7be", "Backend"))
    monkeypatch.setattr(builtins, "soak7_interrupt", True, raising=False)
    try:
        with pytest.raises(KeyboardInterrupt):
            runtime.client("soak7")
        assert "soak7pkg.a" in sys.modules and "soak7pkg" not in sys.modules
        c = runtime.client("soak7")
        x = c.create(np.arange(3, dtype=np.float32))
        np.testing.assert_array_equal(c.read(x), [0, 1, 2])
        c.shutdown()
        assert S.backend_unavailable("soak7") is None
    finally:
        S._probes.pop("soak7", None)
        for m in [m for m in sys.modules if m.startswith(("soak7pkg", "soak7be"))]:
            del sys.modules[m]


def test_a_backend_whose_library_starts_threads_is_opened_on_a_thread_nobody_interrupts(
        monkeypatch):
    """SOAK7 (wgpu soak with interrupts): a KeyboardInterrupt aimed at a caller of
    ``runtime.client("wgpu")`` landed in the poll thread wgpu-py's ``GPUDevice.__init__``
    was starting, which died before it ran; wgpu-py's ``Thread.start`` waited for ever, under
    the server table's lock: every later ``runtime.client()`` hung. A backend declaring
    ``foreign_threads`` is now constructed on a private thread: the interrupt lands in the
    caller's wait and propagates, and the backend finished after it is closed."""
    import ctypes
    import threading

    import numpy as np

    import runtime
    from runtime import server as S
    from runtime.backends.cpu import CpuBackend

    gate, entered, closed, opened_on = threading.Event(), threading.Event(), [], []

    class Foreign(CpuBackend):
        foreign_threads = True

        def __init__(self, device=0):
            opened_on.append(threading.get_ident())
            entered.set()
            assert gate.wait(30)
            super().__init__(device)

        def close(self):
            closed.append(self)
            super().close()
    monkeypatch.setitem(S.BACKENDS, "foreign7", Foreign)
    before = set(threading.enumerate())
    box = []

    def caller():
        try:
            runtime.client("foreign7")
            box.append("returned")
        except KeyboardInterrupt:
            box.append("interrupted")
    t = threading.Thread(target=caller)
    t.start()
    try:
        assert entered.wait(30)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident),
                                                   ctypes.py_object(KeyboardInterrupt))
        t.join(30)
        assert box == ["interrupted"] and opened_on[0] != t.ident
    finally:
        gate.set()
    assert _until_gone(before) == [] and len(closed) == 1
    c = runtime.client("foreign7")
    try:
        np.testing.assert_array_equal(c.read(c.create(np.arange(3, dtype=np.float32))), [0, 1, 2])
    finally:
        c.shutdown()
        S._probes.pop("foreign7", None)


def test_the_runtimes_frame_walks_run_with_the_cyclic_gc_off(monkeypatch):
    """SOAK9: on CPython 3.11 ``sys._current_frames()`` holds the thread-list lock while it
    builds its dict; a gc collection starting there runs weakref callbacks, which can hand the
    GIL to a thread starting a thread, which then waits for that lock holding the GIL: a
    fork's wait for BLAS calls (``cpu_threads._before_fork``, walking frames) hung so beside a
    matmul starting its fan-out threads (CPython gh-106883). The runtime's frame walks go
    through ``runtime._threads.current_frames``, which turns the gc off meanwhile (and back on:
    an interrupt landing in it never leaves it off)."""
    import gc
    import threading

    from runtime import _threads, cpu_threads
    from runtime.server import queue

    seen = []
    monkeypatch.setattr(sys, "_current_frames", lambda: seen.append(gc.isenabled()) or {})
    assert gc.isenabled()
    assert _threads.current_frames() == {} and seen == [False] and gc.isenabled()
    assert cpu_threads._current_frames is _threads.current_frames
    queue._running_a_message()                      # the device thread's walk
    assert seen == [False, False] and gc.isenabled()
    cpu_threads.WHOLE_CODES.add(test_the_runtimes_frame_walks_run_with_the_cyclic_gc_off.__code__)
    try:
        cpu_threads._before_fork()                  # a fork's
    finally:
        cpu_threads.WHOLE_CODES.discard(
            test_the_runtimes_frame_walks_run_with_the_cyclic_gc_off.__code__)
        cpu_threads._after_fork_in_parent()
    assert seen == [False] * 3 and gc.isenabled() and threading.active_count() >= 1
