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
