"""``python -m runtime bench``: the latency suite, one JSON file and a markdown report.

    python -m runtime bench [--backend cpu,wgpu] [--quick] [--out DIR] [--readme]
                            [--sections a,b] [--skip minilm] [--no-plots] [--budget-s S]
    python -m runtime bench --compare REF [--rounds 3] [--reps 300] [--quick]
                            [--json FILE | --out DIR]

``--compare REF`` runs only the core rows of the cpu backend against another commit or
checkout in alternating fresh processes and prints the ratios (:mod:`runtime.bench.refcompare`):
run it before and after changing the hot path (launch, replay, read, sync, the queue).

Per backend (default: every backend that answers here; cuda only with a GPU), the sections of
:data:`SECTIONS` in order:

1. ``device_thread`` (:mod:`runtime.bench.device_thread`): blocking no-op and empty launch vs
   the backend verbs called with no server, for 1, 2, 4 and 8 client threads;
2. ``replay`` (:mod:`runtime.bench.replay`): ``Graph.replay()`` enqueue latency vs graph
   length, and end-to-end passes, eager vs replay vs the raw backend, tiny and large kernels;
3. ``minilm`` (:mod:`runtime.bench.minilm`): the MiniLM forward, eager vs replay, and
   sentence-transformers where installed;
4. ``stalls`` (:mod:`runtime.bench.stalls`): one client's replay/read latency while another
   reads a heavy result or floods launches, and RSS under unsynced churn (cpu only in
   ``--quick``);
5. ``decode`` (:mod:`runtime.bench.decode`): greedy decoding tokens/s, eager vs one replay per
   token vs one replay per sequence (``capture_while``, the loop on the device).
6. ``soak`` (:mod:`runtime.bench.soak`), only when named (``--sections soak``): ten minutes
   (``--quick``: a few seconds) of mixed work from 8 threads (per-request streams, threads
   that start and end, graphs captured and released, injected kernel failures, handle and
   graph drop bursts); RSS, the server's tables, the queue's maximum length and a 16-byte
   read's p99 at the start and the end (``--budget-s 0`` for the full ten minutes).

A run never loses what it measured: ``bench.json`` and ``bench.md`` are written after every
section (plots at the end), each section's table is printed as it finishes, and a run cut by
Ctrl-C or SIGTERM writes what it has (``"interrupted"`` in the JSON). ``--budget-s S`` bounds the
run (default :data:`DEFAULT_BUDGET_S`, about 10 minutes for the full cpu,wgpu run on 2 cores):
each section gets a share of the seconds left by its ``weight`` (:mod:`runtime.bench.budget`)
and runs fewer repetitions once its share is spent (MiniLM and replay's end-to-end rows,
whose warm-ups alone take seconds a row on lavapipe, leave their remaining rows out once the
whole share is spent, and say which); ``result["timing"]`` and
the report's "Run time and budget" table say how long each section took and what a budget cut.

Rows are medians with p10/p90 (p99 for latencies) over interleaved repetitions. ``--quick``
(the CI smoke run) uses few repetitions, graph lengths up to 1000 (large kernels up to 10) and
MiniLM batch 1, sequence 16, on cpu only. Results go to ``bench.json`` and ``bench.md`` (+ PNGs)
in ``--out`` (default: ``benchmarks/results`` of the checkout this package runs from, else
``./bench-results``); ``--readme`` also writes the report to the checkout's
``benchmarks/README.md`` with its plots under ``benchmarks/img/``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import decode, device_thread, minilm, replay, report, soak, stalls
from .budget import Budget
from .results import machine, write_json

#: the run's default ``--budget-s``: the full cpu,wgpu run ends in about 10 minutes on 2 cores
#: (the sections' fixed costs, compiles and captures, come on top of their shares).
DEFAULT_BUDGET_S = 480.0


@dataclass(frozen=True)
class Section:
    """One part of the suite: what it measures per backend and how the report shows it.

    Attributes:
        name: the key of its results (``result["backends"][backend][name]``) and its name for
            ``--sections`` / ``--skip``.
        measure: ``measure(backend, quick, tick) -> dict``: JSON-able results for one backend
            name (``"cpu"``, ``"wgpu"``, ``"cuda"``); ``quick`` is ``--quick``; call ``tick(n=1)``
            per unit of progress. Raising fails the run (exit 1) after the other sections ran;
            return ``{"skipped": why}`` for a backend it does not apply to.
        units: ``units(quick) -> int``: how many ticks ``measure`` makes per backend.
        markdown: ``markdown(result, img) -> list[str]``: the report's lines for the whole run
            (every backend); ``## `` headings are numbered by the report; ``img(name, alt)``
            returns the lines that show a PNG ``plot`` wrote (empty when it did not).
        plot: ``plot(result, folder) -> list[Path]``: PNGs written into ``folder``
            (matplotlib; ``ImportError`` without it).
        targets: ``targets(result) -> list[dict]``: goals (not tests) for the targets table,
            each ``{"backend", "target", "value", "met"}``.
        weight: the section's share of the run's ``--budget-s`` on a backend, relative to the
            other sections' (a number, or ``{backend: number}`` with ``"*"`` for the rest).
            ``measure`` gets its share as ``budget=`` (a :class:`runtime.bench.budget.Budget`)
            when it has that keyword: it should run fewer repetitions once the budget is spent,
            and record each cut (``budget.stop``/``budget.cut``); a row left out says so. A section
            without the keyword runs in full; the report says so.
        takes: how long the section takes, for ``--help`` (e.g. ``"cpu ~40 s, wgpu ~60 s"``).
        default: run when ``--sections`` does not name any (False: only when named, e.g. the
            ten-minute ``soak``).
    """

    name: str
    measure: Callable[[str, bool, Callable], dict]
    units: Callable[[bool], int]
    markdown: Callable[[dict, Callable], list] | None = None
    plot: Callable[[dict, Path], list] | None = None
    targets: Callable[[dict], list] | None = None
    weight: float | dict = 1.0
    takes: str = ""
    default: bool = True

    def weight_on(self, backend: str) -> float:
        """This section's budget weight on ``backend``."""
        w = self.weight
        return float(w.get(backend, w.get("*", 1.0)) if isinstance(w, dict) else w)

    def takes_budget(self) -> bool:
        """Whether ``measure`` accepts ``budget=``."""
        try:
            return "budget" in inspect.signature(self.measure).parameters
        except (TypeError, ValueError):
            return False


