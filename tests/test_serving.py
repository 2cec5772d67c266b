"""Embeddings serving: the batcher against a fake model, and the HTTP server end to end.

The fake-model tests need numpy only. The end-to-end tests start the real server on a free
loopback port (uvicorn on a thread) with MiniLM on the cpu backend and check every embedding
against ``tests/fixtures/minilm_reference.npz`` (``RUNTIME_FIXTURES`` overrides the folder)
to 1e-4; they skip with the reason when fastapi/uvicorn/httpx or the model files are missing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.serving.batcher import (BatchFailed, Batcher, BatcherClosed, QueueFull,
                                     choose_bucket)
from runtime.serving.metrics import ServingMetrics

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 8
POISON = 666                                    # token id of the word "boom" in the fake model


# -- a fake model ---------------------------------------------------------------------------
class FakeModel:
    """Records every call. Token ids: [CLS]=101, one id per word (its length + 1000, or POISON
    for "boom"), [SEP]=102, truncated to ``max_seq_length`` keeping [SEP]. A row's embedding
    spells its real tokens: ``out[r, :L] = ids[r, :L]`` (L <= HIDDEN - 1), ``out[r, -1] = L``.
    Padding rows come back as NaN, so any that leaked would show."""

    hidden = HIDDEN

    def __init__(self, max_seq_length: int = 16, max_graphs: int = 4, delay: float = 0.0):
        self.max_seq_length = max_seq_length
        self.max_graphs = max_graphs
        self.delay = delay
        self.calls = []                          # (path, batch, seq, rows)
        self._buckets: list = []
        self.lock = threading.Lock()

    @property
    def buckets(self):
        return list(self._buckets)

    def tokenize(self, texts):
        rows = []
        for t in texts:
            ids = [POISON if w == "boom" else 1000 + len(w) for w in t.split()]
            rows.append([101] + ids[:self.max_seq_length - 2] + [102])
        L = max(len(r) for r in rows)
        ids = np.zeros((len(rows), L), np.int64)
        mask = np.zeros((len(rows), L), np.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = r, 1
        return ids, mask

    def _compute(self, ids, mask):
        if (ids == POISON).any():
            raise RuntimeError("boom")
        out = np.full((ids.shape[0], HIDDEN), np.nan, np.float32)
        for r in range(ids.shape[0]):
            L = int(mask[r].sum())
            if L:
                out[r] = 0
                k = min(L, HIDDEN - 1)
                out[r, :k] = ids[r, :k]
                out[r, -1] = L
        time.sleep(self.delay)
        return out

    def run_bucket(self, batch, seq_len, ids, mask):
        b, s = ids.shape
        assert b <= batch and s <= seq_len
        with self.lock:
            if (batch, seq_len) in self._buckets:
                self._buckets.remove((batch, seq_len))
            elif len(self._buckets) >= self.max_graphs:
                self._buckets.pop(0)
            self._buckets.append((batch, seq_len))
            self.calls.append(("graph", batch, seq_len, b))
        pi = np.zeros((batch, seq_len), np.int64)
        pm = np.zeros((batch, seq_len), np.int64)
        pi[:b, :s], pm[:b, :s] = ids, mask
        return self._compute(pi, pm)             # all `batch` rows: the batcher must cut them

    def forward(self, ids, mask, graph=False):
        with self.lock:
            self.calls.append(("eager", ids.shape[0], ids.shape[1], int((mask.sum(1) > 0).sum())))
        return self._compute(np.asarray(ids), np.asarray(mask))


def expected(model, text):
    ids, mask = model.tokenize([text])
    L = int(mask.sum())
    e = np.zeros(HIDDEN, np.float32)
    e[:min(L, HIDDEN - 1)] = ids[0, :min(L, HIDDEN - 1)]
    e[-1] = L
    return e


TEXTS = ["", "a", "bb cc", "one two three four five", "x " * 30, "hello there world",
         "q w e r t y u i o p a s d"]


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


def test_warmup_runs_each_bucket_once_and_respects_the_graph_bound():
    model = FakeModel(max_graphs=2)
    m = ServingMetrics()
    b = Batcher(model, batch_buckets=(1, 4), seq_buckets=(8, 16), metrics=m)
    assert b.warmup([(1, 8), (4, 16)], progress=False) == [(1, 8), (4, 16)]
    assert model.buckets == [(1, 8), (4, 16)] and m.captures.value() == 2
    with pytest.raises(ValueError, match="max_graphs"):
        b.warmup([(1, 8), (4, 8), (1, 16)], progress=False)
    with pytest.raises(ValueError):
        b.warmup([(3, 8)], progress=False)
    b.close()


def test_metrics_render_in_the_prometheus_text_format():
    model = FakeModel()
    m = ServingMetrics(queue_depth=lambda: 0)
    with Batcher(model, metrics=m) as b:
        b.embed(["a", "b c"], timeout=10)
    text = m.render()
    assert text.endswith("\n")
    assert 'runtime_serving_batches_total{path="graph"} 1' in text
    assert 'runtime_serving_batch_size_bucket{path="graph",le="2"} 1' in text
    assert 'runtime_serving_queue_wait_seconds_bucket{le="+Inf"} 2' in text
    assert "runtime_serving_queue_wait_seconds_count 2" in text
    assert "# TYPE runtime_serving_replay_seconds histogram" in text
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2


# -- HTTP ------------------------------------------------------------------------------------
def _need_http():
    for mod in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(mod, reason=f"{mod} is not installed (pip install -e '.[serve]')")


async def _post_all(url, bodies):
    """POST every body concurrently; ``bodies`` items are dicts (sent as JSON) or raw bytes."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300.0,
                                 limits=httpx.Limits(max_connections=64)) as http:
        async def one(b):
            if isinstance(b, (bytes, str)):
                return await http.post("/v1/embeddings", content=b,
                                       headers={"content-type": "application/json"})
            return await http.post("/v1/embeddings", json=b)
        return await asyncio.gather(*(one(b) for b in bodies))


