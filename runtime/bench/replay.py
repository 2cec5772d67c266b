"""Replay enqueue latency and end-to-end passes: eager vs replay vs the raw backend.

One *pass* is ``L`` dependent launches of ``add_scalar`` (``y = x + 1``) ping-ponging between two
f32 buffers ``a`` and ``b`` (the workload of CubeCL's ``graph_bench``, research section E), with
``tiny`` kernels (64 floats) and ``large`` ones (1 Mi floats, the device-bound control).

- :func:`measure_enqueue` (item 2): the ``Graph.replay()`` call itself, accepted not executed,
  for graphs of ``L`` tiny launches; the stream is synced (untimed) before each call. It should
  be flat in ``L`` on cpu and cuda; on wgpu replay re-encodes every dispatch, so it grows.
- :func:`measure_e2e` (item 3): per pass, ``enqueue`` (the issuing calls) and ``e2e`` (issue
  plus a blocking read of ``a``) for three paths taking turns each repetition:
  ``eager`` (``L`` ``client.launch`` calls), ``replay`` (one ``Graph.replay()``) and ``floor``
  (the raw backend, no runtime: numpy calls on cpu; graph_sweep's hand-written wgpu-py pass,
  prebuilt pipeline and bind groups, one submit, on wgpu; raw cupy launches on cuda, plus
  ``floor_graph``, one raw cupy graph launch).

    python -m runtime bench --sections replay [--backend cpu] [--quick]
"""

from __future__ import annotations

import sys
import time

import numpy as np

import runtime
import runtime.kernels as K

from .budget import unbounded
from .floors import KERNEL, floor_class
from .timing import clock, interleaved, summarize

LENGTHS = (1, 10, 100, 1000, 10000)
QUICK_LENGTHS = (1, 10, 100, 1000)
SIZES = {"tiny": 64, "large": 1 << 20}
#: repetitions per graph length: (tiny full, tiny quick, large full, large quick); 0 = skipped
E2E_REPS = {1: (100, 12, 20, 6), 10: (60, 10, 12, 4), 100: (30, 6, 6, 0), 1000: (12, 3, 3, 0),
            10000: (5, 0, 0, 0)}


def run_pass(client, a, b, elems: int, length: int) -> None:
    """``length`` launches of the kernel, ping-ponging ``a -> b -> a ...``."""
    params, count, launch = {"alpha": 1.0, "n": elems}, K.grid(elems), client.launch
    for i in range(length):
        launch(KERNEL, count, [a, b] if i % 2 == 0 else [b, a], params)


def capture(client, a, b, elems: int, length: int):
    """Warm, prepare, warm-up, record: returns ``(graph, stop_capture seconds)``."""
    run_pass(client, a, b, elems, length)          # compile, settle the pool
    client.sync()
    client.graph_prepare()
    run_pass(client, a, b, elems, length)          # the warm-up run
    client.sync()
    client.start_capture()
    run_pass(client, a, b, elems, length)          # recorded, not executed
    t = clock()
    g = client.stop_capture()
    return g, clock() - t


#: untimed pause between wgpu samples (the ``settle`` of :func:`runtime.bench.timing.interleaved`).
SETTLE_S = 0.05


# -- item 2 ----------------------------------------------------------------------------------
def measure_enqueue(client, lengths, reps: int, tick=None, budget=None) -> dict:
    """``Graph.replay()`` call latency per graph length (tiny kernels): ``{L: summary}``.

    Graphs longer than 1000 launches are sampled every fifth repetition (their execution, not
    the call, dominates the wall time).
    """
    elems = SIZES["tiny"]
    a = client.create(np.zeros(elems, np.float32))
    b = client.create(np.zeros(elems, np.float32))
    graphs, capture_s = {}, {}
    for length in lengths:
        graphs[length], capture_s[length] = capture(client, a, b, elems, length)

    def one(g):
        def sample():
            client.sync()                          # untimed: the stream is idle at the call
            t = clock()
            g.replay()
            return clock() - t
        return sample

    paths = {str(L): one(graphs[L]) for L in lengths}
    every = {str(L): (5 if L > 1000 else 1) for L in lengths}
    samples = interleaved(paths, reps, tick, every=every, budget=budget,
                          what="replay() enqueue", min_reps=5)
    client.sync()
    out = {L: dict(summarize(samples[str(L)]), capture_ms=capture_s[L] * 1e3) for L in lengths}
    for g in graphs.values():
        g.release()
    return out


