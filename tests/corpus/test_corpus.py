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

from runtime.corpus import (ERROR, CorpusEmbedder, ParquetSink, embed_corpus,  # noqa: E402
                            input_format, plan_input, read_block)
from runtime.serving.batcher import Batcher  # noqa: E402
from fakes import HIDDEN, FakeModel, expected  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


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
    assert [c for c, _ in plan_input(tmp_path / "c.csv", "body").columns] == ["id", "body"]
    # refused before the model loads: no such column
    with pytest.raises(ValueError, match="'text' not in"):
        embed_corpus(tmp_path / "c.csv", tmp_path / "o.parquet", progress=False)
    (tmp_path / "c.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n')     # in no row
    with pytest.raises(ValueError, match="'text' not in"):
        embed_corpus(tmp_path / "c.jsonl", tmp_path / "o.parquet", progress=False)
    (tmp_path / "e.csv").write_text("id,text\n")
    with pytest.raises(ValueError, match="no rows"):
        embed_corpus(tmp_path / "e.csv", tmp_path / "o.parquet", progress=False)
    for empty in ("e.jsonl",):                          # an empty file: not a column problem
        (tmp_path / empty).write_text("")
        with pytest.raises(ValueError, match="no rows"):
            embed_corpus(tmp_path / empty, tmp_path / "o.parquet", progress=False)
    # USER8: lines, but no JSON object among them: said "the input has no rows"
    for body, why in (("plain text\n", "not valid JSON"), ("[1, 2]\n\"x\"\n", "a JSON list")):
        (tmp_path / "n.jsonl").write_text(body)
        with pytest.raises(ValueError, match=rf"no line is a JSON object \(the first is {why}"):
            embed_corpus(tmp_path / "n.jsonl", tmp_path / "o.parquet", progress=False)
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



# -- reading: the text column is never type-inferred, every row is kept ---------------------
BAD_JSONL = ('{"id": 0, "tag": "x"}\n'                # no text field in the first line
             '{"id": 1, "text": "hello there"}\n\n'   # a blank line is no row
             '{"id": 2, "text": 5}\n'                  # a number (pyarrow: ArrowInvalid)
             'not json\n[1, 2]\n'
             '{"id": 3, "text": null}\n'
             '{"id": 4, "text": {"a": 1}, "tag": 7}\n'  # an object; tag becomes mixed
             '{"id": 5, "text": "bye now"}\n')
WANT_ERRORS = ["the row has no text field", None, "the text is a JSON number, not a string",
               "the line is not valid JSON", "the line is a JSON list, not an object",
               "the text is null", "the text is a JSON object, not a string", None]


@pytest.mark.parametrize("block_rows", [1, 3, 100])
def test_every_block_reads_the_same_rows_and_types_whatever_the_block_size(tmp_path,
                                                                            block_rows):
    (tmp_path / "c.jsonl").write_text(BAD_JSONL)
    plan = plan_input(tmp_path / "c.jsonl", "text", block_rows)
    assert plan.rows == 8 and [b.first_row for b in plan.blocks] == list(range(0, 8, block_rows))
    t = pa.concat_tables([read_block(plan, b) for b in plan.blocks])
    assert t.column("id").to_pylist() == [0, 1, 2, None, None, 3, 4, 5]
    assert t.column("text").to_pylist() == [None, "hello there"] + [None] * 5 + ["bye now"]
    assert t.column("tag").to_pylist() == ["x"] + [None] * 5 + ["7", None]
    assert t.schema.field("text").type == pa.string()
    rows = ['id,text,n\n', '1,"two\nlines, quoted",3\n', '2,42,4\n', '\n', '3,plain,x\n']
    (tmp_path / "c.csv").write_text("".join(rows))
    plan = plan_input(tmp_path / "c.csv", "text", block_rows)
    t = pa.concat_tables([read_block(plan, b) for b in plan.blocks])
    assert t.column("text").to_pylist() == ["two\nlines, quoted", "42", "plain"]
    assert t.column("n").to_pylist() == ["3", "4", "x"]          # "x" in a number column
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": list(range(10)), "text": [f"t{i}" for i in range(10)]}),
                   tmp_path / "c.parquet", row_group_size=3)
    plan = plan_input(tmp_path / "c.parquet", "text", block_rows)
    t = pa.concat_tables([read_block(plan, b) for b in plan.blocks])
    assert t.column("id").to_pylist() == list(range(10))


