"""Soak: a long-lived service's mixed work, and whether anything grows (issue 24 item 6).

For ``seconds`` (600: ten minutes; ``--quick``: 4) eight threads loop over a seeded mix of:

- ``request``: a per-request stream (``client.with_stream(StreamId.new())``): create, launch a
  kernel that also reads a long-lived shared buffer, read, check the values, drop everything;
- ``thread``: a short-lived thread doing one request on its own (unpinned) stream, then ending;
- ``graph``: capture a graph on a fresh stream, replay it, read, check, release (or just drop);
- ``failure``: an injected kernel failure (a kernel that fails on every backend, at execution
  on cpu and at submit on wgpu) on a per-request stream; its ``sync`` must raise it;
- ``handle_burst``: 1,000 handles (``--quick``: 200) made, then dropped at once;
- ``graph_burst``: 20 graphs sharing two buffers captured, then dropped at once.

Meanwhile a probe thread reads 16 bytes on its own stream every 2 ms (latency in ms), a sampler
records the device queue's length every millisecond, and every ``interval`` seconds the main
thread records RSS and the server's tables: streams (server and backend), handles, graphs, live
failure marks (the marks reachable from live handles, chains included), errors waiting for a
blocking call, releases pending. After the workers stop and the stream syncs, the tables are
read once more (``end``).

Reported per backend: the series, the start and end snapshots, the queue's maximum length, the
probe's p50/p99 over the first and the last fifth of the run, counts of each operation, and any
unexpected error (wrong values, a failure that was not raised where it should be). Goals (not
tests): every count back to its baseline at the end and bounded by live work during the run;
RSS at the end within +20 MB of RSS after the first fifth (warm-up: compiles, thread stacks);
the probe's p99 in the last fifth within 1.5x the first; no unexpected error.

Plugs into ``python -m runtime bench`` as the section ``soak``, run only when named
(``--sections soak --budget-s 0``: ten minutes per backend; with a budget, its share); also ``python -m runtime.bench.soak
[--backend cpu,wgpu] [--seconds S] [--quick] [--out FILE]``. Reads the server's tables through
``client._server`` (what it measures has no public API).
"""

from __future__ import annotations

import argparse
import gc
import random
import threading
import time

import numpy as np

import runtime
import runtime.kernels as K
from runtime.errors import ServerError
from runtime.kernel import Kernel

from .results import machine, write_json
from .stalls import rss_mb
from .timing import clock, summarize

WORKERS = 8
#: the mix: operation -> weight.
MIX = {"request": 50, "thread": 8, "graph": 15, "failure": 10, "handle_burst": 4,
       "graph_burst": 2}

_FAIL_WGSL = """
@group(0) @binding(0) var<storage, read_write> y: array<f32, 64>;
@compute @workgroup_size(1)
fn main() { y[63] = 5.0; }
"""


def _fail_cpu(y, *, count):
    y[63] = 5.0                              # y holds 4 floats: IndexError


#: fails on cpu (at execution) and wgpu (validation: the binding is smaller than the shader's
#: array); bound to a 16-byte buffer.
FAIL = Kernel("soak_fail", [("y", "f32", "read_write")], workgroup_size=(1, 1, 1),
              wgsl=_FAIL_WGSL, cpu=_fail_cpu)


def _plan(quick: bool, seconds: float | None) -> dict:
    s = seconds if seconds is not None else (4.0 if quick else 600.0)
    return {"seconds": float(s), "interval": max(0.5, min(10.0, s / 20)),
            "handle_burst": 200 if quick else 1000, "graph_burst": 20, "workers": WORKERS}


def units(quick: bool) -> int:
    """Progress units ``measure`` reports per backend: one per snapshot interval (20)."""
    return 20


def _tables(srv) -> dict:
    """The server's table sizes, read on its owner (one message)."""
    from runtime.server.marks import CLEAN

    def read():
        seen, stack = set(), [st.mark for st in srv.handles.values()]
        while stack:
            m = stack.pop()
            if m is None or m is CLEAN or id(m) in seen:
                continue
            seen.add(id(m))
            stack.extend(p for _, p in getattr(m, "parents", ()) or ())
        be_streams = getattr(srv.backend, "streams", None)
        return {"streams": len(srv.streams),
                "backend_streams": None if be_streams is None else len(be_streams),
                "handles": len(srv.handles), "graphs": len(srv.graphs), "marks": len(seen),
                "waiting_errors": len(srv.marks.async_errors) + len(srv.backend.failures),
                "releases_pending": srv.queue.pending_releases}
    return srv.call(read)