#: the suite, in run and report order. Add a section here (see ``runtime.bench``'s docstring).
SECTIONS: list[Section] = [
    Section("device_thread", device_thread.measure, device_thread.units, device_thread.markdown,
            device_thread.plot, device_thread.targets, weight=1.0,
            takes="cpu ~5 s, wgpu 30-45 s (40 rounds x 1-8 threads)"),
    Section("replay", replay.measure, replay.units, replay.markdown, replay.plot,
            replay.targets, weight=1.5,
            takes="cpu 30-70 s, wgpu 1-5 min (lavapipe: the 1 Mi-float and L=10000 rows)"),
    Section("minilm", minilm.measure, minilm.units, minilm.markdown, minilm.plot,
            weight={"cpu": 1.0, "*": 3.0},
            takes="cpu 40 s-4 min, wgpu 3-25 min unbudgeted (a 32x128 forward is ~12 s on "
                  "lavapipe; warm-up and capture take ~4 a row); past its budget rows are "
                  "left out and say so"),
    Section("stalls", stalls.measure, stalls.units, stalls.markdown, stalls.plot,
            stalls.suite_targets, weight=1.0,
            takes="~40 s a backend within the budget (the growth phase is 60 s without)"),
    Section("decode", decode.measure, decode.units, decode.markdown, weight=0.5,
            takes="cpu 1-5 s, wgpu ~10 s"),
    Section("soak", soak.measure, soak.units, soak.markdown, None, soak.suite_targets,
            takes="only when named: 10 min per backend with --budget-s 0, else its share "
                  "of the budget; --quick ~5 s", default=False),
]


