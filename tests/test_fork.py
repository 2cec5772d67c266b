"""Fork safety (issue 24 item 4): after the cpu backend ran numba kernels (layer norm), a forked
child (``os.fork``, ``multiprocessing`` with the ``fork`` start method, ``ProcessPoolExecutor``
with it) runs them too, on a fresh server of its own, with values equal to numpy's; a parent's
client, handle or graph used in the child raises ``ServerForked``; the parent goes on working.

Each scenario runs in a fresh interpreter (so its parent really started numba's pool and the
cpu workers first) under a timeout, and every wait inside has one: a regression fails the test
instead of hanging the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")

PRELUDE = textwrap.dedent("""
    import os, sys, threading, time
    import multiprocessing as mp
    import concurrent.futures as cf
    import numpy as np
    import runtime
    from runtime.tensor import Tensor

    H = 384

    def inputs(seed):
        rng = np.random.default_rng(seed)
        return (rng.standard_normal((64, H)).astype(np.float32),
                rng.standard_normal((64, H)).astype(np.float32),
                rng.standard_normal(H).astype(np.float32), rng.standard_normal(H).astype(np.float32))

    def reference(seed):
        x, r, g, b = (a.astype(np.float64) for a in inputs(seed))
        v = x + r
        d = v - v.mean(-1, keepdims=True)
        return d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-12) * g + b

    def layer_norm(seed, c=None):
        # add + layer norm on the cpu backend (numba's parallel loops); the max error vs numpy
        c = c or runtime.client("cpu")
        x, r, g, b = (Tensor.from_numpy(c, a) for a in inputs(seed))
        got = x.layer_norm(g, b, residual=r).numpy()
        return float(np.abs(got - reference(seed)).max())

    def wait_child(pid, timeout=60.0):
        # the child's exit status, or kill it and fail after `timeout` seconds
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise SystemExit(f"child {pid} hung")

    assert layer_norm(0) < 1e-4                      # the parent ran numba kernels first
""")


def _run(body: str, timeout: float = 240) -> str:
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-4000:]}"
    return out.stdout


def test_os_fork_child_gets_a_fresh_server_and_the_parents_objects_raise_server_forked():
    out = _run("""
        c = runtime.client("cpu")
        h = c.create(np.arange(8, dtype=np.float32))
        y = c.empty(32)
        c.graph_prepare()
        c.launch(runtime.kernels.add_scalar, runtime.kernels.grid(8), [h, y],
                 {"alpha": 1.0, "n": 8})
        c.start_capture()
        c.launch(runtime.kernels.add_scalar, runtime.kernels.grid(8), [h, y],
                 {"alpha": 1.0, "n": 8})
        g = c.stop_capture()
        stop = threading.Event()

        def busy():                            # another thread mid-work at the fork
            s = c.with_stream(runtime.StreamId.new())
            while not stop.is_set():
                layer_norm(1, s)

        t = threading.Thread(target=busy)
        t.start()
        time.sleep(0.3)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(r)
                lines = []
                for what, fn in (("client", lambda: c.read(h)), ("graph", g.replay),
                                 ("sync", c.sync)):
                    try:
                        fn()
                        lines.append(f"{what}: no error")
                    except runtime.ServerForked as e:
                        lines.append(f"{what}: ServerForked fork={'fork' in str(e)}")
                c2 = runtime.client("cpu")
                assert c2._server is not c._server   # private: a fresh server after the fork
                try:
                    c2.read(h)
                    lines.append("handle: no error")
                except runtime.ServerForked:
                    lines.append("handle: ServerForked")
                lines.append(f"child error {layer_norm(2) < 1e-4}")
                x = c2.create(np.arange(8, dtype=np.float32))
                lines.append(f"child read {c2.read(x).view(np.float32)[3]}")
                os.write(w, "\\n".join(lines).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        status = wait_child(pid)
        with os.fdopen(r) as f:
            print(f.read())
        stop.set()
        t.join(30)
        print(f"status {status}")
        print(f"parent error {layer_norm(3) < 1e-4}")
        g.replay()
        print(f"parent graph {c.read(y).view(np.float32)[:8].tolist()}")
    """)
    assert out.split("\n") == [
        "client: ServerForked fork=True", "graph: ServerForked fork=True",
        "sync: ServerForked fork=True", "handle: ServerForked", "child error True",
        "child read 3.0", "status 0", "parent error True",
        "parent graph [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]", ""]


def test_multiprocessing_pool_with_fork_maps_numba_kernels():
    out = _run("""
        with mp.get_context("fork").Pool(2) as pool:
            errors = pool.map_async(layer_norm, range(6)).get(120)
        print(all(e < 1e-4 for e in errors), len(errors))
        print(layer_norm(7) < 1e-4)
    """)
    assert out.split() == ["True", "6", "True"]


def test_process_pool_executor_with_fork_maps_numba_kernels():
    out = _run("""
        with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as ex:
            errors = list(ex.map(layer_norm, range(6), timeout=120))
        print(all(e < 1e-4 for e in errors), len(errors))
    """)
    assert out.split() == ["True", "6"]


#: a fresh interpreter that has run nothing yet (no warm-up: the first work of the process is
#: what is pending at the fork), with the child's wait under a timeout
FRESH = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    import runtime
    from runtime.tensor import Tensor

    def wait_child(pid, timeout=60.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return "hung"

    def in_child(fn):
        # fork, run fn() in the child under a timeout; the child's exit status, or "hung"
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                import faulthandler
                faulthandler.dump_traceback_later(50, exit=True)
                fn()
                code = 0
            finally:
                os._exit(code)
        return wait_child(pid)
""")


