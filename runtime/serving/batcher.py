"""Fair, bounded dynamic batching of embedding requests from many callers onto one model.

Callers (HTTP handlers, threads) call :meth:`Batcher.submit` with their texts (or
:meth:`Batcher.submit_ids` with token ids) and get a ``concurrent.futures.Future``. Submitting
tokenises on the caller's thread (truncated to the model's ``max_seq_length`` while tokenizing)
and queues the request. One worker thread owns the model and loops:

1. wait for work; once something arrives after an idle period, wait up to ``max_wait_ms`` more
   for company (a burst of simultaneous requests then shares one batch), unless the last
   :data:`LONELY_WAITS` such waits found none (requests that come one at a time: each wait
   only delayed its request; every :data:`LONELY_WAITS`-th idle arrival still waits, to see
   whether company comes again);
2. build the next batch **fairly**: the waiting requests form a ring; the request at its head
   picks the sequence-length bucket (that of its lowest waiting row), then the requests with
   texts of that bucket give one text each, in ring order, round after round, until the row
   cap is reached: ``min(max_batch, the largest batch bucket b with b * seq_len <=
   max_batch_tokens)`` (a padded-token budget, as text-embeddings-inference's
   ``--max-batch-tokens``). A head that led the previous batch moves to the back of the ring
   first when others wait. A big request is thus split into sub-batches interleaved with
   everyone else's: a new request joins the next batch of its sequence bucket, and waits for
   at most one batch per other waiting request;
3. choose the ``(batch, seq_len)`` bucket (:func:`choose_bucket`; with the graph cache full, a
   captured bucket within the token budget is reused, even if that means running fewer texts
   now and the rest in the next batch, rather than capturing and evicting), pad to it, and run
   it through ``model.run_bucket`` (graph path) or ``model.forward`` (eager path, the same
   padded shapes, or with ``exact_shapes`` the batch's own: its texts, padded to its longest);
4. copy each real row to its request; padding rows are dropped before anything is copied. A
   request completes when all of its texts have, and gets its rows in its own order.

Cancelling a request's future (``future.cancel()``, as the HTTP app does when the client
disconnects) drops its texts not yet batched; a batch in flight finishes. A batch that raises
fails every request with a text in it (:class:`BatchFailed`, with the cause) and nothing else.
:meth:`Batcher.drain` (graceful shutdown) refuses new work, finishes what is queued for a grace
period, then fails the rest with :class:`BatcherClosed`.

The model only needs ``tokenize(texts) -> (ids, mask)``, ``run_bucket(batch, seq_len, ids,
mask) -> [b, hidden]``, ``forward(ids, mask, graph=False) -> [b, hidden]``, ``hidden`` and
``max_seq_length``; ``buckets`` (captured buckets), ``max_graphs`` (their bound) and
``encode_ids(seqs) -> (ids, mask)`` (token-id inputs) are used when present.
:class:`runtime.models.MiniLM` has all of them.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as _FutureTimeout   # (3.10: not the builtin)
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .._threads import Condition as _Condition   # SOAK9: a future no interrupt leaves locked
from .._threads import is_alive as _is_alive     # SOAK8: 3.11's is_alive() can lie
from ..models.buckets import BATCH_BUCKETS, SEQ_BUCKETS, bucket_up, choose_bucket

__all__ = ["Batcher", "BatchFailed", "BatcherClosed", "QueueFull", "Embeddings", "Timings",
           "BatchTiming",
           "choose_bucket", "bucket_up"]

#: ``Batcher(max_padding="auto")`` for a model on the cpu backend: at most a quarter of a
#: bucket's rows padding. From MiniLM's forward on 2 cores at 16 tokens, about 13 ms a forward
#: plus 4.3 ms a row (``benchmarks/minilm_forward.py``: 1x16 16.1 ms, 8x16 47.2, 32x16 151):
#: 20 texts as 16 + 4 cost ~112 ms against ~150 as 32, while 3 texts padded to 4 (30 ms) beat
#: 2 + 1 (39 ms). End to end with dense buckets the difference was within the noise
#: (``benchmarks/serving.py --max-padding auto|none``, README "Serving against ...").
CPU_MAX_PADDING = 0.25
_STOP = object()


class BatchFailed(RuntimeError):
    """The batch holding one of the request's texts raised; ``cause`` is what it raised."""

    def __init__(self, cause: BaseException, bucket):
        super().__init__(f"batch {bucket} failed: {type(cause).__name__}: {cause}")
        self.cause, self.bucket = cause, bucket


class BatcherClosed(RuntimeError):
    """The batcher was closed (or its worker stopped) before the request ran; also what a
    forked child's wait on a request its parent had pending raises (no worker there answers
    it)."""


