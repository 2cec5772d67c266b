"""The cpu thread rule: how many threads the library pools inside a cpu kernel get.

A leaf module: it imports nothing from ``runtime`` (the cpu backend, the kernels and serving
import it), so the rule, the BLAS settings and the fan-out pool are written once.

A cpu stream's kernels run one after another on one worker thread (:mod:`runtime.backends.cpu`);
inside a kernel, numpy's matmuls fan out into OpenBLAS's thread pool and the compiled loops of
:mod:`runtime.kernels.cpu_loops` into numba's (OpenMP) pool. Two pools and several workers on
few cores fight unless something decides who gets the cores. The rule:

    library threads = max(1, cores // stream items executing now)

counted process-wide (every cpu backend of the process), re-applied whenever that count changes:
OpenBLAS's thread count is one number per process (``openblas_set_num_threads``, set through
threadpoolctl's library controller), numba's is per calling thread (``numba.set_num_threads``,
applied by each kernel before its loops run). So one busy stream (one model forward at a time: a
batcher, a benchmark) gets every core in both pools, two busy streams on two cores one thread
each, with no pool waiting on a thread another worker holds. OpenBLAS runs a call from a
1-thread setting on the calling thread, so concurrent streams do not queue on its pool.

A kernel made of many small products (attention: two [S, hd] x [hd, S]-sized GEMMs per sequence
and head) instead deals its pieces out to its threads itself, each piece with 1-thread BLAS and
numba (:class:`FanOutPool`, :meth:`ThreadRule.fan_out`), as torch's CPU attention runs
single-threaded GEMMs in a parallel loop: measured on 2 cores, attention of 32x128 tokens (12
heads of 32) took 23 ms that way against 44 ms with each small GEMM split over OpenBLAS's 2
threads.

numba's OpenMP pool is told to sleep as soon as a parallel region ends (``OMP_WAIT_POLICY=PASSIVE``
while :mod:`runtime.kernels.cpu_loops` starts the pool, unless the variable is already set):
GNU OpenMP's default spins for a while after each region, and a forward alternates OpenMP loops
with OpenBLAS calls, so the spinning threads took the cores OpenBLAS's threads needed: MiniLM
8x128 with both pools at 2 threads ran at 1.4 sentences/s spinning against 25.2 passive
(``benchmarks/minilm_forward.py --variant``). The rule before this one (both pools at 1 thread,
parallelism from streams only) reached 0.67-0.81x sentence-transformers on the batch-32 and
128-token rows (README, "The cpu backend: kernels and threads").

What the user sets wins: ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS``/``MKL_NUM_THREADS``
(:data:`BLAS_ENV`) fix BLAS (the rule leaves it alone), ``NUMBA_NUM_THREADS`` caps numba's pool,
``runtime.client("cpu", threads=n)`` sets ``cores`` (e.g. a Ray replica's ``num_cpus``), and
``blas_threads=n`` (fixed) or ``None`` (untouched) takes BLAS out of the rule.
"""

from __future__ import annotations

import contextlib
import os
import threading

#: the environment variables that fix numpy's BLAS thread count (the user's setting wins)
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def blas_fixed_by_user() -> bool:
    """Whether the environment fixes BLAS's thread count (any of :data:`BLAS_ENV` set)."""
    return any(os.environ.get(v) for v in BLAS_ENV)


