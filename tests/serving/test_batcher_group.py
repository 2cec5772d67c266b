"""``runtime.serving.BatcherGroup``: several batchers, a model each, every request to the least
loaded (``serve --streams N``). Fake models with gates (no timing), and one run of the real model
on two cpu streams against one."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from runtime.serving.batcher import Batcher, BatcherClosed
from runtime.serving.group import BatcherGroup
from runtime.serving.metrics import ServingMetrics

from fakes import HIDDEN, FakeModel, expected, samples

WAIT = 30          # seconds a step may take at most (a hang fails; nothing is timed)


def _group(*models):
    return BatcherGroup([Batcher(m, batch_buckets=(1, 2, 4), seq_buckets=(16,)) for m in models])


def test_load_counts_the_texts_queued_and_running():
    gate = threading.Event()
    model = FakeModel(gate=gate)
    b = Batcher(model, batch_buckets=(1, 2, 4), seq_buckets=(16,))
    assert b.load == 0
    first = b.submit(["a", "b c", "d"])
    assert model.entered.wait(WAIT)                 # the batch of 3 is running (gated)
    second = b.submit(["e f", "g"])                 # queued behind it
    assert b.load == 5 and b.queued == 2
    gate.set()
    first.result(WAIT), second.result(WAIT)
    b.close()
    assert b.load == 0


def test_each_request_goes_whole_to_the_least_loaded_batcher():
    gate = threading.Event()
    busy, free = FakeModel(gate=gate), FakeModel()
    g = _group(busy, free)
    try:
        a = g.submit(["a", "b"])                    # both idle: the first
        assert busy.entered.wait(WAIT)              # ... which is now running it (gated)
        b = g.submit(["c d", "e", "f"])             # busy has 2 running: to free
        assert b.result(WAIT)
        c = g.submit(["g"])                         # busy 2, free 0: free again
        assert c.result(WAIT)
        assert g.load == 2 and g.queued == 0
        gate.set()
        for fut, texts, model in ((a, ["a", "b"], busy), (b, ["c d", "e", "f"], free),
                                  (c, ["g"], free)):
            rows = fut.result(WAIT).embeddings
            for row, t in zip(rows, texts):
                np.testing.assert_array_equal(row, expected(model, t))
        assert sum(c[3] for c in busy.calls) == 2 and sum(c[3] for c in free.calls) == 4
        assert g.batches_run == len(busy.calls) + len(free.calls)
    finally:
        gate.set()
        g.close()


def test_a_tie_goes_to_the_first_and_the_group_reports_its_batchers_together():
    models = [FakeModel(), FakeModel(), FakeModel()]
    g = _group(*models)
    m = ServingMetrics()
    g.metrics = m                                    # what create_app does: every batcher's
    try:
        for i in range(6):
            g.embed([f"w{i}"], timeout=WAIT)         # each finishes first: always a tie
        assert [len(x.calls) for x in models] == [6, 0, 0]     # one model stays hot
        assert all(b.metrics is m for b in g.batchers)
        assert g.model is models[0] and g.hidden == models[0].hidden and g.path == "graph"
        assert g.alive and g.queued_requests == 0
    finally:
        g.close()


def test_a_stopped_batcher_gets_no_requests_and_a_group_of_stopped_ones_refuses():
    a, b = FakeModel(), FakeModel()
    g = _group(a, b)
    g.batchers[0].close()                           # the first: it would win every tie
    for i in range(3):
        g.embed([f"x{i}"], timeout=WAIT)
    assert not a.calls and len(b.calls) == 3
    g.close()
    assert not g.alive
    with pytest.raises(BatcherClosed):
        g.submit(["y"])


def test_a_group_needs_a_model_per_batcher():
    m = FakeModel()
    with pytest.raises(ValueError):
        BatcherGroup([])
    one = Batcher(m, start=False)
    with pytest.raises(ValueError):
        BatcherGroup([one, Batcher(m, start=False)])
    one.close()


class _SizedModel(FakeModel):
    """A fake model that also reports its graphs' bytes (as MiniLM's ``graph_memory``)."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.nbytes = nbytes

    def graph_memory(self) -> int:
        return self.nbytes


