"""What a user would pick instead: sentence-transformers' throughput on the same texts.

``python -m runtime demo`` prints its served throughput beside :func:`anchor_throughput`, which
times ``SentenceTransformer(<the same model directory>).encode(texts, batch_size=32)`` (its
default batch size) in a fresh process, on torch's default threads. sentence-transformers is not
a dependency: it runs with ``python`` (``--st-python`` / ``RUNTIME_ST_PYTHON``, e.g. a side
virtualenv made with ``--system-site-packages``), or with this interpreter when it can import
sentence-transformers; otherwise nothing is measured.

The worker half (``python -m runtime.serving.anchor``) reads ``{"texts", "model_dir",
"batch_size", "rounds"}`` as JSON on stdin and writes ``{"texts_per_s", "threads", ...}`` on
stdout; it starts no runtime backend, so the cpu thread rule (one BLAS thread) is not applied
there and torch keeps its own defaults.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time


def st_python(explicit: str | None = None) -> str | None:
    """The interpreter to run sentence-transformers with: ``explicit``, ``$RUNTIME_ST_PYTHON``,
    this interpreter if it has sentence-transformers, else ``None``."""
    p = explicit or os.environ.get("RUNTIME_ST_PYTHON")
    if p:
        return p
    return sys.executable if importlib.util.find_spec("sentence_transformers") else None


def anchor_throughput(texts: list, model_dir: str, batch_size: int = 32, rounds: int = 3,
                      python: str | None = None, timeout_s: float = 600.0) -> dict | None:
    """sentence-transformers' throughput (texts/s) on ``texts``, or ``None`` where it is absent.

    Args:
        texts: the sentences; model_dir: the all-MiniLM-L6-v2 directory the runtime loaded.
        batch_size: ``encode``'s batch size (32 is its default); rounds: timed passes over all
            ``texts`` after one untimed warm-up pass (the median pass is reported).
        python: the interpreter (see :func:`st_python`); timeout_s: limit for the whole run.
    Returns: ``{"texts_per_s", "min", "max", "threads", "versions"}`` (the median, slowest and
        fastest pass) or ``None``.
    Raises: ``RuntimeError`` when the worker fails or times out.
    """
    py = st_python(python)
    if py is None:
        return None
    job = json.dumps({"texts": list(texts), "model_dir": str(model_dir),
                      "batch_size": int(batch_size), "rounds": int(rounds)})
    try:
        proc = subprocess.run([py, "-m", "runtime.serving.anchor"], input=job,
                              capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  filter(None, [_root(), os.environ.get("PYTHONPATH")]))})
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"sentence-transformers run exceeded {timeout_s:.0f} s") from e
    if proc.returncode != 0:
        raise RuntimeError(f"sentence-transformers run failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker() -> None:
    job = json.loads(sys.stdin.read())
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(job["model_dir"], device="cpu")
    texts, bs = job["texts"], job["batch_size"]
    model.encode(texts, batch_size=bs)                      # warm-up
    rates = []
    for _ in range(max(1, job["rounds"])):
        t0 = time.perf_counter()
        model.encode(texts, batch_size=bs)
        rates.append(len(texts) / (time.perf_counter() - t0))
    rates.sort()
    import sentence_transformers
    print(json.dumps({"texts_per_s": rates[len(rates) // 2], "min": rates[0], "max": rates[-1],
                      "threads": {"torch": torch.get_num_threads()},
                      "versions": {"torch": torch.__version__,
                                   "sentence_transformers": sentence_transformers.__version__}}))


if __name__ == "__main__":
    _worker()
