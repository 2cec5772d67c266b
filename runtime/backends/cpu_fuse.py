"""Fusing a cpu software graph's runs of pointwise launches into one compiled call (issue 26).

A software graph (``runtime.backends.cpu.CpuGraph``) replays each recorded launch as one numpy
call; for a chain of tiny launches the per-call cost (~0.35 µs a ufunc call, plus the loop)
is the whole cost. :func:`fuse` replaces each run of at least two consecutive top-level launches
of the exactly-rounded float32 pointwise kernels (``runtime.kernels.pointwise``: fill, copy,
add, mul, add_scalar, mul_scalar, accumulate, noop: the kernels whose cpu callable has a
``fuse`` attribute) by ONE call of a numba-compiled interpreter over an op table, so a replay
of L such launches costs one call (~0.2 µs for 10 x 64 floats) instead of L. This is the
elementwise-chain fusion of Warp's and torch.compile's code generators, done as an interpreter
compiled once per process (no code generated per graph).

The op table (``int64``): ``[ops, elements, (code, out, a, b, m) per op]`` where ``out``, ``a``,
``b`` are addresses of float32 data (a scalar operand, the float32 param, points into the
call's own params array) and ``m`` the op's element count (the kernel's bound
``min(n, count.x * count.y * 64)``, taken at capture exactly as the unfused call takes it). The
interpreter walks the elements in blocks of :data:`BLOCK` and runs every op over each block in
order, so each element sees the run's ops in launch order.

Exactness (the hard requirement: results bitwise equal to the unfused replay):

- Per op the arithmetic is one float32 IEEE operation, as numpy's float32 ufunc loop does it:
  numba compiles without fast-math (no reassociation, no FMA contraction: LLVM contracts only
  with the ``contract`` flag, which numba sets only under ``fastmath``), so -0.0, NaN, inf,
  subnormals come out the same; copies and fills move the 32 bits (a signalling NaN's payload
  included). Params are the float32 scalar the unfused call binds (``y.dtype.type(alpha)``),
  made by the kernel's own ``fuse`` description. The first compile is checked against numpy on
  special values (:func:`_self_check`); a mismatch turns fusion off for the process. The one
  freedom: a NaN computed from two NaN operands (an add or mul of two NaNs) may carry the other
  operand's payload than the unfused call's. IEEE 754 leaves the choice open, and numpy's own
  loops differ by position (measured here: a 255-element add gives the first operand's payload
  in the vector body, the second's in the tail), so no replay could match it bit for bit.
- Element-by-element order equals launch-by-launch order only when no op reads an element
  another op writes at a different index. A run therefore only admits an op whose arrays are,
  against every array already in the run, the very same memory (same data pointer: element
  ``i`` is then the same address in both) or disjoint address ranges (pooled buffers and
  arenas may be views into one allocation at different offsets). An op that would overlap
  partially ends the run and starts the next one.
- An op is described only when numpy would run it as a plain elementwise loop: float32,
  1-D, contiguous, 4-byte aligned, a writable output, every operand of the output's length
  (numpy would broadcast a length-1 operand or raise on a mismatch: such a launch stays an
  unfused call, which raises there with its kernel's name). Indirect counts, conditional
  nodes, other kernels and other dtypes end a run (``copy_words``, bitwise int32, is left out).

A fused call raises only if the interpreter cannot run at all; the graph names it
``"<kernels> (<k> launches fused)"`` in ``CpuGraph.names``, so a failing replay's
``LaunchError`` names the kernels of the run, and the replay's write set is marked as for any
failing call (``CpuBackend.launch_graph``). Floating-point exceptions are not reported: numpy
may print a ``RuntimeWarning`` (overflow, invalid) for an unfused call, the fused call computes
the same values silently, as the GPU backends do.

Compile cost: numba is imported and the interpreter compiled (or loaded from numba's on-disk
cache, ``cache=True``; without a writable cache directory it compiles in memory) on the first
capture that has a run to fuse, once per process: ~0.2 s to import numba and ~0.4 s for its
target's first use (which ``runtime.kernels.cpu_loops`` pays too), ~0.3 s more for the first
compile ever. Any failure (numba missing, a compile error, the self-check) leaves the unfused
calls in place and is kept in :data:`STATE`. ``RUNTIME_CPU_FUSE=0`` turns fusion off.

Two compiled variants: one keeps the GIL (tiny work), one releases it (work of
:data:`RELEASE_GIL` op-elements and more, so other threads run meanwhile).
"""

