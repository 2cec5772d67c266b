"""Corpus files: JSON Lines, CSV or Parquet in, read block by block; Parquet out.

:func:`plan_input` reads the input once, streaming, and splits it into blocks of rows (byte
ranges of JSON Lines/CSV records, row ranges of Parquet) with one set of column types for the
whole file; :func:`read_block` reads one block alone, in any process (the in-process path and
every Ray worker), so every path reads the same rows with the same types. The text column is
never type-inferred: a number, an object, a missing field or a line that is not JSON becomes a
row with a null text and the reason, kept in the output, and the value itself is kept as its
JSON text in a ``<text column>_raw`` column (:func:`raw_column`). :class:`ParquetSink` writes
tables to one Parquet file through a ``.partial`` file renamed when complete.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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


#: The row-index column of the Ray path's dataset output: each row's 0-based row in the input
#: (rows sort back into input order by it).
ROW_INDEX = "input_row"
#: A private column of :func:`read_block`'s tables: why a row's text is not a string (missing
#: field, a number, a line that is not JSON), read and dropped by the embedder.
TEXT_ERROR = "__text_error__"
#: Rows per block: the unit of reading, embedding, writing and resuming.
BLOCK_ROWS = 4096


def raw_column(text_column: str) -> str:
    """The name of the column that keeps a text value that is not a string:
    ``<text_column>_raw`` (``text_raw``), ``string``, right after the text column; present in
    the output only when some row of the input needs it (see :func:`read_block`).

    A row whose text is a JSON number, boolean, object or list holds the value's JSON text
    there (``json.loads`` gives the value back: ``42`` -> ``"42"``); a line that is not a JSON
    object holds the line itself; every other row holds null. The text column stays a clean
    ``string`` column (null for those rows), so ``"42"`` never passes for a text; the same idea
    as Spark's ``_corrupt_record`` and Databricks' rescued-data column.
    """
    return f"{text_column}_raw"


@dataclass(frozen=True)
class Block:
    """One block of input rows: ``index``, its first row (0-based, data rows only) and row
    count; ``start``/``end`` are its byte range (JSON Lines, CSV) or row range (Parquet)."""

    index: int
    first_row: int
    rows: int
    start: int
    end: int


@dataclass(frozen=True)
class Plan:
    """How an input file splits into blocks, and the column types every block is read with
    (so each block, read alone by any process, gives the same schema).

    Attributes: path, fmt (``"json"``/``"csv"``/``"parquet"``), text_column, block_rows,
        blocks (:class:`Block`, in input order), columns (``(name, pyarrow type)`` pairs in
        input order; the text column is always ``string``, followed by :func:`raw_column`'s
        ``string`` column when some row's text is not a string), header (CSV: the header
        record's bytes), size and mtime_ns (the file's, to refuse resuming over a changed
        input), raw (whether ``columns`` has that raw column).
    """

    path: str
    fmt: str
    text_column: str
    block_rows: int
    blocks: tuple
    columns: tuple
    header: bytes = b""
    size: int = 0
    mtime_ns: int = 0
    raw: bool = False

    @property
    def rows(self) -> int:
        """Data rows in the input."""
        return sum(b.rows for b in self.blocks)

    def key(self) -> dict:
        """What identifies this plan (a resumed run must find the same; the raw column only
        when present, so a folder whose parts lack it is not resumed into parts that have it)."""
        key = {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns,
               "text_column": self.text_column, "block_rows": self.block_rows,
               "blocks": len(self.blocks)}
        if self.raw:
            key["raw_column"] = raw_column(self.text_column)
        return key


def _kind(v) -> str:
    """The JSON value kind that decides a column's type."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int" if -2**63 <= v < 2**63 else "json"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    return "json"                                   # lists, objects


def _json_type(kinds: set):
    """A column's type from the kinds of its non-null values across the whole file: one kind
    gives its type, int and float give float64, anything else (mixed, lists, objects) strings
    (JSON text for the non-strings)."""
    import pyarrow as pa

    kinds = set(kinds)
    if kinds <= {"int"}:
        return pa.int64() if kinds else pa.string()
    if kinds <= {"int", "float"}:
        return pa.float64()
    if kinds == {"bool"}:
        return pa.bool_()
    return pa.string()


class _Blocks:
    """Collects blocks of ``block_rows`` rows from each data row's end offset as a scan meets
    them (memory: one :class:`Block` per block, not one offset per row)."""

    def __init__(self, block_rows: int, start: int):
        self.block_rows, self.start, self.rows, self.first, self.out = block_rows, start, 0, 0, []

    def row(self, end: int) -> None:
        self.rows += 1
        self.end = end
        if self.rows == self.block_rows:
            self.close()

    def close(self) -> tuple:
        if self.rows:
            self.out.append(Block(len(self.out), self.first, self.rows, self.start, self.end))
            self.first += self.rows
            self.start, self.rows = self.end, 0
        return tuple(self.out)


