"""A graph that writes part of a buffer and then reads more of it reads what the graph found
there (docs/contract.md sections 4 and 4c; ADV7).

A ``write`` binding whose declared element count (or workgroup count) covers a prefix of its
buffer hides a later read only where it covers what that read touches
(``runtime.server.capture.sources``, ``Kernel.touched_bytes``). Before ADV7 any write hid every
later read: a ``fill`` of half of ``y`` then a ``copy`` of all of ``y`` into ``z`` made ``z``
from the half the failed writer left, and ``z`` read back with no error; in a graph pool such a
buffer counted as a temporary, so another graph of the pool overwrote the half the reader
reads.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import ReplayFailed

N = 8


def _fail_a_write_of(c, y, short):
    """A launch that would write all of ``y`` is refused (``short`` holds fewer elements than
    its ``n``): ``y`` is marked, on every backend."""
    n = y.nbytes // 4
    c.launch(K.add_scalar, K.grid(n), [short, y], {"alpha": 1.0, "n": n})
    with pytest.raises(runtime.ServerError):
        c.sync()


def _half_then_all(c, y, z, zh):
    c.launch(K.fill, K.grid(N // 2), [y], {"value": 3.0, "n": N // 2})    # half of y
    c.launch(K.copy, K.grid(N), [y, z], {"n": N})                         # all of y
    c.launch(K.copy, K.grid(N // 2), [y, zh], {"n": N // 2})              # the half it wrote


def _capture(c, fn, *args, pool=None):
    c.graph_prepare(pool=pool)
    fn(c, *args)
    c.start_capture()
    fn(c, *args)
    return c.stop_capture()


def test_a_graph_reading_past_its_own_partial_write_inherits_the_failure(client):
    c = client.with_stream(runtime.StreamId.new())
    short = c.create(np.zeros(4, np.float32))
    y = c.create(np.full(N, 100, np.float32))
    z, zh = c.empty(N, np.float32), c.empty(N // 2, np.float32)
    g = _capture(c, _half_then_all, y, z, zh)
    _fail_a_write_of(c, y, short)
    for _ in range(2):                  # every replay, until y is written from the host
        g.replay()
        for h in (z, y):                # z holds the failed half: never a value (was silent)
            with pytest.raises(ReplayFailed, match="add_scalar"):
                c.read(h)
    c.write(y, np.full(N, 5, np.float32))
    g.replay()
    np.testing.assert_array_equal(c.read(z), [3, 3, 3, 3, 5, 5, 5, 5])
    np.testing.assert_array_equal(c.read(zh), [3, 3, 3, 3])
    g.release()


def test_a_read_within_the_part_a_graph_rewrote_is_not_stale(client):
    """The other side of the rule: what reads only the rewritten part is computed from clean
    data, so a graph whose temporaries are written in part (MiniLM's bucket graphs over a
    shared arena) still recovers from a failure of their last writer."""
    c = client.with_stream(runtime.StreamId.new())
    short = c.create(np.zeros(4, np.float32))
    t = c.create(np.full(N, 100, np.float32))
    out = c.empty(N // 2, np.float32)

    def body(c, t, out):
        c.launch(K.fill, K.grid(N // 2), [t], {"value": 2.0, "n": N // 2})
        c.launch(K.add_scalar, K.grid(N // 2), [t, out], {"alpha": 1.0, "n": N // 2})
    g = _capture(c, body, t, out)
    _fail_a_write_of(c, t, short)
    g.replay()
    np.testing.assert_array_equal(c.read(out), np.full(N // 2, 3, np.float32))
    with pytest.raises(ReplayFailed):   # its other half still holds what the failure left
        c.read(t)
    g.release()


def test_a_graph_updated_to_write_part_of_a_buffer_it_then_reads_whole_inherits(client):
    """The same shape made by ``Graph.update(params=...)``: the fill of all of ``y`` updated to
    half of it; updated back, the copy is computed from clean data again."""
    c = client.with_stream(runtime.StreamId.new())
    short = c.create(np.zeros(4, np.float32))
    y, z = c.create(np.full(N, 100, np.float32)), c.empty(N, np.float32)

    def body(c, y, z):
        c.launch(K.fill, K.grid(N), [y], {"value": 3.0, "n": N})
        c.launch(K.copy, K.grid(N), [y, z], {"n": N})
    g = _capture(c, body, y, z)
    g.update(params={0: {"n": N // 2}})
    _fail_a_write_of(c, y, short)
    g.replay()
    with pytest.raises(ReplayFailed, match="add_scalar"):
        c.read(z)
    g.update(params={0: {"n": N}})
    g.replay()
    np.testing.assert_array_equal(c.read(z), np.full(N, 3, np.float32))
    g.release()


def _private():
    return runtime.client("cpu", max_idle_bytes=(1 << 30) + 27)   # a server of its own


def _pool_graph(c, out, n, value, pool, part=False):
    """``t = empty(n); t[:m] = value; out = t`` with ``m`` = ``n // 2`` (``part``: the
    window's ``t`` is read past what the graph writes, so it is state) or ``n`` (a plain
    temporary, shared by the pool)."""
    def body():
        t = c.empty(n, np.float32)
        m = n // 2 if part else n
        c.launch(K.fill, K.grid(m), [t], {"value": value, "n": m})
        c.launch(K.copy, K.grid(n), [t, out], {"n": n})
        del t
    return _capture(c, lambda c: body(), pool=pool)


def test_a_pool_never_shares_a_buffer_a_graph_reads_past_its_partial_write():
    """Graph A fills half of its window's ``t`` and copies all of it: ``t``'s other half is
    state A reads. Before, the pool shared ``t`` with B as a temporary, so A's output changed
    with every replay of B (7s in the half A does not write). Now ``t`` stays A's own."""
    n = 256
    c = _private().with_stream(runtime.StreamId.new())
    out_a, out_b = c.empty(n, np.float32), c.empty(n, np.float32)
    pool = runtime.GraphPool()
    ga = _pool_graph(c, out_a, n, 1.0, pool, part=True)
    gc.collect()
    ga.replay()
    first = c.read(out_a)
    np.testing.assert_array_equal(first[:n // 2], np.ones(n // 2, np.float32))
    gb = _pool_graph(c, out_b, n, 7.0, pool)
    gc.collect()
    for _ in range(2):
        gb.replay()
        np.testing.assert_array_equal(c.read(out_b), np.full(n, 7, np.float32))
        ga.replay()
        np.testing.assert_array_equal(c.read(out_a), first)


def test_a_pool_window_reading_past_a_partial_write_of_a_shared_buffer_is_refused():
    """The window takes B's temporary from the pool, writes half of it and reads all of it:
    the other half would be whatever B's last replay left. ``stop_capture`` raises
    ``GraphStateError`` (no graph), as for any state taken from the pool; B still works."""
    n = 256
    c = _private().with_stream(runtime.StreamId.new())
    out_a, out_b = c.empty(n, np.float32), c.empty(n, np.float32)
    pool = runtime.GraphPool()
    gb = _pool_graph(c, out_b, n, 7.0, pool)
    gc.collect()
    assert pool.memory_usage()["free_bytes"] == n * 4
    with pytest.raises(runtime.GraphStateError, match="read by the recording before"):
        _pool_graph(c, out_a, n, 1.0, pool, part=True)
    gc.collect()
    gb.replay()
    np.testing.assert_array_equal(c.read(out_b), np.full(n, 7, np.float32))


def test_kernels_writing_a_prefix_of_a_longer_buffer_keep_its_mark(client):
    """``attention`` writes ``B * S`` rows of ``out``, ``argmax`` one element: over a longer
    buffer whose last writer failed, the rest still holds what it held, so a read keeps
    raising (before ADV7 their ``out`` declared no extent, was taken as rewritten whole, and
    the stale rest read back with no error: 100s after the attention rows, eagerly, on cpu and
    wgpu). A host write of the whole buffer clears it."""
    from runtime.kernels import decode, nn
    c = client.with_stream(runtime.StreamId.new())
    B, S, heads, hd = 1, 4, 2, 32
    H = heads * hd
    qkv = c.create(np.ones(B * S * 3 * H, np.float32))
    mask = c.create(np.ones(B * S, np.float32))
    out = c.create(np.full(2 * B * S * H, 100, np.float32))     # twice what it writes
    _fail_a_write_of(c, out, c.create(np.zeros(4, np.float32)))
    c.launch(nn.attention, nn.attention_count(B, S, heads), [qkv, qkv, qkv, mask, out],
             {"S": S, "heads": heads, "hd": hd, "ld_in": 3 * H, "q_off": 0, "k_off": H,
              "v_off": 2 * H, "ld_out": H, "scale": 0.1})
    for _ in range(2):
        with pytest.raises(ReplayFailed, match="add_scalar"):
            c.read(out)
    c.write(out, np.zeros(2 * B * S * H, np.float32))
    c.launch(nn.attention, nn.attention_count(B, S, heads), [qkv, qkv, qkv, mask, out],
             {"S": S, "heads": heads, "hd": hd, "ld_in": 3 * H, "q_off": 0, "k_off": H,
              "v_off": 2 * H, "ld_out": H, "scale": 0.1})
    got = c.read(out)
    np.testing.assert_allclose(got[:B * S * H], np.ones(B * S * H, np.float32), rtol=1e-5)
    np.testing.assert_array_equal(got[B * S * H:], np.zeros(B * S * H, np.float32))

    x = c.create(np.array([1, 5, 2, 0], np.float32))
    idx = c.create(np.full(4, 9, np.int32))
    c.launch(K.copy_words, K.grid(4), [c.create(np.zeros(1, np.int32)), idx], {"n": 4})
    with pytest.raises(runtime.ServerError):
        c.sync()
    c.launch(decode.argmax, 1, [x, idx], {"n": 4})
    with pytest.raises(ReplayFailed):
        c.read(idx)
    c.write(idx, np.zeros(4, np.int32))
    c.launch(decode.argmax, 1, [x, idx], {"n": 4})
    np.testing.assert_array_equal(c.read(idx), [1, 0, 0, 0])
