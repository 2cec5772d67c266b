"""The core rows of the cpu backend, measured in this process: the child of ``bench --compare``.

Run by :mod:`runtime.bench.compare` as a script, with ``PYTHONPATH`` pointing at the checkout
under test, so it must import nothing of the runtime but its public API (``runtime.client``,
``runtime.kernels``), which every compared commit has. It prints one JSON line:
``{"runtime": <path of the package measured>, "rows": {row: {"p50", "p10", "p90", "n"}}}``
(µs, medians over repetitions in which the rows take turns, order rotated each repetition,
with an untimed ``sync()`` after every sample, so no row pays for work another left queued).

Rows (64 float32 per buffer; ``add_scalar`` ``y = x + 1`` ping-ponging ``a -> b -> a ...``):

- ``sync``: ``client.sync()`` on an idle stream (an untimed sync first);
- ``launch``: one fire-and-forget ``client.launch`` on an idle stream;
- ``replay``: ``Graph.replay()`` of a 1-launch graph on an idle stream (the enqueue);
- ``replay_read``: that replay plus ``client.read`` of its output, 64 floats;
- ``launch_read``: one launch plus the read of its output;
- ``enqueue_L``: ``Graph.replay()`` of an ``L``-launch graph on an idle stream, L = 10 .. 10000;
- ``e2e_L``: replay of the ``L``-launch graph plus the read of its output (``e2e_1`` is
  ``replay_read``);
- ``floor_L``: the same arithmetic as bare numpy, the floor of ``e2e_L`` (issue 26): ``L``
  calls ``np.add(x, 1.0, out=y)`` ping-ponging between two preallocated arrays, then one copy
  of the result.

    python runtime/bench/core.py [--reps 300] [--quick]
"""

if __name__ == "__main__":          # run as a script: never import this folder's modules
    import sys
    sys.path.pop(0)

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

ELEMS = 64
LENGTHS = (10, 100, 1000, 10000)
E2E = (1, 10, 100, 1000)
#: rows sampled only every k-th repetition (their execution, not the call, dominates).
EVERY = {"enqueue_1000": 2, "enqueue_10000": 10, "e2e_1000": 2, "floor_1000": 2}


def rows() -> list:
    """The row names, in report order."""
    return (["sync", "launch", "replay", "replay_read", "launch_read"]
            + [f"enqueue_{n}" for n in LENGTHS] + [f"e2e_{n}" for n in E2E if n > 1]
            + [f"floor_{n}" for n in E2E])


def measure(reps: int, quick: bool = False) -> dict:
    """Time every row ``reps`` times (``quick``: L <= 1000); returns row -> samples (µs)."""
    import runtime
    from runtime import kernels as K

    c = runtime.client("cpu")
    kern, count, params = K.add_scalar, K.grid(ELEMS), {"alpha": 1.0, "n": ELEMS}
    a = c.create(np.zeros(ELEMS, np.float32))
    b = c.create(np.zeros(ELEMS, np.float32))
    launch, sync, read, pc = c.launch, c.sync, c.read, time.perf_counter

    def run_pass(n):
        for i in range(n):
            launch(kern, count, [a, b] if i % 2 == 0 else [b, a], params)

    lengths = sorted({1, *E2E, *(n for n in LENGTHS if not quick or n <= 1000)})
    graphs = {}
    for n in lengths:
        run_pass(n)
        sync()
        c.graph_prepare()
        run_pass(n)
        sync()
        c.start_capture()
        run_pass(n)
        graphs[n] = c.stop_capture()
    out_of = {n: (b if n % 2 else a) for n in lengths}
    fa, fb = np.zeros(ELEMS, np.float32), np.zeros(ELEMS, np.float32)
    add = np.add

    def t_sync():                             # on an idle stream
        sync()
        t = pc()
        sync()
        return pc() - t

    def t_launch():
        t = pc()
        launch(kern, count, [a, b], params)
        return pc() - t

    def t_launch_read():
        t = pc()
        launch(kern, count, [a, b], params)
        read(b)
        return pc() - t

    def t_enqueue(n):
        g = graphs[n]

        def f():
            sync()
            t = pc()
            g.replay()
            dt = pc() - t
            sync()
            return dt
        return f

    def t_e2e(n):
        g, y = graphs[n], out_of[n]

        def f():
            t = pc()
            g.replay()
            read(y)
            return pc() - t
        return f

    def t_floor(n):
        pair = ((fa, fb), (fb, fa))

        def f():
            t = pc()
            for i in range(n):
                x, y = pair[i & 1]
                add(x, 1.0, out=y)
            (fb if n % 2 else fa).copy()
            return pc() - t
        return f

    paths = {"sync": t_sync, "launch": t_launch, "replay": t_enqueue(1),
             "replay_read": t_e2e(1), "launch_read": t_launch_read}
    for n in LENGTHS:
        if n in graphs:
            paths[f"enqueue_{n}"] = t_enqueue(n)
    for n in E2E:
        if n > 1:
            paths[f"e2e_{n}"] = t_e2e(n)
        paths[f"floor_{n}"] = t_floor(n)
    names = list(paths)
    samples = {n: [] for n in names}
    for fn in paths.values():                 # warm every path
        fn()
    sync()
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if r % EVERY.get(name, 1):
                continue
            samples[name].append(paths[name]() * 1e6)
            sync()                            # untimed: no row pays for work another left
    sync()
    runtime.shutdown()
    return samples


def summary(values) -> dict:
    """``{"p50", "p10", "p90", "n"}`` of ``values`` (µs)."""
    a = np.asarray(values, np.float64)
    p10, p50, p90 = np.percentile(a, [10, 50, 90])
    return {"p50": float(p50), "p10": float(p10), "p90": float(p90), "n": int(a.size)}


def main(argv=None) -> int:
    """Measure and print the JSON line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="graph lengths up to 1000 only")
    args = ap.parse_args(argv)
    import runtime
    samples = measure(args.reps, args.quick)
    print(json.dumps({"runtime": runtime.__file__,
                      "rows": {k: summary(v) for k, v in samples.items() if v}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
