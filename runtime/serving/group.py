"""Several batchers behind one submit: a model per stream, each request to the least loaded
(on the cpu backend: by sequence bucket while the host is busy, else the first;
``route="cpu"``, see below).

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

On a free host the trade goes the other way: one batch at a time gets every core (one call on
OpenBLAS's own threads), batches fuller and reads the weights once per batch, so two half
batches cost more CPU per text. So ``serve`` (two streams by default on cpu:
:func:`runtime.serving.replica.default_streams`) routes a cpu group by the thread rule's view
of the host (``route="cpu"``, :func:`cpu_host_free`): only the first batcher while the process
has its cores to itself (what one stream does), by sequence bucket while busy processes take
cores. ``route="spill"`` (the first until a full batch waits there) remains an option.

By sequence bucket (``route="bucket"``, and ``"cpu"`` on a busy host): a batch holds the texts
of one sequence bucket, so with every request to the least loaded each batcher's queue mixed
all the buckets and a batch took a fifth of it (the serving benchmark's texts of 2-20 tokens
over buckets 8, 12, 16, 20, 24: 7 texts a batch at 64 clients, against sentence-transformers'
15). The batchers take the buckets in turn instead (the i-th to the ``i % N``-th), so each
queue holds half of them: 9-10 texts a batch at 64 clients beside busy processes, more
requests/s in 8 of 10 paired rounds (median +21% in each of two runs) for 2-11% less CPU per
request (issue 30: a paired probe, the two routings alternating in one process every 192
requests beside two busy loops). Only under load (``BUCKET_MIN_LOAD``:
at 8 clients the least loaded kept both streams running side by side, one thread each, and
spent less CPU per request). Balance is kept: an idle batcher takes
the next request whatever its bucket (a free thread starts at once, as with the least loaded),
and a batcher more than ``BUCKET_SLACK * max_batch`` texts ahead of the least loaded gives way
to it. The request is tokenised first (:meth:`Batcher.tokens_of`) to find its bucket.

Within each batcher, batching stays as :class:`Batcher` documents (fair ring, sub-batches of big
requests, cancellation); a request never spans two batchers, so its rows come back in order
from one.
"""

from __future__ import annotations

from .batcher import BatcherClosed

__all__ = ["BatcherGroup", "ROUTES", "cpu_host_free"]

#: the routings :class:`BatcherGroup` knows
ROUTES = ("least", "spill", "cpu", "bucket")
#: ``route="bucket"``: most texts a request's own batcher (by its sequence bucket) may hold
#: beyond the least loaded one before the request goes to the least loaded instead, as a
#: fraction of that batcher's ``max_batch``
BUCKET_SLACK = 0.5
#: ``route="bucket"``: below this many texts queued and running over the group (as a fraction
#: of the first batcher's ``max_batch``) every request goes to the least loaded: a batch then
#: holds what waits anyway, and a lone busy batcher runs its batch dealt out to every core,
#: which costs more CPU per text than two batches side by side (8 clients beside two busy
#: loops: 10.5 against 9.7 ms of CPU per request by bucket, issue 30)
BUCKET_MIN_LOAD = 0.5


def cpu_host_free() -> bool:
    """Whether this process has its cores to itself, as the cpu thread rule last saw it
    (:class:`runtime.cpu_threads.WholeCalls`: one call on OpenBLAS's own threads kept its
    calling thread on a core; beside busy processes it does not, and whole calls are off).
    ``False`` when the rule does not size BLAS (the user's environment fixed it: no whole calls
    to judge by) or whole calls are switched off (``RUNTIME_CPU_WHOLE=0``)."""
    from ..cpu_threads import RULE
    return bool(RULE.adapt_blas and RULE.whole.on)