def test_health_and_graph_gauges_count_every_streams_graphs():
    # serve --streams 2: /health "graphs" and the graphs/graph_bytes gauges used to report
    # only the first stream's model (the second's graphs were invisible)
    for mod in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(mod, reason=f"{mod} is not installed (pip install -e '.[serve]')")
    import httpx

    from runtime.serving import ServerThread, create_app

    a, b = _SizedModel(1000), _SizedModel(234)
    g = _group(a, b)
    g.batchers[0].embed(["x"], timeout=WAIT)             # stream 0 holds the (1, 16) graph
    g.batchers[1].embed(["x", "y"], timeout=WAIT)        # stream 1 holds the (2, 16) graph
    g.batchers[1].embed(["z"], timeout=WAIT)             # and (1, 16): held by both
    assert a.buckets == [(1, 16)] and b.buckets == [(2, 16), (1, 16)]
    try:
        with ServerThread(create_app(g)) as srv:
            health = httpx.get(srv.url + "/health", timeout=10).json()
            assert sorted(map(tuple, health["graphs"])) == [(1, 16), (2, 16)]
            assert health["streams"] == 2
            got = samples(httpx.get(srv.url + "/metrics", timeout=10).text)
            assert got[("runtime_serving_graphs", ())] == 3
            assert got[("runtime_serving_graph_bytes", ())] == 1234
    finally:
        g.close()


def test_two_streams_of_the_real_model_embed_as_one():
    from runtime.models import default_model_dir
    try:
        default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from runtime.serving.replica import start_batcher

    texts = ["a short one", "the quick brown fox jumps over the lazy dog", "x"]
    one = start_batcher("cpu", max_graphs=2, warmup=[(4, 16)])
    two = start_batcher("cpu", max_graphs=2, warmup=[(4, 16)], streams=2)
    try:
        assert isinstance(two, BatcherGroup) and len(two.batchers) == 2
        m0, m1 = (b.model for b in two.batchers)
        assert m0 is not m1 and m0.client.stream != m1.client.stream
        assert m0.buckets == m1.buckets == [(4, 16)]          # each captured its own
        # ... over one copy of the weights (MiniLM.replica; before, the second was loaded
        # and uploaded again: its own buffers)
        assert m1.word.handle.id == m0.word.handle.id and m1.blocks is m0.blocks
        assert two.route == "cpu"             # serve's routing on cpu; here both streams must
        two.route = "least"                   # get work whatever the host: the least loaded
        want = one.embed(texts, timeout=120)
        futs = [two.submit(texts) for _ in range(4)]          # both streams get work
        for f in futs:
            np.testing.assert_allclose(f.result(120).embeddings, want, atol=1e-5)
        assert all(b.batches_run for b in two.batchers)
    finally:
        one.close()
        two.close()
    with pytest.raises(ValueError):
        start_batcher("cpu", model=FakeModel(), streams=0)


def test_spill_routing_keeps_one_batcher_until_a_full_batch_waits_there():
    # route="spill" (serve --streams N on the cpu backend): every request goes to the first
    # batcher, even while it runs a batch, until it holds a full batch waiting; then to the
    # least loaded. Gated fake models: nothing is timed.
    gate = threading.Event()
    first, second = FakeModel(gate=gate), FakeModel()
    g = BatcherGroup([Batcher(m, batch_buckets=(1, 2, 4), seq_buckets=(16,), max_batch=4)
                      for m in (first, second)], route="spill")
    try:
        a = g.submit(["a"])
        assert first.entered.wait(WAIT)             # the first is running it (gated)
        queued = [g.submit([f"q{i}"]) for i in range(3)]   # to the first, though it is busy
        assert g.batchers[0].queued == 3 and g.batchers[1].load == 0
        more = g.submit(["m n"])                    # 3 waiting < 4: still the first
        assert g.batchers[0].queued == 4 and g.batchers[1].load == 0
        spill = g.submit(["s"])                     # a full batch waits there: spill over
        np.testing.assert_array_equal(spill.result(WAIT).embeddings[0], expected(second, "s"))
        assert sum(c[3] for c in second.calls) == 1 and g.batchers[0].queued == 4
        gate.set()
        for fut, t in zip([a] + queued + [more], ["a", "q0", "q1", "q2", "m n"]):
            np.testing.assert_array_equal(fut.result(WAIT).embeddings[0], expected(first, t))
        assert sum(c[3] for c in first.calls) == 5
        with pytest.raises(ValueError):
            BatcherGroup([Batcher(FakeModel())], route="nearest")
    finally:
        gate.set()
        g.close()


