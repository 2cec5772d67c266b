"""One kernel body, two dialects: write a compute body once and get WGSL and CUDA C.

The body is written in a small subset of WGSL that also reads as C++ once a few declarations
are rewritten, so the WGSL and CUDA sources of a kernel come from the same text and cannot drift
apart. :func:`program` wraps it in each backend's entry-point boilerplate.

The subset:

- Scalar types ``f32``, ``i32``, ``u32`` (CUDA gets them as typedefs, so ``f32(x)`` casts in both).
- Float literals carry the ``f`` suffix (``0.0f``, ``1e-9f``), unsigned ones ``u``; never mix types
  in ``min``/``max``/``select`` (WGSL forbids it; C++ would silently promote).
- Declarations: ``let x = e;``, ``let x: T = e;``, ``var x = e;``, ``var x: T = e;`` and local
  arrays ``var a: array<f32, 16>;`` (not zero-initialised in CUDA: initialise them yourself).
- Control flow: ``if (c) { } else { }``, ``for (var i = 0u; i < n; i++) { }``; no ternary (use
  ``select(if_false, if_true, cond)``), no ``loop``/``continuing``; ``workgroupBarrier()`` only in
  uniform control flow (WGSL checks this; an early ``return`` before a barrier is an error).
- Builtins: ``exp``, ``sqrt``, ``inverseSqrt``, ``abs`` (floats only), ``min``, ``max``,
  ``select``; ``lid`` (local invocation id, ``.x/.y/.z``), ``lidx`` (flat local index), ``wg``
  (workgroup id), ``nwg`` (workgroup count).
- Bindings are used by name (``x[i]``); params as ``p.name``. Helper functions
  (``fn f(a: f32) -> f32 { ... }``) may only do arithmetic: they cannot see the bindings in CUDA.
- Workgroup memory is declared with ``shared=[("name", "f32", size)]``.
- Device-side checks (``program(..., checks=[message, ...])``): ``atomicMax(&err_flag[0], ku);``
  fails check ``k`` (``Kernel.checks``); ``arrayLength(&name)`` is a binding's element count
  (the bound handle's ``nbytes`` over the item size). CUDA has neither a binding length nor a
  reader of the flag yet: there ``arrayLength`` reads as ``0xffffffffu`` and ``err_flag`` is a
  ``__device__`` global, so cuda does not check.
"""

from __future__ import annotations

import re

from ..kernel import C_TYPES, Binding, Kernel, Param

_CUDA_PRELUDE = "".join(f"typedef {c} {w};\n" for w, c in C_TYPES.items()) + """\
template <typename T> __device__ __forceinline__ T select(T f, T t, bool c) { return c ? t : f; }
__device__ __forceinline__ f32 inverseSqrt(f32 x) { return rsqrtf(x); }
#define workgroupBarrier() __syncthreads()
"""

# WGSL declaration forms -> C++ (order matters: the typed forms first).
_TO_CUDA = [
    (re.compile(r"\bbitcast<u32>\("), "__float_as_uint("),
    (re.compile(r"\bbitcast<f32>\("), "__uint_as_float("),
    (re.compile(r"\bvar\s+(\w+)\s*:\s*array<\s*(\w+)\s*,\s*([^>]+?)\s*>\s*;"), r"\2 \1[\3];"),
    (re.compile(r"\bvar\s+(\w+)\s*:\s*(\w+)\s*="), r"\2 \1 ="),
    (re.compile(r"\bvar\s+(\w+)\s*="), r"auto \1 ="),
    (re.compile(r"\blet\s+(\w+)\s*:\s*(\w+)\s*="), r"const \2 \1 ="),
    (re.compile(r"\blet\s+(\w+)\s*="), r"const auto \1 ="),
    (re.compile(r"\bexp\("), "expf("),
    (re.compile(r"\bsqrt\("), "sqrtf("),
    (re.compile(r"\babs\("), "fabsf("),
    (re.compile(r"\barrayLength\(\s*&\s*\w+\s*\)"), "0xffffffffu"),
]
_FN = re.compile(r"\bfn\s+(\w+)\s*\(([^)]*)\)\s*->\s*(\w+)\s*\{")


def _fn_to_cuda(m: re.Match) -> str:
    args = []
    for a in filter(None, (s.strip() for s in m.group(2).split(","))):
        name, typ = (s.strip() for s in a.split(":"))
        args.append(f"{typ} {name}")
    return f"__device__ __forceinline__ {m.group(3)} {m.group(1)}({', '.join(args)}) {{"


def to_cuda(text: str) -> str:
    """Rewrite body or helper text of the subset into CUDA C++ (see the module docstring)."""
    text = _FN.sub(_fn_to_cuda, text)
    for pattern, repl in _TO_CUDA:
        text = pattern.sub(repl, text)
    return text


