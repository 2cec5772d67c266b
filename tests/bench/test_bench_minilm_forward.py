"""benchmarks/minilm_forward.py ``--st-threads 1,2``: sentence-transformers runs at each torch
thread count in its own processes, and every ratio is against the best one per row (per round,
that round's best): the anchor at its best setting. Fake workers, no timing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fwd():
    spec = importlib.util.spec_from_file_location("minilm_forward_bench",
                                                  ROOT / "benchmarks" / "minilm_forward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ratios_are_against_the_best_thread_count_of_each_row_and_round(fwd, monkeypatch,
                                                                          capsys):
    from runtime.models import default_model_dir
    try:
        default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    # seconds per call: ours 10 ms; torch at 1 thread 20 ms on 1x16 and 80 ms on 8x16, at 2
    # threads 40 ms and 40 ms: the best differs per row; in round 2 1 thread is the faster on
    # 8x16 (30 ms), but pooled over both rounds (median 183 sentences/s) 2 threads (200) is
    times = {("product", None): {"1x16": [0.01, 0.01], "8x16": [0.01, 0.01]},
             ("st", "1"): {"1x16": [0.02, 0.02], "8x16": [0.08, 0.03]},
             ("st", "2"): {"1x16": [0.04, 0.04], "8x16": [0.04, 0.04]}}
    calls = []

    def fake(python, kind, job, env):
        n = env.get(fwd.ST_THREADS_ENV)
        r = sum(1 for c in calls if c == (kind, n))
        calls.append((kind, n))
        return {"samples": {k: [v[r]] * 3 for k, v in times[kind, n].items()},
                "threads": {"torch": int(n)} if n else {}}
    monkeypatch.setattr(fwd, "_run_worker", fake)
    res = fwd.compare("python-with-st", rows=((1, 16), (8, 16)), rounds=2, reps=3,
                      budget_s=0.1, st_threads=[1, 2])
    assert sorted(set(calls)) == [("product", None), ("st", "1"), ("st", "2")]
    assert len(calls) == 6                                   # each in its own process per round
    r1, r8 = res["rows"]
    assert r1["st_best"] == "sentence-transformers 1t" and r1["ratio:runtime"] == pytest.approx(2)
    assert r1["ratio_rounds:runtime"] == pytest.approx([2, 2])
    assert r8["st_best"] == "sentence-transformers 2t" and r8["ratio:runtime"] == pytest.approx(4)
    assert r8["ratio_rounds:runtime"] == pytest.approx([4, 3])      # each round's best: 40, 30
    assert res["st_threads"] == [1, 2]
    fwd.print_table(res)
    out = capsys.readouterr().out
    assert "vs ST best" in out and "best per row: 1x16 1t, 8x16 2t" in out
