"""benchmarks/serving.py's summary: sentence-transformers at several torch thread counts
(``--st-threads 1,2``) is compared at its best in each round (the anchor's best setting), and
the flags that cannot work are refused. Fake rows, no server, no timing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def serving():
    spec = importlib.util.spec_from_file_location("serving_bench",
                                                  ROOT / "benchmarks" / "serving.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(path, clients, rnd, rate, threads=None):
    return {"path": path, "clients": clients, "round": rnd, "req_per_s": rate,
            "p50_ms": 1000 / rate, "p99_ms": 2000 / rate, "st_threads": threads}


def test_the_graph_path_is_compared_with_sentence_transformers_best_thread_count_per_round(
        serving):
    ST = serving.ST
    rows = [_row("graph", 8, 0, 60.0), _row(ST, 8, 0, 30.0, 2), _row(ST, 8, 0, 50.0, 1),
            _row("graph", 8, 1, 40.0), _row(ST, 8, 1, 80.0, 2), _row(ST, 8, 1, 20.0, 1)]
    s = {x["label"]: x for x in serving.summarize_closed(rows)}
    assert set(s) == {"graph", f"{ST} 1t", f"{ST} 2t", f"{ST} best"}
    g = s["graph"]
    # round 0: 60 / max(30, 50); round 1: 40 / max(80, 20)
    assert g["vs_st_min"] == pytest.approx(0.5) and g["vs_st_max"] == pytest.approx(1.2)
    assert g["vs_st_median"] == pytest.approx((0.5 + 1.2) / 2)
    best = s[f"{ST} best"]
    assert best["rounds"] == 2 and best["req_per_s_min"] == 50.0 and best["req_per_s_max"] == 80.0
    assert sorted(r["best_of"] for r in serving.best_st(rows)) == [1, 2]
    assert s[f"{ST} 1t"]["req_per_s_median"] == pytest.approx(35.0)


def test_one_sentence_transformers_setting_is_compared_as_before(serving):
    ST = serving.ST
    rows = [_row("graph", 1, 0, 30.0), _row(ST, 1, 0, 20.0, 0),
            _row("graph", 1, 1, 30.0), _row(ST, 1, 1, 60.0, 0)]
    assert serving.best_st(rows) == []
    s = {x["label"]: x for x in serving.summarize_closed(rows)}
    assert set(s) == {"graph", ST}
    assert (s["graph"]["vs_st_min"], s["graph"]["vs_st_max"]) == (0.5, 1.5)


def test_thread_lists_are_parsed_and_need_isolated_processes(serving):
    assert serving.st_thread_counts("1,2") == [1, 2]
    assert serving.st_thread_counts("0") == [0]
    for bad in ("", "-1", "1,x"):
        with pytest.raises(ValueError):
            serving.st_thread_counts(bad)
    with pytest.raises(SystemExit):          # torch's threads are per process
        serving.main(["--sections", "closed", "--st-threads", "1,2", "--no-st"])