def _run_fresh(body: str, timeout: float = 240) -> str:
    out = subprocess.run([sys.executable, "-c", FRESH + textwrap.dedent(body)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-4000:]}"
    return out.stdout


def test_a_fork_while_a_worker_imports_a_module_leaves_the_child_able_to_import_it(tmp_path):
    """A cpu worker importing a module at the fork (the runtime's first stream item imports
    threadpoolctl, its first nn kernel numba) held that module's import lock, which stays held
    in the child: its first import of the module hung forever (found by ADV2). The kernel here
    imports a module whose import waits until the parent forked."""
    (tmp_path / "slow_module.py").write_text(textwrap.dedent("""
        import time
        while not __import__("os").path.exists(__file__ + ".go"):
            time.sleep(0.01)
        VALUE = 7
    """))
    out = _run_fresh(f"""
        sys.path.insert(0, {str(tmp_path)!r})

        def body(y, *, count):
            import slow_module               # on a worker, blocked until after the fork
            y[:] = slow_module.VALUE
        k = runtime.Kernel("imports", [runtime.Binding("y", "f32", "write")], cpu=body)
        c = runtime.client("cpu")
        y = c.empty(1 << 20, np.float32)     # large: a worker runs it, not the caller
        c.launch(k, 1, [y])
        while "slow_module" not in sys.modules:
            time.sleep(0.005)

        def child():
            open({str(tmp_path / "slow_module.py")!r} + ".go", "w").close()
            cc = runtime.client("cpu")
            z = cc.empty(4, np.float32)
            cc.launch(k, 1, [z])
            assert cc.read(z).tolist() == [7.0] * 4
        print("child", in_child(child))
        print("parent", c.read(y)[:2].tolist())
    """)
    assert out.split() == ["child", "0", "parent", "[7.0,", "7.0]"]


@pytest.mark.parametrize("lock", ["numba", "llvm", "layer"])
def test_a_fork_while_a_worker_holds_numbas_compiler_lock_leaves_the_child_able_to_compile(lock):
    """A cpu worker compiling a numba loop (or loading it from numba's cache) at the fork held
    numba's compiler lock (and llvmlite's LLVM lock): the child's first compile waited for it
    forever (found by ADV2; the LLVM lock hung one run of the first-work test below). [layer]
    (SOAK9): one starting numba's threading layer (the process's first nn kernel) held the
    layer's start-up lock: the child's first nn kernel waited for it for ever (2 of ~30
    children of a fork beside two threads' first matmuls; fails on 4ca5ee2: the child hung)."""
    out = _run_fresh(f"""
        LOCK = {lock!r}""" + """
        from numba.core.compiler_lock import global_compiler_lock
        import llvmlite.binding.ffi
        held, go = threading.Event(), threading.Event()
        import numba.np.ufunc.parallel
        the_lock = {"numba": global_compiler_lock, "llvm": llvmlite.binding.ffi.lib._lock,
                    "layer": numba.np.ufunc.parallel._backend_init_thread_lock}[LOCK]
        runtime._fork.FORK_WAIT_S = 0.5     # the fork's wait for a compile gives up: the
                                            # child must still get the locks afresh

        def body(y, *, count):
            with the_lock:                   # as a compile on this worker does
                held.set()
                go.wait(30)
            y[:] = 1
        k = runtime.Kernel("compiles", [runtime.Binding("y", "f32", "write")], cpu=body)
        c = runtime.client("cpu")
        y = c.empty(1 << 20, np.float32)
        c.launch(k, 1, [y])
        assert held.wait(30)

        def child():
            cc = runtime.client("cpu")
            rng = np.random.default_rng(0)
            x = Tensor.from_numpy(cc, rng.standard_normal((8, 384)).astype(np.float32))
            g = Tensor.from_numpy(cc, np.ones(384, np.float32))
            b = Tensor.from_numpy(cc, np.zeros(384, np.float32))
            got = x.layer_norm(g, b).numpy()
            v = x.numpy().astype(np.float64)
            d = v - v.mean(-1, keepdims=True)
            want = d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-12)
            assert np.abs(got - want).max() < 1e-4
        print("child", in_child(child))
        go.set()
        print("parent", c.read(y)[0])
    """)
    assert out.split() == ["child", "0", "parent", "1.0"]


