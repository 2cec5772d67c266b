"""``python -m runtime embed-corpus INPUT --out OUTPUT [--ray]``: embed a corpus file.

Usage::

    python -m runtime embed-corpus corpus.jsonl --out corpus.parquet [--overwrite]
        [--text-column text] [--backend cpu|wgpu|cuda|auto] [--batch-size 256]
        [--block-rows 4096] [--max-graphs 8] [--model-dir DIR] [--seq-buckets 16,32,64,128,256]
    python -m runtime embed-corpus corpus.jsonl --out corpus_embedded/ --ray [--resume]
        [--single-file] [--address ray://head:10001] [--actors 2] [--actor-cpus 1] ...

An existing ``--out`` is never replaced silently: an output file that exists, or a non-empty
``--ray`` folder without ``--resume``, is refused (status 2) unless ``--overwrite`` is given
(which replaces the file, or the part files and manifest an earlier run wrote in the folder).

Without ``--ray`` the output is one Parquet file. With ``--ray`` it is a folder, a Parquet
dataset the Ray workers write (``part-NNNNNN.parquet`` per block, ``input_row`` first);
``--single-file`` merges it into the one file ``--out`` instead; ``--resume`` finishes a run
that crashed or was stopped, skipping the blocks it had written.

Exit status: 0 when every row was embedded, 1 when some rows failed (they are in the output
with a null ``embedding`` and the reason in ``embedding_error``; the first ones are printed;
a text value that is not a string is kept as its JSON text in a ``text_raw`` column),
2 on bad input (missing file, unknown format, a text column in no row, no rows), 130 when
interrupted (SIGINT or SIGTERM: no ``.partial`` file is left; with ``--ray`` the finished
blocks stay for ``--resume``). The in-process and ``--ray`` paths give the same rows and the
same status on every input.
"""

from __future__ import annotations

import argparse
import sys

from .. import flags


def build_parser() -> argparse.ArgumentParser:
    """The ``embed-corpus`` argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m runtime embed-corpus",
        description="Embed the text column of a JSON Lines, CSV or Parquet file with "
        "all-MiniLM-L6-v2; write Parquet with the original columns plus 'embedding' "
        "(float32 x 384) and 'embedding_error', in order. A row whose text is not a string "
        "keeps a null embedding and the reason (and its value in '<text column>_raw'); exit "
        "status 1 when any row failed, 2 on bad input.")
    p.add_argument("input", help="a .jsonl, .csv or .parquet file")
    p.add_argument("--out", required=True,
                   help="the Parquet file to write (with --ray: the dataset folder)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out (the file; with --ray a dataset folder an "
                   "earlier run wrote); without it an existing --out file, or a non-empty "
                   "--ray folder without --resume, is refused (exit status 2)")
    p.add_argument("--text-column", default="text",
                   help="the column holding the texts (default: text)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "wgpu", "cuda", "auto"],
                   help="device backend of each embedder (default: cpu)")
    p.add_argument("--batch-size", type=flags.positive(int), default=256,
                   help="rows per embedder call (default 256)")
    p.add_argument("--block-rows", type=flags.positive(int), default=4096,
                   help="rows per block: the unit each worker reads, embeds and writes, and "
                   "that --resume skips (default 4096)")
    p.add_argument("--max-graphs", type=flags.positive(int), default=8,
                   help="most bucket graphs per embedder (default 8)")
    p.add_argument("--seq-buckets", type=flags.seq_sizes, default=None, metavar="N,N,...",
                   help="sequence-length buckets in tokens, the last >= 256 (default "
                        "16,32,64,128,256; add 8 for corpora of very short texts)")
    p.add_argument("--model-dir", default=None, help="model directory (default: the wheel's)")
    g = p.add_argument_group("Ray Data", "with --ray: an actor pool on a Ray cluster")
    g.add_argument("--ray", action="store_true", help="embed with a Ray Data actor pool")
    g.add_argument("--address", default=None,
                   help="Ray cluster to join (default: start a local one on 127.0.0.1)")
    g.add_argument("--actors", type=flags.positive(int), default=1,
                   help="actors (one model + device each; default 1)")
    g.add_argument("--resume", action="store_true",
                   help="finish the run that wrote --out: skip its finished blocks")
    g.add_argument("--single-file", action="store_true",
                   help="merge the dataset into the one Parquet file --out")
    g.add_argument("--actor-cpus", type=flags.non_negative(float), default=1.0,
                   help="Ray CPUs per actor (default 1; --backend cuda asks one GPU each)")
    return p


def main(argv=None) -> int:
    """Run ``embed-corpus``; returns the exit status (see the module docstring)."""
    import signal

    p = build_parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for flag in ("resume", "single_file", "address"):
        if getattr(args, flag) not in (None, False) and not args.ray:
            p.error(f"argument --{flag.replace('_', '-')}: only with --ray")
    from .run import check_output, embed_corpus

    settings = {"backend": None if args.backend == "auto" else args.backend,
                "model_dir": args.model_dir, "max_graphs": args.max_graphs,
                "seq_buckets": args.seq_buckets}
    # SIGTERM stops the run as Ctrl-C does: the with-blocks clean up (no .partial file left);
    # the caller's handler is back afterwards (a process that goes on: a test, a notebook)
    caller = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return _run(args, settings, check_output, embed_corpus)
    finally:
        signal.signal(signal.SIGTERM, caller)


def _run(args, settings, check_output, embed_corpus) -> int:
    """:func:`main` once its flags are read and SIGTERM is Ctrl-C's: the run and its summary."""
    # refused before a model loads or Ray starts (seconds), not after
    check_output(args.out, args.ray, args.single_file, args.resume, args.overwrite,
                 args.input)
    if args.ray:
        from ..cluster import init_ray
        init_ray(args.address)
    try:
        summary = embed_corpus(args.input, args.out, text_column=args.text_column,
                               use_ray=args.ray, actors=args.actors,
                               batch_size=args.batch_size, block_rows=args.block_rows,
                               actor_cpus=args.actor_cpus, resume=args.resume,
                               single_file=args.single_file, overwrite=args.overwrite,
                               **settings)
    except KeyboardInterrupt:
        if args.ray:
            print(f"interrupted: the finished blocks are in {args.out}"
                  f"{'.parts' if args.single_file else ''}; rerun with --resume to finish",
                  file=sys.stderr)
        raise
    resumed = f" ({summary.resumed} of {summary.blocks} blocks resumed)" if summary.resumed \
        else ""
    print(f"{summary.rows} rows -> {summary.output} in {summary.seconds:.1f} s "
          f"({summary.rows / max(summary.seconds, 1e-9):.1f} rows/s); "
          f"{summary.failed} failed{resumed}", file=sys.stderr)
    for row, msg in summary.failures:
        print(f"  row {row}: {msg}", file=sys.stderr)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
