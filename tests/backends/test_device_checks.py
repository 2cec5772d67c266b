"""A bad value read on the device fails the launch on every backend that checks (never silent).

``embedding`` and ``embed_at`` index tables with ids read from device buffers. On cpu the body
raises ``IndexError``; on wgpu the kernel fails a device-side check (``Kernel.checks``: it sets
the backend's ``err_flag``, read back after the submit), so in both the launch (or the replay
holding it) fails with ``LaunchError``, what it writes is marked, and a read of it raises
``ReplayFailed`` (docs/contract.md section 4) instead of returning zeros or clamped rows. cuda does
not check (documented on the kernels): skipped there with that reason.
"""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from helpers import captured
from runtime import kernels as K
from runtime.errors import ReplayFailed
from runtime.kernel import Kernel
from runtime.kernels.decode import embed_at
from runtime.kernels.shader import program

H, V, S, T, ROWS = 8, 5, 4, 2, 6
RNG = np.random.default_rng(7)
WORD = RNG.standard_normal((V, H)).astype(np.float32)
POS = RNG.standard_normal((S, H)).astype(np.float32)
TTAB = RNG.standard_normal((T, H)).astype(np.float32)
IDS = np.array([0, 1, 4, 2, 3, 1], np.int32)
TYPES = np.array([0, 1, 0, 1, 1, 0], np.int32)


@pytest.fixture
def checked(client, backend):
    if backend == "cuda":
        pytest.skip("cuda does not check ids on the device (runtime.kernels.embedding docs)")
    return client


def _reference(ids, types, s=S):
    r = np.arange(ROWS)
    return (WORD[ids] + POS[r % s] + TTAB[types]).reshape(-1)


class _Embedding:
    def __init__(self, c, s=S, graph=False):
        self.c, self.s = c, s
        self.ids, self.types = c.create(IDS), c.create(TYPES)
        self.word, self.pos, self.ttab = c.create(WORD), c.create(POS), c.create(TTAB)
        self.out = c.empty(ROWS * H, np.float32)
        self.g = captured(c, self.launch) if graph else None

    def launch(self):
        self.c.launch(K.embedding, K.grid(ROWS * H),
                      [self.ids, self.types, self.word, self.pos, self.ttab, self.out],
                      {"H": H, "S": self.s, "n": ROWS * H})

    def run(self):
        self.g.replay() if self.g is not None else self.launch()


def _raises(c, handle, what):
    with pytest.raises(ReplayFailed) as info:
        c.read(handle)
    assert what in str(info.value)
    try:
        c.sync()                    # every error was raised once, by the read
    except runtime.ServerError as e:    # pragma: no cover - a failure message
        pytest.fail(f"sync after the raising read raised again: {e!r}")


BAD = {
    "id past the table": ("ids", lambda a: a.__setitem__(2, V), "ids"),
    "negative id": ("ids", lambda a: a.__setitem__(0, -1), "ids"),
    "type past the table": ("types", lambda a: a.__setitem__(3, T), "types"),
}


@pytest.mark.parametrize("via", ["launch", "replay"])
@pytest.mark.parametrize("case", list(BAD))
def test_an_embedding_id_outside_its_table_fails_the_launch_and_its_reads(checked, via, case):
    c = checked
    e = _Embedding(c, graph=via == "replay")
    e.run()
    np.testing.assert_allclose(c.read(e.out), _reference(IDS, TYPES), rtol=1e-6)
    which, spoil, what = BAD[case]
    bad = (IDS if which == "ids" else TYPES).copy()
    spoil(bad)
    c.write(getattr(e, which), bad)
    e.run()
    _raises(c, e.out, what)
    with pytest.raises(ReplayFailed):   # until a later write lands
        c.read(e.out)
    c.write(getattr(e, which), IDS if which == "ids" else TYPES)
    e.run()                         # the flag was cleared: the next run is clean
    np.testing.assert_allclose(c.read(e.out), _reference(IDS, TYPES), rtol=1e-6)


