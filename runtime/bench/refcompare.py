"""``python -m runtime bench --compare REF``: the core rows of this checkout against another.

The regression guard of the hot path (issue 26; README "Benchmarks"): run it before and after
changing launch, replay, read, sync or the queue. It times the rows of
:mod:`runtime.bench.core` (sync, fire-and-forget launch, replay enqueue of 1 to 10,000
launches, replay + read, launch + read, the numpy floor) with two checkouts in alternating
fresh processes: ``REF, NEW, NEW, REF, REF, NEW, ...`` (each round runs both, the order
flipped every round), so load from other processes lands on both sides alike. Each process
reports the medians of its repetitions; the table shows per row the median over rounds of
each side's median with the min-max of the rounds, and the speed-up ``REF / NEW`` as the
median of the per-round ratios with their min-max (a ratio of two processes run back to
back is robust to a shared, loaded machine where absolute numbers are not).

    python -m runtime bench --compare aef0e49 [--against PATH] [--rounds 3] [--reps 300]
                            [--quick] [--json FILE | --out DIR]

``REF`` is a git commit (or branch, tag) of the checkout this package runs from, exported
once with ``git archive`` into a cache folder, or the path of another checkout (a folder
holding ``runtime/__init__.py``). ``NEW`` is this package's checkout, or ``--against PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .core import E2E, rows
from .results import machine, write_json

#: rows whose speed-up the goal of issue 26 covers (>= 2x against aef0e49, its ANCHOR: the
#: report marks the goal only when comparing against that commit).
CORE = ("sync", "launch", "replay", "replay_read", "launch_read")
ANCHOR = "aef0e49"
CHILD = Path(__file__).with_name("core.py")


def this_checkout() -> Path:
    """The folder holding the ``runtime`` package that runs this code."""
    return Path(__file__).resolve().parents[2]


def resolve(ref: str, repo: Path) -> tuple[Path, str]:
    """``(folder holding runtime/, label)`` for ``ref``: a checkout path, else a git commit of
    ``repo`` exported once into ``$TMPDIR/runtime-ref-<sha>``.

    Raises: ``ValueError`` (neither a checkout nor a commit ``git`` knows in ``repo``).
    """
    p = Path(ref).expanduser()
    if (p / "runtime" / "__init__.py").is_file():
        return p.resolve(), str(p)
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                             capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise ValueError(f"--compare {ref!r}: neither a checkout (a folder with "
                         f"runtime/__init__.py) nor a commit of the git repository {repo}") from e
    dest = Path(tempfile.gettempdir()) / f"runtime-ref-{sha[:12]}"
    if not (dest / "runtime" / "__init__.py").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=f"runtime-ref-{sha[:12]}-"))
        archive = subprocess.run(["git", "-C", str(repo), "archive", sha, "runtime"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        try:
            tmp.rename(dest)
        except OSError:                  # another run exported it meanwhile
            pass
    return dest, f"{ref} ({sha[:9]})"


def run_child(root: Path, reps: int, quick: bool, timeout: float = 600) -> dict:
    """One fresh process measuring the core rows with ``root``'s ``runtime`` package.

    Raises: ``RuntimeError`` (the child failed or measured another package than ``root``'s).
    """
    env = dict(os.environ, PYTHONPATH=str(root), RUNTIME_BACKEND="cpu")
    env.pop("RUNTIME_CHECK", None)
    cmd = [sys.executable, str(CHILD), "--reps", str(reps)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise RuntimeError(f"core rows with {root} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(data["runtime"]).resolve().is_relative_to(root):
        raise RuntimeError(f"the child measured {data['runtime']}, not the package in {root}")
    return data["rows"]


def compare(ref_root: Path, new_root: Path, rounds: int = 3, reps: int = 300,
            quick: bool = False, log=None) -> dict:
    """Alternate fresh processes of both checkouts for ``rounds`` rounds (module docstring),
    after one short untimed process of each (so neither side's first process pays alone for
    cold file and compile caches).

    Returns: ``{"rounds": [{"ref": rows, "new": rows}], "rows": {row: {"ref", "new",
    "ref_range", "new_range", "speedup", "speedup_range"}}, "floor": {side: {L: ratio}}}``
    with medians in µs.
    """
    for root in (ref_root, new_root):         # untimed: the first process of a run paid for
        run_child(root, 10, True)             # cold imports and caches (1 round read 0.6-0.9x)
    runs = []
    for r in range(rounds):
        order = ("ref", "new") if r % 2 == 0 else ("new", "ref")
        got = {}
        for side in order:
            t = time.time()
            got[side] = run_child(ref_root if side == "ref" else new_root, reps, quick)
            if log:
                log(f"round {r + 1}/{rounds} {side}: {time.time() - t:.1f} s")
        runs.append(got)
    table = {}
    for row in rows():
        if not all(row in g["ref"] and row in g["new"] for g in runs):
            continue
        ref = [g["ref"][row]["p50"] for g in runs]
        new = [g["new"][row]["p50"] for g in runs]
        sp = [x / y for x, y in zip(ref, new) if y > 0]
        table[row] = {"ref": statistics.median(ref), "new": statistics.median(new),
                      "ref_range": [min(ref), max(ref)], "new_range": [min(new), max(new)],
                      "speedup": statistics.median(sp), "speedup_range": [min(sp), max(sp)]}
    floor = {}
    for side in ("ref", "new"):
        floor[side] = {}
        for n in E2E:
            e2e = "replay_read" if n == 1 else f"e2e_{n}"
            rs = [g[side][e2e]["p50"] / g[side][f"floor_{n}"]["p50"] for g in runs
                  if e2e in g[side] and f"floor_{n}" in g[side]]
            if rs:
                floor[side][str(n)] = {"ratio": statistics.median(rs), "range": [min(rs), max(rs)]}
    return {"rounds": runs, "rows": table, "floor": floor}


def report(res: dict, ref_label: str, new_label: str) -> str:
    """The comparison as a plain-text table."""
    lines = [f"core rows, cpu backend, µs: p50 = median over {len(res['rounds'])} rounds of "
             "each process's median [min-max over rounds]",
             f"REF = {ref_label}", f"NEW = {new_label}", "",
             f"{'row':15s} {'REF p50':>9s} {'[min-max]':>19s} {'NEW p50':>9s} {'[min-max]':>19s}"
             f" {'REF/NEW':>8s} {'[min-max]':>13s}"]
    anchored = ANCHOR in ref_label
    for row, v in res["rows"].items():
        goal = "  (goal >= 2x)" if anchored and row in CORE else (
            "  (goal <= 3 µs)" if anchored and row.startswith("enqueue_") else "")
        lines.append(f"{row:15s} {v['ref']:9.2f} {_rng(v['ref_range']):>19s} {v['new']:9.2f} "
                     f"{_rng(v['new_range']):>19s} {v['speedup']:7.2f}x "
                     f"{_rng(v['speedup_range'], 2):>13s}{goal}")
    lines += ["", "replay + read / numpy floor (goal: <= 1.2x for L >= 10, <= 2x for L = 1)",
              f"{'L':>6s} {'REF':>8s} {'NEW':>8s} {'NEW [min-max]':>15s}"]
    for n, v in res["floor"].get("new", {}).items():
        r = res["floor"]["ref"].get(n, {}).get("ratio", float("nan"))
        lines.append(f"{n:>6s} {r:7.2f}x {v['ratio']:7.2f}x {_rng(v['range'], 2):>15s}")
    return "\n".join(lines)


def _rng(r, digits=1) -> str:
    return f"[{r[0]:.{digits}f}-{r[1]:.{digits}f}]"


def main(ref: str, argv=None) -> int:
    """``bench --compare REF [options]``; returns the exit status (0, or 2 for a bad REF)."""
    ap = argparse.ArgumentParser(prog=f"python -m runtime bench --compare {ref}",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--against", help="the checkout to measure as NEW (default: this one)")
    ap.add_argument("--rounds", type=int, default=3, help="process pairs (default 3)")
    ap.add_argument("--reps", type=int, default=300, help="repetitions per process (default 300)")
    ap.add_argument("--quick", action="store_true", help="graph lengths up to 1000 only")
    ap.add_argument("--json", help="where to write the JSON (default: compare.json in --out)")
    ap.add_argument("--out", metavar="DIR", help="folder for compare.json, as bench's --out "
                                                "(default: benchmarks/results of this checkout)")
    args = ap.parse_args(argv)
    if args.json and args.out:
        ap.error("--json FILE and --out DIR both name where the JSON goes: pass one")
    if args.rounds < 1 or args.reps < 1:
        raise ValueError("--rounds and --reps must be >= 1")
    here = this_checkout()
    ref_root, ref_label = resolve(ref, here)
    new_root = Path(args.against).resolve() if args.against else here
    new_label = str(new_root)
    head = subprocess.run(["git", "-C", str(new_root), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode == 0:
        dirty = subprocess.run(["git", "-C", str(new_root), "status", "--porcelain", "runtime"],
                               capture_output=True, text=True).stdout.strip()
        new_label += f" ({head.stdout.strip()}{' + uncommitted changes' if dirty else ''})"

    def log(msg):
        print(msg, file=sys.stderr, flush=True)
    res = compare(ref_root, new_root, args.rounds, args.reps, args.quick, log)
    res.update({"ref": ref_label, "new": new_label, "machine": machine(),
                "reps": args.reps, "quick": args.quick})
    out = (Path(args.json) if args.json else
           Path(args.out) / "compare.json" if args.out else
           here / "benchmarks" / "results" / "compare.json")
    write_json(out, res)
    print(report(res, ref_label, new_label))
    print(f"\nwrote {out}")
    return 0
