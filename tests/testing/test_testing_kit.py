"""runtime.testing: recorded schedules, the sequential model, shrinking, the printed program.

The reference is a hand-written program with a missing ``wait_event`` (a graph on stream 1
replays over an input stream 2 refreshes) and the same program with the wait: the first must
give wrong data for some seeds and not others, the second the model's data for every seed.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings, strategies as st

import runtime
from runtime import kernels as K
from runtime.backends.cpu import CpuBackend, decode_trace, encode_trace
from runtime.server.server import ComputeServer
from runtime.testing.model import Model
from runtime.testing.strategies import Builder, config
from runtime.testing import (Create, Launch, Prepare, Program, ProgramMismatch, Read, RecordEvent,
                             Replay, StartCapture, StopCapture, Sync, WaitEvent, Write, KernelSpec,
                             programs, run_program)

SEEDS = range(20)
SPECS = (KernelSpec(K.add_scalar, {"alpha": 1.0}),)
ONES, FIVES = (1.0,) * 4, (5.0,) * 4


def refresh_then_replay(wait: bool) -> Program:
    """x on stream 0; a graph on stream 1 computes y = x + 1; stream 2 refreshes x; replay.

    (The refresh comes from a third stream: the first replay waits for what the creating
    stream had pending at record time, up to that stream's latest work.)"""
    launch = Launch(1, 0, (0, 1), (("alpha", 1.0), ("n", 4)))
    ops = [Create(0, 0, "f32", ONES), Create(0, 1, "f32", ONES), Sync(0),
           Prepare(1), StartCapture(1), launch, StopCapture(1, 0), Write(2, 0, "f32", FIVES)]
    if wait:
        ops += [RecordEvent(2, 0), WaitEvent(1, 0)]
    ops += [Replay(1, 0), Read(1, 1)]
    return Program(tuple(ops), (Sync(0), Sync(1), Sync(2)), SPECS, 4, 3, 3, contract=wait)


def test_a_missing_wait_gives_wrong_data_for_some_seeds_and_a_trace_replays_it_exactly():
    prog = refresh_then_replay(wait=False)
    runs = [run_program(prog, seed=s, raises=False) for s in SEEDS]
    wrong = [r for r in runs if r.mismatches]
    assert wrong and len(wrong) < len(runs), "the schedule must decide the outcome"
    assert all(r.reads[-1].tolist() == [2.0] * 4 for r in wrong)      # the stale x + 1
    for r in runs[:6]:
        again = run_program(prog, trace=r.trace, raises=False)
        assert again.diverged == 0 and again.trace == r.trace
        np.testing.assert_array_equal(again.reads[-1], r.reads[-1])
        assert bool(again.mismatches) == bool(r.mismatches)


def test_the_correct_program_passes_every_seed_with_and_without_the_checker():
    prog = refresh_then_replay(wait=True)
    for s in SEEDS:
        run = run_program(prog, seed=s, check=s % 2 == 0)
        assert run.flagged is None
        np.testing.assert_array_equal(run.reads[-1], np.full(4, 6, np.float32))


def test_the_checker_flags_the_missing_wait_and_the_report_names_seed_and_schedule():
    run = run_program(refresh_then_replay(wait=False), seed=3, check=True, raises=False)
    assert isinstance(run.flagged, runtime.StreamRaceError)
    prog = dataclasses.replace(refresh_then_replay(wait=False), contract=True)   # claimed correct: a mismatch
    with pytest.raises(ProgramMismatch) as info:
        run_program(prog, seed=3, check=True)
    text = str(info.value)
    assert "seed 3" in text and "schedule (trace)" in text and "g0.replay()  # MISMATCH" in text


def test_the_printed_program_runs_as_written_and_reads_what_the_run_read():
    prog = refresh_then_replay(wait=False)
    for s in SEEDS:
        run = run_program(prog, seed=s, raises=False)
        if run.mismatches:
            break
    ns: dict = {}
    exec(prog.to_python(seed=s), ns)                  # noqa: S102 - the point of the test
    try:
        np.testing.assert_array_equal(ns["c1"].read(ns["b1"]), run.reads[-1])
    finally:
        ns["c"].shutdown()


def test_a_trace_that_no_longer_fits_is_followed_where_it_can_and_counts_the_divergence():
    prog = refresh_then_replay(wait=True)
    run = run_program(prog, trace="7*3,0", raises=True)      # stream 7 never exists
    assert run.diverged >= 3
    np.testing.assert_array_equal(run.reads[-1], np.full(4, 6, np.float32))


def test_traces_encode_compactly_and_bad_ones_are_refused():
    assert encode_trace([0, 0, 0, 1, 0, 0]) == "0*3,1,0*2"
    assert decode_trace("0*3,1,0*2") == [0, 0, 0, 1, 0, 0]
    for bad in ("a", "1*", "-1", "1*x"):
        with pytest.raises(ValueError):
            decode_trace(bad)
    with pytest.raises(TypeError):
        decode_trace(3.5)
    with pytest.raises(ValueError):
        CpuBackend(scheduler="trace")                     # a trace scheduler needs its trace
    with pytest.raises(ValueError):
        CpuBackend(scheduler="interleave", trace="0")
    with pytest.raises(ValueError):
        run_program(refresh_then_replay(True), backend="wgpu", trace="0")


def test_programs_refuses_bad_kernels_and_sizes():
    with pytest.raises(ValueError):
        programs([])
    with pytest.raises(ValueError, match=r"KernelSpec\(add_scalar, \{'alpha': \.\.\.\}\)"):
        programs([K.add_scalar])                          # alpha has no value: says how
    with pytest.raises(ValueError):
        programs([(K.copy, {"beta": 1})])
    with pytest.raises(TypeError):
        programs(["copy"])
    with pytest.raises(ValueError):
        programs([K.copy], buffers=0)
    wgsl_only = runtime.Kernel("w", [runtime.Binding("y", "f32", "read_write")], wgsl="x")
    with pytest.raises(ValueError):
        programs([wgsl_only])


def test_generated_programs_use_every_call_and_pass():
    seen = set()
    ks = [(K.add_scalar, {"alpha": 1.5}), K.copy, K.add]

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(programs(ks, streams=2, clients=3))
    def one(prog):
        seen.update(type(op).__name__ for op in prog.ops)
        run_program(prog, seed=len(seen), threads=False)
    one()
    assert {"Create", "Launch", "Read", "Write", "Free", "Sync", "RecordEvent", "WaitEvent",
            "Prepare", "StartCapture", "StopCapture", "Replay", "Release", "Clone",
            "Empty", "CreateFlag", "CaptureIf", "CaptureWhile", "Update", "UpdateCount",
            "PreparePool"} <= seen, seen


def test_shrinking_reduces_a_planted_missing_dependency_to_a_few_calls(monkeypatch):
    # the planted bug: the server forgets the event waits between streams
    monkeypatch.setattr(ComputeServer, "_wait_for", lambda self, s, fences: None)

    def diverges(prog):
        return any(run_program(prog, seed=s, threads=False, raises=False).mismatches
                   for s in range(6))
    small = find(programs([K.copy], buffers=3, steps=8, capture=False), diverges,
                 settings=settings(max_examples=100, deadline=None, database=None,
                                   derandomize=True, suppress_health_check=list(HealthCheck)))
    print("\nshrunk:\n" + small.to_python())
    assert len(small) <= 4, small.to_python()


def _always_fails(x, y, *, n, count):
    raise ValueError("always fails")


ALWAYS_FAILS = runtime.Kernel("always_fails", [("x", "f32", "read"), ("y", "f32", "read_write")],
                              [("n", "u32")], cpu=_always_fails)


class Scripted(Builder):
    """The program builder with its choices given in order (``pick``, ``flag`` and ``draw``
    each take the next one): a hand-written path through ``programs()``."""

    def __init__(self, cfg, script):
        super().__init__(lambda strategy: self.script.pop(0), cfg)
        self.script = list(script)

    def pick(self, seq):
        choice = self.script.pop(0)
        assert choice in list(seq), (choice, list(seq))
        return choice

    def flag(self):
        return self.script.pop(0)

    def values(self, dtype):
        return (1.0,) * self.cfg["size"]


def test_calls_meant_for_a_window_that_did_not_open_are_ordered_like_eager_calls():
    """A failed warm-up makes ``start_capture`` raise: the calls the builder meant for the
    window then run eagerly (a launch, a 'refused' replay). The builder must order them as if
    they ran (issue 17: the checker flagged such contract programs, which raced for real)."""
    cfg = config([K.copy, ALWAYS_FAILS], buffers=4, streams=2, clients=2, steps=30,
                 failures=True)
    copy, fails = 0, 1
    b = Scripted(cfg, [])
    for _ in range(3):                            # b0, b1, b2 on stream 0
        b.script += [0, "f32"]
        b.create()
    # g0 on stream 1: copy(b0 -> b1), no feed-back, no conditional node, no warm-up
    b.script += [1, 1, copy, 0, 1, False, False, False]
    b.capture()
    b.script += [1]
    b.end()
    b.script += [0, 1, True]                      # replay g0 once, after a sync of stream 0
    b.replay()
    b.script += [0, 1, fails, 0, 2, False, False, True]  # stream 0: a warm-up that fails
    b.capture()
    b.script += [0, copy, 0, 1]                   # meant for the window: copy(b0 -> b1)
    b.launch()                                    # ...runs eagerly, over g0's pending write
    b.script += [0]
    b.end()
    b.script += [0, 1, True]                      # g0 on stream 1, again
    b.replay()
    b.script += [1]
    b.sync()
    b.script += [1, 1, fails, 0, 2, False, False, True]  # stream 1: a warm-up that fails
    b.capture()
    b.script += [0, copy, 1, 0]                   # stream 0 copies b1 -> b0 (g0 reads b0)
    b.launch()
    b.script += [0]                               # g0, 'refused' inside the window: it runs,
    b.replay()                                    # over stream 0's copy
    assert not b.script
    prog = b.program()
    assert sum(isinstance(op, Replay) for op in prog.ops) == 3
    for s in range(4):
        run = run_program(prog, seed=s, check=True)
        assert run.flagged is None




def test_a_graph_whose_input_was_freed_is_not_replayed_even_inside_a_window():
    """The 'refused' replay inside a window runs when the window did not open: the builder
    replays no graph whose caller-owned input was freed, inside a window or not (issue 17: the
    run raised LivenessError in a contract program)."""
    cfg = config([K.copy, ALWAYS_FAILS], buffers=4, streams=2, clients=2, steps=30,
                 failures=True)
    copy, fails = 0, 1
    b = Scripted(cfg, [])
    for _ in range(3):
        b.script += [0, "f32"]
        b.create()
    b.script += [1, 1, copy, 0, 1, False, False, False, 1]  # g0 on stream 1: copy(b0 -> b1)
    b.capture()
    b.end()
    b.script += [0, 0]                            # free b0 (from client 0)
    b.free()
    b.script += [1, 1, fails, 1, 2, False, False, True]  # stream 1: a warm-up that fails
    b.capture()
    b.script += [0]
    b.replay()                                    # g0 is not replayed
    assert not b.script
    prog = b.program()
    assert not any(isinstance(op, Replay) for op in prog.ops)
    run_program(prog, seed=0, check=True)


def test_the_model_expects_a_failure_to_propagate_to_what_is_computed_from_it():
    """A launch reading a buffer whose writer failed (through a ``read`` binding) marks what it
    writes: a read of that must raise ``ReplayFailed`` (the model used to accept any answer),
    and the failing stream's next blocking call raises the ``LaunchError``."""
    specs = (KernelSpec(ALWAYS_FAILS), KernelSpec(K.add_scalar, {"alpha": 1.0}))
    n = (("n", 4),)
    ops = (Create(0, 0, "f32", ONES), Create(0, 1, "f32", ONES), Create(0, 2, "f32", ONES),
           Launch(0, 0, (0, 1), n),                    # fails: marks b1
           Launch(1, 1, (1, 2), (("alpha", 1.0),) + n),  # another stream reads b1: marks b2
           Read(1, 2), Read(0, 0))
    prog = Program(ops, (Sync(0), Sync(1)), specs, 4, 2, 2)
    for s in range(4):
        run = run_program(prog, seed=s, check=True)
        stale, first = run.reads
        assert isinstance(stale, runtime.ReplayFailed) and not isinstance(stale, runtime.LaunchError)
        assert isinstance(first, runtime.LaunchError)  # stream 0 raises its own failure
    model = Model(prog)
    for op in ops[:5]:
        assert model.step(op, None, None) is None
    assert "must raise ReplayFailed" in model.step(ops[5], np.full(4, 2, np.float32), None)


def test_the_schedulers_live_in_their_own_module_and_the_old_import_paths_still_work():
    from runtime.backends import cpu, cpu_schedule
    for name in ("Scheduler", "ThreadScheduler", "InterleavingScheduler", "TraceScheduler",
                 "encode_trace", "decode_trace"):
        assert getattr(cpu, name) is getattr(cpu_schedule, name)
    assert runtime.testing.encode_trace is cpu_schedule.encode_trace
    be = cpu.CpuBackend(scheduler="trace", trace="0*2")
    assert isinstance(be.scheduler, cpu_schedule.TraceScheduler)
    be.close()


def _scale_zeroes_x(x, y, *, n, count):
    y[:n] = 2 * x[:n]
    x[:n] = 0                       # writes x, declared "read": every launch of it fails


_scale = runtime.Kernel("scale", [("x", "f32", "read"), ("y", "f32", "read_write")],
                        [("n", "u32")], cpu=_scale_zeroes_x)


def test_hypothesis_prints_the_falsifying_program_as_its_failing_run_opened_the_client():
    """ADV4 (a new user's nit): hypothesis prints the falsifying example (``repr(program)``)
    before its final run, and it opened ``runtime.client('cpu', ..., seed=0)``: without
    ``check=True`` and with another seed than the failing run's, so pasting it ran without the
    happens-before checker. Now it opens the client as a failing run of that program did."""
    import re

    @settings(max_examples=50, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(programs(kernels=[_scale, K.accumulate], streams=2, capture=False),
           st.integers(3, 100))
    def property_test(program, seed):
        run_program(program, seed=seed, check=True, threads=False)

    with pytest.raises(ProgramMismatch) as info:
        property_test()
    text = "\n".join(getattr(info.value, "__notes__", []))
    # (hypothesis 6.155 says "Falsifying example", 6.170 "Failing test case")
    assert "Falsifying example" in text or "Failing test case" in text, text
    printed = re.findall(r"runtime\.client\((.*)\)", text)
    assert printed, text
    seed = re.search(r"with seed (\d+)", str(info.value)).group(1)
    assert printed[-1] == f"'cpu', scheduler='interleave', seed={seed}, check=True", text


def test_a_kernel_writing_a_binding_it_declared_read_is_named_even_when_the_values_do_not_change():
    """USER5 (the README's testing-kit example): the cpu backend hands a ``read`` binding to the
    body as a read-only view, so the launch fails however the values come out; the model ran
    the body on writable copies and compared values, so on zeros (``x = 0`` leaves zeros) it
    expected success and the report said only "sync raised ServerUnhealthy ... the model says it
    succeeds". The model now gives the body read-only views as the backend does and names the
    binding and the fix."""
    zeros = (0.0,) * 4
    prog = Program((Create(0, 0, "f32", zeros), Create(0, 1, "f32", zeros),
                    Launch(0, 0, (0, 1), (("n", 4),))), (Sync(0),),
                   (KernelSpec(_scale, {}),), 4, 1, 1)
    with pytest.raises(ProgramMismatch) as info:
        run_program(prog, seed=0, check=True)
    text = str(info.value)
    assert "kernel scale writes binding x, declared 'read'" in text, text
    assert "declare it 'read_write'" in text, text
    assert "call 2" in text, text                     # the launch, not the sync after it


def _fails_below(x, y, *, n, count):
    if (x[:n] < -6).any():
        raise ValueError("an input below -6")
    y[:n] = 2 * x[:n]


#: ``y = 2x`` (``y`` read_write), failing on an input below -6
FAILING = runtime.Kernel("fails_below", [("x", "f32", "read"), ("y", "f32", "read_write")],
                         [("n", "u32")], cpu=_fails_below)


@pytest.mark.parametrize("shape", ["zero-count", "untaken-branch"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_model_counts_a_source_of_unknown_state_as_perhaps_marked(shape, seed):
    """A kernel run on a buffer of unknown contents (here: never written) may fail, so what it
    writes has unknown contents *and may be marked*. A graph that reads that buffer only through
    a launch that runs nothing (a count updated to 0) or inside a branch not taken still counts
    it as a source (``runtime.server.capture.sources``: which launches ran is decided on the
    device), so a replay marks its whole write set when it was marked: the model must accept
    ``ReplayFailed`` for every buffer the graph writes. (ADV4's interleaving soak found it: the
    model said the read of an unrelated output of such a graph succeeds; the server's
    ReplayFailed is right, docs/contract.md section 4b.)"""
    from runtime.testing import CaptureIf, CreateFlag, Empty, UpdateCount
    specs = (KernelSpec(K.add_scalar, {"alpha": 1.5}), KernelSpec(FAILING))
    n = (("n", 4),)
    ops = [Create(0, 0, "f32", (0.0, 0.0, 0.0, -7.0)), Empty(0, 1, "f32"),
           Create(0, 2, "f32", ONES), Create(0, 3, "f32", ONES), Create(0, 4, "f32", ONES),
           Sync(0), Prepare(0), StartCapture(0)]
    reader = Launch(0, 0, (1, 3), (("alpha", 1.5),) + n)       # reads b1 (unknown contents)
    if shape == "zero-count":
        ops += [reader]
    else:
        ops = ops[:5] + [CreateFlag(0, 5, 0)] + ops[5:] + [CaptureIf(0, 5, (reader,), ())]
    ops += [Launch(0, 0, (2, 4), (("alpha", 1.5),) + n),        # b4 = b2 + 1.5: a clean output
            StopCapture(0, 0)]
    if shape == "zero-count":
        ops += [UpdateCount(0, 0, 0, 0, 1, 1)]
    ops += [Launch(0, 1, (0, 1), n),                            # fails: b1 marked
            Replay(0, 0)]
    prog = Program(tuple(ops), (Sync(0), Read(0, 4), Read(0, 3)), specs, 4, 1, 1)
    run = run_program(prog, seed=seed, raises=False)
    assert not run.mismatches, run.report()
    assert isinstance(run.reads[0], runtime.ReplayFailed)      # the server marks b4 (right)


def test_the_model_expects_a_graph_reading_past_its_partial_write_to_inherit_a_failure():
    """A graph that writes half of ``b1`` (``n = 2`` of 4) and then copies all of it into
    ``b0`` reads the half a failed writer left: ``b0`` must raise ``ReplayFailed`` (ADV7: the
    server hid the read behind the partial write and ``b0`` read back a value; the model
    follows ``Kernel.touched_bytes``), and ``b1`` keeps its mark (a write over part of it)."""
    specs = (KernelSpec(ALWAYS_FAILS), KernelSpec(K.add_scalar, {"alpha": 1.0}),
             KernelSpec(K.copy))
    ops = (Create(0, 0, "f32", ONES), Create(0, 1, "f32", ONES), Create(0, 2, "f32", ONES),
           Launch(0, 0, (0, 1), (("n", 4),)),          # fails: marks b1
           Sync(0), Prepare(0), StartCapture(0),
           Launch(0, 1, (2, 1), (("alpha", 1.0), ("n", 2))),    # half of b1
           Launch(0, 2, (1, 0), (("n", 4),)),                   # all of b1 into b0
           StopCapture(0, 0), Replay(0, 0), Read(0, 0), Read(0, 1))
    prog = Program(ops, (Sync(0),), specs, 4, 1, 1)
    for s in range(3):
        run = run_program(prog, seed=s, check=True)
        assert all(isinstance(r, runtime.ReplayFailed) for r in run.reads[-2:]), run.reads
    model = Model(prog)
    for op in ops[:11]:
        model.step(op, None, runtime.LaunchError("x") if isinstance(op, Sync) else None)
    assert "must raise ReplayFailed" in model.step(ops[11], np.full(4, 2, np.float32), None)


def test_programs_draw_partial_writes_and_graphs_that_read_past_them():
    """``programs()`` draws launches whose ``n`` covers part of their buffers and capture
    windows that copy all of such a buffer after writing part of it (``partial=True``, the
    default; ADV7)."""
    def read_past(prog):
        ops = list(prog.ops)
        for i, op in enumerate(ops):
            if isinstance(op, Launch) and dict(op.params).get("n", 8) < 8:
                later = ops[i + 1:]
                if any(isinstance(o, Launch) and o.bufs[0] == op.bufs[-1]
                       and dict(o.params).get("n") == 8 for o in later[:3]) and any(
                        isinstance(o, StopCapture) for o in later):
                    return True
        return False
    found = []

    @settings(max_examples=100, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(programs([(K.add_scalar, {"alpha": 1.5}), K.copy], buffers=3, steps=12))
    def draw(prog):
        if read_past(prog):
            found.append(prog)
    draw()
    assert found, "no program wrote part of a buffer and then read all of it in a window"
    run_program(found[0], seed=0, check=True)


def _both_branches_program() -> Program:
    """``b1``'s writer fails; a graph rewrites ``b1`` in both branches of a ``capture_if`` with
    an else (``b1 = b0 + 1`` or ``b0 + 2``), then ``b2 = b1 + 1`` after the node; replays with
    the condition 1, then 0, each read back."""
    from runtime.testing import CaptureIf, CreateFlag
    specs = (KernelSpec(ALWAYS_FAILS), KernelSpec(K.add_scalar, {"alpha": 1.0}),
             KernelSpec(K.add_scalar, {"alpha": 2.0}))
    n = (("n", 4),)
    ops = (Create(0, 0, "f32", ONES), Create(0, 1, "f32", ONES), Create(0, 2, "f32", ONES),
           CreateFlag(0, 3, 1),
           Launch(0, 0, (0, 1), n),                             # fails: marks b1
           Sync(0), Prepare(0), StartCapture(0),
           CaptureIf(0, 3, (Launch(0, 1, (0, 1), (("alpha", 1.0),) + n),),
                     (Launch(0, 2, (0, 1), (("alpha", 2.0),) + n),)),
           Launch(0, 1, (1, 2), (("alpha", 1.0),) + n),
           StopCapture(0, 0), Replay(0, 0), Read(0, 1), Read(0, 2),
           Write(0, 3, "i32", (0,)), Replay(0, 0), Read(0, 1), Read(0, 2))
    return Program(ops, (Sync(0),), specs, 4, 1, 1)


def test_the_model_expects_a_buffer_both_branches_write_to_recover_with_the_next_replay():
    """A buffer both branches of an if with an else rewrite is written whichever runs: a
    replay clears its failure and it is no source of what the graph computes after the node
    (ADV8: the server kept it marked for good, and ``b2`` failed on every replay, though each
    rewrote both from clean data; the model follows ``capture.maybe_written``/``sources``)."""
    prog = _both_branches_program()
    for s in range(3):
        run = run_program(prog, seed=s, check=True)
        np.testing.assert_array_equal(run.reads[0], np.full(4, 2, np.float32))
        np.testing.assert_array_equal(run.reads[1], np.full(4, 3, np.float32))
        np.testing.assert_array_equal(run.reads[2], np.full(4, 3, np.float32))
        np.testing.assert_array_equal(run.reads[3], np.full(4, 4, np.float32))
    model = Model(prog)
    for op in prog.ops[:12]:
        model.step(op, None, runtime.LaunchError("x") if isinstance(op, Sync) else None)
    assert model.step(prog.ops[12], None, runtime.ReplayFailed("stale")) is not None


def test_programs_draw_branches_that_both_write_one_buffer():
    """``programs()`` draws ``capture_if`` nodes whose else branch writes the buffer the then
    branch's last launch writes (ADV8's shape)."""
    from runtime.testing import CaptureIf
    found = []

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(programs([(K.add_scalar, {"alpha": 1.5}), K.copy], buffers=3, steps=20))
    def draw(prog):
        for op in prog.ops:
            if isinstance(op, CaptureIf) and op.then and op.other and \
                    op.then[-1].bufs[-1] == op.other[-1].bufs[-1]:
                found.append(prog)
                return
    draw()
    assert found, "no program wrote one buffer in both branches of a capture_if"
    run_program(found[0], seed=0, check=True)


def test_the_model_expects_an_indirect_launch_to_inherit_its_counts_failure():
    """An indirect launch whose count buffer was computed from a failed buffer (``set_counts``
    reading it) computed from failed data: what it writes must raise ``ReplayFailed`` (ADV8:
    the server took only the read bindings' marks, and ``b2`` read back a value); a count of
    0 runs nothing and leaves what it writes as it was."""
    from runtime.testing import LaunchIndirect, set_counts
    specs = (KernelSpec(ALWAYS_FAILS), KernelSpec(K.add_scalar, {"alpha": 1.0}),
             KernelSpec(set_counts, {"x": 0}))
    n = (("n", 4),)
    ops = (Create(0, 0, "f32", ONES), Create(0, 1, "f32", ONES), Create(0, 2, "f32", ONES),
           Create(0, 3, "u32", (1, 1, 1, 1)),
           LaunchIndirect(0, 1, (0, 2), (("alpha", 1.0),) + n, 3),   # b2 = b0 + 1
           Read(0, 2),
           Launch(0, 0, (0, 1), n),                                    # fails: marks b1
           Sync(0),
           Launch(0, 2, (1, 3), (("x", 1),)),                          # counts from b1
           LaunchIndirect(0, 1, (0, 2), (("alpha", 1.0),) + n, 3),
           Read(0, 2),
           Write(0, 3, "u32", (0, 1, 1, 1)), Write(0, 2, "f32", FIVES),
           LaunchIndirect(0, 1, (0, 2), (("alpha", 1.0),) + n, 3),   # count 0: b2 stays 5
           Read(0, 2))
    prog = Program(ops, (Sync(0),), specs, 4, 1, 1)
    assert "c0.launch(K.add_scalar, b3, [b0, b2]" in prog.to_python()
    for s in range(3):
        run = run_program(prog, seed=s, check=True)
        np.testing.assert_array_equal(run.reads[0], np.full(4, 2, np.float32))
        assert isinstance(run.reads[1], runtime.ReplayFailed), run.reads
        np.testing.assert_array_equal(run.reads[2], np.full(4, 5, np.float32))
    model = Model(prog)
    for op in ops[:10]:
        model.step(op, np.full(4, 2, np.float32) if isinstance(op, Read) else None,
                   runtime.LaunchError("x") if isinstance(op, Sync) else None)
    assert "must raise ReplayFailed" in model.step(ops[10], np.full(4, 2, np.float32), None)


def test_programs_draw_indirect_launches_over_counts_computed_from_other_buffers():
    """``programs(indirect=True)`` draws indirect launches whose counts ``set_counts`` wrote
    from an f32 buffer first (ADV8's shape), and such programs match the model."""
    from runtime.testing import LaunchIndirect
    found = []

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(programs([(K.add_scalar, {"alpha": 1.5}), K.copy], buffers=3, steps=30,
                    indirect=True))
    def draw(prog):
        names = [type(op).__name__ for op in prog.ops]
        if "LaunchIndirect" in names and any(
                isinstance(op, Launch) and prog.kernels[op.kernel].kernel.name == "set_counts"
                for op in prog.ops):
            found.append(prog)
    draw()
    assert found, "no program launched indirectly over counts set_counts wrote"
    assert any(isinstance(op, LaunchIndirect) for op in found[0].ops)
    for prog in found[:5]:
        run_program(prog, seed=0, check=True)


def test_the_model_expects_a_create_refused_inside_a_window_to_raise_until_written():
    """``create(values)`` inside a capture window: its write is refused late and not applied,
    so the buffer holds no data: the model marks it (ADV9: the server read back the pool's old
    bytes with no error, from the capture stream and another one, once ``stop_capture`` had
    raised); a write to a buffer made before the window leaves it as it was."""
    ops = (Create(0, 0, "f32", ONES), Sync(0), Prepare(0), StartCapture(0),
           Create(0, 1, "f32", FIVES), Write(0, 0, "f32", FIVES), StopCapture(0, 0),
           Read(1, 1), Read(0, 1), Read(1, 0), Write(1, 1, "f32", FIVES), Read(1, 1))
    prog = Program(ops, (Sync(0), Sync(1)), SPECS, 4, 2, 2)
    for s in range(3):
        run = run_program(prog, seed=s, check=True)
        assert [type(r) for r in run.reads[:2]] == [runtime.ReplayFailed] * 2, run.reads
        np.testing.assert_array_equal(run.reads[2], np.ones(4, np.float32))
        np.testing.assert_array_equal(run.reads[3], np.full(4, 5, np.float32))


def test_the_model_expects_an_eager_loop_stopped_by_an_error_to_mark_what_it_wrote():
    """An eager ``capture_while`` whose body's launch fails (at execution) stops at the next
    condition read, which raises: what the loop wrote is marked, as at its limit (ADV9: the
    server left one iteration's values of a three-iteration loop readable with no error)."""
    from runtime.testing import CaptureWhile, CreateFlag, count_down, set_counter
    specs = (KernelSpec(K.add_scalar, {"alpha": 1.0}), KernelSpec(ALWAYS_FAILS),
             KernelSpec(set_counter), KernelSpec(count_down))
    n = (("n", 4),)
    init = Launch(0, 2, (3,), (("value", 3),))
    body = (Launch(0, 3, (3,), ()), Launch(0, 0, (0, 1), (("alpha", 1.0),) + n),
            Launch(0, 1, (0, 2), n))
    ops = (Create(0, 0, "f32", ONES), Create(0, 1, "f32", ONES), Create(0, 2, "f32", ONES),
           CreateFlag(0, 3, 0), Sync(0), CaptureWhile(0, 3, (init,), body, 5), Read(1, 1),
           Write(1, 1, "f32", FIVES), Read(1, 1))
    prog = Program(ops, (Sync(0), Sync(1)), specs, 4, 2, 2)
    for s in range(3):
        run = run_program(prog, seed=s, check=True)
        assert isinstance(run.reads[0], runtime.ReplayFailed), run.reads
        np.testing.assert_array_equal(run.reads[1], np.full(4, 5, np.float32))
