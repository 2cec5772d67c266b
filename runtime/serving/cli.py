"""``python -m runtime serve``: the embeddings HTTP server (uvicorn, foreground).

Usage::

    python -m runtime serve [--backend cpu|wgpu|cuda|auto] [--host 127.0.0.1] [--port 8000]
                            [--eager] [--max-graphs 8] [--warmup 1x16,8x32,...]
                            [--max-batch 32] [--max-batch-tokens 8192] [--max-wait-ms 2]
                            [--max-queue 4096] [--max-inputs 2048] [--max-input-chars 100000]
                            [--max-body-bytes 16777216] [--header-timeout 10]
                            [--body-timeout 30] [--grace 10] [--api-key KEY]
                            [--seq-buckets 16,32,...] [--batch-buckets 1,2,4,...]
                            [--token-ids refuse|wordpiece|openai] [--otlp-endpoint URL]
                            [--ray [--replicas N] [--address ray://...] [--min-replicas m]
                                   [--max-replicas M] [--target-ongoing-requests t]]

then ``curl -s localhost:8000/v1/embeddings -d '{"input": ["a text", "another"]}'``.
Every limit is a flag (``--help`` lists the defaults). ``RUNTIME_API_KEY`` is read when
``--api-key`` is not given. ``serve`` and ``serve --ray`` take the same flags, translated once
(:func:`settings_from_args`) into one :class:`runtime.serving.replica.Settings` that both build
their replica from; ``--header-timeout`` alone is refused with ``--ray`` (Serve's proxy reads
the headers).
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import sys

from .. import flags
from .limits import (BODY_TIMEOUT, GRACE, HEADER_TIMEOUT, MAX_BODY_BYTES, MAX_INPUT_CHARS,
                     MAX_INPUTS)
from .replica import Settings
from .token_ids import MODES

#: ``parse_buckets`` and ``parse_sizes`` are the flag validators of :mod:`runtime.flags`.
parse_buckets, parse_sizes = flags.buckets, flags.sizes


def build_parser() -> argparse.ArgumentParser:
    """The ``serve`` argument parser (every value checked by its ``type=``,
    :mod:`runtime.flags`; :func:`parse_args` adds the checks across flags)."""
    positive_int, positive_float = flags.positive(int), flags.positive(float)
    p = argparse.ArgumentParser(prog="python -m runtime serve",
                                description="Serve all-MiniLM-L6-v2 embeddings over HTTP "
                                "(OpenAI-compatible POST /v1/embeddings, GET /v1/models, /health, /metrics).")
    p.add_argument("--backend", default="cpu", choices=["cpu", "wgpu", "cuda", "auto"],
                   help="device backend (default: cpu, the embedded default; auto = best)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    p.add_argument("--port", type=flags.port, default=8000, help="TCP port (default 8000; 0: any free one)")
    p.add_argument("--eager", action="store_true",
                   help="launch kernels one by one instead of replaying bucket graphs")
    p.add_argument("--max-graphs", type=positive_int, default=8,
                   help="most bucket graphs held (LRU)")
    p.add_argument("--warmup", type=flags.buckets, default=None, metavar="BxS,...",
                   help="capture these buckets at start-up (progress bar), e.g. 1x16,8x32; each "
                   "a pair of the batch and sequence buckets")
    p.add_argument("--batch-buckets", type=flags.sizes, default=None, metavar="B,B,...",
                   help="batch sizes (texts) a batch is padded up to, increasing (default "
                   "1,2,4,8,16,32); denser sizes pad less and hold more graphs (on 2 cores, "
                   "1,2,3,4,6,8,12,16,24,32 served short texts 10-15%% faster at 8 clients)")
    p.add_argument("--seq-buckets", type=flags.seq_sizes, default=None, metavar="N,N,...",
                   help="sequence-length buckets in tokens, increasing, the last >= 256 "
                   "(default 16,32,64,128,256)")
    p.add_argument("--max-batch", type=positive_int, default=32,
                   help="most texts per batch (default 32)")
    p.add_argument("--max-batch-tokens", type=flags.at_least(flags.MODEL_TOKENS, "one text of "
                                                             "256 tokens"), default=None,
                   help="most padded tokens per batch, rows x seq bucket (default max-batch x "
                   "256 = 8192)")
    p.add_argument("--max-wait-ms", type=flags.non_negative(float), default=2.0,
                   help="how long an idle batcher waits for more texts (ms, default 2)")
    p.add_argument("--streams", type=positive_int, default=None,
                   help="copies of the model, each on its own stream with its own batcher; "
                   "each request goes to the least loaded (on cpu: while other processes take "
                   "cores, by its sequence bucket under load, concurrent batches one thread "
                   "each; on a free host the first only; "
                   "one more set of graphs per stream, the weights shared; default: 2 on cpu "
                   "with 2 or more cores, else 1)")
    p.add_argument("--max-queue", type=positive_int, default=4096,
                   help="most texts waiting (per stream with --streams: each batcher has its "
                   "own queue); beyond it 503 with Retry-After (default 4096)")
    p.add_argument("--max-inputs", type=positive_int, default=MAX_INPUTS,
                   help=f"most inputs per request (400 beyond; default {MAX_INPUTS})")
    p.add_argument("--max-input-chars", type=positive_int, default=MAX_INPUT_CHARS,
                   help=f"most characters per text (400 beyond; default {MAX_INPUT_CHARS})")
    p.add_argument("--max-body-bytes", type=positive_int, default=MAX_BODY_BYTES,
                   help=f"request body limit in bytes (413 beyond; default {MAX_BODY_BYTES})")
    p.add_argument("--header-timeout", type=positive_float, default=HEADER_TIMEOUT,
                   help=f"seconds to send request headers (408 after; default "
                   f"{HEADER_TIMEOUT:g}; not with --ray: Serve's proxy reads the headers)")
    p.add_argument("--body-timeout", type=positive_float, default=BODY_TIMEOUT,
                   help=f"seconds to send the body (408 after; default {BODY_TIMEOUT:g})")
    p.add_argument("--grace", type=flags.non_negative(float), default=GRACE,
                   help=f"seconds to finish queued work on SIGTERM before answering 503 and "
                   f"exiting (default {GRACE:g}; with --ray, per replica on shutdown)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(default: $RUNTIME_API_KEY; none: open)")
    p.add_argument("--token-ids", default=MODES[0], choices=MODES,
                   help="token-array inputs: refuse them (default; the server embeds text), "
                   "read them as this model's WordPiece ids (wordpiece), or as OpenAI "
                   "cl100k_base ids decoded to text (openai: needs tiktoken and its file in "
                   "TIKTOKEN_CACHE_DIR)")
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="export OpenTelemetry spans per request to this OTLP/HTTP traces URL, "
                   "e.g. http://127.0.0.1:4318/v1/traces (default: no tracing)")
    p.add_argument("--model-dir", default=None, help="model directory (default: the wheel's)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="trace the server (runtime.trace): Chrome trace-event JSON of the last "
                        "events (RUNTIME_TRACE_EVENTS, default 200000) written to FILE on exit; "
                        "open it in ui.perfetto.dev")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level (uvicorn's; with --ray, the replicas' Serve logs)")
    # -- Ray Serve: the same settings, per replica; these flags only with --ray -----------------
    g = p.add_argument_group("Ray Serve", "with --ray: replicas of this server on a Ray cluster")
    g.add_argument("--ray", action="store_true",
                   help="deploy on Ray Serve (one model + batcher per replica)")
    g.add_argument("--replicas", type=positive_int, default=1,
                   help="replicas (initial, when autoscaling)")
    g.add_argument("--address", default=None,
                   help="Ray cluster to join (ray://head:10001, head:6379, auto); default: start "
                        "a local one on 127.0.0.1")
    g.add_argument("--min-replicas", type=flags.non_negative(int), default=None,
                   help="autoscaling lower bound")
    g.add_argument("--max-replicas", type=positive_int, default=None,
                   help="autoscaling upper bound")
    g.add_argument("--target-ongoing-requests", type=positive_float, default=None,
                   help="autoscaling target of ongoing requests per replica")
    g.add_argument("--replica-cpus", type=flags.non_negative(float), default=1.0,
                   help="Ray CPUs per replica (--backend cuda asks one GPU each)")
    return p


RAY_ONLY = ("replicas", "address", "min_replicas", "max_replicas", "target_ongoing_requests",
            "replica_cpus")


def parse_args(argv=None) -> argparse.Namespace:
    """Parse ``serve`` arguments; a bad value or combination gets argparse's answer (usage,
    one ``error:`` line, exit 2) before anything starts."""
    p = build_parser()
    args = p.parse_args(argv)
    flags.check_warmup(p, args.warmup, args.batch_buckets, args.seq_buckets)
    smallest = (args.batch_buckets or (1,))[0]
    if args.max_batch_tokens is not None and args.max_batch_tokens < smallest * \
            flags.MODEL_TOKENS:
        p.error(f"argument --max-batch-tokens: {args.max_batch_tokens} cannot hold "
                f"{smallest} text(s) of {flags.MODEL_TOKENS} tokens (the smallest batch bucket)")
    if args.ray and args.trace:
        p.error("argument --trace: not with --ray (trace one replica: RUNTIME_TRACE=FILE in "
                "its environment)")
    if not args.ray:
        given = [k for k in RAY_ONLY if getattr(args, k) != p.get_default(k)]
        if given:
            p.error(f"argument --{given[0].replace('_', '-')}: only with --ray")
    else:
        if args.header_timeout != HEADER_TIMEOUT:
            p.error("argument --header-timeout: not with --ray (Serve's HTTP proxy reads the "
                    "request headers; the body timeout and every other limit apply per replica)")
        lo, hi = args.min_replicas, args.max_replicas
        if (lo is not None and lo > args.replicas) or (hi is not None and hi < args.replicas):
            p.error(f"argument --replicas: need --min-replicas <= --replicas ({args.replicas}) "
                    "<= --max-replicas")
    return args


def settings_from_args(args) -> Settings:
    """The :class:`Settings` of parsed ``serve`` arguments (the API key: ``--api-key`` or
    ``RUNTIME_API_KEY``): one translation for ``serve`` and ``serve --ray``."""
    return Settings(
        backend=None if args.backend == "auto" else args.backend, model_dir=args.model_dir,
        max_graphs=args.max_graphs, graph=not args.eager,
        warmup=tuple(args.warmup) if args.warmup else None, batch_buckets=args.batch_buckets,
        seq_buckets=args.seq_buckets, max_batch=args.max_batch,
        max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue, max_input_chars=args.max_input_chars, streams=args.streams,
        max_inputs=args.max_inputs, max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout,
        api_key=args.api_key or os.environ.get("RUNTIME_API_KEY") or None,
        token_ids=args.token_ids, otlp_endpoint=args.otlp_endpoint, host=args.host,
        port=args.port, header_timeout=args.header_timeout, grace=args.grace,
        log_level=args.log_level)


def exposure_warning(host: str, api_key) -> str | None:
    """The warning to print when ``host`` is not a loopback address and there is no API key
    (anyone who can reach the port can use the model), else ``None``."""
    if api_key:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:                              # a host name: assume reachable
        loopback = False
    if loopback:
        return None
    return (f"warning: serving on {host} without an API key: anyone who can reach this port can "
            "use the model (set --api-key or RUNTIME_API_KEY)")


def main_ray(args, settings=None) -> int:
    """``python -m runtime serve --ray``: deploy on Ray and serve until interrupted.

    Starts a loopback-only local cluster, or joins ``--address``; deploys ``--replicas``
    replicas (autoscaling with ``--min-replicas``/``--max-replicas``/
    ``--target-ongoing-requests``) of the server built from ``settings`` (every ``serve`` flag)
    behind Serve's proxy on ``--host``:``--port``. On Ctrl-C or SIGTERM the application is
    deleted (each replica drains for ``--grace``) and a local cluster stopped.

    Args: args: the parsed ``serve`` arguments (:func:`runtime.serving.cli.parse_args`);
        settings: their :class:`~runtime.serving.replica.Settings` (default: translated here).
    Returns: the exit status (0).
    Raises: ``ValueError`` (bad counts); Ray's errors (cluster unreachable).
    """
    import signal
    import time

    from ..cluster import init_ray, stop_serve
    from .ray_serve import APP_NAME, build_app_from_args, deploy

    settings = settings or settings_from_args(args)
    app = build_app_from_args(args, settings)
    warning = exposure_warning(settings.host, settings.api_key)
    if warning:
        print(warning, file=sys.stderr)
    if settings.token_ids == "openai":               # fail here, not in every replica
        from .token_ids import load_openai_encoding
        load_openai_encoding()
    init_ray(args.address)
    caller = signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill`: as Ctrl-C
    try:
        url = deploy(app, host=settings.host, port=settings.port)
        print(f"serving all-MiniLM-L6-v2 on Ray Serve ({args.replicas} replica(s), "
              f"{args.backend}, token ids: {settings.token_ids}) at {url}; Ctrl-C stops",
              file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # SOAK8: bounded (a SIGTERM to the process group stops the local cluster too: Serve's
        # cleanup waited 60 s for it, then Ray ended the process with status 1); a second
        # SIGTERM meanwhile does not cut it short (ray.shutdown stops the cluster's processes)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            stop_serve(APP_NAME, local=args.address is None, grace_s=args.grace)
        finally:
            # the caller's handler back: a process that goes on (a test) kept SIGTERM ignored,
            # and every child it started later inherited that (their SIGTERM did nothing)
            signal.signal(signal.SIGTERM, caller)
    return 0


def main(argv=None) -> int:
    """Run the server until interrupted. Returns the exit code (1 when the address cannot be
    listened on: in use, not this host's, or a privileged port; 2 for ``--trace`` with a
    ``RUNTIME_TRACE_EVENTS`` that is not a positive integer). Raises ``ModelFilesMissing``
    naming ``--model-dir`` when the model is missing (``python -m runtime``: one line, 2)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    settings = settings_from_args(args)
    if args.ray:                         # Ray Serve: the same settings, per replica
        return main_ray(args, settings)
    if args.trace:
        return _serve_traced(settings, args.trace)
    return _serve(settings)


