"""The property kit's failure shapes on a device backend: a kernel that fails on some inputs by a
device-side check (``Kernel.checks``: the wgpu queue thread reads the flag back after the
submit) must behave as the cpu body that raises does, in every shape the kit draws (eager
launches, warm-ups, replayed graphs, clones and instances, events across streams, pools):
the failed launch or replay marks what it would have written, reads of it (and of work computed
from it) raise ``ReplayFailed`` until a later write lands, and the stream raises the
``LaunchError`` once. Random multi-client programs on wgpu (lavapipe here), compared with the
sequential model built from the cpu bodies; skipped with the reason where wgpu is missing.
"""

import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from runtime import kernels as K
from runtime.kernels.shader import program
from runtime.testing import backend_unavailable, programs, run_program

#: programs per run (derandomized: tests/conftest.py); each runs on the shared wgpu server
EXAMPLES = int(os.environ.get("RUNTIME_PROPERTY_EXAMPLES_WGPU", "100"))


def _checked_double(x, y, *, n, count):
    """``y = 2x`` over ``n``; raises (writing nothing) when an input is below -6."""
    if (x[:n] < -6).any():
        raise ValueError("an input below -6")
    y[:n] = 2 * x[:n]


#: the same kernel on the device: every invocation looks at all ``n`` inputs first, so a failed
#: launch writes nothing there either (the model's failed launch), and fails check 1
checked_double_dev = program(
    "checked_double_dev", [("x", "f32", "read"), ("y", "f32", "read_write")], [("n", "u32")],
    (64, 1, 1), """
    let i = (wg.y * nwg.x + wg.x) * 64u + lidx;
    var bad = false;
    for (var j = 0u; j < p.n; j++) {
        if (x[j] < -6.0f) { bad = true; }
    }
    if (bad) {
        atomicMax(&err_flag[0], 1u);
    } else if (i < p.n) {
        y[i] = 2.0f * x[i];
    }""", cpu=_checked_double, checks=("an input below -6",))

KERNELS = [(K.add_scalar, {"alpha": 1.5}), (K.mul_scalar, {"alpha": -0.5}), K.copy, K.accumulate,
           K.add, checked_double_dev, checked_double_dev]
PROGRAMS = st.one_of(*(programs(KERNELS, buffers=4, streams=s, clients=2, steps=30,
                                failures=True) for s in (1, 2)))


@pytest.mark.skipif(bool(backend_unavailable("wgpu")), reason=str(backend_unavailable("wgpu")))
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(PROGRAMS)
def test_device_checked_failures_match_the_model_on_wgpu(program):
    run_program(program, backend="wgpu")
