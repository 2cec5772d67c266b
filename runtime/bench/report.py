"""The markdown report and matplotlib plots of a ``bench.json`` result, and the renderers of
the built-in sections (:mod:`runtime.bench.suite` wires them to their measurements).

    python benchmarks/report.py benchmarks/results/bench.json [--out DIR | --readme]

Targets (goals, not tests), each marked met or missed per backend:

- blocking call: ``client.sync()`` on an idle stream < 5 µs p50 on cpu (one client thread);
- replay enqueue: ``Graph.replay()`` < 10 µs p50 at every graph length on cpu and cuda;
- replay vs floor: replay end to end within 1.2x of the raw backend (on cuda, of the faster of
  raw launches and a raw cupy graph), per row;
- control: on the large-kernel rows, replay / eager end to end within 5% of 1.0x.
"""

from __future__ import annotations

from pathlib import Path

GOAL_SYNC_US, GOAL_ENQUEUE_US, GOAL_FLOOR_X, GOAL_CONTROL = 5.0, 10.0, 1.2, 0.05
PATH_NAMES = {"sync": "runtime `sync()`", "sync_floor": "backend `synchronize` (floor)",
              "launch": "runtime `launch(noop)`", "launch_floor": "backend `launch` (floor)",
              "call": "numpy `noop` call"}


def _n(x: float) -> str:
    """A number with about three significant digits."""
    if x >= 1000:
        return f"{x:,.0f}"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _cell(s: dict, p99: bool = False) -> str:
    """``p50 [p10–p90]`` (and ``p99``) of a summary."""
    txt = f"{_n(s['p50'])} [{_n(s['p10'])}–{_n(s['p90'])}]"
    return txt + f" p99 {_n(s['p99'])}" if p99 else txt


def _mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _floor_e2e(row: dict) -> dict:
    """The floor a replay is held to: the faster raw path (raw launches or a raw cupy graph)."""
    floors = [row[k]["e2e"] for k in ("floor", "floor_graph") if k in row]
    return min(floors, key=lambda s: s["p50"])


def device_thread_targets(result: dict) -> list:
    """The blocking-call target (cpu, one client thread): ``[{"backend", "target", "value",
    "met"}]``."""
    out = []
    for b, res in result["backends"].items():
        dt = res.get("device_thread", {}).get("threads", {})
        if b == "cpu" and "1" in dt:
            v = dt["1"]["sync"]["p50"]
            out.append({"backend": b, "target": f"blocking `sync()` < {GOAL_SYNC_US:g} µs p50",
                        "value": f"{_n(v)} µs", "met": v < GOAL_SYNC_US})
    return out


def replay_targets(result: dict) -> list:
    """The replay targets (enqueue, floor, large-kernel control) per backend."""
    out = []
    for b, res in result["backends"].items():
        enq = res.get("replay", {}).get("enqueue", {})
        if b in ("cpu", "cuda") and enq:
            worst = max(enq.items(), key=lambda kv: kv[1]["p50"])
            out.append({"backend": b,
                        "target": f"replay enqueue < {GOAL_ENQUEUE_US:g} µs p50, every length",
                        "value": f"worst {_n(worst[1]['p50'])} µs (L={worst[0]})",
                        "met": worst[1]["p50"] < GOAL_ENQUEUE_US})
        rows = res.get("replay", {}).get("e2e", [])
        if rows:
            ratios = [(r, r["replay"]["e2e"]["p50"] / _floor_e2e(r)["p50"]) for r in rows]
            ok = [x for _, x in ratios if x <= GOAL_FLOOR_X]
            worst = max(ratios, key=lambda t: t[1])
            out.append({"backend": b, "target": f"replay within {GOAL_FLOOR_X:g}x of the floor",
                        "value": f"{len(ok)}/{len(ratios)} rows; worst {worst[1]:.2f}x "
                                 f"({worst[0]['size']} L={worst[0]['length']})",
                        "met": len(ok) == len(ratios)})
            ctl = [r["replay"]["e2e"]["p50"] / r["eager"]["e2e"]["p50"]
                   for r in rows if r["size"] == "large"]
            if ctl:
                ok = [x for x in ctl if abs(x - 1) <= GOAL_CONTROL]
                out.append({"backend": b, "target": "large-kernel replay/eager within 5% of 1.0x",
                            "value": f"{len(ok)}/{len(ctl)} rows; "
                                     f"{min(ctl):.2f}x–{max(ctl):.2f}x",
                            "met": len(ok) == len(ctl)})
    return out


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
def _device_thread_md(b: str, dt: dict) -> list:
    threads = list(dt["threads"])
    head = "| path | " + " | ".join(f"{n} thread{'s' if n != '1' else ''}" for n in threads) + " |"
    lines = [head, "|---|" + "---|" * len(threads)]
    for p in dt["threads"][threads[0]]:
        cells = [_cell(dt["threads"][n][p], p99=True) for n in threads]
        lines.append(f"| {PATH_NAMES.get(p, p)} | " + " | ".join(cells) + " |")
    return lines