def _serve_traced(settings, path: str) -> int:
    """``_serve`` inside ``runtime.trace(path)``; the file is written however the server stops.

    uvicorn re-raises the signal that stopped it once it has shut down; SIGTERM's default action
    would then end the process inside the ``with`` before the trace is written (Ctrl-C raises
    ``KeyboardInterrupt``, which unwinds it). So SIGTERM raises ``SystemExit(143)`` meanwhile
    (the exit status a process killed by it reports in a shell).
    """
    import signal

    from .._env import env_positive_int
    from ..tracing import trace

    try:                                 # a typo: one error line, as for a bad flag
        events = env_positive_int("RUNTIME_TRACE_EVENTS", 200_000)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def _term(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _term)
    try:
        with trace(path, events):
            status = _serve(settings)
    except (KeyboardInterrupt, SystemExit):
        print(f"trace written to {path}", file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"trace written to {path}", file=sys.stderr)
    return status


def _serve(settings) -> int:
    from .http import serve
    from .replica import Replica

    from ..models.minilm import ModelFilesMissing
    try:
        replica = Replica(settings, progress=True)
    except ModelFilesMissing as e:          # one line naming the flag (README "Commands"): 2
        raise e.naming("--model-dir DIR") from None
    streams = len(getattr(replica.batcher, "batchers", (replica.batcher,)))
    warning = exposure_warning(settings.host, settings.api_key)
    if warning:
        print(warning, file=sys.stderr)
    try:
        serve(replica.app, host=settings.host, port=settings.port, grace=settings.grace,
              header_timeout=settings.header_timeout, log_level=settings.log_level,
              banner=f"serving all-MiniLM-L6-v2 on {settings.backend or 'the best backend'} "
                     f"({replica.batcher.path} path"
                     f"{f', {streams} streams' if streams > 1 else ''}"
                     f", token ids: {settings.token_ids})")
    except OSError as e:                # serve binds first: an address in use, not ours, ...
        if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        print(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}; pick another "
              "--port (another process may hold this one), or --port 0 for any free one",
              file=sys.stderr)
        return 1
    finally:
        replica.tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
