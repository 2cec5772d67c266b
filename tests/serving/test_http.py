"""Embeddings serving over HTTP (``runtime.serving.app``, ``http``, ``cli``, ``demo``):
malformed input, limits, timeouts, shutdown, then the real server end to end.

The end-to-end tests start the real server on a free loopback port (uvicorn on a thread)
with MiniLM on the cpu backend and check every embedding against
``tests/fixtures/minilm_reference.npz`` (``RUNTIME_FIXTURES`` overrides the folder) to 1e-4;
they skip with the reason when fastapi/uvicorn/httpx or the model files are missing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import socket
import threading
import time

import numpy as np
import pytest

from runtime.serving.batcher import Batcher
from runtime.serving.metrics import ServingMetrics

from fakes import FakeModel, REPO, expected, samples


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
    ({"input": [[101, "x"]]}, 400), ({"input": [-1]}, 400), ({"input": [[30522]]}, 400),
    ({"input": ["a", [1]]}, 400), ({"input": [True]}, 400), (b"[" * 100_000, 400),
    (b'{"input": "a", "dimensions": ' + b"9" * 5000 + b"}", 400), (b"\xff\xfe", 400),
    (b'{"input": ["ok", "\\ud800"]}', 400), (b'{"input": NaN}', 400),
    ({"input": {"a": 1}}, 400), ({"input": None}, 400), ({"input": "a" * 2001}, 400),
    ({"input": "hi", "model": "text-embedding-3-small"}, 404),
    ({"input": "hi", "encoding_format": "int8"}, 400), ({"input": "hi", "dimensions": 64}, 400),
    ({"input": ["x"] * 65}, 400),
]


def _check_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]


def _json_values():
    from hypothesis import strategies as st

    leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
            | st.text(max_size=20))
    return st.recursive(leaf, lambda kids: st.lists(kids, max_size=4)
                        | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)


def test_any_malformed_body_gets_a_4xx_error_never_an_exception():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from runtime.serving.app import MODEL_ID
    from runtime.serving.parse import ApiError, parse_request

    keys = st.sampled_from(["input", "model", "encoding_format", "dimensions", "user", "x"])

    @settings(max_examples=50, deadline=None, database=None)
    @given(st.dictionaries(keys, _json_values(), max_size=5) | _json_values(), st.binary(max_size=40))
    def check(value, junk):
        for body in (json.dumps(value).encode(), junk, json.dumps(value).encode()[:-1]):
            try:
                p = parse_request(body, model_id=MODEL_ID, max_inputs=8,
                                  token_ids=("refuse", "wordpiece")[len(junk) % 2],
                                  vocab_size=30522, window=256)
            except ApiError as e:
                assert 400 <= e.status < 500 and e.message
            else:                                  # valid: what the batcher will be given
                assert p.inputs and len(p.inputs) <= 8
                assert all(isinstance(t, str) for t in p.inputs) or p.token_ids
    check()


@pytest.mark.parametrize("inp, says", [
    ([None], "'input[0]' is null; each input must be a string"),
    ([1.5], "'input[0]' is a number; each input must be a string"),
    ([{"a": 1}], "'input[0]' is an object; each input must be a string"),
    ([["a", "b"]], "'input[0]' is an array of strings; send the strings themselves"),
    (["a", None], "'input[1]' is null but 'input[0]' is a string; send strings"),
    ({"a": 1}, "'input' is an object; it must be a string"),
])
@pytest.mark.parametrize("token_ids", ["refuse", "wordpiece"])
def test_a_body_whose_inputs_are_not_strings_is_told_what_each_is_in_json_terms(inp, says,
                                                                               token_ids):
    """USER7: ``{"input": [null]}`` was answered "'input[0]' is NoneType but 'input[0]' is
    NoneType; ... not a mix" and ``[["a"]]`` the token-ids refusal."""
    from runtime.serving.app import MODEL_ID
    from runtime.serving.parse import ApiError, parse_request

    with pytest.raises(ApiError) as e:
        parse_request(json.dumps({"input": inp, "model": MODEL_ID}).encode(), model_id=MODEL_ID,
                      token_ids=token_ids, vocab_size=30522, window=256)
    assert e.value.status == 400 and says in e.value.message, e.value.message


