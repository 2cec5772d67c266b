"""Property test of the stream-ordering checker: soundness against a sequential numpy model.

A hypothesis state machine writes random programs for 2-3 clients, each pinned to its own
stream: create, write, launch, read, free, capture, replay, sync, and event waits. Each program
then runs

- once with ``check=True`` (flagged: the checker raised ``StreamRaceError``/``LivenessError``);
- without the checker under ``SEEDS`` interleaving seeds of the cpu backend (diverged: some
  seed's reads or final buffers differ from the model, which runs the program in issue order).

Soundness: a program the checker passes never diverges (nor does its checked run). Precision:
the share of flagged programs for which some seed really diverged; it is reported, with the
number of programs run, in ``benchmarks/results/checker_property.json`` and on stdout.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, precondition, rule,
                                 run_state_machine_as_test)

import runtime
from runtime import kernels as K

SEEDS = range(6)
#: programs to generate; above 200 (a local soak) hypothesis also explores beyond its fixed seed
EXAMPLES = int(os.environ.get("RUNTIME_CHECKER_EXAMPLES", "200"))
N = 4
#: name -> (kernel, number of handles, takes alpha)
KERNELS = {"copy": (K.copy, 2, False), "add": (K.add, 3, False),
           "add_scalar": (K.add_scalar, 2, True), "accumulate": (K.accumulate, 2, False)}
STATS = {"programs": 0, "runs": 0, "flagged": 0, "flagged_diverged": 0, "passed": 0,
         "passed_diverged": 0, "seeds_per_program": len(SEEDS),
         "flagged_by_kind": {"race": 0, "liveness": 0},
         "diverged_by_kind": {"race": 0, "liveness": 0}}
RESULTS = pathlib.Path(os.environ.get("RUNTIME_RESULTS", pathlib.Path(__file__).parent.parent
                                      / "benchmarks" / "results")) / "checker_property.json"

values = st.lists(st.integers(-4, 4), min_size=N, max_size=N)
#: a launch: kernel name, where its handles start among the live ones, alpha
launches = st.lists(st.tuples(st.sampled_from(sorted(KERNELS)), st.integers(0, 999),
                              st.integers(1, 3)), min_size=1, max_size=2)


def params(name, alpha):
    return {"alpha": float(alpha), "n": N} if KERNELS[name][2] else {"n": N}


def apply(model, name, hids, alpha):
    """Run one launch on the model's arrays (the cpu kernel itself, so aliasing matches)."""
    kernel, _, _ = KERNELS[name]
    kernel.cpu(*[model[h] for h in hids], count=(1, 1, 1), **params(name, alpha))


def execute(program, nstreams, seed, check):
    """Run ``program`` on a fresh interleaving server.

    Returns: ``(flag, observations)``: ``None``, ``"race"`` or ``"liveness"`` (what the checker
    raised first); the reads in order, then every live buffer at the end.
    """
    c = runtime.client("cpu", scheduler="interleave", seed=seed, check=check)
    try:
        cl = [c.with_stream(runtime.StreamId.new()) for _ in range(nstreams)]
        hs, gs, obs, live = {}, {}, [], []
        try:
            for op in program:
                kind = op[0]
                if kind == "create":
                    hs[op[2]] = cl[op[1]].create(np.array(op[3], np.float32))
                    live.append(op[2])
                elif kind == "write":
                    cl[op[1]].write(hs[op[2]], np.array(op[3], np.float32))
                elif kind == "launch":
                    _, s, name, hids, alpha = op
                    cl[s].launch(KERNELS[name][0], 1, [hs[h] for h in hids], params(name, alpha))
                elif kind == "read":
                    obs.append(cl[op[1]].read(hs[op[2]]))
                elif kind == "free":
                    hs[op[1]].release()
                    live.remove(op[1])
                elif kind == "capture":
                    _, s, gid, recorded, tmp = op
                    cl[s].graph_prepare()
                    cl[s].start_capture()
                    if tmp is not None:      # allocated in the window: the graph retains it
                        hs[tmp] = cl[s].empty(N, np.float32)
                    for name, hids, alpha in recorded:
                        cl[s].launch(KERNELS[name][0], 1, [hs[h] for h in hids],
                                     params(name, alpha))
                    gs[gid] = cl[s].stop_capture()
                    if tmp is not None:
                        hs.pop(tmp).release()
                elif kind == "replay":
                    gs[op[1]].replay()
                elif kind == "release_graph":
                    gs.pop(op[1]).release()
                elif kind == "sync":
                    cl[op[1]].sync()
                elif kind == "event":
                    cl[op[2]].wait_event(cl[op[1]].record_event())
            for x in cl:
                x.sync()
            obs.extend(cl[0].read(hs[h]) for h in live)
        except (runtime.StreamRaceError, runtime.LivenessError) as e:
            if not check and not isinstance(e, runtime.LivenessError):
                raise                   # a replay after a free raises even without the checker
            return ("liveness" if isinstance(e, runtime.LivenessError) else "race"), None
        if check:
            assert c._server.checker.violations == []
        return None, obs
    finally:
        STATS["runs"] += 1
        c.shutdown()


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


