"""Compiled loops behind the cpu sources of :mod:`runtime.kernels.nn` (numba).

Each function works in place on dense row-major float32 arrays that the cpu backend hands to a
kernel (views of device buffers), so a kernel allocates nothing per call. Row kernels run
``prange`` over rows on numba's thread pool; the per-element arithmetic is written so that LLVM
vectorises it (``error_model="numpy"``: no zero-division branch; no libm call inside the loops).

Numerics:

- GELU uses the exact-erf form ``0.5 x (1 + erf(x / sqrt 2))`` with erf evaluated in float64 as
  ``z P(z^2) / Q(z^2)`` on ``z`` clamped to ``[-4, 4]`` (``erf(4) = 1 - 1.5e-8``, below float32
  resolution). ``P``/``Q`` (degrees 6 and 5) were fitted for this module by Lawson-reweighted
  least squares on 20,000 points of ``(0, 4]`` against ``math.erf``; max absolute error 1.5e-9
  inside, 1.5e-8 past the clamp (``tests/kernels/test_cpu_loops.py`` checks < 2e-8 on a dense grid;
  float32's spacing near 1 is 6e-8), so the result is exact to float32 rounding. libm's ``erf``
  would be as exact but is a scalar call per element that LLVM cannot vectorise (~10x slower).
- Layer norm and L2 norm accumulate in float64 (one pass for the sum, one for the centred
  variance, one to write), as the WGSL/CUDA sources do in float32.
- fastmath is limited to ``nsz, arcp, contract, reassoc`` (reductions vectorise); NaN and inf keep
  their IEEE meaning, so a bad input shows up in the output instead of being optimised away.

Compiled on first use and cached on disk (``cache=True``: ``__pycache__`` beside this file, or
numba's user cache directory when that is read-only).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import numba
import numpy as np
from numba import njit, prange


def _start_pool() -> None:
    """Start numba's thread pool with its OpenMP runtime told to sleep as soon as a parallel
    region ends (``OMP_WAIT_POLICY=PASSIVE``; :mod:`runtime.cpu_threads` says why), unless
    the user set the variable. GNU OpenMP reads it once, when numba loads it here; the variable
    is removed again, so it reaches neither other libraries nor child processes."""
    mine = "OMP_WAIT_POLICY" not in os.environ
    if mine:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        numba.get_num_threads()          # loads the threading layer (and its OpenMP) now
    finally:
        if mine:
            del os.environ["OMP_WAIT_POLICY"]
    # SOAK8: every numba.set_num_threads (set_threads, before each kernel's loops) enters the
    # layer's start-up lock, a multiprocessing RLock whose Python-level __enter__ a
    # KeyboardInterrupt can leave held (every later kernel's loops then waited for ever). The
    # layer is up: the lock only guards its "started" flag now, which a plain RLock does.
    par = sys.modules.get("numba.np.ufunc.parallel")
    if getattr(par, "_is_initialized", False) and hasattr(par, "_backend_init_process_lock"):
        par._backend_init_process_lock = threading.RLock()


_start_pool()
#: the size of numba's thread pool (``NUMBA_NUM_THREADS``; default: the cores); 1 in a process
#: forked from one that ran GNU OpenMP (see :func:`_after_fork_in_child`)
POOL = numba.config.NUMBA_NUM_THREADS


def _after_fork_in_child() -> None:
    """A forked child of a process whose numba runs on GNU OpenMP (the ``omp`` layer on Linux)
    cannot use that pool: its threads stayed in the parent, libgomp waits for them at the next
    parallel region, and numba guards against that by killing the child (``SIGTERM``: "fork()
    called from a process already using GNU OpenMP"). A region of one thread starts no team,
    so the child runs every loop on its calling thread: numba's count at 1 here (``POOL``), the
    layer's default for new threads at 1, and the layer told that this process is its own
    parent now (``launch_threads`` records the pid it runs in), so its guard lets it through.
    BLAS (OpenBLAS re-creates its pool after a fork) and attention's fan-out threads keep the
    child's other cores busy."""
    global POOL
    par = sys.modules.get("numba.np.ufunc.parallel")     # SOAK8: the start-up locks (plain
    if getattr(par, "_is_initialized", False):           # RLocks here, see _start_pool) may
        par._backend_init_process_lock = threading.RLock()   # be held by a parent thread
        par._backend_init_thread_lock = threading.RLock()    # that did not come along
    try:
        if numba.threading_layer() != "omp":
            return
        from numba.np.ufunc import omppool
    except (ImportError, ValueError):                 # layer not loaded: nothing inherited
        return
    if getattr(omppool, "openmp_vendor", "GNU") != "GNU":
        return
    POOL = 1
    ctypes.CFUNCTYPE(None, ctypes.c_int)(omppool.launch_threads)(1)
    numba.set_num_threads(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_FAST = {"nsz", "arcp", "contract", "reassoc"}
_ROWS = dict(parallel=True, fastmath=_FAST, error_model="numpy", cache=True, nogil=True)
_INLINE = dict(fastmath=_FAST, error_model="numpy", inline="always")

# erf(z) ~= z P(z^2) / Q(z^2) on |z| <= 4 (see the module docstring).
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = (
    1.128379182098878, 0.1847115549117835, 0.05433247816035289, 0.003839542040025853,
    0.0003826810668233114, 4.78021424105482e-06, -1.3665194364964606e-08)
_Q1, _Q2, _Q3, _Q4, _Q5 = (0.497029898709792, 0.11382656058070079, 0.015453503074644395,
                           0.001309566626592332, 6.400618639030697e-05)


@njit(**_INLINE)
def erf(x):
    """erf of a float64 scalar (|error| < 1.6e-8; see the module docstring). Past |x| = 4 it
    is +-1 (|1 - erf(4)| = 1.5e-8), so gelu of -inf is NaN and of -1e30 is -0, as the WGSL and
    CUDA sources and torch give (a clamp to erf(+-4) made them -inf and -7.7e21); NaN stays."""
    if x > 4.0:
        return 1.0
    if x < -4.0:
        return -1.0
    z = x
    u = z * z
    p = (((((_P6 * u + _P5) * u + _P4) * u + _P3) * u + _P2) * u + _P1) * u + _P0
    q = ((((_Q5 * u + _Q4) * u + _Q3) * u + _Q2) * u + _Q1) * u + 1.0
    return z * p / q


# exp(x) = 2^n exp(r), x = n ln2 + r, |r| <= ln2 / 2 (ln2 split in two for an exact reduction)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_LOG2E = np.float32(1.4426950408889634)


@njit(**_INLINE)
def exp_neg(x):
    """exp of a float32 ``x <= 0`` (softmax after the row maximum), relative error < 4e-7.

    ``exp(r)`` by its Taylor polynomial of degree 7 (remainder < 5e-9 on ``|r| <= ln2/2``; the
    rest is float32 rounding in Horner's steps: a few ulps, as numpy's SIMD ``expf``), 2^n
    written into the float's exponent bits; ``x`` below -87 is taken as -87 (exp = 1.6e-38, a
    float32 normal). Written out so that LLVM vectorises it: a libm ``expf`` call is scalar.
    """
    x = max(x, np.float32(-87.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.0 / 5040)
    p = p * r + np.float32(1.0 / 720)
    p = p * r + np.float32(1.0 / 120)
    p = p * r + np.float32(1.0 / 24)
    p = p * r + np.float32(1.0 / 6)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * np.int32((np.int32(n) + np.int32(127)) << 23).view(np.float32)


@njit(**_ROWS)
def exp_neg_array(x, out):
    """``out[i] = exp_neg(x[i])`` for float32 1-D arrays (the scalar of this module; for tests)."""
    for i in prange(x.shape[0]):
        out[i] = exp_neg(x[i])


@njit(**_INLINE)
def _gelu(v):
    return 0.5 * v * (1.0 + erf(v * 0.7071067811865476))


@njit(**_ROWS)
def erf_array(x, out):
    """``out[i] = erf(x[i])`` for float64 1-D arrays (the scalar of this module; for tests)."""
    for i in prange(x.shape[0]):
        out[i] = erf(x[i])


@njit(**_ROWS)
def gelu(x, out):
    """``out[i] = gelu(x[i])`` over 1-D float32 arrays of one length (may be the same array)."""
    n = x.shape[0]
    block = 4096
    for k in prange((n + block - 1) // block):
        for i in range(k * block, min(n, (k + 1) * block)):
            out[i] = _gelu(np.float64(x[i]))


@njit(**_ROWS)
def bias_act_block(y, b, act, r0, r1, c0, c1):
    """In place on the block ``y[r0:r1, c0:c1]`` of ``y [M, N]``: ``+= b[c0:c1]`` (``b [N]``),
    then GELU when ``act`` is 1 (0: bias only): the epilogue of one piece of a matmul dealt out
    to several threads (:mod:`runtime.kernels.nn`, which runs it at one numba thread). Each
    row's block is taken as a slice ``y[r, c0:c1]``, whose unit stride LLVM vectorises: indexing
    the row by ``j in range(c0, c1)`` did not (measured 6x slower for the bias alone)."""
    bb = b[c0:c1]
    n = bb.shape[0]
    for r in prange(r0, r1):
        row = y[r, c0:c1]
        if act == 1:
            for j in range(n):
                row[j] = _gelu(np.float64(row[j] + bb[j]))
        else:
            for j in range(n):
                row[j] = row[j] + bb[j]


@njit(**_ROWS)
def add_bias(x, b, out):
    """``out [M, N] = x [M, N] + b [N]``."""
    M, N = x.shape
    for r in prange(M):
        for j in range(N):
            out[r, j] = x[r, j] + b[j]


@njit(**_ROWS)
def layer_norm(x, res, has_res, g, b, eps, out):
    """``out[r] = (v - mean) / sqrt(var + eps) * g + b`` per row of ``v = x (+ res)``, ``[R, N]``.

    ``res`` is read only when ``has_res`` (pass ``x`` otherwise). Biased variance, as torch.
    """
    R, N = x.shape
    for r in prange(R):
        o = out[r]
        s = 0.0
        for j in range(N):
            v = x[r, j] + res[r, j] if has_res else x[r, j]
            o[j] = v
            s += v
        mean = s / N
        q = 0.0
        for j in range(N):
            d = o[j] - mean
            q += d * d
        rstd = 1.0 / np.sqrt(q / N + eps)
        for j in range(N):
            o[j] = (o[j] - mean) * rstd * g[j] + b[j]


@njit(**_ROWS)
def l2_normalize(x, out):
    """``out[r] = x[r] / max(||x[r]||_2, 1e-12)`` per row of ``[R, N]``."""
    R, N = x.shape
    for r in prange(R):
        s = 0.0
        for j in range(N):
            s += np.float64(x[r, j]) * x[r, j]
        inv = 1.0 / max(np.sqrt(s), 1e-12)
        for j in range(N):
            out[r, j] = x[r, j] * inv


@njit(**_ROWS)
def mean_pool(x, mask, out):
    """``out[b] = sum_s x[b, s] mask[b, s] / max(sum_s mask[b, s], 1e-9)``; ``x [B, S, H]``."""
    B, S, H = x.shape
    for b in prange(B):
        o = out[b]
        o[:] = 0.0
        cnt = 0.0
        for s in range(S):
            m = mask[b, s]
            cnt += m
            if m != 0.0:
                for c in range(H):
                    o[c] += x[b, s, c] * m
        inv = 1.0 / max(cnt, 1e-9)
        for c in range(H):
            o[c] *= inv


@njit(**_ROWS)
def embedding(ids, types, word, pos, ttab, S, out):
    """``out[r] = word[ids[r]] + pos[r % S] + ttab[types[r]]`` for rows ``r`` of ``out [R, H]``."""
    R, H = out.shape
    for r in prange(R):
        w, t, p = ids[r], types[r], r % S
        for c in range(H):
            out[r, c] = word[w, c] + pos[p, c] + ttab[t, c]


@njit(**_INLINE)
def _row_max(row, T):
    """The largest of ``row[:T]`` (float32), as 8 running maxima, one per lane of ``j % 8``,
    merged at the end: one running maximum is a chain of dependent compares that LLVM does not
    vectorise without ``nnan`` (which this module leaves out), 7x slower over 196,608 scores
    (264 against 37 µs). A NaN is skipped here as by the one-chain loop (``max(a, nan)`` is
    ``a``); it still reaches the row through :func:`exp_neg` and the sum."""
    T8 = T - T % 8
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(-np.inf)
    for j in range(0, T8, 8):
        a0 = max(a0, row[j])
        a1 = max(a1, row[j + 1])
        a2 = max(a2, row[j + 2])
        a3 = max(a3, row[j + 3])
        a4 = max(a4, row[j + 4])
        a5 = max(a5, row[j + 5])
        a6 = max(a6, row[j + 6])
        a7 = max(a7, row[j + 7])
    for j in range(T8, T):
        a0 = max(a0, row[j])
    return max(max(max(a0, a1), max(a2, a3)), max(max(a4, a5), max(a6, a7)))


@njit(**_ROWS)
def softmax_rows(s, madd, heads, scale):
    """In place on attention scores ``s [G, S, T]`` (``G = batches * heads``, batch-major): each
    row becomes ``softmax(scale * row + madd[b])``, ``madd [batches, T]`` the additive key mask
    (0 or -1e9; passed precomputed so that no reassociation can fold ``-1e9`` into the scores).
    One pass for scale and mask, one for the maximum (:func:`_row_max`), one for
    :func:`exp_neg` and the sum, one to divide: each vectorised (at 128 keys the row maximum in
    the first pass, one dependent chain, took half the time: MiniLM 1x128's softmax 414 µs a
    layer against 228 now, one thread)."""
    G, S, T = s.shape
    for k in prange(G * S):
        g = k // S
        row = s[g, k - g * S]
        m = madd[g // heads]
        for j in range(T):
            row[j] = row[j] * scale + m[j]
        mx = _row_max(row, T)
        tot = np.float32(0.0)
        for j in range(T):
            e = exp_neg(row[j] - mx)
            row[j] = e
            tot += e
        inv = np.float32(1.0) / tot
        for j in range(T):
            row[j] *= inv


def set_threads(n: int) -> int:
    """Run this thread's next parallel loops on ``n`` threads of numba's pool (capped at the
    pool's size, ``NUMBA_NUM_THREADS``, which defaults to the cores); returns the count applied.
    numba's count is per calling thread; :mod:`runtime.kernels.nn` applies the thread rule
    (:mod:`runtime.cpu_threads`) through this before each cpu kernel's loops."""
    n = max(1, min(int(n), POOL))
    numba.set_num_threads(n)
    return n


def warm() -> None:
    """Compile every loop for the argument types the cpu kernels pass (and fill numba's disk
    cache), so the first launches later load machine code instead of compiling (~15 s of CPU on
    2 cores, once per checkout). ``setup.sh`` runs it; ``python -m runtime.kernels.cpu_loops``
    does the same."""
    f, i = np.float32, np.int32
    x = np.ones((4, 8), f)
    v, b = np.ones(8, f), np.ones(8, f)
    s = np.ones((2, 4, 4), f)
    erf_array(np.zeros(4), np.zeros(4))
    gelu(v, v)
    bias_act_block(x, b, 1, 0, 4, 0, 8)
    add_bias(x, b, x)
    layer_norm(x, x, True, b, b, 1e-12, x)
    layer_norm(x[1:3], x[1:3], True, b, b, 1e-12, x[1:3])      # a block of rows (nn's pieces)
    l2_normalize(x, x)
    mean_pool(x.reshape(2, 2, 8), np.ones((2, 2), f), np.ones((2, 8), f))
    embedding(np.zeros(4, i), np.zeros(4, i), x, x, x, 2, x)
    exp_neg_array(-v, v)
    softmax_rows(s, np.zeros((1, 4), f), 2, f(0.5))


if __name__ == "__main__":
    from runtime.kernels import cpu_loops    # the package module, so the cache keys match
    cpu_loops.warm()
