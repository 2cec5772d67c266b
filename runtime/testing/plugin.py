"""The pytest plugin of ``runtime.testing`` (entry point ``pytest11``; or ``-p runtime.testing.plugin``).

A test that asks for the ``runtime_client`` fixture runs once per variant:

- on cpu, once per seed ``0 .. n-1``, on a fresh server with a seeded interleaving scheduler
  and ``check=True`` (``n``: ``--runtime-seeds N``, else ``@pytest.mark.interleavings(n)``,
  else 10). The strategy (``--runtime-strategy``, else the marker's ``strategy=``) is
  ``"pct"`` by default: PCT (``runtime.testing.search``; Burckhardt et al., ASPLOS 2010) finds
  a bug of depth ``d`` (``depth=``, default 2: ``d`` orderings that must all happen) in one run
  with probability at least ``1/(n k^(d-1))`` for ``n`` streams and ``k`` choice steps
  (``steps=``, default 16: the change points are drawn from the first ``steps`` picks among
  two or more ready streams). ``"random"`` is the earlier uniform pick. ``"exhaustive"`` runs
  the test once per interleaving instead of per seed, as one variant ``cpu-exhaustive``
  (partial-order reduced, at most ``max_runs=`` runs, default 2000; a search cut there warns);
  the test must then issue the same work every time it runs;
- once on each other backend of ``--runtime-backends`` (default ``cpu,wgpu,cuda``; a backend
  that cannot run here is skipped with the reason), with ``check=True``.

``@pytest.mark.interleavings(n, check=False)`` turns the checker off for that test (a missing
dependency then shows as wrong data under some seeds instead of a ``StreamRaceError``).
A failing variant's report gets a "runtime schedule" section: the backend and seed, the
schedule (the cpu trace, also saved to a file) and one-line commands that reproduce it
(``pytest --runtime-seed S path::test``, ``pytest --runtime-trace FILE path::test``). On cpu
the failure itself is a ``ScheduleFailure``: the schedule minimised to the fewest context
switches that still fail, and the racing accesses of that run (operation, stream, buffer and
the line of the test that issued each).
"""

from __future__ import annotations

import re
import shlex
import warnings
import weakref
from pathlib import Path
from typing import NamedTuple

import pytest

from ..backends.cpu_schedule import TraceScheduler
from ..errors import LivenessError, StreamRaceError
from ..frontend.client import client as make_client
from ..streams import StreamId
from ..server import backend_unavailable
from . import search

#: the cpu scheduler each ``runtime_client`` fixture made (the failure report reads its trace).
_schedulers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scheduler_of(client):
    """The scheduler the fixture made for ``client``, or None (another backend, no client)."""
    try:
        return _schedulers.get(client)
    except TypeError:                           # None: the test takes no runtime_client
        return None


#: seeds per test when neither ``--runtime-seeds`` nor the marker says.
DEFAULT_SEEDS = 10
BACKENDS = ("cpu", "wgpu", "cuda")
STRATEGIES = ("pct", "random", "exhaustive")
#: PCT's defaults: bug depth and choice steps the change points are drawn from.
DEFAULT_DEPTH, DEFAULT_STEPS = 2, 16


class Variant(NamedTuple):
    """One run of a test: ``backend``, the cpu ``seed`` or ``trace`` (else None), ``check``,
    and on cpu the search ``strategy``, PCT's ``depth`` and ``steps``, the exhaustive
    ``max_runs``."""

    backend: str
    seed: object = None
    trace: object = None
    check: bool = True
    strategy: str = "pct"
    depth: int = DEFAULT_DEPTH
    steps: int = DEFAULT_STEPS
    max_runs: int = search.DEFAULT_MAX_RUNS

    @property
    def id(self) -> str:
        """The pytest id: ``cpu-seed3``, ``cpu-trace``, ``cpu-exhaustive`` or the backend."""
        if self.backend != "cpu":
            return self.backend
        if self.trace is not None:
            return "cpu-trace"
        return "cpu-exhaustive" if self.strategy == "exhaustive" else f"cpu-seed{self.seed}"

    def scheduler(self):
        """A fresh cpu scheduler for this variant."""
        if self.trace is not None:
            return TraceScheduler(self.trace)
        if self.strategy == "random":
            return search.RandomScheduler(self.seed)
        if self.strategy == "exhaustive":
            return search.Planned([])
        return search.PCTScheduler(self.seed, self.depth, self.steps)


def pytest_addoption(parser):
    """The ``--runtime-*`` options."""
    g = parser.getgroup("runtime", "runtime.testing: seeded stream schedules")
    g.addoption("--runtime-seeds", type=int, metavar="N", default=None,
                help=f"cpu interleaving seeds per test (overrides @pytest.mark.interleavings; "
                     f"default {DEFAULT_SEEDS})")
    g.addoption("--runtime-seed", type=int, metavar="S", default=None,
                help="run only cpu seed S (the reproduce command of a failure)")
    g.addoption("--runtime-backends", metavar="LIST", default=None,
                help="comma list of backends to run on (default cpu,wgpu,cuda; unavailable "
                     "ones skip)")
    g.addoption("--runtime-trace", metavar="FILE", default=None,
                help="run the cpu schedule recorded in FILE instead of seeds")
    g.addoption("--runtime-strategy", choices=STRATEGIES, default=None,
                help="cpu schedule search: pct (default), random or exhaustive (overrides the "
                     "marker's strategy=)")
    g.addoption("--runtime-depth", type=int, metavar="D", default=None,
                help=f"PCT's bug depth (overrides the marker's depth=; default "
                     f"{DEFAULT_DEPTH})")


