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
from .report import backends_with, cell, errbars, mark, num, pyplot, save_png

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
    spent (``reps`` in the row says how many ran). An end-to-end row that cannot fit in what
    is left of the budget (predicted from the last row of its size: a row needs ~12 passes,
    and a pass of 1000 1 Mi-float launches is ~2 s on an idle lavapipe, ~25 s on a loaded
    one) or comes after the budget is spent is not run: ``skipped_rows`` lists it with why,
    as do the budget's cuts and the report.
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
    per_launch: dict = {}                         # size -> eager seconds per launch, last row
    for size, elems, length, reps in plan:
        part = next(parts)
        # a row runs >= 12 passes (warm-ups, capture, 2 repetitions of 3 paths)
        need = 12 * per_launch.get(size, 0.0) * length
        if out["e2e"] and budget is not None and budget.seconds is not None and (
                budget.left() <= 0 or need > budget.left()):
            why = (f"the section's --budget-s share was spent or too small (it needs ~{need:.0f}"
                   f" s, {max(0.0, budget.left()):.0f} s were left; --budget-s 0 runs every row)")
            budget.cut(f"end to end elems={elems} L={length}: not measured ({why})")
            out.setdefault("skipped_rows", []).append({"size": size, "length": length,
                                                       "why": why})
            if tick:
                tick(reps)
            continue
        row = measure_pass(client, backend, elems, length, reps, tick, part)
        per_launch[size] = row["eager"]["e2e"]["p10"] / 1e6 / length
        out["e2e"].append(dict(row, size=size))
    return out


# -- report: targets, markdown, plot (the Section hooks of runtime/bench/suite.py) ----------------
#: targets (goals, not tests): ``Graph.replay()`` enqueue < 10 µs p50 at every graph length on
#: cpu and cuda; replay end to end within 1.2x of the raw backend (cuda: of the faster of raw
#: launches and a raw cupy graph) per row; large-kernel rows: replay no slower than eager (at most
#: 1.05x: a control, the launches dominate; a cpu graph that fuses elementwise runs is faster).
GOAL_ENQUEUE_US, GOAL_FLOOR_X, GOAL_CONTROL = 10.0, 1.2, 0.05


def _floor_e2e(row: dict) -> dict:
    """The floor a replay is held to: the faster raw path (raw launches or a raw cupy graph)."""
    floors = [row[k]["e2e"] for k in ("floor", "floor_graph") if k in row]
    return min(floors, key=lambda s: s["p50"])

def targets(result: dict) -> list:
    """The replay targets (enqueue, floor, large-kernel control) per backend."""
    out = []
    for b, res in result["backends"].items():
        enq = res.get("replay", {}).get("enqueue", {})
        if b in ("cpu", "cuda") and enq:
            worst = max(enq.items(), key=lambda kv: kv[1]["p50"])
            out.append({"backend": b,
                        "target": f"replay enqueue < {GOAL_ENQUEUE_US:g} µs p50, every length",
                        "value": f"worst {num(worst[1]['p50'])} µs (L={worst[0]})",
                        "met": worst[1]["p50"] < GOAL_ENQUEUE_US})
        rows = res.get("replay", {}).get("e2e", [])
        if rows:
            ratios = [(r, r["replay"]["e2e"]["p50"] / _floor_e2e(r)["p50"]) for r in rows]
            ok = [x for _, x in ratios if x <= GOAL_FLOOR_X]
            worst = max(ratios, key=lambda t: t[1])
            out.append({"backend": b, "target": f"replay within {GOAL_FLOOR_X:g}x of the floor",
                        "value": f"{len(ok)}/{len(ratios)} rows; worst {worst[1]:.2f}x "
                                 f"({worst[0]['size']} L={worst[0]['length']})",
                        "met": len(ok) == len(ratios)})
            ctl = [r["replay"]["e2e"]["p50"] / r["eager"]["e2e"]["p50"]
                   for r in rows if r["size"] == "large"]
            if ctl:
                ok = [x for x in ctl if x <= 1 + GOAL_CONTROL]
                out.append({"backend": b, "target": "large-kernel replay/eager <= 1.05x",
                            "value": f"{len(ok)}/{len(ctl)} rows; "
                                     f"{min(ctl):.2f}x–{max(ctl):.2f}x",
                            "met": len(ok) == len(ctl)})
    return out

