"""Several batchers behind one submit: a model per stream, each request to the least loaded
(on the cpu backend: once the first holds a full batch waiting; ``route="spill"``, see below).

A :class:`BatcherGroup` holds ``N`` :class:`runtime.serving.Batcher` s, each with its own model
(on cpu: its own stream of the process's one device server, its own captured graphs) and its own
worker thread, and sends each request whole to the one with the fewest texts waiting or running
(:attr:`Batcher.load`; on a tie the first, so a lone client keeps one model's weights and graphs
hot). On the cpu backend two batches then run at once, one
per stream, and the thread rule (:mod:`runtime.cpu_threads`: ``cores // stream items executing``)
gives each one thread: whole one-thread BLAS products, no pieces handed between threads, no
thread waiting for a partner. One batch at a time (one client) still gets every core.

Why: beside busy processes a forward split over two threads waits whenever the OS runs one of
them and not the other, and every hand-off between them costs CPU (MiniLM 20x16 on 2 cores:
4.1 ms of CPU per row in pieces on 2 threads against 3.7 ms on two streams of one thread each;
``benchmarks/serving.py --streams 2`` beside two busy processes, 64 clients: 107 against 80
requests/s, 5.5 against 6.6 ms of CPU per request; issue 30, measured before the panel matmul
of :mod:`runtime.kernels.panels` made small pieces cheap); two independent batches keep both
threads busy with no hand-off at all. The cost: a model (weights, ~90 MB for MiniLM, and
graphs) per stream.

The trade goes the other way as long as one batcher keeps up: one batch at a time reads the
weights once per batch and batches fuller, so two half batches cost more CPU per text (``serve
--streams 1`` spent less CPU per request than ``--streams 2`` at 8 and 64 clients, with and
without busy processes). So ``serve`` routes a cpu group by spill-over (``route="spill"``):
the first batcher takes every request until a full batch waits there, the others take the
backlog beyond it.

Within each batcher, batching stays as :class:`Batcher` documents (fair ring, sub-batches of big
requests, cancellation); a request never spans two batchers, so its rows come back in order
from one.
"""

from __future__ import annotations

from .batcher import BatcherClosed

__all__ = ["BatcherGroup", "ROUTES"]

#: the routings :class:`BatcherGroup` knows
ROUTES = ("least", "spill")


class BatcherGroup:
    """``N`` started batchers used as one (the attributes the HTTP app, ``serve`` and the
    benchmarks read).

    Args:
        batchers: started :class:`runtime.serving.Batcher` s, each over its own model (same
            weights, buckets and limits; the first one's settings are reported).
        route: ``"least"`` (every request to the least loaded) or ``"spill"`` (the first
            batcher until it holds a full batch waiting; :meth:`pick`).
    Attributes: ``batchers``, ``route``; ``model``, ``hidden``, ``path``, ``max_seq_length``
        and every other setting are the first batcher's.
    Raises: ``ValueError`` (no batchers, two sharing one model: a model runs one batch at a
        time; an unknown ``route``).
    """

    def __init__(self, batchers, route: str = "least"):
        self.batchers = list(batchers)
        if not self.batchers:
            raise ValueError("a BatcherGroup needs at least one batcher")
        if len({id(b.model) for b in self.batchers}) != len(self.batchers):
            raise ValueError("each batcher of a group needs a model of its own")
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        self.route = route

    def pick(self):
        """The batcher the next request goes to, among those whose worker runs.

        ``route="least"``: the one with the least :attr:`Batcher.load` (texts queued plus texts
        in the batch running now); on a tie the first (a lone client stays on one model; a
        second batch goes to the next one while the first runs).

        ``route="spill"``: the first running batcher, even while it runs a batch, unless it
        already holds a full batch waiting (:attr:`Batcher.queued` at least its ``max_batch``):
        then the least loaded. One batch at a time reads the weights once per batch and
        batches fuller; on the cpu backend two half batches, one thread each, cost more CPU per
        text (``benchmarks/serving.py`` beside two busy processes, 8 and 64 clients: 9.6-11.1
        and 6.1-6.6 ms of CPU per request least-loaded against 9.0 and 5.9 on one stream;
        issue 30), so ``serve --streams N`` spills over on cpu: the other streams take a
        backlog beyond a full batch.

        Raises: :class:`BatcherClosed` (every worker has stopped).
        """
        best = first = None
        for b in self.batchers:
            if b.alive:
                if first is None:
                    first = b
                if best is None or b.load < best.load:
                    best = b
        if best is None:
            raise BatcherClosed("every batcher's worker has stopped")
        if self.route == "spill" and first.queued < first.max_batch:
            return first
        return best

    def submit(self, texts):
        """:meth:`Batcher.submit` on :meth:`pick`'s batcher (same arguments, result, errors)."""
        return self.pick().submit(texts)

    def submit_ids(self, seqs):
        """:meth:`Batcher.submit_ids` on :meth:`pick`'s batcher."""
        return self.pick().submit_ids(seqs)

    def embed(self, texts, timeout: float | None = None):
        """``submit(texts).result(timeout).embeddings``: ``float32 [n, hidden]``. Blocks."""
        return self.submit(texts).result(timeout).embeddings

    def warmup(self, buckets=None, progress: bool = True) -> list:
        """:meth:`Batcher.warmup` on every batcher (each model captures its own graphs);
        returns the first one's buckets."""
        out = None
        for b in self.batchers:
            got = b.warmup(buckets, progress=progress)
            out = got if out is None else out
        return out

    def drain(self, grace: float = 10.0) -> None:
        """:meth:`Batcher.drain` on every batcher."""
        for b in self.batchers:
            b.drain(grace)

    def close(self, timeout: float | None = 10.0, grace: float = 0.0) -> None:
        """:meth:`Batcher.close` on every batcher (each waits up to ``timeout``)."""
        self.drain(grace)
        for b in self.batchers:
            b.close(timeout, grace)

    def __enter__(self) -> "BatcherGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """True while any batcher's worker runs (requests go only to those)."""
        return any(b.alive for b in self.batchers)

    @property
    def queued(self) -> int:
        """Texts submitted and not yet taken into a batch, over every batcher."""
        return sum(b.queued for b in self.batchers)

    @property
    def queued_requests(self) -> int:
        """Requests with texts not yet taken into a batch, over every batcher."""
        return sum(b.queued_requests for b in self.batchers)

    @property
    def load(self) -> int:
        """Texts queued or running, over every batcher."""
        return sum(b.load for b in self.batchers)

    @property
    def batches_run(self) -> int:
        """Batches run, over every batcher."""
        return sum(b.batches_run for b in self.batchers)

    def drain_estimate(self) -> float:
        """Seconds until the texts queued now have run: the slowest batcher's estimate."""
        return max(b.drain_estimate() for b in self.batchers)

    @property
    def metrics(self):
        """The batchers' shared :class:`runtime.serving.ServingMetrics` (setting it sets every
        batcher's)."""
        return self.batchers[0].metrics

    @metrics.setter
    def metrics(self, m) -> None:
        for b in self.batchers:
            b.metrics = m

    def __getattr__(self, name):
        # settings (model, hidden, path, max_seq_length, buckets, limits): the first batcher's
        if name.startswith("__") or name == "batchers":
            raise AttributeError(name)
        return getattr(self.batchers[0], name)
