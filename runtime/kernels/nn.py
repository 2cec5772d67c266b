"""Kernels for transformer encoders (BERT): embedding gather, bias add, matmul with bias (and a
fused GELU epilogue), layer norm (with a fused residual add), GELU, attention, masked mean
pooling and L2 normalisation.

Every kernel is one description (:func:`runtime.kernels.shader.program`): a single body written
once gives the WGSL and CUDA C sources, and a numpy callable gives the cpu one. All tensors are
dense row-major ``f32`` (token ids ``i32``); shapes travel as ``u32`` params. Launch geometry
(workgroup counts) is given by the ``*_count`` helpers next to each kernel; ``runtime.Tensor``
wraps all of this so callers never compute counts by hand.

Numerics: accumulation in ``f32``; layer norm uses two passes (mean, then centred variance);
attention keeps an online softmax (running maximum and sum, rescaled accumulators); GELU uses
the erf form with an erf accurate to about 1.2e-7 (absolute), so results agree with a float64
reference to float32 noise.

The cpu sources do the same arithmetic without allocating: matmuls are numpy's BLAS ``sgemm``
on blocks of the output (``out=``), dealt out to the thread rule's threads
(:mod:`runtime.cpu_threads`), or one call on OpenBLAS's own threads while the process has the
cores to itself (``WHOLE_ROWS``), with the bias/GELU epilogue applied in place per block, row and
elementwise kernels are compiled loops (:mod:`runtime.kernels.cpu_loops`, numba, float64
accumulation), and attention is batched BLAS around an in-place softmax (exact, not online) with
its scratch owned by the worker thread.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from .pointwise import WORKGROUP, covers, covers_total, elementwise, grid, groups, touches
from .shader import NAN_HELPERS, program, tree_reduce
from ..cpu_threads import FAN_OUT, RULE, WHOLE_CODES

R, RW, W = "read", "read_write", "write"

#: matmul tile columns: a workgroup of 16x16 invocations computes a (16 r) x 128 block of ``out``
#: (r x 8 each, r = 8, 4 or 1 by the variant), stepping through K by MM_BK.
MM_TILE = 128
MM_BK = 16
#: invocations per workgroup of the row kernels (layer norm, L2 normalise) and of attention.
ROW_WORKGROUP = 128
ATTN_WORKGROUP = 64
#: largest head dimension attention supports (q and the accumulators are unrolled per lane).
ATTN_MAX_HEAD_DIM = 64

# ---------------------------------------------------------------------------------------------
# erf and GELU
#
# erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z/2), z >= 0, with the degree-9 Chebyshev fit
# P of Press et al. (Numerical Recipes, "erfcc"): fractional error of erfc below 1.2e-7
# everywhere, so erf is good to ~1.2e-7 absolute (float32 resolution; the 5-term
# Abramowitz-Stegun 7.1.25 form is only good to 2.5e-5). The same coefficients feed the
# WGSL/CUDA helper and the numpy fallback; tests check it against math.erf.
_ERFC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
         -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def _horner(var: str) -> str:
    expr = f"{_ERFC[-1]!r}f"
    for c in reversed(_ERFC[:-1]):
        expr = f"({c!r}f + {var} * {expr})"
    return expr


_GELU_HELPERS = f"""
fn erf_approx(x: f32) -> f32 {{
    let z = abs(x);
    let t = 1.0f / (1.0f + 0.5f * z);
    let r = 1.0f - t * exp(-z * z + {_horner("t")});
    return select(-r, r, x >= 0.0f);
}}
fn gelu_erf(x: f32) -> f32 {{
    return 0.5f * x * (1.0f + erf_approx(x * 0.70710678118654752f));
}}
"""


def erf_np(x: np.ndarray) -> np.ndarray:
    """erf of a float array with the WGSL/CUDA kernels' approximation (|error| < 1.2e-7), same
    dtype. A numpy reference; the cpu kernels use :func:`runtime.kernels.cpu_loops.erf`."""
    z = np.abs(x)
    t = 1 / (1 + z * x.dtype.type(0.5))
    poly = np.full_like(t, _ERFC[-1])
    for c in reversed(_ERFC[:-1]):
        poly = c + t * poly
    r = 1 - t * np.exp(-z * z + poly)
    return np.where(x >= 0, r, -r).astype(x.dtype, copy=False)


def gelu_np(x: np.ndarray) -> np.ndarray:
    """``0.5 x (1 + erf(x / sqrt 2))`` in the dtype of ``x`` (exact-erf GELU, as BERT uses), with
    :func:`erf_np`: a numpy reference (allocates; the cpu kernels do not use it)."""
    e = erf_np(x * x.dtype.type(0.7071067811865476))
    e += 1
    e *= x
    e *= x.dtype.type(0.5)
    return e


_LOOPS = None
_tls = threading.local()


#: elements a compiled loop (:mod:`runtime.kernels.cpu_loops`) must touch to run on more than
#: one thread: below it (a layer norm of 128 rows of 384: ~20 µs), waking numba's sleeping
#: OpenMP threads costs more than they save, and on a busy host a static split waits for a
#: partner the OS is not running
LOOP_GRAIN = 1 << 17


def _loops(work: int = LOOP_GRAIN):
    """:mod:`runtime.kernels.cpu_loops`, imported on the first cpu launch (numba loads there, not
    when ``runtime`` is imported), with numba's threads for the calling thread set by the thread
    rule (:mod:`runtime.cpu_threads`: cores shared among the stream items executing now), or one
    thread when the loops touch fewer than :data:`LOOP_GRAIN` elements (``work``)."""
    global _LOOPS
    if _LOOPS is None:
        from . import cpu_loops
        _LOOPS = cpu_loops
    n = RULE.threads() if work >= LOOP_GRAIN else 1
    if n != getattr(_tls, "threads", 0):
        _tls.threads = n
        _LOOPS.set_threads(n)
    return _LOOPS


def _scratch(n: int) -> np.ndarray:
    """A float32 scratch array of at least ``n`` elements owned by the calling thread.

    Grows to the largest request seen and is reused by every later launch on the thread (a cpu
    kernel runs on one thread from start to end), so a replay allocates nothing once warm.
    """
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.size < n:
        buf = _tls.buf = np.empty(n, np.float32)
    return buf


def _gelu_cpu(x, out, *, n, count):
    _loops(n).gelu(x[:n], out[:n])


#: ``out[i] = gelu(x[i])`` over ``i < n``; launch over ``grid(n)``.
gelu = program(
    "gelu", [("x", "f32", R), ("out", "f32", W)], [("n", "u32")], (WORKGROUP, 1, 1), f"""
    let i = (wg.y * nwg.x + wg.x) * {WORKGROUP}u + lidx;
    if (i < p.n) {{ out[i] = gelu_erf(x[i]); }}""", helpers=_GELU_HELPERS, cpu=_gelu_cpu,
    elements="n")


def _add_bias_cpu(x, b, out, *, N, n, count):
    rows = n // N                              # n may end inside a row (a short launch count)
    _loops(n).add_bias(x[:rows * N].reshape(rows, N), b[:N], out[:rows * N].reshape(rows, N))
    out[rows * N:n] = x[rows * N:n] + b[:n - rows * N]


#: ``out[i] = x[i] + b[i % N]`` (a bias broadcast over the rows of an ``[*, N]`` tensor);
#: launch over ``grid(n)``. ``b`` holds ``N`` (a launch shorter than a row still binds the whole
#: bias: a shorter one was read past its end on cpu and clamped on wgpu).
add_bias = elementwise("add_bias", [("x", "f32", R), ("b", "f32", R), ("out", "f32", W)],
                       "x[i] + b[i % {N}]", [("N", "u32")], _add_bias_cpu,
                       elements={"x": "n", "out": "n", "b": "N"})

# ---------------------------------------------------------------------------------------------
# Embedding gather


def _embedding_cpu(ids, types, word, pos, ttab, out, *, H, S, n, count):
    rows = n // H
    if n % H:                                       # (wgpu would write a partial row)
        raise ValueError(f"embedding: n = {n} is not a multiple of H = {H}")
    if ids.size < rows or types.size < rows:        # (the loop would read past them)
        raise IndexError(f"embedding: ids/types hold {min(ids.size, types.size)} rows, "
                         f"n / H = {rows}")
    tables = [t[:t.size - t.size % H].reshape(-1, H) for t in (word, pos, ttab)]
    for name, idx, tab in (("ids", ids[:rows], tables[0]), ("types", types[:rows], tables[2]),
                           ("positions", np.array([min(rows, S) - 1]), tables[1])):
        if rows and (idx.min() < 0 or idx.max() >= tab.shape[0]):   # the loop does not check
            raise IndexError(f"embedding: {name} outside [0, {tab.shape[0]})")
    _loops(n).embedding(ids[:rows], types[:rows], *tables, S, out[:rows * H].reshape(rows, H))


#: ``out[r, c] = word[ids[r], c] + pos[r % S, c] + ttab[types[r], c]`` for ``r < n / H`` rows
#: (``S`` tokens per sequence; positions restart at 0 in each; ``H``, ``S >= 1``: 0 is a
#: ``ValueError`` at the call, ``Kernel.ranges``). ``ids``/``types`` are ``i32``
#: and must index inside their tables (rows: a table's elements over ``H``), hold ``n / H`` rows
#: each, ``S`` must not exceed the rows of ``pos`` and ``n`` must be a multiple of ``H``: outside
#: them the launch fails with ``LaunchError`` (``IndexError``/``ValueError`` on cpu; a device-side
#: check on wgpu, ``Kernel.checks``, found after the submit; its output reads raise). cuda does
#: not check. Launch over ``grid(n)``.
embedding = program(
    "embedding", [("ids", "i32", R), ("types", "i32", R), ("word", "f32", R), ("pos", "f32", R),
                  ("ttab", "f32", R), ("out", "f32", W)],
    [("H", "u32"), ("S", "u32"), ("n", "u32")], (WORKGROUP, 1, 1), f"""
    let i = (wg.y * nwg.x + wg.x) * {WORKGROUP}u + lidx;
    if (p.n % p.H != 0u) {{
        if (i == 0u) {{ atomicMax(&err_flag[0], 5u); }}
    }} else if (i < p.n) {{
        let r = i / p.H;
        let c = i % p.H;
        let w = u32(ids[r]);
        let t = u32(types[r]);
        let q = r % p.S;
        if (r >= arrayLength(&ids) || r >= arrayLength(&types)) {{
            atomicMax(&err_flag[0], 4u);
        }} else if (w >= arrayLength(&word) / p.H) {{
            atomicMax(&err_flag[0], 1u);
        }} else if (t >= arrayLength(&ttab) / p.H) {{
            atomicMax(&err_flag[0], 2u);
        }} else if (q >= arrayLength(&pos) / p.H) {{
            atomicMax(&err_flag[0], 3u);
        }} else {{
            out[i] = word[w * p.H + c] + pos[q * p.H + c] + ttab[t * p.H + c];
        }}
    }}""", cpu=_embedding_cpu, checks=("ids outside the rows of word", "types outside the rows of "
                                       "ttab", "positions (S) outside the rows of pos",
                                       "ids/types hold fewer than n / H rows",
                                       "n is not a multiple of H"),
    elements={"out": "n"}, ranges={"H": (1, None), "S": (1, None)})

# ---------------------------------------------------------------------------------------------
# Matmul: out[M, N] = A[M, K] @ W[K, N] (+ b[N]) (then GELU)


#: multiply-adds per piece when a matmul is dealt out to several threads (about 60 µs of one
#: AVX-512 core): a product of fewer than two pieces runs on the calling thread alone
MM_PIECE_MACS = 1 << 22
#: most pieces per thread a matmul is cut into (more balance the load when a thread stalls;
#: each piece packs its own copy of the [M, K] input)
MM_PIECES_PER_THREAD = 2
#: most rows (tokens) of a kernel that runs as one call on BLAS's or numba's own threads while
#: the process has the cores to itself (:meth:`runtime.cpu_threads.ThreadRule.whole_call`);
#: larger ones are dealt out in pieces even then (MiniLM at 1,024 tokens, quiet: 62 sentences/s
#: in pieces, 52 whole)
WHOLE_ROWS = 512


def mm_pieces(M: int, N: int, K: int, threads: int) -> list:
    """The blocks ``(r0, r1, c0, c1)`` of an ``[M, N] = [M, K] @ [K, N]`` product's output that
    :func:`matmul` deals out to ``threads`` threads: one block when ``threads <= 1`` or the
    product has fewer than ``2 * MM_PIECE_MACS`` multiply-adds, else up to
    ``MM_PIECES_PER_THREAD`` per thread of at least ``MM_PIECE_MACS`` each (so a thread the OS
    does not run holds up a small piece, and the others take the rest): column blocks
    (multiples of 16 columns) when ``N >= M`` (each piece reads all of the small ``[M, K]``
    input and its own columns of the weight), else row blocks."""
    n = min(MM_PIECES_PER_THREAD * threads, M * N * K // MM_PIECE_MACS) if threads > 1 else 1
    if n < 2:
        return [(0, M, 0, N)]
    if N >= M:
        step = -(-N // (16 * n)) * 16               # ceil(N / n), rounded up to 16
        return [(0, M, c, min(N, c + step)) for c in range(0, N, step)]
    step = -(-M // n)
    return [(r, min(M, r + step), 0, N) for r in range(0, M, step)]


def _whole(A, W, y) -> int:
    """``y = A @ W`` as one call on OpenBLAS's own threads when the rule allows it
    (``RULE.whole_call``; timed into ``RULE.whole``): returns its threads, or 0 (nothing done:
    pieces). A fork waits while a thread is in here (``cpu_threads.WHOLE_CODES``, SOAK9):
    OpenBLAS's fork handler, racing a threaded call's workers, waited for ever for one of
    them, and the forking process hung with the GIL held."""
    n = RULE.whole_call()
    if n:
        t0, c0 = time.perf_counter(), time.thread_time()
        np.matmul(A, W, out=y)
        RULE.whole.record(time.perf_counter() - t0, time.thread_time() - c0, n)
    return n


WHOLE_CODES.add(_whole.__code__)


def _matmul_cpu(bias: bool, act: str | None):
    code = 1 if act == "gelu" else 0

    def run(a, w, *rest, M, N, K, count):
        # BLAS sgemm on blocks of the output (mm_pieces) dealt out to the thread rule's threads
        # (cpu_threads.FAN_OUT: whichever thread asks next takes the next block, BLAS at one
        # thread; threads that wait sleep), each block's bias/GELU epilogue applied in place
        # right after its product, on the same thread. OpenBLAS's own pool, which splits a
        # product statically and spin-waits after it, runs only a whole product of at most
        # WHOLE_ROWS rows while the process has the cores to itself (RULE.whole_call), timed
        # so that busy neighbours turn it off (cpu_threads.WholeCalls).
        b, out = rest if bias else (None, rest[0])
        A, W = a[:M * K].reshape(M, K), w[:K * N].reshape(K, N)
        y = out[:M * N].reshape(M, N)
        loops = _loops(1)
        bb = b[:N] if bias else None

        def piece(p):
            r0, r1, c0, c1 = p
            np.matmul(A[r0:r1], W[:, c0:c1], out=y[r0:r1, c0:c1])
            if bias:
                loops.bias_act_block(y, bb, code, r0, r1, c0, c1)
        if M <= WHOLE_ROWS and _whole(A, W, y):            # one call on BLAS's threads
            if bias:
                _loops(M * N).bias_act_block(y, bb, code, 0, M, 0, N)
            return
        threads = RULE.threads()
        t0 = time.perf_counter()
        FAN_OUT.run(_one_thread_piece(piece), mm_pieces(M, N, K, threads), threads)
        RULE.record(M * N * K, time.perf_counter() - t0, threads, (M, N, K))   # ThreadChoice
    return run


def _matmul(name: str, bias: bool, act: str | None, rows: int = 8):
    # A workgroup of 16x16 invocations computes a (16 rows) x 128 block of out; invocation (x, y)
    # owns rows y + 16 i (i < rows) and columns x + 16 j (j < 8), so neighbouring invocations
    # load the W tile and store out contiguously. The A tile is stored k-major so the inner loop
    # reads both tiles by k. The accumulators are unrolled scalars (Python writes the lines):
    # indexed local arrays spill to memory on some compilers (llvmpipe: 2x slower).
    th, bk, tn, tm = 16, MM_BK, MM_TILE, 16 * rows
    ri, cj = range(rows), range(tn // th)
    accs = "\n".join(f"    var c{i}{j} = 0.0f;" for i in ri for j in cj)
    inner = "\n".join([f"            let a{i} = As[kk * {tm}u + lid.y + {th * i}u];" for i in ri]
                       + [f"            let w{j} = Ws[kk * {tn}u + lid.x + {th * j}u];" for j in cj]
                       + [f"            c{i}{j} += a{i} * w{j};" for i in ri for j in cj])
    stores = [f"    let row{i} = m0 + lid.y + {th * i}u;" for i in ri]
    for j in cj:
        stores.append(f"    let col{j} = n0 + lid.x + {th * j}u;")
        if bias:
            stores.append(f"    var b{j} = 0.0f;")
            stores.append(f"    if (col{j} < p.N) {{ b{j} = bias[col{j}]; }}")
    for i in ri:
        for j in cj:
            v = f"c{i}{j}" + (f" + b{j}" if bias else "")
            v = f"gelu_erf({v})" if act == "gelu" else v
            stores.append(f"    if (row{i} < p.M && col{j} < p.N) "
                          f"{{ out[row{i} * p.N + col{j}] = {v}; }}")
    body = f"""
    let m0 = wg.y * {tm}u;
    let n0 = wg.x * {tn}u;
{accs}
    for (var k0 = 0u; k0 < p.K; k0 += {bk}u) {{
        for (var e = lidx; e < {bk * tm}u; e += 256u) {{
            let am = e / {bk}u;
            let ak = e % {bk}u;
            var x = 0.0f;
            if (m0 + am < p.M && k0 + ak < p.K) {{ x = a[(m0 + am) * p.K + k0 + ak]; }}
            As[ak * {tm}u + am] = x;
        }}
        for (var e = lidx; e < {bk * tn}u; e += 256u) {{
            let wk = e / {tn}u;
            let wn = e % {tn}u;
            var y = 0.0f;
            if (k0 + wk < p.K && n0 + wn < p.N) {{ y = w[(k0 + wk) * p.N + n0 + wn]; }}
            Ws[wk * {tn}u + wn] = y;
        }}
        workgroupBarrier();
        for (var kk = 0u; kk < {bk}u; kk++) {{
{inner}
        }}
        workgroupBarrier();
    }}
