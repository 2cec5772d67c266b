"""The client side: ``ComputeClient``, ``Handle``, ``Graph``, ``StreamId`` (docs/contract.md
section 2). ``runtime.client()`` lives in :mod:`runtime.frontend.client`; ``StreamId`` in
:mod:`runtime.streams` (below client and server)."""

from .client import ComputeClient
from .graph import Graph
from .handle import Handle
from ..streams import Event, StreamId

__all__ = ["ComputeClient", "Graph", "Handle", "StreamId", "Event"]
