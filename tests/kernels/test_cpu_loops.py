"""The cpu backend's compiled kernels (``runtime.kernels.cpu_loops``) and its thread rule:
exactness against ``math.erf``/numpy float64 references, attention worked through in chunks, a
replay that allocates nothing, bad ids refused, and the thread rule (the cores shared among the
stream items executing now; the user's settings win)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import runtime
from runtime.cpu_threads import RULE, CpuShare, ThreadRule, WholeCalls, limit_blas_threads
from runtime.kernels import cpu_loops, nn
from runtime.tensor import Arena, Tensor, embedding

from test_kernels_nn import attention_ref, gelu_ref

RNG = np.random.default_rng(16)


@pytest.fixture(autouse=True)
def free_host(monkeypatch):
    """The thread rule sees a free host whatever else runs on this machine (its CPU share, which
    cuts the cores on a busy host, is tested in test_cpu_threads.py)."""
    monkeypatch.setattr(RULE, "cpu", CpuShare(read=lambda: None))
    monkeypatch.setattr(RULE, "whole", WholeCalls(mode="0"))   # pieces (whole: own tests)


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


@pytest.mark.parametrize("chunk,fan_out,cores", [
    (3 * 33 * 33, 1 << 62, None),       # one sequence per piece, on the worker alone
    (3 * 33 * 33, 0, 2),                # the pieces dealt out to 2 threads (RULE.fan_out)
    (33 * 33, 0, 3),                    # one head per piece, 3 threads
    (1 << 18, 0, 4),                    # several sequences per piece, fewer pieces than threads
])
@pytest.mark.parametrize("whole", ["0", "1"])   # "1": on this thread, BLAS's own threads inside
def test_attention_in_pieces_on_one_or_more_threads_matches_numpy(cpu, monkeypatch, chunk,
                                                                   fan_out, cores, whole):
    B, S, heads, hd = 5, 33, 3, 32
    H = heads * hd
    monkeypatch.setattr(nn, "ATTN_CPU_CHUNK", chunk)
    monkeypatch.setattr(nn, "ATTN_FAN_OUT_MACS", fan_out)
    monkeypatch.setattr(RULE, "whole", WholeCalls(mode=whole))
    if cores:
        monkeypatch.setattr(RULE, "cores", cores)
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
    # tracemalloc counts every thread: the least peak of three windows (another thread's
    # allocation, e.g. releases of earlier tests' garbage on the device thread, lands in one)
    peaks = []
    for _ in range(3):
        tracemalloc.start()
        try:
            for _ in range(3):
                graph.replay()
            cpu.sync()
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    peak = min(peaks)
    assert peak < smallest // 4, f"replays allocated {peaks} bytes at peak"
    np.testing.assert_allclose(out.numpy(), warm, atol=1e-6)
    graph.release()
    arena.release()


def test_embedding_refuses_ids_outside_the_table(cpu):
    word, pos, ttab = (Tensor.from_numpy(cpu, np.ones((n, 8), np.float32)) for n in (10, 4, 2))
    ids = Tensor.from_numpy(cpu, np.array([[1, 10]], np.int32))
    types = Tensor.from_numpy(cpu, np.zeros((1, 2), np.int32))
    with pytest.raises(runtime.ServerError, match="ids outside"):
        embedding(ids, types, word, pos, ttab).numpy()


def test_exp_neg_is_exact_to_float32_on_a_dense_grid():
    x = np.concatenate([np.linspace(-87, 0, 200001), [0.0, -1e-30, -0.34657, -0.34658, -86.99]])
    x = x.astype(np.float32)
    got = np.empty_like(x)
    cpu_loops.exp_neg_array(x, got)
    ref = np.exp(x.astype(np.float64))
    assert np.abs(got / ref - 1).max() < 4e-7             # a few float32 ulps, as numpy's expf
    assert cpu_loops.exp_neg_array(np.zeros(1, np.float32), got[:1]) is None and got[0] == 1.0
    far = np.array([-88.5, -1e9, -np.inf], np.float32)
    cpu_loops.exp_neg_array(far, far)
    assert (far <= 1.7e-38).all() and (far >= 0).all()   # clamped at -87: tiny, never negative


def test_softmax_rows_keeps_scores_beside_a_minus_1e9_mask():
    # the mask is added, not folded: with reassociation allowed, scale * s + (1 - m) * -1e9
    # can become (scale * s - 1e9) + 1e9 m, which loses every score to float32 rounding
    G, heads, S = 6, 3, 40
    s = (RNG.standard_normal((G, S, S)) * 8).astype(np.float32)
    mask = np.ones((G // heads, S), np.float32)
    mask[0, 30:] = 0
    madd = ((1 - mask) * np.float32(-1e9)).astype(np.float32)
    ref = s.astype(np.float64) * np.float64(np.float32(0.17)) + np.repeat(madd, heads, 0)[:, None]
    ref = np.exp(ref - ref.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    got = s.copy()
    cpu_loops.softmax_rows(got, madd, heads, np.float32(0.17))
    np.testing.assert_allclose(got, ref, atol=2e-7, rtol=1e-5)
    assert (got[:heads, :, 30:] < 1e-30).all()            # masked keys get nothing


@pytest.mark.parametrize("T", [1, 5, 8, 13, 16, 128, 131])
def test_softmax_rows_finds_the_row_maximum_in_every_lane_and_the_tail(T):
    # the row maximum runs as 8 running maxima (one per j % 8) and a tail loop: put the largest
    # score of each row at every position in turn (a large lead: a missed maximum overflows or
    # shifts the exps), against float64 numpy
    heads, S = 2, T
    s = RNG.standard_normal((2 * heads, S, T)).astype(np.float32)
    for r in range(S):
        s[:, r, r % T] = 60.0 + r                    # the row's maximum at column r % T
    madd = np.zeros((2, T), np.float32)
    madd[1, T // 2:] = np.float32(-1e9) if T > 1 else 0
    ref = s.astype(np.float64) * np.float64(np.float32(1.5)) + np.repeat(madd, heads, 0)[:, None]
    ref = np.exp(ref - ref.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    got = s.copy()
    cpu_loops.softmax_rows(got, madd, heads, np.float32(1.5))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=2e-7, rtol=1e-5)


def test_thread_rule_shares_the_cores_among_executing_items():
    rule = ThreadRule(cores=4)
    assert rule.threads() == 4                             # nothing executing: a caller alone
    for active, want in ((1, 4), (2, 2), (3, 1), (5, 1)):
        rule.active = active
        assert rule.threads() == want
    with pytest.raises(ValueError):
        rule.set_cores(0)


class _FakeBlas:
    """Stands in for a threadpoolctl library controller: records the counts it is given."""

    def __init__(self):
        self.calls = []

    def set_num_threads(self, n):
        self.calls.append(n)


def _rule_with_fake_blas(monkeypatch):
    """A 2-core ThreadRule free of the user's BLAS settings, sizing a fake BLAS library."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    rule, lib = ThreadRule(cores=2), _FakeBlas()
    rule._blas = [lib]
    rule.cpu = CpuShare(read=lambda: None)                 # a free host
    rule.whole = WholeCalls(mode="0")                      # pieces only
    return rule, lib