from __future__ import annotations

import os
import threading
from functools import partial

import numpy as np

from .._env import env_switch

#: fusion on (the default); ``RUNTIME_CPU_FUSE=0`` in the environment turns it off (the graph
#: then replays one numpy call per launch, as before issue 26's fusion).
ENABLED = env_switch("RUNTIME_CPU_FUSE", True)   # 0/false/no/off; a typo: ValueError
#: elements each op of a fused call runs per block (the block's operands stay in L1).
BLOCK = 256
#: op-elements of a fused call counted as one call where the graph decides whether a replay is
#: small enough to run on the caller at once (``CpuGraph.inline``, ``INLINE_CALLS`` calls): a
#: fused call costs ~0.15 µs plus ~0.07 ns per op-element measured (the loops vectorise; 100 x 64
#: floats took 0.56 µs, 10 x 64 0.18 µs), so 2,048 op-elements cost at most a tiny numpy call's
#: ~0.35 µs even at 4x that rate. 10 x 64 floats counts 1 call, 100 x 64 counts 4 (inline under
#: ``INLINE_CALLS = 4``), 1,000 x 64 counts 32 (queued: the enqueue must not wait for it).
UNIT = 2048
#: op-elements from which a fused call releases the GIL while it runs (~4 µs of work: numpy
#: releases it from 500 elements per call; below this the hand-over would cost more).
RELEASE_GIL = 1 << 16
#: op codes of the interpreter, by the name a kernel's ``fuse`` description gives.
CODES = {"fill": 0, "copy": 1, "add": 2, "mul": 3, "add_scalar": 4, "mul_scalar": 5}
#: distinct array starts one run may hold: admitting an op compares its arrays with each, so
#: a run over many buffers is cut into runs of at most this many (capture stays linear).
MAX_REGIONS = 64
_ROW = 5
_F32 = np.dtype(np.float32)
#: ``{"compiled": bool | None, "error": str | None}``: whether the interpreter is available
#: (None: not tried yet) and why not.
STATE: dict = {"compiled": None, "error": None}
_lock = threading.Lock()
_kernel = None


