"""The cpu backend's compiled kernels (``runtime.kernels.cpu_loops``) and its thread rule:
exactness against ``math.erf``/numpy float64 references, attention worked through in chunks, a
replay that allocates nothing, bad ids refused, and OpenBLAS held at one thread."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

import runtime
from runtime.backends.cpu import limit_blas_threads
from runtime.kernels import cpu_loops, nn
from runtime.tensor import Arena, Tensor, embedding

from test_kernels_nn import attention_ref, gelu_ref

RNG = np.random.default_rng(16)


@pytest.fixture
def cpu():
    c = runtime.client("cpu")
    c.set_stream(runtime.StreamId.new())
    return c


def test_erf_is_exact_to_float32_on_a_dense_grid():
    x = np.concatenate([np.linspace(-7, 7, 40001), [0.0, 1e-30, -1e-30, 3.999, 4.0, 4.001]])
    got = np.empty_like(x)
    cpu_loops.erf_array(x, got)
    ref = np.array([math.erf(v) for v in x])
    assert np.abs(got - ref).max() < 2e-8
    nan = np.array([np.nan])
    cpu_loops.erf_array(nan, nan)
    assert np.isnan(nan[0])                    # NaN propagates: no fastmath nnan


def test_gelu_loop_matches_exact_erf_and_propagates_nan():
    x = (RNG.standard_normal(50001) * 5).astype(np.float32)
    x[7] = np.nan
    out = np.empty_like(x)
    cpu_loops.gelu(x, out)
    ok = ~np.isnan(x)
    np.testing.assert_allclose(out[ok], gelu_ref(x[ok]), atol=1e-6, rtol=1e-6)
    assert np.isnan(out[7])


def test_attention_in_chunks_of_one_sequence_matches_numpy(cpu, monkeypatch):
    B, S, heads, hd = 5, 33, 3, 32
    H = heads * hd
    monkeypatch.setattr(nn, "ATTN_CPU_CHUNK", heads * S * S)      # one sequence per chunk
    qkv = RNG.standard_normal((B, S, 3 * H)).astype(np.float32)
    mask = np.ones((B, S), np.float32)
    mask[1, 20:] = 0
    mask[4, 1:] = 0
    ref = attention_ref(qkv[..., :H], qkv[..., H:2 * H], qkv[..., 2 * H:], mask, heads)
    got = Tensor.from_numpy(cpu, qkv).attention(Tensor.from_numpy(cpu, mask), heads).numpy()
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)


def test_a_replayed_encoder_layer_allocates_no_activation_sized_memory(cpu):
    B, S, H, heads = 4, 32, 96, 3
    f = np.float32
    up = lambda a: Tensor.from_numpy(cpu, a.astype(f))    # noqa: E731
    x = up(RNG.standard_normal((B, S, H)))
    mask = up(np.ones((B, S)))
    wqkv, bqkv = up(RNG.standard_normal((H, 3 * H)) * 0.1), up(RNG.standard_normal(3 * H))
    wi, bi = up(RNG.standard_normal((H, 4 * H)) * 0.1), up(RNG.standard_normal(4 * H))
    wo, bo = up(RNG.standard_normal((4 * H, H)) * 0.1), up(RNG.standard_normal(H))
    g, b = up(np.ones(H)), up(np.zeros(H))

    def layer():
        ctx = x.matmul(wqkv, bqkv).attention(mask, heads)
        y = ctx.layer_norm(g, b, residual=x)
        h = y.matmul(wi, bi, activation="gelu").matmul(wo, bo)
        return h.layer_norm(g, b, residual=y).mean_pool(mask).l2_normalize()

    arena = Arena(cpu)
    cpu.graph_prepare()
    with arena:
        warm = layer().numpy()
        cpu.start_capture()
        out = layer()
    graph = cpu.stop_capture()
    graph.replay()
    np.testing.assert_allclose(out.numpy(), warm, atol=1e-6)
    smallest = B * S * H * 4                   # bytes of the smallest activation
    tracemalloc.start()
    try:
        for _ in range(3):
            graph.replay()
        cpu.sync()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < smallest // 4, f"replays allocated {peak} bytes at peak"
    np.testing.assert_allclose(out.numpy(), warm, atol=1e-6)
    graph.release()
    arena.release()


def test_embedding_refuses_ids_outside_the_table(cpu):
    word, pos, ttab = (Tensor.from_numpy(cpu, np.ones((n, 8), np.float32)) for n in (10, 4, 2))
    ids = Tensor.from_numpy(cpu, np.array([[1, 10]], np.int32))
    types = Tensor.from_numpy(cpu, np.zeros((1, 2), np.int32))
    with pytest.raises(runtime.ServerError, match="ids outside"):
        embedding(ids, types, word, pos, ttab).numpy()


def test_blas_thread_rule_holds_one_thread_and_yields_to_the_user(monkeypatch):
    from threadpoolctl import threadpool_info
    runtime.client("cpu")                      # a started cpu backend applied the rule
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    prev = limit_blas_threads(1)
    try:
        assert all(i["num_threads"] == 1 for i in threadpool_info() if i["user_api"] == "blas")
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
        assert limit_blas_threads(1) is None   # the user's setting wins: nothing done
    finally:
        if prev is not None:
            limit_blas_threads(prev, force=True)
