"""``python -m runtime demo``: serve MiniLM on the embedded default (cpu) and load it.

Starts the embeddings server in-process on a free loopback port (uvicorn on a thread), sends
real sentences from several concurrent HTTP clients (httpx), checks the answers, and prints one
table: throughput and p50/p99 request latency with the batcher replaying captured bucket graphs
vs the same workload launched eagerly (two servers on one model, taking turns in four rounds).

Checks (exit code 1 if any fails): every request answered 200 with unit-norm rows; a text
always gets the same vector whatever it was batched with (no cross-talk); the graph and eager
paths agree to 1e-4; a paraphrase pair is similar (cosine > 0.75) and an unrelated pair is not
(< 0.3).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time

import numpy as np

from .. import flags

#: Demo texts: two paraphrase pairs, unrelated topics, an empty string, a one-word text, a
#: non-English one and one far longer than the model's 256 tokens (truncated as the model does).
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A fast brown fox leaps over a sleepy dog.",
    "How do I change the password on my account?",
    "What are the steps to reset my account password?",
    "The central bank raised interest rates by a quarter of a percentage point.",
    "Fresh basil and ripe tomatoes make a simple summer salad.",
    "The spacecraft entered orbit around Jupiter after a five-year journey.",
    "Our train to Lyon was delayed by forty minutes because of snow.",
    "She plays the cello in the city's youth orchestra every Thursday.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "Please send the quarterly report to the finance team by Friday.",
    "Il pleut depuis ce matin sur toute la Bretagne.",
    "",
    "ok",
    "Shipping was free, but the package arrived with a cracked screen - 2/5 stars.",
    "Gradient descent nudges every weight a little downhill on the loss surface.",
    " ".join(["The night ferry left the island at eleven, its deck lamps swinging as the swell "
              "rose, and the few passengers who stayed outside watched the harbour lights "
              "shrink into a thin gold line before the rain closed in."] * 8),
]
PARAPHRASE = (0, 1)          # fox / fox: ~0.85 measured
UNRELATED = (0, 8)           # fox / cello: ~0.0 measured
PARAPHRASE_MIN, UNRELATED_MAX = 0.75, 0.3
#: Buckets the demo uses: short texts batch up to 16; the long text runs alone at 256 tokens.
#: Each capture costs about two forwards of its bucket, so start-up stays short.
BATCH_BUCKETS = (1, 2, 4, 8, 16)
SEQ_BUCKETS = (16, 32, 64, 256)
WARMUP = [(b, s) for s in (16, 32) for b in BATCH_BUCKETS] + [(1, 256)]


def workload(clients: int, per_client: int) -> list:
    """The request bodies of each client: ``[[texts, ...] per client]``, deterministic.

    Every third request carries three texts, the others one, drawn from the short sentences;
    the first client's fifth request is the long text (real traffic has a few).
    """
    short = SENTENCES[:-1]
    n = len(short)
    out = []
    for c in range(clients):
        reqs = []
        for i in range(per_client):
            k = (c * 5 + i * 3) % n
            reqs.append([short[(k + j) % n] for j in range(3)] if i % 3 == 2 else [short[k]])
        if c == 0 and per_client > 4:
            reqs[4] = [SENTENCES[-1]]
        out.append(reqs)
    return out


async def _drive(url: str, plan: list, model_id: str) -> tuple:
    """Send each client's requests in order, clients concurrently. Returns (latencies s,
    [(texts, status, body)], wall s)."""
    import httpx

    lat, answers = [], []

    async def one_client(http, reqs):
        for texts in reqs:
            t0 = time.perf_counter()
            r = await http.post("/v1/embeddings", json={"input": texts, "model": model_id})
            lat.append(time.perf_counter() - t0)
            answers.append((texts, r.status_code, r.json()))

    limits = httpx.Limits(max_connections=len(plan) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(http, reqs) for reqs in plan))
        wall = time.perf_counter() - t0
    return lat, answers, wall


def run_paths(model, plan: list, warm_plan: list, rounds: int, quiet: bool) -> list:
    """Serve ``model`` twice on loopback (graph path and eager path, one server each), send
    ``warm_plan`` to each untimed, then ``plan`` in ``rounds`` slices, the paths taking turns
    (order alternating) so load drift hits both alike. Returns one result dict per path."""
    from . import MODEL_ID, ServerThread, ServingMetrics, create_app
    from .replica import start_batcher

    paths = []
    try:
        for graph in (True, False):
            metrics = ServingMetrics()
            b = start_batcher(model=model, graph=graph, max_batch=BATCH_BUCKETS[-1],
                              metrics=metrics, batch_buckets=BATCH_BUCKETS,
                              seq_buckets=SEQ_BUCKETS)
            paths.append({"graph": graph, "batcher": b, "metrics": metrics, "lat": [],
                          "answers": [], "wall": 0.0})
            if graph:
                b.warmup(WARMUP, progress=not quiet)
            p = paths[-1]
            p["server"] = ServerThread(create_app(b, metrics=metrics))
            p["server"].start()
            asyncio.run(_drive(p["server"].url, warm_plan, MODEL_ID))
            p["b0"], p["c0"] = b.batches_run, metrics.value("graph_captures_total")
        slices = [[reqs[r::rounds] for reqs in plan] for r in range(rounds)]
        for r, part in enumerate(slices):
            for p in (paths if r % 2 == 0 else paths[::-1]):
                lat, answers, wall = asyncio.run(_drive(p["server"].url, part, MODEL_ID))
                p["lat"] += lat
                p["answers"] += answers
                p["wall"] += wall
    finally:
        for p in paths:
            if "server" in p:
                p["server"].stop()
            p["batcher"].close()
    out = []
    for p in paths:
        lat_ms = np.array(p["lat"]) * 1e3
        texts = sum(len(t) for t, _, _ in p["answers"])
        batches = p["batcher"].batches_run - p["b0"]
        wall = p["wall"]
        out.append({"path": "replayed graphs" if p["graph"] else "eager launches",
                    "requests": len(lat_ms), "texts": texts, "wall_s": wall,
                    "req_per_s": len(lat_ms) / wall, "texts_per_s": texts / wall,
                    "p50_ms": float(np.percentile(lat_ms, 50)),
                    "p99_ms": float(np.percentile(lat_ms, 99)), "batches": batches,
                    "rows_per_batch": texts / max(batches, 1),
                    "captures_in_run": int(p["metrics"].value("graph_captures_total") - p["c0"]),
                    "answers": p["answers"]})
    return out


def check(results: list) -> list:
    """The demo's checks over both phases. Returns ``[(name, ok, detail)]``."""
    from .app import cosine

    checks = []
    vec: dict = {}
    bad_status, bad_norm, drift = 0, 0, 0.0
    per_path = []
    for res in results:
        seen: dict = {}
        for texts, status, body in res["answers"]:
            if status != 200 or len(body.get("data", [])) != len(texts):
                bad_status += 1
                continue
            for i, t in enumerate(texts):
                row = body["data"][i]
                e = np.asarray(row["embedding"], np.float32)
                if row["index"] != i or abs(float(np.linalg.norm(e)) - 1) > 1e-3:
                    bad_norm += 1
                if t in seen:
                    drift = max(drift, float(np.abs(seen[t] - e).max()))
                seen[t] = e
        per_path.append(seen)
    checks.append(("every request answered 200 with its own rows", bad_status == 0,
                   f"{bad_status} bad answers"))
    checks.append(("rows carry their index and unit norm", bad_norm == 0, f"{bad_norm} bad rows"))
    checks.append(("a text gets the same vector in every batch", drift < 1e-5,
                   f"max diff {drift:.1e}"))
    if len(per_path) == 2:
        common = set(per_path[0]) & set(per_path[1])
        d = max((float(np.abs(per_path[0][t] - per_path[1][t]).max()) for t in common),
                default=np.inf)
        checks.append(("graph and eager paths agree (1e-4)", d < 1e-4, f"max diff {d:.1e}"))
    vec = per_path[0]
    a, b = (SENTENCES[i] for i in PARAPHRASE)
    s = cosine(vec[a], vec[b]) if a in vec and b in vec else float("nan")
    checks.append((f"paraphrase cosine > {PARAPHRASE_MIN}", s > PARAPHRASE_MIN,
                   f"{s:.3f}  ({a!r} ~ {b!r})"))
    a, b = (SENTENCES[i] for i in UNRELATED)
    s = cosine(vec[a], vec[b]) if a in vec and b in vec else float("nan")
    checks.append((f"unrelated cosine < {UNRELATED_MAX}", s < UNRELATED_MAX,
                   f"{s:.3f}  ({a!r} vs {b!r})"))
    return checks


