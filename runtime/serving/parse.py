"""Parsing ``POST /v1/embeddings`` bodies, off the event loop and bounded.

:func:`parse_request` validates a body's JSON shape and returns a :class:`Parsed` request whose
size no longer depends on the body's: token arrays come back as ``int64`` arrays cut to the
ids the model reads (``window``), checked with numpy, not one id at a time in Python. The texts'
own checks (length, Unicode) are the batcher's (:meth:`runtime.serving.Batcher.submit`).

:func:`parse_off_loop` is what the app awaits: a body up to :data:`INLINE_BYTES` is parsed in
place (microseconds), a bigger one in a worker process of a small shared pool
(``concurrent.futures.ProcessPoolExecutor``, spawn start method), because ``json.loads`` holds
the GIL for its whole parse (0.5 s for 2.4 million ids on this machine): in a thread it would
still stop the event loop, and ``/health`` with it.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import threading
from typing import NamedTuple

import numpy as np

#: Bodies up to this size (bytes) are parsed on the event loop itself (well under 1 ms).
INLINE_BYTES = 64 << 10
#: Worker processes of the parse pool (at most; fewer on a machine with fewer CPUs).
POOL_WORKERS = 2


class ApiError(Exception):
    """An OpenAI-shaped error answer: ``status``, ``message``, ``type``, ``param``, ``code``,
    extra response ``headers``. Picklable, so a parse worker process can raise it."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type_,
                                                                       param, code)
        self.headers = headers

    def __reduce__(self):
        return (ApiError, (self.status, self.message, self.type, self.param, self.code,
                           self.headers))


class Parsed(NamedTuple):
    """A valid ``/v1/embeddings`` request.

    Attributes:
        inputs: a list of strings, or (``token_ids``) a list of ``int64`` arrays (each cut to
            the parser's ``window`` ids when one was given).
        token_ids: whether ``inputs`` are token ids.
        encoding_format: ``"float"`` or ``"base64"``.
    """

    inputs: list
    token_ids: bool
    encoding_format: str


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ids(i: int, seq, vocab_size, window, slow: bool, max_ids) -> np.ndarray:
    """One token array as ``int64``, checked (ints in ``[0, vocab_size)``) and cut to
    ``window``; raises :class:`ApiError` 400 naming ``input[i]``."""
    if max_ids is not None and len(seq) > max_ids:
        raise ApiError(400, f"'input[{i}]' has {len(seq)} token ids; at most {max_ids} per "
                       "input", param="input")
    try:
        arr = np.asarray(seq)
    except (ValueError, TypeError):                   # ragged nested lists
        arr = np.asarray(seq, dtype=object)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if slow or arr.ndim != 1 or arr.dtype.kind not in "iu":     # find the first bad value
        j = next((j for j, v in enumerate(seq) if not _is_int(v)), None)
        if j is not None:
            raise ApiError(400, f"'input[{i}][{j}]' is {type(seq[j]).__name__}; token-id "
                           "inputs are lists of ints", param="input")
        arr = np.asarray(seq, dtype=object)
    if vocab_size is not None:
        bad = (arr < 0) | (arr >= vocab_size)
        if bad.any():
            v = seq[int(np.argmax(bad))]
            raise ApiError(400, f"input[{i}] holds {v!r}, not a token id of this model: token "
                           "ids must come from this model's tokenizer (integers in "
                           f"[0, {vocab_size}))", param="input")
    if window is not None:
        arr = arr[:window]
    return arr.astype(np.int64)


_JSON_TYPES = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number",
               str: "a string", list: "an array", dict: "an object"}


def _json_type(v) -> str:
    """What a JSON value is, in JSON's words (``null``, ``an array``, ...), for messages."""
    return _JSON_TYPES.get(type(v), type(v).__name__)


def _inputs(inp, body: bytes, token_ids: str, vocab_size, window, refusal) -> tuple:
    """``(inputs, is_ids)`` from the ``input`` field, or :class:`ApiError` 400."""
    if isinstance(inp, str):
        return [inp], False
    if not isinstance(inp, list):
        raise ApiError(400, f"'input' is {_json_type(inp)}; it must be a string, a list of "
                       "strings, or token ids (a list of ints or a list of lists of ints)",
                       param="input")
    if not inp:
        raise ApiError(400, "'input' must not be an empty list", param="input")
    if all(isinstance(t, str) for t in inp):
        return inp, False
    first = inp[0]
    if not (isinstance(first, (str, list)) or _is_int(first)):
        raise ApiError(400, f"'input[0]' is {_json_type(first)}; each input must be a string "
                       "(or, where the server takes token ids, every input an integer, or every "
                       "input an array of integers)", param="input")
    if isinstance(first, list) and first and isinstance(first[0], str):
        raise ApiError(400, "'input[0]' is an array of strings; send the strings themselves: "
                       "'input' is a string or a list of strings", param="input")
    if token_ids == "refuse" and (_is_int(inp[0]) or isinstance(inp[0], list)):
        raise ApiError(400, refusal, param="input", code="token_ids_not_accepted")
    # a bool inside an int list becomes an int in numpy: only then check each value in Python
    slow = b"true" in body or b"false" in body
    max_ids = None
    if token_ids == "openai":
        from .token_ids import OPENAI_MAX_IDS
        max_ids, window = OPENAI_MAX_IDS, None
    if _is_int(inp[0]):
        return [_ids(0, inp, vocab_size, window, slow, max_ids)], True
    if all(isinstance(t, list) for t in inp):
        return [_ids(i, s, vocab_size, window, slow, max_ids) for i, s in enumerate(inp)], True
    kind = str if isinstance(inp[0], str) else (list if isinstance(inp[0], list) else int)
    bad = next(i for i, t in enumerate(inp) if not isinstance(t, kind) or isinstance(t, bool))
    raise ApiError(400, f"'input[{bad}]' is {_json_type(inp[bad])} but 'input[0]' is "
                   f"{_json_type(first)}; send strings, or token ids, not a mix",
                   param="input")