class QueueFull(RuntimeError):
    """More than ``max_queue`` texts are waiting; retry later.

    ``retry_after`` is the queue's drain estimate in seconds (:meth:`Batcher.drain_estimate`).
    """

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = float(retry_after)


class BatchTiming(NamedTuple):
    """One batch that held texts of a request (``time.time_ns`` stamps, for tracing).

    Attributes: bucket: ``(batch, seq_len)`` run; rows: real rows of the batch; request_rows:
        this request's rows in it; path: ``"graph"``/``"eager"``; step: ``"replay"``,
        ``"capture"`` (a bucket's first graph batch) or ``"forward"`` (eager); start_ns, end_ns.
    """

    bucket: tuple
    rows: int
    request_rows: int
    path: str
    step: str
    start_ns: int
    end_ns: int


class Timings(NamedTuple):
    """When a request was queued and the batches that ran it (``time.time_ns``)."""

    enqueue_ns: int
    batches: tuple


class Embeddings(NamedTuple):
    """The answer to one :meth:`Batcher.submit`.

    Attributes:
        embeddings: ``float32 [n, hidden]``, row ``i`` for text ``i`` (unit L2 norm for MiniLM).
        tokens: ``int64 [n]``, tokens fed to the model per text (special tokens included, after
            truncation).
        timings: a :class:`Timings` (enqueue and batch stamps), or ``None`` for no texts.
    """

    embeddings: np.ndarray
    tokens: np.ndarray
    timings: Timings | None = None


class _Request:
    """One submit: its future, output rows, and its texts not yet batched (by seq bucket)."""

    def __init__(self, n: int, hidden: int, tokens: np.ndarray):
        self.future: Future = Future()
        # SOAK9: Future's own Condition enters its lock through Python: a caller interrupted
        # there (Ctrl-C in ``embed``) left it owned, and the worker's answer to any request
        # then waited for it for ever; this one enters in C
        self.future._condition = _Condition()
        self.out = np.zeros((n, hidden), np.float32)
        self.tokens = tokens
        self.left = n                            # rows not yet computed
        self.lock = threading.Lock()
        self.pending: dict = {}                  # seq bucket -> deque of _Item, lowest row first
        self.n_pending = 0
        self.enqueue_ns = 0
        self.batches: list = []                  # BatchTiming of each batch with its rows

    def add(self, item: "_Item", front: bool = False) -> None:
        q = self.pending.setdefault(item.seq, deque())
        q.appendleft(item) if front else q.append(item)
        self.n_pending += 1

    def first_seq(self) -> int:
        """The seq bucket of the lowest waiting row."""
        return min(self.pending.items(), key=lambda kv: kv[1][0].row)[0]

    def pop(self, seq: int) -> "_Item":
        q = self.pending[seq]
        it = q.popleft()
        if not q:
            del self.pending[seq]
        self.n_pending -= 1
        return it

    def done_rows(self, k: int) -> None:
        with self.lock:
            self.left -= k
            finished = self.left == 0
        if finished:
            timings = Timings(self.enqueue_ns, tuple(self.batches))
            self._settle(lambda f: f.set_result(Embeddings(self.out, self.tokens, timings)))

    def fail(self, exc: BaseException) -> None:
        self._settle(lambda f: f.set_exception(exc))

    def _settle(self, how) -> None:
        with self.lock:
            if not self.future.done():
                try:
                    how(self.future)
                except InvalidStateError:        # cancelled by the caller meanwhile
                    pass


#: requests not answered yet (weak: an answered one leaves); a forked child fails them
_UNSETTLED: "weakref.WeakSet[_Request]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # only the forking thread comes along: no batcher worker will ever answer a request the
    # parent had pending, so a wait on its future here would never end
    for req in list(_UNSETTLED):
        req.lock = threading.Lock()         # (a parent thread may have held these)
        req.future._condition = _Condition()
        req.fail(BatcherClosed("this process was forked while the request was pending: only "
                               "the parent's batcher worker could answer it; submit it again "
                               "to a batcher made in this process"))
    _UNSETTLED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: seconds between :meth:`Batcher.embed`'s checks that the worker still runs while it waits
WAIT_POLL_S = 0.5


#: company waits in a row (``max_wait_ms`` after an idle period) that found no other request,
#: after which a batcher's worker runs a request arriving at an idle batcher at once, waiting
#: again only every ``LONELY_WAITS``-th time (to notice a burst coming back) and as soon as one
#: finds company. Requests that come one at a time (a lone client) gained nothing from the
#: wait: the serving benchmark at 1 client, the two alternating in one process, 12.8 against
#: 14.9 ms p50 (issue 30); bursts (many clients) keep finding company and keep the wait.
LONELY_WAITS = 4


