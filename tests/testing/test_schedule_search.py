"""The testing kit searches with a guarantee (issue 28 item 3): PCT and the bounded exhaustive
search of ``runtime.testing.search``, through the API and through the pytest plugin.

The planted bug has depth 2: ``out`` ends up 1 only if stream A's first replay runs before
stream B's first (which copies what it wrote) *and* B's second replay runs before A's second
(which copies B's result into ``out``). Both streams also replay graphs on buffers of their
own, which commute with everything (the partial-order reduction's case). The correct program
orders the four with events and must pass every interleaving.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.testing import search

N = 4
pytest_plugins = ("pytester",)


def _graph(c, x, y, kernel=K.copy):
    c.graph_prepare()
    c.launch(kernel, K.grid(N), [x, y], {"n": N})
    c.start_capture()
    c.launch(kernel, K.grid(N), [x, y], {"n": N})
    return c.stop_capture()


def pipeline(a, ordered: bool):
    """A: ga1 (one -> p), later ga2 (r -> out); B: gb1 (p -> q), gb2 (q -> r); both also
    accumulate into a buffer of their own, three times. Returns (out, xa, xb) as read back."""
    b = a.with_stream(runtime.StreamId.new())
    z = np.zeros(N, np.float32)
    one = a.create(np.ones(N, np.float32))
    p, q, r, out, xa, xb = (a.create(z) for _ in range(6))
    a.sync()
    ga1, gb1, gb2, ga2 = _graph(a, one, p), _graph(b, p, q), _graph(b, q, r), _graph(a, r, out)
    gxa, gxb = _graph(a, one, xa, K.accumulate), _graph(b, one, xb, K.accumulate)
    for h in (p, q, r, out, xa, xb):
        a.write(h, z)
    a.sync()
    b.sync()
    for _ in range(2):
        gxa.replay()
        gxb.replay()
    ga1.replay()                                   # writes p
    if ordered:
        b.wait_event(a.record_event())
    gb1.replay()                                   # reads p, writes q
    gxb.replay()
    gb2.replay()                                   # reads q, writes r
    if ordered:
        a.wait_event(b.record_event())
    gxa.replay()
    ga2.replay()                                   # reads r, writes out
    return a.read(out), a.read(xa), b.read(xb)


def planted(a):
    out, xa, xb = pipeline(a, ordered=False)
    assert xa.tolist() == xb.tolist() == [3.0] * N      # their own buffers: never racy
    assert out.tolist() == [0.0] * N, "out was written through p, q and r"


def correct(a):
    out, xa, xb = pipeline(a, ordered=True)
    assert out.tolist() == [1.0] * N and xa.tolist() == xb.tolist() == [3.0] * N


def _check_report(failure: search.ScheduleFailure) -> None:
    text = str(failure)
    assert "out was written through p, q and r" in text
    # the two races of the bug, each with both accesses, their streams and test lines
    races = {(a.op.split(" of ")[0], a.stream, b.stream) for a, b, _ in failure.races}
    assert len(failure.races) == 2, text
    assert all(a.op.startswith("replay") and b.op.startswith("replay") for a, b, _ in
               failure.races), text
    assert races == {("replay", 0, 1), ("replay", 1, 0)}, text
    lines = re.findall(r"issued at .*test_schedule_search\.py:(\d+)", text)
    assert len(lines) == 4, text
    assert "writes handle" in text and "reads handle" in text
    # minimised: one switch away from a stream that could have run on is all the bug needs
    assert failure.preemptions[1] == 1 <= failure.preemptions[0], text
    again = search.run_once(planted, search.Planned(
        runtime.testing.decode_trace(failure.trace)))
    assert isinstance(again.error, AssertionError)


@pytest.mark.parametrize("seed", range(10))
def test_pct_finds_the_planted_depth_2_race_within_its_bound(seed):
    res = search.explore(planted, "pct", depth=2, seed=seed, runs=1000, raises=False)
    assert res.failure is not None
    bound = search.pct_runs(streams=2, steps=res.steps, depth=2, miss=1e-3)
    assert res.runs <= bound, (res, bound)
    if seed == 0:
        _check_report(res.failure)


def test_the_exhaustive_search_always_finds_the_planted_race():
    res = search.explore(planted, "exhaustive", raises=False)
    assert res.failure is not None and res.runs > 1
    _check_report(res.failure)


def refresh_then_replay(c):
    """The README's testing-kit bug: a loader stream refreshes x, a worker replays a graph over
    it with no event between them; the worker's read returns before the write runs."""
    loader, worker = c.with_stream(runtime.StreamId.new()), c.with_stream(runtime.StreamId.new())
    x, y = c.create(np.zeros(N, np.float32)), c.create(np.zeros(N, np.float32))
    c.sync()
    worker.graph_prepare()
    worker.start_capture()
    worker.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": N})
    g = worker.stop_capture()
    loader.write(x, np.full(N, 5, np.float32))      # the racing write
    g.replay()                                      # the racing replay
    assert worker.read(y).tolist() == [6.0] * N


