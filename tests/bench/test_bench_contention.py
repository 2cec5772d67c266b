"""The busy host of ``--contention N`` (runtime.bench.contention): its loops run while the block
runs and are gone after it, and a loop whose starter died ends by itself (nothing left spinning
after a killed benchmark)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from runtime.bench.contention import busy_processes


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, seconds: float = 20.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")


def test_busy_processes_run_inside_the_block_only():
    with busy_processes(2) as pids:
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    assert all(_wait_gone(p) for p in pids)
    with busy_processes(0) as none:
        assert none == []
    with pytest.raises(ValueError):
        with busy_processes(-1):
            pass


def test_a_busy_loop_ends_when_its_starter_is_killed():
    code = ("from runtime.bench.contention import busy_processes; import time\n"
            "with busy_processes(1) as pids:\n"
            "    print(pids[0], flush=True); time.sleep(60)\n")
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(starter.stdout.readline())
        assert _alive(pid)
    finally:
        starter.kill()
        starter.wait(10)
    assert _wait_gone(pid)
