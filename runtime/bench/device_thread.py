"""Device-thread cost: what a call through the server costs beside the same call with no server.

For 1, 2, 4 and 8 concurrent client threads (each thread an unpinned client, so each its own
stream), every thread times each call on its own, for these paths:

- ``sync``: ``client.sync()`` on an idle stream, the blocking round trip through the queue;
- ``sync_floor``: the backend's ``synchronize`` verb on an idle stream of a private backend
  instance (no queue, no server, no lock);
- ``launch``: a fire-and-forget ``client.launch`` of the empty kernel ``runtime.kernels.noop``;
- ``launch_floor``: the backend's ``launch`` verb with the compiled ``noop``, on the private
  backend;
- ``call`` (cpu only): the kernel's numpy callable called directly, the work itself.

Each thread owns its floor backend (the backends' objects are single-owner), so the floor rows
show what the device work costs when nothing is shared. Paths take turns in rounds: all
threads run a batch of one path between two barriers, then the next path, the order rotated
each round. Launch batches end with an untimed sync, so queues never grow across a batch.

    python -m runtime bench --sections device_thread [--backend cpu] [--quick]
"""

from __future__ import annotations

import threading

import numpy as np

import runtime
import runtime.kernels as K
from runtime.server import backend_class

from .budget import unbounded
from .timing import clock, summarize
from .report import backends_with, cell, errbars, num, pyplot, save_png

THREADS = (1, 2, 4, 8)
N = 64                                        # floats in the noop's one binding


def _floor_backend(name: str):
    """A private backend instance with one stream, the compiled noop and a 256-byte buffer."""
    if name == "cpu":
        from runtime.backends.cpu import ThreadScheduler
        be = backend_class("cpu")(scheduler=ThreadScheduler(workers=1))
    else:
        be = backend_class(name)()
    stream = be.new_stream()
    buf = be.alloc(N * 4)
    return {"backend": be, "stream": stream, "program": be.compile(K.noop),
            "args": [(buf, N * 4)], "params": K.noop.pack_params({"n": N})}


def _wait(comp) -> None:
    while not comp.wait(1.0):
        pass
    comp.result()


def _ops(backend: str, client, y, floor) -> dict:
    """Path name -> (one timed call, untimed follow-up after a batch or None)."""
    be, s, prog = floor["backend"], floor["stream"], floor["program"]
    args, params, one = floor["args"], floor["params"], (1, 1, 1)
    kparams = {"n": N}
    ops = {
        "sync": (client.sync, None),
        "sync_floor": (lambda: _wait(be.synchronize(s)), None),
        "launch": (lambda: client.launch(K.noop, 1, [y], kparams), client.sync),
        "launch_floor": (lambda: be.launch(s, prog, one, args, params),
                         lambda: _wait(be.synchronize(s))),
    }
    if backend == "cpu":
        view, fn = np.zeros(N, np.float32), K.noop.cpu
        ops["call"] = (lambda: fn(view, n=N, count=one), None)
    return ops


def paths_for(backend: str) -> list:
    """The path names measured on ``backend``, in report order."""
    base = ["sync", "sync_floor", "launch", "launch_floor"]
    return base + (["call"] if backend == "cpu" else [])


def run_threads(backend: str, floors: list, rounds: int, batch: int, tick=None,
                budget=None) -> dict:
    """All paths with ``len(floors)`` client threads; returns path -> summary (µs). A
    ``budget`` (:class:`runtime.bench.budget.Budget`) ends it after fewer rounds (at least 2)."""
    n = len(floors)
    paths = paths_for(backend)
    samples = {p: [] for p in paths}
    start, done = threading.Barrier(n + 1), threading.Barrier(n + 1)
    current, errors = [None], []

    def worker(i):
        try:
            c = runtime.client(backend)          # unpinned: this thread's own stream
            y = c.create(np.zeros(N, np.float32))
            c.launch(K.noop, 1, [y], {"n": N})   # compile and warm
            c.sync()
            ops = _ops(backend, c, y, floors[i])
            for op, after in ops.values():       # warm every path once
                op()
                if after:
                    after()
            while True:
                start.wait()
                path = current[0]
                if path is None:
                    return
                op, after = ops[path]
                local = []
                for _ in range(batch):
                    t = clock()
                    op()
                    local.append(clock() - t)
                if after:
                    after()
                samples[path].extend(local)
                done.wait()
        except threading.BrokenBarrierError:
            return
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            start.abort()
            done.abort()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        for r in range(rounds):
            if budget is not None and budget.stop(r, rounds, f"{n} thread(s)"):
                break
            k = r % len(paths)
            for path in paths[k:] + paths[:k]:
                current[0] = path
                start.wait()
                done.wait()
            if tick:
                tick()
        current[0] = None
        start.wait()
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return {p: summarize(v) for p, v in samples.items()}


