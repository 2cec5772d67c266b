"""What the stream-ordering checker (``check=True``) costs on the launch and replay paths.

Two servers of one backend run side by side, one with the checker and one without, and the
measurements alternate between them round by round (the order flips every round), so drift of
a shared machine hits both alike:

- replay enqueue: the latency of one ``Graph.replay()`` call (it blocks until the device thread
  accepted the enqueue) of a graph of ``--graph-launches`` launches over four buffers; every
  call is timed, a sync every ``--batch`` calls keeps the queue short (not timed);
- eager pass: ``--launches`` launches of ``add`` (three bindings) cycling over four buffers on
  one stream, then a ``sync``; the whole pass is timed end to end (``eager_pass_N``), and the
  issuing calls alone (``eager_issue_N``: the part the checker adds to).

Medians with p10/p90; the overhead is checker median / plain median - 1. The ``_cpu`` entries
count the calling thread's CPU time (``time.thread_time``), which a loaded machine inflates far
less than wall time; with ``--scheduler interleave`` no worker thread runs meanwhile and every
message runs on the caller (the combining fast path), so they are the server's own cost.

Usage::

    python benchmarks/checker_cost.py [--backend cpu] [--scheduler interleave] [--rounds 40]

Writes ``benchmarks/results/checker_cost_<backend>[_<scheduler>].json`` (gitignored).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import runtime  # noqa: E402
import runtime.kernels as K  # noqa: E402
from runtime.bench import machine, ratio, summarize, write_json  # noqa: E402

ELEMS = 64


def setup(backend, check, scheduler=None):
    """A client pinned to a fresh stream, and four buffers."""
    opts = {"scheduler": scheduler} if scheduler else {}
    c = runtime.client(backend, check=check, **opts)
    c.set_stream(runtime.StreamId.new())
    hs = [c.create(np.zeros(ELEMS, np.float32)) for _ in range(4)]
    c.sync()
    return c, hs


def issue(c, hs, launches):
    for i in range(launches):
        c.launch(K.add, 1, [hs[i % 4], hs[(i + 1) % 4], hs[(i + 2) % 4]], {"n": ELEMS})


def capture(c, hs, launches):
    c.graph_prepare()
    c.start_capture()
    issue(c, hs, launches)
    return c.stop_capture()


def replay_samples(c, g, calls, batch):
    """Per-call replay latencies (wall, us) and per-batch mean CPU time of this thread (us)."""
    out, cpu = [], []
    clock, tclock = time.perf_counter_ns, time.thread_time_ns
    c0 = tclock()
    for i in range(calls):
        t0 = clock()
        g.replay()
        out.append((clock() - t0) / 1e3)
        if (i + 1) % batch == 0:
            cpu.append((tclock() - c0) / 1e3 / batch)
            c.sync()
            c0 = tclock()
    c.sync()
    return out, cpu


def eager_pass(c, hs, launches):
    """One pass of ``launches`` launches + sync: ``(issue ms, issue CPU ms, end-to-end ms)``."""
    t0, c0 = time.perf_counter(), time.thread_time()
    issue(c, hs, launches)
    t1, c1 = time.perf_counter(), time.thread_time()
    c.sync()
    return (t1 - t0) * 1e3, (c1 - c0) * 1e3, (time.perf_counter() - t0) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--launches", type=int, default=1000, help="launches per eager pass")
    ap.add_argument("--graph-launches", type=int, default=16, help="launches in the graph")
    ap.add_argument("--calls", type=int, default=500, help="replay calls per round")
    ap.add_argument("--batch", type=int, default=50, help="replays between syncs")
    ap.add_argument("--scheduler", default=None,
                    help="cpu: 'thread' (default) or 'interleave' (work runs at the sync, on "
                         "the caller: issue times without a worker thread competing)")
    ap.add_argument("--quick", action="store_true", help="5 rounds (a smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rounds = 5 if args.quick else args.rounds

    modes = {}
    for check in (False, True):
        c, hs = setup(args.backend, check, args.scheduler)
        g = capture(c, hs, args.graph_launches)
        eager_pass(c, hs, args.launches)          # warm: compile, pool, caches
        replay_samples(c, g, args.batch, args.batch)
        modes[check] = (c, hs, g)
    assert modes[True][0].capabilities["checked"] and not modes[False][0].capabilities["checked"]

    replay = {False: [], True: []}
    replay_cpu = {False: [], True: []}
    eager = {False: [], True: []}
    issued = {False: [], True: []}
    issued_cpu = {False: [], True: []}
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for check in order:
            c, hs, g = modes[check]
            wall, cpu = replay_samples(c, g, args.calls, args.batch)
            replay[check].extend(wall)
            replay_cpu[check].extend(cpu)
            t_issue, t_cpu, t_total = eager_pass(c, hs, args.launches)
            issued[check].append(t_issue)
            issued_cpu[check].append(t_cpu)
            eager[check].append(t_total)

    def entry(samples, unit):
        off, on = summarize(samples[False], 1), summarize(samples[True], 1)   # already scaled
        return {"unit": unit, "plain": off, "checked": on, "overhead": ratio(on, off) - 1.0}

    result = {
        "backend": args.backend,
        "scheduler": args.scheduler or "default",
        "device": modes[False][0].device_name,
        "machine": machine(),
        "params": {"rounds": rounds, "launches": args.launches, "elems": ELEMS,
                   "graph_launches": args.graph_launches, "calls": args.calls,
                   "batch": args.batch},
        "replay_enqueue": entry(replay, "us/call"),
        f"eager_pass_{args.launches}": entry(eager, "ms/pass"),
        f"eager_issue_{args.launches}": entry(issued, "ms/pass"),
        "replay_enqueue_cpu": entry(replay_cpu, "us/call (thread CPU time)"),
        f"eager_issue_{args.launches}_cpu": entry(issued_cpu, "ms/pass (thread CPU time)"),
    }
    for c, _, g in modes.values():
        g.release()
    runtime.shutdown()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"checker_cost_{args.backend}"
                                   f"{'_' + args.scheduler if args.scheduler else ''}.json")
    write_json(out, result)
    for name in [k for k in result if k.startswith(("replay_", "eager_"))]:
        e = result[name]
        p, q = e["plain"], e["checked"]
        print(f"{name:24s} plain {p['p50']:9.2f} [{p['p10']:.2f}, {p['p90']:.2f}]  "
              f"checked {q['p50']:9.2f} [{q['p10']:.2f}, {q['p90']:.2f}] {e['unit']}  "
              f"overhead {100 * e['overhead']:+.1f}%")
    print("wrote", out)
    return result


if __name__ == "__main__":
    main()
