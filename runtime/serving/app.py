"""The embeddings HTTP API: an OpenAI-compatible ``POST /v1/embeddings`` over a :class:`Batcher`.

Routes:

- ``POST /v1/embeddings``: body ``{"input": str | [str, ...] | [int, ...] | [[int, ...], ...],
  "model": str?, "encoding_format": "float" | "base64"?, "dimensions": int?, "user": str?}``.
  Answer ``{"object": "list", "data": [{"object": "embedding", "index": i, "embedding":
  [...]}, ...], "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}``, rows in input
  order. Token-id inputs are refused (400) unless the app was told how to read them
  (``token_ids``, :mod:`runtime.serving.token_ids`): this model's own WordPiece ids
  (``[CLS]``/``[SEP]`` added where missing), or OpenAI's ``cl100k_base`` ids decoded to text.
  ``prompt_tokens`` counts the
  tokens the model was fed (``[CLS]``/``[SEP]`` included, after the 256-token truncation).
  ``base64`` is little-endian float32, as OpenAI's.
- ``GET /v1/models`` and ``GET /v1/models/{id}``: the one served model (``created``: the app's
  start time, Unix seconds; ``token_ids``: how token arrays are read).
- ``GET /health``: ``200 {"status": "ok", ...}`` while the batcher's worker runs, else 503.
  Never needs the API key.
- ``GET /metrics``: Prometheus text format (:class:`runtime.serving.metrics.ServingMetrics`).

Errors are OpenAI-shaped JSON, ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed request (bad JSON of any shape or depth, wrong types, empty or too many inputs, a
text too long or not valid Unicode, token ids outside the vocabulary, unknown
``encoding_format``, other ``dimensions``), 401 without the API key (when one is set), 404 for
another model or route, 408 when the body does not arrive within ``body_timeout``, 413 for a
body over ``max_body_bytes``, 503 when the queue is full (with ``Retry-After``, the queue's
drain estimate) or the server is shutting down, 500 when the batch holding one of the request's
texts failed. A bad request is refused before anything is queued, and a failed batch fails only
its own requests. A client that disconnects before its answer cancels its texts not yet batched
and is counted as ``499`` in ``runtime_serving_requests_total``.

The event loop does O(1) work per request: a body over a few KiB is parsed in a worker process
(:func:`runtime.serving.parse.parse_off_loop`), tokenizing and the answer's JSON of a big request
run on worker threads, and token arrays are cut to the ids the model reads before any per-id
Python work.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations
# (``request: Request``) at runtime, and ``Request`` is imported inside ``create_app``.
import asyncio
import base64
import contextlib
import hmac
import json
import math
import time
import weakref

import numpy as np

from .batcher import BatchFailed, BatcherClosed, QueueFull
from .metrics import CONTENT_TYPE, ServingMetrics
from .parse import ApiError as _ApiError
from .parse import parse_off_loop
from .limits import BODY_TIMEOUT, MAX_BODY_BYTES, MAX_INPUT_CHARS, MAX_INPUTS  # noqa: F401
from .token_ids import MODES, OpenAIIds

#: The served model's id (what ``model`` defaults to and what responses carry).
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
#: Texts (or characters) above which a submit (tokenizing) runs on a worker thread, not the
#: event loop.
INLINE_TEXTS, INLINE_CHARS = 16, 4096


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def read_body(request, max_bytes: int, timeout: float) -> bytes:
    """The request body, at most ``max_bytes``, arriving within ``timeout`` seconds.

    Raises: ``_ApiError`` 413 (``Content-Length`` or the bytes received exceed ``max_bytes``;
        the rest of the body is read and dropped for up to ``timeout`` seconds so that the
        client reads the answer rather than a reset connection) or 408 (too slow). Both close
        the connection after the answer.
    """
    close = {"connection": "close"}
    declared = request.headers.get("content-length")
    got = {"chunks": [], "size": 0}
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        got["size"] = max_bytes + 1

    async def read():
        async for chunk in request.stream():
            got["size"] += len(chunk)
            if got["size"] <= max_bytes:
                got["chunks"].append(chunk)
            else:
                got["chunks"] = []                 # keep reading and dropping, then 413

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        if got["size"] <= max_bytes:
            raise _ApiError(408, f"the request body did not arrive within {timeout:g} s",
                            code="request_timeout", headers=close) from None
    if got["size"] > max_bytes:
        raise _ApiError(413, f"the request body is over the limit of {max_bytes} bytes",
                        code="request_too_large", headers=close)
    return b"".join(got["chunks"])


async def _until_disconnect(receive) -> None:
    """Returns once the client has disconnected (the ASGI ``http.disconnect`` message)."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