def test_ids_shorter_than_the_rows_fail_on_every_backend_that_checks(checked):
    """``n / H`` rows need as many ids and types: a shorter ids buffer was read past its end
    (numba on cpu, robust access on wgpu) and gave rows from whatever was there."""
    c = checked
    e = _Embedding(c)
    short = c.create(IDS[:ROWS - 2])
    c.launch(K.embedding, K.grid(ROWS * H), [short, e.types, e.word, e.pos, e.ttab, e.out],
             {"H": H, "S": S, "n": ROWS * H})
    _raises(c, e.out, "rows")


def test_a_sequence_longer_than_the_position_table_fails(checked):
    c = checked
    e = _Embedding(c, s=S + 2)      # rows 4 and 5 want positions 4 and 5: the table has 4
    e.run()
    _raises(c, e.out, "pos")


def test_work_reading_a_failed_embedding_fails_too_and_other_work_does_not(checked):
    c = checked
    e = _Embedding(c)
    bad = IDS.copy()
    bad[1] = 1000
    c.write(e.ids, bad)
    e.run()
    y = c.empty(ROWS * H, np.float32)
    c.launch(K.gelu, K.grid(ROWS * H), [e.out, y], {"n": ROWS * H})    # reads the failed output
    x = c.create(np.arange(16, dtype=np.float32))
    z = c.empty(16, np.float32)
    c.launch(K.add_scalar, K.grid(16), [x, z], {"alpha": 2.0, "n": 16})  # unrelated, after it
    with pytest.raises(ReplayFailed):
        c.read(y)
    np.testing.assert_array_equal(c.read(z), np.arange(16, dtype=np.float32) + 2.0)
    with pytest.raises(ReplayFailed):
        c.read(e.out)


def test_embed_at_with_a_token_outside_its_table_fails(checked):
    c = checked
    wte, wpe = c.create(WORD), c.create(POS)
    tok, pos = c.create(np.array([V + 3], np.int32)), c.create(np.array([1], np.int32))
    out = c.empty(H, np.float32)
    c.launch(embed_at, K.grid(H), [tok, pos, wte, wpe, out], {"H": H, "T": S})
    _raises(c, out, "token")
    c.write(tok, np.array([3], np.int32))
    c.launch(embed_at, K.grid(H), [tok, pos, wte, wpe, out], {"H": H, "T": S})
    np.testing.assert_allclose(c.read(out), WORD[3] + POS[1], rtol=1e-6)


def test_program_declares_the_flag_in_both_dialects_and_checks_are_typed():
    k = program("chk", [("x", "i32", "read"), ("y", "f32", "write")], [("n", "u32")], (64, 1, 1),
                """
    let i = wg.x * 64u + lidx;
    if (i < p.n) {
        if (u32(x[i]) >= arrayLength(&y)) { atomicMax(&err_flag[0], 1u); } else { y[i] = 1.0f; }
    }""", checks=("x outside y",))
    assert k.checks == ("x outside y",)
    assert "@binding(3) var<storage, read_write> err_flag: array<atomic<u32>>;" in k.wgsl
    assert "__device__ u32 err_flag[1];" in k.cuda and "arrayLength" not in k.cuda
    with pytest.raises(TypeError, match="checks"):
        Kernel("bad", [("x", "f32", "read")], cpu=lambda x, count: None, checks="x outside")


def test_a_check_that_cannot_be_read_back_fails_the_work_it_checks(checked, backend, monkeypatch):
    if backend != "wgpu":
        pytest.skip("the readback is wgpu's (cpu raises in the body)")
    from runtime.backends import wgpu as W

    def lost(self, kernels, mark, stream):
        raise RuntimeError("device lost while mapping")
    monkeypatch.setattr(W.QueueThread, "_check_device", lost)
    c = checked
    e = _Embedding(c)
    e.run()                         # good ids, but nobody can tell: not returned as if fine
    with pytest.raises(ReplayFailed, match="device-side check"):
        c.read(e.out)
    monkeypatch.undo()
    e.run()
    np.testing.assert_allclose(c.read(e.out), _reference(IDS, TYPES), rtol=1e-6)


