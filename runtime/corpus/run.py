"""Embed a corpus file: in this process into one Parquet file, or on a Ray Data actor pool into
a Parquet dataset written by the workers (one file per block), resumable.

Both paths run the same three steps per block (:func:`embed_block`): :func:`~runtime.corpus.
files.read_block` with the plan's types, the :class:`~runtime.corpus.CorpusEmbedder`, and the
table that goes out. So the in-process file and the Ray dataset (or its single-file merge)
hold the same rows, values and types, and the exit status is the same on every input.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .embedder import EMBEDDING, ERROR, CorpusEmbedder
from .files import FORMATS, ROW_INDEX, Block, ParquetSink, plan_input, read_block

#: The Ray path's manifest in the dataset folder: the plan it belongs to.
MANIFEST = "_plan.json"
#: Failures kept per block and per run (the count covers all).
KEEP_FAILURES = 20


@dataclass
class CorpusSummary:
    """What :func:`embed_corpus` did.

    Attributes:
        output: the Parquet file or dataset folder written; rows: rows written (= rows read);
        failed: rows with a null embedding (their ``embedding_error`` says why);
        failures: the first ``(row, message)`` pairs of those, by row; seconds: wall time;
        blocks: blocks in the input; resumed: blocks found finished and skipped.
    """

    output: str
    rows: int = 0
    failed: int = 0
    failures: list = field(default_factory=list)
    seconds: float = 0.0
    blocks: int = 0
    resumed: int = 0


def embed_block(plan, block: Block, embedder: CorpusEmbedder, batch_size: int):
    """One block's output table: its rows in input order, the input's columns, then
    ``embedding`` and ``embedding_error``, embedded ``batch_size`` rows per embedder call."""
    import pyarrow as pa

    table = read_block(plan, block)
    parts = [embedder(table.slice(s, batch_size))
             for s in range(0, max(table.num_rows, 1), batch_size)]
    return pa.concat_tables(parts)


def part_name(index: int) -> str:
    """The dataset file of block ``index`` (names sort in input order)."""
    return f"part-{index:06d}.parquet"


def embed_corpus(input_path, output_path, *, text_column: str = "text", use_ray: bool = False,
                 actors: int = 1, batch_size: int = 256, block_rows: int = 4096,
                 actor_cpus: float = 1.0, actor_gpus: float | None = None,
                 progress: bool = True, resume: bool = False, single_file: bool = False,
                 overwrite: bool = False, **settings) -> CorpusSummary:
    """Embed every row's text; write the rows, in input order, with ``embedding`` added.

    Args:
        input_path: a JSON Lines (``.jsonl``), CSV or Parquet file (with ``use_ray``: at the
            same path on every node, or on a shared file system).
        output_path: in-process (or with ``single_file``): the Parquet file to write, the
            input's columns then ``embedding`` (``fixed_size_list<float32>[384]``) and
            ``embedding_error`` (null unless the row failed), and where some text is not a
            string, ``<text_column>_raw`` after the text column (that value's JSON text,
            :func:`~runtime.corpus.files.raw_column`). With ``use_ray``: a folder, the
            Parquet dataset the workers write, one ``part-NNNNNN.parquet`` per block, each
            with :data:`~runtime.corpus.files.ROW_INDEX` (the row's 0-based input row) first.
        text_column: the column with the texts.
        use_ray: run on the connected Ray cluster (call :func:`runtime.cluster.init_ray`
            first): a Ray Data actor pool of ``actors`` actors (``actor_cpus`` CPUs and
            ``actor_gpus`` GPUs each; GPUs default to 1 with ``backend="cuda"``), each with one
            :class:`CorpusEmbedder`, reads, embeds and writes whole blocks; this process only
            plans the blocks and collects one small summary per block (its memory does not
            grow with the corpus).
        batch_size: rows per embedder call; block_rows: rows per block.
        progress: show a progress bar (rows in-process, blocks with Ray).
        resume: with ``use_ray``: keep the blocks already in the dataset folder (written by
            an earlier run of the same plan that crashed or was stopped) and embed the rest.
        single_file: with ``use_ray``: also merge the dataset into the one Parquet file
            ``output_path`` (through ``<output_path>.parts/``, removed after the merge; the
            merge streams one block at a time), byte-identical to the in-process output.
        overwrite: replace an existing output (:func:`check_output`): the file (in-process
            or ``single_file``: the old file stays whole until the new one is complete), or
            with ``use_ray`` a dataset folder an earlier run wrote (its part files and
            manifest are removed first). Without it an existing output file or a non-empty
            dataset folder (without ``resume``) is refused, on both paths.
        settings: :func:`runtime.serving.replica.start_batcher` arguments (``backend``, ...).
    Returns: a :class:`CorpusSummary`.
    Raises: ``FileNotFoundError``; ``ValueError`` (format, no text column in any row, bad
        counts, an output file that exists or a dataset folder that is not empty without
        ``overwrite``/``resume``, a dataset folder that belongs to another plan); the
        embedder's errors; Ray's errors; ``KeyboardInterrupt`` (SIGINT/SIGTERM in
        the CLI): the in-process ``.partial`` file is removed; with Ray, finished blocks stay
        for ``resume`` and half-written ones are removed.
    """
    if batch_size < 1 or actors < 1:
        raise ValueError(f"batch_size and actors must be >= 1, got {batch_size}, {actors}")
    if (resume or single_file) and not use_ray:
        raise ValueError("resume and single_file go with use_ray (the dataset output)")
    check_output(output_path, use_ray, single_file, resume, overwrite, input_path)
    t0 = time.perf_counter()
    plan = plan_input(input_path, text_column, block_rows)      # bad input: before any model
    if not plan.blocks:
        raise ValueError(f"input {str(input_path)!r} has no rows")
    if use_ray:
        summary = _ray_run(plan, Path(output_path), actors, batch_size, actor_cpus, actor_gpus,
                           progress, resume, single_file, settings, overwrite)
    else:
        summary = CorpusSummary(str(output_path), blocks=len(plan.blocks))
        embedder = CorpusEmbedder(text_column, **settings)
        bar = _bar(progress, plan.rows, "row")
        try:
            with ParquetSink(output_path, error_column=ERROR, keep=KEEP_FAILURES) as sink:
                for block in plan.blocks:
                    sink.write(embed_block(plan, block, embedder, batch_size))
                    if bar is not None:
                        bar.update(block.rows)
        finally:
            embedder.close()
            if bar is not None:
                bar.close()
        summary.rows, summary.failed, summary.failures = sink.rows, sink.failed, sink.failures
    summary.seconds = time.perf_counter() - t0
    return summary


def _bar(progress: bool, total: int, unit: str):
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="embedding", unit=unit, disable=None)


class BlockWriter:
    """A Ray Data actor: embeds whole blocks and writes each to the dataset folder as
    ``part-NNNNNN.parquet`` (through a temporary name renamed when complete, so a file with
    that name is always a finished block). Returns one small summary row per block."""

    def __init__(self, plan, out_dir: str, batch_size: int, settings: dict):
        self.plan, self.out_dir, self.batch_size = plan, Path(out_dir), batch_size
        self.embedder = CorpusEmbedder(plan.text_column, **settings)

    def __call__(self, batch: dict) -> dict:
        import pyarrow as pa
        import pyarrow.compute as pc
        from pyarrow import parquet

        out = {"block": [], "rows": [], "failed": [], "failures": []}
        for i in range(len(batch["index"])):
            block = Block(*(int(batch[k][i]) for k in ("index", "first_row", "rows", "start",
                                                         "end")))
            table = embed_block(self.plan, block, self.embedder, self.batch_size)
            rows = pa.array(range(block.first_row, block.first_row + table.num_rows), pa.int64())
            table = table.add_column(0, ROW_INDEX, rows)
            final = self.out_dir / part_name(block.index)
            tmp = self.out_dir / f".{final.name}.{os.getpid()}.tmp"
            parquet.write_table(table, tmp)
            os.replace(tmp, final)
            errors = table.column(ERROR)
            bad = pc.indices_nonzero(pc.is_valid(errors)).to_pylist()
            out["block"].append(block.index)
            out["rows"].append(table.num_rows)
            out["failed"].append(len(bad))
            out["failures"].append(json.dumps([(block.first_row + j, errors[j].as_py())
                                               for j in bad[:KEEP_FAILURES]]))
        return out


def dataset_folder(output, single_file: bool = False) -> Path:
    """The folder a Ray run writes its part files to: ``output`` (``<output>.parts`` with
    ``single_file``)."""
    output = Path(output)
    return output.with_name(output.name + ".parts") if single_file else output


def check_dataset_folder(out_dir: Path, resume: bool) -> None:
    """Refuse a dataset folder a Ray run cannot write: a file, or a folder that is not empty
    without ``resume`` (``ValueError``). The CLI asks before it starts Ray (seconds)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {str(out_dir)!r} is a file; with --ray it is a folder "
                         "(or pass --single-file)")
    if not resume and out_dir.is_dir() and any(out_dir.iterdir()):
        raise ValueError(f"{str(out_dir)!r} is not empty: pass --resume to finish that run, "
                         "or remove it")