def program(name: str, bindings, params, workgroup_size, body: str, *, shared=(), helpers="",
            cpu=None, elements=None, checks=(), ranges=None) -> Kernel:
    """Build a :class:`~runtime.Kernel` whose WGSL and CUDA sources share one body.

    Args:
        name: kernel name (the CUDA entry point).
        bindings: ``[(name, dtype, access), ...]`` buffer arguments, in order.
        params: ``[(name, dtype), ...]`` 4-byte scalar arguments, read as ``p.name`` in the body.
        workgroup_size: ``(x, y, z)`` invocations per workgroup.
        body: the entry point's body in the WGSL subset of the module docstring.
        shared: ``[(name, dtype, size), ...]`` workgroup (CUDA ``__shared__``) arrays.
        helpers: helper functions in the subset, placed before the entry point.
        cpu: the numpy callable (``runtime.kernel`` conventions).
        elements: the ``Kernel`` keyword: the integer param counting the elements each binding
            (or each binding of a ``{binding: param}`` dict) must hold; checked by the server.
        checks: the messages of the body's device-side checks (``Kernel.checks``; the module
            docstring says how the body fails one); declares ``err_flag``.
        ranges: ``{param: (lo, hi)}`` (``Kernel.ranges``): the values a param may take where
            the sources hold a fixed size or need at least 1 (``hi`` ``None``: no upper bound).
    Returns:
        a ``Kernel`` with ``wgsl``, ``cuda`` and ``cpu`` sources.
    Raises:
        ValueError: a malformed description (from ``Kernel``).
    """
    bindings = [Binding(*b) for b in bindings]
    params = [Param(*p) for p in params]
    wgx, wgy, wgz = tuple(workgroup_size) + (1,) * (3 - len(workgroup_size))
    # WGSL: storage bindings, one uniform struct, workgroup arrays, helpers, main.
    access = {"read": "read", "read_write": "read_write", "write": "read_write"}
    lines = [f"@group(0) @binding({k}) var<storage, {access[b.access]}> {b.name}: array<{b.dtype}>;"
             for k, b in enumerate(bindings)]
    if params:
        lines.append("struct Params { " + ", ".join(f"{q.name}: {q.dtype}" for q in params) + " }")
        lines.append(f"@group(0) @binding({len(bindings)}) var<uniform> p: Params;")
    if checks:
        lines.append(f"@group(0) @binding({len(bindings) + bool(params)}) "
                     "var<storage, read_write> err_flag: array<atomic<u32>>;")
    lines += [f"var<workgroup> {n}: array<{t}, {s}>;" for n, t, s in shared]
    wgsl = "\n".join(lines) + f"""
{helpers}
@compute @workgroup_size({wgx}, {wgy}, {wgz})
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(local_invocation_index) lidx: u32,
        @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{
{body}
}}
"""
    # CUDA: the same body after to_cuda(); params gathered into a struct named p.
    args = [f"{'const ' if b.access == 'read' else ''}{b.dtype}* __restrict__ {b.name}"
            for b in bindings]
    args += [f"{q.dtype} {q.name}" for q in params]
    struct, init = "", ""
    if params:
        fields = " ".join(f"{q.dtype} {q.name};" for q in params)
        struct = f"struct {name}_params {{ {fields} }};"
        init = f"    const {name}_params p = {{{', '.join(q.name for q in params)}}};"
    smem = "\n".join(f"__shared__ {t} {n}[{s}];" for n, t, s in shared)
    if checks:
        smem += "\n__device__ u32 err_flag[1];"
    cuda = f"""{_CUDA_PRELUDE}{struct}
{smem}
{to_cuda(helpers)}
extern "C" __global__ void {name}({', '.join(args)}) {{
{init}
    const uint3 lid = threadIdx;
    const uint3 wg = blockIdx;
    const uint3 nwg = gridDim;
    const u32 lidx = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
{to_cuda(body)}
}}
"""
    return Kernel(name, bindings, params, (wgx, wgy, wgz), wgsl=wgsl, cuda=cuda, cpu=cpu,
                  elements=elements, checks=checks, ranges=ranges)


#: WGSL helpers for kernels that must carry NaN through: WGSL leaves ``min``/``max`` with a NaN
#: operand to the implementation (and a compiler may fold ``x != x``), so NaN is tested on the
#: bits. ``nmax``: ``max`` that returns NaN when an operand is NaN (numpy's ``np.maximum``).
NAN_HELPERS = """
fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }
fn nmax(a: f32, b: f32) -> f32 { return select(max(a, b), a + b, is_nan(a) || is_nan(b)); }
"""


def tree_reduce(op: str, size: int) -> str:
    """Body text that tree-reduces workgroup memory ``red[0 .. size)`` into ``red[0]`` with
    ``op`` (``"+"``, ``"max"``, or ``"nmax"``: a max that keeps NaN, needs
    :data:`NAN_HELPERS`), barriers included; ``size`` is a power of two, the workgroup's
    invocation count (every invocation must reach it: uniform control flow)."""
    combine = ("red[lidx] + red[lidx + st]" if op == "+"
               else f"{op}(red[lidx], red[lidx + st])")
    return f"""
    workgroupBarrier();
    for (var st = {size // 2}u; st > 0u; st = st / 2u) {{
        if (lidx < st) {{ red[lidx] = {combine}; }}
        workgroupBarrier();
    }}"""
