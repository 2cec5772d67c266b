"""The pytest plugin of ``runtime.testing`` (entry point ``pytest11``; or ``-p runtime.testing.plugin``).

A test that asks for the ``runtime_client`` fixture runs once per variant:

- on cpu, once per seed ``0 .. n-1``, on a fresh server with the seeded interleaving scheduler
  and ``check=True`` (``n``: ``--runtime-seeds N``, else ``@pytest.mark.interleavings(n)``,
  else 10);
- once on each other backend of ``--runtime-backends`` (default ``cpu,wgpu,cuda``; a backend
  that cannot run here is skipped with the reason), with ``check=True``.

``@pytest.mark.interleavings(n, check=False)`` turns the checker off for that test (a missing
dependency then shows as wrong data under some seeds instead of a ``StreamRaceError``).
A failing variant's report gets a "runtime schedule" section: the backend and seed, the
schedule (the cpu trace, also saved to a file) and one-line commands that reproduce it
(``pytest --runtime-seed S path::test``, ``pytest --runtime-trace FILE path::test``).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import NamedTuple

import pytest

from ..backends.cpu_schedule import InterleavingScheduler, TraceScheduler
from ..frontend.client import client as make_client
from ..streams import StreamId
from .run import backend_unavailable

#: seeds per test when neither ``--runtime-seeds`` nor the marker says.
DEFAULT_SEEDS = 10
BACKENDS = ("cpu", "wgpu", "cuda")


class Variant(NamedTuple):
    """One run of a test: ``backend``, the cpu ``seed`` or ``trace`` (else None), ``check``."""

    backend: str
    seed: object = None
    trace: object = None
    check: bool = True

    @property
    def id(self) -> str:
        """The pytest id: ``cpu-seed3``, ``cpu-trace`` or the backend name."""
        if self.backend != "cpu":
            return self.backend
        return "cpu-trace" if self.trace is not None else f"cpu-seed{self.seed}"


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
        "markers", "interleavings(n, check=True): run a test that uses the runtime_client "
        "fixture on n cpu interleaving seeds (and once per other backend)")


def variants(config, marker) -> list:
    """The ``Variant`` s a test runs as, from the options and its ``interleavings`` marker.

    Raises: ``pytest.UsageError`` (unreadable trace file, n < 1).
    """
    check = bool(marker.kwargs.get("check", True)) if marker is not None else True
    trace_file = config.getoption("runtime_trace")
    if trace_file is not None:
        try:
            return [Variant("cpu", trace=Path(trace_file).read_text().strip(), check=check)]
        except OSError as e:
            raise pytest.UsageError(f"--runtime-trace: cannot read {trace_file}: {e}") from e
    seed = config.getoption("runtime_seed")
    if seed is not None:
        return [Variant("cpu", seed=seed, check=check)]
    n = config.getoption("runtime_seeds")
    if n is None:
        n = marker.args[0] if marker is not None and marker.args else DEFAULT_SEEDS
    if not isinstance(n, int) or n < 1:
        raise pytest.UsageError(f"interleavings: the number of seeds must be >= 1, got {n!r}")
    backends = _backends(config)
    out = [Variant("cpu", seed=s, check=check) for s in range(n)] if "cpu" in backends else []
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
        sched = TraceScheduler(v.trace) if v.trace is not None else InterleavingScheduler(v.seed)
        c = make_client("cpu", scheduler=sched, check=v.check)
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


def describe_failure(item, v: Variant) -> str:
    """The "runtime schedule" section of a failed variant: backend, seed, schedule, the commands
    that reproduce it (the trace is saved to a file on cpu)."""
    config = item.config
    base = item.nodeid.split("[")[0]
    plugin = " -p runtime.testing.plugin" if any(
        "runtime.testing.plugin" in str(a) for a in config.invocation_params.args) else ""
    test = shlex.quote(base)
    if v.backend != "cpu":
        return (f"failed on {v.backend} (check={v.check})\n"
                f"reproduce: pytest{plugin} --runtime-backends {v.backend} {test}")
    lines = [f"failed on cpu with the interleaving scheduler, "
             + (f"seed {v.seed}" if v.trace is None else "a recorded trace")
             + f" (check={v.check})"]
    client = item.funcargs.get("runtime_client")
    sched = getattr(getattr(client, "_server", None), "backend", None)
    trace = getattr(getattr(sched, "scheduler", None), "trace", None)
    if trace is not None:
        path = _trace_path(config, item, v)
        path.write_text(trace + "\n")
        shown = trace if len(trace) <= 200 else trace[:200] + " ..."
        lines.append(f"schedule (trace): {shown or '(no deferred work ran)'}")
        lines.append(f"trace saved to: {path}")
    if v.trace is None:
        lines.append(f"reproduce: pytest{plugin} --runtime-seed {v.seed} {test}")
    if trace is not None:
        lines.append(f"same schedule: pytest{plugin} --runtime-trace {shlex.quote(str(path))} "
                     f"{test}")
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Add the "runtime schedule" section to the report of a failed variant."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed:
        v = getattr(getattr(item, "callspec", None), "params", {}).get("runtime_variant")
        if isinstance(v, Variant):
            rep.sections.append(("runtime schedule", describe_failure(item, v)))
