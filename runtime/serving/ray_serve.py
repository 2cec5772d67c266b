"""The embeddings server as a Ray Serve deployment: one MiniLM and one batcher per replica.

Each replica is a Ray actor that builds the single-process server's
:class:`runtime.serving.replica.Replica` from the same settings (every ``serve`` flag): it loads
all-MiniLM-L6-v2 once on its device (its own device server and captured bucket graphs) and
serves the app (:func:`runtime.serving.create_app`) through Serve's ASGI ingress:
``POST /v1/embeddings``, ``GET /v1/models``, ``GET /health`` and ``GET /metrics``, answered by
whichever replica Serve's router picked (the metrics are that replica's; Serve's own
request metrics cover the deployment). Every answer carries the replica's id in the
``x-runtime-replica`` header.

Replicas map to devices through ``ray_actor_options``: one GPU each with ``backend="cuda"``
(Ray sets ``CUDA_VISIBLE_DEVICES``, so the replica's device 0 is its own GPU), ``num_cpus``
CPUs otherwise. Serve restarts a replica whose actor dies or whose :meth:`check_health` raises
(its batcher stopped).

``python -m runtime serve --ray`` (:func:`runtime.serving.cli.main_ray`) deploys it;
:func:`build_app` and :func:`deploy` are the library entry points.
"""

from __future__ import annotations

from ray import serve

#: Response header naming the replica that answered.
REPLICA_HEADER = "x-runtime-replica"
#: The Serve application's default name.
APP_NAME = "runtime-embeddings"


class ReplicaServer:
    """What each Serve replica runs (:data:`EmbeddingsReplica` is this class as a Serve
    deployment with ASGI ingress): MiniLM on this actor's device, a batcher, and the embeddings
    app, all built by :class:`runtime.serving.replica.Replica` from the same
    :class:`~runtime.serving.replica.Settings` as ``python -m runtime serve`` in one process.

    Args:
        settings: a :class:`~runtime.serving.replica.Settings`, or a dict of its fields, or
            ``None`` for its defaults (cpu).
    Raises: what ``Replica`` raises (Serve then reports the deployment unhealthy).
    """

    def __init__(self, settings=None):
        from .replica import Replica, Settings

        if not isinstance(settings, Settings):
            settings = Settings(**dict(settings or {}))
        self.settings = settings
        self.core = Replica(settings)
        self.batcher = self.core.batcher
        self.replica = serve.get_replica_context().replica_tag

    def __serve_build_asgi_app__(self):
        """The ASGI app this replica serves (Serve calls it after ``__init__``): the
        single-process server's app over this replica's batcher, plus the replica header."""
        app = self.core.app
        replica = self.replica

        @app.middleware("http")
        async def _name_the_replica(request, call_next):
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = replica
            return response

        return app

    def check_health(self) -> None:
        """Serve's periodic health check. Raises ``RuntimeError`` once the batcher's worker
        stopped (Serve then replaces this replica)."""
        if not self.batcher.alive:
            raise RuntimeError(f"replica {self.replica}: the batcher's worker stopped")

    def __del__(self):
        """Serve's shutdown hook: queued texts run for the ``grace`` setting, the rest get 503
        (as SIGTERM does to the single-process server); spans are flushed."""
        core = getattr(self, "core", None)
        if core is not None:
            try:
                core.close(grace=self.settings.grace)
            except Exception:  # noqa: BLE001 - at interpreter exit modules are gone already
                pass


#: The Serve deployment: :class:`ReplicaServer` behind Serve's ASGI ingress.
EmbeddingsReplica = serve.deployment(name="embeddings", max_ongoing_requests=64)(
    serve.ingress()(ReplicaServer))