def test_a_failing_batch_answers_500_to_its_requests_and_the_server_keeps_serving():
    _need_http()
    import httpx

    from runtime.serving import ServerThread, create_app

    model = FakeModel(delay=0.01)
    b = Batcher(model, batch_buckets=(1, 2, 4), seq_buckets=(4, 8, 16), max_wait_ms=20,
                max_input_chars=2000)
    with ServerThread(create_app(b, max_inputs=64, token_ids="wordpiece")) as srv:
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
        got = samples(httpx.get(srv.url + "/metrics", timeout=10).text)
        assert got[("runtime_serving_requests_total", (("code", "500"),))] >= 1
        assert got[("runtime_serving_failed_batches_total", (("path", "graph"),))] >= 1
        assert got[("runtime_serving_requests_total", (("code", "400"),))] == \
            sum(status == 400 for _, status in MALFORMED)
        miss = httpx.get(srv.url + "/nope", timeout=10)
        _check_error(miss, 404)
    b.close()


def _raw(url: str, data: bytes, timeout: float = 10.0) -> socket.socket:
    """A loopback socket to the server at ``url`` that has sent ``data`` (maybe a partial
    request)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (bounded by the socket's timeout)."""
    out = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return out
        out += chunk


def _wait_for(cond, timeout: float = 10.0) -> None:
    """Poll ``cond()`` until true (an event the test waits for, never an assertion by itself)."""
    t_end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t_end, "timed out waiting for the server"
        time.sleep(0.01)


def _post_head(n_bytes: int) -> bytes:
    return (b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % n_bytes)


def test_a_client_that_disconnects_cancels_its_unbatched_texts_counted_as_499():
    _need_http()
    import httpx

    from runtime.serving import ServerThread, create_app

    gate = threading.Event()
    model = FakeModel(gate=gate)
    m = ServingMetrics()
    b = Batcher(model, max_batch=4, batch_buckets=(1, 2, 4), seq_buckets=(4, 16), metrics=m)
    with ServerThread(create_app(b)) as srv:
        body = json.dumps({"input": [f"w{i}" for i in range(40)]}).encode()
        sock = _raw(srv.url, _post_head(len(body)) + body)
        assert model.entered.wait(10)                     # its first batch is running
        sock.close()
        _wait_for(lambda: m.value("requests_total", code="499") == 1)
        gate.set()
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": "a"}, timeout=10)
        assert r.status_code == 200
    b.close()
    assert [c[3] for c in model.calls] == [4, 1]          # 36 texts were never computed
    assert m.value("cancelled_inputs_total") == 36


def test_body_and_input_limits_answer_413_and_400():
    _need_http()
    import httpx

    from runtime.serving import ServerThread, create_app

    model = FakeModel()
    b = Batcher(model, max_input_chars=50)
    app = create_app(b, max_inputs=4, max_body_bytes=2000)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=10) as http:
        r = http.post("/v1/embeddings", json={"input": ["x" * 40] * 4})
        assert r.status_code == 200 and len(r.json()["data"]) == 4
        _check_error(http.post("/v1/embeddings", json={"input": ["x" * 40] * 5}), 400)
        r = http.post("/v1/embeddings", json={"input": ["ok", "x" * 51]})
        _check_error(r, 400)
        assert r.json()["error"]["param"] == "input" and "input[1]" in r.json()["error"]["message"]
        _check_error(http.post("/v1/embeddings", content=b'{"input": "' + b"x" * 3000 + b'"}'),
                     413)

        def chunks():                                      # no content-length: chunked
            for _ in range(10):
                yield b" " * 300
        _check_error(http.post("/v1/embeddings", content=chunks()), 413)
        assert http.post("/v1/embeddings", json={"input": "a"}).status_code == 200
    b.close()


