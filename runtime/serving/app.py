"""The embeddings HTTP API: an OpenAI-compatible ``POST /v1/embeddings`` over a :class:`Batcher`.

Routes:

- ``POST /v1/embeddings``: body ``{"input": str | [str, ...], "model": str?,
  "encoding_format": "float" | "base64"?, "dimensions": int?, "user": str?}``. Answer
  ``{"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...]}, ...],
  "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}``, rows in input order.
  ``prompt_tokens`` counts the tokens the model was fed (``[CLS]``/``[SEP]`` included, after the
  256-token truncation). ``base64`` is little-endian float32, as OpenAI's.
- ``GET /v1/models``: the one served model.
- ``GET /health``: ``200 {"status": "ok", ...}`` while the batcher's worker runs, else 503.
- ``GET /metrics``: Prometheus text format (:class:`runtime.serving.metrics.ServingMetrics`).

Errors are OpenAI-shaped JSON, ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed request (bad JSON, wrong types, empty or too many inputs, token-id inputs, unknown
``encoding_format``, other ``dimensions``), 404 for another model or route, 503 when the queue is
full or the batcher stopped, 500 when the batch holding one of the request's texts failed. A bad
request is refused before anything is queued, and a failed batch fails only its own requests, so
neither disturbs any other request.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations
# (``request: Request``) at runtime, and ``Request`` is imported inside ``create_app``.
import asyncio
import base64
import json
import socket
import threading
import time

import numpy as np

from .batcher import BatchFailed, BatcherClosed, QueueFull
from .metrics import CONTENT_TYPE, ServingMetrics

#: The served model's id (what ``model`` defaults to and what responses carry).
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


class _ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type_,
                                                                       param, code)


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def parse_request(body: bytes, *, model_id: str = MODEL_ID, hidden: int = 384,
                  max_inputs: int = 2048, max_input_chars: int = 100_000) -> tuple:
    """Validate a ``/v1/embeddings`` body.

    Args:
        body: the raw request body (UTF-8 JSON).
        model_id: the served model (``model`` may be it or its last path part).
        hidden: the embedding width (``dimensions`` may only equal it).
        max_inputs: most strings per request; max_input_chars: most characters per string.
    Returns: ``(texts, encoding_format)``: a list of strings and ``"float"`` or ``"base64"``.
    Raises: ``_ApiError`` (status 400 or 404, with the offending ``param``).
    """
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise _ApiError(400, "the body must be a JSON object with an 'input' field")
    if "input" not in req:
        raise _ApiError(400, "'input' is required: a string or a list of strings", param="input")
    inp = req["input"]
    if isinstance(inp, str):
        texts = [inp]
    elif isinstance(inp, list):
        if not inp:
            raise _ApiError(400, "'input' must not be an empty list", param="input")
        if all(isinstance(t, str) for t in inp):
            texts = inp
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in inp) or \
                all(isinstance(t, list) for t in inp):
            raise _ApiError(400, "token-id inputs are not supported; send strings",
                            param="input")
        else:
            bad = next(i for i, t in enumerate(inp) if not isinstance(t, str))
            raise _ApiError(400, f"'input[{bad}]' is {type(inp[bad]).__name__}; every input "
                            "must be a string", param="input")
    else:
        raise _ApiError(400, f"'input' is {type(inp).__name__}; it must be a string or a list "
                        "of strings", param="input")
    if len(texts) > max_inputs:
        raise _ApiError(400, f"{len(texts)} inputs; at most {max_inputs} per request",
                        param="input")
    long = next((i for i, t in enumerate(texts) if len(t) > max_input_chars), None)
    if long is not None:
        raise _ApiError(400, f"'input[{long}]' has {len(texts[long])} characters; at most "
                        f"{max_input_chars} (the model reads only its first 256 tokens)",
                        param="input")
    model = req.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise _ApiError(400, "'model' must be a string", param="model")
        if model not in (model_id, model_id.rsplit("/", 1)[-1]):
            raise _ApiError(404, f"model '{model}' is not served here; this server serves "
                            f"'{model_id}'", param="model", code="model_not_found")
    fmt = req.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise _ApiError(400, f"'encoding_format' must be 'float' or 'base64', got {fmt!r}",
                        param="encoding_format")
    dims = req.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)
                             or dims != hidden):
        raise _ApiError(400, f"'dimensions' must be {hidden} (this model's width) if given, "
                        f"got {dims!r}", param="dimensions")
    user = req.get("user")
    if user is not None and not isinstance(user, str):
        raise _ApiError(400, "'user' must be a string", param="user")
    return texts, fmt


def create_app(batcher, *, model_id: str = MODEL_ID, metrics: ServingMetrics | None = None,
               max_inputs: int = 2048, max_input_chars: int = 100_000):
    """The FastAPI application serving ``batcher``.

    Args:
        batcher: a running :class:`runtime.serving.Batcher`.
        model_id: the model name it answers to and reports.
        metrics: where to record; default ``batcher.metrics``, else a fresh
            :class:`ServingMetrics` (then the batcher's own batches are not recorded).
        max_inputs, max_input_chars: request limits (400 beyond them).
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
    app = FastAPI(title="runtime embeddings", version="0.1.0")
    app.state.batcher, app.state.metrics = batcher, m
    hidden = int(batcher.hidden)
    model = batcher.model
    backend = getattr(getattr(model, "client", None), "backend", None)

    def err(e: _ApiError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc):       # 404/405 etc. in the same JSON shape
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"),
                            status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        t0 = time.perf_counter()
        status = 500
        try:
            texts, fmt = parse_request(await request.body(), model_id=model_id, hidden=hidden,
                                       max_inputs=max_inputs, max_input_chars=max_input_chars)
            try:
                if len(texts) > 16 or sum(map(len, texts)) > 4096:   # keep the loop free
                    fut = await run_in_threadpool(batcher.submit, texts)
                else:
                    fut = batcher.submit(texts)
                res = await asyncio.wrap_future(fut)
            except QueueFull as e:
                raise _ApiError(503, str(e), "server_overloaded") from None
            except BatcherClosed as e:
                raise _ApiError(503, str(e), "server_unavailable") from None
            except BatchFailed as e:
                raise _ApiError(500, str(e), "server_error") from None
            except (TypeError, ValueError) as e:
                raise _ApiError(400, str(e)) from None
            if fmt == "base64":
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
            m.requests.inc(code=str(status))
            m.request.observe(time.perf_counter() - t0)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model",
                                            "owned_by": "runtime"}]}

    @app.get("/health")
    async def health():
        ok = batcher.alive
        body = {"status": "ok" if ok else "unavailable", "model": model_id, "backend": backend,
                "path": batcher.path, "graphs": [list(b) for b in getattr(model, "buckets", [])],
                "queued": batcher.queued, "batches": batcher.batches_run}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(m.render(), media_type=CONTENT_TYPE)

    return app


class ServerThread:
    """Run an ASGI app with uvicorn on a background thread (tests, the demo, benchmarks).

    Args:
        app: the ASGI app; host: the interface (loopback by default); port: ``0`` picks a free
            one (the socket is bound here, before the thread starts, so there is no race).
        log_level: uvicorn's (``"warning"`` keeps the access log quiet).

    ``start()`` blocks until the server accepts connections and returns the base URL;
    ``stop()`` shuts it down and joins the thread. Also a context manager.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        # proto=IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only
        # when the socket says it is TCP; with proto 0, Nagle + delayed ACK add ~40 ms to every
        # response written in two parts (headers, body).
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                  socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                             timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="serving-http", daemon=True)

    @property
    def url(self) -> str:
        """``http://host:port``."""
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def start(self, timeout: float = 30.0) -> str:
        """Start serving; returns :attr:`url`. Raises ``RuntimeError`` if not up in time."""
        self.thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit and join its thread."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def cosine(a, b) -> float:
    """Cosine similarity of two vectors (float)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
