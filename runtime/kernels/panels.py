"""A cpu-only matmul for products of few rows against a weight also stored in column panels.

numpy's OpenBLAS multiplies a few rows by a wide weight slowly: ``[16, 384] @ [384, 1536]`` on
one thread takes 480-520 µs where torch's MKL takes about 220 (this 2-core AVX-512 machine; the
serving path's products at one client are 8-24 rows). The same product taken as one small
``sgemm`` per contiguous panel of the weight's columns (``[K, P]`` blocks, one after another in
memory) is 1.5-3x faster from 4 to 32 rows hot, and inside MiniLM's forward (cold weights) 1.1-1.4x
up to 96 rows (the figures are in the commits that made this file). So a model that owns its weights (MiniLM)
uploads each ``[K, N]`` weight also as panels (:func:`panel_weight`, ``[ceil(N / P), K, P]``,
the last panel zero-padded) and launches :data:`matmul_bias_panels` /
:data:`matmul_bias_gelu_panels` with both: the cpu source takes the panels for at most
:data:`PANEL_ROWS` rows (:data:`PANEL_ROWS_SPLIT` when the product is dealt out to several
threads), and the plain weight (the ordinary matmul's cpu source, :mod:`runtime.kernels.nn`)
above, or while the thread rule allows one call on OpenBLAS's own threads (a free host:
:meth:`runtime.cpu_threads.ThreadRule.whole_call`). No cache: the panels are a second read-only
buffer the caller uploads once, so nothing can go stale.

There is no WGSL or CUDA source: launch these on the cpu backend only (on a GPU the tiled
kernels of :mod:`runtime.kernels.nn` have no such weakness).
"""

from __future__ import annotations

import time

import numpy as np

from ..cpu_threads import FAN_OUT, RULE
from ..kernel import Kernel
from . import nn

#: columns per panel (``P``): 64 was best or within noise of the best of 32-256 at 8-32 rows
#: for ``K = 384`` (MiniLM's ``[384, 1152]``, ``[384, 384]``, ``[384, 1536]`` weights)
PANEL_COLS = 64
#: most rows (``M``) the cpu source multiplies panel by panel on one thread; above, the plain
#: weight (MiniLM forwards in one process alternating both, CPU ms: 48 rows 17.8 vs 21.3, 96
#: rows 27.4 vs 29.6, 128 rows 38.9 vs 38.4, 256 rows 65.2 vs 58.8)
PANEL_ROWS = 96
#: most rows taken panel by panel when the product is dealt out to several threads: a piece of
#: the plain weight is a strided column block, a piece of panels is contiguous (2 threads, CPU
#: ms: 128 rows 35.5 vs 38.9, 192 rows 50.1 vs 53.1)
PANEL_ROWS_SPLIT = 192


