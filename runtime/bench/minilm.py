"""The MiniLM forward section: eager vs replay (vs sentence-transformers where installed), in ms.

Host token ids in, embeddings out, as the embeddings server calls the model: ``eager`` launches
every kernel (``MiniLM.forward(..., graph=False)``), ``replay`` writes the inputs of the bucket's
captured graph and replays it (``MiniLM.run_bucket``), ``sentence_transformers`` runs the same
model files in torch on the cpu rows. ``--quick`` runs batch 1, sequence 16 on cpu only (a
forward on lavapipe takes seconds).
"""

from __future__ import annotations

import numpy as np

from .budget import unbounded
from .timing import clock, summarize
from .report import backends_with, cell, pyplot, save_png

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


def measure(backend: str, quick: bool = False, tick=None, budget_s: float = 8.0,
            budget=None) -> dict:
    """MiniLM forward per ``(batch, seq)``: eager vs replay (+ sentence-transformers), in ms.

    Each configuration takes turns between the paths until ``min_reps`` and ``budget_s`` seconds
    are both reached, or ``max_reps``. Host ids in, embeddings out, as a server calls it. A
    ``budget`` (:class:`runtime.bench.budget.Budget`) is shared among the configurations by
    their size; one whose share is spent stops after fewer repetitions (at least one of each
    path after the warm-up), and the cut is recorded. A configuration that cannot fit in what
    is left of the budget (predicted from the last row's seconds per token) or comes after the
    budget is spent is not measured: its row says so (``"skipped"``), as do the cuts (the first
    row always runs).

    Returns: ``{"rows": [{"batch", "seq", "reps", "eager", "replay"[, "sentence_transformers"]}],
    "sentence_transformers": "measured" or why not}`` (summaries in ms), or ``{"skipped": why}``
    (model files missing, or ``quick`` on a backend other than cpu).
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
    parts = (budget or unbounded()).split([b * s + 64 for b, s in plan])
    left = (budget or unbounded()).left
    per_token = 0.0                                      # eager seconds per token, last row
    for batch, seq in plan:
        part = next(parts)
        # the warm-up and capture alone take several forwards (on lavapipe, 32x128 is ~12 s
        # each): a row that cannot fit in what is left of the section's budget (by the seconds
        # per token of the last row of >= 128 tokens, ~6 forwards at least) is skipped, said
        # in the row and the cuts
        need = 6 * per_token * batch * seq if per_token else 0.0
        if out["rows"] and part.seconds is not None and (part.seconds <= 0 or need > left()):
            why = (f"the section's --budget-s share was spent or too small (it needs ~{need:.0f} "
                   f"s, {max(0.0, left()):.0f} s were left; --budget-s 0 runs every row)")
            part.cut(f"MiniLM batch {batch} seq {seq}: not measured ({why})")
            out["rows"].append({"batch": batch, "seq": seq, "reps": 0, "skipped": why})
            if tick:
                tick(max_reps)
            continue
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
            if r >= 1 and part.expired():
                part.cut(f"MiniLM batch {batch} seq {seq}: {r} repetition(s), planned "
                         f"{min_reps}-{max_reps}")
                break
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
        if samples["eager"] and batch * seq >= 128:   # below, per-forward costs dominate
            per_token = min(samples["eager"]) / (batch * seq)
        row = {"batch": batch, "seq": seq, "reps": r}
        row.update({p: summarize(v, 1e3) for p, v in samples.items()})
        out["rows"].append(row)
        model.release()                                  # one bucket's buffers at a time
    model.release()
    return out


def units(quick: bool) -> int:
    """Progress-bar units :func:`measure` reports (one per repetition, at most)."""
    return len(MINILM_QUICK if quick else MINILM_FULL) * (3 if quick else 20)


# -- report: targets, markdown, plot (the Section hooks of runtime/bench/suite.py) ----------------
def _minilm_md(b: str, mm: dict) -> list:
    if "skipped" in mm or "error" in mm:
        return [f"MiniLM on {b}: not measured ({mm.get('skipped') or mm.get('error')})."]
    st = any("sentence_transformers" in r for r in mm["rows"])
    head = "| batch | seq | eager ms | replay ms | eager/replay |"
    head += " sentence-transformers ms |" if st else ""
    lines = [head, "|---:|---:|---:|---:|---:|" + ("---:|" if st else "")]
    for r in mm["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['batch']} | {r['seq']} | not measured: {r['skipped']} | | |"
                         + (" |" if st else ""))
            continue
        cells = [str(r["batch"]), str(r["seq"]), cell(r["eager"]), cell(r["replay"]),
                 f"{r['eager']['p50'] / r['replay']['p50']:.2f}x"]
        if st:
            cells.append(cell(r["sentence_transformers"]) if "sentence_transformers" in r else "")
        lines.append("| " + " | ".join(cells) + " |")
    if not st:
        lines.append(f"\nsentence-transformers: {mm.get('sentence_transformers')}.")
    return lines

def markdown(result: dict, img) -> list:
    """Markdown of the MiniLM forward section (empty when no backend has it)."""
    if not any("minilm" in r for r in result["backends"].values()):
        return []
    lines = ["## MiniLM forward (ms; host ids in, embeddings out)", ""]
    for b, res in result["backends"].items():
        if "minilm" in res:
            lines += [f"### {b}", ""] + _minilm_md(b, res["minilm"]) + [""]
    return lines + img("minilm.png", "MiniLM forward")

def plot(result: dict, folder: Path) -> list:
    """``minilm.png`` (ms per forward, per path and bucket) into ``folder``; the paths written.

    Raises: ``ImportError`` without matplotlib.
    """
    have = [(b, [r for r in mm["rows"] if "skipped" not in r])
            for b, mm in backends_with(result, "minilm", "rows")]
    if not have:
        return []
    plt = pyplot()
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
    return [save_png(plt, fig, folder, "minilm.png")]
