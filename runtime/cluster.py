"""Joining or starting the Ray cluster that ``serve --ray`` and ``embed-corpus --ray`` run on.

Without an address a one-machine cluster is started on loopback: its node address is
127.0.0.1, so its processes reach each other (and Serve's proxy its replicas) over loopback
only, as the single-process server binds 127.0.0.1 by default. (A few Ray servers still bind
every interface, e.g. a Serve replica's internal gRPC port; nothing of the cluster dials them
on another address.) Ray itself replaces a loopback node address with the machine's routable
one unless its ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` switch is off
(``ray/_private/ray_constants.py``, read when ``ray`` is imported), so :func:`init_ray` turns
it off (the environment variable, and the constant it sets if ray is already imported) and
then checks with ``ray.nodes()`` that it held. With an address (``ray://head:10001`` for Ray
Client, ``head:6379`` for a driver on a cluster node, or ``auto``) it joins that cluster as it
is.
"""

from __future__ import annotations

import os
import sys

LOOPBACK = "127.0.0.1"
_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class NotLoopback(RuntimeError):
    """A local cluster that should be loopback-only came up on another address."""


def node_addresses() -> list:
    """The IP address of every live node of the connected cluster (``ray.nodes()``)."""
    import ray

    return [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive", True)]


def init_ray(address: str | None = None, *, num_cpus: float | None = None,
             log_to_driver: bool = True, retries: int = 1, **kwargs):
    """Connect this process to Ray: join ``address``, or start a loopback-only local cluster.

    Args:
        address: a cluster to join (``ray://host:10001``, ``host:6379``, ``auto``), or ``None``
            to start a new local cluster on 127.0.0.1 (no dashboard).
        num_cpus: logical CPUs of the local cluster (default: all); ignored when joining.
        log_to_driver: forward workers' output to this process.
        retries: further attempts to start a local cluster after a failed start (Ray gives its
            node 30 s to register, which an overloaded machine can miss).
        kwargs: more ``ray.init`` arguments.
    Returns: what ``ray.init`` returns (its context). If Ray is already initialised here, that
        connection is kept and ``None`` is returned.
    Raises: ``ImportError`` (``pip install 'runtime[ray]'``); :class:`NotLoopback` when a local
        cluster came up with a node address other than 127.0.0.1 (it is shut down first);
        Ray's ``ConnectionError`` when ``address`` cannot be reached.
    """
    if address is None:
        os.environ[_SWITCH] = "0"        # read at `import ray`, and by the workers it starts
        consts = getattr(getattr(sys.modules.get("ray"), "_private", None), "ray_constants", None)
        if consts is not None and hasattr(consts, "ENABLE_RAY_CLUSTER"):
            consts.ENABLE_RAY_CLUSTER = False    # ray was imported first: same switch, late
    import ray

    if ray.is_initialized():
        return None
    if address is not None:
        return ray.init(address=address, log_to_driver=log_to_driver, **kwargs)
    for attempt in range(1 + max(0, int(retries))):
        try:
            ctx = ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK,
                           include_dashboard=False, log_to_driver=log_to_driver, **kwargs)
            break
        except Exception:                # Ray raises a bare Exception on a start-up timeout
            ray.shutdown()
            if attempt >= retries:
                raise
    bad = [a for a in node_addresses() if a != LOOPBACK]
    if bad:
        ray.shutdown()
        raise NotLoopback(f"the local Ray cluster came up on {bad}, not {LOOPBACK} only; set "
                           f"{_SWITCH}=0 before starting Python")
    return ctx
