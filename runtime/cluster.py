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
import threading
import time

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


#: seconds :func:`stop_serve` gives Serve's cleanup beyond the replicas' grace
STOP_MARGIN_S = 30.0


def _local_raylet():
    """The raylet process (``subprocess.Popen``) of the local cluster this process started, or
    None (joined a cluster, or a Ray without that record)."""
    try:
        import ray

        node = ray._private.worker._global_node
        infos = node.all_processes.get("raylet") if node is not None else None
        return infos[0].process if infos else None
    except Exception:  # noqa: BLE001 - private API: without it, only the bound applies
        return None


def stop_serve(app_name: str, *, local: bool, grace_s: float = 0.0) -> bool:
    """Delete Serve application ``app_name`` and, for a ``local`` cluster this process started,
    stop Serve and Ray; never longer than the cluster lives or ``grace_s`` +
    :data:`STOP_MARGIN_S` seconds.

    SOAK8: a SIGTERM to the process group of ``serve --ray`` (``kill -TERM -PGID``, a service
    manager, ``timeout``) also reaches the local cluster's processes, which Ray starts in that
    group with only SIGINT blocked: its raylet shuts down, and ``serve.delete`` waited on the
    dead controller until Ray's GCS client gave up after 60 s and ended the process with status
    1, spinning a core meanwhile. The cleanup runs on a thread; the caller stops waiting for it
    when the local raylet exits (nothing is left to drain) or the bound passes, then stops Ray.

    Returns: whether Serve's cleanup finished (False: skipped, the cluster was going away).
    """
    from ray import serve

    raylet = _local_raylet() if local else None
    finished = threading.Event()

    def clean():
        try:
            serve.delete(app_name)
            if local:
                serve.shutdown()
            finished.set()
        except Exception:  # noqa: BLE001 - a cluster going away: Ray's shutdown below
            pass
    t = threading.Thread(target=clean, name="runtime-serve-stop", daemon=True)
    t.start()
    end = time.monotonic() + max(0.0, grace_s) + STOP_MARGIN_S
    while t.is_alive() and time.monotonic() < end:
        if raylet is not None and raylet.poll() is not None:
            break                       # the local cluster is stopping: nothing to drain
        t.join(0.1)
    if local:
        import ray

        ray.shutdown()
    return finished.is_set()