def test_a_full_queue_answers_503_with_retry_after_from_the_drain_estimate():
    _need_http()
    import httpx

    from runtime.serving import ServerThread, create_app

    gate = threading.Event()
    model = FakeModel(delay=0.3)
    b = Batcher(model, max_batch=1, max_queue=4, batch_buckets=(1,), seq_buckets=(4, 16))
    b.embed(["warm"], timeout=10)                          # ~0.3 s per text measured
    model.gate, model.entered = gate, threading.Event()

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            first = asyncio.ensure_future(http.post("/v1/embeddings", json={"input": "a"}))
            while not model.entered.is_set():
                await asyncio.sleep(0.01)
            queued = asyncio.ensure_future(http.post("/v1/embeddings",
                                                     json={"input": ["b", "c", "d", "e"]}))
            while b.queued < 4:
                await asyncio.sleep(0.01)
            full = await http.post("/v1/embeddings", json={"input": "f"})
            estimate = b.drain_estimate()
            gate.set()
            return full, estimate, await first, await queued

    with ServerThread(create_app(b)) as srv:
        full, estimate, first, queued = asyncio.run(scenario(srv.url))
    b.close()
    _check_error(full, 503)
    assert 4 * 0.25 < estimate < 4 * 5                      # 4 texts at the measured pace
    assert int(full.headers["retry-after"]) == math.ceil(estimate)
    assert first.status_code == 200 and queued.status_code == 200


def test_slow_headers_and_slow_bodies_get_408_and_are_closed():
    _need_http()
    from runtime.serving import ServerThread, create_app

    b = Batcher(FakeModel())
    with ServerThread(create_app(b, body_timeout=0.5), header_timeout=0.5) as srv:
        socks = [_raw(srv.url, b""),                                          # says nothing
                 _raw(srv.url, b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\n"),  # half headers
                 _raw(srv.url, _post_head(100) + b'{"input": ')]              # half a body
        answers = [_read_all(s) for s in socks]                # each ends: the server closed
        for s in socks:
            s.close()
        for a in answers:
            assert a.startswith(b"HTTP/1.1 408"), a[:80]
            assert json.loads(a.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    b.close()


def test_models_routes_have_the_openai_shape():
    _need_http()
    import httpx

    from runtime.serving import MODEL_ID, ServerThread, create_app

    b = Batcher(FakeModel())
    with ServerThread(create_app(b)) as srv, httpx.Client(base_url=srv.url, timeout=10) as http:
        listed = http.get("/v1/models").json()
        one = http.get(f"/v1/models/{MODEL_ID}").json()
        short = http.get("/v1/models/all-MiniLM-L6-v2").json()
        _check_error(http.get("/v1/models/text-embedding-3-small"), 404)
    b.close()
    assert listed["object"] == "list" and listed["data"] == [one] and short == one
    assert set(one) == {"id", "object", "created", "owned_by", "token_ids"}
    assert one["token_ids"] == "refuse"                     # token arrays: refused by default
    assert one["id"] == MODEL_ID and one["object"] == "model"
    assert isinstance(one["created"], int) and abs(one["created"] - time.time()) < 3600


def test_an_api_key_is_required_except_for_health_and_the_openai_sdk_sends_it():
    _need_http()
    openai = pytest.importorskip("openai", reason="the openai SDK is not installed")
    import httpx

    from runtime.serving import MODEL_ID, ServerThread, create_app

    model = FakeModel()
    b = Batcher(model)
    key = "sk-test-key-0123"
    with ServerThread(create_app(b, api_key=key)) as srv:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": key}):
            for method, path in (("POST", "/v1/embeddings"), ("GET", "/v1/models"),
                                 ("GET", "/metrics"), ("GET", "/nope"), ("GET", "/docs"),
                                 ("GET", "/redoc"), ("GET", "/openapi.json")):
                r = httpx.request(method, srv.url + path, json={"input": "a"}, timeout=10,
                                  headers={k: v.encode() for k, v in headers.items()})
                _check_error(r, 401)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json"):  # off with a key (before: open)
            r = httpx.get(srv.url + path, timeout=10, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 404, (path, r.status_code)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
        res = client.embeddings.create(model=MODEL_ID, input=["a", "b c"])
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope",
                          max_retries=0).embeddings.create(model=MODEL_ID, input="a")
    b.close()
    np.testing.assert_array_equal(res.data[1].embedding, expected(model, "b c"))


def test_serve_warns_when_exposed_without_a_key():
    from runtime.serving.cli import build_parser, exposure_warning

    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("::1", None) is None and exposure_warning("localhost", None) is None
    assert "without an API key" in exposure_warning("0.0.0.0", None)
    assert "without an API key" in exposure_warning("example.org", "")
    assert exposure_warning("0.0.0.0", "k") is None
    args = build_parser().parse_args(["--max-body-bytes", "100", "--grace", "2",
                                      "--max-batch-tokens", "512", "--api-key", "k"])
    assert (args.max_body_bytes, args.grace, args.max_batch_tokens, args.api_key) == \
        (100, 2.0, 512, "k")
    assert build_parser().parse_args([]).grace == 10.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-body-bytes", "0"])
    assert build_parser().parse_args(["--batch-buckets", "1,2,3,4"]).batch_buckets == (1, 2, 3, 4)
    assert build_parser().parse_args([]).batch_buckets is None       # the batcher's default
    for bad in ("4,2", "0,1", "1,x", "", "1,,2", "2,2"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--batch-buckets", bad])


SIGTERM_SERVER = """
import sys
sys.path.insert(0, {tests!r})
from fakes import FakeModel
from runtime.serving import Batcher, create_app, serve
b = Batcher(FakeModel(delay=0.2), max_batch=1, batch_buckets=(1,), seq_buckets=(4, 16))
serve(create_app(b), host="127.0.0.1", port=0, grace={grace}, log_level="warning")
"""


def test_sigterm_with_queued_work_and_a_half_sent_body_exits_within_the_grace_period():
    _need_http()
    import os
    import signal
    import subprocess
    import sys

    grace = 2.0
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SERVER.format(
        tests=str(REPO / "tests"), grace=grace)], stderr=subprocess.PIPE, env=env, text=True)
    try:
        line = ""
        t_end = time.monotonic() + 60
        while " at http://" not in line:
            line = proc.stderr.readline()
            assert line and time.monotonic() < t_end, "the server did not start"
        url = line.rsplit(" at ", 1)[1].strip()
        body = json.dumps({"input": [f"w{i}" for i in range(60)]}).encode()   # ~12 s of work
        queued = _raw(url, _post_head(len(body)) + body, timeout=grace + 10)
        half = _raw(url, _post_head(1000) + b'{"input": ["', timeout=grace + 10)
        _wait_for(lambda: b"queued\": 0" not in _health(url))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace + 2)
        took = time.monotonic() - t0
        answer = _read_all(queued)
        half_answer = _read_all(half)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert took <= grace + 2
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]          # rest of the queue: 503
    assert b"server_unavailable" in answer
    assert half_answer == b"" or half_answer.startswith(b"HTTP/1.1 408")


