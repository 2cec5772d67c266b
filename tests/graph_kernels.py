"""Small i32 kernels for the graphs-that-change tests (conditions, counters), one source per
backend, and the capture helper they share."""

import numpy as np

from runtime.kernel import Binding, Kernel, Param


def _add_i32(c, *, delta, count):
    c[0] += delta


#: ``c[0] += delta`` (one i32): a loop counter / condition.
add_i32 = Kernel(
    "add_i32", [Binding("c", "i32", "read_write")], [Param("delta", "i32")], (1, 1, 1),
    wgsl="""@group(0) @binding(0) var<storage, read_write> c: array<i32>;
struct P { delta: i32 }
@group(0) @binding(1) var<uniform> p: P;
@compute @workgroup_size(1) fn main() { c[0] = c[0] + p.delta; }""",
    cuda='extern "C" __global__ void add_i32(int* c, int delta) { c[0] += delta; }',
    cpu=_add_i32)


def _set_i32(c, *, value, count):
    c[0] = value


#: ``c[0] = value`` (one i32).
set_i32 = Kernel(
    "set_i32", [Binding("c", "i32", "read_write")], [Param("value", "i32")], (1, 1, 1),
    wgsl="""@group(0) @binding(0) var<storage, read_write> c: array<i32>;
struct P { value: i32 }
@group(0) @binding(1) var<uniform> p: P;
@compute @workgroup_size(1) fn main() { c[0] = p.value; }""",
    cuda='extern "C" __global__ void set_i32(int* c, int value) { c[0] = value; }',
    cpu=_set_i32)


def capture(c, work, warmup=True, retain=False):
    """Record ``work()`` on ``c``'s stream (after an optional warm-up run) and return the
    graph."""
    c.graph_prepare()
    if warmup:
        work()
    c.start_capture()
    try:
        work()
    except BaseException:
        c.abort_capture()
        raise
    return c.stop_capture(retain=retain)


def i32(v):
    return np.array([v], np.int32)
