"""A short demo of capture and replay: ``python -m runtime capture-demo [--backend cpu]``.

Runs a chain of small elementwise launches eagerly, captures the same chain once, replays it,
checks both against numpy, and prints the per-pass time of each path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import runtime
from runtime import kernels as K


def chain(c, a, b, n, length):
    """``length`` dependent launches ping-ponging between ``a`` and ``b`` (+1, then *1)."""
    for i in range(length):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        c.launch(K.add_scalar, K.grid(n), [src, dst], {"alpha": 1.0, "n": n})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime capture-demo", description=__doc__)
    p.add_argument("--backend", default="cpu", help="cpu (default), wgpu, cuda")
    p.add_argument("--length", type=int, default=200, help="launches per pass (even)")
    p.add_argument("--elems", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    c = runtime.client(args.backend)
    n, L = args.elems, args.length
    print(f"backend {c.backend}: {c.device_name}")
    a = c.create(np.zeros(n, np.float32))
    b = c.create(np.zeros(n, np.float32))
    c.graph_prepare()
    chain(c, a, b, n, L)                      # warm-up: executes
    c.start_capture()
    chain(c, a, b, n, L)                      # recorded, not executed
    g = c.stop_capture()
    print(f"captured {L} launches into {g} ({'hardware' if g.is_hardware else 'software'} graph)")
    eager, replay = [], []
    for _ in range(args.rounds):              # interleaved so drift hits both paths alike
        t = time.perf_counter()
        chain(c, a, b, n, L)
        c.sync()
        eager.append(time.perf_counter() - t)
        t = time.perf_counter()
        g.replay()
        c.sync()
        replay.append(time.perf_counter() - t)
    total = L * (1 + 2 * args.rounds)         # warm-up + every eager pass + every replay
    expect_a, expect_b = (total, total - 1) if L % 2 == 0 else (total - 1, total)
    got_a, got_b = c.read(a), c.read(b)
    ok = np.array_equal(got_a, np.full(n, expect_a, np.float32)) and \
        np.array_equal(got_b, np.full(n, expect_b, np.float32))
    me, mr = statistics.median(eager) * 1e6, statistics.median(replay) * 1e6
    print(f"values match numpy: {ok} (a={got_a[0]:.0f}, b={got_b[0]:.0f})")
    print(f"eager  launches: {me:10.1f} µs/pass  ({me / L:.2f} µs/launch)")
    print(f"graph  replay  : {mr:10.1f} µs/pass  ({mr / L:.2f} µs/launch)  speedup x{me / mr:.2f}")
    runtime.shutdown()
    return 0 if ok else 1
