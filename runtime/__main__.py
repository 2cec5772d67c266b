"""Command line: ``python -m runtime <command>``.

Commands: ``demo`` (the embeddings server demo), ``serve``, ``embed``, ``embed-corpus``,
``bench``, ``capture-demo``. Each is imported only when asked for.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("runtime.serving.demo", "main", "serve MiniLM on the embedded default and load it"),
    "serve": ("runtime.serving.cli", "main", "start the embeddings HTTP server"),
    "embed": ("runtime.models.cli", "embed_main", "print embeddings of texts"),
    "embed-corpus": ("runtime.corpus.cli", "main", "embed a JSONL/CSV/Parquet file into Parquet"),
    "bench": ("benchmarks.run", "main", "run the latency benchmarks"),
    "capture-demo": ("runtime.demo", "main", "capture a launch chain and replay it"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        print(f"python -m runtime: unknown command {argv[0]!r}\n", file=sys.stderr)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m runtime <command> [options]\n\ncommands:")
        for name, (_, _, doc) in COMMANDS.items():
            print(f"  {name:13s} {doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    mod, fn, _ = COMMANDS[argv[0]]
    if mod.startswith("benchmarks"):
        sys.path.insert(0, ".")
    from .errors import ServerError
    try:
        return getattr(importlib.import_module(mod), fn)(argv[1:]) or 0
    except (ServerError, ValueError, FileNotFoundError) as e:   # bad backend, missing model...
        print(f"python -m runtime {argv[0]}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