def deployment_options(backend: str | None = "cpu", *, replicas: int = 1,
                       min_replicas: int | None = None, max_replicas: int | None = None,
                       target_ongoing_requests: float | None = None, num_cpus: float = 1.0,
                       num_gpus: float | None = None, max_ongoing_requests: int = 64,
                       grace: float | None = None, log_level: str | None = None) -> dict:
    """Serve deployment options (``Deployment.options`` keywords) for the replicas.

    Args:
        backend: the replicas' backend; ``"cuda"`` makes ``num_gpus`` default to 1.
        replicas: replicas to run (the initial count when autoscaling).
        min_replicas, max_replicas, target_ongoing_requests: any of them turns on Serve's
            autoscaling (``autoscaling_config``); unset bounds default to ``replicas``.
        num_cpus: logical CPUs per replica (Ray's ``num_cpus``).
        num_gpus: GPUs per replica; default 1 with ``backend="cuda"``, else 0.
        max_ongoing_requests: requests Serve sends one replica at a time (its batcher batches
            them; more wait in Serve's router).
        grace: the replicas' shutdown grace (s): Serve's ``graceful_shutdown_timeout_s`` is
            ``grace + 5`` (the replica drains its batcher for ``grace`` in ``__del__``).
        log_level: ``serve`` ``--log-level`` (uvicorn's names) for the replicas' Serve logs.
    Returns: ``{"ray_actor_options", "max_ongoing_requests", "num_replicas" or
        "autoscaling_config"}``, plus ``graceful_shutdown_timeout_s`` and ``logging_config``
        when given.
    Raises: ``ValueError`` (a count below 1, ``min > replicas > max``, non-positive target).
    """
    if num_gpus is None:
        num_gpus = 1 if backend == "cuda" else 0
    if replicas < 1 or max_ongoing_requests < 1 or num_cpus < 0 or num_gpus < 0:
        raise ValueError("replicas and max_ongoing_requests must be >= 1, num_cpus and "
                         f"num_gpus >= 0; got {replicas}, {max_ongoing_requests}, {num_cpus}, "
                         f"{num_gpus}")
    opts = {"ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
            "max_ongoing_requests": max_ongoing_requests}
    if grace is not None:
        opts["graceful_shutdown_timeout_s"] = float(grace) + 5.0
    if log_level is not None:
        opts["logging_config"] = {"log_level": {"trace": "DEBUG", "critical": "CRITICAL"}.get(
            log_level, log_level.upper())}
    if min_replicas is None and max_replicas is None and target_ongoing_requests is None:
        opts["num_replicas"] = replicas
        return opts
    lo = replicas if min_replicas is None else min_replicas
    hi = max(replicas, lo) if max_replicas is None else max_replicas
    if not 0 <= lo <= replicas <= hi:
        raise ValueError(f"need 0 <= min_replicas ({lo}) <= replicas ({replicas}) <= "
                         f"max_replicas ({hi})")
    auto = {"min_replicas": lo, "max_replicas": hi, "initial_replicas": replicas}
    if target_ongoing_requests is not None:
        if target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got "
                             f"{target_ongoing_requests}")
        auto["target_ongoing_requests"] = target_ongoing_requests
    opts["autoscaling_config"] = auto
    return opts


def build_app(settings=None, **options):
    """The embeddings deployment, bound and ready for ``serve.run`` (or :func:`deploy`).

    Args:
        settings: the replicas' :class:`~runtime.serving.replica.Settings` (or a dict of its
            fields); its ``grace`` and ``log_level`` also set the deployment's shutdown timeout
            and logging.
        options: :func:`deployment_options` keywords (``replicas``, autoscaling bounds,
            ``num_cpus``, ``num_gpus``, ``max_ongoing_requests``); the backend is
            ``settings.backend``.
    Returns: a ``ray.serve.Application``.
    Raises: ``ValueError`` (from :func:`deployment_options`).
    """
    from .replica import Settings

    if not isinstance(settings, Settings):
        settings = Settings(**dict(settings or {}))
    options.setdefault("grace", settings.grace)
    options.setdefault("log_level", settings.log_level)
    opts = deployment_options(settings.backend, **options)
    return EmbeddingsReplica.options(**opts).bind(settings)


def deploy(app, *, host: str = "127.0.0.1", port: int = 8000, name: str = APP_NAME,
           route_prefix: str = "/") -> str:
    """Start Serve's HTTP proxy on ``host:port`` (if Serve is not running yet) and run ``app``
    under ``route_prefix``; returns once every replica is up.

    Args:
        app: from :func:`build_app`; host, port: where Serve's proxy listens (loopback by
            default; ignored when Serve already runs); name: the Serve application name (one
            name per app: several apps can share the proxy under different prefixes).
    Returns: the app's base URL, ``http://host:port`` plus the prefix.
    Raises: Serve's errors (a replica that fails to start fails the deployment).
    """
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=name, route_prefix=route_prefix)
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


def build_app_from_args(args, settings):
    """:func:`build_app` for parsed ``serve --ray`` arguments: the replicas get ``settings``
    (:func:`runtime.serving.cli.settings_from_args` of the same arguments: what ``serve``
    without ``--ray`` runs), the deployment the Ray flags."""
    return build_app(settings, replicas=args.replicas, min_replicas=args.min_replicas,
                     max_replicas=args.max_replicas,
                     target_ongoing_requests=args.target_ongoing_requests,
                     num_cpus=args.replica_cpus)
