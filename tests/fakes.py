"""Fakes of the serving and corpus tests (tests/serving/, tests/test_corpus.py): an
embedding model with deterministic rows, a poison word that fails its batch and a
settable delay (numpy only), and a Prometheus text parser."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np


REPO = Path(__file__).resolve().parents[1]
HIDDEN = 8
POISON = 666                                    # token id of the word "boom" in the fake model


# -- a fake model ---------------------------------------------------------------------------
class FakeModel:
    """Records every call. Token ids: [CLS]=101, one id per word (its length + 1000, or POISON
    for "boom"), [SEP]=102, truncated to ``max_seq_length`` keeping [SEP]. A row's embedding
    spells its real tokens: ``out[r, :L] = ids[r, :L]`` (L <= HIDDEN - 1), ``out[r, -1] = L``.
    Padding rows come back as NaN, so any that leaked would show."""

    hidden = HIDDEN

    def __init__(self, max_seq_length: int = 16, max_graphs: int = 4, delay: float = 0.0,
                 gate: threading.Event | None = None):
        self.max_seq_length = max_seq_length
        self.max_graphs = max_graphs
        self.delay = delay
        self.gate = gate                         # when given, every batch waits for it
        self.entered = threading.Event()         # set once the first batch has started
        self.calls = []                          # (path, batch, seq, rows)
        self._buckets: list = []
        self.lock = threading.Lock()

    @property
    def buckets(self):
        return list(self._buckets)

    def tokenize(self, texts):
        rows = []
        for t in texts:
            ids = [POISON if w == "boom" else 1000 + len(w) for w in t.split()]
            rows.append([101] + ids[:self.max_seq_length - 2] + [102])
        L = max(len(r) for r in rows)
        ids = np.zeros((len(rows), L), np.int64)
        mask = np.zeros((len(rows), L), np.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = r, 1
        return ids, mask

    def _compute(self, ids, mask):
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        if (ids == POISON).any():
            raise RuntimeError("boom")
        out = np.full((ids.shape[0], HIDDEN), np.nan, np.float32)
        for r in range(ids.shape[0]):
            L = int(mask[r].sum())
            if L:
                out[r] = 0
                k = min(L, HIDDEN - 1)
                out[r, :k] = ids[r, :k]
                out[r, -1] = L
        time.sleep(self.delay)
        return out

    def run_bucket(self, batch, seq_len, ids, mask):
        b, s = ids.shape
        assert b <= batch and s <= seq_len
        with self.lock:
            if (batch, seq_len) in self._buckets:
                self._buckets.remove((batch, seq_len))
            elif len(self._buckets) >= self.max_graphs:
                self._buckets.pop(0)
            self._buckets.append((batch, seq_len))
            self.calls.append(("graph", batch, seq_len, b))
        pi = np.zeros((batch, seq_len), np.int64)
        pm = np.zeros((batch, seq_len), np.int64)
        pi[:b, :s], pm[:b, :s] = ids, mask
        return self._compute(pi, pm)             # all `batch` rows: the batcher must cut them

    def forward(self, ids, mask, graph=False):
        with self.lock:
            self.calls.append(("eager", ids.shape[0], ids.shape[1], int((mask.sum(1) > 0).sum())))
        return self._compute(np.asarray(ids), np.asarray(mask))


def expected(model, text):
    ids, mask = model.tokenize([text])
    L = int(mask.sum())
    e = np.zeros(HIDDEN, np.float32)
    e[:min(L, HIDDEN - 1)] = ids[0, :min(L, HIDDEN - 1)]
    e[-1] = L
    return e


TEXTS = ["", "a", "bb cc", "one two three four five", "x " * 30, "hello there world",
         "q w e r t y u i o p a s d"]


def samples(text: str) -> dict:
    """``{(name, ((label, value), ...)): value}`` of a Prometheus exposition, parsed by
    ``prometheus_client.parser`` (so the text is valid as well as right)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


