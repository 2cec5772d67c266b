"""argparse value types for the commands' flags: one validator per kind of value.

Each is an argparse ``type=``: it turns the flag's text into a value or raises
``argparse.ArgumentTypeError``, so a bad value gets argparse's answer (the command's usage and
one ``error:`` line, exit status 2) before anything starts. A check that needs two flags
(a warm-up bucket against the bucket lists) is :func:`check_warmup`, called by the command right
after parsing with ``parser.error`` (the same answer).
"""

from __future__ import annotations

import argparse

#: Tokens the model reads (all-MiniLM-L6-v2's ``max_seq_length``): the largest sequence bucket
#: must reach it, and a batch's token budget must hold one text of it.
MODEL_TOKENS = 256


def _number(kind, text: str):
    try:
        v = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if kind is float and v != v:                        # NaN compares false with everything
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    return v


def positive(kind):
    """A number of ``kind`` (``int`` or ``float``) above 0."""
    def parse(text: str):
        v = _number(kind, text)
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return v
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def non_negative(kind):
    """A number of ``kind`` at or above 0."""
    def parse(text: str):
        v = _number(kind, text)
        if not v >= 0:
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
        return v
    parse.__name__ = f"non-negative {kind.__name__}"
    return parse


def at_least(low: int, why: str):
    """An integer ``>= low`` (``why`` says where the bound comes from)."""
    def parse(text: str):
        v = _number(int, text)
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low} ({why}), got {text}")
        return v
    parse.__name__ = "integer"
    return parse


def port(text: str) -> int:
    """A TCP port 0-65535 (0: any free one)."""
    v = _number(int, text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {text}")
    return v


def sizes(text: str) -> tuple:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``: positive sizes, strictly increasing."""
    try:
        out = tuple(int(p) for p in text.split(","))
    except ValueError:
        out = ()
    if not out or out[0] < 1 or list(out) != sorted(set(out)):
        raise argparse.ArgumentTypeError(f"{text!r} is not increasing positive sizes, e.g. "
                                         "1,2,4,8,16,32")
    return out


def seq_sizes(text: str) -> tuple:
    """Sequence buckets: :func:`sizes` whose last reaches the model's 256 tokens."""
    out = sizes(text)
    if out[-1] < MODEL_TOKENS:
        raise argparse.ArgumentTypeError(f"{text!r}: the last sequence bucket must be at least "
                                         f"{MODEL_TOKENS} (the tokens the model reads)")
    return out


def buckets(text: str) -> list:
    """``"1x16,8x32"`` -> ``[(1, 16), (8, 32)]``: positive ``BATCHxSEQ`` pairs."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            b, s = part.lower().split("x")
            pair = (int(b), int(s))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bucket {part!r} is not BATCHxSEQ, e.g. 8x32") \
                from None
        if min(pair) < 1:
            raise argparse.ArgumentTypeError(f"bucket {part!r}: sizes must be above 0")
        out.append(pair)
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} names no bucket, e.g. 1x16,8x32")
    return out


def check_warmup(parser: argparse.ArgumentParser, warmup, batch_buckets, seq_buckets) -> None:
    """``parser.error`` (usage, one ``error:`` line, exit 2) unless every warm-up bucket is a
    pair of the bucket lists (the flags' values, or the defaults when ``None``)."""
    from .models.buckets import BATCH_BUCKETS, SEQ_BUCKETS

    bb, sb = batch_buckets or BATCH_BUCKETS, seq_buckets or SEQ_BUCKETS
    for b, s in warmup or ():
        if b not in bb or s not in sb:
            parser.error(f"argument --warmup: bucket {b}x{s} is not in the batch buckets "
                         f"{','.join(map(str, bb))} x the sequence buckets "
                         f"{','.join(map(str, sb))}")
