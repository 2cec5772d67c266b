"""all-MiniLM-L6-v2 on the cpu backend beside sentence-transformers, side by side (issue 16).

    python benchmarks/minilm_forward.py                # the table (product alone without ST)
    python benchmarks/minilm_forward.py --st-python $ST_PYTHON --plot minilm.png
    python benchmarks/minilm_forward.py --st-python $ST_PYTHON --contention 2 \
        --st-threads 1,2               # torch at 1 and at 2 threads, ratios against the best
    python benchmarks/minilm_forward.py --variant blas2 OPENBLAS_NUM_THREADS=2 --variant now
    python benchmarks/minilm_forward.py --variant before RUNTIME_BENCH_ROOT=<an old checkout> --variant now
    python benchmarks/minilm_forward.py --kernels              # per-kernel µs beside numpy/torch
    python benchmarks/minilm_forward.py --eager-vs-replay --backends cpu wgpu

($ST_PYTHON: the Python of an environment with sentence-transformers and torch, e.g. a venv made
as the README's cpu section says.)

The table: sentences/s of ``MiniLM.embed(texts, batch_size=len(texts))`` (the captured, replayed
path, tokenisation included) and of sentence-transformers' ``encode(texts,
batch_size=len(texts))`` on the same texts, at batch x tokens 1x16 ... 32x128 (every text
tokenises to exactly ``tokens`` ids, [CLS] and [SEP] included). Each implementation runs in a
fresh process per round; processes alternate (the order flips every round), ``--rounds`` rounds
(3). A round warms each row up (two calls, so capture and compile are not timed), then times
calls until ``--reps`` or ``--budget-s`` per row. Reported: median sentences/s over every timed
call of all rounds with p10/p90, the ratio product / sentence-transformers per row, and on every
row the thread counts each process ran with (torch's intra-op threads, BLAS threads from
threadpoolctl, numba's threads), and the per-round ratios' range. ``--contention N`` runs N
busy-loop processes beside both sides for the whole run (a busy host; recorded in the JSON).
JSON to ``--out``; a bar chart with ``--plot`` (matplotlib).

sentence-transformers and torch are not dependencies: point ``--st-python`` at an interpreter
that has them (a side virtualenv, see the README), or run this script with one; without either
the product's rows are measured alone. The same interpreter runs ``--kernels`` so that torch's
kernels can be timed beside the product's.

Self-contained (only numpy, the runtime and, optionally, matplotlib/threadpoolctl): a benchmark
package can call :func:`compare` and :func:`kernel_table`, which return the JSON-ready dicts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: the environment this script was started with: the workers get it (importing the runtime's
#: kernels sets OMP_WAIT_POLICY in this process, which must not reach torch's process)
_USER_ENV = dict(os.environ)
ROWS = ((1, 16), (8, 16), (32, 16), (1, 128), (8, 128), (32, 128))
#: the sentence-transformers worker's torch thread count (``--st-threads``)
ST_THREADS_ENV = "RUNTIME_BENCH_ST_THREADS"
ST = "sentence-transformers"
#: single-wordpiece words the benchmark texts are made of (checked against the tokenizer).
WORDS = ("the cat sat on a mat and the dog ran to see what it was while birds sang in tall "
         "trees near an old house by the river where people walk every day after work").split()


# -- helpers shared by the worker processes ---------------------------------------------------
def _threads() -> dict:
    """Thread counts this process runs with (torch, BLAS libraries, numba, OpenMP)."""
    out: dict = {}
    try:
        from threadpoolctl import threadpool_info
        for i in threadpool_info():       # numpy's and scipy's OpenBLAS share a prefix
            where = os.path.basename(os.path.dirname(i.get("filepath") or ""))
            out[f"{i['user_api']}:{where}/{i.get('prefix') or i['internal_api']}"] = \
                i["num_threads"]
    except ImportError:
        pass
    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].get_num_threads()
    if "numba" in sys.modules:
        out["numba"] = sys.modules["numba"].get_num_threads()
    rule = sys.modules.get("runtime.cpu_threads")
    if rule is not None and hasattr(rule.RULE, "cpu") and os.path.dirname(rule.__file__) == \
            os.path.dirname(getattr(sys.modules.get("runtime"), "__file__", "")):  # its share
        out["cpu share"] = round(rule.RULE.cpu.share, 2)
        out["busy host"] = rule.RULE.cpu.busy
        whole = getattr(rule.RULE, "whole", None)
        if whole is not None:        # whole calls on BLAS's threads: on now, times turned off
            share = None if whole.share is None else round(whole.share, 2)
            out["whole calls"] = f"on={whole.on} stops={whole.stops} share={share}"
        choice = getattr(rule.RULE, "choice", None)
        if choice is not None:       # one thread or all on a busy host (ThreadChoice)
            sp = [None if x is None else round(x, 2) for x in choice.speedups]
            out["thread choice"] = (f"{choice.mode} one={choice.one} comparisons="
                                    f"{choice.comparisons} changes={choice.changes} last={sp}")
    loops = sys.modules.get("runtime.kernels.cpu_loops")
    if loops is not None:                             # numba's OpenMP, as the runtime starts it
        out["numba OMP_WAIT_POLICY"] = _USER_ENV.get(
            "OMP_WAIT_POLICY", "PASSIVE" if hasattr(loops, "_start_pool") else "(default)")
    return out


def _schedstat() -> tuple:
    """``(ns on a cpu, ns runnable but waiting for one)`` summed over this process's threads
    now (``/proc/self/task/*/schedstat``; ``(0, 0)`` where the kernel does not say)."""
    run = wait = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return (0, 0)
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/schedstat", "rb") as f:
                r, w = f.read().split()[:2]
            run, wait = run + int(r), wait + int(w)
        except (OSError, ValueError):
            continue
    return (run, wait)


def _cpu_s() -> float:
    # user + system CPU of every thread of the process (os.times counts in 10 ms ticks)
    return time.process_time()


def _time_calls(fn, reps: int, budget_s: float, account: dict | None = None) -> list:
    """Wall seconds of each timed call of ``fn`` (two warm-up calls first). ``account``, when
    given, gets what the timed calls cost the process: ``wall_s``, ``cpu_s`` (user + system
    over all its threads, :func:`time.process_time`), ``run_s`` / ``wait_s`` (its threads' time on a
    core and runnable but waiting for one, from the kernel's schedstat), ``calls`` and
    ``threads`` (the process's threads at the end)."""
    fn()
    fn()                                           # warm-up: capture, compile, caches
    times, start = [], time.perf_counter()
    c0, s0 = _cpu_s(), _schedstat()
    while len(times) < reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if account is not None:
        s1 = _schedstat()
        account.update(wall_s=time.perf_counter() - start, cpu_s=_cpu_s() - c0,
                       run_s=max(0, s1[0] - s0[0]) / 1e9, wait_s=max(0, s1[1] - s0[1]) / 1e9,
                       calls=len(times), threads=len(os.listdir("/proc/self/task")))
    return times


def texts_for(tokenizer_json: str, batch: int, tokens: int, seed: int = 0) -> list:
    """``batch`` texts of :data:`WORDS` that tokenise to exactly ``tokens`` ids each.

    Raises: ``ValueError`` if a word is not one wordpiece (the lengths would be off).
    """
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer_json)
    tok.no_padding()
    tok.no_truncation()
    rng = np.random.default_rng(seed + 1000 * batch + tokens)
    texts = [" ".join(rng.choice(WORDS, tokens - 2)) for _ in range(batch)]
    for t in texts:
        n = len(tok.encode(t).ids)
        if n != tokens:
            raise ValueError(f"benchmark text tokenises to {n} ids, not {tokens}")
    return texts


def _worker_product(job: dict) -> dict:
    # RUNTIME_BENCH_ROOT (a variant's environment) times another checkout, e.g. the code before
    # a change, in the same alternating run
    sys.path.insert(0, os.environ.get("RUNTIME_BENCH_ROOT", str(ROOT)))
    import runtime
    from runtime.models import MiniLM
    model = MiniLM.load(runtime.client("cpu"), max_graphs=len(job["rows"]))
    res, cost = {}, {}
    for key, texts in job["rows"].items():
        cost[key] = {}
        res[key] = _time_calls(lambda: model.embed(texts, batch_size=len(texts)), job["reps"],
                               job["budget_s"], cost[key])
        cost[key]["rule"] = {k: v for k, v in _threads().items()       # the thread rule's state
                             if k in ("cpu share", "busy host", "whole calls", "thread choice")}
    try:               # numba's count is per thread: report what one executing stream gets
        from runtime.kernels.cpu_loops import set_threads
        # the timed checkout's own rule (an editable install would hand an older checkout
        # the newer checkout's runtime.cpu_threads, a second rule its kernels never use)
        if os.path.exists(os.path.join(os.path.dirname(runtime.__file__), "cpu_threads.py")):
            from runtime.cpu_threads import RULE
        else:                                      # a checkout before the leaf module
            from runtime.kernels.threads import RULE
        RULE.enter()
        set_threads(RULE.threads())
        RULE.exit()
    except ImportError:                            # a checkout before the thread rule
        pass
    return {"samples": res, "cost": cost, "threads": _threads()}


def _worker_st(job: dict) -> dict:
    n = os.environ.get(ST_THREADS_ENV)
    if n:                                # --st-threads: this process's torch intra-op threads
        import torch
        torch.set_num_threads(int(n))
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(job["model_dir"], device="cpu")
    res, cost = {}, {}
    for key, texts in job["rows"].items():
        cost[key] = {}
        res[key] = _time_calls(lambda: model.encode(texts, batch_size=len(texts)), job["reps"],
                               job["budget_s"], cost[key])
    return {"samples": res, "cost": cost, "threads": _threads(),
            "versions": {"torch": sys.modules["torch"].__version__,
                         "sentence_transformers": sys.modules["sentence_transformers"].__version__}}


def _st_python(arg: str | None) -> str | None:
    """The interpreter that has sentence-transformers: ``arg``, this one, or ``None``."""
    if arg:
        return arg
    import importlib.util
    return sys.executable if importlib.util.find_spec("sentence_transformers") else None


def _run_worker(python: str, kind: str, job_file: str, env: dict) -> dict:
    out = job_file + f".{kind}.out.json"
    cmd = [python, str(Path(__file__).resolve()), "--worker", kind, job_file, out]
    proc = subprocess.run(cmd, env={**_USER_ENV, **env}, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(Path(out).read_text())


def _summary(samples: list, batch: int) -> dict:
    """Sentences/s percentiles of forward times ``samples`` (seconds) of ``batch`` texts."""
    from runtime.bench import summarize       # not at the top: workers may time another checkout
    rate = summarize(batch / np.asarray(samples, np.float64), 1)
    return {"sent_per_s": rate["p50"], **rate}


def compare(st_python: str | None, rows=ROWS, rounds: int = 3, reps: int = 20,
            budget_s: float = 4.0, variants: dict | None = None, contention: int = 0,
            st_threads=None, partial: str | None = None) -> dict:
    """The side-by-side table; returns the JSON-ready result (see the module docstring).

    Args:
        st_python: interpreter with sentence-transformers, or ``None`` (product rows alone).
        rows: ``(batch, tokens)`` pairs; rounds: fresh processes per implementation.
        reps, budget_s: timed calls per row and round (at least 3), seconds per row and round.
        variants: product name -> extra environment (thread settings); default
            ``{"runtime": {}}``.
        contention: busy-loop processes running beside both sides for the whole run
            (:func:`runtime.bench.contention.busy_processes`; recorded as ``"contention"``).
        st_threads: torch thread counts to run sentence-transformers at, each in its own
            processes (``"sentence-transformers Nt"``); every ratio is then against the best
            of them on that row (pooled medians; per round, that round's best), and
            ``row["st_best"]`` names it. ``None``: torch's default threads only.
        partial: a path the samples and costs so far are written to after every process (a run
            stopped early keeps what it measured).
    """
    sys.path.insert(0, str(ROOT))
    from runtime.bench import machine
    from runtime.bench.contention import busy_processes
    from runtime.models.minilm import default_model_dir
    model_dir = str(default_model_dir())
    texts = {f"{b}x{s}": texts_for(os.path.join(model_dir, "tokenizer.json"), b, s)
             for b, s in rows}
    impls = {name: (sys.executable, "product", env)
             for name, env in (variants or {"runtime": {}}).items()}
    if st_python:
        for n in st_threads or [None]:
            impls[ST if n is None else f"{ST} {int(n)}t"] = (
                st_python, "st", {} if n is None else {ST_THREADS_ENV: str(int(n))})
    sts = [n for n in impls if n.startswith(ST)]
    samples: dict = {n: {k: [] for k in texts} for n in impls}
    medians: dict = {n: {k: [] for k in texts} for n in impls}     # per round
    costs: dict = {n: {k: [] for k in texts} for n in impls}       # per round (_time_calls)
    info: dict = {}
    with tempfile.TemporaryDirectory() as tmp, busy_processes(contention):
        job = os.path.join(tmp, "job.json")
        Path(job).write_text(json.dumps({"rows": texts, "reps": reps, "budget_s": budget_s,
                                         "model_dir": model_dir}))
        for r in range(rounds):
            order = list(impls) if r % 2 == 0 else list(impls)[::-1]
            for name in order:
                python, kind, env = impls[name]
                res = _run_worker(python, kind, job, env)
                for k, v in res["samples"].items():
                    samples[name][k].extend(v)
                    medians[name][k].append(float(np.median(v)))
                    if res.get("cost", {}).get(k):
                        costs[name][k].append(res["cost"][k])
                info[name] = {"threads": res["threads"], "env": env,
                              **({"versions": res["versions"]} if "versions" in res else {})}
                print(f"round {r + 1}/{rounds}: {name} done", file=sys.stderr, flush=True)
                if partial:
                    Path(partial).write_text(json.dumps({"round": r, "samples": samples,
                                                         "costs": costs}))
    table = []
    for b, s in rows:
        k = f"{b}x{s}"
        row = {"row": k, "batch": b, "tokens": s}
        for name in impls:
            row[name] = _summary(samples[name][k], b)
            if costs[name][k]:
                row[name]["cost"] = _cost(costs[name][k])
        if st_python:
            best = max(sts, key=lambda n: row[n]["sent_per_s"])
            base = row[best]["sent_per_s"]
            row["st_best"] = best
            st_rounds = [min(t) for t in zip(*(medians[n][k] for n in sts))]   # best per round
            for name in impls:
                if name not in sts:
                    row[f"ratio:{name}"] = row[name]["sent_per_s"] / base
                    # each round's ratio of medians (its processes ran back to back)
                    row[f"ratio_rounds:{name}"] = [
                        st_s / ours_s for ours_s, st_s in zip(medians[name][k], st_rounds)]
                    ours, theirs = row[name].get("cost"), row[best].get("cost")
                    if ours and theirs and ours["cpu_ms"] > 0 and theirs["cores"] > 0:
                        # sentences/s = batch / (CPU per forward / cores used): the ratio is
                        # (their CPU per forward / ours) x (our cores / theirs)
                        row[f"split:{name}"] = {
                            "cpu_efficiency": theirs["cpu_ms"] / ours["cpu_ms"],
                            "cpu_share": ours["cores"] / theirs["cores"]}
        table.append(row)
    return {"kind": "minilm_compare", "rounds": rounds, "impls": info, "rows": table,
            "contention": {"busy_processes": contention}, "machine": machine(),
            "st_threads": list(st_threads) if st_threads else None}


def _cost(rounds: list) -> dict:
    """What the timed calls cost per round (:func:`_time_calls`'s ``account``), as medians over
    the rounds with their range: ``cpu_ms`` (process CPU per forward), ``cores`` (CPU seconds per
    wall second while timing), ``got`` (the share of the CPU time its threads were runnable that
    they spent on a core: 1.0 on a free host) and ``threads`` (the process's threads)."""
    def med(vals):
        return {"p50": float(np.median(vals)), "min": float(min(vals)), "max": float(max(vals))}
    cpu = [1e3 * r["cpu_s"] / max(1, r["calls"]) for r in rounds]
    cores = [r["cpu_s"] / r["wall_s"] if r["wall_s"] > 0 else 0.0 for r in rounds]
    got = [r["run_s"] / (r["run_s"] + r["wait_s"]) if r["run_s"] + r["wait_s"] > 0 else 1.0
           for r in rounds]
    return {"cpu_ms": float(np.median(cpu)), "cores": float(np.median(cores)),
            "got": float(np.median(got)), "threads": max(r.get("threads", 0) for r in rounds),
            "rounds": {"cpu_ms": med(cpu), "cores": med(cores), "got": med(got)}}


def print_table(res: dict) -> None:
    """The comparison as a markdown table (sentences/s, median [p10-p90], ratio, threads)."""
    names = list(res["impls"])
    sts = [n for n in names if n.startswith(ST)]
    ratios = [n for n in names if n not in sts] if sts else []
    vs = " (vs ST best)" if len(sts) > 1 else ""
    head = ["batch x tokens"] + [f"{n} sent/s" for n in names] + [f"ratio {n}{vs}"
                                                                  for n in ratios]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in res["rows"]:
        cells = [row["row"]] + [f"{row[n]['sent_per_s']:.1f} [{row[n]['p10']:.1f}-"
                                f"{row[n]['p90']:.1f}]" for n in names]
        cells += [f"{row['ratio:' + n]:.2f}" + (
            f" [{min(row['ratio_rounds:' + n]):.2f}-{max(row['ratio_rounds:' + n]):.2f}]"
            if row.get("ratio_rounds:" + n) else "") for n in ratios]
        print("| " + " | ".join(cells) + " |")
    if any(res["rows"][0].get(n, {}).get("cost") for n in names):
        print()
        head = ["batch x tokens"] + [f"{n} CPU ms/fwd, cores, got" for n in names] + [
            f"{n}: CPU eff. x share" for n in ratios]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in res["rows"]:
            cells = [row["row"]]
            for n in names:
                c = row[n].get("cost")
                cells.append("-" if not c else
                             f"{c['cpu_ms']:.1f} [{c['rounds']['cpu_ms']['min']:.1f}-"
                             f"{c['rounds']['cpu_ms']['max']:.1f}], {c['cores']:.2f} "
                             f"[{c['rounds']['cores']['min']:.2f}-"
                             f"{c['rounds']['cores']['max']:.2f}], {c['got']:.2f}")
            for n in ratios:
                sp = row.get("split:" + n)
                cells.append("-" if not sp else
                             f"{sp['cpu_efficiency']:.2f} x {sp['cpu_share']:.2f}")
            print("| " + " | ".join(cells) + " |")
        print("- CPU ms/fwd: the process's CPU (all threads) per forward; cores: its CPU seconds "
              "per wall second while timing; got: the share of its threads' runnable time on "
              "a core (median over rounds [range]). CPU eff. x share: ST best's CPU per "
              "forward over ours, times our cores over ST best's (their product is about the "
              "ratio)")
    if len(sts) > 1:
        print("- sentence-transformers best per row: " + ", ".join(
            f"{row['row']} {row['st_best'][len(ST) + 1:]}" for row in res["rows"]))
    for n, i in res["impls"].items():
        print(f"- {n}: threads {i['threads']}" + (f", env {i['env']}" if i["env"] else ""))
    print(f"- load average at start {res['machine'].get('loadavg')}; busy-loop processes "
          f"beside both sides: {res.get('contention', {}).get('busy_processes', 0)}")


def plot(res: dict, path: str) -> None:
    """Grouped bars: sentences/s per row and implementation (log scale), ratios on top."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(res["impls"])
    rows = res["rows"]
    x = np.arange(len(rows))
    w = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, n in enumerate(names):
        med = np.array([r[n]["sent_per_s"] for r in rows])
        lo = med - np.array([r[n]["p10"] for r in rows])
        hi = np.array([r[n]["p90"] for r in rows]) - med
        ax.bar(x + i * w, med, w, yerr=[lo, hi], label=n, capsize=2)
    for j, r in enumerate(rows):
        rs = [v for k, v in r.items() if k.startswith("ratio:")]
        if rs:
            ax.text(x[j] + 0.4 - w / 2, max(r[n]["p90"] for n in names) * 1.15,
                    " / ".join(f"{v:.2f}x" for v in rs), ha="center", fontsize=8)
    ax.set_xticks(x + 0.4 - w / 2, [r["row"] for r in rows])
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * 1.5)                 # room for the ratio labels
    ax.set_ylabel("sentences / s (median, p10-p90)")
    ax.set_xlabel("batch x tokens")
    ax.set_title("all-MiniLM-L6-v2 on the cpu: runtime vs sentence-transformers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- the kernel table -------------------------------------------------------------------------
KERNELS = ("matmul_bias_gelu", "matmul_bias (qkv)", "add_layer_norm", "attention")


def _kernel_inputs(batch: int, seq: int) -> dict:
    """The arrays of one MiniLM layer's kernels at ``batch x seq`` (seeded: every process that
    builds them gets the same values)."""
    rng = np.random.default_rng(0)
    H, FF = 384, 1536
    M, f = batch * seq, np.float32
    d = {"x": rng.standard_normal((M, H), dtype=f), "res": rng.standard_normal((M, H), dtype=f),
         "g": rng.standard_normal(H, dtype=f), "b": rng.standard_normal(H, dtype=f),
         "wi": rng.standard_normal((H, FF), dtype=f) * f(0.05),
         "bi": rng.standard_normal(FF, dtype=f),
         "wqkv": rng.standard_normal((H, 3 * H), dtype=f) * f(0.05), "bqkv": np.zeros(3 * H, f),
         "mask": np.ones((batch, seq), f)}
    d["qkv"] = d["x"] @ d["wqkv"]
    return d


def _timer(reps: int):
    from runtime.bench import summarize

    def t(fn):
        fn()
        s = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            s.append(time.perf_counter() - t0)
        return summarize(s)                  # µs
    return t


def _kernels_runtime(batch: int, seq: int, reps: int) -> dict:
    """The runtime's cpu kernels and numpy's equivalents: ``{kernel: {"shape", "runtime",
    "numpy"}}``. Runs on the calling thread as one executing stream under the cpu backend's
    thread rule (BLAS and numba at every core unless the environment says otherwise)."""
    sys.path.insert(0, str(ROOT))
    from runtime.cpu_threads import RULE
    from runtime.kernels import nn
    H, FF, heads, hd = 384, 1536, 12, 32
    M, f = batch * seq, np.float32
    d = _kernel_inputs(batch, seq)
    x, res, g, bH, wi, bi, wqkv, bqkv, qkv, mask = (d[k] for k in (
        "x", "res", "g", "b", "wi", "bi", "wqkv", "bqkv", "qkv", "mask"))
    o_ff, o_h, o_qkv = np.empty(M * FF, f), np.empty(M * H, f), np.empty(M * 3 * H, f)
    cnt = (1, batch * heads, 1)
    rows = {
        "matmul_bias_gelu": (f"[{M},{H}]@[{H},{FF}]",
                             lambda: nn.matmul_bias_gelu.cpu(x.ravel(), wi.ravel(), bi, o_ff, M=M,
                                                             N=FF, K=H, count=cnt),
                             lambda: nn.gelu_np(x @ wi + bi)),
        "matmul_bias (qkv)": (f"[{M},{H}]@[{H},{3 * H}]",
                              lambda: nn.matmul_bias.cpu(x.ravel(), wqkv.ravel(), bqkv, o_qkv,
                                                         M=M, N=3 * H, K=H, count=cnt),
                              lambda: x @ wqkv + bqkv),
        "add_layer_norm": (f"[{M},{H}]",
                           lambda: nn.add_layer_norm.cpu(x.ravel(), res.ravel(), g, bH, o_h,
                                                         rows=M, n=H, eps=1e-12, count=cnt),
                           lambda: _ln_np(x + res, g, bH)),
        "attention": (f"B={batch} S={seq} heads={heads} hd={hd}",
                      lambda: nn.attention.cpu(qkv.ravel(), qkv.ravel(), qkv.ravel(),
                                               mask.ravel(), o_h, S=seq, heads=heads, hd=hd,
                                               ld_in=3 * H, q_off=0, k_off=H, v_off=2 * H,
                                               ld_out=H, scale=hd ** -0.5, count=cnt),
                      lambda: _attn_np(qkv, batch, seq, heads, hd)),
    }
    t = _timer(reps)
    RULE.enter()                     # one executing stream (numpy's column runs under it too)
    try:
        return {k: {"shape": shape, "runtime": t(ours), "numpy": t(ref)}
                for k, (shape, ours, ref) in rows.items()}
    finally:
        RULE.exit()


def _kernels_torch(batch: int, seq: int, reps: int) -> dict:
    """torch's equivalents (its default threads), ``{kernel: {"torch"}}``."""
    import torch
    import torch.nn.functional as F
    H, heads, hd = 384, 12, 32
    d = {k: torch.from_numpy(np.ascontiguousarray(v.T) if k in ("wi", "wqkv") else v)
         for k, v in _kernel_inputs(batch, seq).items()}
    rows = {"matmul_bias_gelu": lambda: F.gelu(F.linear(d["x"], d["wi"], d["bi"])),
            "matmul_bias (qkv)": lambda: F.linear(d["x"], d["wqkv"], d["bqkv"]),
            "add_layer_norm": lambda: F.layer_norm(d["x"] + d["res"], (H,), d["g"], d["b"],
                                                   1e-12),
            "attention": lambda: _attn_torch(d["qkv"], batch, seq, heads, hd)}
    t = _timer(reps)
    with torch.inference_mode():
        return {k: {"torch": t(fn)} for k, fn in rows.items()}


def kernel_table(batch: int = 8, seq: int = 128, reps: int = 30,
                 st_python: str | None = None) -> list:
    """Each cpu kernel of the MiniLM layer (µs, median [p10-p90]) beside numpy's and torch's
    equivalent on the same shapes (the same seeded arrays). The runtime's and numpy's columns
    are timed in this process, torch's in a fresh process of ``st_python`` (an interpreter with
    torch; ``None``: no torch column), so that neither side's thread pools (torch's OpenMP, the
    runtime's numba OpenMP and OpenBLAS) run beside the other's.

    Returns: rows ``{"kernel", "shape", "runtime", "numpy", "torch"}`` (each ``{"p50", "p10",
    "p90"}`` in µs, or ``None``) and, under ``"threads"``, each side's thread counts.
    """
    ours = _kernels_runtime(batch, seq, reps)
    theirs = {}
    if st_python:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "torch.json"
            subprocess.run([st_python, str(Path(__file__).resolve()), "--worker", "kernels",
                            json.dumps({"batch": batch, "seq": seq, "reps": reps}), str(out)],
                           check=True, env=_USER_ENV)
            theirs = json.loads(out.read_text())
    rows = [{"kernel": k, "shape": ours[k]["shape"], "runtime": ours[k]["runtime"],
             "numpy": ours[k]["numpy"], "torch": theirs.get("rows", {}).get(k, {}).get("torch")}
            for k in KERNELS]
    return rows, {"runtime": _threads(), "torch": theirs.get("threads")}


def _ln_np(v, g, b):
    m = v.mean(-1, keepdims=True)
    d = v - m
    return d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-12) * g + b


def _attn_np(qkv, B, S, heads, hd):
    q, k, v = (np.ascontiguousarray(a) for a in
               qkv.reshape(B, S, 3, heads, hd).transpose(2, 0, 3, 1, 4))
    s = q @ k.transpose(0, 1, 3, 2) * np.float32(hd ** -0.5)
    s = np.exp(s - s.max(-1, keepdims=True))
    return ((s / s.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, S, heads * hd)


def _attn_torch(tqkv, B, S, heads, hd):
    import torch.nn.functional as F
    q, k, v = tqkv.view(B, S, 3, heads, hd).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, heads * hd)


def print_kernels(rows: list, threads: dict) -> None:
    """The kernel table as markdown (µs, median [p10-p90]) and each side's threads."""
    def c(v):
        return "-" if v is None else f"{v['p50']:,.0f} [{v['p10']:,.0f}-{v['p90']:,.0f}]"
    print("| kernel | shape | runtime µs | numpy µs | torch µs | runtime/torch |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['runtime']['p50'] / r['torch']['p50']:.2f}" if r["torch"] else "-"
        print(f"| {r['kernel']} | {r['shape']} | {c(r['runtime'])} | {c(r['numpy'])} | "
              f"{c(r['torch'])} | {ratio} |")
    for side, th in threads.items():
        if th:
            print(f"- {side}: threads {th}")
    print(f"- load average {os.getloadavg()}")


# -- the earlier per-backend eager vs replay latency ------------------------------------------
def eager_vs_replay(backends, batches, seqs, reps: int, budget_s: float) -> list:
    """Forward latency (ms) per backend, eager (``forward(graph=False)``) vs ``run_bucket``."""
    sys.path.insert(0, str(ROOT))
    import runtime
    from runtime.models import MiniLM
    rng = np.random.default_rng(0)
    out = []
    for backend in backends:
        try:
            model = MiniLM.load(runtime.client(backend), max_graphs=2)
        except Exception as e:  # noqa: BLE001 - report and go on with the other backends
            print(f"{backend}: skipped ({type(e).__name__}: {e})")
            continue
        for batch in batches:
            for seq in seqs:
                ids = rng.integers(1000, 29000, (batch, seq))
                ids[:, 0], ids[:, -1] = 101, 102
                mask = np.ones((batch, seq), np.int64)
                for mode, fn in (("eager", lambda: model.forward(ids, mask, graph=False)),
                                 ("replay", lambda: model.run_bucket(batch, seq, ids, mask))):
                    ms = np.array(_time_calls(fn, reps, budget_s)) * 1e3
                    r = {"backend": backend, "batch": batch, "seq": seq, "mode": mode,
                         "median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
                         "p90_ms": float(np.percentile(ms, 90)), "reps": len(ms)}
                    out.append(r)
                    print(f"{backend:6s} {batch:3d}x{seq:<4d} {mode:7s} {r['median_ms']:9.2f} ms "
                          f"[{r['p10_ms']:.2f}-{r['p90_ms']:.2f}] n={r['reps']}", flush=True)
                model.release()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--st-python", help="interpreter with sentence-transformers (side venv)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=4.0, help="seconds per row and round")
    ap.add_argument("--rows", nargs="+", default=[f"{b}x{s}" for b, s in ROWS])
    ap.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "ENV=VAL"),
                    help="a product variant: name and environment settings (repeatable)")
    ap.add_argument("--kernels", action="store_true", help="the kernel table instead")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--eager-vs-replay", action="store_true")
    ap.add_argument("--backends", nargs="+", default=["cpu", "wgpu"])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"
                                         / "minilm_forward.json"),
                    help="the JSON (default: benchmarks/results/minilm_forward.json, which git "
                         "ignores)")
    ap.add_argument("--plot", help="write a bar chart (png) of the comparison")
    ap.add_argument("--contention", type=int, default=0, metavar="N",
                    help="run N busy-loop processes beside both sides (a busy host)")
    ap.add_argument("--st-threads", help="comma list of torch thread counts to run "
                    "sentence-transformers at (each in its own processes; ratios against the "
                    "best per row), e.g. 1,2; default: torch's own count")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.worker:
        kind, job, out = args.worker
        if kind == "kernels":                # torch's column of the kernel table
            j = json.loads(job)
            res = {"rows": _kernels_torch(j["batch"], j["seq"], j["reps"]),
                   "threads": _threads()}
        else:
            work = _worker_product if kind == "product" else _worker_st
            res = work(json.loads(Path(job).read_text()))
        Path(out).write_text(json.dumps(res))
        return 0
    if args.kernels:
        rows, threads = kernel_table(args.batch, args.seq, st_python=_st_python(args.st_python))
        print_kernels(rows, threads)
        Path(args.out).write_text(json.dumps({"kind": "minilm_kernels", "batch": args.batch,
                                              "seq": args.seq, "rows": rows,
                                              "threads": threads}, indent=2))
        return 0
    if args.eager_vs_replay:
        res = eager_vs_replay(args.backends, [1, 8, 32], [16, 128], args.reps, args.budget_s)
        Path(args.out).write_text(json.dumps({"kind": "minilm_eager_vs_replay", "rows": res},
                                             indent=2))
        return 0
    rows = [tuple(int(v) for v in r.split("x")) for r in args.rows]
    variants = ({v[0]: dict(kv.split("=", 1) for kv in v[1:]) for v in args.variant}
                if args.variant else None)
    st_threads = [int(n) for n in args.st_threads.split(",")] if args.st_threads else None
    res = compare(_st_python(args.st_python), rows, args.rounds, args.reps, args.budget_s,
                  variants, args.contention, st_threads, partial=args.out + ".partial")
    print_table(res)
    Path(args.out).write_text(json.dumps(res, indent=2))
    if args.plot:
        plot(res, args.plot)
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