def print_table(results: list, title: str) -> None:
    """One table, ``rich`` if installed, else plain text."""
    cols = ["path", "requests", "texts", "wall s", "req/s", "texts/s", "p50 ms", "p99 ms",
            "batches", "rows/batch"]
    rows = [[r["path"], str(r["requests"]), str(r["texts"]), f"{r['wall_s']:.2f}",
             f"{r['req_per_s']:.1f}", f"{r['texts_per_s']:.1f}", f"{r['p50_ms']:.1f}",
             f"{r['p99_ms']:.1f}", str(r["batches"]), f"{r['rows_per_batch']:.1f}"]
            for r in results]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        line = "  ".join("-" * w for w in widths)
        print(title)
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols,
                                                                                    widths))))
        print(line)
        for r in rows:
            print("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in
                            enumerate(zip(r, widths))))
        return
    t = Table(title=title)
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*r)
    Console().print(t)


def print_anchor(graph_result: dict, plan: list, python: str | None = None) -> None:
    """Print sentence-transformers' throughput on the demo's texts beside the served graph path
    (:func:`runtime.serving.anchor.anchor_throughput`); one line saying why when it is absent."""
    from runtime.models.minilm import default_model_dir

    from .anchor import anchor_throughput
    texts = [t for client in plan for req in client for t in req]
    try:
        a = anchor_throughput(texts, str(default_model_dir()), python=python)
    except (RuntimeError, FileNotFoundError, OSError) as e:
        print(f"sentence-transformers comparison failed: {e}")
        return
    if a is None:
        print("sentence-transformers not importable (pass --st-python or set RUNTIME_ST_PYTHON "
              "to compare)")
        return
    print(f"sentence-transformers {a['versions']['sentence_transformers']} (torch "
          f"{a['versions']['torch']}, {a['threads']['torch']} threads), encode(batch_size=32) "
          f"of the same {len(texts)} texts in one process: {a['texts_per_s']:.1f} texts/s "
          f"[{a['min']:.1f}-{a['max']:.1f}]; runtime served over HTTP: "
          f"{graph_result['texts_per_s']:.1f} texts/s "
          f"({graph_result['texts_per_s'] / a['texts_per_s']:.2f}x)")


