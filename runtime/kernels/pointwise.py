"""Elementwise kernels: fill, copy, add, mul, add_scalar, mul_scalar, accumulate (``y += x``), noop.

One generator writes the WGSL and CUDA C sources from a single expression, so the backends
cannot drift apart. Indexing is 2-D over workgroups so that more than 65,535 workgroups
(WebGPU's and CUDA's per-dimension limit) fit: ``i = (wg.y * nwg.x + wg.x) * 64 + lid.x``.
"""

from __future__ import annotations

import re

from ..kernel import Binding, Kernel, Param

#: invocations per workgroup of every elementwise kernel.
WORKGROUP = 64
_MAX_DIM = 65535
_WGSL_T = {"f32": "f32", "i32": "i32", "u32": "u32"}
_CUDA_T = {"f32": "float", "i32": "int", "u32": "unsigned int"}


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
    """Build an elementwise kernel ``out = expr`` over ``i < n``.

    Args:
        name: kernel name.
        bindings: ``[(name, dtype, access), ...]``; the assignment target is the last binding.
        expr: the right-hand side, written with ``x[i]`` for bindings and ``{alpha}`` for params
            (substituted as ``p.alpha`` in WGSL and ``alpha`` in CUDA C).
        params: ``[(name, dtype), ...]`` besides ``n`` (appended as the last ``u32`` param).
        cpu: the numpy callable (see ``runtime.kernel``).
    """
    bindings = [Binding(*b) for b in bindings]
    params = [Param(*p) for p in params] + [Param("n", "u32")]
    target = bindings[-1].name
    wgsl_expr = re.sub(r"\{(\w+)\}", r"p.\1", expr)
    cuda_expr = re.sub(r"\{(\w+)\}", r"\1", expr)
    decls = "\n".join(
        f"@group(0) @binding({k}) var<storage, {'read' if b.access == 'read' else 'read_write'}> "
        f"{b.name}: array<{_WGSL_T[b.dtype]}>;" for k, b in enumerate(bindings))
    fields = ", ".join(f"{p.name}: {_WGSL_T[p.dtype]}" for p in params)
    body = f"{target}[i] = {wgsl_expr};" if expr else "_ = &" + target + ";"
    wgsl = f"""{decls}
struct Params {{ {fields} }}
@group(0) @binding({len(bindings)}) var<uniform> p: Params;
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {{
    let i = (wg.y * nwg.x + wg.x) * {WORKGROUP}u + lid.x;
    if (i < p.n) {{ {body} }}
}}
"""
    args = ", ".join([f"{_CUDA_T[b.dtype]}* __restrict__ {b.name}" for b in bindings]
                     + [f"{_CUDA_T[p.dtype]} {p.name}" for p in params])
    cbody = f"{target}[i] = {cuda_expr};" if expr else ""
    cuda = f"""extern "C" __global__ void {name}({args}) {{
    unsigned int i = (blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {{ {cbody} }}
}}
"""
    return Kernel(name, bindings, params, (WORKGROUP, 1, 1), wgsl=wgsl, cuda=cuda,
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


R, RW = "read", "read_write"
#: ``y[i] = value``
fill = elementwise("fill", [("y", "f32", RW)], "{value}", [("value", "f32")], _fill)
#: ``y[i] = x[i]``
copy = elementwise("copy", [("x", "f32", R), ("y", "f32", RW)], "x[i]", cpu=_copy)
#: ``out[i] = a[i] + b[i]``
add = elementwise("add", [("a", "f32", R), ("b", "f32", R), ("out", "f32", RW)], "a[i] + b[i]", cpu=_add)
#: ``out[i] = a[i] * b[i]``
mul = elementwise("mul", [("a", "f32", R), ("b", "f32", R), ("out", "f32", RW)], "a[i] * b[i]", cpu=_mul)
#: ``y[i] = x[i] + alpha``
add_scalar = elementwise("add_scalar", [("x", "f32", R), ("y", "f32", RW)], "x[i] + {alpha}",
                         [("alpha", "f32")], _add_scalar)
#: ``y[i] = x[i] * alpha``
mul_scalar = elementwise("mul_scalar", [("x", "f32", R), ("y", "f32", RW)], "x[i] * {alpha}",
                         [("alpha", "f32")], _mul_scalar)
#: ``y[i] += x[i]``
accumulate = elementwise("accumulate", [("x", "f32", R), ("y", "f32", RW)], "y[i] + x[i]", cpu=_accumulate)
#: an empty kernel (one read_write binding, no work): measures pure launch overhead.
noop = elementwise("noop", [("y", "f32", RW)], "", cpu=_noop)
