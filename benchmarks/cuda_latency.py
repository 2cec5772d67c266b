"""Launch latency on a device: eager launches vs one graph replay, and the replay enqueue itself.

Three measurements, all through the public client API on one pinned stream:

- ``chain``: a pass of ``L`` dependent tiny launches (``add_scalar`` over 64 floats, ping-pong
  between two buffers) for ``L`` in 1, 10, 100, 1000. Eager issues ``L`` ``client.launch`` calls;
  replay issues one ``Graph.replay()`` of the same pass. Each pass ends with ``client.sync()``.
  Reported per pass: enqueue (the issuing calls only) and end to end (issue + sync), p50/p99 in
  microseconds, and ``speedup`` = eager / replay end to end (p50).
- ``replay_enqueue``: ``Graph.replay()`` of a one-launch graph timed call by call (a sync every
  256 replays keeps the device queue short), p50/p99/p999 in microseconds.
- ``minilm``: the all-MiniLM-L6-v2 forward (``runtime.models.minilm``) eager vs captured for a
  few ``(batch, seq)`` buckets, with random weights of the real shapes (latency does not depend
  on the values, and nothing is downloaded); skipped with the reason when the model code is not
  there.

Usage::

    python benchmarks/cuda_latency.py [--backend cuda] [--quick] [--out results.json]

Prints one line per row and writes JSON (default
``benchmarks/results/cuda_latency_<backend>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import runtime  # noqa: E402
import runtime.kernels as K  # noqa: E402
from runtime.bench import machine, summarize, write_json  # noqa: E402

LENGTHS = (1, 10, 100, 1000)
N = 64


def reps_for(length: int, quick: bool) -> int:
    """Passes per length: enough for a p99 at small L, bounded time at large L."""
    r = max(20, min(2000, 20000 // length))
    return max(10, r // 5) if quick else r


def chain(c, a, b, length: int) -> None:
    for i in range(length):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        c.launch(K.add_scalar, 1, [src, dst], {"alpha": 1.0, "n": N})


def bench_chain(c, length: int, reps: int) -> dict:
    """Eager vs replay of ``length`` dependent tiny launches (see module doc)."""
    a = c.create(np.zeros(N, np.float32))
    b = c.create(np.zeros(N, np.float32))
    c.graph_prepare()
    chain(c, a, b, length)                      # warm-up: compiles, settles the pool
    c.sync()
    c.start_capture()
    chain(c, a, b, length)
    t0 = time.perf_counter()
    g = c.stop_capture()
    capture_s = time.perf_counter() - t0
    out = {"eager_enqueue": [], "eager_e2e": [], "replay_enqueue": [], "replay_e2e": []}
    for _ in range(3):                           # warm both paths
        chain(c, a, b, length)
        g.replay()
    c.sync()
    for _ in range(reps):                        # interleaved, so drift hits both alike
        t0 = time.perf_counter()
        chain(c, a, b, length)
        t1 = time.perf_counter()
        c.sync()
        t2 = time.perf_counter()
        g.replay()
        t3 = time.perf_counter()
        c.sync()
        t4 = time.perf_counter()
        out["eager_enqueue"].append(t1 - t0)
        out["eager_e2e"].append(t2 - t0)
        out["replay_enqueue"].append(t3 - t2)
        out["replay_e2e"].append(t4 - t2)
    # every launch writes the latest value + 1, so after 1 + 3 * 2 + reps * 2 executed passes
    # (prelude, warm-ups, timed) ``a`` holds their launch count; a replay that did nothing
    # shows. An odd L restarts from ``a`` each pass: ``b`` stays 1.
    passes = 1 + 3 * 2 + reps * 2
    total, got = ((length * passes, float(c.read(a)[0])) if length % 2 == 0
                  else (1, float(c.read(b)[0])))
    row = {"length": length, "reps": reps, "capture_us": round(capture_s * 1e6, 1),
           "checked": got == float(total)}
    for k, v in out.items():
        row[k + "_us"] = summarize(v)
    row["speedup_e2e_p50"] = round(row["eager_e2e_us"]["p50"] / row["replay_e2e_us"]["p50"], 2)
    row["eager_per_launch_us_p50"] = round(row["eager_e2e_us"]["p50"] / length, 2)
    g.release()
    return row


def bench_replay_enqueue(c, count: int) -> dict:
    """``Graph.replay()`` call latency of a one-launch graph, call by call."""
    a = c.create(np.zeros(N, np.float32))
    b = c.create(np.zeros(N, np.float32))
    c.graph_prepare()
    chain(c, a, b, 1)
    c.sync()
    c.start_capture()
    chain(c, a, b, 1)
    g = c.stop_capture()
    samples = []
    for i in range(count):
        t0 = time.perf_counter()
        g.replay()
        samples.append(time.perf_counter() - t0)
        if i % 256 == 255:
            c.sync()
    c.sync()
    g.release()
    return {"replays": count, "us": summarize(samples),
            "p999_us": float(np.percentile(np.asarray(samples) * 1e6, 99.9))}


def _minilm_weights(rng, vocab=30522, hidden=384, layers=6, inter=1536, pos=512):
    w = {"embeddings.word_embeddings.weight": (vocab, hidden),
         "embeddings.position_embeddings.weight": (pos, hidden),
         "embeddings.token_type_embeddings.weight": (2, hidden),
         "embeddings.LayerNorm.weight": (hidden,), "embeddings.LayerNorm.bias": (hidden,)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for n in ("query", "key", "value"):
            w[p + f"attention.self.{n}.weight"] = (hidden, hidden)
            w[p + f"attention.self.{n}.bias"] = (hidden,)
        w[p + "attention.output.dense.weight"] = (hidden, hidden)
        w[p + "attention.output.dense.bias"] = (hidden,)
        w[p + "attention.output.LayerNorm.weight"] = (hidden,)
        w[p + "attention.output.LayerNorm.bias"] = (hidden,)
        w[p + "intermediate.dense.weight"] = (inter, hidden)
        w[p + "intermediate.dense.bias"] = (inter,)
        w[p + "output.dense.weight"] = (hidden, inter)
        w[p + "output.dense.bias"] = (hidden,)
        w[p + "output.LayerNorm.weight"] = (hidden,)
        w[p + "output.LayerNorm.bias"] = (hidden,)
    return {k: (rng.standard_normal(s, dtype=np.float32) * 0.02) for k, s in w.items()}


def bench_minilm(c, quick: bool) -> dict:
    """MiniLM forward, eager vs replay, per bucket (p50/p99 ms). Random weights, real shapes."""
    try:
        from runtime.models.minilm import MiniLM
    except Exception as e:  # noqa: BLE001 - not there yet: say why
        return {"skipped": f"runtime.models.minilm not importable: {type(e).__name__}: {e}"}
    rng = np.random.default_rng(0)
    config = {"hidden_size": 384, "num_attention_heads": 12, "num_hidden_layers": 6,
              "layer_norm_eps": 1e-12}
    model = MiniLM(c, _minilm_weights(rng), None, config, 256)
    rows = []
    for batch, seq in ((1, 16), (8, 128)) if quick else ((1, 16), (1, 128), (8, 128), (32, 128)):
        ids = rng.integers(1000, 2000, (batch, seq))
        mask = np.ones((batch, seq), np.int64)
        reps = 10 if quick else 30
        res = {}
        for graph in (False, True):
            model.forward(ids, mask, graph=graph)          # warm-up (and capture)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                emb = model.forward(ids, mask, graph=graph)
                ts.append(time.perf_counter() - t0)
            res["replay" if graph else "eager"] = emb
            rows.append({"batch": batch, "seq": seq, "path": "replay" if graph else "eager",
                         "ms": summarize(ts, 1e3)})
        rows[-1]["max_abs_diff_vs_eager"] = float(np.max(np.abs(res["replay"] - res["eager"])))
    model.release()
    return {"rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-minilm", action="store_true")
    args = ap.parse_args(argv)
    c = runtime.client(args.backend)
    c.set_stream(runtime.StreamId.new())
    result = {"backend": args.backend, "device": c.device_name, "machine": machine(),
              "quick": args.quick, "chain": []}
    for length in LENGTHS:
        row = bench_chain(c, length, reps_for(length, args.quick))
        result["chain"].append(row)
        print(f"L={length:5d}  eager {row['eager_e2e_us']['p50']:10.1f} us  replay "
              f"{row['replay_e2e_us']['p50']:9.1f} us  x{row['speedup_e2e_p50']:6.2f}  "
              f"enqueue eager {row['eager_enqueue_us']['p50']:9.1f} replay "
              f"{row['replay_enqueue_us']['p50']:6.1f} us  checked={row['checked']}", flush=True)
    result["replay_enqueue"] = bench_replay_enqueue(c, 2000 if args.quick else 20000)
    print(f"replay enqueue: {result['replay_enqueue']['us']}", flush=True)
    result["minilm"] = ({"skipped": "--skip-minilm"} if args.skip_minilm
                        else bench_minilm(c, args.quick))
    print(f"minilm: {json.dumps(result['minilm'])}", flush=True)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"cuda_latency_{args.backend}.json")
    write_json(out, result)
    print(f"wrote {out}")
    return 0 if all(r["checked"] for r in result["chain"]) else 1


if __name__ == "__main__":
    sys.exit(main())
