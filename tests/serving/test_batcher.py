"""``runtime.serving.batcher`` against a fake model: bucket choice, batching and padding,
failures, fairness, the token budget, cancellation and draining (numpy only)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from runtime.serving.batcher import (BatchFailed, Batcher, BatcherClosed, QueueFull,
                                     choose_bucket)
from runtime.serving.metrics import ServingMetrics

from fakes import FakeModel, HIDDEN, TEXTS, expected


# -- bucket choice --------------------------------------------------------------------------
def test_choose_bucket_rounds_rows_and_tokens_up_to_the_next_bucket():
    assert choose_bucket(3, 17, (1, 4, 16), (16, 32, 256)) == (4, 32)
    assert choose_bucket(1, 1, (1, 4, 16), (16, 32, 256)) == (1, 16)
    assert choose_bucket(16, 256, (1, 4, 16), (16, 32, 256)) == (16, 256)
    with pytest.raises(ValueError):
        choose_bucket(17, 3, (1, 4, 16), (16, 32))


def test_a_full_graph_cache_pads_up_to_a_captured_bucket_instead_of_evicting():
    held = [(16, 32), (4, 16)]
    assert choose_bucket(2, 10, (1, 4, 16), (16, 32), held, max_graphs=2) == (4, 16)
    assert choose_bucket(5, 10, (1, 4, 16), (16, 32), held, max_graphs=2) == (16, 32)
    # room left, or nothing captured fits: the exact bucket
    assert choose_bucket(2, 10, (1, 4, 16), (16, 32), held, max_graphs=3) == (4, 16)
    assert choose_bucket(1, 10, (1, 4, 16), (16, 32), held, max_graphs=3) == (1, 16)
    assert choose_bucket(1, 40, (1, 4, 16), (16, 64), held, max_graphs=2) == (1, 64)


def test_a_full_graph_cache_runs_fewer_rows_in_a_captured_bucket_rather_than_capture():
    held = [(1, 256), (4, 16)]
    assert choose_bucket(3, 200, (1, 4, 16), (16, 256), held, max_graphs=2) == (1, 256)
    model = FakeModel(max_graphs=1)
    with Batcher(model, batch_buckets=(1, 4), seq_buckets=(8, 16)) as b:
        b.warmup([(1, 16)], progress=False)
        e = b.embed(["a", "b c", "d e f"], timeout=10)
    for row, t in zip(e, ["a", "b c", "d e f"]):
        np.testing.assert_array_equal(row, expected(model, t))
    assert model.calls == [("graph", 1, 16, 1)] * 4 and model.buckets == [(1, 16)]


def test_max_padding_runs_the_bucket_the_texts_fill_instead_of_a_mostly_padded_one():
    bb, sb = (1, 2, 4, 8, 16, 32), (16, 32)
    assert choose_bucket(20, 10, bb, sb, max_padding=0.25) == (16, 16)   # 32 would pad 37.5%
    assert choose_bucket(24, 10, bb, sb, max_padding=0.25) == (32, 16)   # 25%: allowed
    assert choose_bucket(3, 20, bb, sb, max_padding=0.25) == (4, 32)
    assert choose_bucket(5, 20, bb, sb, max_padding=0.25) == (4, 32)
    assert choose_bucket(20, 10, bb, sb) == (32, 16)                       # no bound
    # a full cache: only a captured bucket is taken
    held = [(32, 16), (8, 16)]
    assert choose_bucket(20, 10, bb, sb, held, max_graphs=2, max_padding=0.25) == (32, 16)
    assert choose_bucket(11, 10, bb, sb, held + [(16, 16)], max_graphs=3,
                         max_padding=0.25) == (8, 16)


def test_a_batch_over_max_padding_runs_in_full_buckets_and_every_text_gets_its_row():
    model = FakeModel(max_graphs=16)
    texts = [TEXTS[i % len(TEXTS)][:20] or "z" for i in range(5)]
    b = Batcher(model, max_padding=0.25, batch_buckets=(1, 2, 4, 8), seq_buckets=(16,),
                start=False)
    fut = b.submit(texts)
    b.start()
    e = fut.result(10).embeddings
    b.close()
    for row, t in zip(e, texts):
        np.testing.assert_array_equal(row, expected(model, t))
    assert [c[1:] for c in model.calls] == [(4, 16, 4), (1, 16, 1)]     # not (8, 16, 5)


def test_max_padding_auto_bounds_padding_on_the_cpu_backend_only():
    class OnBackend(FakeModel):
        def __init__(self, backend):
            super().__init__()
            self.client = type("Client", (), {"backend": backend})()

    assert Batcher(OnBackend("cpu"), start=False).max_padding == 0.25
    assert Batcher(OnBackend("wgpu"), start=False).max_padding is None
    assert Batcher(FakeModel(), start=False).max_padding is None
    assert Batcher(OnBackend("cpu"), graph=False, exact_shapes=True,
                   start=False).max_padding is None
    with pytest.raises(ValueError, match="max_padding"):
        Batcher(FakeModel(), max_padding=1.0, start=False)


# -- batching with a fake model --------------------------------------------------------------
def test_texts_are_grouped_by_seq_bucket_padded_and_split_back_to_their_requests():
    model = FakeModel(max_seq_length=64, max_graphs=16)
    b = Batcher(model, max_batch=4, batch_buckets=(1, 2, 4), seq_buckets=(4, 8, 64),
                start=False)
    futs = [b.submit([TEXTS[(i + j) % len(TEXTS)] for j in range(i % 3 + 1)])
            for i in range(20)]
    b.start()
    for i, f in enumerate(futs):
        res = f.result(10)
        texts = [TEXTS[(i + j) % len(TEXTS)] for j in range(i % 3 + 1)]
        assert res.embeddings.shape == (len(texts), HIDDEN)
        for row, t in zip(res.embeddings, texts):
            np.testing.assert_array_equal(row, expected(model, t))
        np.testing.assert_array_equal(res.tokens, [len(t.split()) + 2 for t in texts])
    b.close()
    assert model.calls
    for path, batch, seq, rows in model.calls:
        assert path == "graph" and batch in (1, 2, 4) and seq in (4, 8, 64)
        assert rows <= batch
    assert max(c[3] for c in model.calls) == 4       # queued work really was batched


def test_padding_rows_never_reach_a_response():
    model = FakeModel()
    with Batcher(model, batch_buckets=(8,), seq_buckets=(16,)) as b:
        for t in TEXTS[:4]:
            e = b.embed([t], timeout=10)
            assert np.isfinite(e).all()
            np.testing.assert_array_equal(e[0], expected(model, t))
    assert all(c[1] == 8 and c[3] == 1 for c in model.calls)


def test_the_eager_path_runs_the_same_padded_bucket_shapes():
    model = FakeModel()
    with Batcher(model, graph=False, batch_buckets=(1, 4), seq_buckets=(8, 16)) as b:
        e = b.embed(["a b c", "a"], timeout=10)
    np.testing.assert_array_equal(e[1], expected(model, "a"))
    assert model.calls == [("eager", 4, 8, 2)]


def test_exact_shapes_run_each_eager_batch_at_its_own_rows_and_longest_text():
    model = FakeModel()
    with Batcher(model, graph=False, exact_shapes=True, batch_buckets=(1, 4),
                 seq_buckets=(8, 16)) as b:
        e = b.embed(["a b c", "a"], timeout=10)
    np.testing.assert_array_equal(e[0], expected(model, "a b c"))
    np.testing.assert_array_equal(e[1], expected(model, "a"))
    assert model.calls == [("eager", 2, 5, 2)]          # [CLS] a b c [SEP]: 5 tokens, 2 rows
    with pytest.raises(ValueError, match="graph=False"):
        Batcher(model, graph=True, exact_shapes=True, start=False)


def test_long_texts_are_cut_by_the_tokenizer_and_an_empty_string_is_valid():
    model = FakeModel(max_seq_length=16)
    with Batcher(model, batch_buckets=(1, 2), seq_buckets=(8, 16)) as b:
        res = b.submit(["w " * 100, ""]).result(10)
        assert res.tokens.tolist() == [16, 2]
        assert res.embeddings[0, -1] == 16 and res.embeddings[1, -1] == 2
        empty = b.submit([]).result(1)
        assert empty.embeddings.shape == (0, HIDDEN)
        with pytest.raises(TypeError):
            b.submit([1, 2])


def test_a_failing_batch_fails_only_its_own_requests():
    model = FakeModel()
    b = Batcher(model, batch_buckets=(1, 2, 4), seq_buckets=(4, 8, 16), start=False)
    bad = b.submit(["boom"])                              # 3 tokens: seq bucket 4
    also_bad = b.submit(["a", "b c d e f"])              # row 0 shares the failing batch
    good = b.submit(["a b c d e f g"])                   # 9 tokens: another batch
    b.start()
    with pytest.raises(BatchFailed, match="boom"):
        bad.result(10)
    with pytest.raises(BatchFailed):
        also_bad.result(10)
    np.testing.assert_array_equal(good.result(10).embeddings[0],
                                  expected(model, "a b c d e f g"))
    np.testing.assert_array_equal(b.embed(["a"], timeout=10)[0], expected(model, "a"))
    assert b.alive
    b.close()


def test_closing_fails_what_is_still_queued_and_refuses_new_work():
    b = Batcher(FakeModel(), start=False)
    f = b.submit(["a"])
    b.close()
    with pytest.raises(BatcherClosed):
        f.result(5)
    with pytest.raises(BatcherClosed):
        b.submit(["a"])


def test_a_full_queue_refuses_with_queue_full():
    b = Batcher(FakeModel(), max_queue=3, start=False)
    b.submit(["a", "b"])
    with pytest.raises(QueueFull):
        b.submit(["c", "d"])
    b.close()


def test_a_request_larger_than_the_queue_is_refused_as_bad_input_not_queue_full():
    """A request of more texts than ``max_queue`` can never be admitted: before, it got
    QueueFull (503 + Retry-After over HTTP) on an idle server, forever (found by a new user's
    trial); now ValueError (400), and a request of ``max_queue`` texts still runs."""
    b = Batcher(FakeModel(), max_queue=3)
    try:
        with pytest.raises(ValueError, match="max_queue=3"):
            b.submit(["a", "b", "c", "d"])
        assert b.queued == 0
        assert b.embed(["a", "b", "c"], timeout=10).shape[0] == 3
    finally:
        b.close()


def test_warmup_runs_each_bucket_once_and_respects_the_graph_bound():
    model = FakeModel(max_graphs=2)
    m = ServingMetrics()
    b = Batcher(model, batch_buckets=(1, 4), seq_buckets=(8, 16), metrics=m)
    assert b.warmup([(1, 8), (4, 16)], progress=False) == [(1, 8), (4, 16)]
    assert model.buckets == [(1, 8), (4, 16)] and m.value("graph_captures_total") == 2
    with pytest.raises(ValueError, match="max_graphs"):
        b.warmup([(1, 8), (4, 8), (1, 16)], progress=False)
    with pytest.raises(ValueError):
        b.warmup([(3, 8)], progress=False)
    b.close()


# -- fairness, token budget, cancellation ----------------------------------------------------
def _completion_order(model, futs: dict) -> list:
    """Record ``(name, batches run so far)`` as each future completes."""
    order = []
    for name, f in futs.items():
        f.add_done_callback(lambda _, n=name: order.append((n, len(model.calls))))
    return order


def test_a_small_request_finishes_before_a_big_one_started_earlier():
    gate = threading.Event()
    model = FakeModel(max_graphs=8, gate=gate)
    with Batcher(model, max_batch=4, batch_buckets=(1, 2, 4), seq_buckets=(4, 16)) as b:
        big_texts = [f"w{i}" for i in range(40)]                 # 3 tokens: seq bucket 4
        big = b.submit(big_texts)
        assert model.entered.wait(10)                            # its first batch is running
        small = b.submit(["a b c d e f g"])                      # 9 tokens: seq bucket 16
        order = _completion_order(model, {"big": big, "small": small})
        gate.set()
        np.testing.assert_array_equal(small.result(10).embeddings[0],
                                      expected(model, "a b c d e f g"))
        res = big.result(10)
    for row, t in zip(res.embeddings, big_texts):
        np.testing.assert_array_equal(row, expected(model, t))
    # oldest-first batching would run all 10 of big's batches first; fair batching runs the
    # small one right after the batch that was in flight
    assert [n for n, _ in order] == ["small", "big"]
    assert order[0][1] == 2 and order[1][1] == 11


def test_requests_take_turns_within_a_batch_and_batches_keep_the_token_budget():
    model = FakeModel(max_seq_length=16, max_graphs=16)
    b = Batcher(model, max_batch=8, max_batch_tokens=32, batch_buckets=(1, 2, 4, 8),
                seq_buckets=(4, 8, 16), start=False)
    assert [b.row_cap(s) for s in (4, 8, 16)] == [8, 4, 2]
    short = [b.submit([f"s{i}" for i in range(12)]), b.submit(["x", "y"])]
    long = b.submit(["a b c d e f g h i j"] * 5)                 # 12 tokens: seq bucket 16
    b.start()
    for f in short + [long]:
        f.result(10)
    b.close()
    assert all(batch * seq <= 32 for _, batch, seq, _ in model.calls)
    # the first batch took both short requests' texts in turn: all of the 2-text request
    assert model.calls[0] == ("graph", 8, 4, 8)
    assert short[1].done() and [c[3] for c in model.calls if c[2] == 16] == [2, 2, 1]
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Batcher(FakeModel(), max_batch_tokens=8, seq_buckets=(16,), start=False)


def test_a_cancelled_request_drops_its_texts_not_yet_batched():
    gate = threading.Event()
    model = FakeModel(gate=gate)
    m = ServingMetrics()
    with Batcher(model, max_batch=4, batch_buckets=(1, 2, 4), seq_buckets=(4, 16),
                 metrics=m) as b:
        big = b.submit([f"w{i}" for i in range(40)])
        assert model.entered.wait(10)
        assert big.cancel()
        gate.set()
        np.testing.assert_array_equal(b.embed(["a"], timeout=10)[0], expected(model, "a"))
        assert b.queued == 0 and b.queued_requests == 0
    assert [c[3] for c in model.calls] == [4, 1]           # big's first batch, then "a" only
    assert m.value("cancelled_inputs_total") == 36


def test_drain_finishes_queued_work_then_fails_the_rest_and_refuses_new_work():
    gate = threading.Event()
    model = FakeModel(gate=gate)
    b = Batcher(model, max_batch=1, batch_buckets=(1,), seq_buckets=(4, 16))
    first = b.submit(["a"])
    assert model.entered.wait(10)
    later = b.submit(["b", "c"])
    b.drain(grace=0.0)                                       # no time for queued work
    with pytest.raises(BatcherClosed):
        b.submit(["d"])
    gate.set()
    np.testing.assert_array_equal(first.result(10).embeddings[0], expected(model, "a"))
    with pytest.raises(BatcherClosed):
        later.result(10)
    b.close()
    gate2 = threading.Event()
    model2 = FakeModel(gate=gate2)
    b2 = Batcher(model2, max_batch=1, batch_buckets=(1,), seq_buckets=(4, 16))
    f2 = b2.submit(["a", "b c"])
    assert model2.entered.wait(10)
    b2.drain(grace=30.0)                                     # enough time: all of it runs
    gate2.set()
    assert f2.result(10).embeddings.shape == (2, HIDDEN)
    b2.close()




@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_that_dies_outside_a_batch_fails_every_waiting_request():
    """A bug in the batcher's own loop (outside a forward, whose errors fail only their batch)
    killed the worker thread and left every queued request waiting for ever (noticed by ADV2);
    now they fail with BatcherClosed naming the error, and later submits are refused."""
    b = Batcher(FakeModel(), start=False)

    def broken(ring):
        raise RuntimeError("a bug in the loop")
    b._sweep = broken
    fut = b.submit(["a", "b"])
    b.start()
    with pytest.raises(BatcherClosed, match="a bug in the loop"):
        fut.result(10)
    with pytest.raises(BatcherClosed):
        b.submit(["c"])
    b.close()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_waiting_on_a_parents_pending_request_gets_batcher_closed():
    """Kind 3 of the guide (fork with pending work): a request the parent had pending (queued,
    or in the batch running) can only be answered by the parent's worker thread, which does not
    come along into a child; a wait on its future there never ended. The child's wait now
    raises BatcherClosed at once, a new submit to the parent's batcher is refused, a batcher
    made in the child serves, and the parent's own requests are answered (ADV6)."""
    import os
    import signal
    import time
    model = FakeModel(delay=0.3)
    b = Batcher(model, graph=False)
    try:
        running = b.submit(["in the batch"])
        time.sleep(0.05)                       # (the worker has taken it into a batch)
        queued = b.submit(["queued behind it"])
        pid = os.fork()
        if pid == 0:                           # the child: exit 0 only if every check holds
            code = 1
            try:
                signal.alarm(20)
                for fut in (running, queued):
                    try:
                        fut.result(5)
                    except BatcherClosed:
                        pass
                    else:
                        os._exit(2)
                try:
                    b.submit(["x"])
                except BatcherClosed as e:     # saying why, not "the worker stopped" (USER6)
                    if "forked" not in str(e) or "new batcher" not in str(e):
                        os._exit(5)
                else:
                    os._exit(3)
                with Batcher(model, graph=False) as mine:
                    got = mine.embed(["a"], timeout=10)
                code = 0 if np.allclose(got[0], expected(model, "a")) else 4
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        np.testing.assert_allclose(running.result(10).embeddings[0], expected(model, "in the batch"))
        np.testing.assert_allclose(queued.result(10).embeddings[0],
                                   expected(model, "queued behind it"))
    finally:
        b.close()