WANT_RAW = [None, None, "5", "not json", "[1, 2]", None, '{"a": 1}', None]


def test_a_text_that_is_not_a_string_is_kept_as_its_json_text(tmp_path):
    """A user fixes such rows up from ``text_raw`` (a separate column: "5" in ``text`` would
    pass for a real text); present only when some row needs it, same on every format."""
    import json

    import pyarrow.parquet as pq

    from runtime.corpus import raw_column
    from runtime.corpus.files import TEXT_ERROR

    assert raw_column("text") == "text_raw" and raw_column("body") == "body_raw"
    (tmp_path / "c.jsonl").write_text(BAD_JSONL)
    plan = plan_input(tmp_path / "c.jsonl", "text", 3)
    t = pa.concat_tables([read_block(plan, b) for b in plan.blocks])
    assert t.column_names == ["id", "tag", "text", "text_raw", TEXT_ERROR]
    assert t.column("text_raw").to_pylist() == WANT_RAW
    assert json.loads(t.column("text_raw")[6].as_py()) == {"a": 1}
    # a dataset folder written before the raw column existed is not resumed into one with it
    # (private reach: _prepare is the Ray path's folder check, run here without Ray)
    from runtime.corpus.run import MANIFEST, _prepare
    old_key = {k: v for k, v in plan.key().items() if k != "raw_column"}
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / MANIFEST).write_text(json.dumps(old_key))
    with pytest.raises(ValueError, match="another run"):
        _prepare(plan, tmp_path / "ds", resume=True)
    (tmp_path / "u.jsonl").write_text('{"text": 1.5e300}\n{"text": ["é", true]}\n'
                                      '{"text": "fine"}\n')
    plan = plan_input(tmp_path / "u.jsonl", "text", 2)
    t = pa.concat_tables([read_block(plan, b) for b in plan.blocks])
    assert t.column("text_raw").to_pylist() == ["1.5e+300", '["é", true]', None]
    (tmp_path / "ok.jsonl").write_text('{"text": "a", "text_raw": 1}\n{"text": null}\n')
    plan = plan_input(tmp_path / "ok.jsonl", "text", 2)     # only strings and nulls: no column
    assert [c for c, _ in plan.columns] == ["text", "text_raw"]
    assert read_block(plan, plan.blocks[0]).column("text_raw").to_pylist() == [1, None]
    (tmp_path / "clash.jsonl").write_text('{"text": 5, "text_raw": "mine"}\n')
    with pytest.raises(ValueError, match="'text_raw'"):
        plan_input(tmp_path / "clash.jsonl", "text")
    pq.write_table(pa.table({"text": [3, None, 4], "id": [0, 1, 2]}), tmp_path / "i.parquet",
                   row_group_size=2)
    plan = plan_input(tmp_path / "i.parquet", "text", 2)
    t = pa.concat_tables([read_block(plan, b) for b in plan.blocks])
    assert t.column_names == ["text", "text_raw", "id", TEXT_ERROR]
    assert t.column("text").to_pylist() == [None] * 3
    assert t.column("text_raw").to_pylist() == ["3", None, "4"]
    pq.write_table(pa.table({"text": pa.nulls(2)}), tmp_path / "n.parquet")   # nothing to keep
    plan = plan_input(tmp_path / "n.parquet", "text")
    t = read_block(plan, plan.blocks[0])
    assert t.column_names == ["text", TEXT_ERROR] and t.schema.field("text").type == pa.string()
    (tmp_path / "c.csv").write_text("id,text\n1,42\n")            # CSV: every text is a string
    plan = plan_input(tmp_path / "c.csv", "text")
    assert raw_column("text") not in read_block(plan, plan.blocks[0]).column_names


