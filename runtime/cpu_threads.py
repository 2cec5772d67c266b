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
import math
import os
import re
import threading
import time

#: the environment variables that fix numpy's BLAS thread count (the user's setting wins)
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def blas_fixed_by_user() -> bool:
    """Whether the environment fixes BLAS's thread count (any of :data:`BLAS_ENV` set)."""
    return any(os.environ.get(v) for v in BLAS_ENV)


def available_cores(root: str = "/") -> int:
    """The cores the thread rule shares out by default.

    ``OMP_NUM_THREADS`` when it is set to a positive integer (as torch reads it; Ray sets it to
    a worker's ``num_cpus``); else the CPUs this process may run on (its affinity mask,
    ``os.cpu_count()`` where there is none), capped by the CPU quota of its cgroup rounded up
    (:func:`cpu_quota`; at least 1), as the JVM and Go's ``GOMAXPROCS`` do: a container limited
    to 2 CPUs on a 64-core host gets 2 threads, not 64 threads throttled to 2 cores' time.

    Args:
        root: the filesystem root the ``/proc`` and cgroup files are read under (tests pass a
            fake tree).
    """
    try:
        omp = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        omp = 0
    if omp >= 1:
        return omp
    try:
        cpus = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = max(1, os.cpu_count() or 1)
    quota = cpu_quota(root)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota - 1e-9)))
    return cpus


def cpu_quota(root: str = "/") -> float | None:
    """The CPU bandwidth this process's cgroup may use, in cores (quota / period), or ``None``
    when it has no limit or none can be read (not Linux, no cgroup file system).

    Reads cgroup v2's ``cpu.max`` (``"150000 100000"``: 1.5 cores; ``"max ..."``: no limit) and
    cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (a quota of -1: no limit), for
    the process's own cgroup (``/proc/self/cgroup``, mounted where ``/proc/self/mountinfo``
    says) and every ancestor visible up to the mount point; the smallest limit wins, since a
    parent's limit caps its children. Both hierarchies are read on a hybrid host.

    Args:
        root: the filesystem root the files are read under (``"/"``; tests pass a fake tree).
    """
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            groups = [line.rstrip("\n").split(":", 2) for line in f]
        with open(os.path.join(root, "proc/self/mountinfo")) as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    paths = {}                                 # "v2" / "v1" -> the process's cgroup path
    for g in groups:
        if len(g) != 3:
            continue
        if g[0] == "0" and g[1] == "":
            paths["v2"] = g[2]
        elif "cpu" in g[1].split(","):
            paths["v1"] = g[2]
    best = None
    for line in mounts:
        head, sep, tail = line.partition(" - ")
        f, t = head.split(), tail.split()
        if not sep or len(f) < 5 or not t:
            continue
        if t[0] == "cgroup2":
            kind = "v2"
        elif t[0] == "cgroup" and len(t) > 2 and "cpu" in t[2].split(","):
            kind = "v1"
        else:
            continue
        if kind not in paths:
            continue
        mount_root, point = _unescape(f[3]), _unescape(f[4])
        path = paths[kind]
        rel = path[len(mount_root):] if path.startswith(mount_root) else ""
        top = os.path.join(root, point.lstrip("/"))
        top = os.path.normpath(top)
        d = os.path.normpath(os.path.join(top, rel.lstrip("/")))
        if not d.startswith(top):             # a path outside the mount (another namespace)
            d = top
        while True:
            limit = _cgroup_limit(d, kind)
            if limit is not None and (best is None or limit < best):
                best = limit
            if len(d) <= len(top):
                break
            d = os.path.dirname(d)
    return best


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as \ooo (octal)
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_limit(d: str, kind: str) -> float | None:
    """One cgroup directory's CPU limit in cores, or ``None`` (no limit, no file, unreadable)."""
    try:
        if kind == "v2":
            with open(os.path.join(d, "cpu.max")) as f:
                quota, _, period = f.read().strip().partition(" ")
            if quota == "max":
                return None
            q, p = int(quota), int(period or 100000)
        else:
            with open(os.path.join(d, "cpu.cfs_quota_us")) as f:
                q = int(f.read().strip())
            with open(os.path.join(d, "cpu.cfs_period_us")) as f:
                p = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


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


