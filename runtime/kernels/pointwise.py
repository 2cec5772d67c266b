"""Elementwise kernels: fill, copy, add, mul, add_scalar, mul_scalar, accumulate (``y += x``),
copy_words (bitwise, any 4-byte dtype), noop.

``elementwise`` writes the WGSL and CUDA C sources from a single expression through the one
source generator (``shader.program``), so the backends cannot drift apart. Indexing is 2-D
over workgroups so that more than 65,535 workgroups (WebGPU's and CUDA's per-dimension limit)
fit: ``i = (wg.y * nwg.x + wg.x) * 64 + lid.x``.
"""

from __future__ import annotations

import re

from ..kernel import Kernel
from .shader import program

#: invocations per workgroup of every elementwise kernel.
WORKGROUP = 64
_MAX_DIM = 65535


def grid(n: int, workgroup: int = WORKGROUP) -> tuple:
    """Workgroup count ``(x, y, 1)`` covering ``n`` elements with ``workgroup`` invocations each.

    Splits into a second dimension past 65,535 workgroups; kernels bound-check with ``n``.
    """
    groups = max(1, -(-int(n) // workgroup))
    if groups <= _MAX_DIM:
        return (groups, 1, 1)
    y = -(-groups // _MAX_DIM)
    return (-(-groups // y), y, 1)


def elementwise(name: str, bindings, expr: str, params=(), cpu=None) -> Kernel:
    """Build an elementwise kernel ``out = expr`` over ``i < n``: a thin wrapper over
    :func:`~runtime.kernels.shader.program`, the one source generator.

    Args:
        name: kernel name.
        bindings: ``[(name, dtype, access), ...]``; the assignment target is the last binding.
        expr: the right-hand side in the WGSL subset of ``runtime.kernels.shader``, written
            with ``x[i]`` for bindings and ``{alpha}`` for params (``p.alpha`` in the body);
            empty for a kernel that does nothing.
        params: ``[(name, dtype), ...]`` besides ``n`` (appended as the last ``u32`` param).
        cpu: the numpy callable (see ``runtime.kernel``), run over the elements the launch
            covers.
    Returns: a ``Kernel`` launched over ``grid(n)`` workgroups of ``WORKGROUP`` invocations.
    Raises: ``ValueError`` for a malformed description (from ``Kernel``).
    """
    target = bindings[-1][0]
    rhs = re.sub(r"\{(\w+)\}", r"p.\1", expr)
    # an empty kernel still names its binding (WGSL drops unused ones) but never writes it
    store = f"{target}[i] = {rhs};" if expr else f"if (p.n == 0u) {{ {target}[i] = {target}[i]; }}"
    body = (f"    let i = (wg.y * nwg.x + wg.x) * {WORKGROUP}u + lid.x;\n"
            f"    if (i < p.n) {{ {store} }}")
    return program(name, bindings, list(params) + [("n", "u32")], (WORKGROUP,), body,
                   cpu=None if cpu is None else _bounded(cpu))


def _bounded(fn):
    """Run ``fn`` over the elements the launch covers, as the GPU sources do:
    ``min(n, count.x * count.y * WORKGROUP)`` (an indirect or short count covers fewer)."""
    def cpu(*views, count, n, **params):
        return fn(*views, count=count, n=min(n, count[0] * count[1] * WORKGROUP), **params)
    cpu.__name__ = cpu.__qualname__ = fn.__name__
    return cpu


def _fill(y, *, value, n, count):
    y[:n] = value


def _copy(x, y, *, n, count):
    y[:n] = x[:n]


def _add(a, b, out, *, n, count):
    out[:n] = a[:n] + b[:n]


def _mul(a, b, out, *, n, count):
    out[:n] = a[:n] * b[:n]


def _add_scalar(x, y, *, alpha, n, count):
    y[:n] = x[:n] + y.dtype.type(alpha)


def _mul_scalar(x, y, *, alpha, n, count):
    y[:n] = x[:n] * y.dtype.type(alpha)


def _accumulate(x, y, *, n, count):
    y[:n] += x[:n]


def _noop(y, *, n, count):
    pass


R, RW, W = "read", "read_write", "write"
#: ``y[i] = value``
fill = elementwise("fill", [("y", "f32", W)], "{value}", [("value", "f32")], _fill)
#: ``y[i] = x[i]``
copy = elementwise("copy", [("x", "f32", R), ("y", "f32", W)], "x[i]", cpu=_copy)
#: ``out[i] = a[i] + b[i]``
add = elementwise("add", [("a", "f32", R), ("b", "f32", R), ("out", "f32", W)], "a[i] + b[i]", cpu=_add)
#: ``out[i] = a[i] * b[i]``
mul = elementwise("mul", [("a", "f32", R), ("b", "f32", R), ("out", "f32", W)], "a[i] * b[i]", cpu=_mul)
#: ``y[i] = x[i] + alpha``
add_scalar = elementwise("add_scalar", [("x", "f32", R), ("y", "f32", W)], "x[i] + {alpha}",
                         [("alpha", "f32")], _add_scalar)
#: ``y[i] = x[i] * alpha``
mul_scalar = elementwise("mul_scalar", [("x", "f32", R), ("y", "f32", W)], "x[i] * {alpha}",
                         [("alpha", "f32")], _mul_scalar)
#: ``y[i] += x[i]``
accumulate = elementwise("accumulate", [("x", "f32", R), ("y", "f32", RW)], "y[i] + x[i]", cpu=_accumulate)
#: ``y[i] = x[i]`` for ``i < n`` 4-byte words, bit for bit (bind f32 buffers too: the words are
#: moved as ``i32``, never through float registers). Launch over ``grid(n)``.
copy_words = elementwise("copy_words", [("x", "i32", R), ("y", "i32", W)], "x[i]", cpu=_copy)
#: an empty kernel (one read_write binding, no work): measures pure launch overhead.
noop = elementwise("noop", [("y", "f32", RW)], "", cpu=_noop)
