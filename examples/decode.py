"""Greedy decoding with one captured decode step, eager vs replayed.

    python examples/decode.py                       # cpu, 64 tokens
    python examples/decode.py --backend wgpu --tokens 64 --repeats 3
    python examples/decode.py --end-token 7         # tokens up to token 7 (every mode)

The decoder (``runtime.models.decoder``) has random weights (seed 0): the tokens are
deterministic but meaningless. The step reads the token id and the position from device buffers,
appends to a device KV cache, takes the argmax on the device and feeds the chosen token back into
the token buffer with a device copy, so one captured graph serves every step.

It decodes ``--tokens`` tokens six ways and prints the per-token latency of each (the best of
``--repeats`` runs, after a warm-up that compiles every kernel and captures the step):

- eager, tokens read once at the end / read after every step (a host round trip per token);
- replayed, tokens read once at the end / read after every step;
- one replay per sequence: ``capture_while`` around the step, the end test (last position or
  ``--end-token``) computed on the device by ``kernels.decode.decode_continue``, so the whole
  generation is one ``replay()``: over the raw client (``Decoder.loop_graph``) and as a
  ``StaticGraph(loop="go")`` (``Decoder.sequence_graph``). cpu, wgpu, and cuda with CUDA 12.4
  conditional nodes (a driver without them prints why and skips these rows).

All modes must produce identical tokens (with ``--end-token``, up to and including it); the
script exits with status 1 if they do not. With ``--end-token`` only the per-sequence modes stop
decoding there (the loop's end test runs on the device); the others decode all ``--tokens``
steps and cut after it, so the table's ``steps`` differ and the speed-ups compare per-step times.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import runtime
from runtime.models.decoder import Decoder, DecoderConfig


def _positive(text: str) -> int:
    """An argparse type: an int >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv=None) -> int:
    """Run the comparison; returns the exit status (0: identical tokens). A bad flag value
    exits with status 2 and one ``error:`` line (argparse's answer), before anything runs."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu", choices=("cpu", "wgpu", "cuda"),
                    help="cpu | wgpu | cuda (default cpu)")
    ap.add_argument("--tokens", type=_positive, default=64,
                    help="tokens to generate (default 64)")
    ap.add_argument("--prompt", type=int, nargs="+", default=[1], help="prompt token ids")
    ap.add_argument("--repeats", type=_positive, default=3,
                    help="timed runs per mode (best kept)")
    ap.add_argument("--layers", type=_positive, default=2, help="decoder layers (default 2)")
    ap.add_argument("--dim", type=_positive, default=64, help="model width (default 64)")
    ap.add_argument("--end-token", type=int, default=None,
                    help="stop after this token id (default: generate --tokens tokens)")
    args = ap.parse_args(argv)

    try:
        cfg = DecoderConfig(layers=args.layers, dim=args.dim,
                            max_len=max(128, len(args.prompt) + args.tokens))
        cfg.check()
    except ValueError as e:
        ap.error(f"--layers/--dim: {e}")
    if any(not 0 <= t < cfg.vocab for t in args.prompt):
        ap.error(f"argument --prompt: token ids must be in [0, {cfg.vocab}), got {args.prompt}")
    if args.end_token is not None and not 0 <= args.end_token < cfg.vocab:
        ap.error(f"argument --end-token: a token id in [0, {cfg.vocab}), got {args.end_token}")
    try:
        client = runtime.client(args.backend)
    except runtime.UnsupportedError as e:
        ap.error(f"argument --backend: {e}")
    dec = Decoder(client, cfg)
    print(f"backend {args.backend} ({dec.client.device_name}); decoder {cfg}; random weights, "
          f"seed {cfg.seed}")
    # warm-up: compile every kernel and capture the step graph
    dec.generate(args.prompt, 2)
    g = dec.step_graph()
    dec.generate(args.prompt, 2, graph=True)
    print(f"step graph: {g.recorded and 'recorded' or 'fallback'}, hardware={g.is_hardware}, "
          f"{g.graph.info()['launches'] if g.recorded else '-'} launches per replay")

    modes = [(f"{'replayed' if graph else 'eager':8s} read {'each step' if each else 'at end':9s}",
              dict(graph=graph, read_each_step=each)) for graph in (False, True)
             for each in (False, True)]
    for name, kw in (("one replay per sequence", dict(per_sequence=True)),
                     ("StaticGraph, one per sequence", dict(per_sequence=True, graph=True))):
        try:
            dec.generate(args.prompt, 2, **kw)                # captures the loop graph
            modes.append((name, kw))
        except runtime.UnsupportedError as e:
            print(f"{name}: not available here ({e})")
    rows, tokens = [], {}
    for name, kw in modes:
        best, toks = None, None
        for _ in range(max(1, args.repeats)):
            t = {}
            toks = dec.generate(args.prompt, args.tokens, timings=t, end_token=args.end_token,
                                **kw)
            best = t if best is None or t["per_token_ms"] < best["per_token_ms"] else best
        rows.append((name, best))
        tokens[name] = toks
    print(f"\n{'mode':30s} {'steps':>5s} {'per token (ms)':>15s} {'total (ms)':>11s}")
    for name, t in rows:
        print(f"{name:30s} {t['steps']:5d} {t['per_token_ms']:15.3f} {1e3 * t['seconds']:11.1f}")
    first = next(iter(tokens.values()))
    same = all(np.array_equal(first, v) for v in tokens.values())
    print(f"\ntokens ({len(first)}): {first.tolist()}")
    print("identical tokens in every mode:", same)
    eager = rows[0][1]["per_token_ms"]
    replay = rows[2][1]["per_token_ms"]
    print(f"replay speed-up (read at end): {eager / replay:.1f}x")
    for name, t in rows[4:]:
        print(f"{name} speed-up: {eager / t['per_token_ms']:.1f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
