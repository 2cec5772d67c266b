"""Elementwise kernels: fill, copy, add, mul, add_scalar, mul_scalar, accumulate (``y += x``),
copy_words (bitwise, any 4-byte dtype), noop.

``elementwise`` writes the WGSL and CUDA C sources from a single expression through the one
source generator (``shader.program``), so the backends cannot drift apart. Indexing is 2-D
over workgroups so that more than 65,535 workgroups (WebGPU's and CUDA's per-dimension limit)
fit: ``i = (wg.y * nwg.x + wg.x) * 64 + lid.x``.
"""

from __future__ import annotations

import re
from functools import partial

import numpy as np

from ..kernel import DTYPES, Kernel
from .shader import program

#: invocations per workgroup of every elementwise kernel.
WORKGROUP = 64
_MAX_DIM = 65535


def grid(n: int, workgroup: int = WORKGROUP) -> tuple:
    """Workgroup count ``(x, y, 1)`` covering ``n`` elements with ``workgroup`` invocations each.

    Splits into a second dimension past 65,535 workgroups; kernels bound-check with ``n``.
    """
    g = groups(n, workgroup)
    if g <= _MAX_DIM:
        return (g, 1, 1)
    y = -(-g // _MAX_DIM)
    return (-(-g // y), y, 1)


def covers(kernel, ok, hint: str):
    """Declare the workgroup count ``kernel`` needs (``Kernel.count_error``): ``ok(count, p)``
    (``count`` ``(x, y, z)``, ``p`` the params by name) tells whether the count covers the
    work the params name; ``hint`` names the count helper to launch over. Returns ``kernel``.
    For kernels whose cpu body does the whole work whatever the count while the GPU sources
    do the part the count covers: a short count is refused on every backend instead."""
    names = kernel.param_names

    def count_error(count, params):
        p = dict(zip(names, params))
        if ok(count, p):
            return None
        shown = ", ".join(f"{k}={v}" for k, v in p.items() if type(v) is int)
        return (f"kernel {kernel.name}: workgroup count {tuple(count)} covers less than its "
                f"params ask for ({shown}): launch over {hint}")
    kernel.count_error = count_error
    return kernel


def touches(kernel, extents: dict):
    """Declare how much of its buffers ``kernel`` touches where ``elements=`` cannot say it (a
    row count taken from the workgroup count, a kernel writing one row or one element):
    ``{binding name: fn(count, p) -> elements}`` (``count`` the direct ``(x, y, z)``, ``p`` the
    params by name), a prefix of each buffer (``Kernel.extents``). For a ``read`` binding:
    the most it reads, so a graph that rewrote that prefix before is not taken to read the
    rest (``runtime.server.capture.sources``); for a ``write`` binding: what it rewrites, all
    of it (0 when that is not a prefix), so a launch covering less than the buffer keeps the
    buffer's failure mark (``Kernel.partial_write``, contract section 4). Returns
    ``kernel``."""
    names = kernel.param_names
    index = {b.name: i for i, b in enumerate(kernel.bindings)}

    def wrap(fn):
        return lambda params, count: int(fn(count, dict(zip(names, params))))
    kernel.extents = dict(kernel.extents or {})
    for b, fn in extents.items():
        bi = index[b]
        kernel.extents[bi] = wrap(fn)
        if kernel.accesses[bi] == "write" and not any(c[0] == bi for c in kernel.write_checks):
            kernel.write_checks += ((bi, None, DTYPES[kernel.bindings[bi].dtype].itemsize),)
    return kernel


def groups(n: int, per: int = WORKGROUP) -> int:
    """Workgroups of ``per`` invocations that cover ``n`` (at least 1)."""
    return max(1, -(-int(n) // per))


def covers_total(param: str, per: int = WORKGROUP):
    """``covers``' test for a kernel launched over ``grid(p[param], per)``: the workgroups,
    however folded into ``(x, y, z)``, cover ``p[param]`` invocations of ``per`` each."""
    return lambda c, p: c[0] * c[1] * c[2] >= groups(p[param], per)


def elementwise(name: str, bindings, expr: str, params=(), cpu=None, bind=None,
                fuse=None, elements="n") -> Kernel:
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
        bind: ``bind(*views, n=..., **params) -> callable()``: the same work as one
            zero-argument call with views and params bound once (the cpu ``bind`` of
            ``runtime.kernel``: what a software graph replays); optional.
        fuse: ``fuse(*views, n=..., **params) -> (code, n, out, a, b, param)``: the launch as
            one op of ``runtime.backends.cpu_fuse`` (``code`` one of its ``CODES`` or
            ``"none"``; ``out``, ``a``, ``b`` the indices of the views ``bind`` slices to
            ``[:n]``, or None; ``param`` the float32 scalar ``bind`` binds, or None), so a
            software graph may run a chain of such launches as one compiled call (issue 26);
            only for kernels whose numpy call is exactly one float32 IEEE operation per
            element; optional.
        elements: the ``Kernel`` keyword, ``"n"`` by default: every binding holds at least
            ``n`` elements (the expression indexes each with ``i``), so the server refuses a
            launch whose ``n`` exceeds a bound buffer (``LaunchError``) instead of clamping
            (cpu, wgpu) or running out of bounds (cuda). A kernel whose expression indexes a
            binding otherwise (``add_bias``'s ``b[i % N]``) passes a ``{binding: "n"}`` dict
            of the others.
    Returns: a ``Kernel`` launched over ``grid(n)`` workgroups of ``WORKGROUP`` invocations.
    Raises: ``ValueError`` for a malformed description (from ``Kernel``).
    """
    target = bindings[-1][0]
    rhs = re.sub(r"\{(\w+)\}", r"p.\1", expr)
    # an empty kernel still names its binding (WGSL drops unused ones) but never writes it
    store = f"{target}[i] = {rhs};" if expr else f"if (p.n == 0u) {{ {target}[i] = {target}[i]; }}"
    body = (f"    let i = (wg.y * nwg.x + wg.x) * {WORKGROUP}u + lid.x;\n"
            f"    if (i < p.n) {{ {store} }}")
    k = program(name, bindings, list(params) + [("n", "u32")], (WORKGROUP,), body,
                cpu=None if cpu is None else _bounded(cpu, bind, fuse), elements=elements)
    k.grid_elements = _grid_elements     # (a short grid writes part of the buffer: its mark)
    return k


def _grid_elements(count) -> int:
    """The elements an elementwise launch over ``count`` workgroups covers: the sources'
    ``i = (wg.y * nwg.x + wg.x) * WORKGROUP + lid.x`` (``Kernel.grid_elements``)."""
    return count[0] * count[1] * WORKGROUP


def _bounded(fn, bind=None, fuse=None):
    """Run ``fn`` over the elements the launch covers, as the GPU sources do:
    ``min(n, count.x * count.y * WORKGROUP)`` (an indirect or short count covers fewer).
    With ``bind`` (``fuse``), the callable gets a ``bind`` (``fuse``) attribute with the same
    bound (``runtime.kernel``, ``runtime.backends.cpu_fuse``)."""
    def cpu(*views, count, n, **params):
        m = count[0] * count[1] * WORKGROUP
        return fn(*views, count=count, n=n if n < m else m, **params)
    cpu.__name__ = cpu.__qualname__ = fn.__name__
    for attr, how in (("bind", bind), ("fuse", fuse)):
        if how is not None:
            setattr(cpu, attr, _with_bound(how))
    return cpu


def _with_bound(how):
    """``how(*views, n=..., **params)`` called with the launch's element bound."""
    def bound(*views, count, n, **params):
        m = count[0] * count[1] * WORKGROUP
        return how(*views, n=n if n < m else m, **params)
    return bound


def _fill(y, *, value, n, count):
    y[:n] = value


def _copy(x, y, *, n, count):
    y[:n] = x[:n]


def _add(a, b, out, *, n, count):
    out[:n] = a[:n] + b[:n]


def _mul(a, b, out, *, n, count):
    out[:n] = a[:n] * b[:n]


def _add_scalar(x, y, *, alpha, n, count):
    np.add(x[:n], y.dtype.type(alpha), y[:n])


def _mul_scalar(x, y, *, alpha, n, count):
    np.multiply(x[:n], y.dtype.type(alpha), y[:n])


def _accumulate(x, y, *, n, count):
    y[:n] += x[:n]


def _noop(y, *, n, count):
    pass


def _nothing():
    pass


# binds: the same work as one call with views and params bound once (numpy ufuncs take the
# output as their last positional argument)
def _bind_fill(y, *, value, n):
    return partial(y[:n].fill, y.dtype.type(value))


def _bind_copy(x, y, *, n):
    return partial(np.copyto, y[:n], x[:n])


def _bind_ufunc2(ufunc):
    def bind(a, b, out, *, n):
        return partial(ufunc, a[:n], b[:n], out[:n])
    return bind


def _bind_scalar(ufunc):
    # the param as a 0-d array of y's dtype: the same value and loop as the numpy scalar
    # (y.dtype.type(alpha)), and numpy 2 takes a 0-d array ~0.2 µs faster per call (issue 26)
    def bind(x, y, *, alpha, n):
        return partial(ufunc, x[:n], np.asarray(y.dtype.type(alpha)), y[:n])
    return bind


def _bind_accumulate(x, y, *, n):
    return partial(np.add, y[:n], x[:n], y[:n])


def _bind_noop(y, *, n):
    return _nothing


# fuse: the op each bind above runs (``runtime.backends.cpu_fuse``): (code, n, out, a, b,
# param) with out/a/b indices of the views the bind slices to ``[:n]`` (None where unused) and
# the same float32 param the bind binds
def _fuse_fill(y, *, value, n):
    return ("fill", n, 0, None, None, y.dtype.type(value))


def _fuse_copy(x, y, *, n):
    return ("copy", n, 1, 0, None, None)


def _fuse_ufunc2(code):
    def fuse(a, b, out, *, n):
        return (code, n, 2, 0, 1, None)
    return fuse


def _fuse_scalar(code):
    def fuse(x, y, *, alpha, n):
        return (code, n, 1, 0, None, y.dtype.type(alpha))
    return fuse


def _fuse_accumulate(x, y, *, n):
    return ("add", n, 1, 1, 0, None)           # np.add(y, x, y): y first


def _fuse_noop(y, *, n):
    return ("none", n, None, None, None, None)


R, RW, W = "read", "read_write", "write"
#: ``y[i] = value``
fill = elementwise("fill", [("y", "f32", W)], "{value}", [("value", "f32")], _fill, _bind_fill,
                   _fuse_fill)
#: ``y[i] = x[i]``
copy = elementwise("copy", [("x", "f32", R), ("y", "f32", W)], "x[i]", cpu=_copy,
                   bind=_bind_copy, fuse=_fuse_copy)
#: ``out[i] = a[i] + b[i]``
add = elementwise("add", [("a", "f32", R), ("b", "f32", R), ("out", "f32", W)], "a[i] + b[i]", cpu=_add,
                  bind=_bind_ufunc2(np.add), fuse=_fuse_ufunc2("add"))
#: ``out[i] = a[i] * b[i]``
mul = elementwise("mul", [("a", "f32", R), ("b", "f32", R), ("out", "f32", W)], "a[i] * b[i]", cpu=_mul,
                  bind=_bind_ufunc2(np.multiply), fuse=_fuse_ufunc2("mul"))
#: ``y[i] = x[i] + alpha``
add_scalar = elementwise("add_scalar", [("x", "f32", R), ("y", "f32", W)], "x[i] + {alpha}",
                         [("alpha", "f32")], _add_scalar, _bind_scalar(np.add),
                         _fuse_scalar("add_scalar"))
#: ``y[i] = x[i] * alpha``
mul_scalar = elementwise("mul_scalar", [("x", "f32", R), ("y", "f32", W)], "x[i] * {alpha}",
                         [("alpha", "f32")], _mul_scalar, _bind_scalar(np.multiply),
                         _fuse_scalar("mul_scalar"))
#: ``y[i] += x[i]``
accumulate = elementwise("accumulate", [("x", "f32", R), ("y", "f32", RW)], "y[i] + x[i]", cpu=_accumulate,
                         bind=_bind_accumulate, fuse=_fuse_accumulate)
#: ``y[i] = x[i]`` for ``i < n`` 4-byte words, bit for bit (bind f32 buffers too: the words are
#: moved as ``i32``, never through float registers). Launch over ``grid(n)``.
copy_words = elementwise("copy_words", [("x", "i32", R), ("y", "i32", W)], "x[i]", cpu=_copy)
#: an empty kernel (one read_write binding, no work): measures pure launch overhead.
noop = elementwise("noop", [("y", "f32", RW)], "", cpu=_noop, bind=_bind_noop, fuse=_fuse_noop)
