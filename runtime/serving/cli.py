"""``python -m runtime serve``: the embeddings HTTP server (uvicorn, foreground).

Usage::

    python -m runtime serve [--backend cpu|wgpu|cuda|auto] [--host 127.0.0.1] [--port 8000]
                            [--eager] [--max-graphs 8] [--warmup 1x16,8x32,...]
                            [--max-batch 32] [--max-batch-tokens 8192] [--max-wait-ms 2]
                            [--max-queue 4096] [--max-inputs 2048] [--max-input-chars 100000]
                            [--max-body-bytes 16777216] [--header-timeout 10]
                            [--body-timeout 30] [--grace 10] [--api-key KEY]
                            [--ray [--replicas N] [--address ray://...] [--min-replicas m]
                                   [--max-replicas M] [--target-ongoing-requests t]]

then ``curl -s localhost:8000/v1/embeddings -d '{"input": ["a text", "another"]}'``.
Every limit is a flag (``--help`` lists the defaults). ``RUNTIME_API_KEY`` is read when
``--api-key`` is not given.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from .app import BODY_TIMEOUT, MAX_BODY_BYTES, MAX_INPUT_CHARS, MAX_INPUTS
from .http import GRACE, HEADER_TIMEOUT


def parse_buckets(spec: str) -> list:
    """``"1x16,8x32"`` -> ``[(1, 16), (8, 32)]`` (batch x seq_len).

    Raises: ``argparse.ArgumentTypeError`` on a malformed item.
    """
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            b, s = part.lower().split("x")
            out.append((int(b), int(s)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bucket {part!r} is not BATCHxSEQ, e.g. 8x32")
    return out


def parse_sizes(spec: str) -> tuple:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``: positive sizes, strictly increasing.

    Raises: ``argparse.ArgumentTypeError`` otherwise.
    """
    try:
        sizes = tuple(int(p) for p in spec.split(","))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 1 or list(sizes) != sorted(set(sizes)):
        raise argparse.ArgumentTypeError(f"{spec!r} is not increasing positive sizes, e.g. "
                                         "1,2,4,8,16,32")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    """The ``serve`` argument parser."""
    p = argparse.ArgumentParser(prog="python -m runtime serve",
                                description="Serve all-MiniLM-L6-v2 embeddings over HTTP "
                                "(OpenAI-compatible POST /v1/embeddings, /health, /metrics).")
    p.add_argument("--backend", default="cpu", choices=["cpu", "wgpu", "cuda", "auto"],
                   help="device backend (default: cpu, the embedded default; auto = best)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (0: any free one)")
    p.add_argument("--eager", action="store_true",
                   help="launch kernels one by one instead of replaying bucket graphs")
    p.add_argument("--max-graphs", type=_positive(int), default=8, help="most bucket graphs held (LRU)")
    p.add_argument("--warmup", type=parse_buckets, default=None, metavar="BxS,...",
                   help="capture these buckets at start-up (progress bar), e.g. 1x16,8x32")
    p.add_argument("--batch-buckets", type=parse_sizes, default=None, metavar="B,B,...",
                   help="batch sizes (texts) a batch is padded up to, increasing (default "
                   "1,2,4,8,16,32); denser sizes pad less and hold more graphs (on 2 cores, "
                   "1,2,3,4,6,8,12,16,24,32 served short texts 10-15%% faster at 8 clients)")
    p.add_argument("--max-batch", type=_positive(int), default=32,
                   help="most texts per batch (default 32)")
    p.add_argument("--max-batch-tokens", type=_positive(int), default=None,
                   help="most padded tokens per batch, rows x seq bucket (default max-batch x "
                   "256 = 8192)")
    p.add_argument("--max-wait-ms", type=float, default=2.0,
                   help="how long an idle batcher waits for more texts (ms, default 2)")
    p.add_argument("--max-queue", type=_positive(int), default=4096,
                   help="most texts waiting; beyond it 503 with Retry-After (default 4096)")
    p.add_argument("--max-inputs", type=_positive(int), default=MAX_INPUTS,
                   help=f"most inputs per request (400 beyond; default {MAX_INPUTS})")
    p.add_argument("--max-input-chars", type=_positive(int), default=MAX_INPUT_CHARS,
                   help=f"most characters per text (400 beyond; default {MAX_INPUT_CHARS})")
    p.add_argument("--max-body-bytes", type=_positive(int), default=MAX_BODY_BYTES,
                   help=f"request body limit in bytes (413 beyond; default {MAX_BODY_BYTES})")
    p.add_argument("--header-timeout", type=_positive(float), default=HEADER_TIMEOUT,
                   help=f"seconds to send request headers (408 after; default "
                   f"{HEADER_TIMEOUT:g})")
    p.add_argument("--body-timeout", type=_positive(float), default=BODY_TIMEOUT,
                   help=f"seconds to send the body (408 after; default {BODY_TIMEOUT:g})")
    p.add_argument("--grace", type=float, default=GRACE,
                   help=f"seconds to finish queued work on SIGTERM before answering 503 and "
                   f"exiting (default {GRACE:g})")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(default: $RUNTIME_API_KEY; none: open)")
    p.add_argument("--model-dir", default=None, help="model directory (default: the wheel's)")
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    # -- Ray Serve (issue 18): these flags are read by runtime/serving/ray_serve.py only --------
    g = p.add_argument_group("Ray Serve", "with --ray: replicas of this server on a Ray cluster")
    g.add_argument("--ray", action="store_true",
                   help="deploy on Ray Serve (one model + batcher per replica)")
    g.add_argument("--replicas", type=int, default=1, help="replicas (initial, when autoscaling)")
    g.add_argument("--address", default=None,
                   help="Ray cluster to join (ray://head:10001, head:6379, auto); default: start "
                        "a local one on 127.0.0.1")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling lower bound")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling upper bound")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling target of ongoing requests per replica")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="Ray CPUs per replica (--backend cuda asks one GPU each)")
    return p


