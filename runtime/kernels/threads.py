"""The cpu thread rule's old import path: it lives in :mod:`runtime.cpu_threads` (a leaf
module), re-exported here for code that imports it from ``runtime.kernels.threads``."""

from ..cpu_threads import (BLAS_ENV, FAN_OUT, RULE, FanOutPool, ThreadRule,  # noqa: F401
                           available_cores, limit_blas_threads)
