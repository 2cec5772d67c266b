"""The ``decode`` section of ``python -m runtime bench``: greedy decoding three ways.

    python -m runtime bench --sections decode [--backend cpu,wgpu] [--quick]

The decoder of ``runtime.models.decoder`` (random weights, 2 layers, width 64) generates
``tokens`` tokens after a one-token prompt, with the tokens read once at the end:

- ``eager``: every step launches its ~25 kernels one by one;
- ``replay_per_token``: one ``Graph.replay()`` of the captured step per token (a host
  enqueue per token, no host read);
- ``replay_per_sequence``: one replay of ``capture_while(go, step + decode_continue)`` for the
  whole sequence: the loop and its end test run on the device (issue 27 item 3).

The three modes run interleaved (rotating order, ``runtime.bench.timing.interleaved``) after a
warm-up that compiles every kernel and captures both graphs, and must give identical tokens
(checked every sample; a mismatch fails the section). Rows: tokens/s median with p10/p90 over
the repetitions, and the speed-up over eager. cuda has no loop nodes here: its per-sequence row
says why (``skipped``).
"""

from __future__ import annotations

import numpy as np

from .timing import interleaved, summarize

MODES = ("eager", "replay_per_token", "replay_per_sequence")


def _plan(quick: bool) -> dict:
    return {"tokens": 16 if quick else 32, "reps": 3 if quick else 7}


def units(quick: bool) -> int:
    """Ticks per backend: one per repetition, plus the warm-up."""
    return _plan(quick)["reps"] + 1


def measure(backend: str, quick: bool = False, tick=None, budget=None) -> dict:
    """Tokens/s of the three modes on ``backend`` (see the module doc). A ``budget``
    (:class:`runtime.bench.budget.Budget`) stops the repetitions early (at least 2).

    Returns: ``{"tokens", "config", "modes": {mode: {"tokens_per_s": summary, "ms_per_token":
    summary} | {"skipped": why}}, "speedup_vs_eager": {mode: median ratio}}``.
    Raises: ``AssertionError`` when two modes disagree on the tokens.
    """
    import runtime
    from runtime.errors import UnsupportedError
    from runtime.models.decoder import Decoder, DecoderConfig

    plan = _plan(quick)
    n = plan["tokens"]
    cfg = DecoderConfig(layers=2, dim=64, max_len=max(64, n + 2))
    dec = Decoder(runtime.client(backend), cfg)
    prompt = [1]
    kw = {"eager": {}, "replay_per_token": {"graph": True},
          "replay_per_sequence": {"per_sequence": True}}
    skipped = {}
    ref = dec.generate(prompt, n)
    for mode in MODES[1:]:
        try:
            got = dec.generate(prompt, n, **kw[mode])     # compiles and captures
        except UnsupportedError as e:
            skipped[mode] = f"{type(e).__name__}: {e}"
            continue
        assert np.array_equal(got, ref), f"{mode} tokens {got} != eager {ref}"
    if tick is not None:
        tick()

    def sample(mode):
        def run():
            t = {}
            got = dec.generate(prompt, n, timings=t, **kw[mode])
            assert np.array_equal(got, ref), f"{mode} tokens {got} != eager {ref}"
            return t["seconds"]
        return run
    paths = {m: sample(m) for m in MODES if m not in skipped}
    try:
        runs = interleaved(paths, plan["reps"], tick=tick, budget=budget, what="decode")
    finally:
        dec.release()
    modes: dict = {}
    for m in MODES:
        if m in skipped:
            modes[m] = {"skipped": skipped[m]}
            continue
        secs = np.asarray(runs[m])
        modes[m] = {"tokens_per_s": summarize(n / secs, scale=1.0),
                    "ms_per_token": summarize(secs / n, scale=1e3)}
    eager = modes["eager"]["tokens_per_s"]["p50"]
    return {"tokens": n, "prompt": prompt, "config": {"layers": cfg.layers, "dim": cfg.dim},
            "modes": modes,
            "speedup_vs_eager": {m: modes[m]["tokens_per_s"]["p50"] / eager
                                 for m in MODES if "tokens_per_s" in modes[m]}}


def markdown(result: dict, img=None) -> list:
    """The section's markdown lines (``Section.markdown``): one row per backend and mode."""
    have = [(b, r["decode"]) for b, r in result["backends"].items()
            if "modes" in r.get("decode", {})]
    if not have:
        return []
    lines = ["## Decode: eager vs one replay per token vs one replay per sequence "
             "(`runtime/bench/decode.py`)", "",
             "Greedy decoding of the random-weight decoder (2 layers, width 64), tokens read "
             "once at the end; tokens/s, median (p10-p90) over interleaved repetitions.", "",
             "| backend | tokens | mode | tokens/s p50 | p10 | p90 | ms/token | vs eager | n |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b, res in have:
        for m in MODES:
            x = res["modes"][m]
            if "skipped" in x:
                lines.append(f"| {b} | {res['tokens']} | {m} | - | - | - | - | - | "
                             f"skipped: {x['skipped'][:60]} |")
                continue
            t, ms = x["tokens_per_s"], x["ms_per_token"]
            lines.append(f"| {b} | {res['tokens']} | {m} | {t['p50']:.0f} | {t['p10']:.0f} | "
                         f"{t['p90']:.0f} | {ms['p50']:.3g} | "
                         f"{res['speedup_vs_eager'][m]:.2f}x | {t['n']} |")
    return lines


__all__ = ["measure", "units", "markdown", "MODES"]
