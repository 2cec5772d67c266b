"""Prometheus text-format metrics for the embeddings server, with no dependency.

Three kinds, the ones the server needs: :class:`Counter`, :class:`Gauge` and :class:`Histogram`
(cumulative ``le`` buckets, ``_sum``, ``_count``), each optionally labelled. A
:class:`Registry` renders them all in the text exposition format version 0.0.4, which is what
``GET /metrics`` returns. Every update takes one lock, so any thread may record.
"""

from __future__ import annotations

import math
import threading

#: Content type of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Latency buckets in seconds (1 ms .. 60 s).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
#: Batch-size buckets in rows.
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if float(v).is_integer():
        return str(int(v)) if abs(v) < 1e15 else repr(float(v))
    return repr(float(v))


def _labels(names: tuple, values: tuple, extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(s: str) -> str:
    return s.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Metric:
    kind = ""

    def __init__(self, name: str, doc: str, labels: tuple = ()):
        self.name, self.doc, self.labelnames = name, doc, tuple(labels)
        self._lock = threading.Lock()
        self._values: dict = {}

    def _key(self, labels: dict) -> tuple:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list:
        """The ``# HELP`` and ``# TYPE`` lines."""
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing count (``name_total`` by convention).

    Args:
        name: metric name; doc: one-line help; labels: label names (values given to ``inc``).
    """

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels) -> None:
        """Add ``amount`` (>= 0) to the series of ``labels``."""
        if amount < 0:
            raise ValueError("a counter only goes up")
        k = self._key(labels)
        with self._lock:
            self._values[k] = self._values.get(k, 0.0) + amount

    def value(self, **labels) -> float:
        """The current value of one series (0 if never incremented)."""
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list:
        """The ``# HELP``/``# TYPE`` lines and one sample line per series."""
        with self._lock:
            items = sorted(self._values.items())
        if not items and not self.labelnames:
            items = [((), 0.0)]
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_fmt(v)}"
                                for k, v in items]


class Gauge(Counter):
    """A value that goes up and down, or is read from a callback at render time.

    Args:
        name, doc, labels: as :class:`Counter`; fn: optional zero-argument callable giving the
            value of the unlabelled series when rendered.
    """

    kind = "gauge"

    def __init__(self, name: str, doc: str, labels: tuple = (), fn=None):
        super().__init__(name, doc, labels)
        self._fn = fn

    def inc(self, amount: float = 1.0, **labels) -> None:
        """Add ``amount`` (may be negative)."""
        k = self._key(labels)
        with self._lock:
            self._values[k] = self._values.get(k, 0.0) + amount

    def set(self, value: float, **labels) -> None:
        """Set the series of ``labels`` to ``value``."""
        k = self._key(labels)
        with self._lock:
            self._values[k] = float(value)

    def render(self) -> list:
        """As :meth:`Counter.render`, reading ``fn`` first when given."""
        if self._fn is not None:
            self.set(float(self._fn()))
        return super().render()


class Histogram(_Metric):
    """Observations counted into cumulative buckets, with their sum and count.

    Args:
        name, doc, labels: as :class:`Counter`; buckets: increasing upper bounds (``+Inf`` is
            added), in the unit of the observations (seconds for latencies, rows for sizes).
    """

    kind = "histogram"

    def __init__(self, name: str, doc: str, labels: tuple = (), buckets=LATENCY_BUCKETS):
        super().__init__(name, doc, labels)
        self.bounds = tuple(float(b) for b in buckets) + (math.inf,)

    def observe(self, value: float, **labels) -> None:
        """Record one observation in the series of ``labels``."""
        k = self._key(labels)
        with self._lock:
            counts, total = self._values.get(k, ([0] * len(self.bounds), 0.0))
            for i, b in enumerate(self.bounds):
                if value <= b:
                    counts[i] += 1
                    break
            self._values[k] = (counts, total + value)

    def count(self, **labels) -> int:
        """How many observations the series of ``labels`` holds."""
        with self._lock:
            v = self._values.get(self._key(labels))
        return sum(v[0]) if v else 0

    def render(self) -> list:
        """Per series: cumulative ``_bucket{le=...}`` lines, then ``_sum`` and ``_count``."""
        with self._lock:
            items = sorted((k, (list(c), s)) for k, (c, s) in self._values.items())
        if not items and not self.labelnames:
            items = [((), ([0] * len(self.bounds), 0.0))]
        out = self.header()
        for k, (counts, total) in items:
            run = 0
            for b, c in zip(self.bounds, counts):
                run += c
                le = _labels(self.labelnames, k, f'le="{_fmt(b)}"')
                out.append(f"{self.name}_bucket{le} {run}")
            lab = _labels(self.labelnames, k)
            out.append(f"{self.name}_sum{lab} {_fmt(total)}")
            out.append(f"{self.name}_count{lab} {run}")
        return out