async def answer_or_disconnect(request, fut):
    """The batcher's answer to ``fut``, or ``None`` when the client disconnects first (then
    ``fut`` is cancelled, so its texts not yet batched are dropped)."""
    waiter = asyncio.wrap_future(fut)
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if waiter.done():
        return waiter.result()
    fut.cancel()
    waiter.cancel()
    return None


def bearer_ok(header, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (constant-time compare,
    ``hmac.compare_digest``)."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              api_key.encode())


def create_app(batcher, *, model_id: str = MODEL_ID, metrics: ServingMetrics | None = None,
               max_inputs: int = MAX_INPUTS, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout: float = BODY_TIMEOUT, api_key: str | None = None,
               token_ids: str = "refuse", openai_encoding=None, tracer=None,
               settings: dict | None = None):
    """The FastAPI application serving ``batcher`` (the one factory `serve`, `serve --ray`,
    tests and other deployments build the app with; :class:`runtime.serving.replica.Replica`
    builds it from the ``serve`` settings).

    Args:
        batcher: a running :class:`runtime.serving.Batcher` (it checks the texts: characters
            per text, Unicode).
        model_id: the model name it answers to and reports.
        metrics: where to record; default ``batcher.metrics``, else a fresh
            :class:`ServingMetrics` (then the batcher's own batches are not recorded). Gauges
            ``queue_depth`` (texts), ``queue_requests`` and ``graphs`` are added to it.
        max_inputs: most inputs per request (400 beyond).
        max_body_bytes: body size limit (413 beyond it); body_timeout: seconds for the body to
            arrive once the headers have (408 after).
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer
            <api_key>`` (401 otherwise).
        token_ids: how token-array inputs are read (:mod:`runtime.serving.token_ids`):
            ``"refuse"`` (400, the default), ``"wordpiece"`` (this model's ids:
            ``batcher.submit_ids``) or ``"openai"`` (``cl100k_base`` ids, decoded to text with
            ``openai_encoding``, then embedded as text).
        openai_encoding: with ``"openai"``: an object with ``decode(ids) -> str`` and
            ``n_vocab`` (tiktoken's ``Encoding``; :func:`runtime.serving.token_ids.
            load_openai_encoding` loads it).
        tracer: an OpenTelemetry ``Tracer`` for per-request spans
            (:mod:`runtime.serving.tracing`), or ``None`` (no tracing work).
        settings: what ``/health`` reports under ``settings`` (the server's settings without
            the API key), or ``None``.
    Returns: a ``fastapi.FastAPI``. Its ``state.batcher`` and ``state.metrics`` are set.
    Raises: ``ImportError`` when fastapi is missing (``pip install 'runtime[serve]'``);
        ``ValueError`` (an unknown ``token_ids`` mode, or ``"openai"`` without an encoding).
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    if token_ids not in MODES:
        raise ValueError(f"token_ids={token_ids!r}; one of {MODES}")
    if token_ids == "openai" and openai_encoding is None:
        raise ValueError("token_ids='openai' needs openai_encoding (load_openai_encoding())")
    # the routes reach the batcher and its models through weak proxies and app.state holds
    # them (SOAK7): FastAPI caches its route functions (4,096 entries, process-wide), so an
    # app made per tenant and dropped kept its batcher and model alive through their closures
    app_batcher, batcher = batcher, weakref.proxy(batcher)
    m = metrics or batcher.metrics or ServingMetrics()
    if batcher.metrics is None:
        batcher.metrics = m
    m.watch("queue_depth", "Texts waiting for a batch.", lambda: batcher.queued)
    m.watch("queue_requests", "Requests with texts waiting for a batch.",
            lambda: batcher.queued_requests)
    model = batcher.model
    # serve --streams N: a BatcherGroup, a model per stream, each holding its own graphs;
    # the graph gauges and /health count every stream's, not the first one's
    stream_models = [weakref.proxy(b.model)
                     for b in getattr(app_batcher, "batchers", (app_batcher,))]

    def held_buckets() -> list:
        return [tuple(b) for mo in stream_models for b in getattr(mo, "buckets", ())]

    m.watch("graphs", "Bucket graphs currently held (over every stream's model).",
            lambda: len(held_buckets()))
    if all(hasattr(mo, "graph_memory") for mo in stream_models):   # MiniLM (issue 26 item 3)
        m.watch("graph_bytes", "Bytes the bucket graphs keep alive beyond the weights "
                "(shared temporaries, inputs, outputs; over every stream's model).",
                lambda: sum(mo.graph_memory() for mo in stream_models))
    # with an API key every route but /health needs it: FastAPI's schema and interactive
    # docs routes take no dependency, so they are off then (404), never open without the key
    docs = {} if not api_key else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="runtime embeddings", version="0.1.0", **docs)
    app.state.batcher, app.state.metrics, app.state.tracing = app_batcher, m, tracer
    m = weakref.proxy(m)                # (the routes' too: app.state holds it)
    hidden = int(batcher.hidden)
    backend = getattr(getattr(model, "client", None), "backend", None)
    created = int(time.time())
    model_obj = {"id": model_id, "object": "model", "created": created, "owned_by": "runtime",
                 "token_ids": token_ids}
    openai_ids = OpenAIIds(openai_encoding) if token_ids == "openai" else None
    limits = {"model_id": model_id, "hidden": hidden, "max_inputs": max_inputs,
              "token_ids": token_ids}
    if token_ids == "wordpiece":
        limits["vocab_size"] = getattr(model, "vocab_size", None)
        limits["window"] = int(batcher.max_seq_length)
    elif openai_ids is not None:
        limits["vocab_size"] = openai_ids.vocab_size
    health_settings = dict(settings or {}, token_ids=token_ids)
    for k in ("batch_buckets", "seq_buckets", "max_batch", "max_batch_tokens"):
        if k in health_settings and health_settings[k] is None:     # (None: the default, shown
            v = getattr(batcher, k, None)                             # as what runs: USER7)
            if v is not None:
                health_settings[k] = list(v) if isinstance(v, tuple) else v
    big_submits = asyncio.Semaphore(1)

    def err(e: _ApiError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status,
                            headers=e.headers)

    def check_key(request) -> None:
        if api_key and not bearer_ok(request.headers.get("authorization"), api_key):
            raise _ApiError(401, "a valid API key is required: send 'Authorization: Bearer "
                            "<key>'", code="invalid_api_key")

    def span(name: str, parent=None):
        """A child span of ``parent`` (or a no-op without a tracer)."""
        if tracer is None:
            return contextlib.nullcontext()
        from opentelemetry import trace
        return tracer.start_as_current_span(
            name, context=None if parent is None else trace.set_span_in_context(parent))

    def submit(p):
        """Queue the parsed inputs (token arrays decoded or encoded first); a future."""
        if not p.token_ids:
            return batcher.submit(p.inputs)
        if openai_ids is not None:
            return batcher.submit(openai_ids.texts(p.inputs))
        return batcher.submit_ids(p.inputs)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc):       # 404/405 etc. in the same JSON shape
        if api_key and not bearer_ok(request.headers.get("authorization"), api_key):
            return err(_ApiError(401, "a valid API key is required", code="invalid_api_key"))
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"),
                            status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

    @app.exception_handler(_ApiError)
    async def _api_error(request, exc):
        return err(exc)

    async def handle(request, root):
        check_key(request)
        body = await read_body(request, max_body_bytes, body_timeout)
        with span("parse", root):
            p = await parse_off_loop(body, **limits)
        try:
            with span("tokenize", root):
                n_chars = 0 if p.token_ids else sum(map(len, p.inputs))
                if len(p.inputs) > INLINE_TEXTS or n_chars > INLINE_CHARS or openai_ids:
                    # off the loop, one big request at a time: tokenizing holds the GIL in
                    # short slices, and each more thread slicing it delays the loop's turn
                    async with big_submits:
                        fut = await run_in_threadpool(submit, p)
                else:
                    fut = submit(p)
            res = await answer_or_disconnect(request, fut)
        except QueueFull as e:
            raise _ApiError(503, str(e), "server_overloaded", headers={
                "retry-after": str(max(1, math.ceil(e.retry_after)))}) from None
        except BatcherClosed as e:
            raise _ApiError(503, str(e), "server_unavailable") from None
        except BatchFailed as e:
            raise _ApiError(500, str(e), "server_error") from None
        except (TypeError, ValueError) as e:
            raise _ApiError(400, str(e), param="input") from None
        if res is None:                            # the client left: nobody reads this
            return Response(status_code=499)
        if root is not None:
            from .tracing import record_batches
            record_batches(tracer, root, res.timings)
        with span("respond", root):
            n_tok = int(res.tokens.sum())
            m.request_tokens.observe(n_tok)
            if len(p.inputs) > INLINE_TEXTS:
                return await run_in_threadpool(_answer, res, p.encoding_format, model_id, n_tok)
            return _answer(res, p.encoding_format, model_id, n_tok)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        t0 = time.perf_counter()
        status = 500
        root = None
        try:
            if tracer is not None:
                root = tracer.start_span("embeddings", attributes={
                    "http.request.method": "POST", "url.path": "/v1/embeddings"})
            response = await handle(request, root)
            status = response.status_code
            return response
        except _ApiError as e:
            status = e.status
            return err(e)
        except Exception as e:  # noqa: BLE001 - an unexpected bug answers 500, the server lives
            return err(_ApiError(500, f"{type(e).__name__}: {e}", "server_error"))
        finally:
            m.requests.labels(code=str(status)).inc()
            m.request.observe(time.perf_counter() - t0)
            if root is not None:
                root.set_attribute("http.response.status_code", status)
                root.end()

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [model_obj]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request):
        check_key(request)
        if name not in (model_id, model_id.rsplit("/", 1)[-1]):
            raise _ApiError(404, f"model '{name}' is not served here; this server serves "
                            f"'{model_id}'", param="model", code="model_not_found")
        return model_obj

    @app.get("/health")
    async def health():
        ok = batcher.alive
        body = {"status": "ok" if ok else "unavailable", "model": model_id, "backend": backend,
                "path": batcher.path,
                "graphs": [list(b) for b in dict.fromkeys(held_buckets())],   # any stream's
                "streams": len(stream_models),
                "queued": batcher.queued, "queued_requests": batcher.queued_requests,
                "batches": batcher.batches_run, "token_ids": token_ids,
                "settings": health_settings}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus(request: Request):
        check_key(request)
        return Response(m.render(), media_type=CONTENT_TYPE)

    return app


def _answer(res, encoding_format: str, model_id: str, n_tok: int):
    """The 200 answer for a batcher result (rows as floats or base64 float32).

    The JSON is built one row at a time (``json.dumps`` of one row, then joined), not in one
    ``json.dumps`` of the whole answer: a C call holds the GIL to its end, and 2048 rows of
    384 floats take ~0.2 s, which would stop the event loop even from a worker thread.
    """
    from fastapi.responses import Response

    if encoding_format == "base64":
        rows = (json.dumps(base64.b64encode(r.astype("<f4").tobytes()).decode("ascii"))
                for r in res.embeddings)
    else:
        rows = (json.dumps(r.tolist(), separators=(",", ":"), allow_nan=False)
                for r in res.embeddings)
    data = ",".join(f'{{"object":"embedding","index":{i},"embedding":{r}}}'
                    for i, r in enumerate(rows))
    body = (f'{{"object":"list","data":[{data}],"model":{json.dumps(model_id)},'
            f'"usage":{{"prompt_tokens":{n_tok},"total_tokens":{n_tok}}}}}')
    return Response(body.encode("utf-8"), media_type="application/json")


def cosine(a, b) -> float:
    """Cosine similarity of two vectors (float)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