def _ours(path: Path) -> bool:
    """Whether ``path`` (in a dataset folder) is a file a Ray run writes there."""
    return path.is_file() and (path.name == MANIFEST or (path.name.startswith("part-")
                                                         and path.suffix == ".parquet")
                               or (path.name.startswith(".part-") and path.suffix == ".tmp"))


def check_output(output, use_ray: bool, single_file: bool, resume: bool,
                 overwrite: bool, input_path=None) -> None:
    """Refuse an output that a run would replace without ``overwrite`` (``ValueError``), the
    same way on both paths: an existing output file (in-process, or ``single_file``'s
    merge), a folder where a file goes, or (``use_ray``) a dataset folder that is not empty
    without ``resume`` (:func:`check_dataset_folder`). ``overwrite`` replaces a file, or a
    dataset folder holding only what a Ray run writes (part files and its manifest): never a
    folder with other files in it. ``overwrite`` with ``resume`` is refused (which one?). The
    CLI asks before it loads a model or starts Ray (seconds).

    An output file that is ``input_path`` itself (``--overwrite`` would replace the corpus
    with its embeddings) is refused even with ``overwrite``, and so is an output file named
    like a text input (``.csv``, ``.json``, ``.jsonl``, ``.ndjson``): the output is Parquet,
    and a later run would read that file as CSV or JSON."""
    output = Path(output)
    if overwrite and resume:
        raise ValueError("--overwrite and --resume contradict each other: --resume keeps the "
                         "finished blocks of --out, --overwrite replaces them")
    if not use_ray or single_file:
        if output.is_dir():
            raise ValueError(f"--out {str(output)!r} is a folder; the output is one Parquet "
                             "file (a folder goes with --ray)")
        if (input_path is not None and output.exists() and Path(input_path).exists()
                and output.samefile(input_path)):
            raise ValueError(f"--out {str(output)!r} is the input file: the run would replace "
                             "the corpus with its embeddings; pass another --out")
        if output.suffix.lower() in FORMATS and FORMATS[output.suffix.lower()] != "parquet":
            raise ValueError(f"--out {str(output)!r}: the output is a Parquet file, not "
                             f"{output.suffix}; name it {output.stem + '.parquet'!r}")
        if output.exists() and not overwrite:
            raise ValueError(f"--out {str(output)!r} exists: pass --overwrite "
                             "(overwrite=True) to replace it, or another --out")
    if use_ray:
        out_dir = dataset_folder(output, single_file)
        if overwrite and out_dir.is_dir():
            other = [p.name for p in out_dir.iterdir() if not _ours(p)]
            if other:
                raise ValueError(f"--overwrite: {str(out_dir)!r} holds files a run did not "
                                 f"write ({', '.join(sorted(other)[:3])}...); remove them "
                                 "or pass another --out")
        else:
            check_dataset_folder(out_dir, resume)