def test_a_fork_while_the_first_work_of_the_process_is_pending_leaves_a_working_child():
    """The first nn kernel of a fresh process pending on a worker (importing numba, loading its
    loops) at the fork: the child runs its own (it hung at the import before; found by ADV2).
    Forks at a few points of the parent's first kernel; each child must finish."""
    out = _run_fresh("""
        rng = np.random.default_rng(0)
        x = rng.standard_normal((64, 384)).astype(np.float32)

        def ln(c):
            t = Tensor.from_numpy(c, x)
            return t.layer_norm(Tensor.from_numpy(c, np.ones(384, np.float32)),
                                Tensor.from_numpy(c, np.zeros(384, np.float32)))
        c = runtime.client("cpu")
        pending = ln(c)
        statuses = []
        for delay in (0.0, 0.02, 0.05, 0.1, 0.2):
            time.sleep(delay)
            statuses.append(in_child(lambda: ln(runtime.client("cpu")).numpy()))
        print(statuses, pending.numpy().shape)
    """)
    assert out.strip() == "[0, 0, 0, 0, 0] (64, 384)"


def test_a_fork_while_a_worker_records_a_failure_leaves_the_child_able_to_fail():
    """A worker recording a failure at the fork (``Mark.fail`` holds the failure counter's
    lock for a few bytecodes) left that lock held in the child: its first failed launch hung
    (found by ADV2). The lock is held by a thread here, as that worker would."""
    out = _run_fresh("""
        from runtime.server.marks import Mark
        held, go = threading.Event(), threading.Event()

        def holder():
            with Mark._lock:
                held.set()
                go.wait(30)
        t = threading.Thread(target=holder)
        t.start()
        assert held.wait(30)

        def child():
            def fails(y, *, count):
                raise ValueError("planned")
            k = runtime.Kernel("fails", [runtime.Binding("y", "f32", "write")], cpu=fails)
            cc = runtime.client("cpu")
            y = cc.create(np.zeros(4, np.float32))
            cc.launch(k, 1, [y])
            try:
                cc.read(y)
            except runtime.ReplayFailed:
                return
            raise AssertionError("the failed launch's output read returned")
        print("child", in_child(child))
        go.set()
        t.join(30)
    """)
    assert out.split() == ["child", "0"]


def test_a_child_of_a_process_that_opened_a_wgpu_device_is_told_so_instead_of_hanging():
    """wgpu-native and the Vulkan driver (lavapipe here) do not survive a fork: a child of a
    process that opened a wgpu device hung forever at its own device's first submit (found by
    ADV2). It now gets ``UnsupportedError`` from ``runtime.client("wgpu")`` (as CUDA refuses a
    context inherited across fork), ``runtime.client()`` picks another backend, the cpu
    backend works, and the parent's wgpu server goes on."""
    from runtime.server import backend_unavailable
    why = backend_unavailable("wgpu")
    if why:
        pytest.skip(why)
    out = _run_fresh("""
        from runtime import kernels as K
        c = runtime.client("wgpu")
        x = c.create(np.arange(4, dtype=np.float32))
        y = c.empty(4, np.float32)
        c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
        c.sync()

        def child():
            try:
                runtime.client("wgpu")
                raise AssertionError("a wgpu client opened in the child")
            except runtime.UnsupportedError as e:
                assert "fork" in str(e), e
            d = runtime.client()
            assert d.backend != "wgpu"
            a = d.create(np.ones(4, np.float32))
            b = d.empty(4, np.float32)
            d.launch(K.add_scalar, 1, [a, b], {"alpha": 2.0, "n": 4})
            assert d.read(b).tolist() == [3.0] * 4
        print("child", in_child(child))
        c.launch(K.add_scalar, 1, [x, y], {"alpha": 5.0, "n": 4})
        print("parent", c.read(y).tolist())
    """)
    assert out.split() == ["child", "0", "parent", "[5.0,", "6.0,", "7.0,", "8.0]"], out