MALFORMED = [
    (b"{not json", 400), (b"", 400), (b"[1, 2]", 400), ({"model": "x"}, 400),
    ({"input": 5}, 400), ({"input": ["ok", 7]}, 400), ({"input": []}, 400),
    ({"input": [101, 2023]}, 400), ({"input": {"a": 1}}, 400), ({"input": None}, 400),
    ({"input": "hi", "model": "text-embedding-3-small"}, 404),
    ({"input": "hi", "encoding_format": "int8"}, 400), ({"input": "hi", "dimensions": 64}, 400),
    ({"input": ["x"] * 65}, 400),
]


def _check_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]


def test_a_failing_batch_answers_500_to_its_requests_and_the_server_keeps_serving():
    _need_http()
    import httpx

    from runtime.serving import ServerThread, create_app

    model = FakeModel(delay=0.01)
    b = Batcher(model, batch_buckets=(1, 2, 4), seq_buckets=(4, 8, 16), max_wait_ms=20)
    with ServerThread(create_app(b, max_inputs=64)) as srv:
        bodies = [{"input": "boom"}, {"input": ["a", "b c d e f g"]}, {"input": "a b c d e"}]
        bodies += [b for b, _ in MALFORMED]
        rs = asyncio.run(_post_all(srv.url, bodies))
        _check_error(rs[0], 500)
        assert "boom" in rs[0].json()["error"]["message"]
        for r in rs[1:3]:
            assert r.status_code in (200, 500)   # 200 unless batched with "boom"
        for r, (_, status) in zip(rs[3:], MALFORMED):
            _check_error(r, status)
        ok = httpx.post(srv.url + "/v1/embeddings", json={"input": ["a", "a b"]}, timeout=30)
        assert ok.status_code == 200
        emb = [d["embedding"] for d in ok.json()["data"]]
        np.testing.assert_array_equal(emb[1], expected(model, "a b"))
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'runtime_serving_requests_total{code="500"}' in metrics
        assert 'runtime_serving_failed_batches_total{path="graph"}' in metrics
        miss = httpx.get(srv.url + "/nope", timeout=10)
        _check_error(miss, 404)
    b.close()


