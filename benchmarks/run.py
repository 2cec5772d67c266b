"""``python -m runtime bench``: the latency suite, one JSON file and a markdown report.

    python -m runtime bench [--backend cpu,wgpu] [--quick] [--out DIR] [--readme] [--no-minilm]

Per backend (default: every backend that answers here; cuda only with a GPU):

1. device-thread cost (``benchmarks/device_thread.py``): blocking no-op and empty launch vs the
   backend verbs called with no server, for 1, 2, 4 and 8 client threads;
2. ``Graph.replay()`` enqueue latency vs graph length (``benchmarks/replay.py``);
3. end-to-end passes, eager vs replay vs the raw backend, tiny and large kernels (same file);
4. the MiniLM forward, eager vs replay, and sentence-transformers where installed (here);
5. stalls and growth of the device thread (``benchmarks/stalls.py``): replay latency under
   another client's heavy read, a read under a launch flood, RSS under unsynced churn.

Rows are medians with p10/p90 (p99 for latencies) over interleaved repetitions. ``--quick``
(the CI smoke run) uses few repetitions, graph lengths up to 1000 (large kernels up to 10) and
MiniLM batch 1, sequence 16, on cpu only (a forward on lavapipe takes seconds).
Results go to ``benchmarks/results/bench.json`` and ``bench.md`` (+ PNGs); ``--readme`` also
writes the report to ``benchmarks/README.md`` with its plots under ``benchmarks/img/``.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import numpy as np

from . import device_thread, replay, report, stalls
from .common import HERE, RESULTS, clock, machine, summarize, write_json

MINILM_FULL = [(b, s) for b in (1, 8, 32) for s in (16, 128)]
MINILM_QUICK = [(1, 16)]


def _sentence_transformer():
    """The same model in sentence-transformers (torch), or ``(None, reason)``."""
    try:
        import torch
        from sentence_transformers import SentenceTransformer
        from runtime.models.minilm import default_model_dir
        st = SentenceTransformer(str(default_model_dir()), device="cpu")

        def fwd(ids, mask):
            feats = {"input_ids": torch.as_tensor(ids), "attention_mask": torch.as_tensor(mask),
                     "token_type_ids": torch.zeros_like(torch.as_tensor(ids))}
            with torch.inference_mode():
                return st(feats)["sentence_embedding"].numpy()
        return fwd, None
    except Exception as e:  # noqa: BLE001 - optional: report why it is absent
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:200]


def measure_minilm(backend: str, quick: bool, tick=None, budget_s: float = 8.0) -> dict:
    """MiniLM forward per ``(batch, seq)``: eager vs replay (+ sentence-transformers), in ms.

    Each configuration takes turns between the paths until ``min_reps`` and ``budget_s`` seconds
    are both reached, or ``max_reps``. Host ids in, embeddings out, as a server calls it.
    """
    import runtime
    from runtime.models import MiniLM
    plan = MINILM_QUICK if quick else MINILM_FULL
    min_reps, max_reps = (3, 3) if quick else (3, 20)
    if quick and backend != "cpu":
        if tick:
            tick(len(plan) * max_reps)
        return {"skipped": "--quick runs MiniLM on cpu only"}
    try:
        model = MiniLM.load(runtime.client(backend), max_graphs=2)
    except Exception as e:  # noqa: BLE001 - model files missing: a reported skip
        if tick:
            tick(len(plan) * max_reps)
        return {"skipped": f"{type(e).__name__}: {e}"}
    st, st_reason = _sentence_transformer() if backend == "cpu" else (None, "cpu rows only")
    rng = np.random.default_rng(0)
    out = {"rows": [], "sentence_transformers": st_reason or "measured"}
    for batch, seq in plan:
        ids = rng.integers(1000, 29000, (batch, seq))
        ids[:, 0], ids[:, -1] = 101, 102                 # [CLS] ... [SEP]
        mask = np.ones((batch, seq), np.int64)
        paths = {"eager": lambda: model.forward(ids, mask, graph=False),
                 "replay": lambda: model.run_bucket(batch, seq, ids, mask)}
        if st is not None:
            paths["sentence_transformers"] = lambda: st(ids, mask)
        for fn in paths.values():                        # warm-up, and the capture
            fn()
        samples = {p: [] for p in paths}
        start, r = clock(), 0
        while r < max_reps and (r < min_reps or clock() - start < budget_s):
            names = list(paths)[r % len(paths):] + list(paths)[:r % len(paths)]
            for name in names:
                t = clock()
                paths[name]()
                samples[name].append(clock() - t)
            r += 1
            if tick:
                tick()
        if tick and r < max_reps:
            tick(max_reps - r)
        row = {"batch": batch, "seq": seq, "reps": r}
        row.update({p: summarize(v, 1e3) for p, v in samples.items()})
        out["rows"].append(row)
        model.release()                                  # one bucket's buffers at a time
    model.release()
    return out


def _stalls(backend: str, quick: bool, tick) -> dict:
    """The stalls section; ``--quick`` runs it on cpu only (lavapipe's matmuls take seconds)."""
    if quick and backend != "cpu":
        tick(stalls.units(quick))
        return {"skipped": "--quick runs the stalls section on cpu only"}
    return stalls.measure(backend, quick, tick)


class _NoBar:
    """Stands in for ``tqdm`` when it is not installed (``pip install tqdm`` for the bar)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        print(s, file=sys.stderr, flush=True)


def _backends(arg: str | None) -> tuple[list, dict]:
    """Backends to run and ``{name: reason}`` for the ones skipped."""
    import runtime
    avail = runtime.available_backends()
    skipped = {n: r for n, r in avail.items() if r is not None}
    wanted = [b.strip() for b in arg.split(",")] if arg else [n for n in avail if avail[n] is None]
    for b in wanted:
        if b not in avail:
            raise SystemExit(f"unknown backend {b!r}; choose from {sorted(avail)}")
    run = [b for b in ("cpu", "wgpu", "cuda") if b in wanted and avail[b] is None]
    return run, {b: skipped[b] for b in skipped if b in wanted or not arg}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--backend", help="comma-separated: cpu, wgpu, cuda (default: all that answer)")
    ap.add_argument("--quick", action="store_true", help="the CI smoke run: few reps, L <= 1000")
    ap.add_argument("--out", default=str(RESULTS), help="folder for bench.json, bench.md, PNGs")
    ap.add_argument("--readme", action="store_true",
                    help="also write benchmarks/README.md and benchmarks/img/*.png")
    ap.add_argument("--no-minilm", action="store_true", help="skip the MiniLM rows")
    ap.add_argument("--no-plots", action="store_true", help="skip matplotlib")
    args = ap.parse_args(argv)
    try:
        from tqdm import tqdm
    except ImportError:                                  # the bar is a nicety, not a need
        tqdm = _NoBar
    import runtime

    backends, skipped = _backends(args.backend)
    if not backends:
        print(f"no backend to run: {skipped}", file=sys.stderr)
        return 2
    sections = [("device_thread", lambda b, t: device_thread.measure(b, args.quick, t),
                 device_thread.units(args.quick)),
                ("replay", lambda b, t: replay.measure(b, args.quick, t), replay.units(args.quick))]
    sections.append(("stalls", lambda b, t: _stalls(b, args.quick, t), stalls.units(args.quick)))
    if not args.no_minilm:
        plan = MINILM_QUICK if args.quick else MINILM_FULL
        sections.append(("minilm", lambda b, t: measure_minilm(b, args.quick, t),
                         len(plan) * (3 if args.quick else 20)))
    result = {"suite": "runtime bench", "quick": args.quick, "machine": machine(),
              "skipped_backends": skipped, "backends": {}}
    t0 = time.time()
    failed = False
    with tqdm(total=len(backends) * sum(s[2] for s in sections), unit="rep", desc="bench",
              file=sys.stderr, mininterval=0.5) as bar:
        for b in backends:
            res = result["backends"].setdefault(b, {})
            res["device"] = runtime.client(b).device_name
            for name, fn, _ in sections:
                bar.set_postfix_str(f"{b} {name}")
                try:
                    res[name] = fn(b, bar.update)
                except Exception as e:  # noqa: BLE001 - keep the other rows; fail at the end
                    failed = True
                    traceback.print_exc()
                    res[name] = {"error": f"{type(e).__name__}: {e}"}
    result["wall_s"] = round(time.time() - t0, 1)
    runtime.shutdown()

    out = write_json(f"{args.out}/bench.json", result)
    md = report.write(result, args.out, plots=not args.no_plots)
    print(f"wrote {out} and {md} ({result['wall_s']} s)")
    if args.readme:
        readme = report.write(result, str(HERE), plots=not args.no_plots, img_dir="img",
                              name="README.md", title=True)
        print(f"wrote {readme}")
    print(report.summary(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
