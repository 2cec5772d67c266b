"""Embeddings serving under load: N concurrent HTTP clients, replayed graphs vs eager launches.

The server (``runtime.serving``: batcher + FastAPI app on uvicorn) runs in this process on a
loopback port; the load generator is an ``aiohttp.ClientSession`` here too (:func:`session`).
Sections (``--sections``, default all three):

- ``closed``: for each client count (default 1, 8, 64) every path serves the same fixed
  workload: ``--requests`` requests in total, each ``--texts`` short sentences, spread
  round-robin over the clients, each client sending its next request when the previous one is
  answered (closed loop). Reported per (path, clients): throughput, p50/p99 request latency,
  batches and mean rows per batch.
- ``mixed``: head-of-line blocking. 8 clients send 1-text requests (closed loop, at most
  ``--mixed-requests`` each or ``--mixed-seconds``), first alone (``idle``), then while one more
  client sends max-size requests (``--max-inputs`` short sentences each) back to back
  (``mixed``). Reported per path: the short requests' p50/p90/p99 in both phases and their
  ratio, and the big requests completed.
- ``largest``: the cost of the largest legal request. ``python -m runtime serve`` runs in a
  child process; after a warm-up, its peak RSS is reset (``/proc/PID/clear_refs``), one request
  is sent, and the child's peak RSS above its resident size before the request (``VmHWM``) and
  its CPU time (``utime + stime``) are read. Requests (``--largest-requests``): texts of 256
  tokens (the reference), texts as long as the body limit allows (the largest legal request),
  and texts of ``--max-input-chars`` characters, as many as the body limit allows; each
  ``--largest-inputs`` texts at most (default ``--max-inputs``). Linux only.
- ``health`` (not in the default set): ``/health`` latency (p50/p99/max, goal p99 <= 50 ms)
  from a ``serve`` child while ``--health-senders`` clients send maximum-size legal requests
  of each input kind: ``texts`` (``--max-inputs`` texts filling the body limit) and ``ids`` (one
  token list of 2.4 million ids, 13.7 MiB). :func:`health_rows`.

Paths: ``graph`` (the batcher replays each ``(batch, seq_len)`` bucket's captured graph,
captured at start-up before anything is timed), ``eager`` (the same batcher and padded shapes,
kernels launched one by one) and ``sentence-transformers`` (the same batcher and HTTP server
with the model run by sentence-transformers on torch, cpu, each batch at its own shape: its
texts padded to the longest, as ``SentenceTransformer.encode`` runs them, not to a bucket), only
when it is installed
(``--no-st`` skips it; run this script with the Python of any environment
that has it). The cpu backend shares out the cores by its thread rule
(``runtime.cpu_threads``, as ``serve`` does); torch keeps its default threads (one per core)
unless ``--st-threads`` says otherwise. ``--st-threads 1,2`` (with ``--isolate``) runs
sentence-transformers once per thread count, each in its own process, and compares every other
path with the best of them in the same round and client count (the anchor's best setting: on 2
cores beside 2 busy processes torch at 1 thread served about twice what it did at 2). The
paths take turns (order rotated), so slow drift hits all alike.

The script only uses APIs an older checkout also has, so the same file measures before and
after a change: ``PYTHONPATH=/path/to/old/checkout python benchmarks/serving.py`` imports that
checkout's ``runtime`` (``python -m runtime serve`` in the child too).

Usage::

    python benchmarks/serving.py [--backend cpu] [--sections closed,mixed,largest,health]
                                 [--clients 1,8,64] [--requests 256] [--texts 1] [--no-st]
                                 [--st-threads 0|N|1,2] [--mixed-requests 16] [--mixed-seconds 60]
                                 [--max-inputs 2048] [--max-body-bytes 16777216] [--quick]
                                 [--paths graph,eager,sentence-transformers] [--rounds 1]
                                 [--isolate] [--batch-buckets 1,2,3,4,6,8,12,16,24,32]
                                 [--seq-buckets 8,12,16,20,24,32,64,256] [--streams 1] [--route auto]
                                 [--contention 0]

``--streams N`` serves the graph and eager paths with N copies of the model, each on its own
stream with its own batcher (:class:`runtime.serving.BatcherGroup`, as ``serve --streams N``):
each request goes to the least loaded, so on cpu N batches run at once, one thread each; on the
cpu backend only while other processes take cores (``--route cpu``, serve's: then each request
by its sequence bucket, as ``--route bucket`` always does; ``--route least``: always the least
loaded; ``--route spill``: once the first holds a full batch waiting).

``--contention N`` runs N busy-loop processes beside every path for the whole run (a busy
host; ``"contention"`` in the JSON's meta). ``--rounds R`` repeats the closed section (order rotated each round) and prints medians,
min-max and the median per-round ratio to sentence-transformers; ``--isolate`` runs each
(round, path) in a fresh process of its own instead of all paths in this one.

Writes ``benchmarks/results/serving_<backend>.json`` and ``.png`` (gitignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time

import numpy as np

# appended, not prepended: a ``runtime`` on PYTHONPATH (another checkout) wins
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.serving import (MODEL_ID, Batcher, ServerThread, ServingMetrics,  # noqa: E402
                             create_app, load_model)
from runtime.serving.demo import SENTENCES  # noqa: E402

ST = "sentence-transformers"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHORT = [s for s in SENTENCES if len(s) < 200]     # 2-20 tokens each
# denser than the batcher's default (1, 2, 4, 8, 16, 32): less padding for 20 graphs instead of
# 12 (on 2 cores, 10-15% more requests/s at 8 clients; +260 MB, 5.8 s of captures)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# a sequence bucket every 4 tokens up to 24 (sentence-transformers pads each batch to its
# longest text; a cpu forward costs about its padded rows): the benchmark's texts of 2-20 tokens
# ran padded to 16 or 24 (1.3x their tokens at one client), now to at most 3 more; measured
# against (16, 24, 32, ...) alternating, no busy loops, 2 streams: CPU per request 16.6 vs 18.4
# ms at 1 client, 12.5 vs 12.9 at 8, 7.6 vs 7.8 at 64 (issue 30). On cpu the
# extra graphs cost little memory (one arena and GraphPool per model), a capture each.
SEQ_BUCKETS = (8, 12, 16, 20, 24, 32, 64, 256)
WARMUP_SEQ = 32                     # the warm-up captures every batch bucket up to this length
WARMUP = [(b, s) for s in SEQ_BUCKETS if s <= WARMUP_SEQ for b in BATCH_BUCKETS]
MAX_PADDING = "auto"                # Batcher(max_padding=) of the graph and eager paths
ROUTE = "auto"                      # --route: the BatcherGroup's routing with --streams > 1


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


def session(connections: int, timeout: float):
    """The load generator's HTTP client: an ``aiohttp.ClientSession`` keeping up to
    ``connections`` keep-alive connections. Not httpx: its ``AsyncClient`` spent about 20 ms of
    CPU per request with 64 connections open (8 s for 384 requests, against 0.75 s for aiohttp,
    measured against a model that answers at once), so the 64-client rows measured the client
    at ~52 req/s whatever the model."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=timeout))