def test_thread_rule_keeps_blas_at_one_thread_and_yields_to_the_user(monkeypatch):
    rule, lib = _rule_with_fake_blas(monkeypatch)
    rule.enter()                                           # one stream: both cores
    assert rule.threads() == 2
    rule.enter()                                           # a second stream: one thread each
    assert rule.threads() == 1
    rule.exit()
    rule.exit()
    rule.enter()
    rule.set_cores(4)
    assert rule.threads() == 4
    assert lib.calls == [1]                                # BLAS at one thread, set once
    rule.exit()
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert not ThreadRule(cores=2).adapt_blas              # the user's setting wins
    assert limit_blas_threads(1) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert ThreadRule().cores == 3                         # as torch reads it (Ray sets it)


def test_pinned_blas_leaves_the_rule(monkeypatch):
    rule, lib = _rule_with_fake_blas(monkeypatch)
    rule.enter()
    rule.enter()                                           # two items: one thread each
    assert rule.threads() == 1
    rule.exit()
    rule.exit()
    assert rule.threads() == 2 and rule.active == 0
    assert lib.calls == [1]
    limits = []
    monkeypatch.setattr("runtime.cpu_threads.limit_blas_threads",
                        lambda n, force=False: limits.append((n, force)))
    with pytest.raises(ValueError):
        rule.pin_blas(0)
    rule.pin_blas(1)
    rule.pin_blas(1)                                       # once: the rule is out of BLAS now
    assert limits == [(1, True)] and not rule.adapt_blas
    rule.enter()
    rule.enter()
    assert lib.calls == [1]                                # no more BLAS changes
    rule.exit()
    rule.exit()


