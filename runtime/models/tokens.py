"""Bounded tokenization: truncate while tokenizing, and take token-id inputs.

``tokenizers`` truncates only after encoding the whole string, and keeps every truncated-off
token as an ``overflowing`` encoding: a 100,000-character text costs ~25,000 encoded tokens to
keep 256. :func:`encode_truncated` encodes a prefix of each long text instead and grows the
prefix only while the answer could still change, so the cost of a text is bounded by a few
times ``max_length`` tokens whatever its length.

:func:`ids_batch` turns token-id inputs (the OpenAI ``input`` shape of lists of integers) into
the same padded ``(ids, mask)`` arrays as tokenizing the text would give.
"""

from __future__ import annotations

import numpy as np

#: Characters of a long text encoded in the first pass (~16 per kept token at 256 tokens).
FIRST_CHARS = 4096
#: Texts encoded per ``encode_batch`` call (bounds the memory of one pass).
GROUP = 64


def _settled(enc) -> bool:
    """True when the prefix's truncated encoding equals the whole text's: the prefix overflowed,
    and every kept token comes from a word before the last (possibly cut) word of the prefix."""
    over = enc.overflowing
    if not over:
        return False
    kept = [w for w in enc.word_ids if w is not None]
    tail = [w for w in over[-1].word_ids if w is not None]
    return bool(kept) and bool(tail) and max(kept) < max(tail)


def encode_truncated(tokenizer, texts, first_chars: int = FIRST_CHARS,
                     group: int = GROUP) -> list:
    """``tokenizer.encode_batch(texts)``, reading only as much of each text as truncation keeps.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` with truncation enabled (its ``max_length`` is
            the kept length) and a word-level pre-tokenizer (BERT's, as all-MiniLM-L6-v2's).
        texts: a list of strings; first_chars: characters encoded in the first pass (each
            further pass of an unsettled text reads 4x more, up to the whole text);
        group: texts per ``encode_batch`` call.
    Returns: one ``tokenizers.Encoding`` per text, with the ids and attention mask that
        encoding the whole text gives (checked against it in ``tests/serving/test_http.py``).
    Raises: what ``encode_batch`` raises (e.g. ``TypeError``/``Exception`` for text the
        tokenizer cannot take, such as a lone UTF-16 surrogate).

    How: a prefix cut inside a word changes only that word's tokens. When the prefix's encoding
    overflows and its kept tokens all come from earlier words (``word_ids``), the kept tokens
    are those of the whole text, so the rest is never encoded.
    """
    texts = list(texts)
    out: list = [None] * len(texts)
    todo = list(range(len(texts)))
    chars = max(int(first_chars), 1)
    while todo:
        later = []
        for g in range(0, len(todo), group):
            idx = todo[g:g + group]
            cut = [texts[i][:chars] for i in idx]
            for i, piece, enc in zip(idx, cut, tokenizer.encode_batch(cut)):
                if len(piece) == len(texts[i]) or _settled(enc):
                    out[i] = enc
                else:
                    later.append(i)
        todo, chars = later, chars * 4
    return out


def ids_batch(seqs, *, cls_id: int, sep_id: int, vocab_size: int, max_length: int) -> tuple:
    """Token-id inputs as the padded ``(ids, mask)`` a tokenizer gives for the same texts.

    Each sequence is the model's own token ids for one text, with or without the special
    tokens: a leading ``cls_id`` and a trailing ``sep_id`` are added where missing, and the
    content is truncated on the right to ``max_length - 2`` tokens (keeping ``[SEP]``), as
    tokenizing the text does. ``[]`` is the empty text (``[CLS] [SEP]``). Only the first
    ``max_length`` ids of a sequence are read or checked: cutting there first gives the same
    rows (a longer sequence keeps ``max_length - 2`` ids after an optional leading ``[CLS]``,
    and its trailing ``[SEP]``, if any, lies beyond the cut), so the cost is bounded per input.

    Args:
        seqs: a list of lists (or 1-D integer arrays) of ints; cls_id, sep_id: the special tokens' ids;
        vocab_size: ids must lie in ``[0, vocab_size)``; max_length: tokens kept per sequence.
    Returns: ``(ids, mask)``, ``int64 [n, L]``, right-padded with 0.
    Raises: ``ValueError`` naming ``input[i]`` for an id outside the vocabulary or a value that
        is not an int; ``TypeError`` when ``seqs`` is not a list of lists.
    """
    rows = []
    for i, s in enumerate(seqs):
        if not isinstance(s, (list, tuple, np.ndarray)):
            raise TypeError(f"input[{i}] is {type(s).__name__}; token-id inputs are lists of "
                            "ints")
        s = s[:max_length]          # the model never reads further (see below): O(1) checks
        for t in (s.tolist() if isinstance(s, np.ndarray) else s):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise ValueError(f"input[{i}] holds {t!r}, not a token id of this model: "
                                 "token ids must come from this model's tokenizer (integers "
                                 f"in [0, {vocab_size}))")
        body = list(s.tolist() if isinstance(s, np.ndarray) else s)
        if body and body[0] == cls_id:
            body = body[1:]
        if body and body[-1] == sep_id:
            body = body[:-1]
        rows.append([cls_id] + body[:max_length - 2] + [sep_id])
    L = max((len(r) for r in rows), default=0)
    ids = np.zeros((len(rows), L), np.int64)
    mask = np.zeros((len(rows), L), np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    return ids, mask
