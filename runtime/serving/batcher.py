"""Dynamic batching of embedding requests from many concurrent callers onto one model.

Callers (HTTP handlers, threads) call :meth:`Batcher.submit` with their texts and get a
``concurrent.futures.Future``. Submitting tokenises the texts on the caller's thread (truncated
to the model's ``max_seq_length`` exactly as the model does) and queues one item per text. One
worker thread owns the model and loops:

1. wait for work; once something arrives, wait up to ``max_wait_ms`` more for company (a burst
   of simultaneous requests then shares one batch), then take everything queued;
2. pick the oldest waiting text, and with it up to ``max_batch`` waiting texts of the same
   sequence-length bucket, in arrival order;
3. choose the ``(batch, seq_len)`` bucket (:func:`choose_bucket`; with the graph cache full,
   a captured bucket is reused, even if that means running fewer texts now and the rest in the
   next batch, rather than capturing and evicting), pad to it, and run it through
   ``model.run_bucket`` (graph path: inputs written in place, the bucket's graph replayed and the
   output read, all on the model's capture stream; the first batch of a bucket captures it) or
   ``model.forward`` (eager path: the same padded shapes, kernels launched one by one);
4. copy each real row to its request; padding rows are dropped before anything is copied. A
   request completes when all of its texts have, and gets its rows in its own order.

A batch that raises fails every request with a text in it (:class:`BatchFailed`, with the cause)
and nothing else; the worker goes on with the next batch.

The model only needs ``tokenize(texts) -> (ids, mask)``, ``run_bucket(batch, seq_len, ids,
mask) -> [b, hidden]``, ``forward(ids, mask, graph=False) -> [b, hidden]``, ``hidden`` and
``max_seq_length``; ``buckets`` (captured buckets) and ``max_graphs`` (their bound) are used when
present. :class:`runtime.models.MiniLM` has all of them.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

__all__ = ["Batcher", "BatchFailed", "BatcherClosed", "QueueFull", "Embeddings",
           "choose_bucket", "bucket_up"]

#: Default sequence-length buckets (tokens), as ``runtime.models.minilm.SEQ_BUCKETS``.
SEQ_BUCKETS = (16, 32, 64, 128, 256)
#: Default batch-size buckets (texts), as ``runtime.models.minilm.BATCH_BUCKETS``.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
_STOP = object()


class BatchFailed(RuntimeError):
    """The batch holding one of the request's texts raised; ``cause`` is what it raised."""

    def __init__(self, cause: BaseException, bucket):
        super().__init__(f"batch {bucket} failed: {type(cause).__name__}: {cause}")
        self.cause, self.bucket = cause, bucket


class BatcherClosed(RuntimeError):
    """The batcher was closed (or its worker stopped) before the request ran."""


class QueueFull(RuntimeError):
    """More than ``max_queue`` texts are waiting; retry later."""


class Embeddings(NamedTuple):
    """The answer to one :meth:`Batcher.submit`.

    Attributes:
        embeddings: ``float32 [n, hidden]``, row ``i`` for text ``i`` (unit L2 norm for MiniLM).
        tokens: ``int64 [n]``, tokens fed to the model per text (special tokens included, after
            truncation).
    """

    embeddings: np.ndarray
    tokens: np.ndarray


def bucket_up(n: int, sizes) -> int:
    """The smallest size in ``sizes`` (increasing) that is ``>= n``.

    Raises: ``ValueError`` when ``n`` exceeds the largest.
    """
    for s in sizes:
        if n <= s:
            return int(s)
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


def choose_bucket(n: int, length: int, batch_buckets, seq_buckets, captured=(),
                  max_graphs=None) -> tuple:
    """The ``(batch, seq_len)`` bucket for the next ``n`` texts of at most ``length`` tokens.

    The exact bucket (each size rounded up to its list) when it is already captured or there is
    room for one more graph (``len(captured) < max_graphs``, or no bound). When the bound is
    reached, the cache is not churned (a capture costs about two forwards, and would evict a
    bucket that is likely needed again):

    1. the smallest captured bucket (fewest ``batch * seq_len`` cells) that holds all ``n``;
    2. else the captured bucket with ``seq_len >= length`` and the most rows: it runs only its
       first ``batch`` texts (``batch < n``; the caller keeps the rest for the next batch);
    3. else the exact bucket (the model then evicts its least recently used graph).

    Args:
        n: texts waiting (``1 <= n <= max(batch_buckets)``); length: the longest, in tokens.
        batch_buckets, seq_buckets: increasing sizes; captured: ``(batch, seq_len)`` pairs held.
        max_graphs: the bound on held graphs, or ``None``.
    Returns: ``(batch, seq_len)``; ``batch`` may be below ``n`` (case 2 only).
    Raises: ``ValueError`` when ``n`` or ``length`` exceeds the largest bucket.
    """
    exact = (bucket_up(n, batch_buckets), bucket_up(max(length, 1), seq_buckets))
    captured = list(captured)
    if exact in captured or max_graphs is None or len(captured) < max_graphs:
        return exact
    fits = [b for b in captured if b[0] >= n and b[1] >= length]
    if fits:
        return min(fits, key=lambda b: (b[0] * b[1], b))
    part = [b for b in captured if b[1] >= length]
    if part:
        return max(part, key=lambda b: (b[0], -b[1]))
    return exact