def test_cpu_routing_keeps_the_first_on_a_free_host_and_spreads_on_a_busy_one(monkeypatch):
    # route="cpu" (serve's default on cpu): only the first batcher while the host is free, even
    # with full batches waiting there (what one stream serves: no spill-over), the least loaded
    # while it is busy (a fake switch; nothing is timed); the default switch reads the thread
    # rule's whole calls
    gate = threading.Event()
    first, second = FakeModel(gate=gate), FakeModel()
    free = [True]
    g = BatcherGroup([Batcher(m, batch_buckets=(1, 2, 4), seq_buckets=(16,), max_batch=4)
                      for m in (first, second)], route="cpu", free_host=lambda: free[0])
    try:
        a = g.submit(["a"])
        assert first.entered.wait(WAIT)
        b = [g.submit([f"b{i}"]) for i in range(6)]     # free host: the first, though busy
        assert g.batchers[0].queued == 6 and g.batchers[1].load == 0     # (> max_batch)
        free[0] = False                             # busy host: the least loaded
        c = g.submit(["c d"])
        np.testing.assert_array_equal(c.result(WAIT).embeddings[0], expected(second, "c d"))
        gate.set()
        for fut, t in [(a, "a")] + [(f, f"b{i}") for i, f in enumerate(b)]:
            np.testing.assert_array_equal(fut.result(WAIT).embeddings[0], expected(first, t))
        assert sum(r[3] for r in first.calls) == 7 and sum(r[3] for r in second.calls) == 1
    finally:
        gate.set()
        g.close()
    from runtime import cpu_threads
    from runtime.serving.group import cpu_host_free
    monkeypatch.setattr(cpu_threads.RULE, "adapt_blas", True)
    monkeypatch.setattr(cpu_threads.RULE.whole, "on", True)
    assert cpu_host_free()
    monkeypatch.setattr(cpu_threads.RULE.whole, "on", False)     # whole calls stopped: busy
    assert not cpu_host_free()
    monkeypatch.setattr(cpu_threads.RULE.whole, "on", True)
    monkeypatch.setattr(cpu_threads.RULE, "adapt_blas", False)   # the user fixed BLAS
    assert not cpu_host_free()


def test_serve_routes_by_the_host_on_cpu_and_to_the_least_loaded_elsewhere():
    from runtime.serving.replica import start_batcher
    for backend, route in (("cpu", "cpu"), ("wgpu", "least")):
        class Fake(FakeModel):
            client = types.SimpleNamespace(backend=backend)

            def replica(self):
                return Fake()
        g = start_batcher(model=Fake(), streams=2, batch_buckets=(1, 2), seq_buckets=(16,))
        try:
            assert g.route == route and len(g.batchers) == 2
            np.testing.assert_array_equal(g.embed(["x y"], timeout=WAIT)[0],
                                          expected(g.batchers[0].model, "x y"))
        finally:
            g.close()


def test_serve_defaults_to_two_streams_on_cpu_with_two_cores_and_one_elsewhere(monkeypatch):
    """Issue 30: serve's default (``--streams`` not given, ``Settings.streams = None``) is two
    streams routed by the host on cpu with at least 2 cores and a model that copies its weights
    (``replica``), else one (fake models and a fake rule's cores; nothing is timed)."""
    from runtime import cpu_threads
    from runtime.serving.cli import build_parser, settings_from_args
    from runtime.serving.replica import Settings, default_streams, start_batcher

    class Fake(FakeModel):
        client = types.SimpleNamespace(backend="cpu")

        def replica(self):
            return Fake()
    assert Settings().streams is None
    assert settings_from_args(build_parser().parse_args([])).streams is None
    assert settings_from_args(build_parser().parse_args(["--streams", "1"])).streams == 1
    monkeypatch.setattr(cpu_threads.RULE, "cores", 2)
    assert default_streams("cpu", Fake()) == 2 and default_streams(None, None) == 2
    assert default_streams("cpu", FakeModel()) == 1          # no replica(): no copy
    assert default_streams("wgpu", Fake()) == 1 and default_streams("cuda", None) == 1
    g = start_batcher(model=Fake(), streams=None, batch_buckets=(1, 2), seq_buckets=(16,))
    try:
        assert isinstance(g, BatcherGroup) and g.route == "cpu" and len(g.batchers) == 2
        np.testing.assert_array_equal(g.embed(["x y"], timeout=WAIT)[0],
                                      expected(g.batchers[0].model, "x y"))
    finally:
        g.close()
    monkeypatch.setattr(cpu_threads.RULE, "cores", 1)          # one core: one stream
    assert default_streams("cpu", Fake()) == 1
    one = start_batcher(model=Fake(), streams=None, batch_buckets=(1, 2), seq_buckets=(16,))
    try:
        assert isinstance(one, Batcher)
    finally:
        one.close()