def _backends(config) -> list:
    names = config.getoption("runtime_backends")
    return [b.strip() for b in names.split(",") if b.strip()] if names else list(BACKENDS)


def pytest_configure(config):
    """Register the ``interleavings`` marker; check ``--runtime-backends``.

    Raises: ``pytest.UsageError`` (an unknown backend name).
    """
    unknown = set(_backends(config)) - set(BACKENDS)
    if unknown:
        raise pytest.UsageError(f"--runtime-backends: unknown {sorted(unknown)}; choose from "
                                f"{list(BACKENDS)}")
    config.addinivalue_line(
        "markers", "interleavings(n, check=True, strategy='pct', depth=2, steps=16, "
        "max_runs=2000): run a test that uses the runtime_client fixture on n cpu schedules "
        "(PCT of that depth, uniform random, or every interleaving) and once per other backend")


def variants(config, marker) -> list:
    """The ``Variant`` s a test runs as, from the options and its ``interleavings`` marker.

    Raises: ``pytest.UsageError`` (unreadable trace file, n < 1, an unknown strategy, a depth,
    steps or max_runs < 1).
    """
    kw = marker.kwargs if marker is not None else {}
    check = bool(kw.get("check", True))
    strategy = config.getoption("runtime_strategy") or kw.get("strategy", "pct")
    depth = config.getoption("runtime_depth") or kw.get("depth", DEFAULT_DEPTH)
    steps, max_runs = kw.get("steps", DEFAULT_STEPS), kw.get("max_runs", search.DEFAULT_MAX_RUNS)
    if strategy not in STRATEGIES:
        raise pytest.UsageError(f"interleavings: strategy must be one of {list(STRATEGIES)}, "
                                f"got {strategy!r}")
    for name, v in (("depth", depth), ("steps", steps), ("max_runs", max_runs)):
        if not isinstance(v, int) or v < 1:
            raise pytest.UsageError(f"interleavings: {name} must be an int >= 1, got {v!r}")
    opts = {"check": check, "strategy": strategy, "depth": depth, "steps": steps,
            "max_runs": max_runs}
    trace_file = config.getoption("runtime_trace")
    if trace_file is not None:
        try:
            return [Variant("cpu", trace=Path(trace_file).read_text().strip(), **opts)]
        except OSError as e:
            raise pytest.UsageError(f"--runtime-trace: cannot read {trace_file}: {e}") from e
    seed = config.getoption("runtime_seed")
    if seed is not None:
        return [Variant("cpu", seed=seed, **dict(opts, strategy=(
            "pct" if strategy == "exhaustive" else strategy)))]
    n = config.getoption("runtime_seeds")
    if n is None:
        n = marker.args[0] if marker is not None and marker.args else DEFAULT_SEEDS
    if not isinstance(n, int) or n < 1:
        raise pytest.UsageError(f"interleavings: the number of seeds must be >= 1, got {n!r}")
    backends = _backends(config)
    if "cpu" not in backends:
        out = []
    elif strategy == "exhaustive":
        out = [Variant("cpu", **opts)]
    else:
        out = [Variant("cpu", seed=s, **opts) for s in range(n)]
    return out + [Variant(b, check=check) for b in backends if b != "cpu"]


def pytest_generate_tests(metafunc):
    """Parametrize every test that uses ``runtime_variant`` (through ``runtime_client``)."""
    marker = metafunc.definition.get_closest_marker("interleavings")
    if "runtime_variant" not in metafunc.fixturenames:
        if marker is not None:
            metafunc.definition.warn(pytest.PytestConfigWarning(
                "@pytest.mark.interleavings has no effect without the runtime_client fixture"))
        return
    vs = variants(metafunc.config, marker)
    metafunc.parametrize("runtime_variant", vs, ids=[v.id for v in vs], indirect=True)


@pytest.fixture
def runtime_variant(request) -> Variant:
    """The ``Variant`` this run of the test is (skipped where its backend cannot run)."""
    v = request.param
    if v.backend != "cpu":
        why = backend_unavailable(v.backend)
        if why:
            pytest.skip(why)
    return v


@pytest.fixture
def runtime_client(runtime_variant):
    """A ``ComputeClient`` for this variant, pinned to a fresh stream.

    cpu: a server of its own with the interleaving scheduler at the variant's seed (or its
    trace) and ``check=True`` unless the marker says ``check=False``; shut down after the test.
    Other backends: the backend's shared server with the same ``check``. Make more clients on
    the same server with ``runtime_client.with_stream(runtime.StreamId.new())``.
    """
    v = runtime_variant
    if v.backend == "cpu":
        sched = v.scheduler()
        c = make_client("cpu", scheduler=sched, check=v.check)
        _schedulers[c] = sched                    # for the failure report
        if isinstance(sched, search.Recording):
            sched.attach_server(c._server)        # the kit's own wiring: the recorder reads the server
    else:
        c = make_client(v.backend, check=v.check)
    c.set_stream(StreamId.new())
    yield c
    if v.backend == "cpu":
        c.shutdown()


