"""The transformer kernels of ``runtime.kernels.nn`` agree with a float64 numpy reference on
every backend, at sizes that are not multiples of any workgroup or tile."""

from __future__ import annotations

import math

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.kernels import nn
from runtime.tensor import Arena, Tensor, attention, embedding

RNG = np.random.default_rng(20261129)
NN_KERNELS = [nn.gelu, nn.add_bias, nn.embedding, *nn._MM.values(), nn.layer_norm,
              nn.add_layer_norm, nn.l2_normalize, nn.mean_pool, nn.attention,
              nn.attention_for(64), nn.attention_for(24)]


def randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def gelu_ref(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def up(client, a):
    return Tensor.from_numpy(client, a)


def test_erf_approximation_is_float32_accurate():
    x = np.linspace(-9, 9, 200001)
    ref = np.vectorize(math.erf)(x)
    assert np.abs(nn.erf_np(x) - ref).max() < 2e-7
    xf = x.astype(np.float32)
    assert np.abs(nn.gelu_np(xf) - gelu_ref(xf)).max() < 1e-6


@pytest.mark.parametrize("M,K_,N", [(77, 130, 99), (1, 384, 1152), (130, 17, 65), (16, 40, 129),
                                    (17, 9, 3)])
@pytest.mark.parametrize("variant", ["plain", "bias", "bias_gelu"])
def test_matmul_matches_numpy_at_awkward_sizes(client, M, K_, N, variant):
    a, w, b = randn(M, K_), randn(K_, N, scale=0.2), randn(N)
    ref = a.astype(np.float64) @ w
    if variant != "plain":
        ref += b
    if variant == "bias_gelu":
        ref = gelu_ref(ref)
    A, W, B = up(client, a), up(client, w), up(client, b)
    if variant == "plain":
        got = A.matmul(W)
    else:
        got = A.matmul(W, B, activation="gelu" if variant == "bias_gelu" else None)
    assert got.shape == (M, N)
    np.testing.assert_allclose(got.numpy(), ref, atol=2e-4 * math.sqrt(K_), rtol=1e-4)


def test_add_same_shape_and_broadcast_bias(client):
    x, y, b = randn(5, 7, 67), randn(5, 7, 67), randn(67)
    X, Y, B = up(client, x), up(client, y), up(client, b)
    np.testing.assert_allclose((X + Y).numpy(), x + y, atol=1e-6)
    np.testing.assert_allclose(X.add(B).numpy(), x + b, atol=1e-6)
    with pytest.raises(ValueError):
        X.add(up(client, randn(66)))


def test_gelu_matches_exact_erf(client):
    x = randn(1001, scale=4.0)
    np.testing.assert_allclose(up(client, x).gelu().numpy(), gelu_ref(x), atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_matches_numpy(client, residual):
    rows, n = 37, 385
    x, r = randn(rows, n, scale=3.0) + 1, randn(rows, n)
    g, b = randn(n), randn(n)
    v = x.astype(np.float64) + (r if residual else 0)
    ref = (v - v.mean(1, keepdims=True)) / np.sqrt(v.var(1, keepdims=True) + 1e-12) * g + b
    X = up(client, x)
    got = X.layer_norm(up(client, g), up(client, b), 1e-12,
                       residual=up(client, r) if residual else None)
    np.testing.assert_allclose(got.numpy(), ref, atol=1e-5, rtol=1e-5)


def attention_ref(q, k, v, mask, heads):
    B, S, H = q.shape
    hd = H // heads

    def split(t):
        return t.astype(np.float64).reshape(B, S, heads, hd).transpose(0, 2, 1, 3)

    s = split(q) @ split(k).transpose(0, 1, 3, 2) / math.sqrt(hd)
    s = s + (1 - mask[:, None, None, :]) * -1e9
    e = np.exp(s - s.max(-1, keepdims=True))
    return ((e / e.sum(-1, keepdims=True)) @ split(v)).transpose(0, 2, 1, 3).reshape(B, S, H)


@pytest.mark.parametrize("B,S,heads,hd", [(3, 37, 4, 32), (2, 1, 12, 32), (1, 70, 3, 24),
                                         (2, 300, 2, 64)])
def test_attention_packed_qkv_matches_numpy(client, B, S, heads, hd):
    H = heads * hd
    qkv = randn(B, S, 3 * H)
    mask = np.ones((B, S), np.float32)
    mask[B - 1, (S + 1) // 2:] = 0            # a padded sequence: its tail keys are masked
    ref = attention_ref(qkv[..., :H], qkv[..., H:2 * H], qkv[..., 2 * H:], mask, heads)
    got = up(client, qkv).attention(up(client, mask), heads)
    np.testing.assert_allclose(got.numpy(), ref, atol=2e-5, rtol=1e-4)


def test_attention_separate_q_k_v(client):
    B, S, heads, hd = 2, 19, 2, 40
    q, k, v = randn(B, S, heads * hd), randn(B, S, heads * hd), randn(B, S, heads * hd)
    mask = np.ones((B, S), np.float32)
    mask[0, 11:] = 0
    got = attention(up(client, q), up(client, k), up(client, v), up(client, mask), heads)
    np.testing.assert_allclose(got.numpy(), attention_ref(q, k, v, mask, heads), atol=2e-5,
                               rtol=1e-4)


def test_attention_refuses_unsupported_shapes(client):
    qkv = up(client, randn(1, 3, 3 * 128))
    mask = up(client, np.ones((1, 3), np.float32))
    with pytest.raises(ValueError, match="head dim"):
        qkv.attention(mask, heads=1)
    with pytest.raises(ValueError, match="mask"):
        qkv.attention(up(client, np.ones((1, 4), np.float32)), heads=4)


def test_mean_pool_and_l2_normalize_match_numpy(client):
    B, S, H = 5, 13, 67
    x = randn(B, S, H)
    mask = (RNG.random((B, S)) < 0.7).astype(np.float32)
    mask[:, 0] = 1
    mask[3] = 0                                # an all-padding row pools to zeros, not NaN
    m = mask.astype(np.float64)
    pooled = (x * m[..., None]).sum(1) / np.maximum(m.sum(1), 1e-9)[:, None]
    P = up(client, x).mean_pool(up(client, mask))
    np.testing.assert_allclose(P.numpy(), pooled, atol=1e-5)
    norm = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    got = P.l2_normalize().numpy()
    np.testing.assert_allclose(got, norm, atol=1e-6)
    assert np.all(np.isfinite(got)) and np.all(got[3] == 0)


def test_embedding_gathers_word_position_and_type(client):
    B, S, H, V = 3, 11, 70, 101
    ids = RNG.integers(0, V, (B, S)).astype(np.int32)
    types = RNG.integers(0, 2, (B, S)).astype(np.int32)
    word, pos, ttab = randn(V, H), randn(20, H), randn(2, H)
    ref = word[ids] + pos[np.arange(S)][None] + ttab[types]
    got = embedding(up(client, ids), up(client, types), up(client, word), up(client, pos),
                    up(client, ttab))
    np.testing.assert_allclose(got.numpy(), ref, atol=1e-6)


def test_more_than_65535_workgroups_split_into_two_dimensions(client):
    n = 65536 * 64 + 3                          # elementwise kernels: grid() goes 2-D
    x = randn(n)
    np.testing.assert_allclose(up(client, x).gelu().numpy()[-5:], gelu_ref(x[-5:]), atol=2e-6)


def test_arena_reuses_a_dropped_buffer_for_the_next_output(client):
    arena = Arena(client)
    x, w = up(client, randn(4, 8)), up(client, randn(8, 8))
    with arena:
        first = x.matmul(w)
        hid = first.handle.id
        del first
        again = x.matmul(w)
    assert again.handle.id == hid
    assert arena.nbytes == 4 * 8 * 4
    np.testing.assert_allclose(again.numpy(), x.numpy() @ w.numpy(), atol=1e-5)


def test_wgsl_and_cuda_come_from_one_body():
    """The two sources share the body text, so a fix in one is a fix in the other."""
    for k in NN_KERNELS:
        assert "fn main" in k.wgsl and f"void {k.name}(" in k.cuda, k.name
    assert "p.K" in nn.matmul.wgsl and "p.K" in nn.matmul.cuda
    assert runtime.kernels.matmul_bias is nn.matmul_bias and K.attention is nn.attention
