"""embed-corpus without Ray: the batch embedder against the serving tests' fake model (rows kept
in order, a failing text isolated and reported, nulls reported), the files (formats, column
check, Parquet sink), bad input refused before any model loads, and the ``serve --ray`` flags.
Needs pyarrow; about 3-10 s on the loaded 2-core machine (one CLI subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install 'runtime[ray]')")

from runtime.corpus import (ERROR, CorpusEmbedder, ParquetSink, column_names,  # noqa: E402
                            embed_corpus, input_format)
from runtime.serving.batcher import Batcher  # noqa: E402
from test_serving import HIDDEN, FakeModel, expected  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _embedder(model):
    b = Batcher(model, batch_buckets=(1, 2, 4), seq_buckets=(4, 8, 16), max_wait_ms=0)
    return CorpusEmbedder("body", batcher=b)


def test_a_batch_keeps_every_row_in_order_and_reports_the_failed_ones():
    model = FakeModel()
    emb = _embedder(model)
    texts = ["a", None, "bb cc", "boom", "one two three four five", "", "x y"]
    out = emb(pa.table({"id": list(range(7)), "body": texts}))
    assert out.column_names == ["id", "body", "embedding", ERROR]
    assert out.column("id").to_pylist() == list(range(7))
    errors = out.column(ERROR).to_pylist()
    assert errors[1] == "the text is null" and "boom" in errors[3]
    assert [i for i, e in enumerate(errors) if e] == [1, 3]
    rows = out.column("embedding").to_pylist()
    assert rows[1] is None and rows[3] is None
    for i in (0, 2, 4, 5, 6):                     # each row is its own text's, nothing crossed
        np.testing.assert_array_equal(np.array(rows[i], np.float32), expected(model, texts[i]))
    empty = emb(pa.table({"body": pa.array([], pa.string())}))
    assert empty.num_rows == 0 and empty.column_names[-2:] == ["embedding", ERROR]
    emb.close()
    kind = out.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(kind) and kind.list_size == HIDDEN
    assert kind.value_type == pa.float32()


def test_bad_input_is_refused_with_a_clear_error(tmp_path):
    emb = _embedder(FakeModel())
    with pytest.raises(ValueError, match="text column"):
        emb(pa.table({"text": ["a"]}))
    with pytest.raises(ValueError, match="already has"):
        emb(pa.table({"body": ["a"], "embedding": [1]}))
    emb.close()
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown format"):
        input_format(tmp_path / "c.txt")
    with pytest.raises(FileNotFoundError):
        input_format(tmp_path / "none.csv")
    (tmp_path / "c.csv").write_text("id,body\n1,hello\n")
    assert column_names(tmp_path / "c.csv") == ["id", "body"]
    # refused before the model loads: no such column
    with pytest.raises(ValueError, match="'text' not in"):
        embed_corpus(tmp_path / "c.csv", tmp_path / "o.parquet", progress=False)
    r = subprocess.run([sys.executable, "-m", "runtime", "embed-corpus", str(tmp_path / "c.csv"),
                        "--out", str(tmp_path / "o.parquet")], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "'text' not in" in r.stderr


def test_the_parquet_sink_casts_later_batches_and_counts_failures(tmp_path):
    import pyarrow.parquet as pq

    with ParquetSink(tmp_path / "sub" / "o.parquet", error_column="err", keep=2) as sink:
        sink.write(pa.table({"x": ["a", "b"], "err": [None, "bad"]}))
        sink.write(pa.table({"x": pa.nulls(2), "err": ["worse", "worst"]}))   # null-typed column
    t = pq.read_table(tmp_path / "sub" / "o.parquet")
    assert t.column("x").to_pylist() == ["a", "b", None, None]
    assert (sink.rows, sink.failed, sink.failures) == (4, 3, [(1, "bad"), (2, "worse")])
    with pytest.raises(RuntimeError):                 # a failed run leaves no output file
        with ParquetSink(tmp_path / "f.parquet") as sink:
            sink.write(pa.table({"x": ["a"]}))
            raise RuntimeError("the run failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub"]


def test_serve_cli_takes_the_ray_flags_in_one_group():
    from runtime.serving.cli import build_parser

    args = build_parser().parse_args(["--ray", "--replicas", "3", "--address", "ray://h:10001",
                                      "--min-replicas", "1", "--max-replicas", "4",
                                      "--target-ongoing-requests", "8"])
    assert args.ray and args.replicas == 3 and args.address == "ray://h:10001"
    assert (args.min_replicas, args.max_replicas, args.target_ongoing_requests) == (1, 4, 8.0)
    assert not build_parser().parse_args([]).ray