async def post(http, url: str, body: dict) -> int:
    """POST ``body`` as JSON to ``url``; the response's status (its body read and dropped)."""
    async with http.post(url, json=body) as r:
        await r.read()
        return r.status


async def drive(url: str, work: list) -> tuple:
    """Closed-loop clients; returns (latencies in seconds, wall seconds, failures)."""
    lat, fails = [], [0]
    endpoint = url + "/v1/embeddings"

    async def client(http, bodies):
        for b in bodies:
            t0 = time.perf_counter()
            status = await post(http, endpoint, b)
            lat.append(time.perf_counter() - t0)
            if status != 200:
                fails[0] += 1

    async with session(len(work) + 8, 600.0) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http, w) for w in work))
        return lat, time.perf_counter() - t0, fails[0]


def start(model, graph: bool, quiet: bool, exact: bool = False):
    """A batcher (warmed up) and its loopback server; returns (batcher, server, metrics).
    ``model``: one model, or a list of models (``--streams``: a
    :class:`runtime.serving.BatcherGroup` of a batcher per model, each request to the least
    loaded). ``exact``: batches run at their own shape (``Batcher(exact_shapes=True)``)."""
    m = ServingMetrics()
    kw = dict(graph=graph, metrics=m, batch_buckets=BATCH_BUCKETS, seq_buckets=SEQ_BUCKETS,
              max_batch=BATCH_BUCKETS[-1])
    models = model if isinstance(model, list) else [model]
    batchers = []
    for one in models:
        try:
            b = Batcher(one, exact_shapes=exact, max_padding=MAX_PADDING, **kw)
        except TypeError:             # an older checkout: no exact_shapes, buckets padded
            print("this checkout's Batcher pads every batch to its bucket", file=sys.stderr)
            b = Batcher(one, **kw)
        batchers.append(b)
    if len(batchers) > 1:
        from runtime.serving import BatcherGroup
        route = ROUTE if ROUTE != "auto" else (
            "cpu" if getattr(getattr(models[0], "client", None), "backend", "") == "cpu"
            else "least")                          # as serve --streams N routes
        try:
            b = BatcherGroup(batchers, route=route)
        except TypeError:             # an older checkout: every request to the least loaded
            print("this checkout's BatcherGroup routes to the least loaded", file=sys.stderr)
            b = BatcherGroup(batchers)
    if graph:
        b.warmup(WARMUP, progress=not quiet)
    srv = ServerThread(create_app(b, metrics=m))
    srv.start()
    return b, srv, m


def captures(m) -> float:
    """Graph captures recorded in ``m`` (prometheus-client metrics, or an older checkout's)."""
    value = getattr(m, "value", None)
    return value("graph_captures_total") if value else m.captures.value()


def pct(ms, q) -> float:
    """Percentile ``q`` of the samples ``ms`` (0 when empty)."""
    return float(np.percentile(ms, q)) if len(ms) else 0.0


async def mixed_load(url: str, clients: int, per_client: int, seconds: float,
                     big_inputs: int) -> dict:
    """``clients`` closed-loop 1-text clients (``per_client`` requests each, none started after
    ``seconds``), plus, when ``big_inputs``, one client sending ``big_inputs``-text requests
    back to back until the short clients finish. Returns the short latencies (ms) and the big
    requests completed."""
    short_ms, big_done, fails = [], [0], [0]
    endpoint = url + "/v1/embeddings"
    stop = asyncio.Event()
    t_end = time.perf_counter() + seconds
    big_body = {"input": [SHORT[i % len(SHORT)] for i in range(big_inputs)], "model": MODEL_ID}

    async def short(http, c):
        for r in range(per_client):
            if time.perf_counter() > t_end:
                break
            t0 = time.perf_counter()
            status = await post(http, endpoint, {"input": SHORT[(c * 5 + r * 3) % len(SHORT)]})
            short_ms.append((time.perf_counter() - t0) * 1e3)
            fails[0] += status != 200

    async def big(http):
        while not stop.is_set():
            status = await post(http, endpoint, big_body)
            big_done[0] += status == 200
            fails[0] += status != 200

    async with session(clients + 4, 900.0) as http:
        bg = asyncio.ensure_future(big(http)) if big_inputs else None
        if bg is not None:
            await asyncio.sleep(0.5)                 # the big request is being computed
        await asyncio.gather(*(short(http, c) for c in range(clients)))
        stop.set()
        if bg is not None:
            await bg                                  # let the last one finish: a clean server
    return {"short_ms": short_ms, "big_done": big_done[0], "failures": fails[0]}


