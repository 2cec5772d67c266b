"""The benchmark suite never loses a run (issue 28 item 4): budgets cut repetitions and say so,
``bench.json``/``bench.md`` are written after every section, each section's table is printed
as it finishes, and an interrupted run keeps what it measured.

The suite tests run ``runtime.bench.suite.main`` in a subprocess whose ``SECTIONS`` are fake
sections (sleeps with known counts), so no timing matters: only the counts and the files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.bench import budget as budget_mod
from runtime.bench import suite
from runtime.bench.budget import Budget

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clk = Clock()
    monkeypatch.setattr(budget_mod, "clock", clk)
    return clk


def test_budget_split_gives_unused_time_to_later_parts(clock):
    b = Budget(90.0)
    parts = b.split([1, 1, 1])
    first = next(parts)
    assert first.seconds == pytest.approx(30.0)
    clock.now = 10.0                               # the first part used 10 of its 30 s
    second = next(parts)
    assert second.seconds == pytest.approx(40.0)   # (90 - 10) / 2
    clock.now = 70.0                               # the second overran by 20 s
    assert next(parts).seconds == pytest.approx(20.0)
    with pytest.raises(StopIteration):
        next(parts)


def test_budget_stop_keeps_min_reps_and_records_each_cut(clock):
    b = Budget(5.0)
    assert not b.stop(0, 10, "row a")              # time left: run on
    clock.now = 6.0
    assert not b.stop(1, 10, "row a")              # spent, but fewer than min_reps ran
    assert b.stop(2, 10, "row a")
    assert not b.stop(10, 10, "row a")             # nothing planned is left: not a cut
    assert b.cuts == ["row a: 2 of 10 repetitions"]
    child = b.part(0.5)
    assert child.seconds == 0.0 and child.cuts is b.cuts
    child.cut("x")
    assert b.cuts[-1] == "x"


def test_unbounded_budget_never_cuts(clock):
    b = budget_mod.unbounded()
    clock.now = 1e9
    assert not b.expired() and not b.stop(5, 10, "r")
    assert all(p.seconds is None for p in b.split([1, 2]))
    with pytest.raises(ValueError):
        Budget(-1.0)


def test_interleaved_stops_at_the_budget_and_says_how_many_ran(clock):
    from runtime.bench import timing

    def path():
        clock.now += 1.0
        return 1.0
    b = Budget(3.5)
    got = timing.interleaved({"a": path, "b": path}, reps=10, budget=b, what="pair")
    assert len(got["a"]) == len(got["b"]) == 2     # 4 s spent after 2 repetitions
    assert b.cuts == ["pair: 2 of 10 repetitions"]


def test_every_built_in_section_takes_a_budget_and_says_how_long_it_takes():
    for sec in suite.SECTIONS:
        assert sec.takes_budget(), sec.name
        assert sec.takes and " s" in sec.takes, sec.name
    out = subprocess.run([sys.executable, "-m", "runtime", "bench", "--help"],
                         capture_output=True, text=True, env=_env(), timeout=120).stdout
    assert "--budget-s" in out
    flat = " ".join(out.split())
    for sec in suite.SECTIONS:
        assert f"  {sec.name}" in out and " ".join(sec.takes.split()) in flat, sec.name


FAKE = """
import os, signal, sys, time
from runtime.bench import suite

def budgeted(backend, quick, tick, budget):
    done = 0
    for r in range(50):
        if budget.stop(r, 50, "fake row"):
            break
        time.sleep(0.02)
        done += 1
        tick()
    return {"reps": done}

def plain(backend, quick, tick):
    tick(3)
    return {"plain": 3}

def dies(backend, quick, tick, budget):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    return {"never": True}

def md(name):
    def render(result, img):
        return [f"## {name}", ""] + [f"{b}: {r[name]}" for b, r in result["backends"].items()
                                     if name in r]
    return render

suite.SECTIONS[:] = [
    suite.Section("first", budgeted, lambda q: 50, md("first"), weight=1.0, takes="0.5 s"),
    suite.Section("second", plain, lambda q: 3, md("second"), takes="0 s"),
    suite.Section("third", dies, lambda q: 1, md("third"), takes="-"),
]
sys.exit(suite.main(sys.argv[1:]))
"""


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def _run(tmp_path, *args):
    script = tmp_path / "fake_suite.py"
    script.write_text(textwrap.dedent(FAKE))
    return subprocess.run([sys.executable, str(script), "--backend", "cpu", "--no-plots",
                           "--out", str(tmp_path / "out"), *args],
                          capture_output=True, text=True, env=_env(), timeout=300)


def test_a_budget_cut_is_reported_and_an_interrupted_run_keeps_its_sections(tmp_path):
    proc = _run(tmp_path, "--budget-s", "0.3")
    assert proc.returncode == 130, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    res = data["backends"]["cpu"]
    why = f"{data}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert 2 <= res["first"]["reps"] < 50, why     # cut, but not below the minimum
    assert res["second"] == {"plain": 3}, why
    assert "interrupted" in res["third"]["error"], why
    assert data["interrupted"].startswith("Interrupted during cpu third"), why
    t = data["timing"]["cpu"]
    assert t["first"]["cuts"] == [f"fake row: {res['first']['reps']} of 50 repetitions"]
    assert t["second"]["budgeted"] is False and t["second"]["cuts"] == []
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "Partial run" in md and "fake row:" in md and "takes no budget" in md, md
    # each section's table was printed as it finished, in order
    out = proc.stdout
    assert "== cpu first" in out and "== cpu second" in out, why
    assert out.index("== cpu first") < out.index("== cpu second") < out.index("cpu: {'plain': 3}")


def test_without_a_budget_nothing_is_cut(tmp_path):
    proc = _run(tmp_path, "--budget-s", "0", "--sections", "first,second")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["budget_s"] is None
    assert data["backends"]["cpu"]["first"]["reps"] == 50
    assert data["timing"]["cpu"]["first"]["cuts"] == []
    assert "interrupted" not in data