def _trace_path(config, item, v) -> Path:
    xml = getattr(config.option, "xmlpath", None)
    if xml:
        folder = Path(xml).resolve().parent / "runtime-traces"
    elif getattr(config, "cache", None) is not None:
        folder = config.cache.mkdir("runtime-traces")
    else:
        folder = Path(config.rootpath) / ".runtime-traces"
    folder.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid.split("[")[0]).strip("_")
    return folder / f"{name}-{v.id}.trace"


def describe_failure(item, v: Variant, error=None) -> str:
    """The "runtime schedule" section of a failed variant: backend, seed, schedule, the commands
    that reproduce it (the trace is saved to a file on cpu; a ``ScheduleFailure`` ``error``
    gives the minimised schedule)."""
    config = item.config
    base = item.nodeid.split("[")[0]
    plugin = " -p runtime.testing.plugin" if any(
        "runtime.testing.plugin" in str(a) for a in config.invocation_params.args) else ""
    test = shlex.quote(base)
    if v.backend != "cpu":
        return (f"failed on {v.backend} (check={v.check})\n"
                f"reproduce: pytest{plugin} --runtime-backends {v.backend} {test}")
    how = ("a recorded trace" if v.trace is not None else "every interleaving (exhaustive)"
           if v.strategy == "exhaustive" else f"{v.strategy} seed {v.seed}"
           + (f", depth {v.depth}" if v.strategy == "pct" else ""))
    lines = [f"failed on cpu with the interleaving scheduler, {how} (check={v.check})"]
    if isinstance(error, search.ScheduleFailure):
        trace = error.trace
    else:
        sched = _scheduler_of(item.funcargs.get("runtime_client"))
        trace = getattr(sched, "trace", None)
    if trace is not None:
        path = _trace_path(config, item, v)
        path.write_text(trace + "\n")
        shown = trace if len(trace) <= 200 else trace[:200] + " ..."
        lines.append(f"schedule (trace): {shown or '(no deferred work ran)'}")
        lines.append(f"trace saved to: {path}")
    if v.trace is None and v.seed is not None:
        lines.append(f"reproduce: pytest{plugin} --runtime-seed {v.seed} {test}")
    if trace is not None:
        lines.append(f"same schedule: pytest{plugin} --runtime-trace {shlex.quote(str(path))} "
                     f"{test}")
    return "\n".join(lines)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run a cpu variant's test under the schedule search: once per interleaving for
    ``exhaustive``; once for ``pct``/``random``, and on failure again to minimise the
    schedule (raising ``ScheduleFailure``, the test's own error chained). ``None`` (pytest
    calls the test) for every other test.

    Raises: ``ScheduleFailure`` (the test failed under a searched schedule); the test's own
    error unchanged when the checker raised it or the scheduler records nothing;
    ``RuntimeError`` (exhaustive: the test issued different work when run again).
    """
    v = getattr(getattr(pyfuncitem, "callspec", None), "params", {}).get("runtime_variant")
    if not isinstance(v, Variant) or v.backend != "cpu" or v.trace is not None:
        return None
    if getattr(pyfuncitem.obj, "__code__", None) is None or (
            pyfuncitem.obj.__code__.co_flags & 0x180):          # a coroutine or async generator
        return None
    names = pyfuncitem._fixtureinfo.argnames
    funcargs = {name: pyfuncitem.funcargs[name] for name in names}

    def test(client):
        pyfuncitem.obj(**dict(funcargs, runtime_client=client))
    if v.strategy == "exhaustive":
        res = search.explore(test, "exhaustive", check=v.check, max_runs=v.max_runs)
        if not res.complete:
            warnings.warn(pytest.PytestWarning(
                f"runtime exhaustive search stopped after {res.runs} interleavings "
                f"(max_runs={v.max_runs}) before covering them all; raise max_runs= or use "
                "strategy='pct'"))
        return True
    try:
        pyfuncitem.obj(**funcargs)
    except Exception as e:
        sched = _scheduler_of(funcargs.get("runtime_client"))
        if not isinstance(sched, search.Recording) or isinstance(
                e, (StreamRaceError, LivenessError)):
            raise                 # the checker's error names the unordered accesses itself
        raise search.failure(test, search.Outcome(e, sched), v.check,
                             f"{v.strategy} seed {v.seed}"
                             + (f", depth {v.depth}" if v.strategy == "pct" else "")) from e
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Add the "runtime schedule" section to the report of a failed variant."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed:
        v = getattr(getattr(item, "callspec", None), "params", {}).get("runtime_variant")
        if isinstance(v, Variant):
            error = call.excinfo.value if call.excinfo is not None else None
            rep.sections.append(("runtime schedule", describe_failure(item, v, error)))