def _health(url: str) -> bytes:
    import httpx

    return httpx.get(url + "/health", timeout=10).content


@pytest.fixture(scope="module")
def minilm():
    _need_http()
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    pytest.importorskip("tokenizers", reason="tokenizers is not installed")
    from runtime.serving import load_model
    try:
        model = load_model("cpu", max_graphs=6)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return model


def test_concurrent_clients_get_the_reference_embeddings_and_only_their_own(minilm, ref):
    import httpx

    from runtime.serving import MODEL_ID, ServerThread, create_app

    sents = [str(s) for s in ref["sentences"]]
    want = ref["embeddings"]
    gaps = np.abs(want[:, None, :] - want[None, :, :]).max(-1) + np.eye(len(want))
    assert gaps.min() > 1e-2            # so a row from another text could never pass at 1e-4
    # few buckets: batches of 1, 4 or 16 texts; 16, 32 or 256 tokens (the 256-token sentence)
    b = Batcher(minilm, batch_buckets=(1, 4, 16), seq_buckets=(16, 32, 256), max_wait_ms=5,
                max_input_chars=2000)
    plan = [[i] for i in range(12)]                                   # one text each
    plan += [list(range(12)), [11, 3, 3, 0, 2], [9, 1], [5, 4, 7, 6, 8, 10], [2, 2]]
    bodies = [{"input": sents[p[0]] if len(p) == 1 and k % 2 else [sents[i] for i in p],
               "model": MODEL_ID} for k, p in enumerate(plan)]
    bodies += [body for body, _ in MALFORMED]
    with ServerThread(create_app(b, max_inputs=64, token_ids="wordpiece")) as srv:
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
        got = samples(httpx.get(srv.url + "/metrics", timeout=10).text)
        assert got[("runtime_serving_requests_total", (("code", "200"),))] == len(plan) + 1
        assert got[("runtime_serving_replay_seconds_count", ())] > 0
        assert got[("runtime_serving_graphs", ())] == len(minilm.buckets)
        assert got[("runtime_serving_queue_depth", ())] == 0
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


