"""Property test of the stream-ordering checker: soundness against a sequential numpy model,
written on the public kit (``runtime.testing``).

``programs(..., contract=False)`` draws programs for 3 clients, each pinned to its own stream,
that may break the replay contract: create, write, launch, read, free, capture (with window
allocations), replay, release, sync and event waits, with no ordering added. Each program then
runs

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

from hypothesis import HealthCheck, given, settings, strategies as st

import runtime
from runtime import kernels as K
from runtime.testing import programs, run_program

SEEDS = range(6)
#: programs to generate; above 200 (a local soak) hypothesis also explores beyond its fixed seed
EXAMPLES = int(os.environ.get("RUNTIME_CHECKER_EXAMPLES", "200"))
N = 4
KERNELS = [K.copy, K.add, (K.add_scalar, {"alpha": st.integers(1, 3).map(float)}), K.accumulate]
STATS = {"programs": 0, "runs": 0, "flagged": 0, "flagged_diverged": 0, "passed": 0,
         "passed_diverged": 0, "seeds_per_program": len(SEEDS),
         "flagged_by_kind": {"race": 0, "liveness": 0},
         "diverged_by_kind": {"race": 0, "liveness": 0}}
RESULTS = pathlib.Path(os.environ.get("RUNTIME_RESULTS", pathlib.Path(__file__).parents[2]
                                      / "benchmarks" / "results")) / "checker_property.json"
racy_programs = programs(KERNELS, buffers=5, streams=3, clients=3, size=N, steps=25,
                         values={"f32": st.integers(-4, 4).map(float)}, contract=False)


def judge(program) -> None:
    checked = run_program(program, seed=0, check=True, raises=False)
    flag = checked.flagged
    if flag is None:
        assert not checked.mismatches, "the checked run diverged from the model:\n" + \
            checked.report()
    runs = [run_program(program, seed=s, raises=False) for s in SEEDS]
    diverged = [r.seed for r in runs if r.mismatches]
    STATS["programs"] += 1
    STATS["runs"] += 1 + len(runs)
    if flag is not None:
        kind = "liveness" if isinstance(flag, runtime.LivenessError) else "race"
        STATS["flagged"] += 1
        STATS["flagged_diverged"] += bool(diverged)
        STATS["flagged_by_kind"][kind] += 1
        STATS["diverged_by_kind"][kind] += bool(diverged)
    else:
        STATS["passed"] += 1
        STATS["passed_diverged"] += bool(diverged)
        assert not diverged, (f"the checker passed a program that diverged under seeds "
                              f"{diverged}:\n" + runs[diverged[0]].report())


def test_checker_is_sound_against_the_sequential_model():
    given(racy_programs)(settings(
        max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 200, database=None,
        suppress_health_check=list(HealthCheck))(judge))()
    flagged = STATS["flagged"]
    STATS["precision"] = round(STATS["flagged_diverged"] / flagged, 3) if flagged else None
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(STATS, indent=2) + "\n")
    print("\nchecker property test:", json.dumps(STATS))
    assert STATS["passed_diverged"] == 0
    assert flagged and STATS["flagged_diverged"], "no generated program exercised a violation"