def plan_input(path, text_column: str = "text", block_rows: int = BLOCK_ROWS) -> Plan:
    """Split ``path`` into blocks of ``block_rows`` rows and fix every column's type, reading
    the file once, streaming (memory: the block offsets, not the rows).

    JSON Lines: every line is parsed here to learn the columns (the union of every object's
    keys, first-seen order) and their types (:func:`_json_type`); nothing is inferred per
    block. CSV: records end at a newline outside quotes; the types are :func:`_csv_types`, the
    text column ``string``. Parquet: the file's schema and row count.

    Raises: ``FileNotFoundError``; ``ValueError`` (unknown format; the text column in no row;
        a JSON Lines file with no JSON object in it: exit 2); ``pyarrow.ArrowInvalid`` (a CSV or
        Parquet file pyarrow cannot read).
    """
    import pyarrow as pa

    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    fmt = input_format(path)
    p = Path(path).resolve()
    st = p.stat()
    common = {"path": str(p), "fmt": fmt, "text_column": text_column, "block_rows": block_rows,
              "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if fmt == "json":
        import json
        kinds: dict = {}
        raw = False                               # some row's text value is kept as raw text
        first_bad = None                          # why the first line is not an object
        blocks, offset = _Blocks(block_rows, 0), 0
        with open(p, "rb") as f:
            for line in f:
                offset += len(line)
                if not line.strip():
                    continue
                blocks.row(offset)
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raw = True
                    first_bad = first_bad or f"not valid JSON ({str(e)[:80]})"
                    continue                      # kept as a failed row by read_block
                if not isinstance(obj, dict):
                    raw = True
                    first_bad = first_bad or f"a JSON {type(obj).__name__}, not an object"
                    continue
                for k, v in obj.items():
                    seen = kinds.setdefault(k, set())
                    if v is not None:
                        seen.add(_kind(v))
        if not kinds and first_bad is not None:   # rows, but not one object: not JSON Lines
            raise ValueError(f"input {str(p)!r}: no line is a JSON object (the first is "
                             f"{first_bad}); JSON Lines holds one object per line, e.g. "
                             f'{{"{text_column}": "a text"}}')
        _need_column(list(kinds), text_column)
        raw = raw or bool(kinds[text_column] - {"str"})
        columns = tuple((k, pa.string() if k == text_column else _json_type(v))
                        for k, v in kinds.items())
        return Plan(blocks=blocks.close(), columns=_with_raw(columns, text_column, raw),
                    raw=raw, **common)
    if fmt == "csv":
        blocks, parity, header, offset = None, 0, None, 0
        with open(p, "rb") as f:
            record = b""
            for line in f:
                offset += len(line)
                if header is None:
                    record += line
                    parity ^= line.count(b'"') & 1
                    if not parity:
                        header = record
                        blocks = _Blocks(block_rows, offset)
                    continue
                if not parity and not line.strip(b"\r\n"):
                    continue                      # an empty line between records: skipped
                parity ^= line.count(b'"') & 1
                if not parity:
                    blocks.row(offset)
        if header is None:
            raise ValueError(f"input {str(p)!r}: a CSV file needs a header line")
        return Plan(blocks=blocks.close(), columns=_csv_types(p, text_column), header=header,
                    **common)
    from pyarrow import parquet
    meta = parquet.ParquetFile(p).metadata
    schema = meta.schema.to_arrow_schema()
    _need_column(schema.names, text_column)
    n = meta.num_rows
    blocks = tuple(Block(i, r, min(block_rows, n - r), r, min(r + block_rows, n))
                   for i, r in enumerate(range(0, n, block_rows)))
    text = schema.field(text_column).type
    raw = not (pa.types.is_string(text) or pa.types.is_large_string(text)
               or pa.types.is_null(text))           # an all-null column has nothing to keep
    return Plan(blocks=blocks, columns=_with_raw(tuple((f.name, f.type) for f in schema),
                                                 text_column, raw), raw=raw, **common)


def _with_raw(columns: tuple, text_column: str, raw: bool) -> tuple:
    """``columns`` with :func:`raw_column`'s ``string`` column right after the text column
    when ``raw``; refuses an input that already has a column of that name (it would be
    overwritten)."""
    import pyarrow as pa

    if not raw:
        return columns
    name = raw_column(text_column)
    if name in (c for c, _ in columns):
        raise ValueError(f"the input has a column {name!r} and some texts that are not strings, "
                         f"whose values go to {name!r}; rename that column")
    out = []
    for c, kind in columns:
        out.append((c, kind))
        if c == text_column:
            out.append((name, pa.string()))
    return tuple(out)


def _csv_types(path, text_column: str) -> tuple:
    """Each CSV column's type for the whole file: pyarrow's inference (on the file's first
    block), checked by streaming every record through it; if any value does not fit, every
    column but the text is read as strings instead. The text column is always ``string``."""
    import pyarrow as pa
    from pyarrow import csv

    opts = csv.ConvertOptions(column_types={text_column: pa.string()})
    with csv.open_csv(path, convert_options=opts) as reader:
        schema = reader.schema
        _need_column(schema.names, text_column)
        try:
            for _ in reader:
                pass
        except pa.ArrowInvalid:
            return tuple((f.name, pa.string()) for f in schema)
    return tuple((f.name, f.type) for f in schema)


def _need_column(names, text_column: str) -> None:
    if not names:
        raise ValueError("the input has no rows (no columns to read): nothing to embed")
    if text_column not in names:
        raise ValueError(f"text column {text_column!r} not in the input's columns {list(names)}; "
                         "pass --text-column")


def _bytes(path, block: Block) -> bytes:
    with open(path, "rb") as f:
        f.seek(block.start)
        return f.read(block.end - block.start)


def _read_csv(data: bytes, text_column: str, types=None):
    import io

    from pyarrow import csv

    column_types = dict(types or {})
    column_types[text_column] = "string"          # never inferred as numbers
    return csv.read_csv(io.BytesIO(data),
                        convert_options=csv.ConvertOptions(column_types=column_types))


def read_block(plan: Plan, block: Block):
    """The rows of one block as a ``pyarrow.Table`` with the plan's columns and types (the
    text column ``string``: a value that is not a string, a missing field or a line that is
    not a JSON object is null there, with the reason in :data:`TEXT_ERROR`, and the value's
    JSON text, or the line that is not a JSON object, in :func:`raw_column` when the plan has
    that column).

    Raises: ``pyarrow.ArrowInvalid`` (a CSV value that does not fit its column's type).
    """
    import pyarrow as pa

    tc = plan.text_column
    rc = raw_column(tc)
    if plan.fmt == "json":
        import json
        rows, errors, raws = [], [], []
        for line in _bytes(plan.path, block).splitlines():
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                rows.append({})
                errors.append(f"the line is not valid JSON ({str(e)[:80]})")
                raws.append(line.decode("utf-8", "replace"))
                continue
            if not isinstance(obj, dict):
                rows.append({})
                errors.append(f"the line is a JSON {type(obj).__name__}, not an object")
                raws.append(line.decode("utf-8", "replace"))
                continue
            rows.append(obj)
            v = obj.get(tc)
            bad = not (v is None or isinstance(v, str))
            errors.append("the row has no text field" if tc not in obj else
                          f"the text is a JSON {_json_name(v)}, not a string" if bad else None)
            raws.append(_json_text(v) if bad else None)
        cols = {}
        for name, kind in plan.columns:
            if plan.raw and name == rc:
                cols[name] = pa.array(raws, pa.string())
                continue
            values = [r.get(name) for r in rows]
            if name == tc:
                values = [v if isinstance(v, str) else None for v in values]
            elif pa.types.is_string(kind):
                values = [v if v is None or isinstance(v, str) else json.dumps(v)
                          for v in values]
            cols[name] = pa.array(values, kind)
        cols[TEXT_ERROR] = pa.array(errors, pa.string())
        return pa.table(cols)
    if plan.fmt == "csv":
        t = _read_csv(plan.header + _bytes(plan.path, block), tc, plan.columns)
        return t.append_column(TEXT_ERROR, pa.nulls(t.num_rows, pa.string()))
    from pyarrow import parquet
    pf = parquet.ParquetFile(plan.path)
    groups, first, r = [], None, 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if r + n > block.start and r < block.end:
            groups.append(g)
            first = r if first is None else first
        r += n
    t = pf.read_row_groups(groups).slice(block.start - first, block.rows)
    col, i = t.column(tc), t.column_names.index(tc)
    errors = pa.nulls(t.num_rows, pa.string())
    if plan.raw:
        values = col.to_pylist()
        errors = pa.array([None if v is None else f"the text is {col.type}, not a string"
                           for v in values], pa.string())
        t = t.set_column(i, tc, pa.nulls(t.num_rows, pa.string()))
        t = t.add_column(i + 1, rc, pa.array([None if v is None else _json_text(v)
                                              for v in values], pa.string()))
    elif pa.types.is_null(col.type):                 # all null: a string column of nulls
        t = t.set_column(i, tc, pa.nulls(t.num_rows, pa.string()))
    return t.append_column(TEXT_ERROR, errors)


def _json_text(v) -> str:
    """A value's JSON text (non-ASCII kept); bytes as a JSON string of their UTF-8 text,
    anything JSON cannot spell (dates, decimals) as a JSON string of ``str(v)``."""
    import json

    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    return json.dumps(v, ensure_ascii=False, default=str)


def _json_name(v) -> str:
    return {bool: "boolean", int: "number", float: "number", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)


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
