"""``runtime.testing``: property-based stream-ordering tests for code built on the runtime.

Four tools, usable alone or together (README "Testing your stream ordering"):

- **Seeded schedules for any test** (the pytest plugin, ``runtime.testing.plugin``, registered
  through the ``pytest11`` entry point): the ``runtime_client`` fixture and the
  ``@pytest.mark.interleavings(n)`` marker run a test once per seed on the cpu backend with the
  interleaving scheduler and ``check=True``, and once on every other available backend; a
  failure prints the seed, the schedule (a trace, saved to a file) and a one-line command
  that reproduces it.
- **Search with a guarantee** (``runtime.testing.search``): PCT, the plugin's default strategy
  (a bug of depth ``d`` is found per run with probability at least ``1/(n k^(d-1))``;
  :func:`pct_runs` says how many runs make a miss unlikely), and a bounded exhaustive search
  with partial-order reduction (``strategy="exhaustive"``). A failure is minimised to the
  fewest context switches and names the racing accesses (operation, stream, buffer, the test
  line that issued each): ``explore(test)`` or the marker's ``strategy=``/``depth=``.
- **Recorded schedules**: the cpu interleaving scheduler records the order it ran stream heads
  (``trace``); ``runtime.client("cpu", scheduler="trace", trace=...)`` runs it again exactly.
- **Programs over your kernels**: ``programs(kernels=[...])`` is a hypothesis strategy of
  multi-client, multi-stream programs (create, write, launch, read, free, events, capture,
  capture into a ``runtime.GraphPool``, replay, clone, release, ``capture_if``/``capture_while``, ``Graph.update``;
  with ``indirect=True`` indirect launches over counts computed on the device), and ``run_program(program, backend=..., seed=...)`` runs one and
  compares every read with a sequential model built from the kernels' cpu bodies; a failure
  prints the (shrunk) program as Python calls you can paste.

``import runtime.testing`` needs numpy only; ``programs()`` imports hypothesis when called.
"""

from ..backends.cpu_schedule import decode_trace, encode_trace
from .program import (CaptureIf, CaptureWhile, Clone, Create, CreateFlag, Empty, Free,
                      Instantiate, KernelSpec, Launch, Prepare, PreparePool, Program, Read, RecordEvent, Release, Replay,
                      StartCapture, StopCapture, Sync, Thread, Update, UpdateCount, WaitEvent, Write,
                      copy32, LaunchIndirect,
                      count_down, set_counter, set_counts)
from ..server import backend_unavailable
from .run import ProgramMismatch, ProgramRun, Step, run_program
from .search import ScheduleFailure, explore, pct_runs
from .strategies import programs

__all__ = ["programs", "run_program", "explore", "pct_runs", "ScheduleFailure", "Program",
           "ProgramRun", "ProgramMismatch", "Step",
           "KernelSpec", "copy32", "backend_unavailable", "encode_trace", "decode_trace",
           "Create", "Empty", "Write", "Launch", "Read", "Free", "Sync", "RecordEvent",
           "WaitEvent", "Prepare", "PreparePool", "StartCapture", "StopCapture", "Replay", "Release", "Clone",
           "CreateFlag", "CaptureIf", "CaptureWhile", "Update", "UpdateCount", "Instantiate",
           "set_counter",
           "count_down", "Thread", "LaunchIndirect", "set_counts"]