def test_token_id_inputs_embed_as_their_texts_and_foreign_ids_are_refused(minilm, ref):
    import httpx

    from runtime.serving import ServerThread, create_app

    tok = minilm.tokenizer
    sents = [str(s) for s in ref["sentences"]]
    ids = [tok.encode(t).ids for t in sents[:4]]                              # [CLS] ... [SEP]
    ids += [tok.encode(t, add_special_tokens=False).ids for t in sents[4:8]]  # bare
    b = Batcher(minilm, batch_buckets=(1, 4, 16), seq_buckets=(16, 32, 256))
    with ServerThread(create_app(b, token_ids="wordpiece")) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as http:
        many = http.post("/v1/embeddings", json={"input": ids})
        one = http.post("/v1/embeddings", json={"input": ids[5]})             # one list of ints
        foreign = http.post("/v1/embeddings", json={"input": [[101, minilm.vocab_size, 102]]})
        late = http.post("/v1/embeddings", json={"input": [ids[0] + [2] * 300 + [-5]]})
        surrogate = http.post("/v1/embeddings", content=b'{"input": ["ok", "\\udc80"]}')
        mode = http.get("/v1/models").json()["data"][0]["token_ids"]
    b.close()
    assert mode == "wordpiece"
    assert many.status_code == 200 and one.status_code == 200, many.text + one.text
    got = np.array([d["embedding"] for d in many.json()["data"]], np.float32)
    assert np.abs(got - ref["embeddings"][:8]).max() < 1e-4
    assert many.json()["usage"]["prompt_tokens"] == int(ref["lengths"][:8].sum())
    assert np.abs(np.array(one.json()["data"][0]["embedding"]) - ref["embeddings"][5]).max() < 1e-4
    for r in (foreign, late):                  # an id beyond the model's window is checked too
        _check_error(r, 400)
        assert "tokenizer" in r.json()["error"]["message"]
    for r in (foreign, surrogate):
        assert r.json()["error"]["param"] == "input"
    _check_error(surrogate, 400)
    assert "input[1]" in surrogate.json()["error"]["message"]
    with pytest.raises(ValueError, match=r"input\[2\]"):           # the batcher's own check
        Batcher(minilm, start=False).submit(["a", "b", "\ud800"])


