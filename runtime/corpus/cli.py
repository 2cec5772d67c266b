"""``python -m runtime embed-corpus INPUT --out OUTPUT [--ray]``: embed a corpus file.

Usage::

    python -m runtime embed-corpus corpus.jsonl --out corpus.parquet [--text-column text]
        [--ray [--address ray://head:10001] [--actors 2] [--actor-cpus 1]]
        [--backend cpu|wgpu|cuda|auto] [--batch-size 256] [--max-graphs 8] [--model-dir DIR]
        [--seq-buckets 16,32,64,128,256]

Exit status: 0 when every row was embedded, 1 when some rows failed (they are in the output
with a null ``embedding`` and the reason in ``embedding_error``; the first ones are printed),
2 on bad input (missing file, unknown format, no such column).
"""

from __future__ import annotations

import argparse
import sys

from .. import flags


def build_parser() -> argparse.ArgumentParser:
    """The ``embed-corpus`` argument parser."""
    p = argparse.ArgumentParser(prog="python -m runtime embed-corpus",
                                description="Embed the text column of a JSON Lines, CSV or "
                                "Parquet file with all-MiniLM-L6-v2; write Parquet with the "
                                "original columns plus 'embedding' (float32 x 384), in order.")
    p.add_argument("input", help="a .jsonl, .csv or .parquet file")
    p.add_argument("--out", required=True, help="the Parquet file to write")
    p.add_argument("--text-column", default="text", help="the column holding the texts")
    p.add_argument("--backend", default="cpu", choices=["cpu", "wgpu", "cuda", "auto"],
                   help="device backend of each embedder (default: cpu)")
    p.add_argument("--batch-size", type=flags.positive(int), default=256,
                   help="rows per embedder call")
    p.add_argument("--max-graphs", type=flags.positive(int), default=8,
                   help="most bucket graphs per embedder")
    p.add_argument("--seq-buckets", type=flags.seq_sizes, default=None, metavar="N,N,...",
                   help="sequence-length buckets in tokens, the last >= 256 (default "
                        "16,32,64,128,256; add 8 for corpora of very short texts)")
    p.add_argument("--model-dir", default=None, help="model directory (default: the wheel's)")
    g = p.add_argument_group("Ray Data", "with --ray: an actor pool on a Ray cluster")
    g.add_argument("--ray", action="store_true", help="embed with a Ray Data actor pool")
    g.add_argument("--address", default=None,
                   help="Ray cluster to join (default: start a local one on 127.0.0.1)")
    g.add_argument("--actors", type=flags.positive(int), default=1,
                   help="actors (one model + device each)")
    g.add_argument("--actor-cpus", type=flags.non_negative(float), default=1.0,
                   help="Ray CPUs per actor (--backend cuda asks one GPU each)")
    return p


def main(argv=None) -> int:
    """Run ``embed-corpus``; returns the exit status (see the module docstring)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from .run import embed_corpus

    settings = {"backend": None if args.backend == "auto" else args.backend,
                "model_dir": args.model_dir, "max_graphs": args.max_graphs,
                "seq_buckets": args.seq_buckets}
    if args.ray:
        from ..cluster import init_ray
        init_ray(args.address)
    summary = embed_corpus(args.input, args.out, text_column=args.text_column,
                           use_ray=args.ray, actors=args.actors, batch_size=args.batch_size,
                           actor_cpus=args.actor_cpus, **settings)
    print(f"{summary.rows} rows -> {summary.output} in {summary.seconds:.1f} s "
          f"({summary.rows / max(summary.seconds, 1e-9):.1f} rows/s); "
          f"{summary.failed} failed", file=sys.stderr)
    for row, msg in summary.failures:
        print(f"  row {row}: {msg}", file=sys.stderr)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
