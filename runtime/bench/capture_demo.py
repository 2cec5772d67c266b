"""``python -m runtime capture-demo [--backend cpu]``: a chain of launches, eager vs one replay.

Runs the suite's replay workload (:mod:`runtime.bench.replay`: ``--length`` dependent
``add_scalar`` launches ping-ponging between two f32 buffers of ``--elems`` floats) eagerly,
captures it once, then times eager passes against replays of the graph side by side
(:func:`runtime.bench.compare`: interleaved, medians), checks the buffers hold the count of
launches that ran, and prints the per-pass and per-launch medians in µs.
"""

from __future__ import annotations

import argparse

import numpy as np

import runtime

from . import replay
from .timing import compare


def main(argv=None) -> int:
    """Run the demo; returns 0 when the values match, 1 otherwise.

    Raises: ``SystemExit`` for bad flags (an odd or non-positive ``--length``);
    ``ValueError``/``UnsupportedError`` for a backend that is unknown or cannot run here.
    """
    p = argparse.ArgumentParser(prog="python -m runtime capture-demo",
                                description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="cpu", help="cpu (default), wgpu, cuda")
    p.add_argument("--length", type=int, default=200, help="launches per pass (even)")
    p.add_argument("--elems", type=int, default=1024, help="floats per buffer")
    p.add_argument("--rounds", type=int, default=30, help="timed passes per path")
    args = p.parse_args(argv)
    if args.length < 2 or args.length % 2:
        p.error(f"--length must be even and >= 2, got {args.length}")
    if args.elems < 1 or args.rounds < 1:
        p.error("--elems and --rounds must be >= 1")
    try:
        c = runtime.client(args.backend)
    except ValueError as e:                  # the one line names the flag (README "Commands")
        raise ValueError(f"--backend: {e}") from None
    n, L = args.elems, args.length
    print(f"backend {c.backend}: {c.device_name}")
    a = c.create(np.zeros(n, np.float32))
    b = c.create(np.zeros(n, np.float32))
    g, _ = replay.capture(c, a, b, n, L)      # runs the chain twice, records it once
    passes = [2]

    def eager():
        replay.run_pass(c, a, b, n, L)
        c.sync()
        passes[0] += 1

    def graph():
        g.replay()
        c.sync()
        passes[0] += 1
    print(f"captured {L} launches into one {'hardware' if g.is_hardware else 'software'} graph")
    res = compare({"eager": eager, "replay": graph}, reps=args.rounds)
    total = L * passes[0]                     # every launch adds 1 to the other buffer
    got_a, got_b = c.read(a), c.read(b)
    ok = np.array_equal(got_a, np.full(n, total, np.float32)) and \
        np.array_equal(got_b, np.full(n, total - 1, np.float32))
    me, mr = res["eager"]["p50"], res["replay"]["p50"]
    print(f"values match numpy: {ok} (a={got_a[0]:.0f}, b={got_b[0]:.0f}, expected {total}, "
          f"{total - 1})")
    print(f"eager  launches: {me:10.1f} µs/pass  ({me / L:.2f} µs/launch)")
    print(f"graph  replay  : {mr:10.1f} µs/pass  ({mr / L:.2f} µs/launch)  speedup x{me / mr:.2f}")
    runtime.shutdown()
    return 0 if ok else 1
