"""Benchmarks: time your own work the way ``python -m runtime bench`` does, and the suite itself.

Timing your own work
--------------------
:func:`compare` runs several ways of doing one piece of work side by side: every repetition
calls each path once, in an order rotated from one repetition to the next (slow drift lands on
all paths alike), with an untimed settle (your ``settle`` callable, then a ``pause_s`` sleep)
after every sample, and returns per path the median (``p50``) with p10/p90/p99 in µs::

    import numpy as np, runtime
    from runtime import kernels as K
    from runtime.bench import compare, ratio

    c = runtime.client("cpu")
    x, y = c.create(np.ones(64, np.float32)), c.empty(64, np.float32)

    def eager():
        for _ in range(100):
            c.launch(K.add_scalar, K.grid(64), [x, y], {"alpha": 1.0, "n": 64})
        c.read(y)

    c.graph_prepare(); eager(); c.start_capture()
    for _ in range(100):
        c.launch(K.add_scalar, K.grid(64), [x, y], {"alpha": 1.0, "n": 64})
    g = c.stop_capture()
    res = compare({"eager": eager, "replay": lambda: (g.replay(), c.read(y))},
                  reps=30, settle=c.sync)
    print(res["replay"]["p50"], res["replay"]["p90"], ratio(res["eager"], res["replay"]))

:func:`interleaved` is the loop underneath (callables that time themselves and may return
several named durations); :func:`summarize` turns seconds into percentiles; :func:`machine`
says what the numbers were measured on; :func:`write_json` saves them.

The suite
---------
``python -m runtime bench [--quick] [--backend cpu,wgpu] [--sections ...] [--skip ...]`` runs
the sections of :data:`runtime.bench.suite.SECTIONS` on every backend that answers, writes
``bench.json`` and a markdown report with plots (:mod:`runtime.bench.report`), and prints the
targets (goals, not tests). It works from any folder; ``benchmarks/`` in a checkout holds thin
scripts that call it.

Adding a section
----------------
1. Write a module ``runtime/bench/<name>.py`` with ``measure(backend, quick=False, tick=None)
   -> dict`` (JSON-able results for one backend: use :func:`compare` or :func:`interleaved`
   and :func:`summarize`, so rows are medians with p10/p90/p99 over interleaved repetitions;
   call ``tick()`` per repetition; return ``{"skipped": why}`` where it does not apply) and
   ``units(quick) -> int`` (how many ticks per backend). Keep ``quick`` small: CI runs
   ``--quick`` in the test suite.
2. Give it a report: ``markdown(result, img) -> list[str]`` (its lines for all backends, read
   from ``result["backends"][backend][<name>]``, headings as ``## Title``: the report numbers
   them), optionally ``plot(result, folder) -> list[Path]`` (matplotlib PNGs; show one with
   ``img("x.png", "alt")``) and ``targets(result) -> list[dict]``.
3. Append ``Section("<name>", mod.measure, mod.units, mod.markdown, mod.plot, mod.targets)`` to
   ``SECTIONS`` in ``runtime/bench/suite.py``. ``--sections <name>`` then runs it alone and
   ``--skip <name>`` leaves it out; ``tests/bench/test_bench_smoke.py`` shows how to check its rows.
"""

from .results import machine, write_json
from .timing import clock, compare, interleaved, ratio, summarize

__all__ = ["compare", "interleaved", "summarize", "ratio", "clock", "machine", "write_json"]