# -- item 3 ----------------------------------------------------------------------------------
def measure_pass(client, backend: str, elems: int, length: int, reps: int, tick=None,
                 budget=None) -> dict:
    """Eager vs replay vs floor per pass for one ``(elems, L)``; summaries in µs per pass."""
    a = client.create(np.zeros(elems, np.float32))
    b = client.create(np.zeros(elems, np.float32))
    graph, capture_s = capture(client, a, b, elems, length)
    cls = floor_class(backend)
    floor = cls(elems, length)
    floor.issue()                                  # warm
    floor.sync()
    read = client.read

    def timed(issue, sync):
        def sample():
            t0 = clock()
            issue()
            t1 = clock()
            sync()
            return {"enqueue": t1 - t0, "e2e": clock() - t0}
        return sample

    paths = {"eager": timed(lambda: run_pass(client, a, b, elems, length), lambda: read(a)),
             "replay": timed(graph.replay, lambda: read(a)),
             "floor": timed(floor.issue, floor.sync)}
    if backend == "cuda":
        floor.capture_graph()
        paths["floor_graph"] = timed(floor.issue_graph, floor.sync)
    for p in paths.values():                       # one untimed round: every path warm
        p()
    def settle():                                  # untimed: nothing carries over to the next path
        client.sync()
        floor.sync()
        if backend == "wgpu":
            time.sleep(SETTLE_S)
    samples = interleaved(paths, reps, tick, settle=settle, budget=budget,
                          what=f"end to end elems={elems} L={length}")
    reps = len(samples["eager"]["e2e"])           # fewer when the budget cut the row
    row = {"elems": elems, "length": length, "reps": reps, "capture_ms": capture_s * 1e3,
           "floor_impl": f"{cls.__module__}.{cls.__name__}"}
    for name, s in samples.items():
        row[name] = {m: summarize(v) for m, v in s.items()}
    if length % 2 == 0:                            # every runtime pass adds `length` to a
        runs = 2 * (reps + 2)                      # warm, warm-up, one untimed round, reps
        got, want = float(read(a)[0]), float(runs * length)
        row["check"] = {"a0": got, "expected": want, "ok": got == want}
        if got != want:
            print(f"WARNING {backend} elems={elems} L={length}: a[0] = {got}, expected {want}",
                  file=sys.stderr)
    graph.release()
    a.release()
    b.release()
    return row


def e2e_plan(quick: bool) -> list:
    """``[(size name, elems, L, reps)]`` of item 3."""
    plan = []
    for size, elems in SIZES.items():
        for length, reps in E2E_REPS.items():
            r = reps[(0 if size == "tiny" else 2) + (1 if quick else 0)]
            if r:
                plan.append((size, elems, length, r))
    return plan


def enqueue_reps(quick: bool) -> int:
    return 25 if quick else 200


def units(quick: bool) -> int:
    """Progress-bar units of :func:`measure` (one per repetition)."""
    return enqueue_reps(quick) + sum(p[3] for p in e2e_plan(quick))


def _cost(elems: int, length: int, reps: int) -> float:
    """A row's rough relative cost, for sharing a budget: per pass, launch overhead plus the
    work of large kernels, plus a fixed cost (capture, warm-up) of a few passes."""
    return (reps + 4) * length * (1 + elems / 65536) + 50


def measure(backend: str, quick: bool = False, tick=None, budget=None) -> dict:
    """Items 2 and 3 on ``backend``: ``{"enqueue": {L: summary}, "e2e": [row, ...]}``.

    A ``budget`` (:class:`runtime.bench.budget.Budget`) is shared among the enqueue rows and
    the end-to-end rows by their rough cost; each row runs fewer repetitions once its share is
    spent (``reps`` in the row says how many ran).
    """
    client = runtime.client(backend)
    lengths = QUICK_LENGTHS if quick else LENGTHS
    plan = e2e_plan(quick)
    parts = (budget or unbounded()).split(
        [0.15 * sum(_cost(e, L, r) for _, e, L, r in plan)]
        + [_cost(e, L, r) for _, e, L, r in plan])
    out = {"device": client.device_name,
           "enqueue": measure_enqueue(client, lengths, enqueue_reps(quick), tick, next(parts)),
           "e2e": []}
    for size, elems, length, reps in plan:
        row = measure_pass(client, backend, elems, length, reps, tick, next(parts))
        out["e2e"].append(dict(row, size=size))
    return out
