"""``runtime.bench.compare``: interleaved samples, untimed settle, percentiles that match numpy.

A fake clock makes every duration known: each path advances it by its own list of durations,
so the returned percentiles are checked against ``numpy.percentile`` of exactly those values.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import runtime.bench as bench
from runtime.bench import timing


class FakeClock:
    """A clock that only moves when a path (or the settle) advances it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def fake_clock(monkeypatch):
    clk = FakeClock()
    monkeypatch.setattr(timing, "clock", clk)
    return clk


def test_compare_returns_numpy_percentiles_of_each_paths_own_durations(fake_clock):
    rng = np.random.default_rng(7)
    durations = {"eager": rng.uniform(1e-4, 9e-4, 25), "replay": rng.uniform(1e-5, 5e-5, 25)}
    calls = {name: 0 for name in durations}
    order, settles = [], []

    def path(name):
        def run():
            if calls[name] >= 1:                        # the one warm-up call is not timed
                fake_clock.now += durations[name][calls[name] - 1]
            calls[name] += 1
            order.append(name)
        return run

    def settle():
        settles.append(order[-1])
        fake_clock.now += 1.0                           # untimed: never in a sample

    res = bench.compare({n: path(n) for n in durations}, reps=25, warmup=1, settle=settle)
    for name, d in durations.items():
        want = np.percentile(d * 1e6, [50, 10, 90, 99])
        got = [res[name][k] for k in ("p50", "p10", "p90", "p99")]
        np.testing.assert_allclose(got, want, rtol=1e-9)
        assert res[name]["n"] == 25 and calls[name] == 26
    assert len(settles) == len(order) == 52             # after every call, warm-up included
    timed = order[2:]                                   # repetitions take turns, order rotated
    assert [timed[i:i + 2] for i in (0, 2, 4)] == [["eager", "replay"], ["replay", "eager"],
                                                   ["eager", "replay"]]


def test_compare_scale_gives_milliseconds(fake_clock):
    def step():
        fake_clock.now += 0.002
    res = bench.compare({"one": step}, reps=3, warmup=0, scale=1e3)
    assert res["one"]["p50"] == pytest.approx(2.0) and res["one"]["n"] == 3


@pytest.mark.parametrize("kwargs,exc", [({"paths": {}}, ValueError),
                                        ({"paths": {"a": print}, "reps": 0}, ValueError),
                                        ({"paths": {"a": print}, "pause_s": -1}, ValueError),
                                        ({"paths": {"a": 3}}, TypeError),
                                        # USER8: a list was AttributeError 'list' ... 'items'
                                        ({"paths": [print]}, TypeError)])
def test_compare_refuses_bad_arguments(kwargs, exc):
    with pytest.raises(exc):
        bench.compare(**kwargs)


def test_summarize_of_no_samples_is_zero_with_n_zero():
    assert bench.summarize([]) == {"p50": 0.0, "p10": 0.0, "p90": 0.0, "p99": 0.0, "n": 0}


def test_every_public_name_of_runtime_bench_has_a_docstring():
    from runtime.bench import suite
    names = [getattr(bench, n) for n in bench.__all__ if n != "clock"]
    names += [suite.Section, suite.main, suite.select]
    assert not [o for o in names if len(inspect.getdoc(o) or "") < 10]


def test_sections_are_selected_by_name_and_unknown_names_are_refused():
    from runtime.bench import suite
    assert [s.name for s in suite.select("replay,device_thread")] == ["device_thread", "replay"]
    assert [s.name for s in suite.select(skip="minilm")] == ["device_thread", "replay", "stalls",
                                                         "decode"]
    with pytest.raises(ValueError, match="unknown section"):
        suite.select("nope")


def test_the_report_renders_the_sections_it_is_given_and_rerender_uses_the_suites(tmp_path):
    """``runtime.bench.report`` imports no section (issue 29 item 1: report <-> suite was an
    import cycle): it refuses to guess, and ``suite.rerender`` (benchmarks/report.py) passes
    the suite's sections."""
    import json

    from runtime.bench import machine, report, suite
    result = {"suite": "runtime bench", "quick": True, "machine": machine(), "sections": [],
              "backends": {"cpu": {"device": "numpy", "device_thread": {"threads": {"1": {
                  "sync": {"p50": 1.0, "p10": 0.5, "p90": 2.0, "p99": 3.0, "n": 5}}}}}}}
    with pytest.raises(TypeError, match="sections"):
        report.summary(result)
    assert "met" in report.summary(result, suite.SECTIONS)          # 1 µs < the 5 µs goal
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result))
    assert suite.rerender([str(path), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "Device-thread cost" in md and "| runtime `sync()` | 1.00 [0.50–2.00]" in md