def main(argv=None) -> int:
    """Run the demo. Returns 0 when every check passes, 1 when one fails, 2 without a model."""
    p = argparse.ArgumentParser(prog="python -m runtime demo", description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="cpu", choices=["cpu", "wgpu", "cuda", "auto"],
                   help="cpu (default), wgpu, cuda or auto")
    p.add_argument("--clients", type=flags.positive(int), default=8,
                   help="concurrent HTTP clients")
    p.add_argument("--requests", type=flags.positive(int), default=24,
                   help="timed requests per client")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--st-python", help="interpreter with sentence-transformers for the "
                   "comparison line (default: $RUNTIME_ST_PYTHON, or this one if it has it)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"the demo needs {', '.join(missing)}: pip install -e '.[serve]'", file=sys.stderr)
        return 2
    from . import load_model

    backend = None if args.backend == "auto" else args.backend
    t0 = time.perf_counter()
    from ..models.minilm import ModelFilesMissing
    try:
        model = load_model(backend, max_graphs=len(WARMUP))
    except ModelFilesMissing as e:          # one line (README "Commands"): no flag to name
        raise e.naming(None) from None
    print(f"all-MiniLM-L6-v2 on {model.client.backend} loaded in "
          f"{time.perf_counter() - t0:.1f}s; {args.clients} concurrent clients x "
          f"{args.requests} requests over loopback HTTP", flush=True)
    plan = workload(args.clients, args.requests)
    warm = workload(args.clients, 3)
    results = run_paths(model, plan, warm, rounds=min(4, args.requests), quiet=args.quiet)
    print()
    print_table(results, f"POST /v1/embeddings, {model.client.backend} backend, "
                f"{args.clients} clients")
    g, e = results
    print(f"graphs vs eager: throughput {g['texts_per_s'] / e['texts_per_s']:.2f}x, latency "
          f"p50 {g['p50_ms'] / e['p50_ms']:.2f}x, p99 {g['p99_ms'] / e['p99_ms']:.2f}x (latency "
          f"below 1x: graphs faster); {len(model.buckets)} graphs held, "
          f"{g['captures_in_run']} captured while timed")
    print_anchor(g, plan, args.st_python)
    print()
    checks = check(results)
    for name, ok, detail in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
    failed = [c for c in checks if not c[1]]
    print("all checks passed" if not failed else f"{len(failed)} check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
