"""Embeddings serving under load: N concurrent HTTP clients, replayed graphs vs eager launches.

The server (``runtime.serving``: batcher + FastAPI app on uvicorn) runs in this process on a
loopback port; the load generator is an ``httpx.AsyncClient`` here too. For each client count
(default 1, 8, 64) every path serves the same fixed workload: ``--requests`` requests in total,
each ``--texts`` short sentences, spread round-robin over the clients, each client sending its
next request when the previous one is answered (closed loop). Paths:

- ``graph``: the batcher replays the captured graph of each ``(batch, seq_len)`` bucket
  (captured at start-up, with a progress bar, before anything is timed);
- ``eager``: the same batcher and padded shapes, kernels launched one by one;
- ``sentence-transformers``: the same batcher and HTTP server with the model run by
  sentence-transformers on torch (cpu), only when it is installed (``--no-st`` skips it).

On cpu both numpy's BLAS and torch get one thread (``--st-threads``): the runtime's cpu workers,
the event loop and the batcher already share the cores, and a per-core BLAS/OpenMP pool that
spins between calls then slows a small forward down many times over (measured here: torch at
its default 2 threads served 4 req/s to one client, at 1 thread 64 req/s).

The paths take turns per client count (order rotated), so slow drift hits all alike. Reported
per (path, clients): throughput (requests/s and texts/s over the run's wall time), p50/p99
request latency, batches and mean rows per batch.

Usage::

    python benchmarks/serving.py [--backend cpu] [--clients 1,8,64] [--requests 256]
                                 [--texts 1] [--no-st] [--quick]

Writes ``benchmarks/results/serving_<backend>.json`` and ``.png`` (gitignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.serving import (MODEL_ID, Batcher, ServerThread, ServingMetrics,  # noqa: E402
                             create_app, limit_blas_threads, load_model)
from runtime.serving.demo import SENTENCES  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHORT = [s for s in SENTENCES if len(s) < 200]     # all within the 16/32-token buckets
BATCH_BUCKETS = (1, 4, 16, 32)
SEQ_BUCKETS = (16, 32, 64, 256)
WARMUP = [(b, s) for s in (16, 32) for b in BATCH_BUCKETS]


class SentenceTransformersModel:
    """sentence-transformers behind the batcher's model interface (eager path only).

    Args:
        path: the model directory (the same files the runtime loads).
        threads: ``torch.set_num_threads`` (default: torch's own choice, one per core).
    ``tokenize`` uses the library's tokenizer (truncation at ``max_seq_length``); ``forward``
    runs its module pipeline (BERT, mean pooling, normalisation) under ``torch.inference_mode``.
    """

    def __init__(self, path, threads: int | None = None):
        import torch
        from sentence_transformers import SentenceTransformer

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.st = SentenceTransformer(str(path), device="cpu")
        self.st.eval()
        dim = getattr(self.st, "get_embedding_dimension", None) or \
            self.st.get_sentence_embedding_dimension           # the pre-6.x name
        self.hidden = int(dim())
        self.max_seq_length = int(self.st.max_seq_length)

    def tokenize(self, texts):
        """``(ids, mask)``: ``int64 [n, L]`` numpy arrays, padded to the longest."""
        f = getattr(self.st, "preprocess", None) or self.st.tokenize     # tokenize: pre-6.x
        f = f(list(texts))
        return f["input_ids"].numpy(), f["attention_mask"].numpy()

    def forward(self, ids, mask, graph=False):
        """``float32 [n, hidden]`` sentence embeddings of padded ids/mask."""
        t = self.torch
        ids_t = t.from_numpy(np.ascontiguousarray(ids, np.int64))
        feats = {"input_ids": ids_t, "attention_mask": t.from_numpy(np.asarray(mask, np.int64)),
                 "token_type_ids": t.zeros_like(ids_t)}
        with t.inference_mode():
            return self.st(feats)["sentence_embedding"].float().numpy()


def plan(clients: int, requests: int, texts: int) -> list:
    """Each client's request bodies: ``requests`` in total, round-robin over clients."""
    out = [[] for _ in range(clients)]
    for r in range(requests):
        body = [SHORT[(r * 7 + j) % len(SHORT)] for j in range(texts)]
        out[r % clients].append({"input": body, "model": MODEL_ID})
    return out


async def drive(url: str, work: list) -> tuple:
    """Closed-loop clients; returns (latencies in seconds, wall seconds, failures)."""
    import httpx

    lat, fails = [], [0]

    async def client(http, bodies):
        for b in bodies:
            t0 = time.perf_counter()
            r = await http.post("/v1/embeddings", json=b)
            lat.append(time.perf_counter() - t0)
            if r.status_code != 200:
                fails[0] += 1

    limits = httpx.Limits(max_connections=len(work) + 8, max_keepalive_connections=len(work) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http, w) for w in work))
        return lat, time.perf_counter() - t0, fails[0]


