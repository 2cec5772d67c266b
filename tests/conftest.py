"""Shared fixtures: the ``backend`` fixture runs a test on every backend that answers here.

``RUNTIME_TEST_BACKENDS`` (comma list, default ``cpu,wgpu,cuda``) selects the backends. A
backend whose library or device is missing is skipped with the reason; it never fails and
never passes vacuously.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

# The property tests run derandomized: the same generated examples every run (CI's `pytest -q`
# included, whether or not CI=true is set), so a red run is reproducible with the same command
# and a green one stays green. RUNTIME_HYPOTHESIS_EXPLORE=1 explores new examples each run (a
# local soak; with RUNTIME_PROPERTY_EXAMPLES for more of them).
settings.register_profile("ci", derandomize=True, database=None)
if not os.environ.get("RUNTIME_HYPOTHESIS_EXPLORE"):
    settings.load_profile("ci")

import runtime
from runtime.testing import backend_unavailable

ALL_BACKENDS = [b.strip() for b in os.environ.get("RUNTIME_TEST_BACKENDS", "cpu,wgpu,cuda").split(",")
                if b.strip()]


@pytest.fixture(params=ALL_BACKENDS)
def backend(request):
    """The backend name; skipped with the reason where it cannot run."""
    why = backend_unavailable(request.param)
    if why:
        pytest.skip(why)
    return request.param


@pytest.fixture
def client(backend):
    """A client of the shared server of ``backend``, pinned to a fresh stream (tests never
    share capture state)."""
    c = runtime.client(backend)
    c.set_stream(runtime.StreamId.new())
    yield c


@pytest.fixture
def hardware(client):
    return client.capabilities["hardware_graphs"]


# one capture at a time per device across threads (CUDA global capture mode; CubeCL's tests do so)
capture_lock = threading.Lock()


def f32(*values):
    return np.array(values, dtype=np.float32)


#: the repository's test data (tests/fixtures/README.md says how it was made);
#: RUNTIME_FIXTURES=<folder> reads the same file names from another folder.
FIXTURES = Path(os.environ.get("RUNTIME_FIXTURES", Path(__file__).resolve().parent / "fixtures"))


@pytest.fixture(scope="session")
def ref():
    """The all-MiniLM-L6-v2 reference arrays (``minilm_reference.npz``, used as it is).

    The file ships in ``tests/fixtures/``; a missing one is an error, not a skip (a skip would
    let every accuracy test pass vacuously).
    """
    return dict(np.load(FIXTURES / "minilm_reference.npz"))


def pytest_collection_finish(session):
    """The objects made importing the test modules (numpy, hypothesis, wgpu, the runtime: some
    290,000 here) live for the whole run: after one full collection they are frozen out of the
    collector (``gc.freeze``), so every later collection, automatic or a test's
    ``gc.collect()``, walks only what the tests made (SUITE9: a collect cost 0.5-1 s mid-suite,
    1,800 tests' worth of them). No garbage is frozen: the collection runs first."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture
def frozen_gc():
    """For a test that calls ``gc.collect()`` (or ``gc.get_objects()``) many times: one full
    collection first, then what is left (earlier tests' objects still alive) is frozen out of
    the collector too, so each later collect walks only what the test makes. The test's own
    garbage is found as before, and collected again at its end; what was alive at its start
    stays frozen (the collector's permanent generation grows by what earlier tests kept: their
    caches, sessions' models). ``gc.get_objects()`` lists unfrozen objects only: count against
    a baseline taken inside the test. In the full suite a collect walked the whole heap: 0.5-1 s
    each, 90 s of the suite (SUITE9)."""
    import gc

    gc.collect()
    gc.freeze()
    yield
    gc.collect()