def test_token_arrays_are_refused_by_default_and_the_openai_sdk_sends_text(minilm, ref):
    # langchain-openai's default sends tiktoken (cl100k_base) ids: read as WordPiece ids they
    # gave 200 with the vectors of unrelated tokens; by default they are refused
    openai = pytest.importorskip("openai", reason="the openai SDK is not installed")
    import httpx

    from runtime.serving import MODEL_ID, ServerThread, create_app

    sents = [str(s) for s in ref["sentences"]]
    b = Batcher(minilm, batch_buckets=(1, 4, 16), seq_buckets=(16, 32, 256))
    with ServerThread(create_app(b)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        refused = [http.post("/v1/embeddings", json={"input": body}) for body in
                   ([9906, 1917], [[9906, 1917], [15339]], [[]])]
        mode = http.get("/health").json()["token_ids"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="check_embedding_ctx_length=False"):
            client.embeddings.create(model=MODEL_ID, input=[[9906, 1917]])
        res = client.embeddings.create(model=MODEL_ID, input=sents[:3])
    b.close()
    assert mode == "refuse"
    for r in refused:
        _check_error(r, 400)
        msg = r.json()["error"]["message"]
        assert "embeds text" in msg and "WordPiece" in msg and "--token-ids" in msg
        assert r.json()["error"]["param"] == "input"
    got = np.array([d.embedding for d in res.data], np.float32)
    assert np.abs(got - ref["embeddings"][:3]).max() < 1e-4


class FakeEncoding:
    """Stands in for tiktoken's cl100k_base: id ``k`` of ``pieces`` decodes to ``pieces[k]``
    (words with their leading space, one split inside a word, as BPE pieces are)."""

    def __init__(self, texts):
        self.pieces = sorted({p for t in texts for p in self.split(t)})
        self.index = {p: k for k, p in enumerate(self.pieces)}
        self.n_vocab = len(self.pieces)

    @staticmethod
    def split(text: str) -> list:
        out = []
        for k, w in enumerate(text.split(" ")):
            w = (" " if k else "") + w
            out += [w[:3], w[3:]] if len(w) > 5 else [w]
        return [p for p in out if p]

    def encode(self, text: str) -> list:
        return [self.index[p] for p in self.split(text)]

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_openai_token_ids_decode_to_the_texts_embeddings(minilm, ref, monkeypatch, tmp_path):
    import httpx

    from runtime.serving import ServerThread, create_app
    from runtime.serving.token_ids import load_openai_encoding

    sents = [str(s) for s in ref["sentences"]]
    enc = FakeEncoding(sents)
    assert all(enc.decode(enc.encode(t)) == t for t in sents)
    b = Batcher(minilm, batch_buckets=(1, 4, 16), seq_buckets=(16, 32, 256))
    app = create_app(b, token_ids="openai", openai_encoding=enc)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        many = http.post("/v1/embeddings", json={"input": [enc.encode(t) for t in sents[:6]]})
        one = http.post("/v1/embeddings", json={"input": enc.encode(sents[7])})
        foreign = http.post("/v1/embeddings", json={"input": [[0, enc.n_vocab]]})
        mode = http.get("/v1/models").json()["data"][0]["token_ids"]
    b.close()
    assert mode == "openai"
    assert many.status_code == 200 and one.status_code == 200, many.text + one.text
    got = np.array([d["embedding"] for d in many.json()["data"]], np.float32)
    assert np.abs(got - ref["embeddings"][:6]).max() < 1e-4
    assert np.abs(np.array(one.json()["data"][0]["embedding"]) - ref["embeddings"][7]).max() < 1e-4
    _check_error(foreign, 400)
    # without cl100k_base in tiktoken's cache the mode refuses to start, in one line
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="--token-ids openai needs") as e:
        load_openai_encoding()
    assert "\n" not in str(e.value)


def test_langchain_openai_with_text_inputs_gets_the_reference(minilm, ref):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    from runtime.serving import MODEL_ID, ServerThread, create_app

    sents = [str(s) for s in ref["sentences"]]
    b = Batcher(minilm, batch_buckets=(1, 4, 16), seq_buckets=(16, 32, 256))
    with ServerThread(create_app(b)) as srv:
        emb = lc.OpenAIEmbeddings(model=MODEL_ID, base_url=srv.url + "/v1", api_key="x",
                                  check_embedding_ctx_length=False)
        got = np.array(emb.embed_documents(sents[:4]), np.float32)
    b.close()
    assert np.abs(got - ref["embeddings"][:4]).max() < 1e-4


def test_long_texts_are_truncated_while_tokenized_as_the_whole_text_would_be(minilm):
    from runtime.models.tokens import FIRST_CHARS, encode_truncated

    tok = minilm.tokenizer
    rng = np.random.default_rng(0)
    words = ["the", "Ünïcödé", "東京", "naïve", "x.y,z", "e\u0301", "!!", "tokenization", "🙂",
             "a" * 150, "\n", "   "]
    texts = ["".join(rng.choice(words, n)) for n in (50, 400, 3000)]        # no spaces: cuts
    texts += [" ".join(rng.choice(words, n)) for n in (50, 400, 3000)]
    texts += [" " * 5000 + "late start " * 300, "b" * 9000, ""]
    whole = tok.encode_batch(texts)
    got = encode_truncated(tok, texts, first_chars=300)        # small: several passes each
    for i, (w, g) in enumerate(zip(whole, got)):
        assert g.ids == w.ids and g.attention_mask == w.attention_mask, i
    huge = encode_truncated(tok, ["some words here " * 6250])[0]       # 100,000 characters
    assert len(huge.ids) == minilm.max_seq_length
    assert sum(len(o.ids) for o in huge.overflowing) <= FIRST_CHARS     # never the whole text


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


