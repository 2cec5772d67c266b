"""The embeddings HTTP API: an OpenAI-compatible ``POST /v1/embeddings`` over a :class:`Batcher`.

Routes:

- ``POST /v1/embeddings``: body ``{"input": str | [str, ...] | [int, ...] | [[int, ...], ...],
  "model": str?, "encoding_format": "float" | "base64"?, "dimensions": int?, "user": str?}``.
  Answer ``{"object": "list", "data": [{"object": "embedding", "index": i, "embedding":
  [...]}, ...], "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}``, rows in input
  order. Token-id inputs are ids of this model's own tokenizer (``[CLS]``/``[SEP]`` added where
  missing), as text-embeddings-inference and vLLM take them. ``prompt_tokens`` counts the
  tokens the model was fed (``[CLS]``/``[SEP]`` included, after the 256-token truncation).
  ``base64`` is little-endian float32, as OpenAI's.
- ``GET /v1/models`` and ``GET /v1/models/{id}``: the one served model (``created``: the app's
  start time, Unix seconds).
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
"""

# No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations
# (``request: Request``) at runtime, and ``Request`` is imported inside ``create_app``.
import asyncio
import base64
import hmac
import json
import math
import time
from typing import NamedTuple

import numpy as np

from .batcher import BatchFailed, BatcherClosed, QueueFull
from .metrics import CONTENT_TYPE, ServingMetrics

#: The served model's id (what ``model`` defaults to and what responses carry).
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
#: Default request limits (each a ``serve`` flag): inputs per request, characters per text,
#: body bytes, and seconds for the body to arrive.
MAX_INPUTS, MAX_INPUT_CHARS, MAX_BODY_BYTES, BODY_TIMEOUT = 2048, 100_000, 16 << 20, 30.0


class _ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type_,
                                                                       param, code)
        self.headers = headers


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class Parsed(NamedTuple):
    """A valid ``/v1/embeddings`` request.

    Attributes:
        inputs: a list of strings, or (``token_ids``) a list of lists of ints.
        token_ids: whether ``inputs`` are token ids.
        encoding_format: ``"float"`` or ``"base64"``.
    """

    inputs: list
    token_ids: bool
    encoding_format: str


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _inputs(inp) -> tuple:
    """``(inputs, token_ids)`` from the ``input`` field, or ``_ApiError`` 400."""
    if isinstance(inp, str):
        return [inp], False
    if not isinstance(inp, list):
        raise _ApiError(400, f"'input' is {type(inp).__name__}; it must be a string, a list of "
                        "strings, or token ids (a list of ints or a list of lists of ints)",
                        param="input")
    if not inp:
        raise _ApiError(400, "'input' must not be an empty list", param="input")
    if all(isinstance(t, str) for t in inp):
        return inp, False
    if all(_is_int(t) for t in inp):
        return [inp], True
    if all(isinstance(t, list) for t in inp):
        for i, seq in enumerate(inp):
            j = next((j for j, v in enumerate(seq) if not _is_int(v)), None)
            if j is not None:
                raise _ApiError(400, f"'input[{i}][{j}]' is {type(seq[j]).__name__}; token-id "
                                "inputs are lists of ints", param="input")
        return inp, True
    kind = str if isinstance(inp[0], str) else (list if isinstance(inp[0], list) else int)
    bad = next(i for i, t in enumerate(inp) if not isinstance(t, kind) or isinstance(t, bool))
    raise _ApiError(400, f"'input[{bad}]' is {type(inp[bad]).__name__} but 'input[0]' is "
                    f"{type(inp[0]).__name__}; send strings, or token ids, not a mix",
                    param="input")


