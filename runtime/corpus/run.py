"""Embed a corpus file into a Parquet file: in this process, or on a Ray Data actor pool."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .embedder import ERROR, CorpusEmbedder
from .files import ParquetSink, column_names, read_dataset, read_table


@dataclass
class CorpusSummary:
    """What :func:`embed_corpus` did.

    Attributes:
        output: the Parquet file written; rows: rows written (= rows read);
        failed: rows with a null embedding (their ``embedding_error`` says why);
        failures: the first ``(row, message)`` pairs of those; seconds: wall time.
    """

    output: str
    rows: int = 0
    failed: int = 0
    failures: list = field(default_factory=list)
    seconds: float = 0.0


def embed_corpus(input_path, output_path, *, text_column: str = "text", use_ray: bool = False,
                 actors: int = 1, batch_size: int = 256, actor_cpus: float = 1.0,
                 actor_gpus: float | None = None, progress: bool = True,
                 **settings) -> CorpusSummary:
    """Embed every row's text and write the rows, in input order, with ``embedding`` added.

    Args:
        input_path: a JSON Lines (``.jsonl``), CSV or Parquet file.
        output_path: the Parquet file to write: the input's columns, then ``embedding``
            (``fixed_size_list<float32>[384]``) and ``embedding_error`` (null unless the row
            failed).
        text_column: the column with the texts.
        use_ray: run on the connected Ray cluster (call :func:`runtime.cluster.init_ray` first):
            Ray Data reads the file, a pool of ``actors`` actors (``actor_cpus`` CPUs and
            ``actor_gpus`` GPUs each; GPUs default to 1 with ``backend="cuda"``) embeds it with
            one :class:`CorpusEmbedder` each, and this process writes the batches as they come,
            in order (it sets Ray Data's ``preserve_order`` in this process's ``DataContext``;
            Ray Data's progress bars). Otherwise the file is read into memory and one embedder
            here embeds it, with a tqdm bar.
        batch_size: rows per embedder call.
        progress: show the in-process progress bar.
        settings: :func:`runtime.serving.replica.start_batcher` arguments (``backend``, ...).
    Returns: a :class:`CorpusSummary`.
    Raises: ``FileNotFoundError``; ``ValueError`` (format, missing text column, bad counts);
        the embedder's errors; Ray's errors.
    """
    if batch_size < 1 or actors < 1:
        raise ValueError(f"batch_size and actors must be >= 1, got {batch_size}, {actors}")
    t0 = time.perf_counter()
    with ParquetSink(output_path, error_column=ERROR) as sink:
        if use_ray:
            batches = _ray_batches(input_path, text_column, actors, batch_size, actor_cpus,
                                   actor_gpus, settings)
        else:
            batches = _local_batches(input_path, text_column, batch_size, progress, settings)
        for table in batches:
            sink.write(table)
    return CorpusSummary(str(output_path), sink.rows, sink.failed, sink.failures,
                         time.perf_counter() - t0)


def _need_column(names, text_column: str) -> None:
    if text_column not in names:
        raise ValueError(f"text column {text_column!r} not in the input's columns {list(names)}; "
                         "pass --text-column")


def _local_batches(path, text_column, batch_size, progress, settings):
    table = read_table(path, text_column)
    _need_column(table.column_names, text_column)
    embedder = CorpusEmbedder(text_column, **settings)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=table.num_rows, desc="embedding", unit="row", disable=None)
    try:
        for start in range(0, max(table.num_rows, 1), batch_size):
            chunk = table.slice(start, batch_size)
            yield embedder(chunk)
            if bar is not None:
                bar.update(chunk.num_rows)
    finally:
        embedder.close()
        if bar is not None:
            bar.close()


def _ray_batches(path, text_column, actors, batch_size, actor_cpus, actor_gpus, settings):
    import ray.data

    _need_column(column_names(path), text_column)     # ds.schema() would run the read
    # before the read: a Dataset copies the current DataContext when it is created, so setting
    # it afterwards left the batches in completion order (wrong row numbers in the report)
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ds = read_dataset(path, text_column)
    ds.context.execution_options.preserve_order = True
    if actor_gpus is None:
        actor_gpus = 1 if settings.get("backend") == "cuda" else 0
    ds = ds.map_batches(CorpusEmbedder, fn_constructor_kwargs={"text_column": text_column,
                                                               **settings},
                        batch_size=batch_size, batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(size=actors),
                        num_cpus=actor_cpus, num_gpus=actor_gpus)
    yield from ds.iter_batches(batch_size=None, batch_format="pyarrow")