class CheckerMachine(RuleBasedStateMachine):
    """Builds one program step by step, with its sequential model; runs it in ``teardown``."""

    @initialize(nstreams=st.integers(2, 3), first=st.lists(
        st.tuples(st.integers(0, 2), values), min_size=3, max_size=3))
    def setup(self, nstreams, first):
        self.n = nstreams
        self.program = []
        self.model = {}           # handle index -> float32[N], kept after a free (private)
        self.live = []
        self.graphs = {}          # live graph index -> recorded launches (handle indices)
        self.ngraphs = 0
        self.expected = []
        for s, vals in first:
            self.create(s, vals)

    def _h(self, i):
        return self.live[i % len(self.live)]

    def _bind(self, name, start):
        """Consecutive live handles from ``start``; None when too few are alive to keep them
        distinct (a buffer bound read and read_write in one launch is refused)."""
        hids = [self._h(start + k) for k in range(KERNELS[name][1])]
        return hids if len(set(hids)) == len(hids) else None

    @rule(s=st.integers(0, 2), vals=values)
    def create(self, s, vals):
        h = len(self.model)
        self.model[h] = np.array(vals, np.float32)
        self.live.append(h)
        self.program.append(("create", s % self.n, h, vals))

    @precondition(lambda self: self.live)
    @rule(s=st.integers(0, 2), i=st.integers(0, 999), vals=values)
    def write(self, s, i, vals):
        h = self._h(i)
        self.model[h][:] = vals
        self.program.append(("write", s % self.n, h, vals))

    @precondition(lambda self: self.live)
    @rule(s=st.integers(0, 2), launch=launches)
    def launch(self, s, launch):
        name, start, alpha = launch[0]
        hids = self._bind(name, start)
        if hids is None:
            return
        apply(self.model, name, hids, alpha)
        self.program.append(("launch", s % self.n, name, hids, alpha))

    @precondition(lambda self: self.live)
    @rule(s=st.integers(0, 2), i=st.integers(0, 999))
    def read(self, s, i):
        h = self._h(i)
        self.expected.append(self.model[h].copy())
        self.program.append(("read", s % self.n, h))

    @precondition(lambda self: len(self.live) > 1)
    @rule(i=st.integers(0, 999))
    def free(self, i):
        h = self._h(i)
        self.live.remove(h)
        self.program.append(("free", h))

    @precondition(lambda self: self.live)
    @rule(s=st.integers(0, 2), recorded=launches, via_tmp=st.booleans(), i=st.integers(0, 999))
    def capture(self, s, recorded, via_tmp, i):
        rec = [(name, self._bind(name, start), alpha) for name, start, alpha in recorded]
        rec = [r for r in rec if r[1] is not None]
        gid = self.ngraphs
        self.ngraphs += 1
        tmp = None
        if via_tmp:
            # a scratch buffer allocated in the window and released by the caller after
            # stop_capture: the graph retains it, so replays stay live
            tmp = ("tmp", gid)
            self.model[tmp] = np.zeros(N, np.float32)
            rec = ([("copy", [self._h(i), tmp], 1)] + rec
                   + [("accumulate", [tmp, self._h(i + 1)], 1)])
        self.graphs[gid] = rec
        self.program.append(("capture", s % self.n, gid, rec, tmp))

    @precondition(lambda self: self.graphs)
    @rule(i=st.integers(0, 999))
    def replay(self, i):
        gid = sorted(self.graphs)[i % len(self.graphs)]
        for name, hids, alpha in self.graphs[gid]:
            apply(self.model, name, hids, alpha)
        self.program.append(("replay", gid))

    @precondition(lambda self: self.graphs)
    @rule(i=st.integers(0, 999))
    def release_graph(self, i):
        gid = sorted(self.graphs)[i % len(self.graphs)]
        del self.graphs[gid]
        self.program.append(("release_graph", gid))

    @rule(s=st.integers(0, 2))
    def sync(self, s):
        self.program.append(("sync", s % self.n))

    @rule(src=st.integers(0, 2), dst=st.integers(0, 2))
    def event(self, src, dst):
        self.program.append(("event", src % self.n, dst % self.n))

    def teardown(self):
        if not getattr(self, "program", None):
            return
        expected = self.expected + [self.model[h] for h in self.live]
        flagged, obs = execute(self.program, self.n, 0, check=True)
        if not flagged:
            assert same(obs, expected), "the checked run diverged from the model"
        runs = [execute(self.program, self.n, s, check=False)[1] for s in SEEDS]
        diverged = [s for s, got in zip(SEEDS, runs) if got is not None and not same(got, expected)]
        STATS["programs"] += 1
        if flagged:
            STATS["flagged"] += 1
            STATS["flagged_diverged"] += bool(diverged)
            STATS["flagged_by_kind"][flagged] += 1
            STATS["diverged_by_kind"][flagged] += bool(diverged)
        else:
            STATS["passed"] += 1
            STATS["passed_diverged"] += bool(diverged)
            assert not diverged, (f"the checker passed a program that diverged under seeds "
                                  f"{diverged}: {self.program}")


def test_checker_is_sound_against_the_sequential_model():
    run_state_machine_as_test(CheckerMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=25, deadline=None, derandomize=EXAMPLES <= 200,
        database=None, suppress_health_check=list(HealthCheck)))
    flagged = STATS["flagged"]
    STATS["precision"] = round(STATS["flagged_diverged"] / flagged, 3) if flagged else None
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(STATS, indent=2) + "\n")
    print("\nchecker property test:", json.dumps(STATS))
    assert STATS["passed_diverged"] == 0
    assert flagged and STATS["flagged_diverged"], "no generated program exercised a violation"