def panel_weight(w, cols: int = PANEL_COLS) -> np.ndarray:
    """The ``[K, N]`` weight ``w`` as ``ceil(N / cols)`` contiguous ``[K, cols]`` panels:
    ``out[p, k, j] = w[k, p * cols + j]`` (0 past column ``N``), ``float32 [ceil(N / cols), K,
    cols]``, C-contiguous. Upload it with the plain weight and launch
    :func:`matmul_panels_for`'s kernel with both.

    Raises: ``ValueError`` (``w`` not 2-D, ``cols < 1``).
    """
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or int(cols) < 1:
        raise ValueError(f"panel_weight: a 2-D weight and cols >= 1, got shape {w.shape}, "
                         f"cols {cols}")
    K, N = w.shape
    cols = int(cols)
    n = -(-N // cols)
    out = np.zeros((n, K, cols), np.float32)
    for p in range(n):
        c0, c1 = p * cols, min(N, (p + 1) * cols)
        out[p, :, :c1 - c0] = w[:, c0:c1]
    return out


def panel_pieces(panels: int, macs: int, threads: int) -> list:
    """Ranges ``(p0, p1)`` of panels one product is dealt out in to ``threads`` threads: as
    :func:`runtime.kernels.nn.mm_pieces` cuts columns (one piece below ``2 *
    nn.MM_PIECE_MACS`` multiply-adds or with one thread, else up to ``nn.MM_PIECES_PER_THREAD``
    per thread of at least ``MM_PIECE_MACS`` each), in whole panels."""
    n = min(nn.MM_PIECES_PER_THREAD * threads, macs // nn.MM_PIECE_MACS, panels) \
        if threads > 1 else 1
    if n < 2:
        return [(0, panels)]
    step = -(-panels // n)
    return [(p, min(panels, p + step)) for p in range(0, panels, step)]


def _panels_cpu(act: str | None):
    plain = nn._matmul_cpu(True, act)
    code = 1 if act == "gelu" else 0

    def run(a, w, wp, b, out, *, M, N, K, P, count):
        # out[:, p*P:(p+1)*P] = A @ Wp[p] for each panel p, as one batched numpy call per
        # piece (a loop of 1-thread sgemm calls inside numpy) writing straight into out's
        # columns through a [panels, M, P] view; the last panel, when N % P, on its own.
        threads = RULE.threads()
        if M > (PANEL_ROWS if threads <= 1 else PANEL_ROWS_SPLIT) or P < 1 or (
                threads > 1 and RULE.whole_call()):
            # many rows, or a free host where one call on OpenBLAS's own 2 threads is quicker
            # (MiniLM 1x16 quiet: 8.6 ms a forward against 10.4 in pieces, for 30% more CPU)
            plain(a, w, b, out, M=M, N=N, K=K, count=count)
            return
        n_p = -(-N // P)
        full = N // P
        A = a[:M * K].reshape(M, K)
        Wp = wp[:n_p * K * P].reshape(n_p, K, P)
        y = out[:M * N].reshape(M, N)
        bb = b[:N]
        yv = y[:, :full * P].reshape(M, full, P).transpose(1, 0, 2)     # [full, M, P] view
        loops = nn._loops(1)

        def piece(rng):
            p0, p1 = rng
            f1 = min(p1, full)
            if f1 > p0:
                np.matmul(A, Wp[p0:f1], out=yv[p0:f1])
            if p1 > full:                                   # the partial last panel
                np.matmul(A, Wp[full, :, :N - full * P], out=y[:, full * P:])
            loops.bias_act_block(y, bb, code, 0, M, p0 * P, min(N, p1 * P))
        t0 = time.perf_counter()
        FAN_OUT.run(nn._one_thread_piece(piece), panel_pieces(n_p, M * N * K, threads), threads)
        RULE.record(M * N * K, time.perf_counter() - t0, threads, (M, N, K))   # ThreadChoice
    return run


def _panels_kernel(name: str, act: str | None) -> Kernel:
    binds = [("a", "f32", "read"), ("w", "f32", "read"), ("wp", "f32", "read"),
             ("bias", "f32", "read"), ("out", "f32", "write")]
    return Kernel(name, binds, [("M", "u32"), ("N", "u32"), ("K", "u32"), ("P", "u32")],
                  (1, 1, 1), cpu=_panels_cpu(act),
                  elements={"a": ("M", "K"), "w": ("K", "N"), "bias": "N", "out": ("M", "N")})


#: ``out[M, N] = a[M, K] @ w[K, N] + bias[N]`` with ``wp = panel_weight(w, P)`` bound too
#: (params ``M, N, K, P``; cpu only; launch over ``(1, 1, 1)``)
matmul_bias_panels = _panels_kernel("matmul_bias_panels", None)
#: as :data:`matmul_bias_panels`, then GELU (erf form) on every element
matmul_bias_gelu_panels = _panels_kernel("matmul_bias_gelu_panels", "gelu")


def matmul_panels_for(activation: str | None = None) -> Kernel:
    """The panel matmul (with a bias) for ``activation`` ``None`` or ``"gelu"``.

    Raises: ``ValueError`` for another activation."""
    if activation is None:
        return matmul_bias_panels
    if activation == "gelu":
        return matmul_bias_gelu_panels
    raise ValueError(f"no panel matmul with activation={activation!r}")


__all__ = ["PANEL_COLS", "PANEL_ROWS", "PANEL_ROWS_SPLIT", "panel_weight", "panel_pieces", "matmul_bias_panels",
           "matmul_bias_gelu_panels", "matmul_panels_for"]