class _Work:
    """The workers' shared state and operations (each returns after checking its result)."""

    def __init__(self, backend: str, plan: dict, seed: int = 0):
        self.backend, self.plan = backend, plan
        self.root = runtime.client(backend)
        self.root.set_stream(runtime.StreamId.new())
        self.w = self.root.create(np.full(4, 3.0, np.float32))     # read by every request
        self.root.sync()
        self.stop = threading.Event()
        self.counts = {k: 0 for k in MIX}
        self.unexpected: list = []
        self.lock = threading.Lock()
        self.seed = seed
        self.ops = list(MIX)
        self.weights = [MIX[k] for k in self.ops]

    def _request(self, c, k: int) -> None:
        x = c.create(np.full(4, float(k), np.float32))
        y = c.empty(4, np.float32)
        c.launch(K.add, 1, [x, self.w, y], {"n": 4})
        got = c.read(y)
        if not np.array_equal(got, np.full(4, k + 3.0, np.float32)):
            raise AssertionError(f"request {k}: read {got}, expected {k + 3.0}")

    def request(self, k: int) -> None:
        self._request(self.root.with_stream(runtime.StreamId.new()), k)

    def thread(self, k: int) -> None:
        err = []

        def body():
            try:
                self._request(runtime.client(self.backend), k)   # this thread's own stream
            except BaseException as e:  # noqa: BLE001 - reported below
                err.append(e)
        t = threading.Thread(target=body, daemon=True)
        t.start()
        t.join(60.0)
        if err:
            raise err[0]

    def graph(self, k: int) -> None:
        c = self.root.with_stream(runtime.StreamId.new())
        x = c.create(np.full(4, float(k), np.float32))
        y = c.empty(4, np.float32)
        c.graph_prepare()
        c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
        c.start_capture()
        c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
        g = c.stop_capture()
        for _ in range(3):
            g.replay()
        got = c.read(y)
        if not np.array_equal(got, np.full(4, k + 1.0, np.float32)):
            raise AssertionError(f"graph {k}: read {got}, expected {k + 1.0}")
        if k % 2:
            g.release()

    def failure(self, k: int) -> None:
        c = self.root.with_stream(runtime.StreamId.new())
        small = c.empty(4, np.float32)
        c.launch(FAIL, 1, [small])
        try:
            c.sync()
        except ServerError as e:
            if "soak_fail" not in str(e):
                raise
        else:
            raise AssertionError("the injected failure was not raised by its stream's sync")

    def handle_burst(self, k: int) -> None:
        c = self.root.with_stream(runtime.StreamId.new())
        hs = [c.empty(16) for _ in range(self.plan["handle_burst"])]
        c.sync()
        del hs

    def graph_burst(self, k: int) -> None:
        c = self.root.with_stream(runtime.StreamId.new())
        x = c.create(np.ones(4, np.float32))
        y = c.empty(4, np.float32)
        gs = []
        for _ in range(self.plan["graph_burst"]):
            c.graph_prepare()
            c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
            c.start_capture()
            c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
            gs.append(c.stop_capture())
        gs[-1].replay()
        np.testing.assert_array_equal(c.read(y), np.full(4, 2.0, np.float32))
        del gs

    def worker(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        k = 0
        while not self.stop.is_set():
            op = rng.choices(self.ops, self.weights)[0]
            k += 1
            try:
                getattr(self, op)(k)
            except Exception as e:  # noqa: BLE001 - reported in the result
                with self.lock:
                    if len(self.unexpected) < 20:
                        self.unexpected.append(f"{op}: {type(e).__name__}: {str(e)[:300]}")
                    self.counts.setdefault("unexpected", 0)
                    self.counts["unexpected"] += 1
                continue
            with self.lock:
                self.counts[op] += 1


def _probe(backend: str, stop: threading.Event, out: list) -> None:
    """A 16-byte read every 2 ms on its own stream: ``(time, seconds)`` samples."""
    c = runtime.client(backend)
    c.set_stream(runtime.StreamId.new())
    h = c.create(np.arange(4, dtype=np.float32))
    c.read(h)
    while not stop.is_set():
        t = clock()
        c.read(h)
        out.append((t, clock() - t))
        time.sleep(0.002)


def _queue_sampler(q, stop: threading.Event, out: list) -> None:
    """The device queue's length every millisecond: ``out[0]`` the maximum, ``out[1]`` its
    time."""
    while not stop.is_set():
        n = len(q._q)
        if n > out[0]:
            out[0], out[1] = n, clock()
        time.sleep(0.001)


def measure(backend: str, quick: bool = False, tick=None, budget=None,
            seconds: float | None = None) -> dict:
    """Run the soak on ``backend`` (module doc); returns JSON-able results with ``met``.

    Args:
        budget: the suite's share for it (``runtime.bench.budget.Budget``): a bounded one
            shortens the run to what is left (at least 5 s) and records the cut
            (``python -m runtime bench --sections soak --budget-s 0`` runs the full length).
        seconds: the run length (default 600; ``quick``: 4).
    """
    plan = _plan(quick, seconds)
    if budget is not None and budget.seconds is not None:
        allowed = max(5.0, budget.left())
        if allowed < plan["seconds"]:
            budget.cut(f"soak: {allowed:.0f} of {plan['seconds']:.0f} s")
            plan = dict(plan, seconds=allowed, interval=max(0.5, min(10.0, allowed / 20)))
    work = _Work(backend, plan)
    srv = work.root._server
    gc.collect()
    base = _tables(srv)
    rss0 = rss_mb()
    stop_probe, probe = threading.Event(), []
    qmax = [0, 0.0]
    aux = [threading.Thread(target=_probe, args=(backend, stop_probe, probe), daemon=True),
           threading.Thread(target=_queue_sampler, args=(srv.queue, stop_probe, qmax),
                            daemon=True)]
    for t in aux:
        t.start()
    workers = [threading.Thread(target=work.worker, args=(i,), daemon=True)
               for i in range(plan["workers"])]
    t0 = clock()
    for t in workers:
        t.start()
    series = []
    n_ticks = units(quick)
    ticked = 0
    while True:
        elapsed = clock() - t0
        if elapsed >= plan["seconds"]:
            break
        time.sleep(min(plan["interval"], plan["seconds"] - elapsed))
        snap = _tables(srv)
        snap["t"] = round(clock() - t0, 2)
        snap["rss_mb"] = round(rss_mb(), 1)
        series.append(snap)
        due = min(n_ticks, int(n_ticks * (clock() - t0) / plan["seconds"]))
        if tick and due > ticked:
            tick(due - ticked)
            ticked = due
    work.stop.set()
    for t in workers:
        t.join(120.0)
    stuck = sum(t.is_alive() for t in workers)
    stop_probe.set()
    for t in aux:
        t.join(10.0)
    run_s = clock() - t0
    gc.collect()                    # (the workers' thread keys: their streams end)
    work.root.sync()                # (their work, and on wgpu the fences behind it, ran)
    end = _tables(srv)
    end["rss_mb"] = round(rss_mb(), 1)
    if tick and ticked < n_ticks:
        tick(n_ticks - ticked)
    fifth = plan["seconds"] / 5
    # the first and last fifth of the probe's samples (by count: on a loaded machine the probe
    # may take none in the first fifth of the time)
    k = max(1, len(probe) // 5)
    first = [s for _, s in probe[:k]]
    last = [s for _, s in probe[-k:]]
    p_start, p_end = summarize(first, 1e3), summarize(last, 1e3)
    warm = [s["rss_mb"] for s in series if s["t"] <= fifth] or [rss0]
    rss_start = warm[-1]
    peak = {k: max([s[k] for s in series if s.get(k) is not None] or [0])
            for k in ("streams", "handles", "graphs", "marks", "waiting_errors")}
    flat = all(end[k] <= base[k] for k in ("streams", "handles", "graphs", "marks"))
    rss_growth = end["rss_mb"] - rss_start
    ratio = p_end["p99"] / p_start["p99"] if p_start["p99"] else 0.0
    met = {"flat": flat and stuck == 0, "rss": rss_growth <= 20.0, "p99": ratio <= 1.5,
           "errors": not work.unexpected}
    return {"plan": plan, "seconds": round(run_s, 1), "ops": dict(work.counts),
            "base": base, "end": end, "peak": peak, "series": series,
            "queue_max": qmax[0], "queue_bound": srv.queue.max_messages,
            "rss_start_mb": rss_start, "rss_end_mb": end["rss_mb"],
            "rss_growth_mb": round(rss_growth, 1),
            "read_start": p_start, "read_end": p_end, "p99_ratio": round(ratio, 2),
            "unexpected": work.unexpected, "stuck_workers": stuck, "met": met,
            "target": "counts back to baseline, RSS <= +20 MB after warm-up, read p99 end <= "
                      "1.5x start, no unexpected error"}


# -- report (the Section hooks of runtime/bench/suite.py) -----------------------------------------
def backend_targets(backend: str, res: dict | None) -> list:
    """``[{"backend", "target", "value", "met"}]`` of the soak's goals on ``backend``."""
    if not res or "met" not in res:
        return []
    m, e, b = res["met"], res["end"], res["base"]
    counts = ", ".join(f"{k} {b[k]}->{e[k]} (peak {res['peak'][k]})"
                       for k in ("streams", "handles", "graphs", "marks"))
    return [
        {"backend": backend, "target": "soak: every table back to its baseline", "value": counts,
         "met": m["flat"]},
        {"backend": backend, "target": "soak: RSS within +20 MB after warm-up",
         "value": f"{res['rss_growth_mb']:+.1f} MB over {res['seconds']:g} s", "met": m["rss"]},
        {"backend": backend, "target": "soak: 16-byte read p99 at the end <= 1.5x the start",
         "value": f"{res['read_end']['p99']:.3g} vs {res['read_start']['p99']:.3g} ms "
                  f"({res['p99_ratio']:.2f}x)", "met": m["p99"]},
        {"backend": backend, "target": "soak: no unexpected error",
         "value": f"{len(res['unexpected'])} ({sum(res['ops'].values())} operations)",
         "met": m["errors"]}]


def suite_targets(result: dict) -> list:
    """The soak's goals for every backend of a suite ``result`` (``Section.targets``)."""
    return [t for b, r in result["backends"].items() for t in backend_targets(b, r.get("soak"))]


def markdown(result: dict, img=None) -> list:
    """The soak's markdown lines (empty when no backend ran it)."""
    have = [(b, r["soak"]) for b, r in result["backends"].items() if "met" in r.get("soak", {})]
    if not have:
        return []
    lines = ["## Soak (`runtime/bench/soak.py`)", "",
             "| backend | seconds | operations | streams | handles | graphs | marks | "
             "queue max | RSS start -> end (MB) | read p99 start -> end (ms) | unexpected |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b, r in have:
        e, s, pk = r["end"], r["base"], r["peak"]
        cell = {k: f"{s[k]} -> {e[k]} (peak {pk[k]})" for k in ("streams", "handles", "graphs",
                                                                "marks")}
        lines.append(f"| {b} | {r['seconds']} | {sum(r['ops'].values())} | {cell['streams']} | "
                     f"{cell['handles']} | {cell['graphs']} | {cell['marks']} | "
                     f"{r['queue_max']} (fire-and-forget bound {r['queue_bound']}) | "
                     f"{r['rss_start_mb']} -> "
                     f"{r['rss_end_mb']} | {r['read_start']['p99']:.3g} -> "
                     f"{r['read_end']['p99']:.3g} | {len(r['unexpected'])} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cpu", help="comma-separated: cpu, wgpu, cuda")
    ap.add_argument("--seconds", type=float, default=None, help="run length (default 600)")
    ap.add_argument("--quick", action="store_true", help="a 4 s run")
    ap.add_argument("--out", default=None, help="write the JSON here")
    a = ap.parse_args(argv)
    result = {"suite": "soak", "quick": a.quick, "machine": machine(), "backends": {}}
    for b in a.backend.split(","):
        res = measure(b.strip(), a.quick, seconds=a.seconds)
        result["backends"][b.strip()] = {"soak": res}
        for t in backend_targets(b.strip(), res):
            print(f"{b}: {t['target']}: {t['value']} [{'met' if t['met'] else 'NOT met'}]")
        if res["unexpected"]:
            print(f"{b}: unexpected: {res['unexpected'][:3]}")
    if a.out:
        write_json(a.out, result)
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
