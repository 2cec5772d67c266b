"""Corpus embedding: a JSON Lines/CSV/Parquet file in, Parquet with an ``embedding`` column out.

- :class:`CorpusEmbedder` (``embedder.py``): MiniLM behind a batcher, called on
  ``pyarrow.Table`` batches; one per process (in-process) or per Ray Data actor.
- ``files.py``: :func:`plan_input` (blocks and column types, one streaming pass),
  :func:`read_block` (one block, in any process; a text that is not a string is kept as JSON
  text in :func:`raw_column`) and :class:`ParquetSink`.
- :func:`embed_corpus` (``run.py``): in-process into one file, or on a Ray Data actor pool into
  a Parquet dataset the workers write (resumable); failed rows kept and reported.
- ``python -m runtime embed-corpus`` (``cli.py``).

Needs pyarrow (``pip install 'runtime[ray]'``); Ray only with ``use_ray``.
"""

from .embedder import EMBEDDING, ERROR, CorpusEmbedder
from .files import (FORMATS, ROW_INDEX, Block, ParquetSink, Plan, input_format, plan_input,
                    raw_column, read_block)
from .run import CorpusSummary, embed_block, embed_corpus

__all__ = ["CorpusEmbedder", "EMBEDDING", "ERROR", "FORMATS", "ROW_INDEX", "Block", "Plan",
           "ParquetSink", "input_format", "plan_input", "raw_column", "read_block",
           "CorpusSummary", "embed_block", "embed_corpus"]
