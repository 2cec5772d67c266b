"""The cpu thread rule's leaf module (``runtime.cpu_threads``): it stands alone (imports nothing
from ``runtime``), the old import paths still reach the same objects, and the fan-out pool hands
pieces out one at a time, so a thread that does not get to run holds up one piece only."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

import runtime.cpu_threads as ct

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

    with pytest.raises(KeyError, match="piece 3"):
        pool.run(fn, range(200), 2)
    assert len(ran) < 200
    assert ct.RULE.fan_outs == 0                          # BLAS back under the rule
    pool.run(lambda p: ran.append(p), range(4), 2)        # the pool still works
