"""Stalls and growth of the device thread (issue 14): one client must not stall another, and a
flood must not grow memory.

Three measurements per backend, in one run:

- ``replay_under_read`` (a): client B loops {``replay()`` of a 1-launch graph, read}; only the
  ``replay()`` call is timed. Phases take turns: ``alone``, then ``with_a`` while client A loops
  {replay a graph of three 384x384 matmuls, read the 384x384 result}, the order rotated each
  round. Target: p99 with A <= 3x p99 alone.
- ``read_under_flood`` (b): another client's 16-byte ``read`` latency, ``idle`` vs ``flood``
  (four threads looping fire-and-forget ``launch(add_scalar)`` with no sync), taking turns.
  Target on cpu: p99 during the flood <= 20 ms.
- ``rss_flood`` (c): process RSS sampled every 0.5 s while four threads loop unsynced
  {``empty``, ``launch``, ``release``} for ``seconds`` (60; ``--quick``: 3). Target: flat,
  growth <= +100 MB. A safety stop ends the phase early past +2 GB (``stopped_early``).

Latencies are in ms (median, p10, p90, p99); RSS in MB. Plugs into ``python -m runtime bench``
as the section ``stalls``: ``measure(backend, quick, tick)`` with ``units(quick)`` progress
units (``--quick`` runs it on cpu only, as MiniLM); also
``python -m runtime.bench.stalls [--backend cpu,wgpu] [--quick] [--out FILE]`` on its own (JSON).
Uses only the public client API, so the same file measures an older checkout (before/after).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np

import runtime
import runtime.kernels as K

from .results import machine, write_json
from .timing import clock, summarize

MM = 384                  # A's matmul size
FLOOD_THREADS = 4
RSS_LIMIT_MB = 2048       # safety stop for the growth phase (a shared machine)


def rss_mb() -> float:
    """Resident set size of this process in MB (``/proc/self/statm``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _plan(backend: str, quick: bool) -> dict:
    """Rounds and samples per phase. wgpu on lavapipe runs A's matmuls in ~1 s, and B's read
    queues behind them, so it takes fewer samples."""
    slow = backend == "wgpu"
    if quick:
        return {"rounds": 2, "b_samples": 4 if slow else 20, "flood_s": 0.3, "rss_s": 3.0}
    return {"rounds": 4, "b_samples": 16 if slow else 50, "flood_s": 1.0, "rss_s": 60.0}


def units(quick: bool) -> int:
    """Progress units ``measure`` reports: one per phase of (a) and (b), one for (c)."""
    return 2 * 2 * _plan("cpu", quick)["rounds"] + 1


def _graph(client, body):
    """Warm up ``body`` once, then record it: the public capture recipe."""
    body()
    client.sync()
    client.graph_prepare()
    body()
    client.sync()
    client.start_capture()
    body()
    return client.stop_capture()


class _Loop:
    """A background thread running ``step`` while switched on; ``pause`` returns once the
    current step finished (bounded: ``limit_s``)."""

    def __init__(self, step, limit_s: float = 120.0):
        self.step, self.limit_s = step, limit_s
        self.on, self.idle, self.stop = threading.Event(), threading.Event(), False
        self.idle.set()
        self.errors: list = []
        self.steps = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            if not self.on.wait(0.05):
                continue
            self.idle.clear()
            try:
                self.step()
                self.steps += 1
            except Exception as e:  # noqa: BLE001 - reported by measure
                self.errors.append(e)
                self.on.clear()
            finally:
                self.idle.set()

    def resume(self):
        self.on.set()

    def pause(self):
        self.on.clear()
        if not self.idle.wait(self.limit_s):
            raise RuntimeError("a background loop did not finish its step in time")

    def close(self):
        self.stop = True
        self.pause()
        self.thread.join(self.limit_s)


def replay_under_read(backend: str, plan: dict, tick=None, budget=None) -> dict:
    """(a): B's ``replay()`` call latency alone vs while A replays and reads a heavy result."""
    a = runtime.client(backend)
    a.set_stream(runtime.StreamId.new())
    rng = np.random.default_rng(0)
    x = a.create(rng.standard_normal((MM, MM)).astype(np.float32))
    w = a.create(rng.standard_normal((MM, MM)).astype(np.float32))
    t1, t2, t3 = (a.empty((MM, MM), np.float32) for _ in range(3))
    kernel, count = K.matmul_for(MM, MM)
    p = {"M": MM, "N": MM, "K": MM}

    def heavy():
        a.launch(kernel, count, [x, w, t1], p)
        a.launch(kernel, count, [t1, w, t2], p)
        a.launch(kernel, count, [t2, w, t3], p)
    ga = _graph(a, heavy)
    b = runtime.client(backend)
    b.set_stream(runtime.StreamId.new())
    bx, by = b.create(np.ones(16, np.float32)), b.empty(16, np.float32)
    gb = _graph(b, lambda: b.launch(K.add_scalar, 1, [bx, by], {"alpha": 1.0, "n": 16}))
    loop = _Loop(lambda: (ga.replay(), a.read(t3)))
    samples = {"alone": [], "with_a": []}
    try:
        for r in range(plan["rounds"]):
            if budget is not None and budget.stop(r, plan["rounds"], "replay_under_read rounds"):
                break
            phases = ["alone", "with_a"] if r % 2 == 0 else ["with_a", "alone"]
            for phase in phases:
                if phase == "with_a":
                    loop.resume()
                    while loop.steps == 0 and not loop.errors:   # A is reading at least once
                        loop.idle.wait(0.01)
                for _ in range(plan["b_samples"]):
                    t = clock()
                    gb.replay()
                    samples[phase].append(clock() - t)
                    b.read(by)
                loop.pause()
                if tick:
                    tick()
    finally:
        loop.close()
    if loop.errors:
        raise loop.errors[0]
    out = {p: summarize(v, 1e3) for p, v in samples.items()}
    out["a_reads"] = loop.steps
    out["p99_ratio"] = out["with_a"]["p99"] / out["alone"]["p99"] if out["alone"]["p99"] else 0.0
    out["target"] = "p99 with A <= 3x p99 alone"
    out["met"] = out["p99_ratio"] <= 3.0
    return out


def _flooders(backend: str, body, n: int = FLOOD_THREADS):
    """``n`` threads, each with its own client (its thread's stream), looping ``body(client,
    state)`` until ``stop`` is set; ``done()`` syncs each (untimed) so no backlog is left."""
    stop, errors, counts = threading.Event(), [], [0] * n

    def run(i):
        try:
            c = runtime.client(backend)
            state = {"x": c.create(np.ones(64, np.float32)), "y": c.empty(64, np.float32)}
            c.sync()
            while not stop.is_set():
                body(c, state)
                counts[i] += 1
            c.sync()
        except Exception as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()

    def done(limit_s: float = 600.0):
        stop.set()
        for t in threads:
            t.join(limit_s)
        if errors:
            raise errors[0]
        return sum(counts)
    return done


def _flood_launch(c, st):
    c.launch(K.add_scalar, 1, [st["x"], st["y"]], {"alpha": 1.0, "n": 64})


def read_under_flood(backend: str, plan: dict, tick=None, budget=None) -> dict:
    """(b): a 16-byte read's latency, idle vs during a 4-thread launch flood."""
    c = runtime.client(backend)
    c.set_stream(runtime.StreamId.new())
    h = c.create(np.arange(4, dtype=np.float32))
    c.read(h)
    samples = {"idle": [], "flood": []}
    launches = 0
    for r in range(plan["rounds"]):
        if budget is not None and budget.stop(r, plan["rounds"], "read_under_flood rounds"):
            break
        for phase in (["idle", "flood"] if r % 2 == 0 else ["flood", "idle"]):
            done = _flooders(backend, _flood_launch) if phase == "flood" else None
            end = clock() + plan["flood_s"]
            while clock() < end:
                t = clock()
                c.read(h)
                samples[phase].append(clock() - t)
            if done is not None:
                launches += done()
            if tick:
                tick()
    out = {p: summarize(v, 1e3) for p, v in samples.items()}
    out["flood_launches"] = launches
    out["target"] = "p99 during the flood <= 20 ms (cpu)"
    out["met"] = out["flood"]["p99"] <= 20.0
    return out


def _churn(c, st):
    h = c.empty(64, np.float32)
    c.launch(K.add_scalar, 1, [st["x"], h], {"alpha": 1.0, "n": 64})
    h.release()


def rss_flood(backend: str, plan: dict, tick=None, budget=None) -> dict:
    """(c): RSS while four threads loop unsynced empty + launch + release, for ``plan["rss_s"]``
    seconds or what is left of ``budget`` if less (at least 3 s; the cut is recorded)."""
    seconds = plan["rss_s"]
    if budget is not None and budget.left() < seconds:
        seconds = max(3.0, budget.left())
        budget.cut(f"rss_flood: {seconds:.0f} of {plan['rss_s']:g} s")
    runtime.client(backend).sync()
    start = rss_mb()
    series, stopped = [], False
    t0 = clock()
    done = _flooders(backend, _churn)
    while clock() - t0 < seconds:
        time.sleep(0.5)
        now = rss_mb()
        series.append((round(clock() - t0, 2), round(now, 1)))
        if now - start > RSS_LIMIT_MB:
            stopped = True
            break
    issue_s = clock() - t0
    ops = done()
    drain_s = clock() - t0 - issue_s
    if tick:
        tick()
    peak = max(v for _, v in series) if series else start
    growth = peak - start
    return {"seconds": round(issue_s, 1), "iterations": ops, "drain_s": round(drain_s, 2),
            "rss_start_mb": round(start, 1), "rss_peak_mb": round(peak, 1),
            "rss_end_mb": series[-1][1] if series else start, "growth_mb": round(growth, 1),
            "series": series, "stopped_early": stopped,
            "target": "flat: growth <= +100 MB", "met": growth <= 100 and not stopped}


def measure(backend: str, quick: bool = False, tick=None, budget=None) -> dict:
    """All three measurements on ``backend``: ``{"replay_under_read", "read_under_flood",
    "rss_flood", "plan"}``. In the suite, ``--quick`` runs the section on cpu only (lavapipe's
    384x384 matmuls take seconds): ``{"skipped": why}`` elsewhere. A ``budget``
    (:class:`runtime.bench.budget.Budget`) is shared (a) 1 : (b) 1 : (c) 2; each runs fewer
    rounds (at least 2) or a shorter growth phase once its share is spent."""
    if quick and tick is not None and backend != "cpu":
        tick(units(quick))
        return {"skipped": "--quick runs the stalls section on cpu only"}
    plan = _plan(backend, quick)
    out = {"plan": plan}
    parts = budget.split([1, 1, 2]) if budget is not None else iter([None] * 3)
    out["replay_under_read"] = replay_under_read(backend, plan, tick, next(parts))
    out["read_under_flood"] = read_under_flood(backend, plan, tick, next(parts))
    out["rss_flood"] = rss_flood(backend, plan, tick, next(parts))
    return out


# -- report: targets, markdown, plot (the Section hooks of runtime/bench/suite.py) ---------------
def backend_targets(backend: str, res: dict | None) -> list:
    """``[{"backend", "target", "value", "met"}]`` of the section's three goals on ``backend``."""
    if not res or "replay_under_read" not in res:
        return []
    ru, rf, rs = res["replay_under_read"], res["read_under_flood"], res["rss_flood"]
    out = [{"backend": backend, "target": "replay() p99 while another client reads <= 3x alone",
            "value": f"{ru['with_a']['p99']:.3g} vs {ru['alone']['p99']:.3g} ms "
                     f"({ru['p99_ratio']:.2f}x)", "met": ru["met"]}]
    if backend == "cpu":
        out.append({"backend": backend, "target": "16-byte read p99 during a launch flood <= 20 ms",
                    "value": f"{rf['flood']['p99']:.3g} ms", "met": rf["met"]})
    out.append({"backend": backend, "target": "RSS flat under unsynced churn (<= +100 MB)",
                "value": f"{rs['growth_mb']:+.1f} MB over {rs['seconds']:g} s", "met": rs["met"]})
    return out


def suite_targets(result: dict) -> list:
    """The section's goals for every backend of a suite ``result`` (``Section.targets``)."""
    return [t for b, r in result["backends"].items()
            for t in backend_targets(b, r.get("stalls"))]


def markdown(result: dict, img=None) -> list:
    """The section's markdown lines (empty when no backend measured it); ``img(name, alt)``
    adds the RSS plot (``Section.markdown``)."""
    have = [(b, r["stalls"]) for b, r in result["backends"].items()
            if "replay_under_read" in r.get("stalls", {})]
    if not have:
        return []
    lines = ["## Stalls and growth (ms; `runtime/bench/stalls.py`)", "",
             "| backend | measurement | phase | p50 | p10 | p90 | p99 | n |",
             "|---|---|---|---|---|---|---|---|"]
    for b, res in have:
        for key, phases in (("replay_under_read", ("alone", "with_a")),
                            ("read_under_flood", ("idle", "flood"))):
            for ph in phases:
                x = res[key][ph]
                lines.append(f"| {b} | {key} | {ph} | {x['p50']:.3g} | {x['p10']:.3g} | "
                             f"{x['p90']:.3g} | {x['p99']:.3g} | {x['n']} |")
    lines += ["", "| backend | RSS start (MB) | peak | growth | seconds | iterations |",
              "|---|---|---|---|---|---|"]
    for b, res in have:
        rs = res["rss_flood"]
        lines.append(f"| {b} | {rs['rss_start_mb']} | {rs['rss_peak_mb']} | "
                     f"{rs['growth_mb']:+.1f} | {rs['seconds']} | {rs['iterations']} |")
    if img is not None:
        lines += [""] + img("stalls.png", "RSS under unsynced churn")
    return lines


def plot(result: dict, folder) -> list:
    """``stalls.png`` in ``folder``: RSS over time of (c) per backend (``Section.plot``); ``[]``
    when no backend measured it. Raises ``ImportError`` without matplotlib."""
    from pathlib import Path

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    try:
        if not _draw_rss(result, ax):
            return []
        path = Path(folder) / "stalls.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return [path]
    finally:
        plt.close(fig)


def _draw_rss(result: dict, ax) -> bool:
    drawn = False
    for b, r in result["backends"].items():
        series = r.get("stalls", {}).get("rss_flood", {}).get("series")
        if series:
            ax.plot([t for t, _ in series], [m for _, m in series], label=b)
            drawn = True
    ax.set(xlabel="s", ylabel="RSS (MB)", title="RSS under unsynced empty+launch+release")
    if drawn:
        ax.legend(fontsize=7)
    return drawn


def _line(name: str, s: dict) -> str:
    return (f"  {name:8s} p50 {s['p50']:9.3f}  p10 {s['p10']:9.3f}  p90 {s['p90']:9.3f}  "
            f"p99 {s['p99']:9.3f} ms  (n={s['n']})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cpu", help="comma-separated: cpu, wgpu, cuda")
    ap.add_argument("--quick", action="store_true", help="fewer samples, a 3 s growth phase")
    ap.add_argument("--out", default=None, help="write the JSON here")
    a = ap.parse_args(argv)
    result = {"suite": "stalls", "quick": a.quick, "machine": machine(), "backends": {}}
    for b in a.backend.split(","):
        res = result["backends"][b] = measure(b.strip(), a.quick)
        ru, rf, rs = res["replay_under_read"], res["read_under_flood"], res["rss_flood"]
        print(f"{b}: (a) B's replay() alone vs while A reads a heavy result "
              f"(p99 ratio {ru['p99_ratio']:.2f}, met={ru['met']})")
        print(_line("alone", ru["alone"]))
        print(_line("with_a", ru["with_a"]))
        print(f"{b}: (b) 16-byte read, idle vs 4-thread launch flood (met={rf['met']}, "
              f"{rf['flood_launches']} launches)")
        print(_line("idle", rf["idle"]))
        print(_line("flood", rf["flood"]))
        print(f"{b}: (c) RSS {rs['rss_start_mb']} -> peak {rs['rss_peak_mb']} MB "
              f"({rs['growth_mb']:+.1f} MB) over {rs['seconds']} s, {rs['iterations']} iterations, "
              f"drain {rs['drain_s']} s, stopped_early={rs['stopped_early']}, met={rs['met']}")
    if a.out:
        write_json(a.out, result)
        print(f"wrote {a.out}")
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