def _thread_schedstat():
    """``(ns on the cpu, ns runnable but waiting for a cpu)`` of the calling thread
    (``/proc/thread-self/schedstat``), or ``None`` where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            run, wait = f.read().split()[:2]
        return int(run), int(wait)
    except (OSError, ValueError):
        return None


class CpuShare:
    """Whether the host is busy: the cpu workers wait for cores that other processes hold.

    Two readings, taken by the worker that starts a stream item, at most once per
    ``window_s``: the share of the CPU time that worker wanted and got, ``run / (run + wait)``,
    where ``wait`` is its time runnable but waiting on the run queue for a core (the kernel's
    per-thread scheduler counters, ``/proc/thread-self/schedstat``); and the cores the whole
    process used meanwhile (``time.process_time()`` over wall time). The host is busy when the
    share falls below ``low`` while the process used less than ``external`` of the cores (the
    wait is for other processes, not for this process's own threads: an HTTP server beside the
    model is not a reason to run fewer threads); it is free again once the share is above
    ``high`` or the process uses the cores itself. The band keeps it from flipping straight
    back: with fewer threads on a busy host each gets more (2 busy neighbours on 2 cores: a
    share of 0.5 with 2 threads, 0.67 with 1). Where the counters are missing (not Linux) the
    host is never busy.

    Args:
        window_s: seconds between readings (per process).
        low, high: the share below which the host is busy, above which it is free again.
        external: the fraction of the cores the process must be using less of to call it busy.
        read: the counter reader (tests pass a fake); default the calling thread's schedstat.
        cpu_time: the process's CPU seconds (tests pass a fake); default ``time.process_time``.
    """

    def __init__(self, window_s: float = 0.2, low: float = 0.6, high: float = 0.9,
                 external: float = 0.75, read=None, cpu_time=None):
        self.window_s, self.low, self.high, self.external = window_s, low, high, external
        self.share = 1.0                  # the last reading of the worker's share
        self.used = None                  # the cores the process used in the last window
        self.busy = False
        self._read = read or _thread_schedstat
        self._cpu_time = cpu_time or time.process_time
        self._next = 0.0
        self._proc = None                 # (when, process CPU seconds) at the last reading
        self._tls = threading.local()

    def sample(self, cores: int, now: float | None = None) -> None:
        """Update ``share``, ``used`` and ``busy`` when a window has passed (cheap otherwise:
        one clock read), from what the calling thread's counters gained since it last read
        them (if that was within 10 s and covers at least 20 ms of runnable time) and the
        process's CPU time since the last reading. ``cores``: the cores the rule shares out."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        self._next = now + self.window_s
        got = self._read()
        if got is None:
            return
        cpu, proc = self._cpu_time(), self._proc
        self._proc = (now, cpu)
        last = getattr(self._tls, "last", None)
        self._tls.last = (now, got)
        if last is None or now - last[0] > 10.0 or proc is None or now <= proc[0]:
            return
        run, wait = got[0] - last[1][0], got[1] - last[1][1]
        if run + wait < 20_000_000:
            return
        self.share = run / (run + wait)
        self.used = (cpu - proc[1]) / (now - proc[0])
        mine = self.used >= self.external * cores
        if self.share < self.low and not mine:
            self.busy = True
        elif self.share > self.high or mine:
            self.busy = False

    def cores(self, cores: int) -> int:
        """The cores worth sharing out of ``cores`` now: all of them on a free host, else
        ``cores * share`` rounded (at least 1)."""
        if not self.busy:
            return cores
        return max(1, min(cores, round(cores * self.share)))


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
        self.cpu = CpuShare()
        self._lock = threading.Lock()
        self._blas = None                 # threadpoolctl controllers of the BLAS libraries
        self._blas_now = None             # the count last given to them

    def threads(self) -> int:
        """Library threads a kernel starting now gets: ``max(1, cores // max(1, active))``,
        with ``cores`` cut to what the process gets on a busy host (:class:`CpuShare`)."""
        return max(1, self.cpu.cores(self.cores) // max(1, self.active))

    def enter(self) -> None:
        """A stream item starts executing (the cpu backend calls it around each item, on the
        thread that runs the item: the CPU share is sampled there)."""
        self.cpu.sample(self.cores)
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

    __slots__ = ("fn", "pieces", "next", "left", "error", "cv", "seats")

    def __init__(self, fn, pieces, cv, seats):
        self.fn, self.pieces = fn, pieces
        self.seats = seats                  # pool threads that may still join
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
        self._jobs: list = []               # jobs with pieces left to hand out and seats free
        self._threads: list = []

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
        job = _Job(fn, pieces, cv, helpers)
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
                    cv.wait()
                job = self._jobs[0]
                if job.next >= len(job.pieces) or job.seats <= 0:   # handed out, or enough
                    self._jobs.pop(0)                               # threads on it already
                    continue
                job.seats -= 1
            job.work()


#: the process's rule (the cpu backends and the kernels of :mod:`runtime.kernels.nn` use it)
RULE = ThreadRule()
#: the process's fan-out threads (attention's pieces, :mod:`runtime.kernels.nn`)
FAN_OUT = FanOutPool()


def _after_fork_in_child() -> None:
    # only the forking thread comes along: no stream item executes here, the fan-out threads
    # are gone, and a lock another thread held at the fork would be held forever
    RULE._lock = threading.Lock()
    RULE.active = RULE.fan_outs = 0
    RULE.cpu = CpuShare()
    FAN_OUT.__init__()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