def _after_fork_in_child() -> None:
    """Only the forking thread comes along into a child: a compile another thread had in
    progress (holding ``_lock``) never finishes there, so the child gets a fresh lock and
    compiles itself when it needs to (numba's own compiler lock: ``runtime._fork``)."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _interpret(prog):             # compiled by _compile (numba), never called as Python
    ops = prog[0]
    total = prog[1]
    start = 0
    while start < total:
        end = start + BLOCK
        for k in range(ops):
            r = 2 + _ROW * k
            hi = prog[r + 4]
            if hi > end:
                hi = end
            if hi <= start:
                continue
            code = prog[r]
            o = _f32_at(prog[r + 1])
            a = _f32_at(prog[r + 2])
            b = _f32_at(prog[r + 3])
            if code == 0:
                v = a[0]
                for i in range(start, hi):
                    o[i] = v
            elif code == 1:
                for i in range(start, hi):
                    o[i] = a[i]
            elif code == 2:
                for i in range(start, hi):
                    o[i] = a[i] + b[i]
            elif code == 3:
                for i in range(start, hi):
                    o[i] = a[i] * b[i]
            elif code == 4:
                v = b[0]
                for i in range(start, hi):
                    o[i] = a[i] + v
            elif code == 5:
                v = b[0]
                for i in range(start, hi):
                    o[i] = a[i] * v
        start = end


def _released(prog):              # compiled with nogil by _compile: _interpret without the GIL
    _held(prog)


def _f32_at(addr):               # replaced by a numba intrinsic before _interpret compiles
    raise NotImplementedError


def _held(prog):                 # replaced by the compiled _interpret before _released compiles
    raise NotImplementedError


def _compile():
    """Import numba and compile :func:`_interpret` for ``int64[::1]`` twice: keeping the GIL
    (tiny work: releasing it would let another thread take it for up to the switch interval
    before the call returns, which is why numpy keeps it under 500 elements) and releasing it
    (:func:`_released`, for work of :data:`RELEASE_GIL` op-elements and more). Cached on disk
    where numba finds a writable cache directory, else compiled in memory. Returns
    ``(held, released)`` dispatchers."""
    global _f32_at, _held
    from numba import njit, types
    from numba.extending import intrinsic

    @intrinsic
    def f32_at(typingctx, addr):
        """The int64 address ``addr`` as a ``float32*`` (LLVM ``inttoptr``)."""
        ptr = types.CPointer(types.float32)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))
        return ptr(types.int64), codegen
    _f32_at = f32_at
    sig = types.void(types.int64[::1])
    try:
        _held = njit(sig, cache=True)(_interpret)
        return _held, njit(sig, nogil=True, cache=True)(_released)
    except Exception:  # noqa: BLE001 - no usable cache locator (read-only install): in memory
        _held = njit(sig)(_interpret)
        return _held, njit(sig, nogil=True)(_released)


def kernel():
    """The compiled interpreter ``(held, released)`` (numba dispatchers taking the op table,
    see :func:`_compile`), compiled and self-checked on the first call of the process; None
    when fusion is off or unavailable (``STATE["error"]`` says why). Thread-safe."""
    global _kernel
    if _kernel is None and ENABLED and STATE["compiled"] is None:
        with _lock:
            if STATE["compiled"] is None:
                try:
                    k = _compile()
                    for variant in k:
                        _self_check(variant)
                    _kernel = k
                    STATE["compiled"] = True
                except Exception as e:  # noqa: BLE001 - any failure: the unfused calls stay
                    STATE["compiled"], STATE["error"] = False, f"{type(e).__name__}: {e}"
    return _kernel if ENABLED else None


def _self_check(k) -> None:
    """Run every op code on special values (±0, ±inf, NaNs with payloads, subnormals, values
    whose product rounds) through ``k`` and through numpy; raise ``ArithmeticError`` unless
    the 32 bits agree everywhere (e.g. an FMA contraction or a flush-to-zero would differ)."""
    bits = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFC12345,
                     0x7F812345, 1, 0x80000001, 0x3F800001, 0x3EAAAAAB, 0x7F7FFFFF,
                     0x00800000, 0x4B7FFFFF, 0xBF7FFFFF, 0x3F000000], np.uint32)
    x = bits.view(np.float32)
    rng = np.random.default_rng(26)
    y = np.concatenate([x, rng.standard_normal(300).astype(np.float32)])
    z = np.concatenate([x[::-1], rng.standard_normal(300).astype(np.float32) * 1e3])
    w = np.empty_like(y)
    alpha = np.float32(1.0000001)
    ops = [("mul", w, y, z, None), ("add", w, w, z, None), ("mul_scalar", w, w, None, alpha),
           ("add_scalar", w, w, None, np.float32(-0.0)), ("copy", y, w, None, None),
           ("add", y, y, w, None)]
    want = [y.copy(), z.copy(), w.copy()]
    wy, wz, ww = want
    with np.errstate(all="ignore"):
        np.multiply(wy, wz, ww)
        np.add(ww, wz, ww)
        np.multiply(ww, alpha, ww)
        np.add(ww, np.float32(-0.0), ww)
        np.copyto(wy, ww)
        np.add(wy, ww, wy)
    _fused_call(k, _array_ops(ops), len(ops))()
    for got, ref in zip((y, z, w), want):
        if not np.array_equal(got.view(np.uint32), ref.view(np.uint32)):
            raise ArithmeticError("the compiled interpreter's float32 results differ from "
                                  "numpy's bit for bit; fusion is off")
    fill = np.empty(3, np.float32)
    _fused_call(k, _array_ops([("fill", fill, None, None, x[4]),
                               ("copy", fill, fill, None, None)]), 2)()
    if not np.array_equal(fill.view(np.uint32), np.full(3, bits[4], np.uint32)):
        raise ArithmeticError("the compiled interpreter's fill changes the 32 bits")


def describe(launch, seen):
    """The op ``(code, m, out, a, b, param)`` of one resolved launch ``(fn, views, kwargs,
    count, name)`` when it may join a fused run, else None: the kernel's cpu callable has a
    ``fuse`` description (``runtime.kernels.pointwise``), the count is direct, and numpy would
    run it as one plain float32 elementwise loop over ``m`` elements (see the module doc).
    ``out``, ``a``, ``b``: addresses (``a``/``b`` 0 where unused; a fill's value and a scalar
    op's param are ``param``). ``("none", ...)``: a launch that does nothing (``noop``).
    ``seen``: ``{id(view): (view, address, plain, writable)}`` shared by one graph's calls."""
    fn, views, kwargs, count, _ = launch
    how = getattr(fn, "fuse", None)
    if how is None or type(count) is not tuple:
        return None
    try:
        code, n, out, a, b, param = how(*views, count=count, **kwargs)
    except Exception:  # noqa: BLE001 - anything odd: the unfused call keeps its behaviour
        return None
    if code == "none":
        return ("none", 0, 0, 0, 0, None)
    if code not in CODES or (param is not None and type(param) is not np.float32):
        return None
    m = -1
    addrs = []
    for k in (out, a, b):
        if k is None:
            addrs.append(0)
            continue
        v = views[k]
        info = seen.get(id(v))
        if info is None:
            info = seen[id(v)] = (v, *_address(v))
        _, addr, plain, writable = info
        length = min(n, len(v))             # len(v[:n]), the slice the unfused call binds
        if not plain or (m >= 0 and length != m) or (k == out and not writable):
            return None
        m = length
        addrs.append(addr)
    return (code, m, *addrs, param)


def _address(v) -> tuple:
    """``(address, plain, writable)`` of a view: plain = float32, 1-D, contiguous, 4-byte
    aligned (what the interpreter's loads and stores assume)."""
    if type(v) is not np.ndarray or v.dtype != _F32 or v.ndim != 1:
        return 0, False, False
    addr = v.ctypes.data
    plain = (v.strides[0] == 4 or len(v) <= 1) and addr % 4 == 0
    return addr, plain, bool(v.flags.writeable)


class _Regions:
    """The address ranges ``[start, end)`` of a run's arrays, by start: distinct starts never
    overlap (the run's invariant)."""

    __slots__ = ("ends",)

    def __init__(self):
        self.ends: dict = {}

    def admits(self, op) -> bool:
        """Whether every array of ``op`` is the same memory as (same start) or disjoint from
        every array of the run; records them if so."""
        m = op[1]
        if m <= 0:
            return True
        ends = self.ends
        for p in op[2:5]:                          # an op's arrays all have m elements
            e = p + 4 * m
            if not p or ends.get(p, 0) >= e:       # unused, or within a range checked before
                continue
            if p not in ends and len(ends) >= MAX_REGIONS:
                return False
            for q, f in ends.items():
                if q != p and p < f and q < e:
                    return False                   # (the run ends: what was added is dropped)
            ends[p] = e
        return True


def _fused_call(k, ops, launches, keep=()):
    """One zero-argument call running ``ops`` (see :func:`describe`; ``"none"`` ops dropped)
    through the interpreter ``k`` (a dispatcher, or ``(held, released)``); attributes ``work``
    (op-elements), ``launches`` (how many launches it replaces), ``keep`` (the params array and
    ``keep``: the arrays whose memory the table addresses, alive as long as the call, which a
    queued replay holds without the graph)."""
    rows = [op for op in ops if op[0] != "none"]
    params = np.zeros(max(1, len(rows)), np.float32)
    base = params.ctypes.data
    table = [len(rows), 0]
    total = work = 0
    for j, (code, m, out, a, b, param) in enumerate(rows):
        if param is not None:
            params[j] = param
            if code == "fill":
                a = base + 4 * j
            else:
                b = base + 4 * j
        table += (CODES[code], out, a, b, m)
        total = m if m > total else total
        work += m
    table[1] = total
    prog = np.array(table, np.int64)
    if type(k) is tuple:
        k = k[work >= RELEASE_GIL]
    call = partial(k, prog)
    call.work, call.launches, call.keep = work, launches, (params, keep)
    return call


def _array_ops(ops) -> list:
    """``[(code, out, a, b, param)]`` over float32 arrays (``a``/``b`` None where unused) as
    :func:`describe` ops over the whole arrays (the self-check and tests; the caller keeps the
    arrays alive while the call lives)."""
    return [(code, len(out), out.ctypes.data, 0 if a is None else a.ctypes.data,
             0 if b is None else b.ctypes.data, param) for code, out, a, b, param in ops]


def _name(names) -> str:
    """``"add_scalar, mul_scalar (10 launches fused)"``: the run's kernels, first seen first
    (at most 6)."""
    kinds = list(dict.fromkeys(names))
    shown = ", ".join(kinds[:6]) + (", ..." if len(kinds) > 6 else "")
    return f"{shown} ({len(names)} launches fused)"


def fuse(launches, calls, names):
    """Replace each run of fusable launches in a graph's resolved calls by one fused call.

    Args:
        launches: the resolved launches ``(fn, views, kwargs, count, name)`` behind ``calls``,
            one per call, in replay order (top level only: a graph with conditional nodes is
            not passed here).
        calls: their zero-argument calls (``CpuGraph.calls``).
        names: their kernel names (``CpuGraph.names``).
    Returns: ``(calls, names, cost)``: lists where every run of >= 2 fusable launches (see
        :func:`describe`; at least two doing work) is one call named by :func:`_name`, the
        rest unchanged; ``cost``: the calls a replay makes, a fused call counted as ``1 +
        work // UNIT`` (``CpuGraph.inline``). Unchanged (cost ``len(calls)``) when fusion is
        off or the interpreter cannot be had.
    """
    if not ENABLED or len(calls) < 2:
        return calls, names, len(calls)
    seen: dict = {}
    with np.errstate(all="ignore"):            # a param's cast warned at bind already, if at all
        ops = [describe(launch, seen) for launch in launches]
    runs, start, regions = [], None, None          # runs: (first, end) index ranges
    for i, op in enumerate(ops):
        if op is None:
            if start is not None:
                runs.append((start, i))
            start = None
            continue
        if start is None or not regions.admits(op):
            if start is not None:
                runs.append((start, i))
            start, regions = i, _Regions()
            if not regions.admits(op):          # its own arrays overlap: never fused
                ops[i], start = None, None
    if start is not None:
        runs.append((start, len(ops)))
    runs = [(s, e) for s, e in runs if sum(ops[i][0] != "none" for i in range(s, e)) >= 2]
    if not runs:
        return calls, names, len(calls)
    k = kernel()
    if k is None:
        return calls, names, len(calls)
    out_calls, out_names, cost, at = [], [], 0, 0
    keep = tuple(info[0] for info in seen.values())     # the views the tables address
    for s, e in runs:
        out_calls += calls[at:s]
        out_names += names[at:s]
        call = _fused_call(k, ops[s:e], e - s, keep)
        out_calls.append(call)
        out_names.append(_name(names[s:e]))
        cost += (s - at) + 1 + call.work // UNIT
        at = e
    out_calls += calls[at:]
    out_names += names[at:]
    cost += len(calls) - at
    return out_calls, out_names, cost


def is_fused(call) -> bool:
    """Whether ``call`` (an entry of ``CpuGraph.calls``) is a fused call of this module."""
    return isinstance(call, partial) and _kernel is not None and call.func in _kernel