@pytest.fixture(scope="module")
def minilm():
    _need_http()
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    pytest.importorskip("tokenizers", reason="tokenizers is not installed")
    from runtime.serving import limit_blas_threads, load_model
    try:
        model = load_model("cpu", max_graphs=6)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    prev = limit_blas_threads(1)             # as `serve`/`demo` do; restored below
    yield model
    if prev is not None:
        limit_blas_threads(prev, force=True)


def test_concurrent_clients_get_the_reference_embeddings_and_only_their_own(minilm, ref):
    import httpx

    from runtime.serving import MODEL_ID, ServerThread, create_app

    sents = [str(s) for s in ref["sentences"]]
    want = ref["embeddings"]
    gaps = np.abs(want[:, None, :] - want[None, :, :]).max(-1) + np.eye(len(want))
    assert gaps.min() > 1e-2            # so a row from another text could never pass at 1e-4
    # few buckets: batches of 1, 4 or 16 texts; 16, 32 or 256 tokens (the 256-token sentence)
    b = Batcher(minilm, batch_buckets=(1, 4, 16), seq_buckets=(16, 32, 256), max_wait_ms=5)
    plan = [[i] for i in range(12)]                                   # one text each
    plan += [list(range(12)), [11, 3, 3, 0, 2], [9, 1], [5, 4, 7, 6, 8, 10], [2, 2]]
    bodies = [{"input": sents[p[0]] if len(p) == 1 and k % 2 else [sents[i] for i in p],
               "model": MODEL_ID} for k, p in enumerate(plan)]
    bodies += [body for body, _ in MALFORMED]
    with ServerThread(create_app(b, max_inputs=64)) as srv:
        rs = asyncio.run(_post_all(srv.url, bodies))
        for k, p in enumerate(plan):
            r = rs[k]
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["model"] == MODEL_ID
            assert [d["index"] for d in body["data"]] == list(range(len(p)))
            got = np.array([d["embedding"] for d in body["data"]], np.float32)
            assert got.shape == (len(p), 384)
            err = np.abs(got - want[p]).max()
            assert err < 1e-4, f"request {k} {p}: max diff {err:.2e}"
            assert body["usage"]["prompt_tokens"] == int(ref["lengths"][p].sum())
            assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]
        for r, (_, status) in zip(rs[len(plan):], MALFORMED):
            _check_error(r, status)
        r = httpx.post(srv.url + "/v1/embeddings", timeout=120,
                       json={"input": [sents[3], sents[2]], "encoding_format": "base64"})
        got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
                        for d in r.json()["data"]])
        assert np.abs(got - want[[3, 2]]).max() < 1e-4
        health = httpx.get(srv.url + "/health", timeout=10).json()
        assert health["status"] == "ok" and health["backend"] == "cpu"
        assert 0 < len(health["graphs"]) <= minilm.max_graphs
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        assert f'runtime_serving_requests_total{{code="200"}} {len(plan) + 1}' in text
        assert "runtime_serving_replay_seconds_count" in text
    b.close()


def test_the_eager_path_serves_the_same_embeddings(minilm, ref):
    import httpx

    from runtime.serving import ServerThread, create_app

    sents = [str(s) for s in ref["sentences"]]
    b = Batcher(minilm, graph=False, batch_buckets=(1, 4, 16), seq_buckets=(16, 32, 256))
    with ServerThread(create_app(b)) as srv:
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": sents}, timeout=300)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]], np.float32)
    b.close()
    assert np.abs(got - ref["embeddings"]).max() < 1e-4
    assert json.loads(r.text)["usage"]["prompt_tokens"] == int(ref["lengths"].sum())


def test_serve_cli_parses_warmup_buckets():
    import argparse

    from runtime.serving.cli import build_parser, parse_buckets

    assert parse_buckets("1x16, 8X32") == [(1, 16), (8, 32)]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_buckets("8by32")
    args = build_parser().parse_args(["--port", "0", "--eager", "--warmup", "4x16"])
    assert args.port == 0 and args.eager and args.warmup == [(4, 16)]
    assert args.host == "127.0.0.1" and args.backend == "cpu"


@pytest.mark.slow
def test_the_demo_command_passes_its_checks(minilm):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "runtime", "demo", "--clients", "3",
                        "--requests", "5", "--quiet"], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "replayed graphs" in r.stdout and "eager launches" in r.stdout
    assert "all checks passed" in r.stdout