def test_a_race_whose_write_never_ran_is_named_too():
    """USER5: the exhaustive search's first failing run of the README's bug replays before the
    loader's write ran, and the read returns before it runs at all: no two *executed* items
    race, so the report said "no racing kernel or copy accesses ran in this run: the failure
    comes from elsewhere". It now names the replay and the write that had not run yet."""
    res = search.explore(refresh_then_replay, "exhaustive", check=False, raises=False)
    assert res.failure is not None
    text = str(res.failure)
    assert "no racing kernel or copy accesses" not in text, text
    assert "racing accesses" in text and "had not run yet" in text, text
    (a, b, _), = res.failure.races
    assert a.op.startswith("replay") and b.op == "write" and b.ran is None, text
    lines = re.findall(r"issued at .*test_schedule_search\.py:(\d+)", text)
    assert len(lines) == 2, text


def test_the_correct_program_passes_every_interleaving_and_the_reduction_prunes_orders():
    reduced = search.explore(correct, "exhaustive")
    full = search.explore(correct, "exhaustive", reduce=False)
    assert reduced.complete and full.complete and reduced.failure is None
    assert 1 < reduced.runs < full.runs, (reduced, full)


def test_pct_bound_and_bad_arguments():
    assert search.pct_runs(2, 8, 2, miss=1e-3) == 111         # ln(1000) * 2 * 8
    assert search.pct_runs(3, 10, 1, miss=0.5) == 3
    with pytest.raises(ValueError):
        search.pct_runs(0, 8, 2)
    with pytest.raises(ValueError):
        search.explore(planted, "sideways")
    with pytest.raises(ValueError):
        search.PCTScheduler(0, depth=0)


PLUGIN_TEST = '''
import pytest
from test_schedule_search import planted, correct


@pytest.mark.interleavings(strategy="exhaustive", check=False)
def test_planted(runtime_client):
    planted(runtime_client)


@pytest.mark.interleavings(strategy="exhaustive", check=False)
def test_correct(runtime_client):
    correct(runtime_client)


@pytest.mark.interleavings(3, depth=3, check=False)
def test_pct_depth(runtime_client, runtime_variant):
    sched = runtime_client._server.backend.scheduler       # private: the scheduler the plugin chose
    assert type(sched).__name__ == "PCTScheduler" and sched.depth == 3
    assert runtime_variant.strategy == "pct"
'''


def test_the_plugin_runs_every_interleaving_and_reports_the_minimised_race(pytester):
    import pathlib
    pytester.syspathinsert(pathlib.Path(__file__).parent)
    pytester.makepyfile(test_user=PLUGIN_TEST)
    r = pytester.runpytest("-p", "runtime.testing.plugin", "--runtime-backends", "cpu", "-q")
    out = r.stdout.str()
    r.assert_outcomes(failed=1, passed=4)
    assert "test_planted[cpu-exhaustive]" in out and "ScheduleFailure" in out, out[-4000:]
    assert "racing accesses" in out and "test_schedule_search.py:" in out
    assert "every interleaving (exhaustive)" in out and "--runtime-trace" in out