def _prepare(plan, out_dir: Path, resume: bool, overwrite: bool = False) -> set:
    """Check or create the dataset folder; returns the finished blocks (their part files).
    Half-written temporary files of a stopped run are removed; with ``overwrite`` every file
    an earlier run wrote (:func:`check_output` refused a folder with others)."""
    manifest = out_dir / MANIFEST
    key = plan.key()
    if overwrite and out_dir.is_dir():
        for p in list(out_dir.iterdir()):
            if _ours(p):
                p.unlink()
    check_dataset_folder(out_dir, resume)
    if out_dir.is_dir() and any(out_dir.iterdir()):
        old = json.loads(manifest.read_text()) if manifest.is_file() else None
        if old != key:
            raise ValueError(f"{str(out_dir)!r} holds another run's output (input, block size "
                             "or text column differ); remove it or pass another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    for tmp in out_dir.glob(".part-*.tmp"):
        tmp.unlink(missing_ok=True)
    manifest.write_text(json.dumps(key))
    names = {part_name(b.index): b.index for b in plan.blocks}
    return {names[p.name] for p in out_dir.glob("part-*.parquet") if p.name in names}


def _finished(out_dir: Path, index: int) -> tuple:
    """``(rows, failures)`` of a finished part file (its error column only)."""
    import pyarrow.compute as pc
    from pyarrow import parquet

    t = parquet.read_table(out_dir / part_name(index), columns=[ROW_INDEX, ERROR])
    bad = pc.indices_nonzero(pc.is_valid(t.column(ERROR))).to_pylist()
    return t.num_rows, len(bad), [(t.column(ROW_INDEX)[j].as_py(),
                                   t.column(ERROR)[j].as_py()) for j in bad[:KEEP_FAILURES]]


def _ray_run(plan, output: Path, actors, batch_size, actor_cpus, actor_gpus, progress, resume,
             single_file, settings, overwrite=False) -> CorpusSummary:
    import ray.data

    out_dir = dataset_folder(output, single_file)
    done = _prepare(plan, out_dir, resume, overwrite)
    summary = CorpusSummary(str(output), blocks=len(plan.blocks), resumed=len(done))
    failures = []
    for index in sorted(done):
        rows, failed, first = _finished(out_dir, index)
        summary.rows += rows
        summary.failed += failed
        failures += first
    todo = [asdict(b) for b in plan.blocks if b.index not in done]
    if actor_gpus is None:
        actor_gpus = 1 if settings.get("backend") == "cuda" else 0
    bar = _bar(progress, len(plan.blocks), "block")
    if bar is not None:
        bar.update(len(done))
    try:
        if todo:
            ds = ray.data.from_items(todo, override_num_blocks=len(todo))
            ds = ds.map_batches(BlockWriter, fn_constructor_kwargs={
                "plan": plan, "out_dir": str(out_dir.resolve()), "batch_size": batch_size,
                "settings": settings}, batch_size=1, batch_format="numpy",
                compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=actor_cpus,
                num_gpus=actor_gpus)
            for row in ds.iter_rows():
                summary.rows += int(row["rows"])
                summary.failed += int(row["failed"])
                failures += [tuple(f) for f in json.loads(row["failures"])]
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        for tmp in out_dir.glob(".part-*.tmp"):    # a stopped run's half-written blocks
            tmp.unlink(missing_ok=True)
    summary.failures = sorted(failures)[:KEEP_FAILURES]
    if single_file:
        _merge(plan, out_dir, output)
    return summary


def _merge(plan, out_dir: Path, output: Path) -> None:
    """The dataset's blocks, in order and without the row index, into one Parquet file (one
    block in memory at a time), then the dataset folder removed."""
    import shutil

    from pyarrow import parquet

    import pyarrow as pa

    with ParquetSink(output) as sink:
        for b in plan.blocks:
            t = parquet.read_table(out_dir / part_name(b.index)).drop_columns([ROW_INDEX])
            i = t.schema.get_field_index(EMBEDDING)
            kind = t.schema.field(i).type        # Parquet names the list's child "element"
            t = t.cast(t.schema.set(i, pa.field(EMBEDDING, pa.list_(kind.value_type,
                                                                    kind.list_size))))
            sink.write(t)
    shutil.rmtree(out_dir)
