"""The one wiring path: settings -> model -> batcher -> app, for every process that embeds.

``python -m runtime serve`` (this process), each ``serve --ray`` replica
(:mod:`runtime.serving.ray_serve`), the demo and each corpus embedder
(:class:`runtime.corpus.CorpusEmbedder`) build their batcher with :func:`start_batcher`, and the
servers their app with :class:`Replica`, from one :class:`Settings`: every ``serve`` flag is a
field, so a flag takes the same effect on every path. The batcher is
:class:`runtime.serving.Batcher` over :func:`runtime.serving.load_model` (MiniLM on
``runtime.client(backend)``, that process's one device server); the cpu thread rule's cores come
from :mod:`runtime.cpu_threads`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .batcher import Batcher
from .limits import (BODY_TIMEOUT, GRACE, HEADER_TIMEOUT, MAX_BODY_BYTES, MAX_INPUT_CHARS,
                     MAX_INPUTS)



@dataclass(frozen=True)
class Settings:
    """Every ``serve`` setting (the flags of ``python -m runtime serve``, same names).

    Model and batcher (:func:`start_batcher`): ``backend`` (``"cpu"``, ``"wgpu"``, ``"cuda"``,
    ``None`` = best), ``model_dir``, ``max_graphs`` (bucket graphs held, LRU), ``graph``
    (``False``: eager launches), ``warmup`` (``(batch, seq_len)`` buckets captured at start),
    ``batch_buckets``/``seq_buckets`` (texts; tokens, the last >= 256; ``None``: the defaults
    of :mod:`runtime.models.buckets`), ``max_batch`` (texts), ``max_batch_tokens`` (padded
    tokens per batch), ``max_wait_ms``, ``max_queue`` (texts waiting), ``max_input_chars``
    (characters per text), ``cpu_threads`` (cores the cpu thread rule shares out), ``streams``
    (copies of the model, each on its own stream with its own batcher:
    :class:`runtime.serving.BatcherGroup`; ``None``: :func:`default_streams`).

    App (:func:`runtime.serving.create_app`): ``max_inputs`` (per request), ``max_body_bytes``,
    ``body_timeout`` (s), ``api_key``, ``token_ids`` (``"refuse"``, ``"wordpiece"``,
    ``"openai"``: :mod:`runtime.serving.token_ids`), ``otlp_endpoint`` (OpenTelemetry spans).

    HTTP (:func:`runtime.serving.serve`, or Serve's proxy and deployment with ``--ray``):
    ``host``, ``port``, ``header_timeout`` (s), ``grace`` (s of shutdown grace),
    ``log_level``.
    """

    backend: str | None = "cpu"
    model_dir: str | None = None
    max_graphs: int = 8
    graph: bool = True
    warmup: tuple | None = None
    batch_buckets: tuple | None = None
    seq_buckets: tuple | None = None
    max_batch: int = 32
    max_batch_tokens: int | None = None
    max_wait_ms: float = 2.0
    max_queue: int = 4096
    max_input_chars: int | None = MAX_INPUT_CHARS
    cpu_threads: int | None = None
    streams: int | None = None
    max_inputs: int = MAX_INPUTS
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout: float = BODY_TIMEOUT
    api_key: str | None = None
    token_ids: str = "refuse"
    otlp_endpoint: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    header_timeout: float = HEADER_TIMEOUT
    grace: float = GRACE
    log_level: str = "info"

    def batcher_options(self) -> dict:
        """:func:`start_batcher` keyword arguments."""
        return {k: getattr(self, k) for k in _BATCHER}

    def app_options(self) -> dict:
        """:func:`runtime.serving.create_app` keyword arguments (but the tracer, which
        :class:`Replica` builds from ``otlp_endpoint``)."""
        return {k: getattr(self, k) for k in _APP}

    def public(self) -> dict:
        """The settings without the API key (what ``/health`` reports)."""
        d = dataclasses.asdict(self)
        d["api_key"] = "set" if self.api_key else None
        return d


_BATCHER = ("backend", "model_dir", "max_graphs", "graph", "warmup", "batch_buckets",
            "seq_buckets", "max_batch", "max_batch_tokens", "max_wait_ms", "max_queue",
            "max_input_chars", "cpu_threads", "streams")
_APP = ("max_inputs", "max_body_bytes", "body_timeout", "api_key", "token_ids")


def default_streams(backend: str | None, model=None) -> int:
    """``serve``'s streams when ``--streams`` is not given: 2 on the cpu backend when the thread
    rule shares out at least 2 cores (:data:`runtime.cpu_threads.RULE`) and the model can be
    copied sharing its weights (``model.replica``; ``None``: MiniLM, loaded), else 1.

    Why: the group routes by the host (:class:`runtime.serving.BatcherGroup`, ``route="cpu"``):
    the first batcher alone while the process has its cores to itself (what one stream
    serves), two batches side by side on one thread each while busy processes take cores
    (issue 30: with two busy loops on 2 cores, 1.42 / 1.74 / 1.89x sentence-transformers at 1 /
    8 / 64 clients against 1.13 / 1.07 / 0.95 on one stream). The cost: a second set of bucket
    graphs (the weights are shared).
    """
    from ..cpu_threads import RULE
    if backend not in (None, "cpu") or RULE.cores < 2:
        return 1
    return 2 if model is None or hasattr(model, "replica") else 1


def start_batcher(backend: str | None = "cpu", *, model=None, model_dir=None,
                  max_graphs: int = 8, graph: bool = True, max_batch: int = 32,
                  max_batch_tokens: int | None = None, max_wait_ms: float = 2.0,
                  max_queue: int = 4096, max_input_chars: int | None = None,
                  batch_buckets=None, seq_buckets=None, warmup=None,
                  cpu_threads: int | None = None, streams: int | None = 1, metrics=None,
                  progress: bool = False, **batcher_options):
    """Load all-MiniLM-L6-v2 on this process's device (or take ``model``) and start a batcher.

    Args:
        backend, model_dir, max_graphs: the model (:func:`runtime.serving.load_model`), unless
            ``model`` is given (an already loaded model: the demo runs two batchers on one).
        graph, max_batch, max_batch_tokens, max_wait_ms, max_queue, max_input_chars,
        batch_buckets, seq_buckets: the :class:`Batcher`'s (see :class:`Settings`).
        warmup: ``(batch, seq_len)`` buckets to run now (graph path: captured), or ``None``.
        cpu_threads: on cpu, the cores the thread rule shares out in this process (default:
            ``OMP_NUM_THREADS``, which Ray sets to a worker's ``num_cpus``, else every CPU the
            process may run on).
        metrics: a :class:`runtime.serving.ServingMetrics` to record into (``None``: none).
        streams: copies of the model (``model`` or loaded), each on its own stream of the
            process's device server with its own batcher; more than 1 returns a
            :class:`runtime.serving.BatcherGroup` sending each request to the least loaded
            (on cpu, concurrent batches run one thread each; :mod:`runtime.serving.group`),
            on the cpu backend while the host is busy, by sequence bucket under load
            (``route="cpu"``: on a free host the first batcher only).
            A given ``model`` is the first copy; the others are its replicas
            (``MiniLM.replica``: the same weight buffers, buckets and graphs of their own), or
            loaded from ``model_dir`` for a model without ``replica()``. ``None``:
            :func:`default_streams` (``serve``'s default).
        progress: show the warm-up's progress bar.
        batcher_options: more :class:`Batcher` keywords (``max_padding``, ``exact_shapes``).
    Returns: a started :class:`Batcher`, or a :class:`runtime.serving.BatcherGroup` of
        ``streams`` of them (``close()`` it when done).
    Raises: ``FileNotFoundError`` (no model files); ``UnsupportedError`` (backend missing);
        ``ValueError`` (bad buckets or limits, ``cpu_threads < 1``, ``streams < 1``).
    """
    from ..cpu_threads import RULE
    from . import load_model

    if streams is not None and int(streams) < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    if backend in (None, "cpu") and cpu_threads and model is None:
        RULE.set_cores(cpu_threads)
    if model is None:
        model = load_model(backend, path=model_dir, max_graphs=max_graphs)
    if streams is None:
        streams = default_streams(getattr(getattr(model, "client", None), "backend", backend),
                                  model)
    # the other copies share the first one's weights (MiniLM.replica: no second upload, one
    # copy in the caches); a model without replica() is loaded again
    copy = getattr(model, "replica", None)
    models = [model] + [copy() if copy else load_model(backend, path=model_dir,
                                                      max_graphs=max_graphs)
                        for _ in range(int(streams) - 1)]
    batchers = []
    try:
        for m in models:
            batchers.append(Batcher(
                m, graph=graph, max_batch=max_batch, max_batch_tokens=max_batch_tokens,
                max_wait_ms=max_wait_ms, max_queue=max_queue, max_input_chars=max_input_chars,
                batch_buckets=batch_buckets, seq_buckets=seq_buckets, metrics=metrics,
                **batcher_options))
    except BaseException:
        for b in batchers:
            b.close()
        raise
    if len(batchers) == 1:
        batcher = batchers[0]
    else:
        from .group import BatcherGroup
        on_cpu = getattr(getattr(model, "client", None), "backend", backend) == "cpu"
        batcher = BatcherGroup(batchers, route="cpu" if on_cpu else "least")
    if warmup:
        try:
            batcher.warmup(warmup, progress=progress)
        except BaseException:
            batcher.close()
            raise
    return batcher


class Replica:
    """One server's worth of embedding: metrics, a batcher (:func:`start_batcher`) and the app
    (:func:`runtime.serving.create_app`), all from one :class:`Settings`.

    Args:
        settings: the :class:`Settings`.
        model: an already loaded model to serve instead of loading one (tests, the demo).
        openai_encoding: with ``token_ids="openai"``, the encoding to decode ids with (default:
            :func:`runtime.serving.token_ids.load_openai_encoding`).
        progress: show the warm-up's progress bar.
    Attributes: ``settings``, ``metrics``, ``batcher``, ``app``, ``tracing`` (the
        :class:`runtime.serving.tracing.Tracing` of ``otlp_endpoint``).
    Raises: ``RuntimeError`` (``token_ids="openai"`` without the encoding file: one line);
        what :func:`start_batcher` raises.
    """

    def __init__(self, settings: Settings, *, model=None, openai_encoding=None,
                 progress: bool = False):
        from .app import create_app
        from .metrics import ServingMetrics
        from .tracing import Tracing

        self.settings = settings
        if settings.token_ids == "openai" and openai_encoding is None:
            from .token_ids import load_openai_encoding
            openai_encoding = load_openai_encoding()      # before the model: fail fast
        self.tracing = Tracing(settings.otlp_endpoint)
        self.metrics = ServingMetrics()
        self.batcher = start_batcher(model=model, metrics=self.metrics, progress=progress,
                                     **settings.batcher_options())
        public = settings.public()
        if public["streams"] is None:       # (serve's default, resolved: what runs)
            public["streams"] = len(getattr(self.batcher, "batchers", (self.batcher,)))
        self.app = create_app(self.batcher, metrics=self.metrics,
                              openai_encoding=openai_encoding, tracer=self.tracing.tracer,
                              settings=public, **settings.app_options())

    def close(self, grace: float = 0.0) -> None:
        """Finish queued work for up to ``grace`` seconds, stop the batcher, flush spans."""
        self.batcher.close(timeout=max(10.0, grace + 5.0), grace=grace)
        self.tracing.shutdown()
