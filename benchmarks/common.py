"""Shared helpers of the benchmark suite: interleaved timing, percentiles, JSON, the machine.

Every number the suite reports is a median with its p10/p90 (and p99 for latencies) over
repetitions in which the compared paths take turns: one repetition runs every path once, in an
order rotated from one repetition to the next, so slow drift (another process, frequency
changes, a warming cache) lands on all paths alike instead of on whichever ran last.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Callable

import numpy as np

#: the benchmarks folder and the default output folder (gitignored).
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

clock = time.perf_counter


def summarize(samples, scale: float = 1e6) -> dict:
    """Percentiles of ``samples`` (seconds) in microseconds (``scale`` = 1e6) or ms (1e3).

    Returns: ``{"p50", "p10", "p90", "p99", "n"}``; all zero with ``n = 0`` for no samples.
    """
    a = np.asarray(samples, dtype=np.float64) * scale
    if a.size == 0:
        return {"p50": 0.0, "p10": 0.0, "p90": 0.0, "p99": 0.0, "n": 0}
    p10, p50, p90, p99 = np.percentile(a, [10, 50, 90, 99])
    return {"p50": float(p50), "p10": float(p10), "p90": float(p90), "p99": float(p99),
            "n": int(a.size)}


def interleaved(paths: dict[str, Callable], reps: int, tick: Callable | None = None,
                every: dict | None = None, settle: Callable | None = None) -> dict:
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
    Returns: name -> list of seconds, or name -> metric -> list of seconds.
    """
    names = list(paths)
    every = every or {}
    out: dict = {n: None for n in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if r % every.get(name, 1):
                continue
            v = paths[name]()
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


def ratio(num: dict, den: dict) -> float:
    """Ratio of two summaries' medians (0 when the denominator is 0)."""
    return num["p50"] / den["p50"] if den.get("p50") else 0.0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    """What the numbers were measured on: cpu, cores usable, load, memory, library versions."""
    info = {"cpu": _cpu_model(), "machine": platform.machine(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "commit": _git_commit(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["cpus_usable"] = os.cpu_count()
    try:
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        info["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    for mod in ("wgpu", "cupy", "sentence_transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: just not listed
            pass
    return info


def write_json(path, data) -> Path:
    """Write ``data`` as indented JSON to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    return path