def _positive(kind):
    """argparse type: a number of ``kind`` above 0."""
    def parse(text: str):
        v = kind(text)
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return v
    parse.__name__ = kind.__name__
    return parse


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


def _port(text: str) -> int:
    """argparse type: a TCP port 0-65535."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {port}")
    return port


def main(argv=None) -> int:
    """Run the server until interrupted. Returns the exit code (2 when the model is missing)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.ray:                         # Ray Serve (issue 18)
        from .ray_serve import main_ray
        return main_ray(args)
    from . import Batcher, ServingMetrics, create_app, load_model, serve

    backend = None if args.backend == "auto" else args.backend
    try:
        model = load_model(backend, path=args.model_dir, max_graphs=args.max_graphs)
    except (FileNotFoundError, ImportError) as e:
        print(f"cannot load the model: {e}", file=sys.stderr)
        return 2
    metrics = ServingMetrics()
    try:
        batcher = Batcher(model, graph=not args.eager, max_batch=args.max_batch,
                          max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms,
                          max_queue=args.max_queue, metrics=metrics,
                          batch_buckets=args.batch_buckets)
    except ValueError as e:
        print(f"bad limits: {e}", file=sys.stderr)
        return 2
    if args.warmup:
        batcher.warmup(args.warmup)
    api_key = args.api_key or os.environ.get("RUNTIME_API_KEY") or None
    app = create_app(batcher, metrics=metrics, max_inputs=args.max_inputs,
                     max_input_chars=args.max_input_chars, max_body_bytes=args.max_body_bytes,
                     body_timeout=args.body_timeout, api_key=api_key)
    warning = exposure_warning(args.host, api_key)
    if warning:
        print(warning, file=sys.stderr)
    serve(app, host=args.host, port=args.port, grace=args.grace,
          header_timeout=args.header_timeout, log_level=args.log_level,
          banner=f"serving all-MiniLM-L6-v2 on {model.client.backend} "
                 f"({'eager' if args.eager else 'graph'} path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