def default_out() -> Path:
    """``benchmarks/results`` of the checkout this package runs from, else ``./bench-results``."""
    try:
        return report.checkout_benchmarks() / "results"
    except FileNotFoundError:
        return Path("bench-results")


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

    @staticmethod
    def write(s: str, file=None) -> None:
        print(s, file=file, flush=True)


def _backends(arg: str | None) -> tuple[list, dict]:
    """Backends to run and ``{name: reason}`` for the ones skipped.

    Raises: ``ValueError`` for a name that is not a backend.
    """
    import runtime
    avail = runtime.available_backends()
    skipped = {n: r for n, r in avail.items() if r is not None}
    wanted = [b.strip() for b in arg.split(",")] if arg else [n for n in avail if avail[n] is None]
    for b in wanted:
        if b not in avail:
            raise ValueError(f"unknown backend {b!r}; choose from {sorted(avail)}")
    run = [b for b in ("cpu", "wgpu", "cuda") if b in wanted and avail[b] is None]
    return run, {b: skipped[b] for b in skipped if b in wanted or not arg}


def select(only: str | None = None, skip: str | None = None) -> list[Section]:
    """The sections to run: ``only`` (comma list; default: every section with ``default``)
    minus ``skip`` (comma list).

    Raises: ``ValueError`` for a name that is not a section of :data:`SECTIONS`.
    """
    names = [s.name for s in SECTIONS]

    def parse(arg):
        got = [n.strip() for n in (arg or "").split(",") if n.strip()]
        bad = [n for n in got if n not in names]
        if bad:
            raise ValueError(f"unknown section(s) {bad}; the suite has {names}")
        return got
    keep, drop = parse(only) or [s.name for s in SECTIONS if s.default], parse(skip)
    return [s for s in SECTIONS if s.name in keep and s.name not in drop]


class Interrupted(KeyboardInterrupt):
    """SIGTERM arrived during a run: handled like Ctrl-C."""


def _on_sigterm(signum, frame):
    raise Interrupted("SIGTERM")


def _help_epilog() -> str:
    import textwrap
    head = (f"The sections share --budget-s (default {DEFAULT_BUDGET_S:g} s, aimed at a full "
            "cpu,wgpu run of about 10 minutes on 2 quiet cores); their fixed costs (compiles, "
            "captures, warm-ups) come on top and grow on a loaded machine. Sections, in order, "
            "and how long each took here (2 cores, loaded):")
    lines = textwrap.wrap(head, 78)
    for s in SECTIONS:
        lines += textwrap.wrap(s.takes, 78, initial_indent=f"  {s.name:14s} ",
                               subsequent_indent=" " * 17)
    return "\n".join(lines)


def _shares(plan: list, left: float | None, done: int) -> float | None:
    """The seconds of the ``done``-th (backend, section) of ``plan``: ``left`` times its weight
    over the weights of every pair still to run."""
    if left is None:
        return None
    weights = [sec.weight_on(b) for b, sec in plan[done:]]
    return max(0.0, left) * weights[0] / (sum(weights) or 1.0)