def _enqueue_md(enq: dict) -> list:
    lines = ["| graph length | replay() p50 | p10 | p90 | p99 | vs L=1 | capture (stop_capture) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    base = next(iter(enq.values()))["p50"]
    for L, s in enq.items():
        lines.append(f"| {L} | {num(s['p50'])} | {num(s['p10'])} | {num(s['p90'])} | "
                     f"{num(s['p99'])} | {s['p50'] / base:.1f}x | {num(s['capture_ms'])} ms |")
    return lines

def _e2e_md(rows: list) -> list:
    cuda = any("floor_graph" in r for r in rows)
    head = "| kernels | L | eager | replay | raw backend |"
    head += " raw graph |" if cuda else ""
    head += " replay/eager | replay/floor | eager enqueue share | replay enqueue |"
    lines = [head, "|---|---:|" + "---:|" * (8 if cuda else 7)]
    for r in rows:
        e, rp, fl = r["eager"]["e2e"], r["replay"]["e2e"], _floor_e2e(r)
        cells = [r["size"], str(r["length"]), cell(e), cell(rp), cell(r["floor"]["e2e"])]
        if cuda:
            cells.append(cell(r["floor_graph"]["e2e"]) if "floor_graph" in r else "")
        x_eager, x_floor = rp["p50"] / e["p50"], rp["p50"] / fl["p50"]
        ctl = f" ({mark(x_eager <= 1 + GOAL_CONTROL)})" if r["size"] == "large" else ""
        cells += [f"{x_eager:.2f}x{ctl}", f"{x_floor:.2f}x ({mark(x_floor <= GOAL_FLOOR_X)})",
                  f"{100 * r['eager']['enqueue']['p50'] / e['p50']:.0f}%",
                  num(r["replay"]["enqueue"]["p50"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines

def markdown(result: dict, img) -> list:
    """Markdown of the replay section: the enqueue table and the end-to-end table."""
    lines = ["## `Graph.replay()` enqueue (µs, the blocking call itself)", "",
             "Graphs of L tiny `add_scalar` launches; the stream is idle at each call."]
    for b, res in result["backends"].items():
        enq = res.get("replay", {}).get("enqueue")
        lines += ["", f"### {b}", ""]
        lines += _enqueue_md(enq) if enq else [f"error: {res.get('replay', {}).get('error')}"]
        if enq and b == "wgpu":
            (l0, s0), (l1, s1) = list(enq.items())[0], list(enq.items())[-1]
            per = (s1["p50"] - s0["p50"]) / (int(l1) - int(l0) or 1)
            lines += ["", "On wgpu a replay re-encodes every dispatch into one command buffer: "
                      f"the call grows {s1['p50'] / s0['p50']:.0f}x from L={l0} to L={l1} "
                      f"({num(per)} µs per recorded launch)."]
    lines += img("replay_enqueue.png", "replay enqueue vs graph length")
    lines += ["", "## End to end per pass (µs: issue + blocking read of the result)", "",
              "A pass is L dependent `add_scalar` launches ping-ponging between two buffers; "
              "`tiny` = 64 floats, `large` = 1 Mi floats (the device-bound control). "
              "Raw backend = numpy calls (cpu), hand-written wgpu-py with prebuilt pipelines "
              "and bind groups in one submit (wgpu, `runtime/bench/floors.py`), raw cupy "
              "launches and a raw cupy graph (cuda). Enqueue share = eager issue time / eager "
              "end to end: whether launch overhead is worth attacking at that size."]
    for b, res in result["backends"].items():
        rows = res.get("replay", {}).get("e2e")
        lines += ["", f"### {b}", ""]
        lines += _e2e_md(rows) if rows else [f"error: {res.get('replay', {}).get('error')}"]
        skipped = res.get("replay", {}).get("skipped_rows")
        if skipped:
            lines += ["", "Not measured: " + ", ".join(
                f"{r['size']} L={r['length']}" for r in skipped) + f" ({skipped[0]['why']})."]
    return lines + img("e2e.png", "end to end per pass")

def plot(result: dict, folder: Path) -> list:
    """``replay_enqueue.png`` and ``e2e.png`` into ``folder``; the paths written.

    Raises: ``ImportError`` without matplotlib.
    """
    have = backends_with(result, "replay", "enqueue")
    if not have:
        return []
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for b, rp in have:
        Ls = [int(L) for L in rp["enqueue"]]
        ss = list(rp["enqueue"].values())
        axes[0].errorbar(Ls, [s["p50"] for s in ss], yerr=errbars(ss), marker="o", capsize=2,
                         label=b)
    axes[0].axhline(GOAL_ENQUEUE_US, color="r", lw=0.7, ls=":", label="goal (cpu, cuda)")
    axes[0].set(xscale="log", yscale="log", xlabel="graph length (launches)",
                ylabel="replay() µs (p50, p10–p90)", title="replay enqueue")
    axes[0].legend(fontsize=7)
    for b, rp in have:
        for size, ls in (("tiny", "-"), ("large", "--")):
            rows = [r for r in rp["e2e"] if r["size"] == size]
            if rows:
                axes[1].plot([r["length"] for r in rows],
                             [r["replay"]["e2e"]["p50"] / _floor_e2e(r)["p50"] for r in rows],
                             marker="o", ls=ls, label=f"{b} {size}")
    axes[1].axhline(GOAL_FLOOR_X, color="r", lw=0.7, ls=":", label="goal 1.2x")
    axes[1].axhline(1.0, color="k", lw=0.5)
    axes[1].set(xscale="log", yscale="log", xlabel="graph length (launches)",
                ylabel="replay / raw backend, end to end", title="replay vs floor")
    axes[1].legend(fontsize=7)
    written = [save_png(plt, fig, folder, "replay_enqueue.png")]

    fig, axes = plt.subplots(1, len(have), figsize=(5 * len(have), 3.6), squeeze=False)
    for ax, (b, rp) in zip(axes[0], have):
        for size, ls in (("tiny", "-"), ("large", "--")):
            rows = [r for r in rp["e2e"] if r["size"] == size]
            for k, path in enumerate(("eager", "replay", "floor", "floor_graph")):
                if rows and path in rows[0]:
                    ax.plot([r["length"] for r in rows], [r[path]["e2e"]["p50"] for r in rows],
                            marker="o", ls=ls, color=f"C{k}", label=f"{size} {path}")
        ax.set(xscale="log", yscale="log", title=b, xlabel="graph length (launches)",
               ylabel="µs per pass (p50)")
        ax.legend(fontsize=7)
    return written + [save_png(plt, fig, folder, "e2e.png")]
