"""Software graphs on the cpu backend resolve each recorded launch into one bound call at
capture (issue 26: ``CpuGraph.calls``, the elementwise kernels' cpu ``bind``). A replay must
compute exactly what the eager launches compute, also when the workgroup count covers fewer
elements than ``n`` (the bound is taken at capture), and a zero count runs nothing."""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from runtime import kernels as K

N = 200
X = np.linspace(-3, 3, N).astype(np.float32)
Y = np.linspace(5, -1, N).astype(np.float32)

CASES = [  # kernel, inputs, params, numpy reference of the output over m elements
    (K.fill, [], {"value": 2.5}, lambda m, out: np.r_[np.full(m, 2.5, np.float32), out[m:]]),
    (K.copy, [X], {}, lambda m, out: np.r_[X[:m], out[m:]]),
    (K.add, [X, Y], {}, lambda m, out: np.r_[X[:m] + Y[:m], out[m:]]),
    (K.mul, [X, Y], {}, lambda m, out: np.r_[X[:m] * Y[:m], out[m:]]),
    (K.add_scalar, [X], {"alpha": 1.5}, lambda m, out: np.r_[X[:m] + np.float32(1.5), out[m:]]),
    (K.mul_scalar, [X], {"alpha": -2.0}, lambda m, out: np.r_[X[:m] * np.float32(-2), out[m:]]),
    (K.accumulate, [X], {}, lambda m, out: np.r_[out[:m] + X[:m], out[m:]]),
    (K.noop, [], {}, lambda m, out: out),
]


@pytest.mark.parametrize("count", [K.grid(N), (2, 1, 1), (0, 1, 1)], ids=["full", "short", "zero"])
@pytest.mark.parametrize("case", CASES, ids=[c[0].name for c in CASES])
def test_a_bound_replay_equals_eager_launches_and_numpy(case, count):
    kernel, inputs, params, ref = case
    assert hasattr(kernel.cpu, "bind")
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    ins = [c.create(a) for a in inputs]
    start = np.arange(N, dtype=np.float32)
    out = c.create(start)
    args = dict(params, n=N)
    m = min(N, count[0] * count[1] * K.WORKGROUP)

    def body():
        c.launch(kernel, count, ins + [out], args)
    c.graph_prepare()
    body()                                       # eager (the warm-up): applied once
    eager = c.read(out)
    np.testing.assert_array_equal(eager, ref(m, start))
    c.start_capture()
    body()
    g = c.stop_capture()
    c.write(out, start)
    g.replay()
    np.testing.assert_array_equal(c.read(out), ref(m, start))
    g.replay()                                   # accumulate applies twice, the others are idempotent
    np.testing.assert_array_equal(c.read(out), ref(m, ref(m, start)))