""" + "\n".join(stores)
    binds = [("a", "f32", R), ("w", "f32", R)] + ([("bias", "f32", R)] if bias else [])
    return program(name, binds + [("out", "f32", W)], [("M", "u32"), ("N", "u32"), ("K", "u32")],
                   (th, th, 1), body, shared=[("As", "f32", bk * tm), ("Ws", "f32", bk * tn)],
                   helpers=_GELU_HELPERS if act else "", cpu=_matmul_cpu(bias, act),
                   elements={"a": ("M", "K"), "w": ("K", "N"), "out": ("M", "N"),
                             **({"bias": "N"} if bias else {})})


_EPILOGUES = {"matmul": (False, None), "matmul_bias": (True, None),
              "matmul_bias_gelu": (True, "gelu")}
#: rows of out per workgroup of each matmul variant (16 x rows-per-invocation).
MM_ROWS = (128, 64, 16)
_MM = {(name, tm): _matmul(name if tm == MM_ROWS[0] else f"{name}_m{tm}", *ep, rows=tm // 16)
       for name, ep in _EPILOGUES.items() for tm in MM_ROWS}

#: ``out[M, N] = a[M, K] @ w[K, N]``; launch over ``matmul_count(M, N)`` (see :func:`matmul_for`).
matmul = _MM["matmul", 128]
#: ``out[M, N] = a[M, K] @ w[K, N] + bias[N]``; launch over ``matmul_count(M, N)``.
matmul_bias = _MM["matmul_bias", 128]
#: ``out[M, N] = gelu(a[M, K] @ w[K, N] + bias[N])``; launch over ``matmul_count(M, N)``.
matmul_bias_gelu = _MM["matmul_bias_gelu", 128]


def matmul_count(M: int, N: int, tile_rows: int = MM_ROWS[0]) -> tuple:
    """Workgroups ``(x, y, 1)`` for an ``[M, N]`` matmul output in ``tile_rows x 128`` tiles.

    Raises:
        ValueError: more than 65,535 tiles along a dimension.
    """
    x, y = -(-int(N) // MM_TILE), -(-int(M) // int(tile_rows))
    if max(x, y) > 65535:
        raise ValueError(f"matmul [{M}, {N}] needs {x}x{y} tiles; at most 65,535 per dimension")
    return (max(x, 1), max(y, 1), 1)


def matmul_for(M: int, N: int, bias: bool = False, activation: str | None = None) -> tuple:
    """The matmul variant and workgroup count for an ``[M, N]`` output.

    Small ``M`` (a batch of short sequences) gets a kernel with shorter tiles, so less of each
    tile is padding: ``M <= 16`` -> 16-row tiles, ``M <= 64`` -> 64-row tiles, else 128.

    Args:
        M, N: output rows and columns.
        bias: add a ``[N]`` bias; activation: ``None`` or ``"gelu"`` (needs ``bias``).
    Returns: ``(kernel, count)``; params are ``{"M", "N", "K"}``.
    Raises: ``ValueError`` for an unknown combination.
    """
    name = {(False, None): "matmul", (True, None): "matmul_bias",
            (True, "gelu"): "matmul_bias_gelu"}.get((bool(bias), activation))
    if name is None:
        raise ValueError(f"no matmul with bias={bias}, activation={activation!r}")
    tm = next((t for t in reversed(MM_ROWS) if M <= t), MM_ROWS[0])
    return _MM[name, tm], matmul_count(M, N, tm)

# ---------------------------------------------------------------------------------------------
# Row kernels: one workgroup per row, a tree reduction in workgroup memory.


def rows_count(rows: int) -> tuple:
    """Workgroups ``(x, y, 1)`` giving one workgroup per row (row = ``wg.y * nwg.x + wg.x``)."""
    return grid(rows, 1)


def _layer_norm_cpu(residual: bool):
    def run(x, *rest, rows, n, eps, count):
        r, g, b, out = rest if residual else (x, *rest)
        m = rows * n
        X, Rs, G, Bt, O = (x[:m].reshape(rows, n), r[:m].reshape(rows, n), g[:n], b[:n],
                           out[:m].reshape(rows, n))
        loops, e = _loops(1), float(eps)
        threads = RULE.threads() if m >= LOOP_GRAIN else 1
        if threads > 1 and rows <= WHOLE_ROWS and RULE.whole.on:   # numba's threads
            _loops(m).layer_norm(X, Rs, residual, G, Bt, e, O)
            return
        if threads <= 1:
            loops.layer_norm(X, Rs, residual, G, Bt, e, O)
            return
        step = -(-rows // (MM_PIECES_PER_THREAD * threads))

        def piece(r0):                 # blocks of rows dealt out like a matmul's (FAN_OUT)
            r1 = min(rows, r0 + step)
            loops.layer_norm(X[r0:r1], Rs[r0:r1], residual, G, Bt, e, O[r0:r1])
        FAN_OUT.run(_one_thread_piece(piece), range(0, rows, step), threads)
    return run


def _layer_norm(name: str, residual: bool):
    # The row is scaled by its largest magnitude first (sc), so the variance of values up to
    # float32's limit does not overflow f32 (the cpu source sums in float64): with 1e30 inputs
    # an unscaled ``d * d`` is inf, rstd 0, and the row would silently collapse to ``beta``.
    load = "(x[base + c] + res[base + c])" if residual else "x[base + c]"
    body = f"""
    let row = wg.y * nwg.x + wg.x;
    let valid = row < p.rows;
    let base = row * p.n;
    var m = 0.0f;
    if (valid) {{ for (var c = lidx; c < p.n; c += {ROW_WORKGROUP}u) {{ m = max(m, abs({load})); }} }}
    red[lidx] = m;{tree_reduce("max", ROW_WORKGROUP)}
    let sc = select(1.0f, red[0], red[0] > 0.0f && red[0] < 3.0e38f);
    workgroupBarrier();
    var s = 0.0f;
    if (valid) {{ for (var c = lidx; c < p.n; c += {ROW_WORKGROUP}u) {{ s += {load} / sc; }} }}
    red[lidx] = s;{tree_reduce("+", ROW_WORKGROUP)}
    let mean = red[0] / f32(p.n);
    workgroupBarrier();
    var q = 0.0f;
    if (valid) {{
        for (var c = lidx; c < p.n; c += {ROW_WORKGROUP}u) {{
            let d = {load} / sc - mean;
            q += d * d;
        }}
    }}
    red[lidx] = q;{tree_reduce("+", ROW_WORKGROUP)}
    let rstd = 1.0f / sqrt(red[0] / f32(p.n) + p.eps / sc / sc);
    if (valid) {{
        for (var c = lidx; c < p.n; c += {ROW_WORKGROUP}u) {{
            out[base + c] = ({load} / sc - mean) * rstd * gamma[c] + beta[c];
        }}
    }}"""
    binds = [("x", "f32", R)] + ([("res", "f32", R)] if residual else [])
    binds += [("gamma", "f32", R), ("beta", "f32", R), ("out", "f32", W)]
    return program(name, binds, [("rows", "u32"), ("n", "u32"), ("eps", "f32")],
                   (ROW_WORKGROUP, 1, 1), body, shared=[("red", "f32", ROW_WORKGROUP)],
                   cpu=_layer_norm_cpu(residual),
                   elements={"x": ("rows", "n"), "out": ("rows", "n"), "gamma": "n", "beta": "n",
                             **({"res": ("rows", "n")} if residual else {})})


#: ``out[r] = (x[r] - mean) / sqrt(var + eps) * gamma + beta`` per row of ``[rows, n]`` (biased
#: variance, as torch); launch over :func:`rows_count`.
layer_norm = _layer_norm("layer_norm", False)
#: layer norm of ``x + res`` (the residual add fused); launch over :func:`rows_count`.
add_layer_norm = _layer_norm("add_layer_norm", True)


def _l2_cpu(x, out, *, rows, n, count):
    _loops(rows * n).l2_normalize(x[:rows * n].reshape(rows, n), out[:rows * n].reshape(rows, n))


#: ``out[r] = x[r] / max(||x[r]||_2, 1e-12)`` per row of ``[rows, n]`` (torch ``F.normalize``);
#: launch over :func:`rows_count`. The row is scaled by its largest magnitude first, so values
#: up to float32's limit do not overflow the sum of squares (the cpu source sums in float64),
#: and a NaN norm stays NaN (``nmax``: WGSL's ``max`` may drop it).
l2_normalize = program(
    "l2_normalize", [("x", "f32", R), ("out", "f32", W)], [("rows", "u32"), ("n", "u32")],
    (ROW_WORKGROUP, 1, 1), f"""
    let row = wg.y * nwg.x + wg.x;
    let valid = row < p.rows;
    let base = row * p.n;
    var m = 0.0f;
    if (valid) {{ for (var c = lidx; c < p.n; c += {ROW_WORKGROUP}u) {{ m = max(m, abs(x[base + c])); }} }}
    red[lidx] = m;{tree_reduce("max", ROW_WORKGROUP)}
    let sc = select(1.0f, red[0], red[0] > 0.0f && red[0] < 3.0e38f);
    workgroupBarrier();
    var s = 0.0f;
    if (valid) {{
        for (var c = lidx; c < p.n; c += {ROW_WORKGROUP}u) {{
            let v = x[base + c] / sc;
            s += v * v;
        }}
    }}
    red[lidx] = s;{tree_reduce("+", ROW_WORKGROUP)}
    let inv = 1.0f / nmax(sqrt(red[0]), 1e-12f / sc);
    if (valid) {{
        for (var c = lidx; c < p.n; c += {ROW_WORKGROUP}u) {{ out[base + c] = x[base + c] / sc * inv; }}
    }}""",
    shared=[("red", "f32", ROW_WORKGROUP)], helpers=NAN_HELPERS, cpu=_l2_cpu,
    elements={"x": ("rows", "n"), "out": ("rows", "n")})

# ---------------------------------------------------------------------------------------------
# Masked mean pooling


def _mean_pool_cpu(x, mask, out, *, S, H, n, count):
    B = n // H
    if n % H:                                       # (wgpu would write a partial row)
        raise ValueError(f"mean_pool: n = {n} is not a multiple of H = {H}")
    _loops(B * S * H).mean_pool(x[:B * S * H].reshape(B, S, H), mask[:B * S].reshape(B, S),
                       out[:B * H].reshape(B, H))


#: ``out[b, c] = sum_s x[b, s, c] mask[b, s] / max(sum_s mask[b, s], 1e-9)`` for ``x [B, S, H]``,
#: ``mask [B, S]`` (0/1 floats), ``n = B * H`` (``H >= 1``: 0 is a ``ValueError`` at the call; an
#: ``n`` that is not a multiple of ``H`` fails the launch: ``ValueError`` on cpu, a device-side
#: check on wgpu); launch over ``grid(n)``.
mean_pool = program(
    "mean_pool", [("x", "f32", R), ("mask", "f32", R), ("out", "f32", W)],
    [("S", "u32"), ("H", "u32"), ("n", "u32")], (WORKGROUP, 1, 1), f"""
    let i = (wg.y * nwg.x + wg.x) * {WORKGROUP}u + lidx;
    let rows = (p.n / p.H) * p.S;           // B * S, as the cpu source's reshapes
    if (p.n % p.H != 0u) {{
        if (i == 0u) {{ atomicMax(&err_flag[0], 2u); }}
    }} else if (rows * p.H > arrayLength(&x) || rows > arrayLength(&mask)) {{
        if (i == 0u) {{ atomicMax(&err_flag[0], 1u); }}
    }} else if (i < p.n) {{
        let b = i / p.H;
        let c = i % p.H;
        var s = 0.0f;
        var cnt = 0.0f;
        for (var t = 0u; t < p.S; t++) {{
            let m = mask[b * p.S + t];
            s += x[(b * p.S + t) * p.H + c] * m;
            cnt += m;
        }}
        out[i] = s / max(cnt, 1e-9f);
    }}""", cpu=_mean_pool_cpu, elements={"out": "n"}, ranges={"H": (1, None)},
    checks=("x holds fewer than (n / H) * S rows of H, or mask fewer than (n / H) * S values",
            "n is not a multiple of H"))

# ---------------------------------------------------------------------------------------------
# Attention


#: most attention-score elements the cpu source keeps at once per thread (1 MiB of float32): it
#: works through the batch in pieces (sequences, or heads of one sequence) whose scores fit.
ATTN_CPU_CHUNK = 1 << 18
#: multiply-adds (``B * heads * S * S * hd``) from which the cpu source runs its pieces on the
#: thread rule's threads (below, one thread: handing pieces to a pool costs more than it saves)
ATTN_FAN_OUT_MACS = 1 << 22


def _heads_view(buf, B, S, ld, off, heads, hd):
    """``[B, heads, S, hd]`` strided view (no copy) of the heads of a ``[B, S, ld]`` row-major
    buffer whose head columns start at ``off``.

    Raises: ``ValueError`` when the view would reach past the buffer.
    """
    if off + heads * hd > ld or B * S * ld > buf.size:
        raise ValueError(f"attention: heads at column {off} of rows of {ld} over {B}x{S} rows do "
                         f"not fit a buffer of {buf.size} elements")
    # slices and reshapes, not as_strided (its array-interface round trip cost ~5 us a view,
    # four views per attention launch: ~0.1 ms of a 1x16 MiniLM forward)
    cols = buf[:B * S * ld].reshape(B, S, ld)[:, :, off:off + heads * hd]
    return cols.reshape(B, S, heads, hd).transpose(0, 2, 1, 3)


def _attend(views, madd, pieces, S, hd, scale):
    # One thread's pieces (b0, b1, h0, h1) of attention: q (copied into contiguous scratch) @ k^T
    # (a strided view BLAS takes as transposed) -> scores in scratch; scale + mask + max, exp +
    # sum, divide: one numba loop over the rows (cpu_loops.softmax_rows); scores @ v (strided
    # view) written straight into out's head columns.
    qv, kv, vv, ov = views
    L = _LOOPS
    buf = _scratch(max((b1 - b0) * (h1 - h0) for b0, b1, h0, h1 in pieces) * S * (S + hd))
    for b0, b1, h0, h1 in pieces:
        n, nh = b1 - b0, h1 - h0
        s = buf[:n * nh * S * S].reshape(n, nh, S, S)
        qc = buf[n * nh * S * S:n * nh * S * (S + hd)].reshape(n, nh, S, hd)
        np.copyto(qc, qv[b0:b1, h0:h1])
        np.matmul(qc, kv[b0:b1, h0:h1].transpose(0, 1, 3, 2), out=s)
        L.softmax_rows(s.reshape(n * nh, S, S), madd[b0:b1], nh, scale)
        np.matmul(s, vv[b0:b1, h0:h1], out=ov[b0:b1, h0:h1])


def _one_thread_piece(fn):
    # numba at one thread on whichever thread runs a piece (numba's count is per calling
    # thread; the worker's next kernel sets its own count again in _loops)
    def run(piece):
        if getattr(_tls, "threads", 0) != 1:
            _tls.threads = _LOOPS.set_threads(1)
        fn(piece)
    return run


def _attention_cpu(q, k, v, mask, out, *, S, heads, hd, ld_in, q_off, k_off, v_off, ld_out,
                   scale, count):
    # Pieces of whole sequences (several when their [heads, S, S] scores fit ATTN_CPU_CHUNK) or
    # of heads of one sequence; from ATTN_FAN_OUT_MACS on, the pieces are dealt out to the
    # thread rule's threads (cpu_threads.FAN_OUT: this worker and pool threads take pieces in
    # turn, 1-thread BLAS and numba each; up to MM_PIECES_PER_THREAD per thread, so a stalled
    # thread holds up a small piece), as torch's CPU attention runs single-threaded GEMMs in a
    # parallel loop. Nothing is allocated once warm.
    B = count[1] // heads
    _loops(B * heads * S * S)
    views = tuple(_heads_view(t, B, S, ld_in, off, heads, hd)
                  for t, off in ((q, q_off), (k, k_off), (v, v_off)))
    views += (_heads_view(out, B, S, ld_out, 0, heads, hd),)
    want = RULE.threads() if B * heads * S * S * hd >= ATTN_FAN_OUT_MACS else 1
    hc = max(1, min(heads, ATTN_CPU_CHUNK // (S * S)))
    most = want * MM_PIECES_PER_THREAD if want > 1 else 1     # pieces to aim for
    nb = max(1, min(B, ATTN_CPU_CHUNK // (heads * S * S), -(-B // most))) if hc == heads else 1
    if -(-B // nb) * -(-heads // hc) < most:        # too few pieces: split the sequences' heads
        nb, hc = 1, min(hc, -(-heads // -(-most // B)))
    pieces = [(b0, min(B, b0 + nb), h0, min(heads, h0 + hc))
              for b0 in range(0, B, nb) for h0 in range(0, heads, hc)]
    most = nb * hc * S * (S + hd)
    buf = _scratch(most + B * S)                # this thread's pieces, then the mask
    madd = buf[most:most + B * S].reshape(B, S)
    np.subtract(1.0, mask[:B * S].reshape(B, S), out=madd)     # the additive mask, once
    madd *= np.float32(-1e9)
    sc = np.float32(scale)
    if B * S <= WHOLE_ROWS and RULE.whole_call():   # this thread; BLAS's threads inside
        _attend(views, madd, pieces, S, hd, sc)
    elif want <= 1 or len(pieces) <= 1:
        with RULE.fan_out():                    # BLAS at one thread, as in the pieces
            _attend(views, madd, pieces, S, hd, sc)
    else:
        FAN_OUT.run(_one_thread_piece(lambda piece: _attend(views, madd, (piece,), S, hd, sc)),
                    pieces, want)


def _attention(hd: int):
    # One invocation per query, ATTN_WORKGROUP queries of one (batch, head) per workgroup. Keys
    # and values stream through workgroup memory in tiles of `tk` rows; each invocation keeps
    # an online softmax (running max, running sum, rescaled accumulators), so any sequence length
    # fits and nothing of size S is stored. The head dim is a compile-time constant so q and the
    # accumulators are unrolled scalars (registers), not indexed arrays.
    tk, dd = max(1024 // hd, 1), range(hd)
    qload = "\n".join(f"    let q{d} = q[qbase + {d}u] * p.scale;" for d in dd)
    accs = "\n".join(f"    var o{d} = 0.0f;" for d in dd)
    dot = " + ".join(f"q{d} * Ks[kb + {d}u]" for d in dd)
    upd = "\n".join(f"            o{d} = o{d} * corr + pj * Vs[kb + {d}u];" for d in dd)
    store = "\n".join(f"        out[obase + {d}u] = o{d} * inv;" for d in dd)
    body = f"""
    let rows = (nwg.y / p.heads) * p.S;      // the buffers' rows (B * S), as the cpu source's
    let span = p.heads * {hd}u;
    if (p.q_off + span > p.ld_in || p.k_off + span > p.ld_in || p.v_off + span > p.ld_in
            || span > p.ld_out || rows * p.ld_in > arrayLength(&q)
            || rows * p.ld_in > arrayLength(&k) || rows * p.ld_in > arrayLength(&v)
            || rows * p.ld_out > arrayLength(&out) || rows > arrayLength(&mask)) {{
        if (lidx == 0u) {{ atomicMax(&err_flag[0], 1u); }}
        return;
    }}
    let b = wg.y / p.heads;
    let h = wg.y % p.heads;
    let i = wg.x * {ATTN_WORKGROUP}u + lidx;
    let qi = min(i, p.S - 1u);
    let qbase = (b * p.S + qi) * p.ld_in + p.q_off + h * {hd}u;
{qload}
{accs}
    let neg_inf = bitcast<f32>(0xff800000u);
    var mx = neg_inf;       // a row of -inf scores gives NaN, as on cpu (below)
    var l = 0.0f;
    for (var j0 = 0u; j0 < p.S; j0 += {tk}u) {{
        for (var e = lidx; e < {tk * hd}u; e += {ATTN_WORKGROUP}u) {{
            let j = j0 + e / {hd}u;
            let row = (b * p.S + min(j, p.S - 1u)) * p.ld_in + h * {hd}u + e % {hd}u;
            Ks[e] = k[row + p.k_off];
            Vs[e] = v[row + p.v_off];
        }}
        for (var e = lidx; e < {tk}u; e += {ATTN_WORKGROUP}u) {{
            var mv = 0.0f;
            if (j0 + e < p.S) {{ mv = mask[b * p.S + j0 + e]; }}
            Ms[e] = mv;
        }}
        workgroupBarrier();
        let jn = min({tk}u, p.S - j0);
        for (var jj = 0u; jj < jn; jj++) {{
            let kb = jj * {hd}u;
            let sj = {dot} + (1.0f - Ms[jj]) * -1.0e9f;
            let mnew = max(mx, sj);
            // as the cpu softmax (exact, cpu_loops.exp_neg) on non-finite scores: exp of at
            // least -87 (1.6e-38, never 0: a weight rounded to 0 turned an inf in v into NaN,
            // 0 * inf, where cpu keeps it inf; select keeps a NaN, max would not surely); a
            // -inf score while the maximum is -inf weighs 1 now, rescaled once a finite one
            // comes (1.6e-38 then, as on cpu); a row of -inf scores is NaN (below)
            let ninf = mx == neg_inf && sj == neg_inf;      // (not a NaN sj: max may drop it)
            let dc = select(mx - mnew, 0.0f, ninf);
            let dj = select(sj - mnew, 0.0f, ninf);
            let corr = exp(select(dc, -87.0f, dc < -87.0f));
            let pj = exp(select(dj, -87.0f, dj < -87.0f));
            l = l * corr + pj;
            mx = mnew;
{upd}
        }}
        workgroupBarrier();
    }}
    if (i < p.S) {{
        let inv = select(1.0f / l, bitcast<f32>(0x7fc00000u), mx == neg_inf);   // all -inf: NaN
        let obase = (b * p.S + i) * p.ld_out + h * {hd}u;
{store}
    }}"""
    return program(
        f"attention_hd{hd}", [("q", "f32", R), ("k", "f32", R), ("v", "f32", R),
                              ("mask", "f32", R), ("out", "f32", W)],
        [("S", "u32"), ("heads", "u32"), ("hd", "u32"), ("ld_in", "u32"), ("q_off", "u32"),
         ("k_off", "u32"), ("v_off", "u32"), ("ld_out", "u32"), ("scale", "f32")],
        (ATTN_WORKGROUP, 1, 1), body,
        shared=[("Ks", "f32", tk * hd), ("Vs", "f32", tk * hd), ("Ms", "f32", tk)],
        cpu=_attention_cpu, ranges={"hd": (hd, hd)},     # (the sources compile hd in)
        checks=("heads past a row (offset + heads * hd > ld) or rows past a buffer (B * S "
                "rows of ld_in / ld_out, B * S mask values)",))


_ATTN: dict = {}


def attention_for(hd: int):
    """The attention kernel for head dimension ``hd`` (1..``ATTN_MAX_HEAD_DIM``; built once).

    Multi-head scaled dot-product attention with an additive key mask:
    ``out[b, i, h*hd:(h+1)*hd] = softmax_j(scale q_i . k_j + (1 - mask[b, j]) * -1e9) @ v_j``.
    Rows of ``q``/``k``/``v`` have stride ``ld_in`` elements and their heads start at column
    ``*_off`` (so one packed ``[B, S, 3H]`` QKV buffer can be bound three times); ``out`` rows have
    stride ``ld_out``. Launch over :func:`attention_count`.

    Raises: ``ValueError`` for ``hd`` out of range.
    """
    if not 1 <= hd <= ATTN_MAX_HEAD_DIM:
        raise ValueError(f"attention: head dim {hd} is outside 1..{ATTN_MAX_HEAD_DIM}")
    if hd not in _ATTN:
        k = covers(_attention(hd), lambda c, p: p["heads"] > 0 and c[1] >= p["heads"]
                   and c[0] >= groups(p["S"], ATTN_WORKGROUP) and c[1] % p["heads"] == 0,
                   "attention_count(batch, S, heads)")
        rows = lambda c, p: c[1] // max(p["heads"], 1) * p["S"]          # noqa: E731 - B * S
        # out: B * S rows of ld_out, all of them only when the heads fill a row
        _ATTN[hd] = touches(k, {"q": lambda c, p: rows(c, p) * p["ld_in"],
                                "k": lambda c, p: rows(c, p) * p["ld_in"],
                                "v": lambda c, p: rows(c, p) * p["ld_in"], "mask": rows,
                                "out": lambda c, p: rows(c, p) * p["ld_out"]
                                if p["heads"] * p["hd"] == p["ld_out"] else 0})
    return _ATTN[hd]


#: attention with head dim 32 (MiniLM, BERT-small); other head dims: :func:`attention_for`.
attention = attention_for(32)


def attention_count(batch: int, seq: int, heads: int) -> tuple:
    """Workgroups ``(ceil(seq / 64), batch * heads, 1)`` for the attention kernels.

    Raises:
        ValueError: ``batch * heads > 65535``.
    """
    if batch * heads > 65535:
        raise ValueError(f"attention: batch * heads = {batch * heads} exceeds 65,535 workgroups")
    return (max(1, -(-int(seq) // ATTN_WORKGROUP)), int(batch * heads), 1)


# The workgroup counts the kernels need (Kernel.count_error, pointwise.covers): their cpu
# bodies do the whole work whatever the count, the GPU sources the part it covers, so a short
# count is refused on every backend instead of giving different values on each.
for _k in (gelu, embedding, mean_pool):
    covers(_k, covers_total("n"), "grid(n)")
touches(mean_pool, {"x": lambda c, p: p["n"] // max(p["H"], 1) * p["S"] * p["H"],   # B * S
                    "mask": lambda c, p: p["n"] // max(p["H"], 1) * p["S"]})           # rows
for _k in (layer_norm, add_layer_norm, l2_normalize):
    covers(_k, covers_total("rows", 1), "rows_count(rows)")
for (_name, _tm), _k in _MM.items():
    covers(_k, lambda c, p, tm=_tm: c[0] >= groups(p["N"], MM_TILE) and c[1] >= groups(p["M"], tm),
           f"matmul_count(M, N, {_tm}) (matmul_for)")


__all__ = ["gelu", "add_bias", "embedding", "matmul", "matmul_bias", "matmul_bias_gelu",
           "matmul_count", "matmul_for", "layer_norm", "add_layer_norm", "l2_normalize",
           "rows_count", "mean_pool", "attention", "attention_for", "attention_count", "erf_np",
           "gelu_np", "MM_TILE", "ATTN_MAX_HEAD_DIM"]