def _enqueue_md(enq: dict) -> list:
    lines = ["| graph length | replay() p50 | p10 | p90 | p99 | vs L=1 | capture (stop_capture) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    base = next(iter(enq.values()))["p50"]
    for L, s in enq.items():
        lines.append(f"| {L} | {_n(s['p50'])} | {_n(s['p10'])} | {_n(s['p90'])} | "
                     f"{_n(s['p99'])} | {s['p50'] / base:.1f}x | {_n(s['capture_ms'])} ms |")
    return lines


def _e2e_md(rows: list) -> list:
    cuda = any("floor_graph" in r for r in rows)
    head = "| kernels | L | eager | replay | raw backend |"
    head += " raw graph |" if cuda else ""
    head += " replay/eager | replay/floor | eager enqueue share | replay enqueue |"
    lines = [head, "|---|---:|" + "---:|" * (8 if cuda else 7)]
    for r in rows:
        e, rp, fl = r["eager"]["e2e"], r["replay"]["e2e"], _floor_e2e(r)
        cells = [r["size"], str(r["length"]), _cell(e), _cell(rp), _cell(r["floor"]["e2e"])]
        if cuda:
            cells.append(_cell(r["floor_graph"]["e2e"]) if "floor_graph" in r else "")
        x_eager, x_floor = rp["p50"] / e["p50"], rp["p50"] / fl["p50"]
        ctl = f" ({_mark(abs(x_eager - 1) <= GOAL_CONTROL)})" if r["size"] == "large" else ""
        cells += [f"{x_eager:.2f}x{ctl}", f"{x_floor:.2f}x ({_mark(x_floor <= GOAL_FLOOR_X)})",
                  f"{100 * r['eager']['enqueue']['p50'] / e['p50']:.0f}%",
                  _n(r["replay"]["enqueue"]["p50"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _minilm_md(b: str, mm: dict) -> list:
    if "skipped" in mm or "error" in mm:
        return [f"MiniLM on {b}: not measured ({mm.get('skipped') or mm.get('error')})."]
    st = any("sentence_transformers" in r for r in mm["rows"])
    head = "| batch | seq | eager ms | replay ms | eager/replay |"
    head += " sentence-transformers ms |" if st else ""
    lines = [head, "|---:|---:|---:|---:|---:|" + ("---:|" if st else "")]
    for r in mm["rows"]:
        cells = [str(r["batch"]), str(r["seq"]), _cell(r["eager"]), _cell(r["replay"]),
                 f"{r['eager']['p50'] / r['replay']['p50']:.2f}x"]
        if st:
            cells.append(_cell(r["sentence_transformers"]) if "sentence_transformers" in r else "")
        lines.append("| " + " | ".join(cells) + " |")
    if not st:
        lines.append(f"\nsentence-transformers: {mm.get('sentence_transformers')}.")
    return lines


def device_thread_section(result: dict, img) -> list:
    """Markdown of the device-thread section (``img(name, alt)`` gives a plot's lines)."""
    lines = ["## Device-thread cost (µs per call)", "",
             "Each client thread has its own stream; the floor rows call the backend's verbs on "
             "a private backend instance per thread (no queue, no server)."]
    for b, res in result["backends"].items():
        dt = res.get("device_thread", {})
        lines += ["", f"### {b}", ""]
        lines += _device_thread_md(b, dt) if "threads" in dt else [f"error: {dt.get('error')}"]
    return lines + img("device_thread.png", "device-thread cost")


def replay_section(result: dict, img) -> list:
    """Markdown of the replay section: the enqueue table and the end-to-end table."""
    lines = ["## `Graph.replay()` enqueue (µs, the blocking call itself)", "",
             "Graphs of L tiny `add_scalar` launches; the stream is idle at each call."]
    for b, res in result["backends"].items():
        enq = res.get("replay", {}).get("enqueue")
        lines += ["", f"### {b}", ""]
        lines += _enqueue_md(enq) if enq else [f"error: {res.get('replay', {}).get('error')}"]
        if enq and b == "wgpu":
            (l0, s0), (l1, s1) = list(enq.items())[0], list(enq.items())[-1]
            per = (s1["p50"] - s0["p50"]) / (int(l1) - int(l0) or 1)
            lines += ["", "On wgpu a replay re-encodes every dispatch into one command buffer: "
                      f"the call grows {s1['p50'] / s0['p50']:.0f}x from L={l0} to L={l1} "
                      f"({_n(per)} µs per recorded launch)."]
    lines += img("replay_enqueue.png", "replay enqueue vs graph length")
    lines += ["", "## End to end per pass (µs: issue + blocking read of the result)", "",
              "A pass is L dependent `add_scalar` launches ping-ponging between two buffers; "
              "`tiny` = 64 floats, `large` = 1 Mi floats (the device-bound control). "
              "Raw backend = numpy calls (cpu), hand-written wgpu-py with prebuilt pipelines "
              "and bind groups in one submit (wgpu, `runtime/bench/floors.py`), raw cupy "
              "launches and a raw cupy graph (cuda). Enqueue share = eager issue time / eager "
              "end to end: whether launch overhead is worth attacking at that size."]
    for b, res in result["backends"].items():
        rows = res.get("replay", {}).get("e2e")
        lines += ["", f"### {b}", ""]
        lines += _e2e_md(rows) if rows else [f"error: {res.get('replay', {}).get('error')}"]
    return lines + img("e2e.png", "end to end per pass")


def minilm_section(result: dict, img) -> list:
    """Markdown of the MiniLM forward section (empty when no backend has it)."""
    if not any("minilm" in r for r in result["backends"].values()):
        return []
    lines = ["## MiniLM forward (ms; host ids in, embeddings out)", ""]
    for b, res in result["backends"].items():
        if "minilm" in res:
            lines += [f"### {b}", ""] + _minilm_md(b, res["minilm"]) + [""]
    return lines + img("minilm.png", "MiniLM forward")


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
        lines.append(f"| {t['backend']} | {t['target']} | {t['value']} | {_mark(t['met'])} |")

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
             "section past its share runs fewer repetitions, never fewer rows.", "",
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
def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(folder / name, dpi=64)
    plt.close(fig)
    return folder / name


def _err(ss):
    return [[s["p50"] - s["p10"] for s in ss], [s["p90"] - s["p50"] for s in ss]]


def _have(result: dict, section: str, field: str) -> list:
    """``[(backend, result of section)]`` for the backends whose section result has ``field``."""
    return [(b, r[section]) for b, r in result["backends"].items()
            if field in r.get(section, {})]


def plot_device_thread(result: dict, folder: Path) -> list:
    """``device_thread.png`` (µs per call vs client threads) into ``folder``; the paths written.

    Raises: ``ImportError`` without matplotlib.
    """
    have = _have(result, "device_thread", "threads")
    if not have:
        return []
    plt = _pyplot()
    import matplotlib.ticker
    fig, axes = plt.subplots(1, len(have), figsize=(5 * len(have), 3.6), squeeze=False)
    for ax, (b, dt) in zip(axes[0], have):
        ns = list(dt["threads"])
        for p in dt["threads"][ns[0]]:
            ss = [dt["threads"][n][p] for n in ns]
            ax.errorbar([int(n) for n in ns], [s["p50"] for s in ss], yerr=_err(ss),
                        marker="o", capsize=2, label=p, ls="--" if "floor" in p else "-")
        if b == "cpu":
            ax.axhline(GOAL_SYNC_US, color="r", lw=0.7, ls=":", label="sync goal")
        ax.set(xscale="log", yscale="log", title=b, xlabel="client threads",
               ylabel="µs per call (p50, p10–p90)")
        ax.set_xticks([int(n) for n in ns], ns)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=7)
    return [_save(plt, fig, folder, "device_thread.png")]


def plot_replay(result: dict, folder: Path) -> list:
    """``replay_enqueue.png`` and ``e2e.png`` into ``folder``; the paths written.

    Raises: ``ImportError`` without matplotlib.
    """
    have = _have(result, "replay", "enqueue")
    if not have:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for b, rp in have:
        Ls = [int(L) for L in rp["enqueue"]]
        ss = list(rp["enqueue"].values())
        axes[0].errorbar(Ls, [s["p50"] for s in ss], yerr=_err(ss), marker="o", capsize=2,
                         label=b)
    axes[0].axhline(GOAL_ENQUEUE_US, color="r", lw=0.7, ls=":", label="goal (cpu, cuda)")
    axes[0].set(xscale="log", yscale="log", xlabel="graph length (launches)",
                ylabel="replay() µs (p50, p10–p90)", title="replay enqueue")
    axes[0].legend(fontsize=7)
    for b, rp in have:
        for size, ls in (("tiny", "-"), ("large", "--")):
            rows = [r for r in rp["e2e"] if r["size"] == size]
            if rows:
                axes[1].plot([r["length"] for r in rows],
                             [r["replay"]["e2e"]["p50"] / _floor_e2e(r)["p50"] for r in rows],
                             marker="o", ls=ls, label=f"{b} {size}")
    axes[1].axhline(GOAL_FLOOR_X, color="r", lw=0.7, ls=":", label="goal 1.2x")
    axes[1].axhline(1.0, color="k", lw=0.5)
    axes[1].set(xscale="log", yscale="log", xlabel="graph length (launches)",
                ylabel="replay / raw backend, end to end", title="replay vs floor")
    axes[1].legend(fontsize=7)
    written = [_save(plt, fig, folder, "replay_enqueue.png")]

    fig, axes = plt.subplots(1, len(have), figsize=(5 * len(have), 3.6), squeeze=False)
    for ax, (b, rp) in zip(axes[0], have):
        for size, ls in (("tiny", "-"), ("large", "--")):
            rows = [r for r in rp["e2e"] if r["size"] == size]
            for k, path in enumerate(("eager", "replay", "floor", "floor_graph")):
                if rows and path in rows[0]:
                    ax.plot([r["length"] for r in rows], [r[path]["e2e"]["p50"] for r in rows],
                            marker="o", ls=ls, color=f"C{k}", label=f"{size} {path}")
        ax.set(xscale="log", yscale="log", title=b, xlabel="graph length (launches)",
               ylabel="µs per pass (p50)")
        ax.legend(fontsize=7)
    return written + [_save(plt, fig, folder, "e2e.png")]


def plot_minilm(result: dict, folder: Path) -> list:
    """``minilm.png`` (ms per forward, per path and bucket) into ``folder``; the paths written.

    Raises: ``ImportError`` without matplotlib.
    """
    have = [(b, mm["rows"]) for b, mm in _have(result, "minilm", "rows")]
    if not have:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels, x = [], 0
    for b, rows in have:
        for r in rows:
            for k, (path, color) in enumerate((("eager", "C0"), ("replay", "C1"),
                                               ("sentence_transformers", "C2"))):
                if path in r:
                    ax.bar(x + 0.27 * (k - 1), r[path]["p50"], 0.27, color=color,
                           label=path if x == 0 else None)
            labels.append(f"{b}\n{r['batch']}x{r['seq']}")
            x += 1
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set(yscale="log", ylabel="ms per forward (p50)", title="MiniLM forward")
    ax.legend(fontsize=7)
    return [_save(plt, fig, folder, "minilm.png")]


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
