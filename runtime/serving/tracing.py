"""OpenTelemetry spans for each embeddings request (``serve --otlp-endpoint URL``).

Per ``POST /v1/embeddings`` request one span ``embeddings`` with children ``parse`` (body to a
validated request), ``tokenize`` (texts to ids, or token arrays to rows), ``queue_wait`` (from
enqueue to its first batch), one ``batch`` per batch that held its texts, with a child
``replay`` / ``capture`` / ``forward`` (the graph replay, a first capture, or eager launches),
and ``respond`` (rows to JSON). The batcher stamps its times (``time.time_ns``) on each request
(:attr:`runtime.serving.Embeddings.timings`); the app opens the batch spans after the fact with
those times, so the batcher's thread never touches OpenTelemetry.

Spans go through ``opentelemetry-api``; with an endpoint, the SDK's ``TracerProvider`` exports
them with its OTLP/HTTP exporter in batches (``BatchSpanProcessor``; ``pip install
'runtime[otel]'``). Without one :class:`Tracing` has no tracer and the app does no tracing work
at all. The provider is this server's own (never the process-wide global), as the metrics'
registry is.
"""

from __future__ import annotations

#: The instrumentation scope name of the spans.
SCOPE = "runtime.serving"


class Tracing:
    """A tracer provider for one server, or nothing.

    Args:
        endpoint: an OTLP/HTTP traces URL (``http://collector:4318/v1/traces``); ``None``: no
            tracing (:attr:`tracer` is ``None``).
        exporter: a span exporter to use instead (tests: the SDK's ``InMemorySpanExporter``,
            exported synchronously by a ``SimpleSpanProcessor``).
        service_name: the ``service.name`` resource attribute.
    Attributes: ``tracer`` (an ``opentelemetry.trace.Tracer`` or ``None``), ``provider``.
    Raises: ``ImportError`` naming the extra when an endpoint is given without the SDK or the
        OTLP exporter installed.
    """

    def __init__(self, endpoint: str | None = None, *, exporter=None,
                 service_name: str = "runtime-embeddings"):
        self.provider = self.tracer = None
        if endpoint is None and exporter is None:
            return
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            if exporter is None:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import \
                    OTLPSpanExporter
        except ImportError as e:
            raise ImportError(f"--otlp-endpoint needs the OpenTelemetry SDK and OTLP exporter "
                              f"(pip install 'runtime[otel]'): {e}") from None
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is None:
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
                endpoint=endpoint)))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer(SCOPE)

    def shutdown(self) -> None:
        """Export what is buffered and stop (idempotent; nothing without a provider)."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = self.tracer = None


def record_batches(tracer, parent, timings) -> None:
    """Children of ``parent`` for the batcher's stamps of one request: ``queue_wait`` and one
    ``batch`` (with its ``replay``/``capture``/``forward`` child) per batch.

    Args: tracer: a ``Tracer``; parent: the request's span; timings: a
        :class:`runtime.serving.batcher.Timings` (``time.time_ns`` stamps).
    """
    from opentelemetry import trace

    if timings is None or not timings.batches:
        return
    ctx = trace.set_span_in_context(parent)
    first = min(b.start_ns for b in timings.batches)
    tracer.start_span("queue_wait", context=ctx, start_time=timings.enqueue_ns).end(first)
    for b in timings.batches:
        span = tracer.start_span("batch", context=ctx, start_time=b.start_ns, attributes={
            "batch.rows": b.rows, "batch.bucket_rows": b.bucket[0],
            "batch.seq_len": b.bucket[1], "batch.padded_tokens": b.bucket[0] * b.bucket[1],
            "batch.request_rows": b.request_rows, "batch.path": b.path})
        tracer.start_span(b.step, context=trace.set_span_in_context(span),
                          start_time=b.start_ns).end(b.end_ns)
        span.end(b.end_ns)
