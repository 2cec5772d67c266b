"""What a benchmark ran on (:func:`machine`) and where its JSON goes (:func:`write_json`)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

#: the package folder: its git commit is the one reported (empty outside a checkout).
_PACKAGE = Path(__file__).resolve().parents[1]


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
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_PACKAGE, text=True,
                              capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    """What the numbers were measured on: cpu, cores usable, load average at the call, memory
    (GiB), the commit of this package's checkout, and the versions of numpy, wgpu, cupy and
    sentence-transformers where installed. Never raises: a fact it cannot read is left out."""
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
    """Write ``data`` as indented JSON to ``path`` (parents created); returns the path.

    Raises: ``OSError`` when the folder cannot be created or written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    return path
