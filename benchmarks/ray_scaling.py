"""Scaling out on Ray: corpus embedding with 1 vs 2 Ray Data actors, and Ray Serve with 1 vs 2
replicas beside the single-process server.

Everything runs on one local Ray cluster on 127.0.0.1 (``runtime.cluster.init_ray``; its
logical CPUs = this machine's cores) and on the cpu backend, each model process sharing out
its cores by the cpu thread rule (``runtime.cpu_threads``; a Ray worker's cores are its
``num_cpus``, through the ``OMP_NUM_THREADS`` Ray sets).

- **Corpus** (``embed_corpus``): a JSON Lines file of ``--rows`` distinct short sentences,
  embedded in-process (one Parquet file), by a Ray Data pool of 1 actor and of 2 actors (a
  Parquet dataset the workers write). Each run is its own process (with Ray: its own local
  cluster); the paths take turns (order rotated per repetition); each sample is the whole
  call's wall time, actor start-up and model load included, reported as texts/s, with the
  driver process's peak RSS (``--small-rows N`` adds a 2-actor run on N rows: the driver's
  RSS should not grow with the corpus).
- **Serving**: the single-process server (``python -m runtime serve`` in its own process) and
  two Serve applications behind one proxy, 1 replica (``/one``) and 2 replicas (``/two``), all
  warmed up with the same buckets. For each client count (``--clients``, default 1, 8, 64) the
  paths take turns on the same closed-loop workload (``benchmarks/serving.py``'s ``drive``:
  ``--requests`` requests of one sentence). Reported: requests/s over the run and p10/p50/p90
  latency. Ray's overhead per request is the 1-client p50 latency of Serve with one replica
  minus the single-process server's (the same app and batcher, plus Serve's proxy and router).

Usage::

    python benchmarks/ray_scaling.py [--rows 2000] [--small-rows 0] [--reps 3] [--clients 1,8,64]
                                     [--requests 128] [--quick] [--no-plot] [--out DIR]

Writes ``ray_scaling.json`` and ``.png`` to ``--out`` (default ``benchmarks/results``,
gitignored); the corpus and outputs go to a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine, summarize, write_json  # noqa: E402
from benchmarks.serving import SHORT, drive, plan  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
WARMUP = "1x16,2x16,4x16,8x16,16x16,32x16,1x32,8x32"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_corpus(path: Path, rows: int) -> None:
    """``rows`` distinct short sentences as JSON Lines (``id``, ``text``)."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            f.write(json.dumps({"id": i, "text": f"{SHORT[i % len(SHORT)]} (#{i})"}) + "\n")


CORPUS_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {repo!r})
from runtime.cluster import init_ray
from runtime.corpus import embed_corpus
kw = json.loads({kw!r})
if kw.get("use_ray"):
    init_ray(num_cpus={cpus}, log_to_driver=False)
t0 = time.perf_counter()
s = embed_corpus({src!r}, {out!r}, progress=False, backend="cpu", **kw)
wall = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"rows": s.rows, "failed": s.failed, "wall_s": wall,
                  "driver_peak_rss_mib": rss}}))
"""


def _corpus_run(src: Path, out: Path, kw: dict, cpus: int) -> dict:
    """One ``embed_corpus`` in a fresh process (the driver, with Ray: a local cluster of its
    own); returns its rows, wall time (the whole call, actor start-up and model load included)
    and the driver process's own peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``)."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    if out.is_file():
        out.unlink()
    code = CORPUS_CHILD.format(repo=str(REPO), kw=json.dumps(kw), cpus=cpus, src=str(src),
                               out=str(out))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=7200)
    if r.returncode != 0:
        raise RuntimeError(f"corpus run {kw} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_corpus(rows: int, reps: int, cpus: int, small: int = 0) -> dict:
    """texts/s and the driver's peak RSS of in-process vs 1 vs 2 Ray Data actors (each run in
    its own process, paths interleaved); with ``small`` rows also the 2-actor run on a corpus of
    that size, whose driver RSS beside the big one shows whether it grows with the corpus."""
    import shutil

    tmp = Path(tempfile.mkdtemp(prefix="ray_scaling_"))
    try:
        return _bench_corpus(tmp, rows, reps, cpus, small)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)      # the corpus and every output (GBs at 1M rows)


