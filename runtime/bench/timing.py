"""Interleaved timing and percentiles: the measuring half of :mod:`runtime.bench`.

Every number the suite reports is a median with its p10/p90 (and p99 for latencies) over
repetitions in which the compared paths take turns: one repetition runs every path once, in an
order rotated from one repetition to the next, so slow drift (another process, frequency
changes, a warming cache) lands on all paths alike instead of on whichever ran last.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Callable

import numpy as np

from .. import tracing as _tracing

#: the clock of every sample (seconds, monotonic, sub-microsecond resolution).
clock = time.perf_counter


def summarize(samples, scale: float = 1e6) -> dict:
    """Percentiles of ``samples`` (seconds), scaled: µs with ``scale=1e6``, ms with ``1e3``.

    Returns: ``{"p50", "p10", "p90", "p99", "n"}`` (``p50`` is the median; numpy's linear
    percentiles); all zero with ``n = 0`` for no samples.
    """
    a = np.asarray(samples, dtype=np.float64) * scale
    if a.size == 0:
        return {"p50": 0.0, "p10": 0.0, "p90": 0.0, "p99": 0.0, "n": 0}
    p10, p50, p90, p99 = np.percentile(a, [10, 50, 90, 99])
    return {"p50": float(p50), "p10": float(p10), "p90": float(p90), "p99": float(p99),
            "n": int(a.size)}


def interleaved(paths: dict[str, Callable], reps: int, tick: Callable | None = None,
                every: dict | None = None, settle: Callable | None = None,
                budget=None, what: str = "", min_reps: int = 2) -> dict:
    """Run each path once per repetition, rotating the order; collect what each returns.

    Args:
        paths: name -> a callable that performs one sample and returns either seconds (a
            float) or a dict of named durations in seconds (``{"enqueue": .., "e2e": ..}``).
        reps: repetitions (every path runs ``reps`` times).
        tick: called after each repetition (a progress bar's ``update``).
        every: name -> k: that path runs only every k-th repetition (long ones sampled less).
        settle: called, untimed, after every sample, so that work one path leaves behind (a
            device still finishing, deferred clean-up) is not charged to the next path. Measured
            on lavapipe: without it, whichever path ran right after 1000 eager launches was
            ~1.4x slower (a sync alone did not help, a 100 ms pause did: the aftermath is
            time-based), and the rotation made that land unevenly on the paths.
        budget: a :class:`runtime.bench.budget.Budget`: stop after the repetition in which it
            ran out (at least ``min_reps`` run), recording the cut as ``what`` (the report
            lists it). None: all ``reps``.
    Returns: name -> list of seconds, or name -> metric -> list of seconds.
    """
    names = list(paths)
    every = every or {}
    out: dict = {n: None for n in names}
    for r in range(reps):
        if budget is not None and budget.stop(r, reps, what or "+".join(names), min_reps):
            break
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if r % every.get(name, 1):
                continue
            tracer = _tracing.active()
            if tracer is None:
                v = paths[name]()
            else:                             # --trace-slowest: keep the slowest sample's events
                t0 = tracer.now()
                v = paths[name]()
                SLOWEST.offer(tracer, t0, tracer.now(), f"{what or 'sample'}: {name}")
            if settle is not None:
                settle()
            if isinstance(v, dict):
                slot = out[name] if out[name] is not None else {}
                for m, s in v.items():
                    slot.setdefault(m, []).append(s)
                out[name] = slot
            else:
                if out[name] is None:
                    out[name] = []
                out[name].append(v)
        if tick is not None:
            tick()
    return out


class Slowest:
    """The trace events of the slowest sample since :meth:`reset` (``bench --trace-slowest``).

    While tracing is on (``runtime.tracing``), :func:`interleaved` offers every sample's time
    window; a new slowest one has the ring's events inside its window copied out (the ring
    moves on). :meth:`write` saves them as a trace file of their own.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget the slowest sample (the suite calls it before each section)."""
        self.dur, self.what, self.raw, self.names = 0.0, None, [], {}

    def offer(self, tracer, t0: float, t1: float, what: str) -> None:
        """A sample that ran from ``t0`` to ``t1`` (µs of ``tracer``'s clock)."""
        if t1 - t0 <= self.dur:
            return
        self.dur, self.what = t1 - t0, what
        self.raw = [e for e in list(tracer.ring) if t0 <= e[4] <= t1]
        self.names = dict(tracer.names)

    def write(self, path):
        """Write the slowest sample's events as Chrome trace-event JSON; returns the path, or
        None when no sample was offered."""
        if self.what is None:
            return None
        t = _tracing.Tracer(max(1, len(self.raw)))
        t.ring.extend(self.raw)
        t.emitted = len(self.raw)
        t.names = dict(self.names)
        return t.write(path)


#: the slowest traced sample of the section running now (``bench --trace-slowest``).
SLOWEST = Slowest()


def compare(paths: dict[str, Callable[[], object]], reps: int = 30, *, warmup: int = 1,
            settle: Callable[[], object] | None = None, pause_s: float = 0.0,
            scale: float = 1e6, tick: Callable | None = None, budget=None,
            what: str = "") -> dict:
    """Time several ways of doing one piece of work side by side, as ``python -m runtime bench``.

    Each repetition calls every path once, in an order rotated from one repetition to the next
    (drift lands on all paths alike), and times each call with :data:`clock`. After every
    sample, untimed, ``settle()`` runs and then a ``pause_s`` sleep, so that work a path leaves
    behind is not charged to the next one (see :func:`interleaved`).

    Example::

        from runtime.bench import compare
        res = compare({"eager": lambda: (run_eager(), c.read(y)),
                       "replay": lambda: (g.replay(), c.read(y))}, reps=50, settle=c.sync)
        print(res["replay"]["p50"] / res["eager"]["p50"])      # the ratio of the medians

    Args:
        paths: name -> a callable doing one sample of the work. Include the wait for the
            result (``read``, ``sync``) when end-to-end time is what you compare.
        reps: timed samples per path (>= 1).
        warmup: untimed calls of every path first (compilation, pools, caches).
        settle: called untimed after every sample, e.g. ``client.sync``.
        pause_s: seconds slept (untimed) after every sample; on lavapipe the aftermath of a
            long pass is time-based and only a pause clears it (50 ms served the suite).
        scale: unit of the returned numbers: 1e6 = µs (default), 1e3 = ms.
        tick: called after every repetition (a progress bar's ``update``).
        budget: a :class:`runtime.bench.budget.Budget`: fewer repetitions (at least 2) once it
            ran out, the cut recorded as ``what`` (see :func:`interleaved`).
    Returns: name -> ``{"p50", "p10", "p90", "p99", "n"}`` in the unit of ``scale``
        (:func:`summarize`); ``p50`` is the median.
    Raises: ``ValueError`` (no paths, ``reps < 1``, ``warmup < 0``, ``pause_s < 0``),
        ``TypeError`` (paths not a dict, a path not callable); whatever a path raises, unchanged.
    """
    if not isinstance(paths, Mapping):
        raise TypeError(f"compare: paths is a dict {{name: callable}}, e.g. {{'eager': f, "
                        f"'replay': g}}; got {type(paths).__name__}")
    if not paths:
        raise ValueError("compare: give at least one path")
    if reps < 1 or warmup < 0 or pause_s < 0:
        raise ValueError(f"compare: need reps >= 1, warmup >= 0, pause_s >= 0 "
                         f"(got {reps}, {warmup}, {pause_s})")
    bad = [name for name, fn in paths.items() if not callable(fn)]
    if bad:
        raise TypeError(f"compare: paths {bad} are not callable")

    def after():
        if settle is not None:
            settle()
        if pause_s:
            time.sleep(pause_s)

    for _ in range(warmup):
        for fn in paths.values():
            fn()
            after()

    def timed(fn):
        def sample():
            t = clock()
            fn()
            return clock() - t
        return sample
    samples = interleaved({name: timed(fn) for name, fn in paths.items()}, reps, tick,
                          settle=after, budget=budget, what=what)
    return {name: summarize(s, scale) for name, s in samples.items()}


def ratio(num: dict, den: dict) -> float:
    """Ratio of two summaries' medians (0 when the denominator's median is 0)."""
    return num["p50"] / den["p50"] if den.get("p50") else 0.0