@pytest.mark.parametrize("via", ["launch", "replay"])
def test_an_indirect_count_past_the_limit_fails_instead_of_running_nothing(checked, backend, via):
    """WebGPU skips an indirect dispatch whose count is past the per-dimension limit without a
    word: the launch (or the replay) now fails and its output reads raise; within the limit
    the same buffers give the right values again."""
    if backend != "wgpu":
        pytest.skip("cpu has no per-dimension limit; cuda reads indirect counts on the host")
    c = checked
    limit = c.capabilities["max_workgroups"][0]
    x = c.create(np.arange(64, dtype=np.float32))
    y = c.create(np.zeros(64, np.float32))
    counts = c.create(np.array([1, 1, 1], np.uint32))

    def run():
        c.launch(K.add_scalar, counts, [x, y], {"alpha": 1.0, "n": 64})
    go = captured(c, run).replay if via == "replay" else run
    go()
    np.testing.assert_array_equal(c.read(y), np.arange(64, dtype=np.float32) + 1)
    c.write(y, np.zeros(64, np.float32))
    c.write(counts, np.array([1, limit + 1, 1], np.uint32))
    go()
    _raises(c, y, "per-dimension limit")
    c.write(counts, np.array([1, 1, 1], np.uint32))
    c.write(y, np.zeros(64, np.float32))    # (an indirect launch may write nothing: its output
    go()                                    # keeps the failure of the last writer until then)
    np.testing.assert_array_equal(c.read(y), np.arange(64, dtype=np.float32) + 1)


def test_a_param_past_the_size_the_sources_hold_is_refused_on_every_backend(client):
    """causal_attend keeps scores in a workgroup array of MAX_CACHE rows and q in one of
    MAX_HEAD_DIM; attention_hd32 compiles its head dim in. A launch past them read and wrote
    past the arrays on the GPU (silently wrong) while cpu computed it: now ``ValueError`` at
    the call on every backend (``Kernel.ranges``), and the server serves on."""
    from runtime.kernels import decode as D
    c = client
    heads, hd, T = 2, 4, D.MAX_CACHE + 1
    H = heads * hd
    qkv, pos = c.create(np.ones(3 * H, np.float32)), c.create(np.array([0], np.int32))
    kc, vc = c.create(np.ones(T * H, np.float32)), c.create(np.ones(T * H, np.float32))
    out = c.empty(H, np.float32)
    base = {"heads": heads, "hd": hd, "off": 0, "scale": 0.5}
    for bad, match in (({"T": T}, r"T=1025 is outside \[1, 1024\]"),
                       ({"T": 0}, r"T=0 is outside"),
                       ({"T": 8, "hd": D.MAX_HEAD_DIM + 1, "heads": 1}, r"hd=")):
        with pytest.raises(ValueError, match=match):
            c.launch(D.causal_attend, (heads, 1, 1), [qkv, pos, kc, vc, out], {**base, **bad})
    c.launch(D.causal_attend, (heads, 1, 1), [qkv, pos, kc, vc, out], {**base, "T": 8})
    np.testing.assert_allclose(c.read(out), np.ones(H, np.float32), rtol=1e-6)
    att = K.nn.attention_for(32)
    with pytest.raises(ValueError, match=r"hd=64 is outside \[32, 32\]"):
        att.pack_params({"S": 4, "heads": 1, "hd": 64, "ld_in": 64, "q_off": 0, "k_off": 0,
                         "v_off": 0, "ld_out": 64, "scale": 1.0})
    with pytest.raises(ValueError, match="ranges names 'x'"):
        Kernel("r", [("y", "f32", "write")], [("n", "u32")], cpu=lambda y, count, n: None,
               ranges={"x": (0, 1)})
    for bad in ((5, 1), (1.5, 3), (1,), ("a", 2), 3):   # (USER6: (5, 1) refused every value,
        with pytest.raises(ValueError, match=r"ranges\['n'\] must be"):  # 1.5 became 1)
            Kernel("r", [("y", "f32", "write")], [("n", "u32")], cpu=lambda y, count, n: None,
                   ranges={"n": bad})


