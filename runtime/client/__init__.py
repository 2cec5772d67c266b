"""The client side: ``ComputeClient``, ``Handle``, ``Graph``, ``StreamId`` (docs/contract.md
section 2)."""

from .client import ComputeClient, client
from .graph import Graph
from .handle import Handle
from ..streams import StreamId

__all__ = ["ComputeClient", "client", "Graph", "Handle", "StreamId"]