def test_big_bodies_are_parsed_off_the_event_loop_and_ids_cut_to_the_window(minilm, ref,
                                                                            monkeypatch):
    # issue 25 item 2: four 2.4-million-id lists (13.7 MiB each) stalled /health for 2.7 s:
    # json.loads and the per-id checks ran on the event loop. A body over INLINE_BYTES must
    # never be parsed in this process (the pool's spawn worker imports the real parser), and
    # the batcher must only ever see the ids the model reads
    import httpx

    from runtime.serving import ServerThread, create_app, parse

    real = parse.parse_request

    def on_loop_only_when_small(body, **kw):
        assert len(body) <= parse.INLINE_BYTES, "a big body was parsed on the event loop"
        return real(body, **kw)

    monkeypatch.setattr(parse, "parse_request", on_loop_only_when_small)
    tok = minilm.tokenizer
    sents = [str(s) for s in ref["sentences"]]
    ids = tok.encode(sents[11]).ids
    huge = ids[:-1] + [1996] * 2_400_000 + [102]         # the model reads its first 256 ids
    want_huge = minilm.forward(*minilm.encode_ids([huge[:minilm.max_seq_length]]))[0]
    b = Batcher(minilm, batch_buckets=(1, 4, 16), seq_buckets=(16, 32, 256))
    seen = []
    real_submit = b.submit_ids
    monkeypatch.setattr(b, "submit_ids",
                        lambda seqs: seen.append(max(len(s) for s in seqs)) or real_submit(seqs))
    with ServerThread(create_app(b, token_ids="wordpiece")) as srv, \
            httpx.Client(base_url=srv.url, timeout=300) as http:
        big = http.post("/v1/embeddings", json={"input": [huge, ids]})
        bad = http.post("/v1/embeddings", json={"input": [huge[:-1] + [-3]]})   # checked too
        small = http.post("/v1/embeddings", json={"input": [ids[:5]]})
        texts = http.post("/v1/embeddings", json={"input": [sents[11] + " x" * 40_000] * 2})
    b.close()
    assert big.status_code == 200, big.text
    got = np.array([d["embedding"] for d in big.json()["data"]], np.float32)
    assert np.abs(got[0] - want_huge).max() < 1e-4
    assert np.abs(got[1] - ref["embeddings"][11]).max() < 1e-4
    assert max(seen) <= minilm.max_seq_length
    _check_error(bad, 400)
    assert small.status_code == 200 and texts.status_code == 200
    got = np.array([d["embedding"] for d in texts.json()["data"]], np.float32)
    want = minilm.embed([sents[11] + " x" * 40_000], graph=False)
    assert np.abs(got - want).max() < 1e-4


def test_each_request_is_traced_with_its_steps_and_the_histograms_count_tokens():
    _need_http()
    pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed")
    import httpx
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from runtime.serving import ServerThread, create_app
    from runtime.serving.tracing import Tracing

    spans = InMemorySpanExporter()
    tracing = Tracing(exporter=spans)
    model = FakeModel()
    m = ServingMetrics()
    b = Batcher(model, max_batch=2, batch_buckets=(1, 2), seq_buckets=(4, 16), metrics=m,
                max_wait_ms=20)
    with ServerThread(create_app(b, tracer=tracing.tracer)) as srv:
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": ["a b", "c", "d e f"]},
                       timeout=30)
        bad = httpx.post(srv.url + "/v1/embeddings", json={"input": 5}, timeout=30)
    b.close()
    tracing.shutdown()
    assert r.status_code == 200 and bad.status_code == 400
    done = spans.get_finished_spans()
    roots = [s for s in done if s.name == "embeddings"]
    assert len(roots) == 2
    ok = next(s for s in roots if s.attributes["http.response.status_code"] == 200)
    kids = [s for s in done if s.parent is not None and s.parent.span_id ==
            ok.context.span_id]
    names = sorted(s.name for s in kids)
    assert names == ["batch", "batch", "parse", "queue_wait", "respond", "tokenize"], names
    batches = sorted((s for s in kids if s.name == "batch"), key=lambda s: s.start_time)
    assert [s.attributes["batch.request_rows"] for s in batches] == [2, 1]
    assert [s.attributes["batch.bucket_rows"] for s in batches] == [2, 1]
    steps = [s for s in done if s.parent is not None and s.parent.span_id in
             {x.context.span_id for x in batches}]
    assert sorted(s.name for s in steps) == ["capture", "capture"]   # both buckets new
    qw = next(s for s in kids if s.name == "queue_wait")
    assert ok.start_time <= qw.start_time <= qw.end_time <= batches[0].start_time
    assert all(s.context.trace_id == ok.context.trace_id for s in kids + steps)
    # the histograms: tokens per request and padded tokens per batch
    assert m.value("request_tokens_count") == 1
    assert m.value("request_tokens_sum") == float(sum(len(t.split()) + 2
                                                      for t in ["a b", "c", "d e f"]))
    assert m.value("batch_padded_tokens_count", path="graph") == 2
    assert m.value("batch_padded_tokens_sum", path="graph") == 2 * 4 + 1 * 16