def _worker(ref, q) -> None:
    """The batcher worker's thread: waits on the queue ``q`` holding only a weak reference
    ``ref`` to its :class:`Batcher`, which it holds while it has work (``Batcher._loop``). A
    batcher dropped without ``close()`` puts a stop on ``q`` as it is collected: the thread ends.
    An exception ending the thread outside ``_loop`` (an asynchronous one aimed at it landing
    in ``q.get()``) fails the request it took and every queued one with
    :class:`BatcherClosed` (SOAK9: the request taken, then lost, was never answered; its
    caller's ``embed`` waited for ever)."""
    ring: deque = deque()                       # requests with texts waiting, in turn order
    got = None
    try:
        while True:
            got = None
            got = q.get()
            b = ref()
            if b is None:                       # dropped: nothing else can be queued (a
                return                          # submit holds the batcher)
            try:
                if b._loop(ring, got):
                    return
            finally:
                b = None
    except BaseException as e:  # noqa: BLE001 - re-raised: the thread ends
        b = ref()
        if b is not None:
            b._worker_died(ring, got, e)
        raise


@dataclass
class _Item:
    ids: np.ndarray            # int32 [length], one text's tokens
    req: _Request
    row: int                   # its row in req.out
    t_enqueue: float
    seq: int                   # its sequence bucket


