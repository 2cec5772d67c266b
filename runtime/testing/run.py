"""``run_program``: run a program on a backend and compare every answer with the model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import NamedTuple

from ..backends.cpu_schedule import InterleavingScheduler, ThreadScheduler, TraceScheduler
from ..frontend.client import client as make_client
from ..streams import StreamId
from ..errors import LivenessError, ServerError, StreamRaceError
from .model import Model
from .program import Objects, note_failed_run

#: seconds one call may take before the run reports it as hung.
CALL_TIMEOUT_S = 60.0


class Step(NamedTuple):
    """What one op did: ``value`` returned or ``error`` raised, the model's ``mismatch``
    sentence (None: agreed) and ``skipped`` (why it was not issued, or None)."""

    op: object
    value: object
    error: object
    mismatch: object
    skipped: object


class ProgramMismatch(AssertionError):
    """A run disagreed with the sequential model; ``.run`` is the ``ProgramRun`` and the message
    is its ``report()`` (the seed, the schedule, the program as Python, the first mismatch)."""

    def __init__(self, run):
        super().__init__(run.report())
        self.run = run


class ProgramRun:
    """The result of ``run_program``.

    Attributes:
        program, backend, seed, check: what ran and how.
        steps: one ``Step`` per op of ``program.ops + program.final`` that was reached.
        mismatches: ``[(op index, sentence)]`` where the runtime disagreed with the model.
        flagged: the ``StreamRaceError``/``LivenessError`` the checker raised (then the run
            stopped there), or None.
        trace: the cpu schedule as a compact string (``scheduler="trace", trace=...`` or
            ``run_program(..., trace=...)`` runs it again), None on other backends.
        diverged: steps where a replayed trace could not be followed (0 when followed exactly).
    """

    def __init__(self, program, backend, seed, check):
        self.program, self.backend, self.seed, self.check = program, backend, seed, check
        self.steps: list = []
        self.mismatches: list = []
        self.flagged = None
        self.trace = None
        self.diverged = 0

    @property
    def reads(self) -> list:
        """The value or error of every ``Read`` reached, in order."""
        from .program import Read
        return [s.error if s.error is not None else s.value for s in self.steps
                if isinstance(s.op, Read) and s.skipped is None]

    def report(self) -> str:
        """The failure as text: seed, schedule, the program as Python with the mismatch marked."""
        notes = {i: "MISMATCH: " + m for i, m in self.mismatches}
        notes.update({i: f"skipped: {s.skipped}" for i, s in enumerate(self.steps) if s.skipped})
        head = [f"runtime.testing: the run on {self.backend}"
                + (f" with seed {self.seed}" if self.backend == "cpu" else "")
                + " disagrees with the sequential model"]
        if self.mismatches:
            head.append(f"first: call {self.mismatches[0][0]}: {self.mismatches[0][1]}")
        if self.trace is not None:
            head.append(f"schedule (trace): {self.trace or '(no deferred work ran)'}")
        head.append(f"program ({len(self.program)} calls), paste to reproduce:")
        return "\n".join(head) + "\n\n" + self.program.to_python(
            self.backend, self.seed, self.check, notes) + "\n"


def _open(backend, seed, check, trace, scheduler="interleave"):
    if scheduler not in ("interleave", "thread"):
        raise ValueError(f"scheduler must be 'interleave' or 'thread', got {scheduler!r}")
    if scheduler == "thread" and (backend != "cpu" or trace is not None):
        raise ValueError("scheduler='thread' runs the cpu backend's worker threads, without a "
                         "trace")
    if backend == "cpu":
        # a scheduler object gives a server of its own (options key by identity)
        sched = (ThreadScheduler() if scheduler == "thread" else TraceScheduler(trace)
                 if trace is not None else InterleavingScheduler(seed))
        return make_client("cpu", scheduler=sched, check=check), sched
    if trace is not None:
        raise ValueError("a trace replays a cpu schedule; run it with backend='cpu'")
    return make_client(backend, check=check), None


def run_program(program, backend: str = "cpu", seed: int = 0, *, check: bool = False,
                trace=None, threads: bool = True, rtol=None, atol=None,
                raises: bool = True, scheduler: str = "interleave") -> ProgramRun:
    """Run ``program`` and compare every answer with the sequential model.

    Args:
        program: a ``Program`` (from ``programs()``).
        backend: ``"cpu"`` (a fresh server with the seeded interleaving scheduler), ``"wgpu"``
            or ``"cuda"`` (the backend's shared server, fresh streams).
        seed: the cpu interleaving (ignored elsewhere).
        check: open the server with the stream-ordering checker (``check=True``).
        trace: a cpu schedule to run again (``ProgramRun.trace``) instead of ``seed``.
        threads: issue each client's calls from its own OS thread, one call at a time in
            program order (the device order is still the scheduler's).
        rtol, atol: tolerance of value comparisons; default exact on cpu (the same bodies run),
            ``1e-5``/``1e-6`` elsewhere.
        raises: raise ``ProgramMismatch`` when the run disagrees with the model.
        scheduler: on cpu, ``"interleave"`` (default: the seeded interleaving scheduler) or
            ``"thread"``: the default runtime's worker threads, where tiny work on an idle
            stream runs on the calling thread at once (issue 26's fast paths); real timing
            decides the order (``seed`` is ignored, no schedule is recorded).
    Returns: a ``ProgramRun``.
    Raises: ``ProgramMismatch`` (with ``raises``); ``ValueError`` (a trace off cpu; an unknown
        ``scheduler``, or ``"thread"`` off cpu or with a trace);
        ``UnsupportedError`` (the backend is missing). A checker error is not raised: it is
        ``run.flagged``, and a mismatch only when the program keeps the contract.
    """
    if backend != "cpu" and rtol is None:
        rtol, atol = 1e-5, 1e-6
    root, sched = _open(backend, seed, check, trace, scheduler)
    run = ProgramRun(program, backend, seed, check)
    model = Model(program, root.capabilities["hardware_graphs"], rtol, atol or 0.0)
    sids = [StreamId.new() for _ in range(program.streams)]
    clients = [root.with_stream(sids[k % program.streams]) for k in range(program.clients)]
    pools = [ThreadPoolExecutor(1, thread_name_prefix=f"runtime-testing-c{k}") if threads
             else None for k in range(program.clients)]
    objs = Objects(program.size, program.kernels)
    objs.streams = [sids[k % program.streams] for k in range(program.clients)]
    try:
        for i, op in enumerate(program.ops + program.final):
            why = model.skip(op)
            if why is not None:
                run.steps.append(Step(op, None, None, None, why))
                continue
            value, error = _call(pools[op.client], op, clients[op.client], objs)
            if isinstance(error, (StreamRaceError, LivenessError)):
                run.flagged = error
                if program.contract:
                    run.mismatches.append((i, f"the checker flagged a program that keeps the "
                                              f"contract: {type(error).__name__}: {error}"))
                run.steps.append(Step(op, value, error, None, None))
                break
            bad = model.step(op, value, error)
            run.steps.append(Step(op, value, error, bad, None))
            if bad is not None:           # the model and the runtime part here: stop
                run.mismatches.append((i, bad))
                break
    finally:
        for g in objs.graphs.values():
            g.release()
        for h in objs.bufs.values():
            h.release()
        for p in pools:
            if p is not None:
                p.shutdown()
        if sched is not None:
            run.trace = getattr(sched, "trace", None)
            run.diverged = getattr(sched, "diverged", 0)
            root.shutdown()
    if run.mismatches:
        note_failed_run(program, backend, seed, check)
        if raises:
            raise ProgramMismatch(run)
    return run


def _call(pool, op, client, objs):
    """Issue ``op`` on its client's thread; ``(value, error)``."""
    def issue():
        try:
            return op._run(client, objs), None
        except (ServerError, TypeError, ValueError) as e:
            return None, e
    if pool is None:
        return issue()
    try:
        return pool.submit(issue).result(timeout=CALL_TIMEOUT_S)
    except FutureTimeout:
        return None, ServerError(f"{type(op).__name__} did not return within {CALL_TIMEOUT_S} s")