def test_the_thread_rule_reaches_numpys_openblas_whichever_thread_runs_the_item():
    # in a fresh process: OpenBLAS's count is process-wide, and numpy's OpenBLAS drops a count
    # set by any thread but the first to set one (runtime.cpu_threads.BlasOwner): a rule set from
    # a worker and then from the main thread must reach it from both (before, the main
    # thread's setting was dropped and its sgemm ran on 2 threads)
    code = """if True:
        import os, threading
        for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.pop(v, None)
        import numpy
        from threadpoolctl import threadpool_info
        from runtime.cpu_threads import ThreadRule, limit_blas_threads
        def blas():
            return sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
        rule = ThreadRule(cores=2)
        rule.whole.forced, rule.whole.on = False, False   # pieces only: BLAS at 1 per item
        rule.cpu.busy = False
        rule.cpu.sample = lambda *a: None          # a free host, however loaded this one is
        entered, done = threading.Event(), threading.Event()
        def worker():                              # an item on a worker that stays alive
            rule.enter(); entered.set(); done.wait(30); rule.exit()
        t = threading.Thread(target=worker); t.start(); entered.wait(30)
        a = blas()
        rule.enter(); b = blas()                   # a second item, on the main thread
        limit_blas_threads(2, force=True); c = blas()
        limit_blas_threads(1, force=True); d = blas()
        rule.exit(); done.set(); t.join()
        print(a, b, c, d)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[1]", "[1]", "[2]", "[1]"]


def test_numbas_pool_starts_passive_without_leaking_the_setting():
    code = ("import os; from runtime.kernels import cpu_loops; "
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, want in ((None, "None"), ("ACTIVE", "ACTIVE")):    # the user's value stays
        run_env = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, env=run_env)
        assert out.returncode == 0 and out.stdout.strip() == want, out.stderr


def test_concurrent_streams_split_the_cores_and_a_lone_stream_gets_them_all(monkeypatch):
    import threading

    import numba
    monkeypatch.setattr(RULE, "cores", 2)
    monkeypatch.setattr(RULE, "adapt_blas", False)         # BLAS is process-wide: leave it
    seen, barrier = [], threading.Barrier(2, timeout=10)

    def body(x, y, *, n, count):
        if together:
            barrier.wait()                                 # both items executing at once
        nn._loops()                                        # what every nn kernel does first
        seen.append((RULE.threads(), numba.get_num_threads()))
        if together:
            barrier.wait()                                 # neither ends before both looked
        y[:n] = x[:n]

    k = runtime.Kernel("rule_probe", [("x", "f32", "read"), ("y", "f32", "read_write")],
                       [("n", "u32")], cpu=body)
    c = runtime.client("cpu")
    a, b = c.with_stream(runtime.StreamId.new()), c.with_stream(runtime.StreamId.new())
    x = np.arange(4, dtype=np.float32)
    together = True
    outs = []
    for s in (a, b):
        hx, hy = s.create(x), s.empty(16)
        s.launch(k, (1, 1, 1), [hx, hy], {"n": 4})
        outs.append((s, hy))
    for s, hy in outs:
        np.testing.assert_array_equal(s.read(hy).view(np.float32), x)
    assert seen == [(1, 1), (1, 1)]
    together = False
    seen.clear()
    hx, hy = a.create(x), a.empty(16)
    a.launch(k, (1, 1, 1), [hx, hy], {"n": 4})
    a.sync()
    assert seen == [(2, min(2, cpu_loops.POOL))]


def test_cpu_backend_refuses_a_bad_blas_threads():
    for bad in (0, "two", True):
        with pytest.raises(ValueError, match="blas_threads"):
            runtime.client("cpu", blas_threads=bad)


def test_matmul_blocks_cover_the_output_once():
    for M, N, K, threads in ((128, 1152, 384, 2), (128, 384, 1536, 2), (4096, 384, 384, 2),
                             (512, 384, 384, 3), (16, 384, 384, 2), (128, 1152, 384, 1)):
        pieces = nn.mm_pieces(M, N, K, threads)
        cover = np.zeros((M, N), np.int32)
        for r0, r1, c0, c1 in pieces:
            cover[r0:r1, c0:c1] += 1
            assert c0 % 16 == 0 and r0 < r1 and c0 < c1
        assert (cover == 1).all()
        big = M * N * K >= 2 * nn.MM_PIECE_MACS and threads > 1
        assert (len(pieces) > 1) == big, (M, N, K, threads)
        assert len(pieces) <= nn.MM_PIECES_PER_THREAD * threads
    assert len({c0 for _, _, c0, _ in nn.mm_pieces(128, 1152, 384, 2)}) > 1     # by columns
    assert len({r0 for r0, _, _, _ in nn.mm_pieces(4096, 384, 384, 2)}) > 1     # by rows


def _spy_fan_out(monkeypatch) -> list:
    """Records ``(pieces, threads)`` of every ``FAN_OUT.run`` the kernels make (and runs it)."""
    jobs, run = [], nn.FAN_OUT.run

    def spy(fn, pieces, threads):
        pieces = list(pieces)
        jobs.append((len(pieces), threads))
        return run(fn, pieces, threads)
    monkeypatch.setattr(nn.FAN_OUT, "run", spy)
    return jobs


def _check_matmul(cpu, M, K, N, act):
    """``Tensor.matmul`` with a bias (and ``act``) against float64 numpy."""
    a = RNG.standard_normal((M, K)).astype(np.float32)
    w = (RNG.standard_normal((K, N)) * 0.05).astype(np.float32)
    b = RNG.standard_normal(N).astype(np.float32)
    got = Tensor.from_numpy(cpu, a).matmul(Tensor.from_numpy(cpu, w), Tensor.from_numpy(cpu, b),
                                           activation=act).numpy()
    ref = a.astype(np.float64) @ w + b
    if act:
        ref = gelu_ref(ref)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("M,K,N,act", [(128, 384, 1152, "gelu"), (600, 384, 160, None)])
def test_a_matmul_is_dealt_out_in_blocks_to_the_rules_threads(cpu, monkeypatch, M, K, N, act):
    # before, the product was one call to OpenBLAS's own (statically split, spinning) pool
    monkeypatch.setattr(RULE, "cores", 2)
    jobs = _spy_fan_out(monkeypatch)
    _check_matmul(cpu, M, K, N, act)
    assert jobs and all(n > 1 and t == 2 for n, t in jobs), jobs


def test_a_large_layer_norm_is_dealt_out_in_rows_and_a_small_one_is_not(cpu, monkeypatch):
    monkeypatch.setattr(RULE, "cores", 2)
    jobs = _spy_fan_out(monkeypatch)
    for rows, expect in ((401, True), (7, False)):
        jobs.clear()
        n = 384
        x = RNG.standard_normal((rows, n)).astype(np.float32)
        r = RNG.standard_normal((rows, n)).astype(np.float32)
        g = RNG.standard_normal(n).astype(np.float32)
        b = RNG.standard_normal(n).astype(np.float32)
        t = lambda v: Tensor.from_numpy(cpu, v)             # noqa: E731
        got = t(x).layer_norm(t(g), t(b), 1e-12, residual=t(r)).numpy()
        v = x.astype(np.float64) + r
        ref = (v - v.mean(1, keepdims=True)) / np.sqrt(v.var(1, keepdims=True) + 1e-12) * g + b
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
        assert (rows * n >= nn.LOOP_GRAIN) == expect
        assert bool(jobs and jobs[0][0] > 1) == expect, jobs


@pytest.mark.parametrize("M,K,N,act", [(128, 384, 1152, "gelu"), (64, 384, 160, None)])
def test_a_whole_call_on_a_free_host_runs_the_product_once_and_matches(cpu, monkeypatch, M, K,
                                                                       N, act):
    # while whole calls are on (runtime.cpu_threads.WholeCalls), a product of at most
    # WHOLE_ROWS rows is one call on BLAS's own threads, timed into the rule; the attention
    # and layer norm of such rows run on this thread / numba's threads: no pieces at all
    monkeypatch.setattr(RULE, "cores", 2)
    monkeypatch.setattr(RULE, "adapt_blas", True)         # another test may have pinned BLAS
    monkeypatch.setattr(RULE, "whole", WholeCalls(mode="auto", window_s=1e9))
    jobs = _spy_fan_out(monkeypatch)
    _check_matmul(cpu, M, K, N, act)
    assert jobs == [] and RULE.whole._wall > 0             # one whole call, timed
    t = lambda v: Tensor.from_numpy(cpu, v)                 # noqa: E731
    x = RNG.standard_normal((M, 384)).astype(np.float32) * 3
    g, bb = RNG.standard_normal(384).astype(np.float32), RNG.standard_normal(384).astype(np.float32)
    got = t(x).layer_norm(t(g), t(bb), 1e-12).numpy()
    v = x.astype(np.float64)
    ref = (v - v.mean(1, keepdims=True)) / np.sqrt(v.var(1, keepdims=True) + 1e-12) * g + bb
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
    assert jobs == []


def test_rows_over_the_whole_limit_are_dealt_out_even_on_a_free_host(cpu, monkeypatch):
    monkeypatch.setattr(RULE, "cores", 2)
    monkeypatch.setattr(RULE, "whole", WholeCalls(mode="1"))
    jobs = _spy_fan_out(monkeypatch)
    _check_matmul(cpu, nn.WHOLE_ROWS + 88, 384, 160, None)
    assert jobs and jobs[0][0] > 1