def main(argv=None) -> int:
    """Run the suite (``python -m runtime bench --help`` lists the options and how long each
    section takes).

    Returns: 0; 1 when a section failed (its error is in the JSON, the others ran); 2 when no
    backend can run; 130 when interrupted (Ctrl-C, SIGTERM: what was measured is written).
    Raises: ``ValueError`` (unknown backend or section, a negative ``--budget-s``),
    ``OSError`` (the output folder cannot be written), ``FileNotFoundError`` (``--readme``
    outside a checkout).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--compare" in argv or any(a.startswith("--compare=") for a in argv):
        return _compare(argv)
    ap = argparse.ArgumentParser(prog="python -m runtime bench",
                                 description=__doc__.split("\n")[0], epilog=_help_epilog(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", help="comma-separated: cpu, wgpu, cuda (default: all that answer)")
    ap.add_argument("--quick", action="store_true", help="the CI smoke run: few reps, L <= 1000")
    ap.add_argument("--out", help=f"folder for bench.json, bench.md, PNGs "
                                  f"(default: {default_out()})")
    ap.add_argument("--readme", action="store_true",
                    help="also write the checkout's benchmarks/README.md and benchmarks/img/*.png")
    names = ",".join(s.name for s in SECTIONS if s.default)
    ap.add_argument("--sections", help=f"comma-separated sections to run (default: {names}; "
                                       f"the others run only when named)")
    ap.add_argument("--skip", help="comma-separated sections not to run")
    ap.add_argument("--no-minilm", action="store_true", help="the same as --skip minilm")
    ap.add_argument("--no-plots", action="store_true", help="skip matplotlib")
    ap.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help=f"seconds for the whole run, shared among the sections by weight; a "
                         f"section past its share runs fewer repetitions and "
                         f"the report says so (default: {DEFAULT_BUDGET_S:g}; --quick: none; "
                         f"0: none)")
    ap.add_argument("--trace-slowest", action="store_true",
                    help="trace the run (runtime.trace) and save each section's slowest sample "
                         "as trace-<backend>-<section>.json next to bench.json (the numbers "
                         "are then those of the traced runtime: look, do not compare)")
    ap.add_argument("--compare", metavar="REF",
                    help="only the core rows against another git commit or checkout, in "
                         "alternating processes (see runtime.bench.refcompare; its own options: "
                         "--against, --rounds, --reps, --quick, --json, --out)")
    args = ap.parse_args(argv)
    if args.budget_s is not None and args.budget_s < 0:
        raise ValueError(f"--budget-s must be >= 0, got {args.budget_s:g}")
    total = args.budget_s if args.budget_s is not None else (
        None if args.quick else DEFAULT_BUDGET_S)
    total = total or None                                # 0: no budget
    try:                                                 # the one line names the flag
        sections = select(args.sections, ",".join(filter(None, [
            args.skip, "minilm" if args.no_minilm else ""])))
    except ValueError as e:
        raise ValueError(f"--sections/--skip: {e}") from None
    out_dir = Path(args.out) if args.out else default_out()
    readme_dir = report.checkout_benchmarks() if args.readme else None
    try:
        from tqdm import tqdm
    except ImportError:                                  # the bar is a nicety, not a need
        tqdm = _NoBar
    import runtime

    try:
        backends, skipped = _backends(args.backend)
    except ValueError as e:
        raise ValueError(f"--backend: {e}") from None
    if not backends:
        print(f"python -m runtime bench: no backend to run: {skipped}", file=sys.stderr)
        return 2
    result = {"suite": "runtime bench", "quick": args.quick, "machine": machine(),
              "sections": [s.name for s in sections], "skipped_backends": skipped,
              "budget_s": total, "backends": {}, "timing": {}}
    plan = [(b, sec) for b in backends for sec in sections]
    t0 = time.time()
    failed = []
    interrupted = None
    on_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _on_sigterm) if on_main else None
    if args.trace_slowest:
        from .. import tracing
        from .timing import SLOWEST
        tracing.start()

    def save():
        result["wall_s"] = round(time.time() - t0, 1)
        write_json(out_dir / "bench.json", result)
        report.write(result, out_dir, plots=False, sections=sections)

    try:
        with tqdm(total=len(backends) * sum(s.units(args.quick) for s in sections),
                  unit="rep", desc="bench", file=sys.stderr, mininterval=0.5) as bar:
            for i, (b, sec) in enumerate(plan):
                res = result["backends"].setdefault(b, {})
                if "device" not in res:
                    res["device"] = runtime.client(b).device_name
                left = None if total is None else total - (time.time() - t0)
                budget = Budget(_shares(plan, left, i))
                bar.set_postfix_str(f"{b} {sec.name}")
                kwargs = {"budget": budget} if sec.takes_budget() else {}
                units_before = bar.n if hasattr(bar, "n") else 0
                if args.trace_slowest:
                    SLOWEST.reset()
                try:
                    res[sec.name] = sec.measure(b, args.quick, bar.update, **kwargs)
                except KeyboardInterrupt as e:              # Ctrl-C or SIGTERM
                    interrupted = f"{type(e).__name__} during {b} {sec.name}"
                    res[sec.name] = {"error": f"interrupted ({interrupted})"}
                except Exception as e:  # noqa: BLE001 - keep the other rows; fail at the end
                    failed.append(f"{b} {sec.name}: {type(e).__name__}: {e}")
                    res[sec.name] = {"error": f"{type(e).__name__}: {e}"}
                spent = budget.spent()
                result["timing"].setdefault(b, {})[sec.name] = {
                    "budget_s": None if budget.seconds is None else round(budget.seconds, 1),
                    "wall_s": round(spent, 1), "cuts": budget.cuts,
                    "budgeted": sec.takes_budget()}
                if args.trace_slowest:
                    written = SLOWEST.write(out_dir / f"trace-{b}-{sec.name}.json")
                    if written is not None:
                        result["timing"][b][sec.name]["trace"] = {
                            "file": written.name, "sample": SLOWEST.what,
                            "ms": round(SLOWEST.dur / 1e3, 3)}
                if hasattr(bar, "n"):                    # a cut section ran fewer units
                    bar.update(max(0, units_before + sec.units(args.quick) - bar.n))
                if interrupted:
                    result["interrupted"] = interrupted
                    save()
                    break
                save()
                table = report.section_text(result, sec, b)
                bar.write(f"\n== {b} {sec.name} ({spent:.0f} s"
                          + (f", budget {budget.seconds:.0f} s" if budget.seconds is not None
                             else "") + (f"; cut: {'; '.join(budget.cuts)}" if budget.cuts
                                          else "") + f")\n{table}", file=sys.stdout)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, old_term)
        if args.trace_slowest:
            tracing.stop()
    result["wall_s"] = round(time.time() - t0, 1)
    runtime.shutdown()

    out = write_json(out_dir / "bench.json", result)
    md = report.write(result, out_dir, plots=not args.no_plots, sections=sections)
    print(f"wrote {out} and {md} ({result['wall_s']} s)")
    if interrupted:
        print(f"python -m runtime bench: interrupted ({interrupted}); what was measured is "
              f"in {out}", file=sys.stderr)
        return 130
    if readme_dir is not None:
        readme = report.write(result, readme_dir, plots=not args.no_plots, img_dir="img",
                              name="README.md", title=True, sections=sections)
        print(f"wrote {readme}")
    print(report.summary(result, sections))
    for line in failed:
        print(f"python -m runtime bench: section failed: {line}", file=sys.stderr)
    return 1 if failed else 0


def _compare(argv: list) -> int:
    """``--compare REF ...``: hand the rest of the arguments to :mod:`runtime.bench.compare`."""
    from . import refcompare
    rest, ref, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--compare":
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                if argv[i + 1:i + 2] in (["-h"], ["--help"]):     # --compare --help: its help
                    return refcompare.main("REF", ["--help"])
                raise ValueError("--compare needs a git commit or a checkout path")
            ref, i = argv[i + 1], i + 2
            continue
        if a.startswith("--compare="):
            ref = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if not ref:
        raise ValueError("--compare needs a git commit or a checkout path")
    return refcompare.main(ref, rest)


def rerender(argv=None) -> int:
    """``python benchmarks/report.py JSON [--out DIR | --readme]``: re-render a saved run with
    the suite's sections.

    Returns: the exit status (0). Raises: ``OSError``/``ValueError`` (unreadable JSON),
    ``FileNotFoundError`` (``--readme`` outside a checkout).
    """
    ap = argparse.ArgumentParser(prog="python benchmarks/report.py",
                                 description="Re-render a saved bench.json: markdown and plots.")
    ap.add_argument("json")
    ap.add_argument("--out", help="folder (default: the JSON's)")
    ap.add_argument("--readme", action="store_true",
                    help="write benchmarks/README.md and benchmarks/img/ instead")
    a = ap.parse_args(argv)
    result = json.loads(Path(a.json).read_text())
    if a.readme:
        print(report.write(result, report.checkout_benchmarks(), img_dir="img", name="README.md",
                           title=True, sections=SECTIONS))
    else:
        print(report.write(result, a.out or Path(a.json).parent, sections=SECTIONS))
    return 0