def available_cores() -> int:
    """The cores the thread rule shares out by default: ``OMP_NUM_THREADS`` when it is set to a
    positive integer (as torch reads it; Ray sets it to a worker's ``num_cpus``), else the CPUs
    this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        omp = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        omp = 0
    if omp >= 1:
        return omp
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def limit_blas_threads(n: int = 1, force: bool = False) -> int | None:
    """Cap numpy's BLAS (OpenBLAS) at ``n`` threads for this process, unless the user chose.

    A fixed count, outside the thread rule (which sizes BLAS itself while cpu streams execute;
    ``runtime.client("cpu", blas_threads=n)`` fixes it through this).

    Args:
        n: threads (>= 1).
        force: apply even when one of :data:`BLAS_ENV` is set (otherwise the user's setting
            wins and nothing is done).
    Returns: the previous thread count (pass it back, with ``force=True``, to restore), or
        ``None`` when skipped, when no BLAS was found or ``threadpoolctl`` is missing.
    """
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        return None
    if not force and blas_fixed_by_user():
        return None
    prev = max((i.get("num_threads", 1) for i in threadpool_info() if i.get("user_api") == "blas"),
               default=None)
    if prev is not None and prev != n:
        threadpool_limits(int(n), user_api="blas")
    return prev


class ThreadRule:
    """Counts the cpu stream items executing now and sizes the library pools from that count.

    One per process (:data:`RULE`), since OpenBLAS's setting is process-wide. Thread-safe.

    Attributes:
        cores: the cores the rule shares out (default :func:`available_cores`).
        active: stream items executing now (every cpu backend of the process).
        adapt_blas: whether the rule sets OpenBLAS's thread count (``False`` when the user's
            environment fixes it, or after :meth:`fix_blas`).
    """

    def __init__(self, cores: int | None = None):
        self.cores = cores or available_cores()
        self.active = 0
        self.fan_outs = 0                 # kernels running pieces on several threads now
        self.adapt_blas = not blas_fixed_by_user()
        self._lock = threading.Lock()
        self._blas = None                 # threadpoolctl controllers of the BLAS libraries
        self._blas_now = None             # the count last given to them

    def threads(self) -> int:
        """Library threads a kernel starting now gets: ``max(1, cores // max(1, active))``."""
        return max(1, self.cores // max(1, self.active))

    def enter(self) -> None:
        """A stream item starts executing (the cpu backend calls it around each item)."""
        with self._lock:
            self.active += 1
            if self.adapt_blas:
                self._apply_blas()

    def exit(self) -> None:
        """The item :meth:`enter` announced has finished (raised or not)."""
        with self._lock:
            self.active -= 1
            if self.adapt_blas:
                self._apply_blas()

    @contextlib.contextmanager
    def fan_out(self):
        """While a kernel runs its own pieces on several threads (each calling BLAS), OpenBLAS
        gets one thread: small products split across a pool cost more in hand-offs than they
        gain, and OpenBLAS queues concurrent callers on its pool (attention, in
        :mod:`runtime.kernels.nn`, runs each sequence's two small products this way through
        :class:`FanOutPool`, as torch's CPU attention runs single-threaded GEMMs in a parallel
        loop)."""
        with self._lock:
            self.fan_outs += 1
            if self.adapt_blas:
                self._apply_blas()
        try:
            yield
        finally:
            with self._lock:
                self.fan_outs -= 1
                if self.adapt_blas:
                    self._apply_blas()

    def pin_blas(self, n: int = 1) -> None:
        """Fix OpenBLAS at ``n`` threads from now on, outside the rule (unless the user's
        environment fixes it), as ``OPENBLAS_NUM_THREADS=n`` would; numba's loops and
        attention's pieces still use the rule's threads. Serving does not need it: measured on
        2 cores with 64 closed-loop HTTP clients, pinned at 1 served 98-107 requests/s against
        106-124 with the rule (``benchmarks/serving.py``, README "The cpu backend").

        Raises: ``ValueError`` (``n < 1``).
        """
        if int(n) < 1:
            raise ValueError(f"BLAS threads must be >= 1, got {n}")
        with self._lock:
            if not self.adapt_blas:
                return
            self.adapt_blas = False
        limit_blas_threads(int(n), force=True)

    def set_cores(self, cores: int | None) -> None:
        """Share out ``cores`` from now on (``None``: :func:`available_cores`).

        Raises: ``ValueError`` (``cores < 1``).
        """
        if cores is not None and int(cores) < 1:
            raise ValueError(f"threads must be >= 1, got {cores}")
        with self._lock:
            self.cores = int(cores) if cores is not None else available_cores()
            if self.adapt_blas:
                self._apply_blas()

    def fix_blas(self) -> None:
        """Stop adapting BLAS's thread count (the caller set it, or wants it left alone)."""
        with self._lock:
            self.adapt_blas = False

    def _apply_blas(self) -> None:
        n = 1 if self.fan_outs else self.threads()
        if n == self._blas_now:
            return
        if self._blas is None:
            try:
                from threadpoolctl import ThreadpoolController
                self._blas = ThreadpoolController().select(user_api="blas").lib_controllers
            except Exception:  # noqa: BLE001 - no threadpoolctl or no BLAS: nothing to size
                self._blas = []
        for lib in self._blas:
            lib.set_num_threads(n)
        self._blas_now = n


class _Job:
    """One :meth:`FanOutPool.run`: its pieces, handed out one at a time to whichever thread
    asks next (the caller and pool threads), and the first error."""

    __slots__ = ("fn", "pieces", "next", "left", "error", "cv")

    def __init__(self, fn, pieces, cv):
        self.fn, self.pieces = fn, pieces
        self.next = 0                       # the next piece to hand out
        self.left = len(pieces)             # pieces not finished (or skipped after an error)
        self.error = None
        self.cv = cv

    def work(self) -> None:
        """Run pieces until none is left to hand out."""
        cv, n = self.cv, len(self.pieces)
        while True:
            with cv:
                i = self.next
                if i >= n:
                    return
                self.next = i + 1
            try:
                self.fn(self.pieces[i])
            except BaseException as e:  # noqa: BLE001 - handed to the caller of run()
                with cv:
                    if self.error is None:
                        self.error = e
                    self.left -= n - self.next          # the pieces never handed out
                    self.next = n
                    self.left -= 1
                    cv.notify_all()
                return
            with cv:
                self.left -= 1
                if not self.left:
                    cv.notify_all()


class FanOutPool:
    """Threads a cpu kernel deals its pieces out to (attention's sequences or heads).

    :meth:`run` hands the pieces out one at a time to whichever of its threads asks next (the
    calling thread included), so a thread the OS does not run for a while (a busy host) holds up
    at most the piece it is in, never a fixed share of the work. The pool's threads are started
    on first need (at most the largest ``threads - 1`` asked for) and block on a condition
    variable between jobs: they never spin.
    """

    def __init__(self):
        self._cv = threading.Condition(threading.Lock())
        self._jobs: list = []               # jobs with pieces left to hand out
        self._threads: list = []
        self._idle = 0

    def run(self, fn, pieces, threads: int) -> None:
        """``fn(piece)`` for every piece, on at most ``threads`` threads (this one and
        ``threads - 1`` of the pool's), with BLAS at one thread meanwhile
        (:meth:`ThreadRule.fan_out`). Returns when every piece is done.

        Raises: the first exception a piece raised (the pieces not yet started are skipped).
        """
        pieces = list(pieces)
        helpers = min(int(threads), len(pieces)) - 1
        if helpers <= 0:
            for p in pieces:
                fn(p)
            return
        cv = self._cv
        job = _Job(fn, pieces, cv)
        with RULE.fan_out():
            with cv:
                while len(self._threads) < helpers:
                    t = threading.Thread(target=self._loop, daemon=True,
                                         name=f"runtime-cpu-kernel-{len(self._threads)}")
                    self._threads.append(t)
                    t.start()
                self._jobs.append(job)
                cv.notify_all()             # callers waiting on their jobs wait here too
            try:
                job.work()
            finally:
                with cv:
                    if job in self._jobs:
                        self._jobs.remove(job)
                    while job.left:                     # pieces other threads are in
                        cv.wait()
        if job.error is not None:
            raise job.error

    def _loop(self) -> None:
        cv = self._cv
        while True:
            with cv:
                while not self._jobs:
                    self._idle += 1
                    cv.wait()
                    self._idle -= 1
                job = self._jobs[0]
                if job.next >= len(job.pieces):          # handed out: let its caller finish
                    self._jobs.pop(0)
                    continue
            job.work()


#: the process's rule (the cpu backends and the kernels of :mod:`runtime.kernels.nn` use it)
RULE = ThreadRule()
#: the process's fan-out threads (attention's pieces, :mod:`runtime.kernels.nn`)
FAN_OUT = FanOutPool()
