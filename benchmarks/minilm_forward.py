"""Forward latency of all-MiniLM-L6-v2: eager vs graph replay, per backend, batch x seq_len.

    python benchmarks/minilm_forward.py               # cpu and wgpu, batch 1/8/32, seq 16/128
    python benchmarks/minilm_forward.py --backends cpu --batches 1 8 --out result.json

One measurement is one full forward call as a server makes it: host ids/mask in, embeddings out
(``MiniLM.forward(..., graph=False)`` for eager, ``MiniLM.run_bucket`` for replay: write inputs in
place, replay, read). The first call of each (warm-up; for replay also the capture) is not
timed. Each configuration runs at least ``--min-reps`` times and until ``--reps`` or
``--budget-s`` seconds are reached. Prints a table and writes JSON (milliseconds: median, p10,
p90, reps).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime  # noqa: E402
from runtime.models import MiniLM  # noqa: E402


def measure(fn, reps: int, min_reps: int, budget_s: float) -> dict:
    """Time ``fn()`` repeatedly; returns ``{"median_ms", "p10_ms", "p90_ms", "reps"}``."""
    fn()                                            # warm-up (and capture)
    times, start = [], time.perf_counter()
    while len(times) < reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    t = np.array(times)
    return {"median_ms": float(np.median(t)), "p10_ms": float(np.percentile(t, 10)),
            "p90_ms": float(np.percentile(t, 90)), "reps": len(times)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", nargs="+", default=["cpu", "wgpu"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--seqs", nargs="+", type=int, default=[16, 128])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=10.0, help="time budget per configuration")
    ap.add_argument("--out", default="minilm_forward.json")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    results = {"platform": platform.platform(), "python": platform.python_version(), "rows": []}
    print(f"{'backend':8s} {'batch':>5s} {'seq':>4s} {'mode':7s} {'median ms':>10s} "
          f"{'p10':>9s} {'p90':>9s} {'reps':>4s}")
    for backend in args.backends:
        try:
            model = MiniLM.load(runtime.client(backend), max_graphs=2)
        except Exception as e:  # noqa: BLE001 - report and go on with the other backends
            print(f"{backend}: skipped ({type(e).__name__}: {e})")
            continue
        results.setdefault("devices", {})[backend] = model.client.device_name
        for batch in args.batches:
            for seq in args.seqs:
                ids = rng.integers(1000, 29000, (batch, seq))
                ids[:, 0], ids[:, -1] = 101, 102           # [CLS] ... [SEP]
                mask = np.ones((batch, seq), np.int64)
                runs = {"eager": lambda: model.forward(ids, mask, graph=False),
                        "replay": lambda: model.run_bucket(batch, seq, ids, mask)}
                for mode, fn in runs.items():
                    r = measure(fn, args.reps, args.min_reps, args.budget_s)
                    row = {"backend": backend, "batch": batch, "seq": seq, "mode": mode, **r}
                    results["rows"].append(row)
                    print(f"{backend:8s} {batch:5d} {seq:4d} {mode:7s} {r['median_ms']:10.2f} "
                          f"{r['p10_ms']:9.2f} {r['p90_ms']:9.2f} {r['reps']:4d}", flush=True)
                model.release()                            # one bucket's buffers at a time
        model.release()
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
