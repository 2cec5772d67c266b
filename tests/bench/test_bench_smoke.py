"""Smoke run of the latency suite: ``python -m runtime bench --quick`` in a subprocess, started
in an empty temporary folder (the suite ships in the package, not in the checkout's
``benchmarks/``), with ``PYTHONPATH`` pointing at this checkout so this copy is what runs.

Not a timed test: it checks that the run exits 0 and writes a JSON with every expected row and
sane numbers (positive, finite, percentiles in order), on cpu and on wgpu where it answers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import runtime

ROOT = Path(__file__).resolve().parents[2]
THREADS = {"1", "2", "4", "8"}
QUICK_LENGTHS = {"1", "10", "100", "1000"}


def _sane(s: dict, what: str) -> None:
    vals = [s["p10"], s["p50"], s["p90"], s["p99"]]
    assert s["n"] > 0, f"{what}: no samples"
    assert all(math.isfinite(v) and v > 0 for v in vals), f"{what}: {s}"
    assert vals == sorted(vals), f"{what}: percentiles out of order: {s}"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    avail = runtime.available_backends()
    backends = [b for b in ("cpu", "wgpu") if avail.get(b) is None]
    cwd = tmp_path_factory.mktemp("elsewhere")
    out = cwd / "results"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run(
        [sys.executable, "-m", "runtime", "bench", "--quick", "--backend", ",".join(backends),
         "--out", "results"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    return backends, out, proc


def test_quick_bench_exits_zero_and_writes_json_and_report(quick_run):
    backends, out, proc = quick_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    data = json.loads((out / "bench.json").read_text())
    assert data["quick"] is True
    assert data["sections"] == ["device_thread", "replay", "minilm", "stalls", "decode"]
    assert sorted(data["backends"]) == sorted(backends)
    assert data["machine"]["cpus"] > 0
    md = (out / "bench.md").read_text()
    assert "## Targets" in md and "## 3. End to end" in md


def test_quick_bench_has_device_thread_rows_for_one_to_eight_threads(quick_run):
    backends, out, _ = quick_run
    data = json.loads((out / "bench.json").read_text())
    for b in backends:
        threads = data["backends"][b]["device_thread"]["threads"]
        assert set(threads) == THREADS
        paths = {"sync", "sync_floor", "launch", "launch_floor"}
        paths |= {"call"} if b == "cpu" else set()
        for n, rows in threads.items():
            assert set(rows) == paths
            for p, s in rows.items():
                _sane(s, f"{b} {n} threads {p}")


def test_quick_bench_has_replay_enqueue_and_end_to_end_rows(quick_run):
    backends, out, _ = quick_run
    data = json.loads((out / "bench.json").read_text())
    for b in backends:
        rep = data["backends"][b]["replay"]
        assert set(rep["enqueue"]) == QUICK_LENGTHS
        for L, s in rep["enqueue"].items():
            _sane(s, f"{b} replay enqueue L={L}")
        got = {(r["size"], r["length"]) for r in rep["e2e"]}
        assert {("tiny", L) for L in (1, 10, 100, 1000)} <= got
        assert {("large", L) for L in (1, 10)} <= got
        for r in rep["e2e"]:
            for path in ("eager", "replay", "floor"):
                for metric in ("enqueue", "e2e"):
                    _sane(r[path][metric], f"{b} {r['size']} L={r['length']} {path} {metric}")
            if "check" in r:                      # all three paths computed the same values
                assert r["check"]["ok"], r["check"]


def test_quick_bench_has_a_minilm_row_on_cpu(quick_run):
    backends, out, _ = quick_run
    mm = json.loads((out / "bench.json").read_text())["backends"]["cpu"]["minilm"]
    if "skipped" in mm:
        pytest.skip(f"MiniLM not measured: {mm['skipped']}")
    (row,) = mm["rows"]
    assert (row["batch"], row["seq"]) == (1, 16)
    _sane(row["eager"], "minilm eager")
    _sane(row["replay"], "minilm replay")


def test_quick_bench_has_stalls_rows_on_cpu(quick_run):
    _, out, _ = quick_run
    st = json.loads((out / "bench.json").read_text())["backends"]["cpu"]["stalls"]
    for key, phases in (("replay_under_read", ("alone", "with_a")),
                        ("read_under_flood", ("idle", "flood"))):
        for ph in phases:
            s = st[key][ph]
            assert s["n"] > 0 and 0 < s["p50"] <= s["p99"], (key, ph, s)
    assert st["rss_flood"]["iterations"] > 0 and st["rss_flood"]["series"]


def test_quick_soak_runs_mixed_work_and_every_table_returns_to_its_baseline(tmp_path):
    """``--quick --sections soak`` (issue 24 item 6): the section runs only when named, on cpu
    and wgpu; every kind of work ran, no request saw a wrong value or a missing error, and the
    server's tables (streams, handles, graphs, live marks) are back at their baseline at the
    end (counts, not times: RSS and the read's p99 are reported, not asserted)."""
    avail = runtime.available_backends()
    backends = [b for b in ("cpu", "wgpu") if avail.get(b) is None]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run(
        [sys.executable, "-m", "runtime", "bench", "--quick", "--sections", "soak", "--no-plots",
         "--backend", ",".join(backends), "--out", "results"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "results" / "bench.json").read_text())
    assert data["sections"] == ["soak"]
    for b in backends:
        r = data["backends"][b]["soak"]
        assert not r["unexpected"] and r["stuck_workers"] == 0, r["unexpected"]
        assert all(r["ops"].get(k, 0) > 0 for k in ("request", "graph", "failure")), r["ops"]
        for k in ("streams", "handles", "graphs", "marks"):
            assert r["end"][k] <= r["base"][k], (b, k, r["base"], r["end"])
        assert r["series"] and r["queue_max"] > 0
        assert r["read_start"]["n"] > 0 and r["read_end"]["n"] > 0


def test_serving_benchmark_isolated_rounds_write_rows_and_a_summary(tmp_path):
    """``benchmarks/serving.py --isolate --rounds 2`` on the eager path with a few requests:
    every (round, clients) row is there, each from its own child process, every request
    answered 200, and the summary's median lies within the rounds' min-max."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("fastapi")
    from runtime.models import default_model_dir
    try:
        default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--backend", "cpu",
         "--sections", "closed", "--paths", "eager", "--clients", "1,3", "--requests", "6",
         "--rounds", "2", "--isolate", "--out", str(tmp_path), "--quiet"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "serving_cpu.json").read_text())
    assert data["meta"]["isolated"] and data["meta"]["rounds"] == 2
    assert data["meta"]["contention"] == {"busy_processes": 0}     # --contention N says so
    rows = data["rows"]
    assert sorted((r["round"], r["clients"]) for r in rows) == [(0, 1), (0, 3), (1, 1), (1, 3)]
    assert all(r["path"] == "eager" and r["requests"] == 6 and r["failures"] == 0 for r in rows)
    for s in data["summary"]:
        assert s["rounds"] == 2 and s["vs_st_median"] is None
        assert s["req_per_s_min"] <= s["req_per_s_median"] <= s["req_per_s_max"]
    assert "eager" in proc.stdout and "rounds" in proc.stdout