def mixed_rows(servers: dict, args) -> list:
    """The ``mixed`` section: idle vs mixed short-request latency, per path."""
    rows = []
    for name, (b, srv, m) in servers.items():
        out = {}
        for phase, big in (("idle", 0), ("mixed", args.max_inputs)):
            r = asyncio.run(mixed_load(srv.url, 8, args.mixed_requests, args.mixed_seconds, big))
            ms = np.array(r["short_ms"])
            out[phase] = {"requests": len(ms), "p50_ms": pct(ms, 50), "p90_ms": pct(ms, 90),
                          "p99_ms": pct(ms, 99), "p10_ms": pct(ms, 10),
                          "big_requests_done": r["big_done"], "failures": r["failures"]}
        rows.append({"path": name, "big_inputs": args.max_inputs, **out,
                     "p50_ratio": out["mixed"]["p50_ms"] / max(out["idle"]["p50_ms"], 1e-9),
                     "p99_ratio": out["mixed"]["p99_ms"] / max(out["idle"]["p99_ms"], 1e-9)})
        if not args.quiet:
            i, x = out["idle"], out["mixed"]
            print(f"mixed {name:22s} idle p50 {i['p50_ms']:7.1f} p99 {i['p99_ms']:7.1f} ms | "
                  f"beside {args.max_inputs}-text requests p50 {x['p50_ms']:7.1f} p99 "
                  f"{x['p99_ms']:7.1f} ms ({x['big_requests_done']} big done)",
                  file=sys.stderr, flush=True)
    return rows


def _proc(pid: int) -> dict:
    """RSS, peak RSS (bytes) and CPU seconds of process ``pid``, from ``/proc``."""
    status = open(f"/proc/{pid}/status").read().split("\n")
    kb = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in status
          if ln.startswith(("VmRSS", "VmHWM"))}
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime
    return {"rss": kb["VmRSS"], "peak": kb["VmHWM"], "cpu_s": cpu}


