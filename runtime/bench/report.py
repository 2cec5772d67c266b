"""The markdown report and matplotlib plots of a ``bench.json`` result, over the sections it
is given (:data:`runtime.bench.suite.SECTIONS`, or a selection): the machine, the targets every
section's ``targets`` returns, then each section's ``markdown`` and ``plot``, in order. Each
section owns its renderers (``device_thread.py``, ``replay.py``, ``minilm.py``, ``stalls.py``,
...); this module has the shared formatting (:func:`num`, :func:`cell`, :func:`mark`) and
plotting helpers.

    python benchmarks/report.py benchmarks/results/bench.json [--out DIR | --readme]
"""

from __future__ import annotations

from pathlib import Path



def num(x: float) -> str:
    """A number with about three significant digits."""
    if x >= 1000:
        return f"{x:,.0f}"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def cell(s: dict, p99: bool = False) -> str:
    """``p50 [p10–p90]`` (and ``p99``) of a summary."""
    txt = f"{num(s['p50'])} [{num(s['p10'])}–{num(s['p90'])}]"
    return txt + f" p99 {num(s['p99'])}" if p99 else txt


def mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


def targets(result: dict, sections=None) -> list:
    """Every target that applies, from the ``targets`` of each of ``sections``."""
    return [t for sec in _sections(sections) if sec.targets for t in sec.targets(result)]


def _sections(sections):
    """The sections to render: the caller's (the report imports no section: they import it)."""
    if sections is None:
        raise TypeError("runtime.bench.report renders the sections it is given: pass "
                        "sections=runtime.bench.suite.SECTIONS (or a selection)")
    return sections


def summary(result: dict, sections=None) -> str:
    """The targets as a plain-text table (printed at the end of a run)."""
    lines = ["targets (goals, not tests):"]
    for t in targets(result, sections):
        lines.append(f"  {t['backend']:5s} {'met   ' if t['met'] else 'MISSED'} "
                     f"{t['target']}: {t['value']}")
    return "\n".join(lines)


# -- markdown ---------------------------------------------------------------------------------
def markdown(result: dict, img_dir: str | None = ".", title: bool = False,
             sections=None) -> str:
    """The report: machine, targets, then each section's markdown (and plots) in suite order,
    its ``## `` headings numbered 1, 2, ... here."""
    m = result["machine"]
    lines = ["# Benchmarks", ""] if title else []
    if title:
        lines += ["The latest report of `python -m runtime bench` (the latency suite, "
                  "`runtime/bench/`). Regenerate with `python -m runtime bench --readme` "
                  "(a full run takes 5-20 minutes on 2 cores, most of it MiniLM on lavapipe; "
                  "`--skip minilm` skips it), or from a JSON with `python benchmarks/report.py "
                  "benchmarks/results/bench.json --readme`; "
                  "see the docstrings of `runtime/bench/device_thread.py`, "
                  "`runtime/bench/replay.py` and `runtime/bench/minilm.py` for what each row "
                  "measures.", ""]
    lines += [f"Run: {m['time']}, commit `{m.get('commit', '?')}`, "
              f"{'`--quick`' if result['quick'] else 'full run'}, {result.get('wall_s', '?')} s.",
              "",
              f"Machine: {m['cpu']} ({m['machine']}), {m.get('cpus_usable')} usable of "
              f"{m['cpus']} cores, {m.get('memory_gib', '?')} GiB, load average "
              f"{m.get('loadavg', '?')} at start; {m['platform']}; Python {m['python']}, "
              f"numpy {m['numpy']}" + (f", wgpu {m['wgpu']}" if "wgpu" in m else "")
              + (f", cupy {m['cupy']}" if "cupy" in m else "") + ".", ""]
    load, cores = (m.get("loadavg") or [0])[0], m.get("cpus_usable") or m["cpus"]
    if load > cores:
        lines += [f"**Noisy run:** the load average ({load}) exceeded the usable cores ({cores}) "
                  "when it started; other processes shared the cores, so read the medians as "
                  "rough and the p90/p99 columns as mostly that contention.", ""]
    for b, res in result["backends"].items():
        lines.append(f"- `{b}`: {res.get('device', '?')}")
    for b, why in result.get("skipped_backends", {}).items():
        lines.append(f"- `{b}`: not run ({why})")
    if result.get("interrupted"):
        lines += ["", f"**Partial run:** interrupted ({result['interrupted']}); the sections "
                  "below are the ones that finished."]
    lines += ["", "All times are medians with [p10–p90] (and p99 for latencies) over repetitions "
              "in which the compared paths take turns (order rotated each repetition).", "",
              "## Targets (goals, not tests)", "", "| backend | target | measured | |",
              "|---|---|---|---|"]
    for t in targets(result, sections):
        lines.append(f"| {t['backend']} | {t['target']} | {t['value']} | {mark(t['met'])} |")

    def img(name, alt):
        if img_dir is not None and Path(result.get("_out", ".")).joinpath(
                img_dir, name).exists():
            return ["", f"![{alt}]({img_dir}/{name})"]
        return []

    lines += [""] + budget_lines(result)
    number = 0
    for sec in _sections(sections):
        if sec.markdown is None:
            continue
        for line in sec.markdown(result, img):
            if line.startswith("## "):
                number += 1
                line = f"## {number}. {line[3:]}"
            lines.append(line)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def budget_lines(result: dict) -> list:
    """The "Run time and budget" table: per backend and section the share of ``--budget-s``
    it was given, the seconds it took, and what the budget cut (empty: ran in full)."""
    timing = result.get("timing") or {}
    if not timing:
        return []
    total = result.get("budget_s")
    lines = ["## Run time and budget", "",
             f"Budget: {f'{total:g} s for the run' if total else 'none'} (`--budget-s`); a "
             "section past its share runs fewer repetitions; MiniLM and replay's end-to-end "
             "rows are left out once the whole share is spent (the section says which).", "",
             "| backend | section | budget s | took s | cut by the budget |",
             "|---|---|---:|---:|---|"]
    for b, secs in timing.items():
        for name, t in secs.items():
            if not t.get("budgeted", True):
                cut = "(takes no budget: ran in full)"
            else:
                cut = "; ".join(t.get("cuts") or []) or "nothing"
            bs = "" if t.get("budget_s") is None else f"{t['budget_s']:g}"
            lines.append(f"| {b} | {name} | {bs} | {t['wall_s']:g} | {cut} |")
    return lines


