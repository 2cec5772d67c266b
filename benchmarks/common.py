"""The suite's timing helpers, for scripts written against ``benchmarks.common``: they live in
:mod:`runtime.bench` (``compare``, ``interleaved``, ``summarize``, ``machine``, ...)."""

from runtime.bench.results import machine, write_json  # noqa: F401
from runtime.bench.timing import clock, interleaved, ratio, summarize  # noqa: F401