class Registry:
    """A named set of metrics rendered together.

    ``counter``/``gauge``/``histogram`` create and register a metric and return it; a name may
    be registered once (``ValueError`` otherwise).
    """

    def __init__(self):
        self._metrics: dict = {}

    def _add(self, m: _Metric):
        if m.name in self._metrics:
            raise ValueError(f"metric {m.name} is already registered")
        self._metrics[m.name] = m
        return m

    def counter(self, name: str, doc: str, labels: tuple = ()) -> Counter:
        """Register a :class:`Counter`."""
        return self._add(Counter(name, doc, labels))

    def gauge(self, name: str, doc: str, labels: tuple = (), fn=None) -> Gauge:
        """Register a :class:`Gauge` (``fn``: read at render time)."""
        return self._add(Gauge(name, doc, labels, fn))

    def histogram(self, name: str, doc: str, labels: tuple = (),
                  buckets=LATENCY_BUCKETS) -> Histogram:
        """Register a :class:`Histogram`."""
        return self._add(Histogram(name, doc, labels, buckets))

    def __getitem__(self, name: str):
        return self._metrics[name]

    def render(self) -> str:
        """All metrics in the Prometheus text format (``CONTENT_TYPE``), newline-terminated."""
        lines = []
        for m in self._metrics.values():
            lines.extend(m.render())
        return "\n".join(lines) + "\n"


class ServingMetrics:
    """The embeddings server's metrics (names prefixed ``runtime_serving_``).

    Attributes (all public, recorded by the batcher and the app):
        requests: counter ``requests_total{code}`` (HTTP status of each embeddings request).
        inputs: counter ``inputs_total`` (texts embedded); tokens: ``tokens_total``.
        batches: counter ``batches_total{path}`` (``path`` = ``graph`` | ``eager``).
        failed_batches: counter ``failed_batches_total{path}``.
        captures: counter ``graph_captures_total``.
        batch_size: histogram ``batch_size{path}`` (real rows per batch, padding excluded).
        padding: histogram ``batch_padding_rows{path}`` (rows added to reach the bucket).
        queue_wait: histogram ``queue_wait_seconds`` (enqueue to start of its batch, per text).
        replay: histogram ``replay_seconds`` (write inputs + replay + read, per graph batch).
        capture: histogram ``capture_seconds`` (first batch of a bucket: warm-up + capture).
        eager: histogram ``eager_seconds`` (eager forward, per batch).
        request: histogram ``request_seconds`` (end-to-end, per HTTP embeddings request).
    """

    def __init__(self, queue_depth=None, graphs=None):
        r = self.registry = Registry()
        p = "runtime_serving_"
        self.requests = r.counter(p + "requests_total", "Embeddings requests by HTTP status.",
                                  ("code",))
        self.inputs = r.counter(p + "inputs_total", "Texts embedded.")
        self.tokens = r.counter(p + "tokens_total", "Tokens embedded (after truncation).")
        self.batches = r.counter(p + "batches_total", "Batches run, by path.", ("path",))
        self.failed_batches = r.counter(p + "failed_batches_total", "Batches that raised.",
                                        ("path",))
        self.captures = r.counter(p + "graph_captures_total", "Bucket graphs captured.")
        self.batch_size = r.histogram(p + "batch_size", "Real rows per batch.", ("path",),
                                      SIZE_BUCKETS)
        self.padding = r.histogram(p + "batch_padding_rows", "Padding rows per batch.",
                                   ("path",), (0,) + SIZE_BUCKETS)
        self.queue_wait = r.histogram(p + "queue_wait_seconds",
                                      "Time a text waited in the queue before its batch ran.")
        self.replay = r.histogram(p + "replay_seconds",
                                  "Write inputs, replay the bucket graph, read the output.")
        self.capture = r.histogram(p + "capture_seconds", "Warm-up and capture of a bucket.")
        self.eager = r.histogram(p + "eager_seconds", "Eager forward of one batch.")
        self.request = r.histogram(p + "request_seconds",
                                   "End-to-end latency of an embeddings request.")
        if queue_depth is not None:
            r.gauge(p + "queue_depth", "Texts waiting for a batch.", fn=queue_depth)
        if graphs is not None:
            r.gauge(p + "graphs", "Bucket graphs currently held.", fn=graphs)

    def render(self) -> str:
        """The text exposition of every metric."""
        return self.registry.render()