class BatcherGroup:
    """``N`` started batchers used as one (the attributes the HTTP app, ``serve`` and the
    benchmarks read).

    Args:
        batchers: started :class:`runtime.serving.Batcher` s, each over its own model (same
            weights, buckets and limits; the first one's settings are reported).
        route: ``"least"`` (every request to the least loaded), ``"spill"`` (the first
            batcher until it holds a full batch waiting), ``"bucket"`` (by sequence bucket)
            or ``"cpu"`` (the first while the process has its cores to itself, by sequence
            bucket while busy processes take cores); :meth:`pick`.
        free_host: ``() -> bool`` for ``"cpu"``: whether the process has its cores to itself
            now (default :func:`cpu_host_free`; tests pass a fake).
    Attributes: ``batchers``, ``route``; ``model``, ``hidden``, ``path``, ``max_seq_length``
        and every other setting are the first batcher's.
    Raises: ``ValueError`` (no batchers, two sharing one model: a model runs one batch at a
        time; an unknown ``route``).
    """

    def __init__(self, batchers, route: str = "least", free_host=None):
        self.batchers = list(batchers)
        if not self.batchers:
            raise ValueError("a BatcherGroup needs at least one batcher")
        if len({id(b.model) for b in self.batchers}) != len(self.batchers):
            raise ValueError("each batcher of a group needs a model of its own")
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        self.route = route
        self._free_host = free_host or cpu_host_free

    def pick(self, seq: int = 0):
        """The batcher the next request goes to, among those whose worker runs; ``seq``: the
        request's sequence bucket (:meth:`Batcher.seq_bucket`; 0: unknown).

        ``route="least"``: the one with the least :attr:`Batcher.load` (texts queued plus texts
        in the batch running now); on a tie the first (a lone client stays on one model; a
        second batch goes to the next one while the first runs).

        ``route="spill"``: the first running batcher, even while it runs a batch, unless it
        already holds a full batch waiting (:attr:`Batcher.queued` at least its ``max_batch``):
        then the least loaded. One batch at a time reads the weights once per batch and
        batches fuller: on the cpu backend two half batches cost more CPU per text.

        ``route="cpu"`` (``serve`` on the cpu backend, two streams by default): the first
        running batcher while the process has its cores to itself (``free_host()``: one batch
        at a time gets every core, and serving is what one stream serves: no spill-over, whose
        two half batches side by side cost the quiet 64-client row 15%, 192 against 226
        requests/s, issue 30), the least loaded while busy processes take cores: two
        independent batches on one thread each are two threads always ready to run, where one
        batch dealt out to two threads waits at the end of every kernel for whichever the OS
        is not running (with two busy loops on 2 cores: 1.42 / 1.74 / 1.89x
        sentence-transformers at 1 / 8 / 64 clients on two streams against 1.13 / 1.07 / 0.95
        on one; README, "The cpu backend"), each request by its sequence bucket ``seq`` as
        ``"bucket"`` does (unknown: the least loaded).

        ``route="bucket"``: :meth:`_by_bucket` (``seq`` unknown: the least loaded).

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
        if self.route == "cpu":
            if self._free_host():
                return first
            return self._by_bucket(seq, best) if seq else best
        if self.route == "bucket" and seq:
            return self._by_bucket(seq, best)
        if self.route == "spill" and first.queued < first.max_batch:
            return first
        return best

    def _by_bucket(self, seq: int, best):
        """``route="bucket"``'s choice for a request of sequence bucket ``seq``, ``best`` being
        the least loaded running batcher: ``best`` while the group holds fewer than
        ``BUCKET_MIN_LOAD * max_batch`` texts; else the running batchers take the sequence
        buckets in turn (the i-th bucket of the first's ``seq_buckets`` to the ``i % N``-th),
        unless that one holds more than ``BUCKET_SLACK * max_batch`` texts beyond ``best``, or
        ``best`` is idle while it is not (an idle stream starts at once, as with the least
        loaded)."""
        alive = [b for b in self.batchers if b.alive]
        if not alive or sum(b.load for b in alive) < BUCKET_MIN_LOAD * alive[0].max_batch:
            return best
        sizes = alive[0].seq_buckets
        i = sizes.index(seq) if seq in sizes else seq
        own = alive[i % len(alive)]
        if best.load == 0 and own.load > 0:
            return best
        if own.load - best.load > BUCKET_SLACK * own.max_batch:
            return best
        return own

    def _routes_by_bucket(self) -> bool:
        return self.route == "bucket" or (self.route == "cpu" and not self._free_host())

    def submit(self, texts):
        """:meth:`Batcher.submit` on :meth:`pick`'s batcher (same arguments, result, errors);
        routing by sequence bucket (``"bucket"``, ``"cpu"`` on a busy host), the texts are
        tokenised first (:meth:`Batcher.tokens_of`) to find their bucket."""
        if not self._routes_by_bucket():
            return self.pick().submit(texts)
        b = self.pick()
        ids, mask = b.tokens_of(texts)
        return self.pick(b.seq_bucket(mask)).submit_tokens(ids, mask)

    def submit_ids(self, seqs):
        """:meth:`Batcher.submit_ids` on :meth:`pick`'s batcher (routed as :meth:`submit`)."""
        if not self._routes_by_bucket():
            return self.pick().submit_ids(seqs)
        b = self.pick()
        ids, mask = b.ids_of(seqs)
        return self.pick(b.seq_bucket(mask)).submit_tokens(ids, mask)

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