def parse_request(body: bytes, *, model_id: str = MODEL_ID, hidden: int = 384,
                  max_inputs: int = MAX_INPUTS, max_input_chars: int = MAX_INPUT_CHARS) -> Parsed:
    """Validate a ``/v1/embeddings`` body.

    Args:
        body: the raw request body (UTF-8 JSON).
        model_id: the served model (``model`` may be it or its last path part).
        hidden: the embedding width (``dimensions`` may only equal it).
        max_inputs: most inputs per request; max_input_chars: most characters per string.
    Returns: a :class:`Parsed`.
    Raises: ``_ApiError`` (status 400 or 404, with the offending ``param``), for any body that
        is not a valid request: never anything else.
    """
    try:
        req = json.loads(body)
    except (ValueError, RecursionError) as e:      # JSONDecodeError, UnicodeDecodeError, ...
        raise _ApiError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(req, dict):
        raise _ApiError(400, "the body must be a JSON object with an 'input' field")
    if "input" not in req:
        raise _ApiError(400, "'input' is required: a string or a list of strings", param="input")
    inputs, ids = _inputs(req["input"])
    if len(inputs) > max_inputs:
        raise _ApiError(400, f"{len(inputs)} inputs; at most {max_inputs} per request",
                        param="input")
    if not ids:
        for i, t in enumerate(inputs):
            if len(t) > max_input_chars:
                raise _ApiError(400, f"'input[{i}]' has {len(t)} characters; at most "
                                f"{max_input_chars} (the model reads only its first 256 tokens)",
                                param="input")
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise _ApiError(400, f"'input[{i}]' is not valid Unicode: it holds a lone UTF-16 "
                                "surrogate", param="input") from None
    model = req.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise _ApiError(400, "'model' must be a string", param="model")
        if model not in (model_id, model_id.rsplit("/", 1)[-1]):
            raise _ApiError(404, f"model '{model}' is not served here; this server serves "
                            f"'{model_id}'", param="model", code="model_not_found")
    fmt = req.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise _ApiError(400, f"'encoding_format' must be 'float' or 'base64', got "
                        f"{str(fmt)[:40]!r}", param="encoding_format")
    dims = req.get("dimensions")
    if dims is not None and (not _is_int(dims) or dims != hidden):
        raise _ApiError(400, f"'dimensions' must be {hidden} (this model's width) if given, "
                        f"got {str(dims)[:40]}", param="dimensions")
    user = req.get("user")
    if user is not None and not isinstance(user, str):
        raise _ApiError(400, "'user' must be a string", param="user")
    return Parsed(inputs, ids, fmt)


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
               max_inputs: int = MAX_INPUTS, max_input_chars: int = MAX_INPUT_CHARS,
               max_body_bytes: int = MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT,
               api_key: str | None = None):
    """The FastAPI application serving ``batcher`` (the one factory `serve`, tests and other
    deployments build the app with).

    Args:
        batcher: a running :class:`runtime.serving.Batcher`.
        model_id: the model name it answers to and reports.
        metrics: where to record; default ``batcher.metrics``, else a fresh
            :class:`ServingMetrics` (then the batcher's own batches are not recorded). Gauges
            ``queue_depth`` (texts), ``queue_requests`` and ``graphs`` are added to it.
        max_inputs, max_input_chars: request limits (400 beyond them).
        max_body_bytes: body size limit (413 beyond it); body_timeout: seconds for the body to
            arrive once the headers have (408 after).
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer
            <api_key>`` (401 otherwise).
    Returns: a ``fastapi.FastAPI``. Its ``state.batcher`` and ``state.metrics`` are set.
    Raises: ``ImportError`` when fastapi is missing (``pip install 'runtime[serve]'``).
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    m = metrics or batcher.metrics or ServingMetrics()
    if batcher.metrics is None:
        batcher.metrics = m
    m.watch("queue_depth", "Texts waiting for a batch.", lambda: batcher.queued)
    m.watch("queue_requests", "Requests with texts waiting for a batch.",
            lambda: batcher.queued_requests)
    model = batcher.model
    m.watch("graphs", "Bucket graphs currently held.",
            lambda: len(list(getattr(model, "buckets", ()))))
    if hasattr(model, "graph_memory"):      # issue 26 item 3 (runtime.models.minilm)
        m.watch("graph_bytes", "Bytes the bucket graphs keep alive beyond the weights "
                "(shared temporaries, inputs, outputs).", model.graph_memory)
    app = FastAPI(title="runtime embeddings", version="0.1.0")
    app.state.batcher, app.state.metrics = batcher, m
    hidden = int(batcher.hidden)
    backend = getattr(getattr(model, "client", None), "backend", None)
    created = int(time.time())
    model_obj = {"id": model_id, "object": "model", "created": created, "owned_by": "runtime"}

    def err(e: _ApiError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status,
                            headers=e.headers)

    def check_key(request) -> None:
        if api_key and not bearer_ok(request.headers.get("authorization"), api_key):
            raise _ApiError(401, "a valid API key is required: send 'Authorization: Bearer "
                            "<key>'", code="invalid_api_key")

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

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        t0 = time.perf_counter()
        status = 500
        try:
            check_key(request)
            p = parse_request(await read_body(request, max_body_bytes, body_timeout),
                              model_id=model_id, hidden=hidden, max_inputs=max_inputs,
                              max_input_chars=max_input_chars)
            submit = batcher.submit_ids if p.token_ids else batcher.submit
            try:
                if len(p.inputs) > 16 or (not p.token_ids and sum(map(len, p.inputs)) > 4096):
                    fut = await run_in_threadpool(submit, p.inputs)   # keep the loop free
                else:
                    fut = submit(p.inputs)
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
            if res is None:                        # the client left: nobody reads this
                status = 499
                return Response(status_code=499)
            if p.encoding_format == "base64":
                rows = [base64.b64encode(r.astype("<f4").tobytes()).decode("ascii")
                        for r in res.embeddings]
            else:
                rows = res.embeddings.tolist()
            n_tok = int(res.tokens.sum())
            body = {"object": "list",
                    "data": [{"object": "embedding", "index": i, "embedding": r}
                             for i, r in enumerate(rows)],
                    "model": model_id,
                    "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}}
            status = 200
            return JSONResponse(body)
        except _ApiError as e:
            status = e.status
            return err(e)
        except Exception as e:  # noqa: BLE001 - an unexpected bug answers 500, the server lives
            return err(_ApiError(500, f"{type(e).__name__}: {e}", "server_error"))
        finally:
            m.requests.labels(code=str(status)).inc()
            m.request.observe(time.perf_counter() - t0)

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
                "path": batcher.path, "graphs": [list(b) for b in getattr(model, "buckets", [])],
                "queued": batcher.queued, "queued_requests": batcher.queued_requests,
                "batches": batcher.batches_run}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus(request: Request):
        check_key(request)
        return Response(m.render(), media_type=CONTENT_TYPE)

    return app


def cosine(a, b) -> float:
    """Cosine similarity of two vectors (float)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
