"""The embeddings server's Prometheus metrics, on ``prometheus-client``.

Each :class:`ServingMetrics` owns its own ``prometheus_client.CollectorRegistry`` (never the
process-wide default), so several servers, tests or Ray replicas in one process keep separate
counts. ``GET /metrics`` returns :meth:`ServingMetrics.render` with :data:`CONTENT_TYPE`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

#: Content type of the text exposition format (``prometheus_client.CONTENT_TYPE_LATEST``).
CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Latency buckets in seconds (1 ms .. 60 s).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
#: Batch-size buckets in rows.
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
#: Token-count buckets (padded tokens per batch, tokens per request).
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 65536, 262144)
#: Prefix of every metric name.
PREFIX = "runtime_serving_"


class ServingMetrics:
    """The embeddings server's metrics (names prefixed ``runtime_serving_``).

    Attributes (``prometheus_client`` metrics, recorded by the batcher and the app):
        registry: this instance's ``CollectorRegistry``.
        requests: counter ``requests_total{code}`` (HTTP status of each embeddings request;
            ``499`` when the client disconnected before its answer, as nginx counts it).
        inputs: counter ``inputs_total`` (texts embedded); tokens: ``tokens_total``.
        batches: counter ``batches_total{path}`` (``path`` = ``graph`` | ``eager``).
        failed_batches: counter ``failed_batches_total{path}``.
        cancelled: counter ``cancelled_inputs_total`` (texts dropped before their batch ran,
            because their request was cancelled).
        captures: counter ``graph_captures_total``.
        batch_size: histogram ``batch_size{path}`` (real rows per batch, padding excluded).
        padding: histogram ``batch_padding_rows{path}`` (rows added to reach the bucket).
        padded_tokens: histogram ``batch_padded_tokens{path}`` (rows x sequence length run per
            batch, padding included: the work the device did).
        request_tokens: histogram ``request_tokens`` (tokens fed to the model per HTTP
            embeddings request, after truncation).
        queue_wait: histogram ``queue_wait_seconds`` (enqueue to start of its batch, per text).
        replay: histogram ``replay_seconds`` (write inputs + replay + read, per graph batch).
        capture: histogram ``capture_seconds`` (first batch of a bucket: warm-up + capture).
        eager: histogram ``eager_seconds`` (eager forward, per batch).
        request: histogram ``request_seconds`` (end-to-end, per HTTP embeddings request).

    Gauges read at scrape time are added with :meth:`watch` (``create_app`` adds
    ``queue_depth`` (texts waiting), ``queue_requests`` (requests waiting) and ``graphs``
    (bucket graphs held)). ``queue_depth``/``graphs`` may also be given here as callables.
    """

    def __init__(self, queue_depth=None, graphs=None):
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = PREFIX
        self.requests = Counter(p + "requests_total", "Embeddings requests by HTTP status.",
                                ("code",), registry=r)
        self.inputs = Counter(p + "inputs_total", "Texts embedded.", registry=r)
        self.tokens = Counter(p + "tokens_total", "Tokens embedded (after truncation).",
                              registry=r)
        self.batches = Counter(p + "batches_total", "Batches run, by path.", ("path",),
                               registry=r)
        self.failed_batches = Counter(p + "failed_batches_total", "Batches that raised.",
                                      ("path",), registry=r)
        self.cancelled = Counter(p + "cancelled_inputs_total",
                                 "Texts dropped unbatched because their request was cancelled.",
                                 registry=r)
        self.captures = Counter(p + "graph_captures_total", "Bucket graphs captured.",
                                registry=r)
        self.batch_size = Histogram(p + "batch_size", "Real rows per batch.", ("path",),
                                    buckets=SIZE_BUCKETS, registry=r)
        self.padding = Histogram(p + "batch_padding_rows", "Padding rows per batch.", ("path",),
                                 buckets=(0,) + SIZE_BUCKETS, registry=r)
        self.padded_tokens = Histogram(p + "batch_padded_tokens",
                                       "Padded tokens per batch (bucket rows x sequence bucket).",
                                       ("path",), buckets=TOKEN_BUCKETS, registry=r)
        self.request_tokens = Histogram(p + "request_tokens",
                                        "Tokens fed to the model per embeddings request.",
                                        buckets=TOKEN_BUCKETS, registry=r)
        self.queue_wait = Histogram(p + "queue_wait_seconds",
                                    "Time a text waited in the queue before its batch ran.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.replay = Histogram(p + "replay_seconds",
                                "Write inputs, replay the bucket graph, read the output.",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.capture = Histogram(p + "capture_seconds", "Warm-up and capture of a bucket.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.eager = Histogram(p + "eager_seconds", "Eager forward of one batch.",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.request = Histogram(p + "request_seconds",
                                 "End-to-end latency of an embeddings request.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self._watched: dict = {}
        if queue_depth is not None:
            self.watch("queue_depth", "Texts waiting for a batch.", queue_depth)
        if graphs is not None:
            self.watch("graphs", "Bucket graphs currently held.", graphs)

    def watch(self, name: str, doc: str, fn) -> None:
        """Add (or re-point) gauge ``runtime_serving_<name>``, read from ``fn()`` at scrape time.

        Args:
            name: the suffix after ``runtime_serving_``; doc: its help line;
            fn: a zero-argument callable returning a number.
        """
        g = self._watched.get(name)
        if g is None:
            g = self._watched[name] = Gauge(PREFIX + name, doc, registry=self.registry)
        g.set_function(lambda: float(fn()))

    def value(self, name: str, **labels) -> float:
        """The current value of sample ``runtime_serving_<name>`` with ``labels`` (0 if absent).

        E.g. ``value("graph_captures_total")``, ``value("requests_total", code="499")``,
        ``value("batch_size_count", path="graph")``.
        """
        v = self.registry.get_sample_value(PREFIX + name, labels or None)
        return 0.0 if v is None else float(v)

    def render(self) -> str:
        """Every metric in the Prometheus text format (``prometheus_client.generate_latest``)."""
        return generate_latest(self.registry).decode("utf-8")