def test_a_child_calling_a_parents_graph_object_mid_call_gets_server_forked():
    """A parent thread inside a ``StaticGraph`` / ``runtime.capture`` graph call at the fork (a
    serving loop) held the object's lock for ever in the child: the child's call hung there
    instead of raising ``ServerForked`` (19 of 20 forks beside two busy threads; found by
    ADV2). The lock is held by a thread here, as that call would."""
    out = _run_fresh("""
        c = runtime.client("cpu")
        one = Tensor.from_numpy(c, np.ones(8, np.float32))
        sg = runtime.StaticGraph(c, inputs={"u": ((8,), "f32")}, outputs={"v": ((8,), "f32")},
                                 body=lambda u, v: {"v": u.add(one)})
        cg = runtime.capture(lambda: one.add(one), client=c)
        held, go = threading.Event(), threading.Event()

        def holder():
            with sg._lock, cg._lock:
                held.set()
                go.wait(30)
        t = threading.Thread(target=holder)
        t.start()
        assert held.wait(30)

        def child():
            for call in (lambda: sg(u=np.zeros(8, np.float32)), cg.replay, cg.read):
                try:
                    call()
                    raise AssertionError("a parent's graph ran in the child")
                except runtime.ServerForked:
                    pass
            cc = runtime.client("cpu")           # the child's own work goes on
            x = cc.create(np.ones(4, np.float32))
            assert cc.read(x).tolist() == [1.0] * 4
        print("child", in_child(child))
        go.set()
        t.join(30)
        print("parent", sg(u=np.zeros(8, np.float32))["v"].tolist()[:2], cg.read().tolist()[:2])
    """)
    assert out.split() == ["child", "0", "parent", "[1.0,", "1.0]", "[2.0,", "2.0]"], out


def test_a_parents_graph_pool_serves_the_childs_server():
    """ADV4: a module-level ``GraphPool`` the parent captured into stayed bound to the parent's
    server, so the forked child's first ``runtime.capture(..., pool=POOL)`` raised ValueError
    (gunicorn --preload, a DataLoader forking after a warm-up). The child's server takes it."""
    out = _run_fresh("""
        from runtime import kernels as K
        POOL = runtime.GraphPool()

        def work():
            c = runtime.client("cpu").with_stream(runtime.StreamId.new())
            x = c.create(np.ones(4, np.float32))
            y = c.empty(4, np.float32)
            g = runtime.capture(lambda: c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
                                or y, client=c, pool=POOL)
            g.replay()
            assert (c.read(y) == 2).all()
        work()
        print(in_child(work))
    """)
    assert out.strip() == "0"


def test_a_fork_while_another_thread_starts_or_stops_a_trace_leaves_the_child_able_to_trace():
    """ADV4: ``runtime.tracing._lock`` (held by ``runtime.trace()``'s start and stop, and by
    the traced ``backend_class``) had no at-fork renewal: a fork while another thread held it
    left the child's ``runtime.trace()`` (and, tracing on, its first ``runtime.client()``)
    waiting for ever."""
    out = _run_fresh("""
        from runtime import tracing
        held = threading.Event()
        done = threading.Event()

        def holder():                   # a thread inside start()/stop() at the fork
            with tracing._lock:
                held.set()
                done.wait(30)
        t = threading.Thread(target=holder, daemon=True)
        t.start()
        held.wait(10)

        def child():
            with runtime.trace(capacity=64):
                c = runtime.client("cpu")
                assert (c.read(c.create(np.ones(4, np.float32))) == 1).all()
        status = in_child(child)
        done.set()
        print(status)
    """)
    assert out.strip() == "0"


def test_a_fork_waits_for_a_blas_call_running_on_openblas_threads(monkeypatch):
    """SOAK9: a fork from one thread while another ran a matmul as one call on OpenBLAS's own
    threads (``nn._whole``) hung the forking process for ever, now and then (5 of 28 runs of a
    two-fork soak): OpenBLAS's fork handler stops its workers while one may still finish its
    share of the call, which then clears the stop order and sleeps; the handler waits for it in
    ``fork()``, with the GIL held. A fork now waits for such a call to end (and starts no new
    one meanwhile). Here the call is held inside ``_whole`` until a timer lets it go: the fork
    returns only after that."""
    import threading

    import numpy as np

    from runtime import cpu_threads
    from runtime.kernels import nn

    entered, release, released = threading.Event(), threading.Event(), []

    def whole_call():                   # inside _whole, where the threaded call would run
        entered.set()
        assert release.wait(30)
        return 0
    monkeypatch.setattr(cpu_threads.RULE, "whole_call", whole_call)
    a = np.ones((2, 2), np.float32)
    t = threading.Thread(target=nn._whole, args=(a, a, np.empty_like(a)), daemon=True)
    t.start()
    assert entered.wait(30)
    timer = threading.Timer(0.2, lambda: (released.append(True), release.set()))
    timer.start()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    seen = list(released)               # what the fork waited for
    assert os.waitpid(pid, 0)[1] == 0
    t.join(30)
    timer.join(30)
    assert seen == [True], "the fork ran while a thread was in a whole BLAS call"
    assert not cpu_threads._FORKING