def _children(pid: int) -> set:
    """Live processes whose parent is ``pid`` (Linux ``/proc``)."""
    import os

    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_the_body_parse_worker_processes_too():
    # after a body over 64 KiB the server has spawned parse workers (runtime.serving.parse);
    # uvicorn re-raising SIGTERM used to kill the server before its cleanup and atexit ran,
    # leaving those workers and their resource tracker running as orphans
    _need_http()
    import os
    import signal
    import subprocess
    import sys

    if not os.path.isdir("/proc"):
        pytest.skip("needs Linux /proc to find the worker processes")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SERVER.format(
        tests=str(REPO / "tests"), grace=1.0)], stderr=subprocess.PIPE, env=env, text=True)
    workers: set = set()
    try:
        line = ""
        t_end = time.monotonic() + 60
        while " at http://" not in line:
            line = proc.stderr.readline()
            assert line and time.monotonic() < t_end, "the server did not start"
        url = line.rsplit(" at ", 1)[1].strip()
        body = json.dumps({"input": ["a " * 40_000]}).encode()        # 80 KB: parsed in a worker
        r = _read_all(_raw(url, _post_head(len(body)) + body, timeout=60))
        assert r.startswith(b"HTTP/1.1 "), r[:100]
        workers = _children(proc.pid)
        assert workers, "no parse worker process was started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM          # still dies by the signal
        t_end = time.monotonic() + 20
        while any(_alive(w) for w in workers) and time.monotonic() < t_end:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "parse workers outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for w in workers:                                         # orphans of the old code
            if _alive(w):
                os.kill(w, signal.SIGKILL)


def test_apps_made_per_tenant_and_dropped_leave_no_batcher_or_model_alive():
    """SOAK7: FastAPI caches its route functions process-wide (4,096 entries), and every
    route of ``create_app`` held the batcher (and so the model) through its closure: an app
    made per tenant, served, stopped and dropped kept its model for as long as the cache did
    (10 MB RSS per 30 tenants with the fake model; a MiniLM each in a real service). The
    routes now reach them through weak proxies; ``app.state`` holds them while it lives."""
    _need_http()
    import gc
    import weakref

    import httpx

    from runtime.serving import ServerThread, create_app

    refs = []
    for k in range(6):
        model = FakeModel()
        b = Batcher(model, max_wait_ms=0)
        refs += [weakref.ref(model), weakref.ref(b)]
        with ServerThread(create_app(b)) as srv:
            r = httpx.post(srv.url + "/v1/embeddings", json={"input": ["a b", "ccc"]}, timeout=10)
            assert r.status_code == 200
            got = np.array([d["embedding"] for d in r.json()["data"]], np.float32)
            np.testing.assert_array_equal(got, [expected(model, "a b"), expected(model, "ccc")])
            assert httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok"
            assert "runtime_serving_queue_depth 0.0" in httpx.get(srv.url + "/metrics",
                                                                  timeout=10).text
        b.close()
        del model, b, srv, r
    gc.collect()
    assert [r for r in refs if r() is not None] == []