def test_batchers_dropped_without_close_leave_no_worker_and_free_their_model():
    """SOAK7: a batcher's worker thread held the batcher (its bound ``_loop``) for ever, so one
    dropped without ``close()`` (a service making one per tenant or model, a CorpusEmbedder
    left to the garbage collector) kept its thread and its model: 50 batchers, 50 threads.
    The worker now holds it only while it has work, and a collected batcher stops it."""
    import gc
    import time
    import weakref

    before = set(threading.enumerate())
    models = []
    for k in range(12):
        model = FakeModel()
        models.append(weakref.ref(model))
        b = Batcher(model, max_wait_ms=0)
        got = b.submit(TEXTS).result(10).embeddings
        np.testing.assert_array_equal(got, np.stack([expected(model, t) for t in TEXTS]))
        del got
        del b, model
    gc.collect()
    deadline = time.monotonic() + 20
    while [t for t in threading.enumerate() if t not in before] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [t.name for t in threading.enumerate() if t not in before] == []
    gc.collect()
    assert [r for r in models if r() is not None] == []


def test_a_lone_client_stops_waiting_for_company_and_a_burst_brings_the_wait_back():
    # after LONELY_WAITS idle arrivals whose max_wait found no other request, a request at an
    # idle batcher runs at once (one in LONELY_WAITS still waits, to see a burst coming back);
    # a wait that finds company brings the waits back (counted: timed gets on the queue)
    from runtime.serving import batcher as bm

    class Q:
        def __init__(self, q):
            self.q, self.timed, self.hook = q, 0, None

        def get(self, block=True, timeout=None):
            if timeout is not None:
                self.timed += 1
                hook, self.hook = self.hook, None
                if hook:
                    hook()                      # a second client's request during the wait
            return self.q.get(block, timeout) if timeout is None else self.q.get(True, timeout)

        def __getattr__(self, name):
            return getattr(self.q, name)

    model = FakeModel()
    b = Batcher(model, max_wait_ms=20, start=False)
    q = b._q = Q(b._q)
    b.start()
    waits, extra = [], []
    n = bm.LONELY_WAITS
    try:
        for i in range(3 * n + 1 + n):
            if i == 3 * n:                       # a probe wait: another request comes
                q.hook = lambda: extra.append(b.submit([TEXTS[1]]))
            before = q.timed
            e = b.embed([TEXTS[i % len(TEXTS)]], timeout=10)
            np.testing.assert_array_equal(e[0], expected(model, TEXTS[i % len(TEXTS)]))
            waits.append(q.timed - before > 0)
        np.testing.assert_array_equal(extra[0].result(10).embeddings[0],
                                      expected(model, TEXTS[1]))
    finally:
        b.close()
    lonely = [True] * n + ([True] + [False] * (n - 1)) * 2     # n waits, then 1 in n
    assert waits == lonely + [True] + [True] * n             # company found: waits again


def test_a_request_queued_as_the_worker_ends_is_failed_not_left_waiting():
    """A submit that passed the open check while the worker ran, and queued its request
    after the worker ended (stopped, or died), gets ``BatcherClosed``: before, its future was
    left with nothing that would ever answer it (``submit(...).result()`` without a timeout
    waited for ever; SOAK9's open item); later submits are refused."""
    import weakref

    from runtime.serving.batcher import _STOP, _worker
    b = Batcher(FakeModel(), start=False, max_wait_ms=0)
    ids, mask = b.tokens_of(["hello world"])        # checked while the worker runs
    b._q.put(_STOP)                                 # (a dropped batcher's stop: no close())
    _worker(weakref.ref(b), b._q)                   # the worker ends
    fut = b._enqueue(ids, mask)                     # the submit's queueing, after the end
    assert fut.done() and isinstance(fut.exception(), BatcherClosed)
    with pytest.raises(BatcherClosed):
        b.submit(["again"])
