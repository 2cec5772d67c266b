"""Bucket sizes and bucket choice: the one place the model and the batcher take them from.

A batch of ``n`` texts of at most ``L`` tokens runs padded to a ``(batch, seq_len)`` bucket: each
size rounded up to its increasing list (:func:`bucket_up`), or, when the graph cache is full, a
bucket already captured (:func:`choose_bucket`). :class:`runtime.models.MiniLM` captures one graph
per bucket; :class:`runtime.serving.Batcher` forms the batches.
"""

from __future__ import annotations

#: Default sequence-length buckets (tokens); the last is MiniLM's ``max_seq_length``.
SEQ_BUCKETS = (16, 32, 64, 128, 256)
#: Default batch-size buckets (texts).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)


def bucket_up(n: int, sizes, what: str = "size") -> int:
    """The smallest size in ``sizes`` (increasing) that is ``>= n``.

    Raises: ``ValueError`` (naming ``what``) when ``n`` exceeds the largest.
    """
    for s in sizes:
        if n <= s:
            return int(s)
    raise ValueError(f"{what} {n} exceeds the largest bucket {sizes[-1]}")


def choose_bucket(n: int, length: int, batch_buckets, seq_buckets, captured=(),
                  max_graphs=None, max_tokens=None, max_padding=None) -> tuple:
    """The ``(batch, seq_len)`` bucket for the next ``n`` texts of at most ``length`` tokens.

    The exact bucket (each size rounded up to its list) when it is already captured or there is
    room for one more graph (``len(captured) < max_graphs``, or no bound). When the bound is
    reached, the cache is not churned (a capture costs about two forwards, and would evict a
    bucket that is likely needed again):

    1. the smallest captured bucket (fewest ``batch * seq_len`` cells) that holds all ``n``;
    2. else the captured bucket with ``seq_len >= length`` and the most rows: it runs only its
       first ``batch`` texts (``batch < n``; the caller keeps the rest for the next batch);
    3. else the exact bucket (the model then evicts its least recently used graph).

    With ``max_padding``, a bucket whose padding rows would exceed that fraction of its rows
    gives way to the largest batch bucket the texts fill (same ``seq_len``, when it is captured
    or there is room for it): on a cpu, a padding row costs as much as a real one, so 20 texts
    run as 16 now and 4 with the next batch's company rather than as 32.

    Args:
        n: texts waiting (``1 <= n <= max(batch_buckets)``); length: the longest, in tokens.
        batch_buckets, seq_buckets: increasing sizes; captured: ``(batch, seq_len)`` pairs held.
        max_graphs: the bound on held graphs, or ``None``.
        max_tokens: captured buckets with more than ``batch * seq_len`` padded tokens are not
            reused (the per-batch budget), or ``None``.
        max_padding: the largest fraction of a bucket's rows that may be padding (``0 <= f <
            1``), or ``None`` (any).
    Returns: ``(batch, seq_len)``; ``batch`` may be below ``n`` (case 2, or ``max_padding``).
    Raises: ``ValueError`` when ``n`` or ``length`` exceeds the largest bucket.
    """
    captured = list(captured)
    bucket = _choose(n, length, batch_buckets, seq_buckets, captured, max_graphs, max_tokens)
    B, S = bucket
    if max_padding is None or B <= n or (B - n) / B <= max_padding:
        return bucket
    down = max((b for b in batch_buckets if b <= n), default=None)
    if down is not None and ((down, S) in captured or max_graphs is None or
                             len(captured) < max_graphs):
        return (down, S)
    return bucket


def _choose(n, length, batch_buckets, seq_buckets, captured, max_graphs, max_tokens) -> tuple:
    """:func:`choose_bucket` without the padding bound."""
    exact = (bucket_up(n, batch_buckets), bucket_up(max(length, 1), seq_buckets))
    if exact in captured or max_graphs is None or len(captured) < max_graphs:
        return exact
    if max_tokens is not None:
        captured = [b for b in captured if b[0] * b[1] <= max_tokens]
    fits = [b for b in captured if b[0] >= n and b[1] >= length]
    if fits:
        return min(fits, key=lambda b: (b[0] * b[1], b))
    part = [b for b in captured if b[1] >= length]
    if part:
        return max(part, key=lambda b: (b[0], -b[1]))
    return exact