def start(model, graph: bool, quiet: bool):
    """A batcher (warmed up) and its loopback server; returns (batcher, server, metrics)."""
    m = ServingMetrics()
    b = Batcher(model, graph=graph, metrics=m, batch_buckets=BATCH_BUCKETS,
                seq_buckets=SEQ_BUCKETS, max_batch=BATCH_BUCKETS[-1])
    if graph:
        b.warmup(WARMUP, progress=not quiet)
    srv = ServerThread(create_app(b, metrics=m))
    srv.start()
    return b, srv, m


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="cpu")
    p.add_argument("--clients", default="1,8,64", help="comma list of concurrent clients")
    p.add_argument("--requests", type=int, default=256, help="requests per (path, clients)")
    p.add_argument("--texts", type=int, default=1, help="texts per request")
    p.add_argument("--no-st", action="store_true", help="skip sentence-transformers")
    p.add_argument("--st-threads", type=int, default=1,
                   help="torch threads for sentence-transformers (default 1, as numpy's BLAS "
                   "here; 0 = torch's default, which thrashes like OpenBLAS in this setting)")
    p.add_argument("--quick", action="store_true", help="64 requests")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.requests = 64
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    if args.backend in ("auto", "cpu"):
        limit_blas_threads(1)           # as `python -m runtime serve` does (numpy BLAS only)
    model = load_model(None if args.backend == "auto" else args.backend,
                       max_graphs=len(WARMUP))
    servers = {"graph": start(model, True, args.quiet), "eager": start(model, False, args.quiet)}
    st_note = None
    if not args.no_st:
        try:
            from runtime.models import default_model_dir
            servers["sentence-transformers"] = start(
                SentenceTransformersModel(default_model_dir(), args.st_threads), False,
                args.quiet)
        except ImportError as e:
            st_note = f"sentence-transformers not installed ({e}); skipped"
        except Exception as e:  # noqa: BLE001 - optional comparison
            st_note = f"sentence-transformers failed to load: {type(e).__name__}: {e}"
    if st_note and not args.quiet:
        print(st_note, file=sys.stderr)
    for _, srv, _ in servers.values():                    # one untimed round each
        asyncio.run(drive(srv.url, plan(8, 16, args.texts)))
    rows = []
    names = list(servers)
    for k, n in enumerate(clients):
        order = names[k % len(names):] + names[:k % len(names)]
        for name in order:
            b, srv, m = servers[name]
            b0, c0 = b.batches_run, m.value("graph_captures_total")
            lat, wall, fails = asyncio.run(drive(srv.url, plan(n, args.requests, args.texts)))
            ms = np.array(lat) * 1e3
            batches = b.batches_run - b0
            rows.append({"path": name, "clients": n, "requests": len(lat),
                         "texts": len(lat) * args.texts, "wall_s": wall,
                         "req_per_s": len(lat) / wall, "texts_per_s": len(lat) * args.texts / wall,
                         "p50_ms": float(np.percentile(ms, 50)),
                         "p99_ms": float(np.percentile(ms, 99)), "batches": batches,
                         "rows_per_batch": len(lat) * args.texts / max(batches, 1),
                         "captures": int(m.value("graph_captures_total") - c0), "failures": fails})
            if not args.quiet:
                r = rows[-1]
                print(f"{name:22s} clients={n:3d}  {r['req_per_s']:7.1f} req/s  "
                      f"p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  "
                      f"rows/batch {r['rows_per_batch']:.1f}", file=sys.stderr, flush=True)
    for b, srv, _ in servers.values():
        srv.stop()
        b.close()

    print(f"\n{'path':22s} {'clients':>7s} {'req/s':>8s} {'texts/s':>8s} {'p50 ms':>9s} "
          f"{'p99 ms':>9s} {'batches':>7s} {'rows/b':>6s}")
    for r in rows:
        print(f"{r['path']:22s} {r['clients']:7d} {r['req_per_s']:8.1f} {r['texts_per_s']:8.1f} "
              f"{r['p50_ms']:9.1f} {r['p99_ms']:9.1f} {r['batches']:7d} "
              f"{r['rows_per_batch']:6.1f}")
    if st_note:
        print(st_note)
    os.makedirs(args.out, exist_ok=True)
    meta = {"backend": model.client.backend, "requests": args.requests, "texts": args.texts,
            "clients": clients, "batch_buckets": BATCH_BUCKETS, "seq_buckets": SEQ_BUCKETS,
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "sentence_transformers": st_note or "included"}
    base = os.path.join(args.out, f"serving_{model.client.backend}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {base}.json (matplotlib missing: no plot)")
        return 0
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for k, name in enumerate(names):
        rs = sorted((r for r in rows if r["path"] == name), key=lambda r: r["clients"])
        x, color = [r["clients"] for r in rs], f"C{k}"
        a1.plot(x, [r["texts_per_s"] for r in rs], "o-", color=color, label=name)
        a2.plot(x, [r["p50_ms"] for r in rs], "o-", color=color, label=f"{name} p50")
        a2.plot(x, [r["p99_ms"] for r in rs], "x--", color=color, label=f"{name} p99")
    for a, y in ((a1, "texts / s"), (a2, "request latency (ms)")):
        a.set_xscale("log", base=2)
        a.set_xticks(clients, [str(c) for c in clients])
        a.set_xlabel("concurrent clients")
        a.set_ylabel(y)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    a2.set_yscale("log")
    fig.suptitle(f"POST /v1/embeddings on {model.client.backend}: {args.requests} requests x "
                 f"{args.texts} text(s)")
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=110)
    print(f"wrote {base}.json and {base}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
