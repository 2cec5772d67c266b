"""Graph replay vs the eager launch path, swept over kernel size x graph length.

The analogue of CubeCL's ``cubecl-wgpu/examples/graph_bench.rs`` (research/cubecl-scenarios.md
section E). One *pass* is ``kernels`` dependent launches of ``add_scalar`` (``y = x + 1``)
ping-ponging between two f32 buffers ``a`` and ``b``; a pass is issued, then synced with a
blocking ``read(a)``. Three paths run back to back in every round (interleaved, so slow drift
hits all three alike; their order rotates from round to round):

- eager: ``kernels`` calls of ``client.launch``;
- replay: one ``Graph.replay()`` of the same pass captured with ``start_capture/stop_capture``;
- floor: the same prebuilt dispatches with no runtime around them. On wgpu, a hand-written
  wgpu-py loop over its own device (one encoder, one compute pass, ``set_pipeline`` once,
  ``set_bind_group`` + ``dispatch_workgroups`` per kernel, one submit, then a staging read);
  on cpu, the kernel's numpy callable called in a loop.

Columns: enqueue us/pass (the issuing calls only; not a speedup: replay posts one message),
end-to-end us/kernel (issue + sync; where a win must survive), ``x`` (eager / replay end to
end), ``r/floor`` (replay / floor end to end; a software graph's goal is <= 1.2x), ``share``
(eager enqueue / eager end to end: is launch overhead worth attacking at that size) and
``capture`` (the ``stop_capture()`` call). Medians, with p10/p90/p99 in the JSON. Each row is
the suite's :func:`runtime.bench.replay.measure_pass` (``python -m runtime bench --sections
replay`` runs the same pass over graph lengths).

Usage::

    python benchmarks/graph_sweep.py --backend wgpu [--quick] [--rounds-scale 0.5]

Writes ``benchmarks/results/graph_sweep_<backend>.json`` and ``.png`` (gitignored).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import runtime  # noqa: E402
from runtime.bench import machine, write_json  # noqa: E402
from runtime.bench.floors import KERNEL  # noqa: E402
from runtime.bench.replay import measure_pass  # noqa: E402

#: (name, elems, kernels, rounds), as graph_bench's CONFIGS.
CONFIGS = [
    ("tiny x150", 64, 150, 100),
    ("tiny x1000", 64, 1000, 50),
    ("tiny x5000", 64, 5000, 10),
    ("64k x1000", 65_536, 1000, 20),
    ("256k x1000", 262_144, 1000, 10),
    ("1m x500", 1_048_576, 500, 10),
    ("1m x2000", 1_048_576, 2000, 5),
]
QUICK = ("tiny x150", "tiny x1000", "64k x1000", "1m x500")
PATHS = ("eager", "replay", "floor")


def measure_row(client, backend, name, elems, kernels, rounds, bar) -> dict:
    """One config: the suite's eager/replay/floor pass (:func:`runtime.bench.replay.
    measure_pass`: warm, capture, ``rounds`` interleaved repetitions, the values checked),
    with this sweep's derived columns."""
    row = measure_pass(client, backend, elems, kernels, rounds, tick=bar.update)
    row["config"] = name
    e2e = {p: row[p]["e2e"]["p50"] for p in PATHS}
    row["e2e_us_per_kernel"] = {p: {q: row[p]["e2e"][q] / kernels for q in ("p10", "p50", "p90")}
                                for p in PATHS}
    row["speedup_replay_vs_eager"] = e2e["eager"] / e2e["replay"]
    row["replay_vs_floor"] = e2e["replay"] / e2e["floor"]
    row["enqueue_share_eager"] = row["eager"]["enqueue"]["p50"] / e2e["eager"]
    return row


def print_table(rows, device: str) -> None:
    print(f"\ndevice: {device}")
    print(f"{'config':<12} {'enqueue us/pass':^32} {'e2e us/kernel (p10-p90 replay)':^44} "
          f"{'x':>6} {'r/floor':>8} {'share':>6} {'capture':>9}")
    print(f"{'':<12} {'eager':>10} {'replay':>10} {'floor':>10} {'eager':>9} {'replay':>9} "
          f"{'':>13} {'floor':>9} ")
    for r in rows:
        e = {p: r[p]["enqueue"]["p50"] for p in PATHS}
        k = r["e2e_us_per_kernel"]
        spread = f"({k['replay']['p10']:.1f}-{k['replay']['p90']:.1f})"
        print(f"{r['config']:<12} {e['eager']:>10.0f} {e['replay']:>10.0f} {e['floor']:>10.0f} "
              f"{k['eager']['p50']:>9.2f} {k['replay']['p50']:>9.2f} {spread:>13} "
              f"{k['floor']['p50']:>9.2f}  {r['speedup_replay_vs_eager']:>5.2f}x "
              f"{r['replay_vs_floor']:>7.2f}x {100 * r['enqueue_share_eager']:>5.0f}% "
              f"{r['capture_ms']:>7.2f}ms")


def plot(rows, device: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    x = np.arange(len(rows))
    width = 0.27
    for i, p in enumerate(PATHS):
        k = [r["e2e_us_per_kernel"][p] for r in rows]
        med = np.array([v["p50"] for v in k])
        err = np.array([[m - v["p10"] for m, v in zip(med, k)],
                        [v["p90"] - m for m, v in zip(med, k)]])
        axes[0].bar(x + (i - 1) * width, med, width, yerr=err, capsize=2, label=p)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("end-to-end us / kernel (median, p10-p90)")
    axes[0].set_xticks(x, [r["config"] for r in rows], rotation=30)
    axes[0].legend()
    axes[1].bar(x - 0.2, [r["speedup_replay_vs_eager"] for r in rows], 0.4,
                label="replay vs eager")
    axes[1].bar(x + 0.2, [r["replay_vs_floor"] for r in rows], 0.4, label="replay / floor")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].axhline(1.2, color="r", lw=0.8, ls="--", label="floor goal 1.2x")
    axes[1].set_xticks(x, [r["config"] for r in rows], rotation=30)
    axes[1].set_ylabel("ratio of end-to-end medians")
    axes[1].legend()
    fig.suptitle(f"graph_sweep: {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("cpu", "wgpu"), default="wgpu")
    ap.add_argument("--quick", action="store_true", help=f"only the rows {', '.join(QUICK)}")
    ap.add_argument("--rounds-scale", type=float, default=1.0, help="multiply every row's rounds")
    ap.add_argument("--configs", help="comma-separated row names to run (overrides --quick)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results"))
    args = ap.parse_args(argv)
    from tqdm import tqdm

    configs = CONFIGS
    if args.configs:
        names = [c.strip() for c in args.configs.split(",")]
        configs = [c for c in CONFIGS if c[0] in names]
    elif args.quick:
        configs = [c for c in CONFIGS if c[0] in QUICK]
    configs = [(n, e, k, max(3, round(r * args.rounds_scale))) for n, e, k, r in configs]

    client = runtime.client(args.backend)
    device = getattr(client, "device_name", None) or f"{client.backend}:{client.device}"
    rows = []
    with tqdm(total=sum(c[3] for c in configs), unit="round", desc="graph_sweep") as bar:
        for name, elems, kernels, rounds in configs:
            bar.set_postfix_str(name)
            rows.append(measure_row(client, args.backend, name, elems, kernels, rounds, bar))
    print_table(rows, device)

    stem = os.path.join(args.out, f"graph_sweep_{args.backend}")
    meta = {"backend": args.backend, "device": device, "kernel": KERNEL.name, **machine()}
    write_json(stem + ".json", {"meta": meta, "rows": rows})
    plot(rows, device, stem + ".png")
    print(f"\nwrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