def test_a_zero_count_or_divisor_param_is_refused_on_every_backend(client):
    """argmax over n = 0 values, embed_at/kv_append with T = 0 cache rows, embedding with H or
    S = 0 and mean_pool with H = 0: the cpu body raised (an empty argmax, a broadcast into a
    slice clamped to T - 1 = -1, a division by zero) while the WGSL computed ``0u - 1u`` or
    ``x % 0u`` and returned values with no error (argmax -1, the row at pos, positions of row
    0). Now ``ValueError`` at the call on every backend (``Kernel.ranges``, ``hi`` None), nothing
    queued, and the server serves on (USER6: found by a new user's probe on cpu and wgpu)."""
    from runtime.kernels import decode as D
    c = client
    f = lambda n, v=0.0: c.create(np.full(n, v, np.float32))             # noqa: E731
    i = lambda n: c.create(np.zeros(n, np.int32))                        # noqa: E731
    cases = [
        (D.argmax, (1, 1, 1), [f(8, 1.0), i(1)], {"n": 0}, "n=0"),
        (D.embed_at, K.grid(H), [i(1), i(1), f(2 * H), f(2 * H), f(H)], {"H": H, "T": 0}, "T=0"),
        (D.kv_append, K.grid(H), [f(3 * H), i(1), f(2 * H), f(2 * H)],
         {"H": H, "T": 0, "off": 0}, "T=0"),
        (K.embedding, K.grid(2 * H), [i(2), i(2), f(2 * H), f(2 * H), f(2 * H), f(2 * H)],
         {"H": H, "S": 0, "n": 2 * H}, "S=0"),
        (K.embedding, K.grid(2 * H), [i(2), i(2), f(2 * H), f(2 * H), f(2 * H), f(2 * H)],
         {"H": 0, "S": 2, "n": 2 * H}, "H=0"),
        (K.nn.mean_pool, K.grid(H), [f(4 * H), f(4), f(H)], {"S": 4, "H": 0, "n": H}, "H=0"),
    ]
    for kern, count, hs, params, what in cases:
        with pytest.raises(ValueError, match=f"kernel {kern.name}: param {what} must be at least 1"):
            c.launch(kern, count, hs, params)
    c.sync()                                             # nothing was queued
    x, out = c.create(np.array([3, 9, 1], np.float32)), i(1)
    c.launch(D.argmax, (1, 1, 1), [x, out], {"n": 3})
    assert c.read(out)[0] == 1