def measure(backend: str, quick: bool = False, tick=None, threads=THREADS,
            budget=None) -> dict:
    """Device-thread rows of ``backend``: ``{"threads": {n: {path: summary}}}``. A ``budget``
    (:class:`runtime.bench.budget.Budget`) is shared among the thread counts in proportion
    to the threads, each running fewer rounds once its share is spent."""
    rounds, batch = (8, 25) if quick else (40, 50)
    floors = [_floor_backend(backend) for _ in range(max(threads))]
    out = {"rounds": rounds, "batch": batch, "threads": {}}
    parts = (budget or unbounded()).split(threads)
    try:
        for n in threads:
            out["threads"][str(n)] = run_threads(backend, floors[:n], rounds, batch, tick,
                                                 next(parts))
    finally:
        for f in floors:
            f["backend"].close()
    return out


def units(quick: bool, threads=THREADS) -> int:
    """Progress-bar units ``measure`` reports (one per round per thread count)."""
    return (8 if quick else 40) * len(threads)


# -- report: targets, markdown, plot (the Section hooks of runtime/bench/suite.py) ----------------
#: the blocking-call target: ``client.sync()`` on an idle stream, cpu, one client thread (µs p50).
GOAL_SYNC_US = 5.0
PATH_NAMES = {"sync": "runtime `sync()`", "sync_floor": "backend `synchronize` (floor)",
              "launch": "runtime `launch(noop)`", "launch_floor": "backend `launch` (floor)",
              "call": "numpy `noop` call"}


def targets(result: dict) -> list:
    """The blocking-call target (cpu, one client thread): ``[{"backend", "target", "value",
    "met"}]``."""
    out = []
    for b, res in result["backends"].items():
        dt = res.get("device_thread", {}).get("threads", {})
        if b == "cpu" and "1" in dt:
            v = dt["1"]["sync"]["p50"]
            out.append({"backend": b, "target": f"blocking `sync()` < {GOAL_SYNC_US:g} µs p50",
                        "value": f"{num(v)} µs", "met": v < GOAL_SYNC_US})
    return out

def _device_thread_md(b: str, dt: dict) -> list:
    threads = list(dt["threads"])
    head = "| path | " + " | ".join(f"{n} thread{'s' if n != '1' else ''}" for n in threads) + " |"
    lines = [head, "|---|" + "---|" * len(threads)]
    for p in dt["threads"][threads[0]]:
        cells = [cell(dt["threads"][n][p], p99=True) for n in threads]
        lines.append(f"| {PATH_NAMES.get(p, p)} | " + " | ".join(cells) + " |")
    return lines

def markdown(result: dict, img) -> list:
    """Markdown of the device-thread section (``img(name, alt)`` gives a plot's lines)."""
    lines = ["## Device-thread cost (µs per call)", "",
             "Each client thread has its own stream; the floor rows call the backend's verbs on "
             "a private backend instance per thread (no queue, no server)."]
    for b, res in result["backends"].items():
        dt = res.get("device_thread", {})
        lines += ["", f"### {b}", ""]
        lines += _device_thread_md(b, dt) if "threads" in dt else [f"error: {dt.get('error')}"]
    return lines + img("device_thread.png", "device-thread cost")

def plot(result: dict, folder: Path) -> list:
    """``device_thread.png`` (µs per call vs client threads) into ``folder``; the paths written.

    Raises: ``ImportError`` without matplotlib.
    """
    have = backends_with(result, "device_thread", "threads")
    if not have:
        return []
    plt = pyplot()
    import matplotlib.ticker
    fig, axes = plt.subplots(1, len(have), figsize=(5 * len(have), 3.6), squeeze=False)
    for ax, (b, dt) in zip(axes[0], have):
        ns = list(dt["threads"])
        for p in dt["threads"][ns[0]]:
            ss = [dt["threads"][n][p] for n in ns]
            ax.errorbar([int(n) for n in ns], [s["p50"] for s in ss], yerr=errbars(ss),
                        marker="o", capsize=2, label=p, ls="--" if "floor" in p else "-")
        if b == "cpu":
            ax.axhline(GOAL_SYNC_US, color="r", lw=0.7, ls=":", label="sync goal")
        ax.set(xscale="log", yscale="log", title=b, xlabel="client threads",
               ylabel="µs per call (p50, p10–p90)")
        ax.set_xticks([int(n) for n in ns], ns)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=7)
    return [save_png(plt, fig, folder, "device_thread.png")]
