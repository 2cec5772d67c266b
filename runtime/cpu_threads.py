"""The cpu thread rule: how many threads the library pools inside a cpu kernel get.

A leaf module: it imports nothing from ``runtime`` (the cpu backend, the kernels and serving
import it), so the rule, the BLAS settings and the fan-out pool are written once.

A cpu stream's kernels run one after another on one worker thread (:mod:`runtime.backends.cpu`);
inside a kernel, the work is split over threads. The rule:

    kernel threads = max(1, cores // stream items executing now)

counted process-wide (every cpu backend of the process), with ``cores`` cut on a busy host
(:class:`CpuShare`), and one where a lone item's kernels did more work per second on one
thread beside busy processes (:class:`ThreadChoice`, measured). The kernels of :mod:`runtime.kernels.nn` deal their work out to that many
threads themselves (:class:`FanOutPool`): a matmul in blocks of its output, attention in
sequences or heads, a large layer norm in rows, each piece with one-thread BLAS and numba, as
torch's CPU attention runs single-threaded GEMMs in a parallel loop. Pieces go to whichever
thread asks next and waiting threads sleep, so a thread the OS does not run holds up one small
piece, never a fixed share. numpy's OpenBLAS runs at one thread for the pieces
(:data:`BLAS_THREADS`, set from one owner thread: :class:`BlasOwner` says why); small compiled
loops run on the calling thread and larger ones on numba's OpenMP pool at the rule's count
(numba's count is per calling thread, ``numba.set_num_threads``, applied by each kernel before
its loops run). So one busy stream (one model forward at a time: a batcher, a benchmark) gets
every core, two busy streams on two cores one thread each.

While the process has the cores to itself, a kernel of up to 512 rows runs whole instead: one
BLAS call on OpenBLAS's own threads (which share one packing of the input and hand off by
spinning, faster than pieces on a quiet host), its loops on numba's threads
(:meth:`ThreadRule.whole_call`). The kernels time those calls: when the calling thread was off
its core for a fifth of a window of them (busy neighbours), it is pieces again for a pause that
grows while tries fail (:class:`WholeCalls`).

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
``blas_threads=n`` (fixed) or ``None`` (untouched) takes BLAS out of the rule (a user kernel
calling numpy's matmul gets one BLAS thread under the rule: it can deal out its own pieces with
:data:`FAN_OUT`, or pass ``blas_threads``).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import threading
import time

try:
    from ._threads import start as _start_thread     # SOAK7: a start with a way out
    from ._threads import Event as _Event           # SOAK8: no lock an interrupt leaves held
    from ._threads import is_alive as _is_alive     # SOAK8: no live thread taken for dead
    from ._threads import current_frames as _current_frames   # SOAK9: gh-106883
except ImportError:     # (loaded alone, a leaf module: the plain start)
    def _start_thread(thread) -> bool:
        thread.start()
        return True
    _Event = threading.Event

    def _is_alive(thread) -> bool:
        return thread.is_alive()
    _current_frames = sys._current_frames

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


class BlasOwner:
    """The one thread that changes numpy's BLAS thread count, for the whole process.

    numpy's OpenBLAS (0.3.31, pthreads build, in numpy 2.x's wheels) applies
    ``openblas_set_num_threads`` only from the thread that called it first, for as long as that
    thread lives; a call from any other thread is silently dropped (measured: a worker thread
    sets 2, the main thread then sets 1, ``openblas_get_num_threads()`` still says 2 and the
    main thread's sgemm still runs on 2 threads). A rule that moves the setting from whichever
    thread runs a stream item (the cpu workers, a client thread helping them, a fan-out thread)
    was therefore ignored from all threads but one: pieces meant to run 1-thread BLAS ran
    OpenBLAS's threaded sgemm side by side, queued on its server lock and spun (MiniLM 1x128
    forwards of 1-3 s instead of 30 ms). So every change goes through this daemon thread,
    started on first use and kept for the life of the process (a forked child starts its own).

    Args:
        timeout_s: how long :meth:`call` waits for the thread before running the function on
            the calling thread instead (never a hang).
    """

    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        # SOAK8: blocks take the plain lock, never ``with self._cv`` (the Condition's Python
        # __enter__/__exit__, where a KeyboardInterrupt can land with the lock taken and leave
        # it held: every later call waited for it for ever)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._work: list = []
        self._thread = None

    def call(self, fn):
        """``fn()`` on the owner thread; returns its result or raises its exception."""
        box: list = []
        done = _Event()
        with self._lock:
            if self._thread is None or not _is_alive(self._thread):
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="runtime-blas-owner")
                if not _start_thread(self._thread):      # SOAK7: it died before it ran
                    return fn()                         # (the next call starts another)
            if threading.current_thread() is self._thread:
                return fn()
            owner = self._thread
            self._work.append((fn, box, done))
            self._cv.notify()
        if not done.wait(self.timeout_s):
            with self._lock:
                if (fn, box, done) in self._work:       # never started: run it here
                    self._work.remove((fn, box, done))
                    return fn()
            while not done.wait(0.05):                   # started: it finishes, unless the
                if not _is_alive(owner) and not done.is_set():  # owner died with it taken
                    return fn()                          # (an interrupt): run it here (ADV6)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._work:
                    self._cv.wait()
                fn, box, done = self._work.pop(0)
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()


#: the process's BLAS owner thread (:func:`limit_blas_threads` and the thread rule use it)
BLAS_OWNER = BlasOwner()


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
    if prev is not None and prev != n:        # from the owner thread (BlasOwner says why)
        BLAS_OWNER.call(lambda: threadpool_limits(int(n), user_api="blas"))
    return prev


class ProcessSchedstat:
    """``(ns on the cpu, ns runnable but waiting for a cpu)`` summed over every thread of the
    process (``/proc/self/task/*/schedstat``), as running totals that never go back when a
    thread ends (each thread's gain since the last call is added), or ``None`` where the kernel
    does not say. Thread-safe.

    The share of the CPU the process wanted and got is read over all its threads, not only the
    worker that starts a stream item: a kernel dealt out to the fan-out pool, or to numba's
    OpenMP threads, waits (asleep, uncounted in the worker's own counters) for partners that
    sit on the run queue on a busy host; their wait is the process's wait.

    Args:
        task_dir: the directory of the process's threads (tests pass a fake tree).
    """

    def __init__(self, task_dir: str = "/proc/self/task"):
        self.task_dir = task_dir
        self._seen: dict = {}               # thread id -> its (run, wait) at the last call
        self._total = [0, 0]
        self._lock = threading.Lock()

    def __call__(self):
        try:
            tids = os.listdir(self.task_dir)
        except OSError:
            return None
        now = {}
        for t in tids:
            try:
                with open(os.path.join(self.task_dir, t, "schedstat"), "rb") as f:
                    run, wait = f.read().split()[:2]
                now[t] = (int(run), int(wait))
            except (OSError, ValueError):   # a thread that ended meanwhile
                continue
        if not now:
            return None
        with self._lock:
            for t, (run, wait) in now.items():
                r0, w0 = self._seen.get(t, (0, 0))
                self._total[0] += max(0, run - r0)
                self._total[1] += max(0, wait - w0)
            self._seen = now
            return tuple(self._total)


class CpuShare:
    """Whether the host is starved: the process's threads wait for cores that other processes
    hold, so long that fewer threads would do better.

    Two readings, taken by the worker that starts a stream item, at most once per
    ``window_s``: the share of the CPU time the process's threads wanted and got,
    ``run / (run + wait)``, where ``wait`` is time runnable but waiting on the run queue for a
    core (the kernel's per-thread scheduler counters, summed over the threads:
    :class:`ProcessSchedstat`); and the cores the whole process used meanwhile
    (``time.process_time()`` over wall time). The host is busy when the share falls below
    ``low`` while the process used less than ``external`` of the cores (the wait is for other
    processes, not for this process's own threads: an HTTP server beside the model is not a
    reason to run fewer threads); it is free again once the share is above ``high`` or the
    process uses the cores itself. Where the counters are missing (not Linux) the host is never
    busy.

    The default never cuts the threads (``low=0``: the readings are kept, ``share`` and
    ``used``, for benchmarks and ``RULE.cpu``; pass ``low > 0`` to cut). With the kernels' work
    dealt out in small pieces to threads that sleep while they wait (:class:`FanOutPool`), a
    second thread the OS does not run costs one piece, threads that sleep often are run
    promptly when they wake, and beside busy processes two runnable threads get more of the
    CPU than one (the scheduler shares a core out per thread): MiniLM 1x128 on 2 cores beside
    other sessions' load (load average ~8) and 2 busy loops ran a forward in 42-71 ms on 2
    threads against 300-330 ms on 1 (shares about 0.2 and 0.1). The cut that followed (1 thread
    below a share of 0.1) still lost wherever it fired: beside 2 busy loops and other sessions'
    work (load 8-9, shares 0.06-0.22), ``benchmarks/minilm_forward.py --contention 2`` with the
    cut against without, sentences/s: 8x16 38.7 vs 105, 32x16 35.5 vs 48.1, 1x128 3.6 vs 22.9,
    8x128 5.6 vs 6.6 (issue 30). Before that, ``low=0.6`` (1 thread with 2 busy neighbours)
    was measured with OpenBLAS's statically split, spin-waiting pool, where 1 thread won.

    Args:
        window_s: seconds between readings (per process).
        low, high: the share below which the host is busy (0: never), above which it is free
            again.
        external: the fraction of the cores the process must be using less of to call it busy.
        read: the counter reader (tests pass a fake); default :class:`ProcessSchedstat`.
        cpu_time: the process's CPU seconds (tests pass a fake); default ``time.process_time``.
    """

    def __init__(self, window_s: float = 0.2, low: float = 0.0, high: float = 0.3,
                 external: float = 0.75, read=None, cpu_time=None):
        self.window_s, self.low, self.high, self.external = window_s, low, high, external
        self.share = 1.0                  # the last reading of the worker's share
        self.used = None                  # the cores the process used in the last window
        self.busy = False
        self._read = read or ProcessSchedstat()
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


#: the values of ``RUNTIME_CPU_WHOLE`` (:class:`WholeCalls`' ``mode``)
WHOLE_MODES = ("auto", "0", "1")


def whole_mode_from_env(strict: bool = True) -> str:
    """``RUNTIME_CPU_WHOLE``: ``auto`` (unset or empty), ``0`` or ``1``.

    ``strict=False`` (the rule made at import, and again in a forked child) reads a typo as
    ``auto``: ``import runtime`` does not fail on it, the cpu backend does, at its start
    (:class:`runtime.backends.cpu.CpuBackend` reads it strictly).

    Raises: ``ValueError`` naming the variable for any other value (``strict``; before, a typo
    such as ``RUNTIME_CPU_WHOLE=off`` meant ``auto``, silently)."""
    text = os.environ.get("RUNTIME_CPU_WHOLE")      # (runtime._env's way; this module is a leaf)
    v = (text or "").strip() or "auto"
    if v in WHOLE_MODES or not strict:
        return v if v in WHOLE_MODES else "auto"
    raise ValueError(f"the environment variable RUNTIME_CPU_WHOLE={text!r} must be one of "
                     "auto, 0 (never whole calls), 1 (always); fix it or unset it")


class WholeCalls:
    """Whether a kernel may run as one call on its library's own threads (OpenBLAS's pool) instead
    of in pieces dealt out to :class:`FanOutPool`: while the process has its cores to itself.

    On a free host one OpenBLAS call on 2 threads is faster than the same product in pieces:
    its threads share one packing of the input (each piece packs its own) and hand off by
    spinning, not through the fan-out's sleeping condition variable and Python's GIL (MiniLM
    at 128 tokens: the four products of a layer 2.1 ms on OpenBLAS's 2 threads against 2.8 ms
    in 2 pieces and 3.5-4.2 ms in 4 on this 2-core machine, quiet). Beside busy processes the
    same call waits for a partner the OS is not running, in a spin (10-70 ms instead of 4 ms),
    where pieces lose one small piece at most.

    So the kernels ask :meth:`allowed` before each call, and time every whole call they make
    (:meth:`record`): the thread's CPU time over the call's wall time, summed over calls until
    ``window_s`` of wall time. OpenBLAS's calling thread computes its share of the product, then
    spin-waits for the others, so on a free host it is on a core the whole call (a share of
    about 1); beside busy processes it is preempted, or yields to them in its spin (about 0.5
    with two busy loops on two cores). A window under ``low`` turns whole calls off for
    ``backoff_s`` seconds (``windows`` low windows in a row; a try: one), a window ending as soon
    as the thread was off its core for more than ``(1 - low) * window_s`` of it (2 ms: a try
    beside busy processes ends within a few calls),
    unless the process itself used at least ``own`` of the call's cores meanwhile (its own
    threads kept the thread off its core: a capture recording beside the worker). ``own`` is
    high (0.95): a serving process's many threads still get 1.3-1.8 of 2 cores beside two busy
    loops, where whole calls lost (8 clients: 65 vs 82 requests/s at 0.8). The process's first
    window is not read: OpenBLAS's workers' first calls read 0.31 on a quiet host (and would
    have sent a quiet benchmark's first rows to pieces for 1 s).
    then one window is tried again (the pause grows ``growth`` times, up to ``max_backoff_s``,
    while tries fail, and is back to ``backoff_s`` after a good window). Under lasting
    contention a try costs a few slower calls (and OpenBLAS's idle workers spinning for ~0.1 s
    after them) every ``max_backoff_s``. State: a few numbers (bounded); nothing spins or waits
    here.

    ``RUNTIME_CPU_WHOLE=0`` (never whole) or ``1`` (always) fixes the choice (``mode``).

    Args:
        low: the share below which whole calls stop.
        window_s: the wall time of whole calls one reading sums (seconds).
        backoff_s, max_backoff_s: the first and the longest pause of whole calls (seconds).
        growth: the factor the pause grows by after each failed try.
        own: the fraction of the call's cores the process must use itself, over the window,
            for a low share to count as its own threads' doing (no stop).
        windows: the low windows in a row that stop whole calls (after a pause: one).
        mode: ``"auto"`` (adaptive), ``"0"`` or ``"1"``; ``None`` reads ``RUNTIME_CPU_WHOLE``.
        clock: monotonic seconds (tests pass a fake).
        cpu_time: the process's CPU seconds (tests pass a fake); default ``time.process_time``.
    Raises: ``ValueError`` (a ``mode``, or a ``RUNTIME_CPU_WHOLE``, that is none of the three).
    """

    def __init__(self, low: float = 0.8, window_s: float = 0.01, backoff_s: float = 1.0,
                 max_backoff_s: float = 32.0, growth: float = 4.0, own: float = 0.95,
                 windows: int = 2, mode: str | None = None, clock=None, cpu_time=None):
        if mode is None:
            mode = whole_mode_from_env()
        mode = str(mode).strip()
        if mode not in WHOLE_MODES:
            raise ValueError(f"WholeCalls mode must be auto, 0 or 1, got {mode!r}")
        self.mode = mode
        self.forced = {"0": False, "1": True}.get(mode)
        self.low, self.window_s, self.own, self.windows = low, window_s, own, windows
        self._low = 0                               # low windows in a row
        self.backoff_s, self.max_backoff_s, self.growth = backoff_s, max_backoff_s, growth
        self.on = self.forced is not False          # whole calls allowed now
        self.share = None                           # the last window's reading
        self.used = None                            # the cores the process used in it
        self.stops = 0                              # windows that turned whole calls off
        self._clock = clock or time.monotonic
        self._cpu_time = cpu_time or time.process_time
        self._pause = backoff_s                     # the next pause
        self._until = 0.0                           # off until then
        self._wall = self._cpu = 0.0                # the current window's sums
        self._start = None                          # (clock, process CPU s) at its first call
        self._cold = 1                              # windows not read: the process's first
        self._lock = threading.Lock()

    def allowed(self) -> bool:
        """Whether the next call may be whole (turns whole calls back on for a try once the
        pause is over)."""
        if self.on:
            return True
        if self.forced is not None or self._clock() < self._until:
            return False
        with self._lock:
            self.on = True
            self._wall = self._cpu = 0.0
            self._start = None
            self._low = self.windows - 1            # a try: one low window stops it
        return True

    def record(self, wall: float, cpu: float, threads: int = 1) -> None:
        """One whole call on ``threads`` threads took ``wall`` seconds, ``cpu`` of them on a
        core for the calling thread (``time.thread_time()`` around the call)."""
        if self.forced is not None:
            return
        with self._lock:
            if not self.on:                 # a call that started before a stop
                return
            if self._start is None:         # the process's CPU counted from the end of the
                self._start = (self._clock() - wall, self._cpu_time())   # first call (low side)
            self._wall += wall
            self._cpu += cpu
            if (self._wall < self.window_s
                    and self._wall - self._cpu <= (1 - self.low) * self.window_s):
                return                      # no window yet, and not yet too long off a core
            share = self._cpu / self._wall
            self._wall = self._cpu = 0.0
            t0, p0 = self._start
            self._start = None
            if self._cold:                  # OpenBLAS's workers' first calls (their buffers
                self._cold -= 1             # first touched): read 0.31 on a quiet host
                return
            self.share = share
            now = self._clock()
            self.used = (self._cpu_time() - p0) / max(now - t0, 1e-9)
            if share >= self.low or self.used >= self.own * threads:
                self._pause = self.backoff_s        # a free host, or the process's own
                self._low = 0                       # threads kept it off the core
                return
            self._low += 1
            if self._low < self.windows:            # one low window: a blip, read another
                return
            self._low = 0
            self.on = False
            self.stops += 1
            self._until = self._clock() + self._pause
            self._pause = min(self.max_backoff_s, self._pause * self.growth)


class ThreadChoice:
    """Whether kernels dealt out in pieces run on all the rule's threads or on one, chosen from
    the throughput the process measures while its threads wait for cores (a busy host).

    Beside busy processes two threads cost more CPU per forward than one (5-25% on 2 cores:
    every piece handed between them, every wait at a kernel's end for the thread the OS is
    not running) and may or may not obtain the extra core that pays for it: which count was
    faster flipped from run to run with the host's other load (issue 30). So nothing is
    assumed: while the host is starved (``starved()``: the process's threads waited for cores,
    :class:`CpuShare`), every ``hold`` seconds the rule compares the two counts in windows of
    work taken in turn (other, incumbent, incumbent, other: two pairs in opposite orders, so a
    drift of the host's load cannot favour one count in both), each window ``window_s`` seconds
    of kernels dealt out in pieces (their wall time: :meth:`record`). Shapes vary between
    windows (a serving process runs whatever batches arrive), so the counts are compared shape
    by shape: for the shapes both windows of a pair ran, the incumbent's wall time against the
    time the other count's speed (multiply-adds per second, per shape) would have taken for
    the same work. The other count takes over when it was faster by ``margin`` in both pairs
    (hysteresis: noise between windows does not flip the choice); then the next comparison
    comes after ``hold_s``, while one that confirms the incumbent doubles the wait, up to
    ``max_hold_s``: under steady contention comparisons cost little, and a change of the
    host is seen within ``max_hold_s``. On a free host (``starved()`` false) all the threads at
    once, and no comparisons: a quiet machine runs as without this class. State: a few numbers
    and at most ``MAX_SHAPES`` shapes per window (bounded); nothing waits here.

    ``RUNTIME_CPU_CHOICE=all`` or ``1`` fixes the count (``mode``; ``auto``: measured; another
    value warns and is taken as ``auto``).

    Args:
        starved: ``() -> bool``, whether the process's threads wait for cores that other
            processes hold (the rule: ``CpuShare.share`` below :data:`CHOICE_SHARE` while the
            process used less than ``CpuShare.external`` of its cores; tests pass a fake).
        window_s: seconds of pieces' wall time one window sums.
        margin: how much faster (a fraction) the other count must be, in each pair of
            windows, to replace the incumbent.
        hold_s, max_hold_s: the first and the longest wait between comparisons (seconds).
        stale_s: a window open longer than this (seconds of clock: the process went idle, or
            ran only whole calls) ends the comparison, incumbent kept.
        mode: ``"auto"``, ``"all"`` or ``"1"``; ``None`` reads ``RUNTIME_CPU_CHOICE``.
        clock: monotonic seconds (tests pass a fake).
    Attributes: ``one`` (one thread is the incumbent), ``speedups`` (the last comparison's
        two pairs: the other count's speed over the incumbent's, ``> 1``: the other was
        faster), ``changes`` (times the choice changed), ``comparisons`` (comparisons
        finished).
    Raises: ``ValueError`` (an unknown ``mode`` passed).
    """

    #: most shapes one window keeps (a kernel of another shape beyond them is not counted)
    MAX_SHAPES = 64

    def __init__(self, starved=None, window_s: float = 0.05, margin: float = 0.1,
                 hold_s: float = 1.0, max_hold_s: float = 16.0, stale_s: float = 2.0,
                 mode: str | None = None, clock=None):
        if mode is None:                # (read at import: a typo warns, it does not fail it)
            mode = os.environ.get("RUNTIME_CPU_CHOICE", "auto").strip() or "auto"
            if mode not in ("auto", "all", "1"):
                import warnings
                warnings.warn(f"RUNTIME_CPU_CHOICE={mode!r} is not auto, all or 1: using auto",
                              RuntimeWarning, stacklevel=2)
                mode = "auto"
        mode = str(mode).strip()
        if mode not in ("auto", "all", "1"):
            raise ValueError(f"ThreadChoice mode must be auto, all or 1, got {mode!r}")
        self.mode = mode
        self._starved = starved or (lambda: False)
        self.window_s, self.margin, self.stale_s = window_s, margin, stale_s
        self.hold_s, self.max_hold_s = hold_s, max_hold_s
        self._clock = clock or time.monotonic
        self.one = mode == "1"
        self._one_now = False               # one thread now (the choice, or a window's)
        self.speedups: tuple = ()
        self.changes = self.comparisons = 0
        self._hold = hold_s
        self._until = 0.0                   # no comparison before then
        self._plan: list = []               # the windows left to run (True: one thread)
        self._opened = 0.0                  # when the current window opened (clock)
        self._wins: list = []               # finished windows: {shape: [work, wall]}
        self._cur: dict = {}                # the current window's
        self._win = 0.0                     # the current window's wall so far
        self._lock = threading.Lock()

    def threads(self, n: int) -> int:
        """The threads a kernel dealt out in pieces gets now, out of the rule's ``n``: one
        while one thread is the choice or a window of one runs, unless the host is free again
        (then all, at once: the comparison, if any, is dropped)."""
        if n <= 1 or self.mode == "all":
            return n
        if self.mode == "1":
            return 1
        if self._one_now or self._plan:
            if not self._starved():
                with self._lock:
                    self._reset()
                return n
            return 1 if self._one_now else n
        return n

    def record(self, work: float, wall: float, threads: int, shape=None) -> None:
        """A kernel dealt out in pieces on ``threads`` threads (:meth:`threads`' answer) did
        ``work`` (multiply-adds) in ``wall`` seconds; ``shape``: any hashable naming the
        kernel's shape (kernels of one shape are compared with each other only)."""
        if self.mode != "auto" or wall <= 0 or not (self._plan or self._starved()):
            return                      # (a free host: no lock, no clock)
        now = self._clock()
        with self._lock:
            if not self._plan:
                if now < self._until or not self._starved():
                    return
                # compare: other, incumbent, incumbent, other (two pairs of windows, in
                # opposite orders: a drift of the host's load favours neither count in both)
                self._plan = [not self.one, self.one, self.one, not self.one]
                self._one_now = self._plan[0]
                self._wins, self._cur = [], {}
                self._win, self._opened = 0.0, now
                return                  # this kernel ran before the comparison began
            if now - self._opened > self.stale_s:       # idle, or only whole calls meanwhile
                self._plan = []
                self._one_now = self.one
                self._until = now + self._hold
                return
            if (threads == 1) != self._plan[0]:    # started before this window: not its count
                return
            s = self._cur.get(shape)
            if s is None:
                if len(self._cur) >= self.MAX_SHAPES:
                    return
                s = self._cur[shape] = [0.0, 0.0]
            s[0] += work
            s[1] += wall
            self._win += wall
            if self._win < self.window_s:
                return
            self._plan.pop(0)
            self._wins.append(self._cur)
            self._cur, self._win, self._opened = {}, 0.0, now
            if self._plan:
                self._one_now = self._plan[0]
                return
            w = self._wins                  # other, incumbent, incumbent, other
            self.speedups = (_speedup(w[0], w[1]), _speedup(w[3], w[2]))
            self.comparisons += 1
            if all(x is not None and x > 1 + self.margin for x in self.speedups):
                self.one = not self.one
                self.changes += 1
                self._hold = self.hold_s
            else:
                self._hold = min(self.max_hold_s, self._hold * 2)
            self._one_now = self.one
            self._until = now + self._hold

    def _reset(self) -> None:
        # a free host: all the threads, the next comparison as soon as the host is starved
        if self.one:
            self.changes += 1
        self.one = self._one_now = False
        self._plan = []
        self._hold = self.hold_s
        self._until = 0.0


def _speedup(other: dict, mine: dict):
    """How much faster ``other``'s window ran than ``mine``'s (``{shape: [work, wall]}``), on
    the shapes both ran: ``mine``'s wall time over the time ``other``'s speed per shape would
    have taken for ``mine``'s work; ``None`` when they share no shape."""
    t_mine = t_other = 0.0
    for k, (wk, wl) in mine.items():
        o = other.get(k)
        if o is None or o[0] <= 0 or wk <= 0:
            continue
        t_mine += wl
        t_other += wk * o[1] / o[0]
    return t_mine / t_other if t_other > 0 else None


#: :class:`ThreadChoice` compares one thread with all while the process's threads got less
#: than this share of the CPU time they wanted (``CpuShare.share``: run / (run + wait))
CHOICE_SHARE = 0.8


#: the BLAS threads the rule gives numpy's OpenBLAS outside whole calls: one. The kernels that
#: multiply matrices (:mod:`runtime.kernels.nn`) cut each product into blocks and deal them out
#: to the fan-out pool (:class:`FanOutPool`: whichever thread asks next takes the next block,
#: threads that wait sleep), so OpenBLAS's own pool, which splits a product statically and
#: spin-waits after it, runs only for whole calls on a free host (:class:`WholeCalls`): on a
#: busy host its threads waited on partners the OS was not running (1x128 products 10-70 ms
#: instead of 4 ms with 2 busy processes beside), and its spinning took the core that numba's
#: loops and the fan-out threads needed next.
BLAS_THREADS = 1


class ThreadRule:
    """Counts the cpu stream items executing now and sizes the kernels' threads from that
    count (numba's loops, the fan-out pool); OpenBLAS runs at :data:`BLAS_THREADS` but for
    whole calls (:meth:`whole_call`, :class:`WholeCalls`).

    One per process (:data:`RULE`), since OpenBLAS's setting is process-wide. Thread-safe.

    Attributes:
        cores: the cores the rule shares out (default :func:`available_cores`).
        active: stream items executing now (every cpu backend of the process).
        adapt_blas: whether the rule sets OpenBLAS's thread count (to :data:`BLAS_THREADS`, or
            a whole call's; ``False`` when the user's environment fixes it, or after
            :meth:`fix_blas`: then no whole calls).
        whole: whether kernels may make whole calls now (:class:`WholeCalls`).
        choice: one thread or all for kernels dealt out in pieces while the process's threads
            wait for cores (:class:`ThreadChoice`; the kernels report to :meth:`record`).
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
        self.whole = WholeCalls(mode=whole_mode_from_env(strict=False))   # whole calls now?
        self.choice = ThreadChoice(self._starved)   # one thread or all, on a busy host

    def _starved(self) -> bool:
        # the process's threads waited for cores (CpuShare.share) that other processes held:
        # it used less than CpuShare.external of its cores meanwhile (not its own threads)
        c = self.cpu
        return c.share < CHOICE_SHARE and (c.used is None or c.used < c.external * self.cores)

    def share(self) -> int:
        """The rule's threads for a kernel starting now: ``max(1, cores // max(1, active))``,
        with ``cores`` cut to what the process gets on a busy host (:class:`CpuShare`)."""
        return max(1, self.cpu.cores(self.cores) // max(1, self.active))

    def threads(self) -> int:
        """Library threads a kernel starting now gets: :meth:`share`, or one where that is
        more than one and one thread did more work per second beside busy processes
        (:class:`ThreadChoice`, ``self.choice``)."""
        n = self.share()
        return self.choice.threads(n) if n > 1 else n

    def record(self, work: float, wall: float, threads: int, shape=None) -> None:
        """A kernel dealt out in pieces on ``threads`` threads (:meth:`threads`' answer) did
        ``work`` multiply-adds in ``wall`` seconds (``shape``: hashable, e.g. ``(M, N, K)``):
        counted by :class:`ThreadChoice` while this item executes alone with more than one
        thread to share (else the count was never a choice)."""
        if self.active <= 1 and self.share() > 1:
            self.choice.record(work, wall, threads, shape)

    def enter(self) -> None:
        """A stream item starts executing (the cpu backend calls it around each item, on the
        thread that runs the item: the CPU share is sampled there). BLAS goes to
        :data:`BLAS_THREADS` unless whole calls are on and this item runs alone (then it keeps
        the count the last whole call set: :meth:`whole_call`)."""
        self.cpu.sample(self.cores)
        with self._lock:
            self.active += 1
            if self.adapt_blas and (self.active > 1 or not self.whole.on):
                self._apply_blas(BLAS_THREADS)

    def whole_call(self) -> int:
        """The threads a kernel starting now may run as one call on BLAS's own pool (OpenBLAS
        sharing one packing of the input among its threads), or 0: deal the work out in pieces
        (:class:`FanOutPool`). Whole when the rule sizes BLAS, the kernel gets more than one
        thread (:meth:`share`: no other item executing, a free host), no kernel runs pieces
        now and the process has the cores to itself (:class:`WholeCalls`); BLAS is set to that
        many threads (from the owner thread, when it changes). A kernel that makes the call
        times it into ``self.whole`` (:meth:`WholeCalls.record`)."""
        n = self.share()
        if n <= 1 or not self.adapt_blas or self.fan_outs or _FORKING or \
                not self.whole.allowed():
            return 0
        with self._lock:
            if self.fan_outs:                 # pieces started meanwhile: they need BLAS at 1
                return 0
            self._apply_blas(n)
        return n

    def exit(self) -> None:
        """The item :meth:`enter` announced has finished (raised or not)."""
        with self._lock:
            self.active -= 1

    @contextlib.contextmanager
    def fan_out(self):
        """Counts a kernel running its own pieces (:class:`FanOutPool`), each with one-thread
        BLAS (the rule's :data:`BLAS_THREADS`; set here too, should no item have entered)."""
        counted = False
        try:        # (an interrupt in _apply_blas left the count up for good: BLAS at 1 thread)
            with self._lock:
                self.fan_outs += 1
                counted = True
                if self.adapt_blas:
                    self._apply_blas(BLAS_THREADS)
            yield
        finally:
            if counted:
                with self._lock:
                    self.fan_outs -= 1

    def pin_blas(self, n: int = 1) -> None:
        """Fix OpenBLAS at ``n`` threads from now on, outside the rule (unless the user's
        environment fixes it), as ``OPENBLAS_NUM_THREADS=n`` would; numba's loops and the
        kernels' pieces still use the rule's threads. The rule itself keeps BLAS at
        :data:`BLAS_THREADS` (one), so ``n = 1`` changes nothing but who owns the setting.

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

        Raises: ``ValueError`` naming ``threads`` (``cores`` below 1 or not a number: ``0``,
            ``"a"``, ``True``; ``"a"`` was a bare ``int()`` error before).
        """
        if cores is not None:
            n = 0
            if not isinstance(cores, (bool, str, bytes)):      # as blas_threads (CpuBackend)
                try:
                    n = int(cores)
                except (TypeError, ValueError, OverflowError):
                    pass
            if n < 1:
                raise ValueError(f"threads must be an int >= 1 (the cores the thread rule "
                                 f"shares out) or None, got {cores!r}")
        with self._lock:
            self.cores = n if cores is not None else available_cores()
            if self.adapt_blas:
                self._apply_blas(BLAS_THREADS)

    def fix_blas(self) -> None:
        """Stop adapting BLAS's thread count (the caller set it, or wants it left alone)."""
        with self._lock:
            self.adapt_blas = False

    def _apply_blas(self, n: int) -> None:
        # BLAS at n threads (BLAS_THREADS, or a whole call's), from the owner thread (BlasOwner)
        if n == self._blas_now:
            return
        if self._blas is None:
            try:
                from threadpoolctl import ThreadpoolController
                self._blas = ThreadpoolController().select(user_api="blas").lib_controllers
            except Exception:  # noqa: BLE001 - no threadpoolctl or no BLAS: nothing to size
                self._blas = []
        libs = self._blas
        BLAS_OWNER.call(lambda: [lib.set_num_threads(n) for lib in libs])
        self._blas_now = n


class _Job:
    """One :meth:`FanOutPool.run`: its pieces, handed out one at a time to whichever thread
    asks next (the caller and pool threads), and the first error."""

    __slots__ = ("fn", "pieces", "next", "left", "error", "cv", "lock", "seats")

    def __init__(self, fn, pieces, cv, seats):
        self.fn, self.pieces = fn, pieces
        self.seats = seats                  # pool threads that may still join
        self.next = 0                       # the next piece to hand out
        self.left = len(pieces)             # pieces not finished (or skipped after an error)
        self.error = None
        self.cv = cv
        self.lock = cv._lock                # (``with`` takes it: see FanOutPool)

    def work(self) -> None:
        """Run pieces until none is left to hand out. An exception (a piece's, or an
        asynchronous one landing anywhere in here: KeyboardInterrupt, a signal handler's) is
        handed to the caller of ``run()`` and still counts the piece this thread held, so the
        caller's wait for ``left`` always ends (ADV6: one landing between taking a piece and
        running it left ``left`` above 0 for ever, the caller and its stream hung)."""
        cv, lock, n = self.cv, self.lock, len(self.pieces)
        held = False                        # a piece taken and not yet counted
        try:
            while True:
                with lock:
                    i = self.next
                    if i >= n:
                        return
                    self.next, held = i + 1, True   # (no call between: no interrupt lands)
                self.fn(self.pieces[i])
                with lock:
                    self.left, held = self.left - 1, False
                    if not self.left:
                        cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the caller of run()
            with lock:
                if self.error is None:
                    self.error = e
                self.left -= n - self.next + held       # never handed out, and this one
                self.next = n
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
        self._lock = threading.Lock()       # SOAK8: ``with`` takes the plain lock (BlasOwner)
        self._cv = threading.Condition(self._lock)
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
            with RULE.fan_out():
                for p in pieces:
                    fn(p)
            return
        cv, lock = self._cv, self._lock
        job = _Job(fn, pieces, cv, helpers)
        with RULE.fan_out():
            with lock:
                while len(self._threads) < helpers:
                    t = threading.Thread(target=self._loop, daemon=True,
                                         name=f"runtime-cpu-kernel-{len(self._threads)}")
                    if not _start_thread(t):     # SOAK7: it died before it ran: fewer
                        break                   # helpers this time (pieces go to who asks)
                    self._threads.append(t)
                self._jobs.append(job)
                cv.notify_all()             # callers waiting on their jobs wait here too
            try:
                job.work()
            finally:
                with lock:
                    if job in self._jobs:
                        self._jobs.remove(job)
                    if job.next < len(pieces):          # SOAK8: interrupted before work()
                        job.left -= len(pieces) - job.next    # ran: nobody hands them out
                        job.next = len(pieces)                # now (the caller waited for
                    while job.left:                     # ever); pieces other threads are in
                        cv.wait()
        if job.error is not None:
            raise job.error

    def _loop(self) -> None:
        cv = self._cv
        while True:
            with self._lock:
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


#: code of the functions inside which a thread may run a BLAS call on OpenBLAS's own threads
#: (``runtime.kernels.nn._whole``): a fork waits for them (:func:`_before_fork`)
WHOLE_CODES: set = set()
#: most seconds a fork waits for such calls to end (then it goes on)
FORK_WAIT_S = 2.0
_FORKING = False            # a fork is waiting or under way: no whole call starts


def _before_fork() -> None:
    """(``os.register_at_fork``) Let no BLAS call run on OpenBLAS's own threads across a fork
    (SOAK9): OpenBLAS's own fork handler (``blas_thread_shutdown_``) stops its workers while a
    threaded call's worker may still be finishing its share, which then clears the stop order
    and sleeps for ever; the handler waits for it for ever, in ``fork()`` with the GIL held:
    the whole process hung (``tests/test_fork.py``: a fork from one thread while another runs
    matmuls; numpy alone: ``a @ a`` on a thread and a fork on another, within a few hundred
    forks). New whole calls take pieces (one-thread BLAS) from now until the fork returned;
    those in flight are waited for, at most :data:`FORK_WAIT_S`."""
    global _FORKING
    _FORKING = True
    if not WHOLE_CODES:
        return
    me = threading.get_ident()
    end = time.monotonic() + FORK_WAIT_S
    while time.monotonic() < end:
        for tid, f in _current_frames().items():
            while tid != me and f is not None and f.f_code not in WHOLE_CODES:
                f = f.f_back
            if tid != me and f is not None:
                break                               # a thread is in a whole call: wait
        else:
            return
        time.sleep(0.0005)


def _after_fork_in_parent() -> None:
    global _FORKING
    _FORKING = False


def _after_fork_in_child() -> None:
    # only the forking thread comes along: no stream item executes here, the fan-out threads
    # are gone, and a lock another thread held at the fork would be held forever
    global _FORKING
    _FORKING = False
    RULE._lock = threading.Lock()
    RULE.active = RULE.fan_outs = 0
    RULE.cpu = CpuShare()
    RULE.whole = WholeCalls(mode=whole_mode_from_env(strict=False))
    RULE.choice = ThreadChoice(RULE._starved, mode=RULE.choice.mode)
    RULE._blas_now = None                      # the owner thread stayed in the parent
    BLAS_OWNER.__init__(BLAS_OWNER.timeout_s)
    FAN_OUT.__init__()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