def section_text(result: dict, section, backend: str) -> str:
    """One section's markdown for one backend (what the suite prints as a section finishes)."""
    if section.markdown is None:
        return ""
    one = dict(result, backends={backend: result["backends"][backend]})
    return "\n".join(section.markdown(one, lambda name, alt: [])).strip()


# -- plots ------------------------------------------------------------------------------------
def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_png(plt, fig, folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(folder / name, dpi=64)
    plt.close(fig)
    return folder / name


def errbars(ss):
    return [[s["p50"] - s["p10"] for s in ss], [s["p90"] - s["p50"] for s in ss]]


def backends_with(result: dict, section: str, field: str) -> list:
    """``[(backend, result of section)]`` for the backends whose section result has ``field``."""
    return [(b, r[section]) for b, r in result["backends"].items()
            if field in r.get(section, {})]


def draw_plots(result: dict, folder: Path, sections=None) -> list:
    """Every section's PNGs into ``folder`` (small: about 10-40 KB each); returns their paths.

    Raises: ``ImportError`` without matplotlib.
    """
    return [p for sec in _sections(sections) if sec.plot for p in sec.plot(result, folder)]


def checkout_benchmarks() -> Path:
    """The ``benchmarks/`` folder of the checkout this package runs from (where ``--readme``
    writes ``README.md`` and ``img/``).

    Raises: ``FileNotFoundError`` when the package runs without its checkout (a wheel install).
    """
    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    if not folder.is_dir():
        raise FileNotFoundError(f"--readme writes into a checkout's benchmarks/ folder; there is "
                                f"none at {folder} (use --out)")
    return folder


def write(result: dict, out_dir, plots: bool = True, img_dir: str = ".",
          name: str = "bench.md", title: bool = False, sections=None) -> Path:
    """Write the plots (into ``out_dir/img_dir``) and the markdown ``out_dir/name``; returns its
    path. Without matplotlib the report is text only (a line says so).

    Raises: ``OSError`` when the folder cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        try:
            draw_plots(result, out / img_dir, sections)
        except ImportError as e:                       # matplotlib missing: text only
            print(f"plots skipped: {e}")
    path = out / name
    path.write_text(markdown(dict(result, _out=str(out)), img_dir if plots else None, title,
                             sections))
    return path
