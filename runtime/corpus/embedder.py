"""The callable that embeds one batch of corpus rows: what each Ray Data actor holds, and what
the in-process path calls directly (one code path for both)."""

from __future__ import annotations

import numpy as np

from ..serving.batcher import BatchFailed
from .files import TEXT_ERROR

#: Name of the added column: ``fixed_size_list<float32>[384]``, null where the row failed.
EMBEDDING = "embedding"
#: Name of the added column saying why a row failed: ``string``, null where it succeeded.
ERROR = "embedding_error"


class CorpusEmbedder:
    """Embeds the text column of ``pyarrow.Table`` batches with MiniLM behind a batcher.

    One instance loads the model once on this process's device (its own device server and
    captured bucket graphs, :func:`runtime.serving.replica.start_batcher`); Ray Data builds one
    per actor of its pool (``map_batches(CorpusEmbedder, fn_constructor_kwargs=...)``).

    Args:
        text_column: the column holding the texts.
        timeout: seconds one batch may take before ``TimeoutError``.
        batcher: a running :class:`runtime.serving.Batcher` to use instead of starting one
            (``close()`` then closes it).
        settings: more ``start_batcher`` keyword arguments (``backend``, ``model_dir``,
            ``max_graphs``, ``seq_buckets``, ...).
    Raises: what ``start_batcher`` raises (model files missing, backend unavailable).
    """

    def __init__(self, text_column: str = "text", timeout: float = 600.0, batcher=None,
                 **settings):
        from ..serving.replica import start_batcher

        self.text_column = text_column
        self.timeout = float(timeout)
        self.batcher = batcher if batcher is not None else start_batcher(**settings)

    def __call__(self, batch):
        """Embed one batch.

        Args:
            batch: a ``pyarrow.Table`` with :attr:`text_column` (any other columns ride along;
                a :data:`~runtime.corpus.files.TEXT_ERROR` column, from ``read_block``, gives
                the reason of rows whose text was not a string, and is dropped).
        Returns: the same rows, in the same order, with two columns appended: :data:`EMBEDDING`
            (``fixed_size_list<float32>[hidden]``, unit L2 norm) and :data:`ERROR`. A row whose
            text is null or not a string, or whose batch failed even alone, keeps its place with
            a null embedding and the reason; it is never dropped.
        Raises: ``ValueError`` (no such text column; the batch already has an output column);
            :class:`runtime.serving.BatcherClosed` (the model's worker stopped: every row would
            fail); ``TimeoutError``.
        """
        import pyarrow as pa

        reasons = None
        if TEXT_ERROR in batch.column_names:           # read_block's: why a text is not one
            reasons = batch.column(TEXT_ERROR).to_pylist()
            batch = batch.drop_columns([TEXT_ERROR])
        missing = [c for c in (self.text_column,) if c not in batch.column_names]
        taken = [c for c in (EMBEDDING, ERROR) if c in batch.column_names]
        if missing or taken:
            raise ValueError(f"text column {missing} not in the input's columns "
                             f"{batch.column_names}" if missing else
                             f"the input already has column(s) {taken}; rename them")
        values = batch.column(self.text_column).to_pylist()
        n, hidden = len(values), self.batcher.hidden
        out = np.zeros((n, hidden), np.float32)
        errors = [None if isinstance(v, str) else
                  ("the text is null" if v is None else
                   f"the text is {type(v).__name__}, not a string") for v in values]
        if reasons is not None:
            errors = [r or e for r, e in zip(reasons, errors)]
        rows = [i for i, e in enumerate(errors) if e is None]
        if rows:
            try:
                out[rows] = self._embed([values[i] for i in rows])
            except (BatchFailed, ValueError):     # find the rows that fail alone
                for i in rows:
                    try:
                        out[i] = self._embed([values[i]])[0]
                    except (BatchFailed, ValueError) as e:
                        errors[i] = str(e)
        failed = pa.array([e is not None for e in errors], pa.bool_())
        emb = pa.FixedSizeListArray.from_arrays(pa.array(out.ravel(), pa.float32()), hidden,
                                                mask=failed)
        return batch.append_column(EMBEDDING, emb).append_column(ERROR,
                                                                 pa.array(errors, pa.string()))

    def _embed(self, texts: list) -> np.ndarray:
        return self.batcher.embed(texts, timeout=self.timeout)

    def close(self) -> None:
        """Stop the batcher (idempotent)."""
        self.batcher.close()