def _bench_corpus(tmp: Path, rows: int, reps: int, cpus: int, small: int) -> dict:
    src = tmp / "corpus.jsonl"
    write_corpus(src, rows)
    # actors take half a logical CPU each, so 2 actors leave room for Ray Data's tasks
    half = min(0.5, cpus / 4)
    paths = {"in-process": {}, "ray 1 actor": {"use_ray": True, "actors": 1, "actor_cpus": half},
             "ray 2 actors": {"use_ray": True, "actors": 2, "actor_cpus": half}}
    rate: dict = {n: [] for n in paths}
    rss: dict = {n: [] for n in paths}
    names = list(paths)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            out = tmp / ("out" if paths[name] else "out.parquet")
            r = _corpus_run(src, out, paths[name], cpus)
            assert r["rows"] == rows and r["failed"] == 0, r
            rate[name].append(rows / r["wall_s"])
            rss[name].append(r["driver_peak_rss_mib"])
            print(f"  corpus {name:13s} rep {rep}: {rows / r['wall_s']:7.1f} texts/s "
                  f"({r['wall_s']:.1f} s), driver peak RSS {r['driver_peak_rss_mib']:.0f} MiB",
                  flush=True)
    out = {n: summarize(v, scale=1.0) for n, v in rate.items()}
    out["driver_peak_rss_mib"] = {n: max(v) for n, v in rss.items()}
    out["ratio_2_vs_1_actor"] = out["ray 2 actors"]["p50"] / out["ray 1 actor"]["p50"]
    out["ratio_1_actor_vs_in_process"] = out["ray 1 actor"]["p50"] / out["in-process"]["p50"]
    if small:
        write_corpus(tmp / "small.jsonl", small)
        r = _corpus_run(tmp / "small.jsonl", tmp / "small_out", paths["ray 2 actors"], cpus)
        out["driver_peak_rss_mib_small"] = {"rows": small, "ray 2 actors":
                                            r["driver_peak_rss_mib"]}
        print(f"  corpus ray 2 actors, {small} rows: driver peak RSS "
              f"{r['driver_peak_rss_mib']:.0f} MiB", flush=True)
    out["rows"] = rows
    return out


def _single_process_server(port: int):
    """``python -m runtime serve`` in its own process; returns (process, url) once healthy."""
    import httpx

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH",
                                                                                 "")]))
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--port", str(port),
                             "--warmup", WARMUP, "--log-level", "warning"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    t_end = time.monotonic() + 300
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"the single-process server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the single-process server did not come up in 300 s")


