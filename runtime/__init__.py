"""runtime: a device-thread compute runtime with graph capture and replay.

One server per device on its own thread owns every buffer, stream and graph; clients on any
thread talk to it through a queue. See ``docs/contract.md`` for the contracts and README.md to
start.

    import numpy as np, runtime
    from runtime import kernels as K
    c = runtime.client("cpu")
    x = c.create(np.arange(4, dtype=np.float32)); y = c.empty(4, np.float32)
    c.graph_prepare(); c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    c.start_capture(); c.launch(K.add_scalar, 1, [x, y], {"alpha": 1.0, "n": 4})
    g = c.stop_capture(); g.replay(); c.read(y)   # -> [1, 2, 3, 4]
"""

from . import _fork  # noqa: F401 - first: its fork handler runs before the others
from .errors import (CaptureRefused, GraphStateError, InvalidHandle, LaunchError, LivenessError,
                     LoopLimitExceeded, OutOfMemory, ReplayFailed, ServerClosed, ServerError,
                     ServerForked, ServerUnhealthy, StreamRaceError, UnknownGraph,
                     UnsupportedError)
from .kernel import Binding, Kernel, Param
from .frontend import ComputeClient, Graph, Handle
from .frontend.client import client
from .frontend.pool import GraphPool
from .streams import Event, StreamId
from .server import available_backends, shutdown
from . import kernels
from .tensor import Tensor
from .captured import CapturedGraph, capture
from .static_graph import StaticGraph
from .tracing import trace, from_env as _trace_from_env

__version__ = "0.1.0"

__all__ = [
    "client", "shutdown", "available_backends", "ComputeClient", "Handle", "Graph", "GraphPool", "StreamId",
    "Event",
    "Kernel", "Binding", "Param", "kernels", "Tensor", "capture", "CapturedGraph", "StaticGraph",
    "trace",
    "ServerError", "GraphStateError", "CaptureRefused", "UnknownGraph", "ReplayFailed",
    "LaunchError", "InvalidHandle", "OutOfMemory", "ServerUnhealthy", "ServerClosed",
    "ServerForked", "LivenessError", "StreamRaceError", "UnsupportedError", "LoopLimitExceeded",
]

_trace_from_env()          # RUNTIME_TRACE=FILE traces the whole process
