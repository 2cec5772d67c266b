"""Core latencies of the device thread: a blocking no-op, replay enqueue, eager launches.

    python benchmarks/core_latency.py [--backend cpu] [--reps 2000] [--json out.json]

Rows (µs; median with p10/p90/p99 over interleaved repetitions):
- ``sync (idle stream)``: ``client.sync()`` on an idle stream, the blocking round trip; beside
  it a direct numpy call on 4 floats (the floor of doing anything at all).
- ``replay enqueue, L launches``: the ``Graph.replay()`` call itself (accepted, not executed),
  for graphs of 1 and 1000 tiny launches; beside it the same launches as direct numpy calls.
- ``eager launch``: one fire-and-forget ``launch`` of a tiny kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import runtime  # noqa: E402
from runtime import kernels as K  # noqa: E402
from runtime.bench import machine, summarize as stats, write_json  # noqa: E402


def measure(backend: str, reps: int) -> dict:
    c = runtime.client(backend)
    n = 4
    x = c.create(np.ones(n, np.float32))
    y = c.empty(n, np.float32)
    hx, hy = np.ones(n, np.float32), np.empty(n, np.float32)
    graphs = {}
    for length in (1, 1000):
        c.graph_prepare()
        for _ in range(length):
            c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": n})
        c.sync()
        c.start_capture()
        for _ in range(length):
            c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": n})
        graphs[length] = c.stop_capture()
    rows = {k: [] for k in ("sync", "numpy_call", "replay_1", "replay_1000", "numpy_1",
                            "numpy_1000", "launch")}
    pc = time.perf_counter
    for r in range(reps):                          # interleaved: drift hits every row alike
        t = pc(); c.sync(); rows["sync"].append(pc() - t)
        t = pc(); np.add(hx, 1.0, out=hy); rows["numpy_call"].append(pc() - t)
        t = pc(); c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": n}); rows["launch"].append(pc() - t)
        for length in (1, 1000):
            if length == 1000 and r % 10:
                continue                           # the long graph's work dominates: sample less
            c.sync()
            t = pc(); graphs[length].replay(); rows[f"replay_{length}"].append(pc() - t)
            c.sync()
            t = pc()
            for _ in range(length):
                np.add(hx, 1.0, out=hy)
            rows[f"numpy_{length}"].append(pc() - t)
    c.sync()
    return {k: stats(v) for k, v in rows.items()} | {"device": c.device_name}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--json", default="benchmarks/results/core_latency.json")
    a = p.parse_args(argv)
    res = measure(a.backend, a.reps)
    res["machine"] = machine()
    write_json(a.json, res)
    print(f"backend {a.backend} ({res['device']}), µs")
    print(f"{'row':28s} {'p50':>9s} {'p10':>9s} {'p90':>9s} {'p99':>9s}")
    for k in ("sync", "numpy_call", "launch", "replay_1", "numpy_1", "replay_1000", "numpy_1000"):
        s = res[k]
        print(f"{k:28s} {s['p50']:9.2f} {s['p10']:9.2f} {s['p90']:9.2f} {s['p99']:9.2f}")
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