def largest_rows(args) -> list:
    """The ``largest`` section: one ``serve`` child, the reference request (256-token texts)
    and the largest legal request, each measured for peak RSS and CPU time."""
    import httpx

    words = " ".join(SHORT).split()
    ref_text = " ".join(words[i % len(words)] for i in range(254))        # >= 254 word pieces
    per_text = (args.max_body_bytes - 1000) // args.max_inputs - 6         # JSON quotes, commas
    long_text = (" ".join(words) + " ") * (per_text // len(" ".join(words)) + 1)
    long_text = long_text[:per_text]
    child, url = _serve_child(args, ["--warmup", "32x256"])
    rows = []
    try:
        with httpx.Client(base_url=url, timeout=1800.0) as http:
            http.post("/v1/embeddings", json={"input": [ref_text] * 64})        # warm-up
            n = args.largest_inputs or args.max_inputs
            longest = (" ".join(words) + " ") * (args.max_input_chars // len(" ".join(words)) + 1)
            n_longest = min(n, (args.max_body_bytes - 1000) // (args.max_input_chars + 6))
            plan = {"ref": ("256-token texts", ref_text, n),
                    "body": ("largest legal", long_text, n),
                    "longest": (f"{args.max_input_chars}-char texts",
                                longest[:args.max_input_chars], n_longest)}
            for key in args.largest_requests.split(","):
                name, text, count = plan[key.strip()]
                body = json.dumps({"input": [text] * count}).encode()
                with open(f"/proc/{child.pid}/clear_refs", "w") as f:
                    f.write("5")                                   # peak RSS := current RSS
                before = _proc(child.pid)
                t0 = time.perf_counter()
                r = http.post("/v1/embeddings", content=body,
                              headers={"content-type": "application/json"})
                wall = time.perf_counter() - t0
                after = _proc(child.pid)
                rows.append({"request": name, "inputs": count, "chars": len(text),
                             "body_bytes": len(body), "status": r.status_code, "wall_s": wall,
                             "cpu_s": after["cpu_s"] - before["cpu_s"],
                             "peak_rss_mb": (after["peak"] - before["rss"]) / 2**20})
                if not args.quiet:
                    x = rows[-1]
                    print(f"largest {name:16s} {x['body_bytes'] / 2**20:6.1f} MiB -> "
                          f"{x['status']}  +{x['peak_rss_mb']:7.1f} MB peak RSS  "
                          f"{x['cpu_s']:6.1f} CPU-s  {x['wall_s']:6.1f} s",
                          file=sys.stderr, flush=True)
    finally:
        _stop_child(child)
    return rows


def closed_rows(servers: dict, clients: list, args, round_: int = 0) -> list:
    """The ``closed`` section: throughput and latency per (path, clients), one round."""
    rows = []
    names = list(servers)
    for k, n in enumerate(clients):
        k += round_
        order = names[k % len(names):] + names[:k % len(names)]
        for name in order:
            b, srv, m = servers[name]
            b0, c0, cpu0 = b.batches_run, captures(m), time.process_time()
            lat, wall, fails = asyncio.run(drive(srv.url, plan(n, args.requests, args.texts)))
            cpu = time.process_time() - cpu0          # this process: server, model, clients
            ms = np.array(lat) * 1e3
            batches = b.batches_run - b0
            rows.append({"path": name, "clients": n, "round": round_, "requests": len(lat),
                         "texts": len(lat) * args.texts, "wall_s": wall,
                         "req_per_s": len(lat) / wall, "texts_per_s": len(lat) * args.texts / wall,
                         "p10_ms": pct(ms, 10), "p50_ms": pct(ms, 50), "p90_ms": pct(ms, 90),
                         "p99_ms": pct(ms, 99), "batches": batches,
                         "rows_per_batch": len(lat) * args.texts / max(batches, 1),
                         "captures": int(captures(m) - c0), "failures": fails,
                         "cpu_ms_per_request": cpu * 1e3 / max(len(lat), 1),
                         "cores_used": cpu / wall,
                         "st_threads": st_thread_counts(args.st_threads)[0] if name == ST
                         else None, "thread_rule": _rule_state()})
            if not args.quiet:
                r = rows[-1]
                print(f"{label(r):22s} clients={n:3d}  {r['req_per_s']:7.1f} req/s  "
                      f"p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  "
                      f"rows/batch {r['rows_per_batch']:.1f}  CPU {r['cpu_ms_per_request']:.1f} "
                      f"ms/request", file=sys.stderr, flush=True)
    return rows


def _rule_state() -> dict:
    """The cpu thread rule's state after a row (an older checkout: what it has): the CPU share
    its threads got, whether whole calls are on, and the thread choice on a busy host
    (``runtime.cpu_threads.ThreadChoice``: one thread or all, comparisons made, changes)."""
    mod = sys.modules.get("runtime.cpu_threads")
    rule = getattr(mod, "RULE", None)
    if rule is None:
        return {}
    out = {"cpu_share": round(rule.cpu.share, 2)}
    whole = getattr(rule, "whole", None)
    if whole is not None:
        out["whole_calls"] = bool(whole.on)
    choice = getattr(rule, "choice", None)
    if choice is not None:
        out["choice"] = {"mode": choice.mode, "one": choice.one,
                         "comparisons": choice.comparisons, "changes": choice.changes}
    return out


def st_thread_counts(spec) -> list:
    """``--st-threads``'s thread counts (``"1,2"`` -> ``[1, 2]``; 0 is torch's default)."""
    out = [int(x) for x in str(spec).split(",") if x.strip()]
    if not out or any(n < 0 for n in out):
        raise ValueError(f"--st-threads {spec!r}: thread counts >= 0, comma-separated")
    return out


def label(r: dict) -> str:
    """A row's name in the tables: the path, and sentence-transformers' torch threads when
    set (``"sentence-transformers 1t"``; ``best``: the best of them in each round)."""
    t = r.get("st_threads")
    return r["path"] if r["path"] != ST or t in (None, 0) else f"{ST} {t}t" \
        if t != "best" else f"{ST} best"


def best_st(rows: list) -> list:
    """Per (round, clients), the sentence-transformers row with the most requests/s when it
    ran at more than one thread count (``st_threads`` ``"best"``, the winner's count in
    ``best_of``); nothing otherwise."""
    st = [r for r in rows if r["path"] == ST]
    if len({r.get("st_threads") for r in st}) < 2:
        return []
    out = []
    for key in sorted({(r.get("round", 0), r["clients"]) for r in st}):
        rs = [r for r in st if (r.get("round", 0), r["clients"]) == key]
        top = max(rs, key=lambda r: r["req_per_s"])
        out.append({**top, "st_threads": "best", "best_of": top.get("st_threads")})
    return out


def summarize_closed(rows: list) -> list:
    """Per (path, clients) (sentence-transformers per thread count, and the best of them in
    each round when it ran at several): the median, lowest and highest req/s over the rounds,
    and, when sentence-transformers ran, the median of the per-round ratios to it (same round,
    same client count; to its best thread count in that round when it ran at several)."""
    out = []
    rows = list(rows) + best_st(rows)
    keys = sorted({(r["path"], str(r.get("st_threads")), r["clients"]) for r in rows},
                  key=lambda k: (k[2], k[0], k[1]))
    best = any(r.get("st_threads") == "best" for r in rows)
    for path, threads, n in keys:
        rs = [r for r in rows if r["path"] == path and r["clients"] == n and
              str(r.get("st_threads")) == threads]
        rate = [r["req_per_s"] for r in rs]
        ratios = []
        for r in rs:
            st = [x for x in rows if x["path"] == ST and x["clients"] == n and
                  x.get("round", 0) == r.get("round", 0) and
                  (not best or x.get("st_threads") == "best")]
            if st and path != ST:
                ratios.append(r["req_per_s"] / st[0]["req_per_s"])
        out.append({"path": path, "clients": n, "rounds": len(rs),
                    "st_threads": rs[0].get("st_threads"), "label": label(rs[0]),
                    "req_per_s_median": float(np.median(rate)), "req_per_s_min": min(rate),
                    "req_per_s_max": max(rate),
                    "p50_ms_median": float(np.median([r["p50_ms"] for r in rs])),
                    "p99_ms_median": float(np.median([r["p99_ms"] for r in rs])),
                    "cpu_ms_per_request_median": float(np.median(
                        [r.get("cpu_ms_per_request", 0.0) for r in rs])),
                    "vs_st_median": float(np.median(ratios)) if ratios else None,
                    "vs_st_min": min(ratios) if ratios else None,
                    "vs_st_max": max(ratios) if ratios else None})
    return out


def isolated_rows(clients: list, args) -> list:
    """``--isolate``: every (round, path) in a fresh process of this script (paths rotated
    each round), so no two paths share a process: torch's and numba's OpenMP runtimes, BLAS
    settings and the garbage collector's heap are each path's own."""
    import tempfile

    rows = []
    runs = [(p.strip(), t if p.strip() == ST else None)
            for p in args.paths.split(",") if p.strip()
            for t in (st_thread_counts(args.st_threads) if p.strip() == ST else [None])]
    for rnd in range(args.rounds):
        order = runs[rnd % len(runs):] + runs[:rnd % len(runs)]
        for path, threads in order:
            with tempfile.TemporaryDirectory() as out:
                cmd = [sys.executable, os.path.abspath(__file__), "--backend", args.backend,
                       "--sections", "closed", "--paths", path, "--clients", args.clients,
                       "--requests", str(args.requests), "--texts", str(args.texts),
                       "--rounds", "1", "--out", out, "--quiet",
                       "--batch-buckets", args.batch_buckets, "--seq-buckets", args.seq_buckets,
                       "--streams", str(args.streams), "--route", args.route,
                       "--max-padding",
                       args.max_padding]
                if threads:
                    cmd += ["--st-threads", str(threads)]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                name = [f for f in os.listdir(out) if f.endswith(".json")][0]
                with open(os.path.join(out, name)) as f:
                    got = json.load(f)["rows"]
            for r in got:
                r["round"] = rnd
                rows.append(r)
                if not args.quiet:
                    print(f"round {rnd} {label(r):22s} clients={r['clients']:3d}  "
                          f"{r['req_per_s']:7.1f} req/s  p50 {r['p50_ms']:8.1f} ms  "
                          f"rows/batch {r['rows_per_batch']:.1f}  CPU "
                          f"{r.get('cpu_ms_per_request', 0):.1f} ms/request  (own process)",
                          file=sys.stderr, flush=True)
    return rows


def _stop_child(child) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    child.terminate()
    try:
        child.wait(30)
    except subprocess.TimeoutExpired:
        child.kill()


def _serve_child(args, extra=()):
    """``python -m runtime serve`` in a child process on a free port; returns (child, url)
    once ``/health`` answers."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "runtime", "serve", "--backend", args.backend, "--port",
           str(port), "--log-level", "warning", *extra]
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    url = f"http://127.0.0.1:{port}"
    t_end = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return child, url
        except httpx.TransportError:
            pass
        if child.poll() is not None or time.monotonic() > t_end:
            child.kill()
            raise RuntimeError("the serve child did not start")
        time.sleep(0.2)


def health_rows(args) -> list:
    """The ``health`` section: ``/health`` latency while maximum-size legal requests arrive.

    One ``serve`` child (``--token-ids wordpiece`` where the checkout has the flag, so id lists
    are embedded, not refused). For each input kind, ``--health-senders`` clients each send
    ``--health-requests`` maximum-size requests back to back: ``texts`` (``--max-inputs``
    texts filling the body limit) and ``ids`` (one token list of as many ids as the body limit
    holds: 2.4 million at 16 MiB); a request unanswered after ``--health-seconds`` is left
    (``left``). Meanwhile one client GETs ``/health`` every 10 ms. Reported
    per kind: the probes' p50/p99/max latency (ms), how many, and the big requests' statuses.
    The goal (issue 25): p99 <= 50 ms."""
    import importlib.util
    import threading

    import httpx

    words = " ".join(SHORT).split()
    per_text = (args.max_body_bytes - 1000) // args.max_inputs - 6
    long_text = ((" ".join(words) + " ") * (per_text // len(" ".join(words)) + 1))[:per_text]
    n_ids = (args.max_body_bytes - 1000) // 6                  # "12345," per id
    ids = [10000 + (i * 7919) % 19000 for i in range(n_ids)]
    bodies = {"texts": json.dumps({"input": [long_text] * args.max_inputs}).encode(),
              "ids": json.dumps({"input": ids}, separators=(",", ":")).encode()}
    modes = importlib.util.find_spec("runtime.serving.token_ids") is not None
    child, url = _serve_child(args, ["--token-ids", "wordpiece"] if modes else [])
    rows = []
    try:
        # warm-up, untimed: every bucket and kernel the big requests use is captured and
        # compiled (a first capture compiles numba kernels, holding the GIL for seconds)
        for warm in ({"input": [long_text] * 64}, {"input": ids[:300_000]}):
            httpx.post(url + "/v1/embeddings", json=warm, timeout=1800)
        for kind, body in bodies.items():
            if kind not in args.health_kinds.split(","):
                continue
            statuses, lat, done = [], [], threading.Event()

            def sender():
                # a request still running after --health-seconds is left (the server cancels
                # its texts not yet batched): the window covers arrival, parsing, tokenizing
                # and the first batches, which is where the event loop could be blocked
                with httpx.Client(timeout=args.health_seconds) as http:
                    for _ in range(args.health_requests):
                        try:
                            r = http.post(url + "/v1/embeddings", content=body,
                                          headers={"content-type": "application/json"})
                            statuses.append(r.status_code)
                        except httpx.TimeoutException:
                            statuses.append("left")

            senders = [threading.Thread(target=sender) for _ in range(args.health_senders)]
            for t in senders:
                t.start()
            with httpx.Client(timeout=60) as http:
                while any(t.is_alive() for t in senders):
                    t0 = time.perf_counter()
                    http.get(url + "/health")
                    lat.append((time.perf_counter() - t0) * 1000)
                    time.sleep(0.01)
            for t in senders:
                t.join()
            rows.append({"kind": kind, "body_bytes": len(body), "senders": args.health_senders,
                         "requests": len(statuses), "statuses": sorted(map(str, set(statuses))),
                         "probes": len(lat), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
                         "max_ms": max(lat), "goal_p99_ms": 50.0,
                         "token_ids_flag": modes})
            if not args.quiet:
                x = rows[-1]
                print(f"health beside {kind:5s} ({x['body_bytes'] / 2**20:.1f} MiB x "
                      f"{x['senders']}): p50 {x['p50_ms']:.1f} ms, p99 {x['p99_ms']:.1f} ms, "
                      f"max {x['max_ms']:.1f} ms over {x['probes']} probes; statuses "
                      f"{x['statuses']}", file=sys.stderr, flush=True)
    finally:
        _stop_child(child)
    return rows


def print_tables(closed: list, mixed: list, largest: list, health: list = ()) -> None:
    """Plain-text tables of each section's rows."""
    if health:
        print(f"\n{'/health beside (serve child)':30s} {'MiB':>6s} {'p50 ms':>7s} {'p99 ms':>7s} "
              f"{'max ms':>7s} {'probes':>6s} {'goal':>5s}")
        for r in health:
            print(f"{r['kind'] + ' x' + str(r['senders']):30s} {r['body_bytes'] / 2**20:6.1f} "
                  f"{r['p50_ms']:7.1f} {r['p99_ms']:7.1f} {r['max_ms']:7.1f} {r['probes']:6d} "
                  f"{'ok' if r['p99_ms'] <= r['goal_p99_ms'] else 'MISS':>5s}")
    if closed and (max(r.get("round", 0) for r in closed) > 0 or best_st(closed)):
        print(f"\n{'path':26s} {'clients':>7s} {'rounds':>6s} {'req/s p50':>9s} {'min':>7s} "
              f"{'max':>7s} {'p50 ms':>8s} {'p99 ms':>8s} {'vs ST':>6s} {'min':>6s} {'max':>6s}")
        for s in summarize_closed(closed):
            vs = (f"{s['vs_st_median']:6.2f} {s['vs_st_min']:6.2f} {s['vs_st_max']:6.2f}"
                  if s["vs_st_median"] is not None else "")
            print(f"{s['label']:26s} {s['clients']:7d} {s['rounds']:6d} "
                  f"{s['req_per_s_median']:9.1f} {s['req_per_s_min']:7.1f} "
                  f"{s['req_per_s_max']:7.1f} {s['p50_ms_median']:8.1f} "
                  f"{s['p99_ms_median']:8.1f} {vs}")
    elif closed:
        print(f"\n{'path':26s} {'clients':>7s} {'req/s':>8s} {'texts/s':>8s} {'p50 ms':>9s} "
              f"{'p99 ms':>9s} {'batches':>7s} {'rows/b':>6s}")
        for r in closed:
            print(f"{label(r):26s} {r['clients']:7d} {r['req_per_s']:8.1f} "
                  f"{r['texts_per_s']:8.1f} {r['p50_ms']:9.1f} {r['p99_ms']:9.1f} "
                  f"{r['batches']:7d} {r['rows_per_batch']:6.1f}")
    if mixed:
        print(f"\n1-text requests from 8 clients, idle vs beside one client's "
              f"{mixed[0]['big_inputs']}-text requests (ms)")
        print(f"{'path':22s} {'idle p50':>9s} {'idle p99':>9s} {'mixed p50':>10s} "
              f"{'mixed p90':>10s} {'mixed p99':>10s} {'p50 x':>6s} {'p99 x':>6s} {'big':>4s}")
        for r in mixed:
            i, x = r["idle"], r["mixed"]
            print(f"{r['path']:22s} {i['p50_ms']:9.1f} {i['p99_ms']:9.1f} {x['p50_ms']:10.1f} "
                  f"{x['p90_ms']:10.1f} {x['p99_ms']:10.1f} {r['p50_ratio']:6.1f} "
                  f"{r['p99_ratio']:6.1f} {x['big_requests_done']:4d}")
    if largest:
        print(f"\n{'request (serve child)':24s} {'MiB':>6s} {'status':>6s} {'+peak MB':>9s} "
              f"{'CPU s':>7s} {'wall s':>7s}")
        for r in largest:
            print(f"{r['request'] + ' x' + str(r['inputs']):24s} {r['body_bytes'] / 2**20:6.1f} "
                  f"{r['status']:6d} {r['peak_rss_mb']:9.1f} {r['cpu_s']:7.1f} {r['wall_s']:7.1f}")
        a = largest[0]
        for b in largest[1:]:
            if a["request"] == "256-token texts" and a["cpu_s"] > 0:
                mem = b["peak_rss_mb"] / max(a["peak_rss_mb"], 1)
                print(f"{b['request']} / 256-token texts, per text: memory "
                      f"{mem * a['inputs'] / b['inputs']:.2f}x, CPU "
                      f"{b['cpu_s'] / b['inputs'] / (a['cpu_s'] / a['inputs']):.2f}x")


def main(argv=None) -> int:
    """Parse the flags and run the sections (module doc); 0 on success."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="cpu")
    p.add_argument("--sections", default="closed,mixed,largest",
                   help="comma list of closed, mixed, largest, health")
    p.add_argument("--clients", default="1,8,64", help="comma list of concurrent clients")
    p.add_argument("--requests", type=int, default=256, help="requests per (path, clients)")
    p.add_argument("--texts", type=int, default=1, help="texts per request")
    p.add_argument("--no-st", action="store_true", help="skip sentence-transformers")
    p.add_argument("--paths", default=f"graph,eager,{ST}",
                   help="comma list of the paths to serve (closed and mixed sections)")
    p.add_argument("--batch-buckets", default=",".join(map(str, BATCH_BUCKETS)),
                   help="the batcher's batch buckets (texts); every one is captured at start-up "
                   "with every sequence bucket up to 32")
    p.add_argument("--seq-buckets", default=",".join(map(str, SEQ_BUCKETS)),
                   help="the batcher's sequence buckets (tokens; the last >= 256); every one up "
                   f"to {WARMUP_SEQ} is captured at start-up with every batch bucket")
    p.add_argument("--streams", type=int, default=0,
                   help="graph and eager paths: a model per stream and a batcher per model, "
                   "each request to the least loaded (runtime.serving.BatcherGroup; serve "
                   "--streams); on cpu two batches then run at once, one thread each; 0 "
                   "(default): serve's default (runtime.serving.replica.default_streams: 2 "
                   "on cpu with 2 or more cores)")
    p.add_argument("--route", default="auto",
                   choices=("auto", "least", "spill", "cpu", "bucket"),
                   help="with --streams > 1, the BatcherGroup's routing: least (every request "
                   "to the least loaded), spill (the first batcher until a full batch waits "
                   "there), bucket (each sequence bucket to a batcher of its own, the least "
                   "loaded when that one is far ahead or another is idle), cpu (the first on a "
                   "free host, bucket on a busy one) or auto (cpu on the cpu backend, as serve; "
                   "least elsewhere)")
    p.add_argument("--max-padding", default="auto",
                   help="the graph and eager batchers' max_padding: auto, none or a fraction")
    p.add_argument("--rounds", type=int, default=1,
                   help="closed section: repeat every (path, clients) this many times, the "
                   "order rotated; the summary gives medians, spread and per-round ratios")
    p.add_argument("--isolate", action="store_true",
                   help="closed section: each (round, path) in a fresh process of its own")
    p.add_argument("--st-threads", default="0",
                   help="torch threads for sentence-transformers (default 0: torch's default); "
                   "a comma list (e.g. 1,2, with --isolate) runs it at each and compares the "
                   "other paths with the best of them per round")
    p.add_argument("--mixed-requests", type=int, default=16,
                   help="1-text requests per short client and phase (mixed section)")
    p.add_argument("--mixed-seconds", type=float, default=60.0,
                   help="no short request starts after this many seconds of a phase")
    p.add_argument("--max-inputs", type=int, default=2048,
                   help="inputs of the big requests (the server's limit)")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20,
                   help="the server's body limit: with --max-inputs, sizes the largest legal "
                   "request's texts")
    p.add_argument("--max-input-chars", type=int, default=100_000,
                   help="the server's characters-per-text limit")
    p.add_argument("--largest-requests", default="ref,body,longest",
                   help="largest section: ref (256-token texts), body (--max-inputs texts "
                   "filling the body limit), longest (--max-input-chars texts, as many as the "
                   "body limit allows)")
    p.add_argument("--largest-inputs", type=int, default=None,
                   help="texts sent in the largest section (default --max-inputs; fewer "
                   "scales the measurement down, each text keeping its size)")
    p.add_argument("--health-senders", type=int, default=4,
                   help="health section: clients sending maximum-size requests")
    p.add_argument("--health-requests", type=int, default=2,
                   help="health section: maximum-size requests per sender and input kind")
    p.add_argument("--health-seconds", type=float, default=30.0,
                   help="health section: a big request still unanswered after this long is "
                   "left (its texts not yet batched are cancelled)")
    p.add_argument("--health-kinds", default="texts,ids",
                   help="health section: input kinds (texts, ids)")
    p.add_argument("--quick", action="store_true", help="64 requests, 8 per mixed client")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--contention", type=int, default=0, metavar="N",
                   help="run N busy-loop processes beside every path for the whole run")
    args = p.parse_args(argv)
    try:
        threads = st_thread_counts(args.st_threads)
    except ValueError as e:
        p.error(str(e))
    if args.streams < 0:
        p.error(f"--streams {args.streams}: at least 1 (0: serve's default)")
    if len(threads) > 1 and not args.isolate:
        p.error("--st-threads with several counts needs --isolate (torch's threads are "
                "per process)")
    with _busy_processes(args.contention):
        return _main(args)


def _busy_processes(n: int):
    """This checkout's busy loops (runtime/bench/contention.py, a leaf file loaded by path, so
    that it works when PYTHONPATH points at an older checkout's runtime)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_contention", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime", "bench",
        "contention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.busy_processes(n)


def _main(args) -> int:
    global BATCH_BUCKETS, SEQ_BUCKETS, WARMUP, MAX_PADDING, ROUTE
    ROUTE = args.route
    BATCH_BUCKETS = tuple(int(b) for b in args.batch_buckets.split(","))
    SEQ_BUCKETS = tuple(int(b) for b in args.seq_buckets.split(","))
    WARMUP = [(b, s) for s in SEQ_BUCKETS if s <= WARMUP_SEQ for b in BATCH_BUCKETS]
    MAX_PADDING = {"auto": "auto", "none": None}.get(args.max_padding.lower(), None)
    if args.max_padding.lower() not in ("auto", "none"):
        MAX_PADDING = float(args.max_padding)
    if args.quick:
        args.requests, args.mixed_requests = 64, 8
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    closed, mixed, largest, st_note, names = [], [], [], None, []
    backend = args.backend
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if args.no_st:
        paths = [x for x in paths if x != ST]
        args.paths = ",".join(paths)
    if ST not in paths:
        st_note = "sentence-transformers not run (--no-st or not in --paths)"
    if "closed" in sections and args.isolate:
        closed = isolated_rows(clients, args)
        names = [x for x in paths if any(r["path"] == x for r in closed)]
        sections = sections - {"closed"}
    if sections & {"closed", "mixed"}:
        model = None
        if {"graph", "eager"} & set(paths):
            model = [load_model(None if args.backend == "auto" else args.backend,
                                max_graphs=len(WARMUP))]
            if not args.streams:                   # serve's default (a checkout before it: 1)
                try:
                    from runtime.serving.replica import default_streams
                    args.streams = default_streams(model[0].client.backend, model[0])
                except ImportError:
                    args.streams = 1
            for _ in range(args.streams - 1):      # the same weights (a checkout before
                model.append(model[0].replica() if hasattr(model[0], "replica")    # replica():
                             else load_model(model[0].client.backend,              # a copy)
                                             max_graphs=len(WARMUP)))
            backend = model[0].client.backend
            if args.streams > 1:
                try:
                    from runtime.serving import BatcherGroup  # noqa: F401
                except ImportError:
                    print("this checkout has no BatcherGroup: one stream", file=sys.stderr)
                    model = model[:1]
            model = model if len(model) > 1 else model[0]
        servers = {name: start(model, name == "graph", args.quiet)
                   for name in ("graph", "eager") if name in paths}
        if ST in paths:
            try:
                from runtime.models import default_model_dir
                servers["sentence-transformers"] = start(
                    SentenceTransformersModel(default_model_dir(),
                                              st_thread_counts(args.st_threads)[0] or None),
                    False, args.quiet, exact=True)
            except ImportError as e:
                st_note = f"sentence-transformers not installed ({e}); skipped"
            except Exception as e:  # noqa: BLE001 - optional comparison
                st_note = f"sentence-transformers failed to load: {type(e).__name__}: {e}"
        if st_note and not args.quiet:
            print(st_note, file=sys.stderr)
        names = list(servers)
        for _, srv, _ in servers.values():                    # one untimed round each
            asyncio.run(drive(srv.url, plan(8, 16, args.texts)))
        if "closed" in sections:
            closed = [r for k in range(args.rounds) for r in closed_rows(servers, clients, args, k)]
        if "mixed" in sections:
            mixed = mixed_rows(servers, args)
        for b, srv, _ in servers.values():
            srv.stop()
            b.close()
    if "largest" in sections:
        largest = largest_rows(args)
    health = health_rows(args) if "health" in sections else []
    print_tables(closed, mixed, largest, health)
    if st_note:
        print(st_note)
    os.makedirs(args.out, exist_ok=True)
    meta = {"backend": backend, "requests": args.requests, "texts": args.texts,
            "clients": clients, "batch_buckets": BATCH_BUCKETS, "seq_buckets": SEQ_BUCKETS,
            "max_inputs": args.max_inputs, "max_body_bytes": args.max_body_bytes,
            "largest_inputs": args.largest_inputs or args.max_inputs,
            "st_threads": args.st_threads if args.st_threads != "0" else "torch default",
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
            "sentence_transformers": st_note or "included", "paths": args.paths,
            "rounds": args.rounds, "isolated": bool(args.isolate),
            "max_padding": args.max_padding, "streams": args.streams, "route": args.route,
            "contention": {"busy_processes": args.contention}}
    base = os.path.join(args.out, f"serving_{backend}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": closed, "summary": summarize_closed(closed),
                   "mixed": mixed, "largest": largest, "health": health}, f, indent=1)
    if not closed:
        print(f"wrote {base}.json")
        return 0
    rows = summarize_closed(closed)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {base}.json (matplotlib missing: no plot)")
        return 0
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for k, name in enumerate(dict.fromkeys(r["label"] for r in rows
                                           if r["path"] in names)):
        rs = sorted((r for r in rows if r["label"] == name), key=lambda r: r["clients"])
        x, color = [r["clients"] for r in rs], f"C{k}"
        med = [r["req_per_s_median"] * args.texts for r in rs]
        a1.errorbar(x, med, yerr=[[m - r["req_per_s_min"] * args.texts for m, r in zip(med, rs)],
                                  [r["req_per_s_max"] * args.texts - m for m, r in zip(med, rs)]],
                    fmt="o-", color=color, capsize=3, label=name)
        a2.plot(x, [r["p50_ms_median"] for r in rs], "o-", color=color, label=f"{name} p50")
        a2.plot(x, [r["p99_ms_median"] for r in rs], "x--", color=color, label=f"{name} p99")
    for a, y in ((a1, "texts / s (median, min-max)"), (a2, "request latency (ms, median)")):
        a.set_xscale("log", base=2)
        a.set_xticks(clients, [str(c) for c in clients])
        a.set_xlabel("concurrent clients")
        a.set_ylabel(y)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    a2.set_yscale("log")
    fig.suptitle(f"POST /v1/embeddings on {backend}: {args.requests} requests x "
                 f"{args.texts} text(s), {args.rounds} round(s)"
                 f"{', each path in its own process' if args.isolate else ''}")
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=110)
    print(f"wrote {base}.json and {base}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