def bench_serving(clients: list, requests: int, reps: int, cpus: int) -> dict:
    """Single-process vs Serve 1 vs 2 replicas, per client count; returns the summaries."""
    from ray import serve

    from runtime.serving.cli import parse_buckets
    from runtime.serving.ray_serve import build_app, deploy

    proc, single = _single_process_server(_free_port())
    port = _free_port()
    settings = {"backend": "cpu", "max_graphs": 8, "warmup": parse_buckets(WARMUP)}
    urls = {"single process": single}
    try:
        for name, n, prefix in (("serve 1 replica", 1, "/one"), ("serve 2 replicas", 2, "/two")):
            app = build_app(settings, replicas=n, num_cpus=min(0.5, cpus / 4))
            urls[name] = deploy(app, port=port, name=f"bench-{n}", route_prefix=prefix)
        for url in urls.values():                        # any capture the warm-up missed
            asyncio.run(drive(url, plan(8, 16, 1)))
        out: dict = {}
        names = list(urls)
        for c in clients:
            lat: dict = {n: [] for n in names}
            rps: dict = {n: [] for n in names}
            for rep in range(reps):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    ls, wall, fails = asyncio.run(drive(urls[name], plan(c, requests, 1)))
                    assert fails == 0, f"{name}: {fails} failed requests"
                    lat[name] += ls
                    rps[name].append(requests / wall)
                    print(f"  serving {name:16s} {c:3d} clients rep {rep}: "
                          f"{requests / wall:7.1f} req/s, p50 {np.median(ls) * 1e3:.1f} ms",
                          flush=True)
            out[str(c)] = {n: {"requests_per_s": summarize(rps[n], scale=1.0),
                               "latency_ms": summarize(lat[n], scale=1e3)} for n in names}
            row = out[str(c)]
            row["ratio_2_vs_1_replica"] = (row["serve 2 replicas"]["requests_per_s"]["p50"]
                                           / row["serve 1 replica"]["requests_per_s"]["p50"])
            row["ratio_1_replica_vs_single"] = (row["serve 1 replica"]["requests_per_s"]["p50"]
                                                / row["single process"]["requests_per_s"]["p50"])
        one = out.get("1")
        if one:
            out["ray_overhead_ms_p50"] = (one["serve 1 replica"]["latency_ms"]["p50"]
                                          - one["single process"]["latency_ms"]["p50"])
        return out
    finally:
        serve.shutdown()
        proc.terminate()
        proc.wait(30)


def plot(res: dict, path: Path) -> None:
    """Corpus texts/s (bars with p10-p90) and serving requests/s per client count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    corpus = {k: v for k, v in res["corpus"].items() if isinstance(v, dict)}
    med = [v["p50"] for v in corpus.values()]
    err = [[m - v["p10"] for m, v in zip(med, corpus.values())],
           [v["p90"] - m for m, v in zip(med, corpus.values())]]
    a1.bar(list(corpus), med, yerr=err, capsize=4)
    a1.set_ylabel("texts/s (whole command)")
    a1.set_title("embed-corpus")
    serving = {k: v for k, v in res["serving"].items() if isinstance(v, dict)}
    xs = [int(c) for c in serving]
    for name in ("single process", "serve 1 replica", "serve 2 replicas"):
        a2.plot(xs, [serving[str(c)][name]["requests_per_s"]["p50"] for c in xs], "o-",
                label=name)
    a2.set_xscale("log", base=2)
    a2.set_xlabel("concurrent clients")
    a2.set_ylabel("requests/s (1 sentence each)")
    a2.set_title("serving")
    a2.legend()
    fig.suptitle(f"Ray scaling, load {res['machine'].get('loadavg')}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    """Run both parts; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2000, help="corpus rows")
    p.add_argument("--small-rows", type=int, default=0,
                   help="also run 2 actors on a corpus of this many rows (driver RSS vs size)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per path")
    p.add_argument("--clients", default="1,8,64", help="client counts")
    p.add_argument("--requests", type=int, default=128, help="requests per client count")
    p.add_argument("--quick", action="store_true", help="500 rows, 1 rep, 64 requests")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--skip", choices=["corpus", "serving"], default=None)
    p.add_argument("--out", default=str(RESULTS), help="folder of ray_scaling.json/.png")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.reps, args.requests = 500, 1, 64
    from runtime.cluster import init_ray

    cpus = os.cpu_count() or 2
    res = {"machine": machine(), "args": vars(args)}
    if args.skip != "corpus":         # each run in its own process, with its own cluster
        res["corpus"] = bench_corpus(args.rows, args.reps, cpus, args.small_rows)
    if args.skip != "serving":
        init_ray(num_cpus=cpus, log_to_driver=False)
        res["serving"] = bench_serving([int(c) for c in args.clients.split(",")], args.requests,
                                       args.reps, cpus)
    res["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    path = write_json(Path(args.out) / "ray_scaling.json", res)
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1))
    print(f"wrote {path}")
    if not args.no_plot and "corpus" in res and "serving" in res:
        try:
            plot(res, path.with_suffix(".png"))
            print(f"wrote {path.with_suffix('.png')}")
        except ImportError:
            print("matplotlib missing: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
