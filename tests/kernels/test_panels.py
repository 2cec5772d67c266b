"""The cpu panel matmul (runtime.kernels.panels) against float64 numpy: few rows through the
weight's column panels, many rows (or a free host's whole call) through the plain weight."""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from runtime.cpu_threads import RULE, CpuShare, WholeCalls
from runtime.kernels import nn, panels
from runtime.tensor import Tensor

from test_kernels_nn import gelu_ref

RNG = np.random.default_rng(30)


@pytest.fixture(autouse=True)
def free_host(monkeypatch):
    """A free host whatever else runs here, and pieces rather than whole calls (the whole-call
    case has its own test)."""
    monkeypatch.setattr(RULE, "cpu", CpuShare(read=lambda: None))
    monkeypatch.setattr(RULE, "whole", WholeCalls(mode="0"))


@pytest.fixture
def cpu():
    c = runtime.client("cpu")
    c.set_stream(runtime.StreamId.new())
    return c


@pytest.mark.parametrize("K,N,cols", [(384, 1152, 64), (5, 7, 3), (3, 2, 8), (1, 64, 64)])
def test_panel_weight_holds_every_column_once_and_zeros_past_the_last(K, N, cols):
    w = RNG.standard_normal((K, N)).astype(np.float32)
    p = panels.panel_weight(w, cols)
    n = -(-N // cols)
    assert p.shape == (n, K, cols) and p.dtype == np.float32 and p.flags.c_contiguous
    flat = np.concatenate(list(p), axis=1)                   # [K, n * cols]
    np.testing.assert_array_equal(flat[:, :N], w)
    assert not flat[:, N:].any()


def test_panel_weight_refuses_a_non_matrix():
    with pytest.raises(ValueError):
        panels.panel_weight(np.zeros(4, np.float32))
    with pytest.raises(ValueError):
        panels.panel_weight(np.zeros((2, 2), np.float32), 0)


@pytest.mark.parametrize("n,macs,threads", [(18, 7 << 20, 2), (24, 9 << 20, 2), (24, 1 << 20, 2),
                                            (6, 1 << 30, 2), (5, 1 << 30, 4), (24, 9 << 20, 1)])
def test_panel_pieces_cover_the_panels_once(n, macs, threads):
    got = panels.panel_pieces(n, macs, threads)
    seen = [p for p0, p1 in got for p in range(p0, p1)]
    assert seen == list(range(n))
    assert len(got) <= max(1, nn.MM_PIECES_PER_THREAD * threads)
    assert (len(got) > 1) == (threads > 1 and macs >= 2 * nn.MM_PIECE_MACS)


def _run(cpu, a, w, wp, b, act):
    M, K = a.shape
    N = w.shape[1]
    t = lambda v: Tensor.from_numpy(cpu, v)                 # noqa: E731
    out = Tensor.empty(cpu, (M, N), "f32")
    cpu.launch(panels.matmul_panels_for(act), (1, 1, 1),
               [t(a).handle, t(w).handle, t(wp).handle, t(b).handle, out.handle],
               {"M": M, "N": N, "K": K, "P": wp.shape[2]})
    return out.numpy()


def _case(M, K, N, cols):
    a = RNG.standard_normal((M, K)).astype(np.float32)
    w = (RNG.standard_normal((K, N)) * 0.05).astype(np.float32)
    b = RNG.standard_normal(N).astype(np.float32)
    return a, w, panels.panel_weight(w, cols), b


def _ref(a, w, b, act):
    ref = a.astype(np.float64) @ w + b
    return gelu_ref(ref) if act else ref


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("act", [None, "gelu"])
@pytest.mark.parametrize("M,K,N,cols", [
    (1, 384, 1152, 64),          # one row
    (16, 384, 1536, 64),         # MiniLM's 1x16 bucket (two pieces on two threads)
    (24, 384, 100, 64),          # N not a multiple of the panel: a partial last panel
    (37, 1536, 384, 64),         # rows not a multiple of anything, K = 1536
    (5, 17, 3, 64),              # one partial panel only
    (9, 7, 130, 32),             # K not 384, several panels and a partial one
    (panels.PANEL_ROWS, 384, 384, 64),
])
def test_few_rows_take_the_panels_and_match_numpy(cpu, monkeypatch, threads, act, M, K, N, cols):
    monkeypatch.setattr(RULE, "cores", threads)
    a, w, wp, b = _case(M, K, N, cols)
    # the plain weight is bound as NaN: a result that read it (the wrong path) is NaN
    got = _run(cpu, a, np.full_like(w, np.nan), wp, b, act)
    np.testing.assert_allclose(got, _ref(a, w, b, act), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("act", [None, "gelu"])
@pytest.mark.parametrize("threads,M", [(1, panels.PANEL_ROWS + 1),
                                       (2, panels.PANEL_ROWS_SPLIT + 1)])
def test_many_rows_take_the_plain_weight_and_match_numpy(cpu, monkeypatch, act, threads, M):
    monkeypatch.setattr(RULE, "cores", threads)
    a, w, wp, b = _case(M, 384, 200, 64)
    got = _run(cpu, a, w, np.full_like(wp, np.nan), b, act)
    np.testing.assert_allclose(got, _ref(a, w, b, act), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("M", [panels.PANEL_ROWS + 1, panels.PANEL_ROWS_SPLIT])
def test_rows_dealt_out_to_several_threads_take_the_panels_further(cpu, monkeypatch, M):
    # a piece of the plain weight is a strided column block, a piece of panels contiguous
    monkeypatch.setattr(RULE, "cores", 2)
    a, w, wp, b = _case(M, 384, 1152, 64)
    got = _run(cpu, a, np.full_like(w, np.nan), wp, b, "gelu")
    np.testing.assert_allclose(got, _ref(a, w, b, "gelu"), atol=1e-4, rtol=1e-4)


def test_a_free_hosts_whole_call_takes_the_plain_weight(cpu, monkeypatch):
    # one call on OpenBLAS's own threads beats 1-thread panels when the process has the cores
    monkeypatch.setattr(RULE, "cores", 2)
    monkeypatch.setattr(RULE, "adapt_blas", True)
    monkeypatch.setattr(RULE, "whole", WholeCalls(mode="auto", window_s=1e9))
    a, w, wp, b = _case(16, 384, 1536, 64)
    got = _run(cpu, a, w, np.full_like(wp, np.nan), b, "gelu")
    np.testing.assert_allclose(got, _ref(a, w, b, "gelu"), atol=1e-4, rtol=1e-4)
    assert RULE.whole._wall > 0                             # the whole call was made and timed


def test_only_gelu_or_none():
    assert panels.matmul_panels_for(None) is panels.matmul_bias_panels
    assert panels.matmul_panels_for("gelu") is panels.matmul_bias_gelu_panels
    with pytest.raises(ValueError):
        panels.matmul_panels_for("relu")


def test_a_bias_shorter_than_n_is_refused_not_read_past_its_end():
    """The panel kernels' epilogue (numba) read ``bias[j]`` for every column: a bias shorter
    than ``N`` was read past its end (whatever memory held). They declare their element
    counts now (``a``: M*K, ``w``: K*N, ``bias``: N, ``out``: M*N): the server refuses it."""
    from runtime.errors import LaunchError, ReplayFailed
    c = runtime.client("cpu").with_stream(runtime.StreamId.new())
    M, N, K, P = 2, 8, 4, 4
    w = np.ones((K, N), np.float32)
    bufs = [c.create(np.ones(M * K, np.float32)), c.create(w.reshape(-1)),
            c.create(panels.panel_weight(w, P).reshape(-1)), c.create(np.ones(N - 1, np.float32)),
            c.create(np.zeros(M * N, np.float32))]
    c.launch(panels.matmul_bias_panels, (1, 1, 1), bufs, {"M": M, "N": N, "K": K, "P": P})
    with pytest.raises(LaunchError, match="param N=8 exceeds the 7 elements"):
        c.sync()
    with pytest.raises(ReplayFailed):
        c.read(bufs[-1])
