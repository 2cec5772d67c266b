"""The cpu backend's worker threads are not woken for work the caller runs itself.

A small write or launch is pushed ``defer=True`` (``ThreadScheduler``): the caller that waits
for it runs it. Only the polling worker may be woken (it runs deferred work no call waits for,
after ``DEFER_S``); the other workers stay asleep: each wake-up makes one more thread runnable
beside the caller's and a busy neighbour's (issue 30: our forward woke the four workers ~11
times). Counted with each worker thread's voluntary context switches (Linux ``/proc``).
"""

import os
import threading
import time

import numpy as np
import pytest

import runtime
from runtime.backends.cpu_schedule import DEFER_S

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")


def _switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def test_a_deferred_push_wakes_no_worker_but_the_poller():
    root = runtime.client("cpu", max_idle_bytes=1 << 20)   # a server of its own: no other
    c = root.with_stream(runtime.StreamId.new())            # test's work wakes its workers
    sched = c._server.backend.scheduler
    workers = [t for t in sched.threads if t is not sched.threads[0]]
    assert len(workers) >= 1
    x = c.create(np.zeros(16, np.float32))
    for _ in range(3):                  # quiet: every worker asleep, the poller untimed
        time.sleep(10 * DEFER_S)
        before = [_switches(t.native_id) for t in workers]
        for k in range(5):
            c.write(x, np.full(16, k, np.float32))     # deferred copies (tiny)
        np.testing.assert_array_equal(c.read(x), np.full(16, 4, np.float32))
        after = [_switches(t.native_id) for t in workers]
        assert after == before, (before, after)     # (each woken worker adds one or more)
    assert all(t.is_alive() for t in sched.threads) and threading.active_count() > 1
    root.shutdown()
