"""Helpers shared by test modules: the CubeCL scenario kernels and the standard prelude
(cubecl-scenarios.md: ``add_one``, ``mul_two``, input [1,2,3,4] -> output)."""

import numpy as np

from runtime import kernels as K


def add_one(c, x, y, n=4):
    """``y[i] = x[i] + 1`` over ``n`` floats."""
    c.launch(K.add_scalar, K.grid(n), [x, y], {"alpha": 1.0, "n": n})


def mul_two(c, x, y, n=4):
    """``y[i] = x[i] * 2`` over ``n`` floats."""
    c.launch(K.mul_scalar, K.grid(n), [x, y], {"alpha": 2.0, "n": n})


def prelude(c):
    """Standard prelude: input [1,2,3,4], output empty(16 bytes), graph_prepare, warm-up, read."""
    inp = c.create(np.array([1, 2, 3, 4], np.float32))
    out = c.empty(4, np.float32)
    c.graph_prepare()
    add_one(c, inp, out)
    np.testing.assert_array_equal(c.read(out), [2, 3, 4, 5])
    return inp, out


def captured_add_one(c):
    """``y = x + 1`` over 4 floats, warmed up and captured on ``c``'s stream: ``(x, y, graph)``."""
    x = c.create(np.ones(4, np.float32))
    y = c.empty(4, np.float32)
    c.graph_prepare()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    c.start_capture()
    c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    return x, y, c.stop_capture()