def test_a_busy_host_routes_each_sequence_bucket_to_its_own_batcher():
    # route="cpu" while the host is busy (and route="bucket" always): the batchers take the
    # sequence buckets in turn (here 4 -> the first, 8 -> the second), so each one's queue
    # holds fewer buckets and its batches are fuller (a batch holds one bucket's texts);
    # an idle batcher still starts a request at once, and one more than BUCKET_SLACK *
    # max_batch texts ahead of the least loaded gives way to it. The least loaded alone
    # would have split the five 1-word texts 3 / 2 and run them in two batches of 3 and 1.
    from runtime.serving import group as group_mod
    gates = [threading.Event(), threading.Event()]
    first, second = FakeModel(gate=gates[0]), FakeModel(gate=gates[1])
    g = BatcherGroup([Batcher(m, batch_buckets=(1, 2, 4), seq_buckets=(4, 8, 16), max_batch=4)
                      for m in (first, second)], route="cpu", free_host=lambda: False)
    try:
        futs = {"x": g.submit(["x"])}                # 3 tokens: bucket 4, its own (the first)
        assert first.entered.wait(WAIT)
        futs["y"] = g.submit(["y"])                  # the second is idle: it starts at once
        assert second.entered.wait(WAIT)
        for t in ("z", "e f g h", "w", "v", "u", "t"):   # 3 and 6 tokens: buckets 4 and 8
            futs[t] = g.submit([t])
        assert [b.queued for b in g.batchers] == [4, 2]  # z w v u | e f g h, t (5 vs 2 > 2)
        gates[0].set(), gates[1].set()
        for t, f in futs.items():
            model = second if t in ("y", "e f g h", "t") else first
            np.testing.assert_array_equal(f.result(WAIT).embeddings[0], expected(model, t))
        assert [c[1:] for c in first.calls] == [(1, 4, 1), (4, 4, 4)]     # z w v u: one batch
        assert sorted(c[1:] for c in second.calls) == [(1, 4, 1), (1, 4, 1), (1, 8, 1)]
        assert group_mod.BUCKET_SLACK == 0.5        # (the slack the counts above assume)
    finally:
        gates[0].set(), gates[1].set()
        g.close()
    # under BUCKET_MIN_LOAD * max_batch texts in the group (16 of 32): the least loaded
    gates = [threading.Event(), threading.Event()]
    first, second = FakeModel(gate=gates[0]), FakeModel(gate=gates[1])
    g = BatcherGroup([Batcher(m, batch_buckets=(1, 2, 4, 8, 16, 32), seq_buckets=(4, 8, 16),
                              max_batch=32) for m in (first, second)],
                     route="cpu", free_host=lambda: False)
    try:
        futs = [g.submit(["x"])]
        assert first.entered.wait(WAIT)
        futs.append(g.submit(["y"]))
        assert second.entered.wait(WAIT)
        futs += [g.submit([t]) for t in ("z", "w", "v")]     # bucket 4, all: 2 / 1 after each
        assert [b.queued for b in g.batchers] == [2, 1]
        gates[0].set(), gates[1].set()
        for f, t in zip(futs, "xyzwv"):
            assert f.result(WAIT).embeddings[0][-1] == 3        # 3 tokens each
    finally:
        gates[0].set(), gates[1].set()
        g.close()
    with BatcherGroup([Batcher(FakeModel(), seq_buckets=(4, 8, 16)) for _ in range(2)],
                      route="bucket") as g:
        rows = g.embed(["a b c d e f g", "a"], timeout=WAIT)   # whole, by its longest: 16
        np.testing.assert_array_equal(rows[1], expected(g.batchers[0].model, "a"))
        assert sorted(c[2] for c in g.batchers[0].model.calls) == [4, 16]
        assert not g.batchers[1].model.calls
        assert g.embed([], timeout=WAIT).shape == (0, HIDDEN)


def test_tokens_of_and_submit_tokens_queue_what_submit_does():
    model = FakeModel()
    with Batcher(model, seq_buckets=(4, 8, 16)) as b:
        ids, mask = b.tokens_of(["a b c d", "x"])
        assert ids.shape == (2, 6) and mask.sum() == 9
        assert b.seq_bucket(mask) == 8 and b.seq_bucket(mask[1:]) == 4
        assert b.seq_bucket(np.zeros((0, 0))) == 0
        rows = b.submit_tokens(ids, mask).result(WAIT).embeddings
        np.testing.assert_array_equal(rows, b.embed(["a b c d", "x"], timeout=WAIT))
        np.testing.assert_array_equal(rows[0], expected(model, "a b c d"))
        with pytest.raises(TypeError):
            b.tokens_of([1])
        with pytest.raises(ValueError):
            b.tokens_of(["\ud800"])
    with pytest.raises(BatcherClosed):
        b.submit_tokens(ids, mask)