class _Request:
    """One submit: its future, output rows, and how many texts are still out."""

    def __init__(self, n: int, hidden: int, tokens: np.ndarray):
        self.future: Future = Future()
        self.out = np.zeros((n, hidden), np.float32)
        self.tokens = tokens
        self.left = n
        self.lock = threading.Lock()

    def done_rows(self, k: int) -> None:
        with self.lock:
            self.left -= k
            finished = self.left == 0
        if finished and not self.future.done():
            self.future.set_result(Embeddings(self.out, self.tokens))

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if not self.future.done():
                self.future.set_exception(exc)


@dataclass
class _Item:
    ids: np.ndarray            # int32 [length], one text's tokens
    req: _Request
    row: int                   # its row in req.out
    t_enqueue: float
    seq: int = field(default=0)  # its sequence bucket


class Batcher:
    """Groups texts from concurrent callers into padded ``(batch, seq_len)`` buckets for a model.

    Args:
        model: the model (see the module docstring); ``runtime.models.MiniLM``.
        graph: ``True`` runs buckets through their captured graphs (``model.run_bucket``),
            ``False`` through eager launches (``model.forward``) on the same padded shapes.
        max_batch: most texts per batch (capped by the largest batch bucket).
        max_wait_ms: how long the worker waits for more work once the first text of an idle
            period arrives (milliseconds; ``0`` runs at once). Texts that arrive while a batch
            runs never wait for this.
        max_queue: most texts waiting; :meth:`submit` beyond it raises :class:`QueueFull`.
        batch_buckets, seq_buckets: the bucket sizes (texts, tokens), increasing; default the
            model's (``BATCH_BUCKETS``/``SEQ_BUCKETS``).
        metrics: a :class:`runtime.serving.metrics.ServingMetrics` to record into, or ``None``.
        start: start the worker thread now (else call :meth:`start`; texts submitted before
            then wait in the queue).

    Thread-safe: any thread may :meth:`submit`. The model is used from the worker thread only
    (and by :meth:`warmup`, which the model's own lock serialises with it).
    """

    def __init__(self, model, *, graph: bool = True, max_batch: int = 32,
                 max_wait_ms: float = 2.0, max_queue: int = 4096, batch_buckets=None,
                 seq_buckets=None, metrics=None, start: bool = True):
        self.model = model
        self.graph = bool(graph)
        self.path = "graph" if self.graph else "eager"
        self.batch_buckets = tuple(batch_buckets or BATCH_BUCKETS)
        self.seq_buckets = tuple(seq_buckets or SEQ_BUCKETS)
        if list(self.batch_buckets) != sorted(set(self.batch_buckets)) or \
                list(self.seq_buckets) != sorted(set(self.seq_buckets)):
            raise ValueError("bucket sizes must be strictly increasing")
        self.max_seq_length = int(getattr(model, "max_seq_length", self.seq_buckets[-1]))
        if self.seq_buckets[-1] < self.max_seq_length:
            raise ValueError(f"the largest sequence bucket {self.seq_buckets[-1]} is below the "
                             f"model's max_seq_length {self.max_seq_length}")
        self.max_batch = max(1, min(int(max_batch), self.batch_buckets[-1]))
        self.max_wait = max(0.0, float(max_wait_ms)) / 1000.0
        self.max_queue = int(max_queue)
        self.metrics = metrics
        self.hidden = int(model.hidden)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0                     # texts submitted and not yet taken into a batch
        self._count_lock = threading.Lock()
        self._closed = False
        self._thread = None
        self.batches_run = 0
        self.last_error = None
        if start:
            self.start()

    # -- callers ----------------------------------------------------------------------------
    def submit(self, texts) -> Future:
        """Queue texts for embedding.

        Args:
            texts: a string or a list/tuple of strings (``""`` is valid: ``[CLS] [SEP]``).
                Longer than ``max_seq_length`` tokens: truncated on the right, keeping
                ``[SEP]``, as the model does.
        Returns: a ``Future`` resolving to :class:`Embeddings` (rows in the order of ``texts``),
            or raising :class:`BatchFailed` (a batch holding one of the texts raised; the
            others' batches are unaffected) or :class:`BatcherClosed`. An empty list resolves at
            once to ``[0, hidden]``. Tokenising runs on the calling thread; nothing else blocks.
        Raises: ``TypeError`` (not strings); :class:`QueueFull`; :class:`BatcherClosed`.
        """
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a string or a list of strings")
        if self._closed or (self._thread is not None and not self._thread.is_alive()):
            raise BatcherClosed("the batcher is closed" if self._closed else
                                "the batcher's worker stopped")
        n = len(texts)
        if n == 0:
            req = _Request(0, self.hidden, np.zeros(0, np.int64))
            req.future.set_result(Embeddings(req.out, req.tokens))
            return req.future
        ids, mask = self.model.tokenize(list(texts))
        ids, mask = np.asarray(ids), np.asarray(mask)
        lengths = mask.sum(axis=1).astype(np.int64)
        if lengths.max() > self.max_seq_length:   # the model's tokenizer already truncates
            raise ValueError(f"tokenize gave {lengths.max()} tokens, more than the model's "
                             f"max_seq_length {self.max_seq_length}")
        with self._count_lock:
            if self._queued + n > self.max_queue:
                raise QueueFull(f"{self._queued} texts are waiting (max_queue={self.max_queue}); "
                                "retry later")
            self._queued += n
        req = _Request(n, self.hidden, lengths)
        now = time.perf_counter()
        items = []
        for i in range(n):
            L = int(lengths[i])
            items.append(_Item(ids[i, :L].astype(np.int32), req, i, now,
                               bucket_up(max(L, 1), self.seq_buckets)))
        self._q.put(items)
        if self._closed and self._thread is not None and not self._thread.is_alive():
            req.fail(BatcherClosed("the batcher closed before this request ran"))  # raced close
        if self.metrics is not None:
            self.metrics.inputs.inc(n)
            self.metrics.tokens.inc(float(lengths.sum()))
        return req.future

    def embed(self, texts, timeout: float | None = None) -> np.ndarray:
        """``submit(texts).result(timeout).embeddings``: ``float32 [n, hidden]``. Blocks."""
        return self.submit(texts).result(timeout).embeddings

    def warmup(self, buckets=None, progress: bool = True) -> list:
        """Run each bucket once now, so later batches find it ready (graph path: captured).

        Args:
            buckets: ``(batch, seq_len)`` pairs; default every pair of the bucket lists, as many
                as ``model.max_graphs`` allows (small ones first).
            progress: show a ``tqdm`` progress bar on stderr (if tqdm is installed).
        Returns: the buckets run, in order.
        Raises: ``ValueError`` (more buckets than ``model.max_graphs`` on the graph path, or a
            size outside the bucket lists); the model's errors.
        """
        limit = getattr(self.model, "max_graphs", None)
        if buckets is None:
            buckets = sorted(((b, s) for b in self.batch_buckets for s in self.seq_buckets),
                             key=lambda p: (p[0] * p[1], p))
            if limit is not None:
                buckets = buckets[:limit]
        buckets = [(int(b), int(s)) for b, s in buckets]
        for b, s in buckets:
            if b not in self.batch_buckets or s not in self.seq_buckets:
                raise ValueError(f"bucket ({b}, {s}) is not in batch {self.batch_buckets} x "
                                 f"seq {self.seq_buckets}")
        if self.graph and limit is not None and len(buckets) > limit:
            raise ValueError(f"{len(buckets)} buckets to capture but model.max_graphs={limit}; "
                             "the first ones would be evicted")
        it = buckets
        if progress:
            try:
                from tqdm import tqdm
                it = tqdm(buckets, desc="capturing graphs" if self.graph else "warming up",
                          unit="bucket", disable=None)   # None: no bar when not a terminal
            except ImportError:
                pass
        for b, s in it:
            ids = np.zeros((b, s), np.int32)
            ids[:, 0], ids[:, -1] = 101, 102
            mask = np.ones((b, s), np.int32)
            fresh = (b, s) not in list(getattr(self.model, "buckets", ()))
            t0 = time.perf_counter()
            self._forward(b, s, ids, mask)
            if self.metrics is not None and self.graph and fresh:
                self.metrics.capture.observe(time.perf_counter() - t0)
                self.metrics.captures.inc()
        return buckets

    # -- worker -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="serving-batcher",
                                            daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the worker thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def queued(self) -> int:
        """Texts submitted and not yet taken into a batch."""
        return self._queued

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop taking work; the worker finishes the batch it is in, then fails every text still
        queued with :class:`BatcherClosed` and exits. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._q.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
        else:                                     # never started: fail what was queued
            self._fail_queued([])

    def __enter__(self) -> "Batcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _loop(self) -> None:
        pending: list = []
        stop = False
        while not stop:
            if not pending:
                got = self._q.get()
                if got is _STOP:
                    break
                pending.extend(got)
                deadline = time.perf_counter() + self.max_wait
                while len(pending) < self.max_batch:      # a burst shares one batch
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    try:
                        got = self._q.get(timeout=left)
                    except queue.Empty:
                        break
                    if got is _STOP:
                        stop = True
                        break
                    pending.extend(got)
            while not stop:                               # everything else that is here
                try:
                    got = self._q.get_nowait()
                except queue.Empty:
                    break
                if got is _STOP:
                    stop = True
                else:
                    pending.extend(got)
            if stop:
                break
            batch, pending = self._take(pending)
            if batch:
                pending[:0] = self._run(batch)       # rows a smaller bucket could not take
        self._fail_queued(pending)

    def _fail_queued(self, pending: list) -> None:
        closed = BatcherClosed("the batcher closed before this request ran")
        while True:
            try:
                got = self._q.get_nowait()
            except queue.Empty:
                break
            if got is not _STOP:
                pending.extend(got)
        for it in pending:
            it.req.fail(closed)

    def _take(self, pending: list) -> tuple:
        """Split off the next batch: the oldest live text and the next ones of its seq bucket."""
        live = [it for it in pending if not it.req.future.done()]
        dropped = len(pending) - len(live)
        if not live:
            self._uncount(dropped)
            return [], []
        seq = live[0].seq
        batch, rest = [], []
        for it in live:
            (batch if it.seq == seq and len(batch) < self.max_batch else rest).append(it)
        self._uncount(dropped + len(batch))
        return batch, rest

    def _uncount(self, k: int) -> None:
        if k:
            with self._count_lock:
                self._queued -= k

    def _forward(self, B: int, S: int, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One padded batch through the chosen path; returns only the real rows."""
        n = ids.shape[0]
        if self.graph:
            return self.model.run_bucket(B, S, ids, mask)[:n]
        pad_ids = np.zeros((B, S), np.int32)
        pad_mask = np.zeros((B, S), np.int32)
        pad_ids[:n, :ids.shape[1]] = ids
        pad_mask[:n, :mask.shape[1]] = mask
        return self.model.forward(pad_ids, pad_mask, graph=False)[:n]

    def _run(self, batch: list) -> list:
        """Run one batch; returns the texts left over for the next one (oldest first)."""
        L = max(len(it.ids) for it in batch)
        m = self.metrics
        captured = list(getattr(self.model, "buckets", ())) if self.graph else []
        bucket = choose_bucket(len(batch), L, self.batch_buckets, self.seq_buckets, captured,
                               getattr(self.model, "max_graphs", None) if self.graph else None)
        B, S = bucket
        left = batch[B:]
        if left:
            batch = batch[:B]
            self._uncount(-len(left))                # back in the queue
        n = len(batch)
        L = max(len(it.ids) for it in batch)
        ids = np.zeros((n, L), np.int32)
        mask = np.zeros((n, L), np.int32)
        for r, it in enumerate(batch):
            ids[r, :len(it.ids)] = it.ids
            mask[r, :len(it.ids)] = 1
        t0 = time.perf_counter()
        if m is not None:
            for it in batch:
                m.queue_wait.observe(t0 - it.t_enqueue)
        try:
            out = np.asarray(self._forward(B, S, ids, mask), dtype=np.float32)
            if out.shape != (n, self.hidden):
                raise RuntimeError(f"the model returned shape {out.shape} for {n} rows, "
                                   f"expected {(n, self.hidden)}")
        except Exception as e:  # noqa: BLE001 - fails this batch's requests, not the worker
            self.last_error = e
            if m is not None:
                m.failed_batches.inc(path=self.path)
            err = BatchFailed(e, bucket)
            for it in batch:
                it.req.fail(err)
            return left
        dt = time.perf_counter() - t0
        self.batches_run += 1
        if m is not None:
            m.batches.inc(path=self.path)
            m.batch_size.observe(n, path=self.path)
            m.padding.observe(B - n, path=self.path)
            if not self.graph:
                m.eager.observe(dt)
            elif bucket in captured:
                m.replay.observe(dt)
            else:
                m.capture.observe(dt)
                m.captures.inc()
        for r, it in enumerate(batch):           # row r is this text's; rows >= n never copied
            it.req.out[it.row] = out[r]
        done: dict = {}
        for it in batch:
            done[id(it.req)] = (it.req, done.get(id(it.req), (None, 0))[1] + 1)
        for req, k in done.values():
            req.done_rows(k)
        return left
