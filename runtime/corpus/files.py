"""Corpus files: JSON Lines, CSV or Parquet in (pyarrow's readers, or Ray Data's), one Parquet
file out (pyarrow's ``ParquetWriter``), written batch by batch in input order."""

from __future__ import annotations

import os
from pathlib import Path

#: Input formats by file extension (JSON means JSON Lines: one object per line).
FORMATS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".csv": "csv",
           ".parquet": "parquet", ".pq": "parquet"}


def input_format(path) -> str:
    """``"json"``, ``"csv"`` or ``"parquet"`` from the extension of ``path``.

    Raises: ``FileNotFoundError`` (no such file); ``ValueError`` (unknown extension).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input {str(p)!r} is not a file")
    fmt = FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise ValueError(f"input {p.name!r}: unknown format; use one of {sorted(FORMATS)}")
    return fmt


def _csv_options(text_column: str) -> dict:
    """Read the text column of a CSV as strings (never inferred as numbers)."""
    from pyarrow import csv

    return {"convert_options": csv.ConvertOptions(column_types={text_column: "string"})}


def read_table(path, text_column: str = "text"):
    """Read the whole input file into memory, in order.

    Args: path: a ``.jsonl``/``.csv``/``.parquet`` file; text_column: read as strings in CSV.
    Returns: a ``pyarrow.Table``.
    Raises: ``FileNotFoundError``; ``ValueError`` (format); ``pyarrow.ArrowInvalid`` (bad file).
    """
    fmt = input_format(path)
    if fmt == "json":
        from pyarrow import json
        return json.read_json(path)
    if fmt == "csv":
        from pyarrow import csv
        return csv.read_csv(path, **_csv_options(text_column))
    from pyarrow import parquet
    return parquet.read_table(path)


def column_names(path) -> list:
    """The input's column names, read from its head only (Parquet footer, first CSV block,
    first JSON line), so a wrong ``--text-column`` is refused before any work starts.

    Raises: as :func:`read_table`.
    """
    fmt = input_format(path)
    if fmt == "parquet":
        from pyarrow import parquet
        return parquet.read_schema(path).names
    if fmt == "csv":
        from pyarrow import csv
        with csv.open_csv(path) as reader:
            return reader.schema.names
    import json
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "{}")
    row = json.loads(first)
    if not isinstance(row, dict):
        raise ValueError(f"input {str(path)!r}: a JSON Lines file needs one object per line")
    return list(row)


def read_dataset(path, text_column: str = "text"):
    """The input file as a Ray Data ``Dataset`` (``ray.data.read_json``/``read_csv``/
    ``read_parquet``), for a cluster whose workers can read ``path``.

    Raises: as :func:`read_table`.
    """
    import ray.data

    fmt = input_format(path)
    path = str(Path(path).resolve())
    if fmt == "json":
        return ray.data.read_json(path)
    if fmt == "csv":
        return ray.data.read_csv(path, **_csv_options(text_column))
    return ray.data.read_parquet(path)


class ParquetSink:
    """Writes ``pyarrow.Table`` batches to one Parquet file, in the order given.

    The batches go to ``<path>.partial``, renamed to ``path`` by :meth:`close` (so a file at
    ``path`` is always complete); leaving the ``with`` block on an exception deletes the
    partial file instead. The schema is the first batch's; a later batch whose types differ (a column that was all
    null in one block, say) is cast to it. Counts rows and the rows whose ``error_column`` is
    set, keeping the first ``keep`` of those as ``(row, message)``.

    Args: path: the output file (its folder is created); error_column: the column naming a
        row's failure; keep: how many failures to remember.
    Raises (from :meth:`write`): ``pyarrow.ArrowInvalid`` when a batch cannot be cast.
    """

    def __init__(self, path, error_column: str | None = None, keep: int = 20):
        self.path = Path(path)
        self.error_column, self.keep = error_column, keep
        self.rows = 0
        self.failed = 0
        self.failures: list = []
        self._writer = None
        self._schema = None
        self._partial = self.path.with_name(self.path.name + ".partial")

    def write(self, table) -> None:
        """Append ``table``'s rows."""
        import pyarrow.compute as pc
        from pyarrow import parquet

        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._schema = table.schema
            self._writer = parquet.ParquetWriter(self._partial, self._schema)
        elif table.schema != self._schema:
            table = table.cast(self._schema)
        if self.error_column is not None:
            errors = table.column(self.error_column)
            bad = pc.indices_nonzero(pc.is_valid(errors)).to_pylist()
            for i in bad[:max(0, self.keep - len(self.failures))]:
                self.failures.append((self.rows + i, errors[i].as_py()))
            self.failed += len(bad)
        self._writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> None:
        """Finish the file and move it to ``path`` (idempotent). A sink that got no batch
        writes nothing."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            os.replace(self._partial, self.path)

    def abort(self) -> None:
        """Drop what was written (the partial file); ``path`` is left as it was."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._partial.unlink(missing_ok=True)

    def __enter__(self) -> "ParquetSink":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
