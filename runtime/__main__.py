"""Command line: ``python -m runtime <command>``.

Commands: ``demo`` (the embeddings server demo), ``serve``, ``embed``, ``embed-corpus``,
``bench``, ``capture-demo``, ``trace`` (``trace check FILE...``: validate trace files). Each is
imported only when asked for.

A command that fails prints one line, ``python -m runtime <command>: <Error>: <message>``, on
stderr and exits non-zero (2 for bad input: a runtime error, ``ValueError``, a missing file; 1
for anything else; 130 on Ctrl-C), never a traceback. ``RUNTIME_TRACEBACK=1`` shows the
traceback instead (for a bug report). A bad flag or flag value gets argparse's answer before
the command starts: the command's usage, one ``error:`` line, exit status 2.
"""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {
    "demo": ("runtime.serving.demo", "main", "serve MiniLM on the embedded default and load it"),
    "serve": ("runtime.serving.cli", "main", "start the embeddings HTTP server"),
    "embed": ("runtime.models.cli", "embed_main", "print embeddings of texts"),
    "embed-corpus": ("runtime.corpus.cli", "main", "embed a JSONL/CSV/Parquet file into Parquet"),
    "bench": ("runtime.bench.suite", "main", "run the latency benchmarks"),
    "capture-demo": ("runtime.bench.capture_demo", "main", "capture a launch chain and replay it"),
    "trace": ("runtime.tracing", "main", "check Chrome trace files: trace check FILE..."),
}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def main(argv=None) -> int:
    """Run one command; returns its exit status (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("--version", "-V"):
        from . import __version__
        print(f"runtime {__version__}")
        return 0
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        print(f"python -m runtime: unknown command {argv[0]!r}\n", file=sys.stderr)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m runtime <command> [options]   (--version: the version)\n\n"
              "commands:")
        for name, (_, _, doc) in COMMANDS.items():
            print(f"  {name:13s} {doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    mod, fn, _ = COMMANDS[argv[0]]
    from .errors import ServerError
    try:
        return getattr(importlib.import_module(mod), fn)(argv[1:]) or 0
    except KeyboardInterrupt:
        print(f"python -m runtime {argv[0]}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, never a traceback (see the docstring)
        if os.environ.get("RUNTIME_TRACEBACK") == "1":
            raise
        print(f"python -m runtime {argv[0]}: {_first_line(e)}", file=sys.stderr)
        bad_input = isinstance(e, (ServerError, ValueError, FileNotFoundError))
        return 2 if bad_input else 1


if __name__ == "__main__":
    sys.exit(main())