def test_a_row_kernel_over_n_not_a_multiple_of_h_fails_on_every_backend_that_checks(checked):
    """embedding and mean_pool work in rows of H: with n = 12, H = 8 the cpu body wrote one
    whole row (out[8:12] untouched) and the WGSL a row and a half (out[8:12] computed): different
    values, no error on either. Now the launch fails on both (cpu ValueError, wgpu a device-side
    check) and its output reads raise; n a multiple of H matches numpy (USER6)."""
    c = checked
    f = lambda a: c.create(np.asarray(a, np.float32))                    # noqa: E731
    ids, types = c.create(np.zeros(2, np.int32)), c.create(np.zeros(2, np.int32))
    word, pos, ttab = f(WORD), f(POS), f(TTAB)
    x, mask = f(np.arange(4 * H, dtype=np.float32)), f(np.ones(4))
    for kern, hs, params in (
            (K.embedding, [ids, types, word, pos, ttab], {"H": H, "S": S}),
            (K.nn.mean_pool, [x, mask], {"S": 2, "H": H})):
        out = c.create(np.full(2 * H, 7, np.float32))
        c.launch(kern, K.grid(2 * H), [*hs, out], {**params, "n": H + H // 2})
        with pytest.raises(ReplayFailed, match="multiple of H") as e:
            c.read(out)
        # the wgpu check skips only what it guards: its message does not claim that nothing
        # of the output was written (it said "the dispatch's output is not written")
        assert "not written" not in str(e.value)
        c.launch(kern, K.grid(2 * H), [*hs, out], {**params, "n": 2 * H})
        got = c.read(out)
        want = ((WORD[[0, 0]] + POS[[0, 1]] + TTAB[[0, 0]]).reshape(-1) if kern is K.embedding
                else np.arange(4 * H, dtype=np.float32).reshape(2, 2, H).mean(axis=1).reshape(-1))
        np.testing.assert_allclose(got, want, rtol=1e-6)


def _attention_ref(qkv, mask, B, S, heads, hd):
    x = qkv.reshape(B, S, 3, heads, hd)
    q, k, v = (x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))      # [B, heads, S, hd]
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + (1.0 - mask.reshape(B, 1, 1, S)) * -1e9
    p = np.exp(s - s.max(-1, keepdims=True))
    o = (p / p.sum(-1, keepdims=True)) @ v
    return o.transpose(0, 2, 1, 3).reshape(-1)


@pytest.mark.parametrize("short", ["qkv", "mask", "out"])
def test_attention_over_buffers_shorter_than_its_rows_fails(checked, short):
    """The attention kernel reads B * S rows of ``ld_in`` (q, k, v at their offsets), B * S mask
    values and writes B * S rows of ``ld_out``: a shorter buffer raised on cpu and was read
    clamped on wgpu. A full launch matches numpy."""
    c = checked
    B, S, heads, hd = 2, 5, 2, 32
    ld, H = 3 * heads * hd, heads * hd
    rng = np.random.default_rng(11)
    qkv = rng.standard_normal(B * S * ld).astype(np.float32)
    mask = np.ones(B * S, np.float32)
    mask[S - 1] = 0.0
    att = K.nn.attention_for(hd)
    params = {"S": S, "heads": heads, "hd": hd, "ld_in": ld, "q_off": 0, "k_off": H,
              "v_off": 2 * H, "ld_out": H, "scale": float(1 / np.sqrt(hd))}
    count = K.nn.attention_count(B, S, heads)
    hq, hm, ho = c.create(qkv), c.create(mask), c.empty(B * S * H, np.float32)
    c.launch(att, count, [hq, hq, hq, hm, ho], params)
    np.testing.assert_allclose(c.read(ho), _attention_ref(qkv, mask, B, S, heads, hd),
                               rtol=1e-4, atol=1e-5)
    bad = {"qkv": c.create(qkv[:-ld]), "mask": c.create(mask[:-1]),
           "out": c.empty(B * S * H - H, np.float32)}[short]
    args = {"qkv": [bad, bad, bad, hm, ho], "mask": [hq, hq, hq, bad, ho],
            "out": [hq, hq, hq, hm, bad]}[short]
    c.launch(att, count, args, params)
    written = args[-1]
    with pytest.raises(runtime.ServerError):
        c.sync()
    with pytest.raises(ReplayFailed):
        c.read(written)


def _decode_case(name):
    """(kernel, count, arrays, params, index of the binding to shorten, index of the output)"""
    from runtime.kernels import decode as D
    H, T, heads = 8, 4, 2
    f = np.float32
    rng = np.random.default_rng(2)
    qkv, cache = rng.standard_normal(3 * H).astype(f), rng.standard_normal(T * H).astype(f)
    pos = np.array([T - 1], np.int32)
    return {
        "mean_pool x": (K.mean_pool, K.grid(2 * H), [rng.standard_normal(2 * 3 * H).astype(f),
                        np.ones(6, f), np.zeros(2 * H, f)], {"S": 3, "H": H, "n": 2 * H}, 0, 2),
        "mean_pool mask": (K.mean_pool, K.grid(2 * H), [rng.standard_normal(2 * 3 * H).astype(f),
                           np.ones(6, f), np.zeros(2 * H, f)], {"S": 3, "H": H, "n": 2 * H}, 1, 2),
        "embed_at wpe": (D.embed_at, K.grid(H), [np.array([1], np.int32), pos,
                         rng.standard_normal(3 * H).astype(f), cache.copy(), np.zeros(H, f)],
                         {"H": H, "T": T}, 3, 4),
        "kv_append kc": (D.kv_append, K.grid(H), [qkv, pos, cache.copy(), cache.copy()],
                         {"H": H, "T": T, "off": 0}, 2, 2),
        "kv_append qkv": (D.kv_append, K.grid(H), [qkv, pos, cache.copy(), cache.copy()],
                          {"H": H, "T": T, "off": 0}, 0, 3),
        "causal_attend vc": (D.causal_attend, (heads, 1, 1), [qkv, pos, cache, cache.copy(),
                             np.zeros(H, f)], {"heads": heads, "hd": H // heads, "T": T, "off": 0,
                                               "scale": 0.5}, 3, 4),
        "argmax x": (D.argmax, (1, 1, 1), [rng.standard_normal(16).astype(f),
                     np.zeros(1, np.int32)], {"n": 16}, 0, 1),
        "feed_back hist": (D.feed_back, (1, 1, 1), [np.array([5], np.int32),
                           np.array([0], np.int32), np.array([0], np.int32),
                           np.zeros(T, np.int32)], {"T": T}, 3, 3),
    }[name]


@pytest.mark.parametrize("case", ["mean_pool x", "mean_pool mask", "embed_at wpe", "kv_append kc",
                                  "kv_append qkv", "causal_attend vc", "argmax x",
                                  "feed_back hist"])
def test_a_buffer_shorter_than_the_kernel_reads_fails_on_every_backend(checked, case):
    """Each kernel reads or writes a row its params (or a device position) name: with that
    buffer one element short, cpu raised (a reshape or slice of the wrong length) while wgpu
    read or dropped it silently (robust access). Now every backend fails the launch (a declared
    element count the server checks, or a device-side check) and marks its output; the full
    buffers run clean."""
    c = checked
    kernel, count, arrays, params, short, out = _decode_case(case)
    full = [c.create(a) for a in arrays]
    c.launch(kernel, count, full, params)
    c.sync()
    c.read(full[out])                           # the full launch: clean
    bufs = [c.create(a[:-1] if i == short else a) for i, a in enumerate(arrays)]
    c.launch(kernel, count, bufs, params)
    with pytest.raises(runtime.ServerError):
        c.sync()
    with pytest.raises(ReplayFailed):
        c.read(bufs[out])


@pytest.mark.parametrize("case", ["gelu", "layer_norm", "matmul", "attention", "embed_at"])
def test_a_workgroup_count_short_of_the_work_is_refused_on_every_backend(client, case):
    """The row, matmul, attention and gather kernels' cpu bodies do the whole work whatever
    the count, their GPU sources the part the count covers: one 64-wide workgroup over 1,024
    gelu elements gave 1,024 values on cpu and 64 on wgpu, no error. A short count is refused
    now (``LaunchError`` naming the count helper; the output marked), on every backend, and in
    ``Graph.update(count=...)`` (``ValueError``)."""
    from runtime.kernels import decode as D
    c = client
    f = np.float32
    if case == "gelu":
        k, short, full, bufs, params = K.gelu, (1, 1, 1), K.grid(1024), [np.ones(1024, f),
                                                                         np.zeros(1024, f)], {"n": 1024}
    elif case == "layer_norm":
        k, short, full = K.layer_norm, (2, 1, 1), K.nn.rows_count(4)
        bufs, params = [np.ones(32, f), np.ones(8, f), np.zeros(8, f), np.zeros(32, f)], \
            {"rows": 4, "n": 8, "eps": 1e-5}
    elif case == "matmul":
        k, full = K.matmul, K.nn.matmul_count(200, 4)
        short = (full[0], full[1] - 1, 1)
        bufs, params = [np.ones(800, f), np.ones(16, f), np.zeros(800, f)], {"M": 200, "N": 4, "K": 4}
    elif case == "attention":
        k, full = K.nn.attention_for(8), K.nn.attention_count(1, 80, 1)
        short = (1, 1, 1)
        bufs = [np.ones(80 * 24, f)] * 3 + [np.ones(80, f), np.zeros(80 * 8, f)]
        params = {"S": 80, "heads": 1, "hd": 8, "ld_in": 24, "q_off": 0, "k_off": 8, "v_off": 16,
                  "ld_out": 8, "scale": 0.5}
    else:
        k, short, full = D.embed_at, (1, 1, 1), K.grid(100)
        bufs = [np.array([1], np.int32), np.array([0], np.int32), np.ones(300, f),
                np.ones(200, f), np.zeros(100, f)]
        params = {"H": 100, "T": 2}
    hs = [c.create(b) for b in bufs]
    c.launch(k, short, hs, params)
    with pytest.raises(runtime.errors.LaunchError, match=r"covers less than its params ask for"):
        c.sync()
    with pytest.raises(ReplayFailed):
        c.read(hs[-1])
    g = captured(c, lambda: c.launch(k, full, hs, params))
    g.replay()
    c.read(hs[-1])                                  # the full count: clean
    with pytest.raises(ValueError, match="covers less"):
        g.update(count={0: short})