def parse_request(body: bytes, *, model_id: str, hidden: int = 384, max_inputs: int = 2048,
                  token_ids: str = "refuse", vocab_size: int | None = None,
                  window: int | None = None) -> Parsed:
    """Validate a ``/v1/embeddings`` body.

    Args:
        body: the raw request body (UTF-8 JSON).
        model_id: the served model (``model`` may be it or its last path part).
        hidden: the embedding width (``dimensions`` may only equal it).
        max_inputs: most inputs per request.
        token_ids: how token arrays are read (:data:`runtime.serving.token_ids.MODES`):
            ``"refuse"`` answers 400, ``"wordpiece"``/``"openai"`` check them.
        vocab_size: token ids must lie in ``[0, vocab_size)`` (``None``: unchecked).
        window: ids kept per token array (``"wordpiece"``: the model's ``max_seq_length``; the
            model never reads the rest); ``None`` keeps all.
    Returns: a :class:`Parsed`, of size bounded by ``max_inputs * window`` for token arrays.
    Raises: :class:`ApiError` (400, or 404 for another model) for any body that is not a valid
        request: never anything else.
    """
    from .token_ids import refusal

    try:
        req = json.loads(body)
    except (ValueError, RecursionError) as e:      # JSONDecodeError, UnicodeDecodeError, ...
        raise ApiError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(req, dict):
        raise ApiError(400, "the body must be a JSON object with an 'input' field")
    if "input" not in req:
        raise ApiError(400, "'input' is required: a string or a list of strings", param="input")
    raw = req["input"]
    if isinstance(raw, list) and raw and not _is_int(raw[0]) and len(raw) > max_inputs:
        raise ApiError(400, f"{len(raw)} inputs; at most {max_inputs} per request",
                       param="input")
    inputs, ids = _inputs(raw, body, token_ids, vocab_size, window, refusal())
    model = req.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", param="model")
        if model not in (model_id, model_id.rsplit("/", 1)[-1]):
            raise ApiError(404, f"model '{model}' is not served here; this server serves "
                           f"'{model_id}'", param="model", code="model_not_found")
    fmt = req.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, f"'encoding_format' must be 'float' or 'base64', got "
                       f"{str(fmt)[:40]!r}", param="encoding_format")
    dims = req.get("dimensions")
    if dims is not None and (not _is_int(dims) or dims != hidden):
        raise ApiError(400, f"'dimensions' must be {hidden} (this model's width) if given, "
                       f"got {repr(dims)[:40]}", param="dimensions")
    user = req.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, "'user' must be a string", param="user")
    return Parsed(inputs, ids, fmt)


def _parse_in_worker(body: bytes, **limits) -> Parsed:
    """:func:`parse_request`, run in a parse pool worker process (pickled by name)."""
    return parse_request(body, **limits)


_pool = None
_pool_lock = threading.Lock()


def _get_pool():
    """The process's shared parse pool (created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            workers = max(1, min(POOL_WORKERS, os.cpu_count() or 1))
            _pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
            atexit.register(shutdown_pool)
        return _pool


def shutdown_pool() -> None:
    """Stop the parse pool's worker processes (at exit; a later big body starts a new pool)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def _drop_pool(broken) -> None:
    global _pool
    with _pool_lock:
        if _pool is broken:
            _pool = None
    broken.shutdown(wait=False, cancel_futures=True)


async def parse_off_loop(body: bytes, **limits) -> Parsed:
    """:func:`parse_request` without blocking the event loop for more than O(1): in place for
    a body up to :data:`INLINE_BYTES`, else in the parse pool's worker process.

    Raises: :class:`ApiError` (the parser's; 503 ``server_overloaded`` when the worker process
        died, e.g. killed for memory: the pool is replaced for the next request).
    """
    if len(body) <= INLINE_BYTES:
        return parse_request(body, **limits)
    from concurrent.futures.process import BrokenProcessPool
    from functools import partial

    pool = _get_pool()
    try:
        return await asyncio.get_running_loop().run_in_executor(
            pool, partial(_parse_in_worker, body, **limits))
    except BrokenProcessPool:
        _drop_pool(pool)
        raise ApiError(503, "the request parser's worker process died; retry",
                       "server_overloaded", headers={"retry-after": "1"}) from None
