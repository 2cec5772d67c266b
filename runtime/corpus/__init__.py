"""Corpus embedding: a JSON Lines/CSV/Parquet file in, Parquet with an ``embedding`` column out.

- :class:`CorpusEmbedder` (``embedder.py``): MiniLM behind a batcher, called on
  ``pyarrow.Table`` batches; one per process (in-process) or per Ray Data actor.
- ``files.py``: the readers (pyarrow, or Ray Data's) and :class:`ParquetSink`.
- :func:`embed_corpus` (``run.py``): in-process or on a Ray Data actor pool, output in input
  order, failed rows kept and reported.
- ``python -m runtime embed-corpus`` (``cli.py``).

Needs pyarrow (``pip install 'runtime[ray]'``); Ray only with ``use_ray``.
"""

from .embedder import EMBEDDING, ERROR, CorpusEmbedder
from .files import FORMATS, ParquetSink, column_names, input_format, read_dataset, read_table
from .run import CorpusSummary, embed_corpus

__all__ = ["CorpusEmbedder", "EMBEDDING", "ERROR", "FORMATS", "ParquetSink", "column_names",
           "input_format", "read_dataset", "read_table", "CorpusSummary", "embed_corpus"]