def test_embed_corpus_keeps_every_good_row_of_a_bad_corpus(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    import runtime.serving as serving

    model = FakeModel()
    monkeypatch.setattr(serving, "load_model", lambda *a, **k: model)
    (tmp_path / "c.jsonl").write_text(BAD_JSONL)
    s = embed_corpus(tmp_path / "c.jsonl", tmp_path / "o.parquet", progress=False,
                     block_rows=3, batch_size=2, seq_buckets=(4, 8, 16))
    t = pq.read_table(tmp_path / "o.parquet")
    assert (s.rows, s.failed) == (8, 6)
    assert t.column_names == ["id", "tag", "text", "text_raw", "embedding", ERROR]
    assert t.column("text_raw").to_pylist() == WANT_RAW       # the value kept to fix it up
    errors = t.column(ERROR).to_pylist()
    for got, want in zip(errors, WANT_ERRORS):
        assert (got is None) == (want is None) and (want is None or got.startswith(want))
    assert [r for r, _ in s.failures] == [0, 2, 3, 4, 5, 6]
    rows = t.column("embedding").to_pylist()
    np.testing.assert_array_equal(rows[1], expected(model, "hello there"))
    np.testing.assert_array_equal(rows[7], expected(model, "bye now"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "o.parquet"]


@pytest.mark.slow
def test_sigterm_leaves_no_partial_file(tmp_path):
    import os
    import signal
    import time

    pytest.importorskip("tokenizers", reason="tokenizers is not installed")
    from runtime.models.minilm import default_model_dir
    try:
        if not (default_model_dir() / "model.safetensors").is_file():
            pytest.skip("no MiniLM model files")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    src = tmp_path / "c.jsonl"
    src.write_text("".join(f'{{"text": "sentence number {i} of many"}}\n' for i in range(3000)))
    out = tmp_path / "o.parquet"
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "embed-corpus", str(src), "--out",
                             str(out), "--block-rows", "32", "--batch-size", "32"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = tmp_path / "o.parquet.partial"
    try:
        t_end = time.monotonic() + 240
        while not partial.exists() and proc.poll() is None and time.monotonic() < t_end:
            time.sleep(0.05)
        assert partial.exists(), "the run never started writing"
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"], err


def test_a_ray_run_into_a_folder_that_is_not_empty_is_refused_before_ray_starts(tmp_path,
                                                                                monkeypatch):
    """From a new user's trial: ``embed-corpus --ray`` into a non-empty --out was refused only
    after Ray had started (~10 s); the folder is checked first now (also ``--single-file``'s
    ``.parts`` folder), and ``--resume`` still goes on to Ray."""
    import runtime.cluster
    from runtime.corpus import cli

    started = []
    monkeypatch.setattr(runtime.cluster, "init_ray", lambda *a, **k: started.append(a) or
                        (_ for _ in ()).throw(RuntimeError("ray started")))
    (tmp_path / "c.jsonl").write_text('{"text": "a"}\n')
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("")
    parts = tmp_path / "one.parquet.parts"
    parts.mkdir()
    (parts / "y").write_text("")
    for argv in ([str(tmp_path / "c.jsonl"), "--out", str(out), "--ray"],
                 [str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "one.parquet"), "--ray",
                  "--single-file"]):
        with pytest.raises(ValueError, match="not empty"):
            cli.main(argv)
    assert started == []
    with pytest.raises(RuntimeError, match="ray started"):
        cli.main([str(tmp_path / "c.jsonl"), "--out", str(out), "--ray", "--resume"])


def test_the_input_itself_or_a_text_named_out_is_refused_even_with_overwrite(tmp_path):
    """USER8: ``embed-corpus c.jsonl --out c.jsonl --overwrite`` replaced the corpus with its
    Parquet output (exit 0, the input gone), and ``--out c.csv`` wrote Parquet under a CSV
    name (a later run reads it as CSV). Both are refused before anything loads (status 2)."""
    from runtime.corpus import cli

    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "one"}\n')
    before = src.read_bytes()
    for argv in ([str(src), "--out", str(src)], [str(src), "--out", str(src), "--overwrite"]):
        with pytest.raises(ValueError, match="is the input file"):
            cli.main(argv)
    with pytest.raises(ValueError, match="is the input file"):
        embed_corpus(src, tmp_path / "." / "c.jsonl", overwrite=True, progress=False)
    assert src.read_bytes() == before
    pq_src = tmp_path / "c.parquet"
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one"]}), pq_src)
    import signal
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError, match="is the input file"):
        cli.main([str(pq_src), "--out", str(pq_src), "--overwrite"])
    assert signal.getsignal(signal.SIGTERM) is handler              # the caller's handler back
    pq_src.unlink()
    for name in ("o.csv", "o.JSONL", "o.json", "o.ndjson"):
        with pytest.raises(ValueError, match=r"Parquet file.*name it 'o\.parquet'"):
            cli.main([str(src), "--out", str(tmp_path / name)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_an_existing_out_is_refused_unless_overwrite_on_both_paths(tmp_path, monkeypatch):
    """ADV4: without ``--ray`` an existing ``--out`` file was silently replaced, while ``--ray``
    refused a non-empty folder (and ``--ray --single-file`` replaced the file too). Now both
    refuse (ValueError: exit status 2, before a model loads or Ray starts) unless
    ``--overwrite``; it replaces a file, or the files a run wrote in a dataset folder (never a
    folder holding other files)."""
    import pyarrow.parquet as pq

    import runtime.cluster
    import runtime.serving as serving
    from runtime.corpus import cli
    from runtime.corpus.run import MANIFEST, _prepare

    model = FakeModel()
    monkeypatch.setattr(serving, "load_model", lambda *a, **k: model)
    kw = {"progress": False, "seq_buckets": (4, 8, 16), "block_rows": 2}
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "two"}\n{"text": "three"}\n')
    out = tmp_path / "o.parquet"
    embed_corpus(tmp_path / "a.jsonl", out, **kw)
    first = out.read_bytes()
    with pytest.raises(ValueError, match="exists: pass --overwrite"):
        embed_corpus(tmp_path / "b.jsonl", out, **kw)
    with pytest.raises(ValueError, match="exists: pass --overwrite"):
        cli.main([str(tmp_path / "b.jsonl"), "--out", str(out)])
    assert out.read_bytes() == first                        # untouched
    s = embed_corpus(tmp_path / "b.jsonl", out, overwrite=True, **kw)
    assert s.rows == 2 and pq.read_table(out).column("text").to_pylist() == ["two", "three"]
    with pytest.raises(ValueError, match="is a folder"):
        embed_corpus(tmp_path / "a.jsonl", tmp_path, overwrite=True, **kw)

    # --ray: refused before Ray starts; --overwrite goes on to Ray
    started = []
    monkeypatch.setattr(runtime.cluster, "init_ray", lambda *a, **k: started.append(a) or
                        (_ for _ in ()).throw(RuntimeError("ray started")))
    src = str(tmp_path / "a.jsonl")
    with pytest.raises(ValueError, match="exists: pass --overwrite"):
        cli.main([src, "--out", str(out), "--ray", "--single-file"])
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "part-000000.parquet").write_text("")
    (folder / MANIFEST).write_text("{}")
    with pytest.raises(ValueError, match="not empty"):
        cli.main([src, "--out", str(folder), "--ray"])
    with pytest.raises(ValueError, match="contradict"):
        cli.main([src, "--out", str(folder), "--ray", "--resume", "--overwrite"])
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="did not write"):
        cli.main([src, "--out", str(folder), "--ray", "--overwrite"])
    assert started == []
    (folder / "notes.txt").unlink()
    for argv in ([src, "--out", str(out), "--ray", "--single-file", "--overwrite"],
                 [src, "--out", str(folder), "--ray", "--overwrite"]):
        with pytest.raises(RuntimeError, match="ray started"):
            cli.main(argv)
    assert len(started) == 2
    # what the Ray run does first with --overwrite: the earlier run's files go
    assert _prepare(plan_input(tmp_path / "a.jsonl", "text", 2), folder, False, True) == set()
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST]
