"""A busy host on demand: busy-loop processes beside a benchmark (issue 30).

``benchmarks/minilm_forward.py --contention N`` and ``benchmarks/serving.py --contention N``
time both sides with N processes that each keep one core busy in pure Python (a noisy
neighbour, a tokenizer or web server beside the model): on 2 cores, 2 of them halve what any
other process gets.

Every loop is bounded: it ends when the benchmark leaves the ``with`` block, when the process
that started it is gone (checked every few ms, so a killed benchmark leaves nothing spinning),
and after ``max_s`` seconds in any case.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

#: the busy loop: spin in pure Python until the parent is gone or the deadline passes
_LOOP = """if True:
    import os, sys, time
    parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
    while os.getppid() == parent and time.monotonic() < end:
        for _ in range(200000):
            pass
"""


@contextlib.contextmanager
def busy_processes(n: int, max_s: float = 7200.0):
    """Run ``n`` busy-loop processes (one core each) while the block runs; yields their pids.

    Args:
        n: processes (0: none, the block runs alone).
        max_s: seconds after which a loop ends by itself even if the block has not.
    Raises: ``ValueError`` (``n < 0``, ``max_s <= 0``).
    """
    if n < 0 or max_s <= 0:
        raise ValueError(f"busy_processes needs n >= 0 and max_s > 0, got {n}, {max_s}")
    procs = [subprocess.Popen([sys.executable, "-c", _LOOP, str(os.getpid()), str(max_s)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
             for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(10)