class Batcher:
    """Fair, bounded batching of texts from concurrent callers into padded buckets for a model.

    Args:
        model: the model (see the module docstring); ``runtime.models.MiniLM``.
        graph: ``True`` runs buckets through their captured graphs (``model.run_bucket``),
            ``False`` through eager launches (``model.forward``) on the same padded shapes.
        max_batch: most texts per batch (capped by the largest batch bucket).
        max_batch_tokens: most padded tokens per batch (``batch bucket * seq_len bucket``);
            default ``max_batch * 256``. Must hold one text of the longest sequence bucket.
        max_wait_ms: how long the worker waits for more work once the first text of an idle
            period arrives (milliseconds; ``0`` runs at once), while such waits find company
            (:data:`LONELY_WAITS`). Texts that arrive while a batch runs never wait for this.
        max_queue: most texts waiting; :meth:`submit` beyond it raises :class:`QueueFull`.
        max_input_chars: most characters per text (:meth:`submit` raises ``ValueError``
            naming ``input[i]`` beyond it); ``None``: any length (the tokenizer reads only a
            bounded prefix of a long text anyway).
        batch_buckets, seq_buckets: the bucket sizes (texts, tokens), increasing; default the
            model's (``BATCH_BUCKETS``/``SEQ_BUCKETS``).
        metrics: a :class:`runtime.serving.metrics.ServingMetrics` to record into, or ``None``.
        max_padding: the largest fraction of a padded batch's rows that may be padding
            (:func:`choose_bucket`): more, and the batch runs as the largest bucket its texts
            fill, the rest waiting for the next batch. ``None``: any padding. ``"auto"``
            (default): :data:`CPU_MAX_PADDING` for a model on the cpu backend (a padding row
            costs as much as a real one there), ``None`` elsewhere (a GPU runs a fuller bucket
            in about the same time, so splitting would only add a dispatch).
        exact_shapes: eager path only: run each batch at its own shape (its texts, padded to
            its longest text) instead of the bucket's, for models whose cost follows the shape
            and that need no fixed shapes (sentence-transformers pads to the longest text in a
            batch, as ``SentenceTransformer.encode`` does). Buckets still choose which texts
            form a batch.
        start: start the worker thread now (else call :meth:`start`; texts submitted before
            then wait in the queue).

    Raises: ``ValueError`` (``exact_shapes`` with ``graph=True``; ``max_padding`` outside
        ``[0, 1)``; buckets not increasing, the largest seq bucket below the model's
        ``max_seq_length``, a token budget that cannot hold one longest text).

    Thread-safe: any thread may :meth:`submit`. The model is used from the worker thread only
    (and by :meth:`warmup`, which the model's own lock serialises with it). The worker holds
    the batcher only while it has work: a batcher dropped without :meth:`close` (its requests
    answered) is collected, and its worker thread ends and its model goes with it.
    """

    def __init__(self, model, *, graph: bool = True, max_batch: int = 32,
                 max_batch_tokens: int | None = None, max_wait_ms: float = 2.0,
                 max_queue: int = 4096, max_input_chars: int | None = None,
                 batch_buckets=None, seq_buckets=None, metrics=None,
                 max_padding="auto", exact_shapes: bool = False, start: bool = True):
        self.model = model
        self.graph = bool(graph)
        if exact_shapes and self.graph:
            raise ValueError("exact_shapes needs graph=False: a replayed graph has its "
                             "bucket's fixed shape")
        self.exact_shapes = bool(exact_shapes)
        if isinstance(max_padding, str) and max_padding == "auto":
            client = getattr(model, "client", None)
            max_padding = CPU_MAX_PADDING if getattr(client, "backend", None) == "cpu" else None
        if max_padding is not None and not 0 <= float(max_padding) < 1:
            raise ValueError(f"max_padding={max_padding!r} must be in [0, 1), \"auto\" or None")
        self.max_padding = None if max_padding is None or self.exact_shapes else float(max_padding)
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
        longest = bucket_up(self.max_seq_length, self.seq_buckets)
        self.max_batch_tokens = int(max_batch_tokens if max_batch_tokens is not None
                                    else self.max_batch * longest)
        if self.max_batch_tokens < self.batch_buckets[0] * longest:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} cannot hold one text of "
                             f"{longest} tokens in the smallest batch bucket "
                             f"{self.batch_buckets[0]}")
        self.max_wait = max(0.0, float(max_wait_ms)) / 1000.0
        self.max_queue = int(max_queue)
        if self.max_queue < 1 or (max_input_chars is not None and int(max_input_chars) < 1):
            raise ValueError(f"max_queue and max_input_chars must be >= 1, got {max_queue}, "
                             f"{max_input_chars}")
        self.max_input_chars = None if max_input_chars is None else int(max_input_chars)
        self.metrics = metrics
        self.hidden = int(model.hidden)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0                     # texts submitted and not yet taken into a batch
        self._queued_requests = 0            # requests with texts not yet taken
        self._count_lock = threading.Lock()
        self._requests = weakref.WeakSet()  # requests not answered yet (_worker_died fails them)
        self._worker_done = False           # the worker thread ended (_worker_ended)
        self._closed = False
        self._deadline = 0.0                 # perf_counter time after which queued work fails
        self._thread = None
        self._inflight: list = []           # the batch running now (its requests)
        self._running = 0                   # its texts, until their rows are copied out
        self._s_per_text = None              # running estimate of compute seconds per text
        self._last_head = None               # the request that led the last batch
        self._lonely = 0                     # company waits in a row that found nobody
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
            once to ``[0, hidden]``. ``future.cancel()`` drops the texts not yet batched.
            Tokenising runs on the calling thread; nothing else blocks.
        Raises: ``TypeError`` (not strings); ``ValueError`` naming ``input[i]``: the first text
            over ``max_input_chars``, or the first the tokenizer refuses (e.g. a lone UTF-16
            surrogate); :class:`QueueFull`; :class:`BatcherClosed`. (The one place texts are
            checked: the HTTP app, the Ray replicas and the corpus embedders all submit here,
            or call :meth:`tokens_of`.)
        """
        return self._enqueue(*self.tokens_of(texts))

    def tokens_of(self, texts) -> tuple:
        """``(ids, mask)`` of ``texts`` as :meth:`submit` checks and tokenises them (on the
        calling thread), without queueing: :meth:`submit_tokens` queues them, here or on another
        batcher over the same model (:class:`runtime.serving.BatcherGroup` routes by their
        sequence bucket, :meth:`seq_bucket`).

        Raises: as :meth:`submit` (but :class:`QueueFull`)."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a string or a list of strings")
        self._check_open()
        for i, t in enumerate(texts):
            if self.max_input_chars is not None and len(t) > self.max_input_chars:
                raise ValueError(f"'input[{i}]' has {len(t)} characters; at most "
                                 f"{self.max_input_chars} (the model reads only its first "
                                 f"{self.max_seq_length} tokens)")
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"'input[{i}]' is not valid Unicode: it holds a lone UTF-16 "
                                 "surrogate") from None
        if not texts:
            return np.zeros((0, 0), np.int64), np.zeros((0, 0), np.int64)
        try:
            return self.model.tokenize(list(texts))
        except Exception as e:  # noqa: BLE001 - tokenizers raise plain Exception
            raise ValueError(self._bad_text(texts, e)) from None

    def submit_tokens(self, ids, mask) -> Future:
        """Queue texts tokenised by :meth:`tokens_of` or :meth:`ids_of` (of a batcher over the
        same model). Returns and raises as :meth:`submit`."""
        self._check_open()
        return self._enqueue(ids, mask)

    def seq_bucket(self, mask) -> int:
        """The sequence bucket (tokens) of the longest text of a request's ``mask`` (``[n,
        L]``; 0 for no texts): the bucket its batch runs at."""
        mask = np.asarray(mask)
        if not mask.size:
            return 0
        return bucket_up(max(int(mask.sum(axis=1).max()), 1), self.seq_buckets)

    def submit_ids(self, seqs) -> Future:
        """Queue token-id inputs: one list of the model's token ids per text.

        Args:
            seqs: a list of lists of ints, made by the model's own tokenizer (with or without
                ``[CLS]``/``[SEP]``: the model's ``encode_ids`` adds them and truncates).
        Returns: as :meth:`submit`.
        Raises: ``ValueError`` (an id outside the model's vocabulary, naming ``input[i]``; or
            a model without ``encode_ids``); ``TypeError``; :class:`QueueFull`;
            :class:`BatcherClosed`.
        """
        return self._enqueue(*self.ids_of(seqs))

    def ids_of(self, seqs) -> tuple:
        """``(ids, mask)`` of token-id inputs as :meth:`submit_ids` checks them, without queueing
        (:meth:`submit_tokens`). Raises: as :meth:`submit_ids` (but :class:`QueueFull`)."""
        enc = getattr(self.model, "encode_ids", None)
        if enc is None:
            raise ValueError("this model does not take token-id inputs; send strings")
        self._check_open()
        return enc(list(seqs))

    def _bad_text(self, texts, err: BaseException) -> str:
        """The message for a text the tokenizer refused: which one, and why."""
        for i, t in enumerate(texts):
            try:
                t.encode("utf-8")
                self.model.tokenize([t])
            except Exception as e:  # noqa: BLE001
                why = ("it is not valid Unicode (a lone UTF-16 surrogate?)"
                       if isinstance(e, UnicodeError) else f"the tokenizer refused it ({e})")
                return f"input[{i}] cannot be tokenized: {why}"
        return f"the texts cannot be tokenized: {err}"

    def _check_open(self) -> None:
        if self._closed or self._worker_done or (self._thread is not None
                                                 and not _is_alive(self._thread)):
            if not self._closed and getattr(self, "_pid", None) not in (None, os.getpid()):
                raise BatcherClosed(f"this batcher was started in process {self._pid}, which "
                                    "forked this one: its worker stays in the parent; make a "
                                    "new batcher in this process (README 'Fork and spawn')")
            raise BatcherClosed("the batcher is closed" if self._closed else
                                "the batcher's worker stopped")

    def _enqueue(self, ids, mask) -> Future:
        ids, mask = np.asarray(ids), np.asarray(mask)
        n = ids.shape[0]
        lengths = mask.sum(axis=1).astype(np.int64)
        req = _Request(n, self.hidden, lengths)
        if n == 0:
            req.future.set_result(Embeddings(req.out, req.tokens))
            return req.future
        if lengths.max() > self.max_seq_length:   # the model's tokenizer already truncates
            raise ValueError(f"tokenize gave {lengths.max()} tokens, more than the model's "
                             f"max_seq_length {self.max_seq_length}")
        if n > self.max_queue:                    # it could never be admitted: not a retry
            raise ValueError(f"{n} texts in one request, more than the server ever queues "
                             f"(max_queue={self.max_queue}); send at most {self.max_queue} "
                             "texts per request")
        now = time.perf_counter()
        req.enqueue_ns = time.time_ns()
        for i in range(n):
            L = int(lengths[i])
            req.add(_Item(ids[i, :L].astype(np.int32), req, i, now,
                          bucket_up(max(L, 1), self.seq_buckets)))
        _UNSETTLED.add(req)
        self._requests.add(req)
        with self._count_lock:
            if self._queued + n > self.max_queue:
                raise QueueFull(f"{self._queued} texts are waiting (max_queue={self.max_queue}); "
                                "retry later", self.drain_estimate())
            # SOAK9: counted and queued with no point between where an asynchronous exception
            # can land (a Ctrl-C there counted texts nobody queued: QueueFull for good)
            self._queued += n
            self._queued_requests += 1
            self._q.put(req)
        if self._worker_done or (self._closed and self._thread is not None
                                 and not _is_alive(self._thread)):
            req.fail(BatcherClosed("the batcher closed before this request ran"))  # raced close
        if self.metrics is not None:
            self.metrics.inputs.inc(n)
            self.metrics.tokens.inc(float(lengths.sum()))
        return req.future

    def embed(self, texts, timeout: float | None = None) -> np.ndarray:
        """``submit(texts).result(timeout).embeddings``: ``float32 [n, hidden]``. Blocks (at
        most ``timeout`` seconds; ``None``: until answered). Raises as :meth:`submit`'s
        future, and :class:`BatcherClosed` when the worker thread ended without answering
        (checked every :data:`WAIT_POLL_S` seconds of the wait: a worker that died before it
        took the request, SOAK9), never waiting for ever on a dead worker."""
        fut = self.submit(texts)
        end = None if timeout is None else time.monotonic() + float(timeout)
        while True:
            left = WAIT_POLL_S if end is None else min(WAIT_POLL_S, end - time.monotonic())
            try:
                return fut.result(max(0.0, left)).embeddings
            except _FutureTimeout:
                if end is not None and time.monotonic() >= end:
                    raise
                t = self._thread
                if t is not None and not _is_alive(t) and not fut.done():
                    try:
                        fut.set_exception(BatcherClosed("the batcher's worker stopped before "
                                                        "it answered this request"))
                    except InvalidStateError:   # answered or cancelled meanwhile
                        pass

    def warmup(self, buckets=None, progress: bool = True) -> list:
        """Run each bucket once now, so later batches find it ready (graph path: captured).

        Args:
            buckets: ``(batch, seq_len)`` pairs; default every pair of the bucket lists, as many
                as ``model.max_graphs`` allows (the smallest ones), captured largest first (the
                model's graph pool then serves the others from its buffers); a given list runs
                in its order.
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
            if self.graph:              # largest first: the model's graph pool then serves
                buckets.sort(key=lambda p: (-p[0] * p[1], p))  # the others (issue 26)
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
            # the worker holds the batcher only while it has work (SOAK7): one dropped without
            # close() is collected, its finalizer's stop ends the worker, and its model goes
            self._thread = threading.Thread(target=_worker, args=(weakref.ref(self), self._q),
                                            name="serving-batcher", daemon=True)
            self._pid = os.getpid()             # (a forked child has no worker: _check_open)
            weakref.finalize(self, self._q.put, _STOP)
            self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the worker thread runs."""
        return self._thread is not None and _is_alive(self._thread)

    @property
    def queued(self) -> int:
        """Texts submitted and not yet taken into a batch."""
        return self._queued

    @property
    def queued_requests(self) -> int:
        """Requests with texts not yet taken into a batch."""
        return self._queued_requests

    @property
    def load(self) -> int:
        """Texts queued plus texts in the batch running now (what
        :class:`runtime.serving.group.BatcherGroup` balances)."""
        return self._queued + self._running

    def drain_estimate(self) -> float:
        """Seconds until the texts queued now have run, from the measured compute time per text
        (running average over recent batches); ``1.0`` before any batch ran."""
        if self._s_per_text is None:
            return 1.0
        return self._queued * self._s_per_text

    def drain(self, grace: float = 10.0) -> None:
        """Begin a graceful stop and return at once (safe in a signal handler): new submits
        raise :class:`BatcherClosed`; the worker keeps running queued texts for up to ``grace``
        seconds, then fails what is left with :class:`BatcherClosed` and exits. Idempotent
        (a later call can only shorten the grace period)."""
        deadline = time.perf_counter() + max(0.0, float(grace))
        if self._closed:
            self._deadline = min(self._deadline, deadline)
            return
        self._deadline = deadline
        self._closed = True
        self._q.put(_STOP)
        if self._thread is None:                  # never started: fail what was queued
            self._fail_queued(deque())

    def close(self, timeout: float | None = 10.0, grace: float = 0.0) -> None:
        """Stop taking work and wait for the worker (up to ``timeout`` seconds): queued texts
        run for up to ``grace`` seconds (:meth:`drain`), the batch in flight finishes, the rest
        fails with :class:`BatcherClosed`. Idempotent."""
        self.drain(grace)
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "Batcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _loop(self, ring: deque, got) -> bool:
        """The worker, from ``got`` (just taken off the queue) until the ``ring`` of requests
        with texts waiting is empty (False: idle) or the batcher stopped (True)."""
        try:
            stop = self._serve(ring, got)
        except BaseException as e:  # noqa: BLE001 - a bug here must not strand the waiters
            self._closed = True                   # submits refuse from now on
            err = BatcherClosed(f"the batcher's worker stopped ({type(e).__name__}: {e})")
            for it in self._inflight:
                it.req.fail(err)
            self._fail_queued(ring, err)
            raise
        if stop:
            self._fail_queued(ring)
            self._worker_ended()
        return stop

    def _worker_ended(self) -> None:
        """The worker thread is ending (stopped, or died: :meth:`_worker_died`): fail every request not answered yet with
        :class:`BatcherClosed`. A submit racing the end adds its request to ``_requests``
        before it looks at ``_worker_done`` and this sets the flag before it looks at
        ``_requests``: one of the two fails it, so no future is left that nothing will ever
        answer (``submit(...).result()`` without a timeout waited for ever on a request queued
        as the worker died: SOAK9's open item)."""
        self._worker_done = True
        err = BatcherClosed("the batcher's worker ended before this request ran")
        for req in list(self._requests):
            req.fail(err)

    def _worker_died(self, ring: deque, got, exc: BaseException) -> None:
        """The worker thread ends on ``exc``: refuse submits, fail ``got`` (the request it had
        taken, unless answered), the ring and the queue with :class:`BatcherClosed`."""
        self._closed = True
        err = BatcherClosed(f"the batcher's worker stopped ({type(exc).__name__}: {exc})")
        if isinstance(got, _Request) and got not in ring and not got.future.done():
            ring.append(got)
        for it in self._inflight:
            it.req.fail(err)
        self._fail_queued(ring, err)
        for req in list(self._requests):    # (one taken off the queue and lost with ``exc``)
            req.fail(err)
        with self._count_lock:              # nothing runs any more
            self._queued = self._queued_requests = 0
        self._worker_ended()

    def _serve(self, ring: deque, got) -> bool:
        stop = got is _STOP
        if not stop:
            ring.append(got)
            stop = self._company(ring)
        while True:
            stop = self._admit(ring) or stop
            self._sweep(ring)
            if stop and (not ring or time.perf_counter() >= self._deadline):
                return True
            if ring:
                self._run(self._take(ring), ring)
            elif not stop:
                return False                    # idle: the worker waits without the batcher

    def _company(self, ring: deque) -> bool:
        """After an idle period: wait up to ``max_wait`` for more requests, unless the last
        :data:`LONELY_WAITS` waits found none (but every ``LONELY_WAITS``-th). True on stop."""
        lonely = self._lonely
        if lonely >= LONELY_WAITS and lonely % LONELY_WAITS:
            self._lonely = lonely + 1           # requests come one at a time: run at once
            return False
        had = len(ring)
        try:
            return self._wait_company(ring)
        finally:
            self._lonely = 0 if len(ring) > had else lonely + 1

    def _wait_company(self, ring: deque) -> bool:
        deadline = time.perf_counter() + self.max_wait
        while sum(r.n_pending for r in ring) < self.max_batch:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                got = self._q.get(timeout=left)
            except queue.Empty:
                break
            if got is _STOP:
                return True
            ring.append(got)
        return False

    def _admit(self, ring: deque) -> bool:
        """Move every submitted request into the ring (no waiting). True on stop."""
        stop = False
        while True:
            try:
                got = self._q.get_nowait()
            except queue.Empty:
                return stop
            if got is _STOP:
                stop = True
            else:
                ring.append(got)

    def _sweep(self, ring: deque) -> None:
        """Drop requests whose future is done (cancelled by the caller, or failed)."""
        if all(not r.future.done() for r in ring):
            return
        keep = [r for r in ring if not r.future.done()]
        gone = [r for r in ring if r.future.done()]
        dropped = sum(r.n_pending for r in gone)
        cancelled = sum(r.n_pending for r in gone if r.future.cancelled())
        ring.clear()
        ring.extend(keep)
        for r in gone:
            r.pending.clear()
            r.n_pending = 0
        self._uncount(dropped, len(gone))
        if self.metrics is not None and cancelled:
            self.metrics.cancelled.inc(cancelled)

    def _fail_queued(self, ring: deque, closed=None) -> None:
        closed = closed or BatcherClosed("the batcher closed before this request ran")
        while True:
            try:
                got = self._q.get_nowait()
            except queue.Empty:
                break
            if got is not _STOP:
                ring.append(got)
        self._uncount(sum(r.n_pending for r in ring), len(ring))
        for r in ring:
            r.fail(closed)
        ring.clear()

    def row_cap(self, seq_len: int) -> int:
        """Most texts in one batch of sequence bucket ``seq_len``: ``min(max_batch, the largest
        batch bucket b with b * seq_len <= max_batch_tokens)`` (at least 1)."""
        fit = [b for b in self.batch_buckets if b * seq_len <= self.max_batch_tokens]
        return max(1, min(self.max_batch, fit[-1] if fit else 1))

    def _take(self, ring: deque) -> list:
        """The next batch: the head request picks the seq bucket; requests holding texts of it
        give one each, in ring order, round after round, up to the row cap. A head that led
        the previous batch first moves to the back of the ring when others wait."""
        if len(ring) > 1 and ring[0] is self._last_head:
            ring.rotate(-1)
        self._last_head = ring[0]
        seq = ring[0].first_seq()
        cap = self.row_cap(seq)
        batch: list = []
        active = [r for r in ring if seq in r.pending]
        while active and len(batch) < cap:
            nxt = []
            for r in active:
                if len(batch) >= cap:
                    break
                batch.append(r.pop(seq))
                if seq in r.pending:
                    nxt.append(r)
            active = nxt
        emptied = [r for r in ring if not r.n_pending]
        for r in emptied:
            ring.remove(r)
        self._uncount(len(batch), len(emptied))
        return batch

    def _uncount(self, texts: int, requests: int = 0) -> None:
        if texts or requests:
            with self._count_lock:
                self._queued -= texts
                self._queued_requests -= requests

    def _put_back(self, items: list, ring: deque) -> None:
        """Texts a smaller bucket could not take: back to the front of their requests, and
        those requests back at the head of the ring."""
        back = []
        for it in reversed(items):
            r = it.req
            if not r.n_pending and r not in back:
                back.append(r)
            r.add(it, front=True)
        for r in back:
            ring.appendleft(r)
        self._uncount(-len(items), -len(back))

    def _forward(self, B: int, S: int, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One padded batch through the chosen path; returns only the real rows."""
        n = ids.shape[0]
        if self.graph:
            return self.model.run_bucket(B, S, ids, mask)[:n]
        if self.exact_shapes:
            return self.model.forward(ids, mask, graph=False)
        pad_ids = np.zeros((B, S), np.int32)
        pad_mask = np.zeros((B, S), np.int32)
        pad_ids[:n, :ids.shape[1]] = ids
        pad_mask[:n, :mask.shape[1]] = mask
        return self.model.forward(pad_ids, pad_mask, graph=False)[:n]

    def _run(self, batch: list, ring: deque) -> None:
        """Run one batch (texts a smaller captured bucket cannot take go back to the ring)."""
        L = max(len(it.ids) for it in batch)
        m = self.metrics
        captured = list(getattr(self.model, "buckets", ())) if self.graph else []
        bucket = choose_bucket(len(batch), L, self.batch_buckets, self.seq_buckets, captured,
                               getattr(self.model, "max_graphs", None) if self.graph else None,
                               self.max_batch_tokens, self.max_padding)
        B, S = bucket
        if len(batch) > B:
            self._put_back(batch[B:], ring)
            batch = batch[:B]
        n = len(batch)
        L = max(len(it.ids) for it in batch)
        ids = np.zeros((n, L), np.int32)
        mask = np.zeros((n, L), np.int32)
        for r, it in enumerate(batch):
            ids[r, :len(it.ids)] = it.ids
            mask[r, :len(it.ids)] = 1
        self._inflight = batch                    # failed by _loop if the worker dies
        self._running = n                         # (load)
        t0 = time.perf_counter()
        t0_ns = time.time_ns()
        if m is not None:
            for it in batch:
                m.queue_wait.observe(t0 - it.t_enqueue)
        try:
            out = np.asarray(self._forward(B, S, ids, mask), dtype=np.float32)
            if out.shape != (n, self.hidden):
                raise RuntimeError(f"the model returned shape {out.shape} for {n} rows, "
                                   f"expected {(n, self.hidden)}")
        except Exception as e:  # noqa: BLE001 - fails this batch's requests, not the worker
            self._running = 0
            self.last_error = e
            if m is not None:
                m.failed_batches.labels(path=self.path).inc()
            err = BatchFailed(e, bucket)
            for it in batch:
                it.req.fail(err)
            return
        dt = time.perf_counter() - t0
        t1_ns = time.time_ns()
        per = dt / n
        self._s_per_text = per if self._s_per_text is None else 0.8 * self._s_per_text + 0.2 * per
        self.batches_run += 1
        if m is not None:
            m.batches.labels(path=self.path).inc()
            m.batch_size.labels(path=self.path).observe(n)
            m.padding.labels(path=self.path).observe(0 if self.exact_shapes else B - n)
            m.padded_tokens.labels(path=self.path).observe(
                n * L if self.exact_shapes else B * S)
            if not self.graph:
                m.eager.observe(dt)
            elif bucket in captured:
                m.replay.observe(dt)
            else:
                m.capture.observe(dt)
                m.captures.inc()
        for r, it in enumerate(batch):           # row r is this text's; rows >= n never copied
            it.req.out[it.row] = out[r]
        self._running = 0                         # before any caller hears of it
        done: dict = {}
        for it in batch:
            done[id(it.req)] = (it.req, done.get(id(it.req), (None, 0))[1] + 1)
        step = ("forward" if not self.graph else "replay" if bucket in captured else "capture")
        for req, k in done.values():
            req.batches.append(BatchTiming(bucket, n, k, self.path, step, t0_ns, t1_ns))
            req.done_rows(k)
