"""How the server reads token-array inputs (``"input": [int, ...]`` or ``[[int, ...], ...]``).

OpenAI's API defines token arrays as ids of OpenAI's own tokenizer (tiktoken's
``cl100k_base`` for its embedding models), and ``langchain-openai``'s ``OpenAIEmbeddings``
sends such arrays by default (``check_embedding_ctx_length=True``). This model reads
all-MiniLM-L6-v2's WordPiece ids, so a token array is only embedded when the server was told
how to read it (``serve --token-ids``):

- ``refuse`` (default): 400 ``invalid_request_error`` with :func:`refusal` (send text instead);
- ``wordpiece``: the ids are this model's own WordPiece ids (clients that tokenized with
  all-MiniLM-L6-v2's tokenizer), as text-embeddings-inference and vLLM take them;
- ``openai``: the ids are ``cl100k_base`` ids; each array is decoded to its text
  (:class:`OpenAIIds`) and the text embedded. Needs ``tiktoken`` (``pip install
  'runtime[openai-ids]'``) and the ``cl100k_base`` file in tiktoken's cache
  (:func:`load_openai_encoding`); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

#: The ``--token-ids`` modes; the first is the default.
MODES = ("refuse", "wordpiece", "openai")
#: Where tiktoken fetches ``cl100k_base`` from (its cache file is named by this URL's SHA-1).
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
#: Most ids in one ``openai`` token array: OpenAI's own limit per embeddings input.
OPENAI_MAX_IDS = 8192


def refusal(max_seq_length: int = 256) -> str:
    """The 400 message for a token array when the server runs in ``refuse`` mode."""
    return ("this server embeds text: send 'input' as a string or a list of strings. A token "
            "array would be read as all-MiniLM-L6-v2's WordPiece ids, not OpenAI's (tiktoken) "
            "ids, so it is refused unless the server runs with --token-ids wordpiece or "
            "--token-ids openai. For langchain-openai use OpenAIEmbeddings(..., "
            "check_embedding_ctx_length=False), which sends the texts")


def tiktoken_cache_file() -> str:
    """The path tiktoken reads ``cl100k_base`` from: ``$TIKTOKEN_CACHE_DIR`` (else
    ``$DATA_GYM_CACHE_DIR``, else ``<tmp>/data-gym-cache``) / SHA-1 of :data:`CL100K_URL`
    (tiktoken's ``load.read_file_cached``)."""
    folder = (os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
              or os.path.join(tempfile.gettempdir(), "data-gym-cache"))
    return os.path.join(folder, hashlib.sha1(CL100K_URL.encode()).hexdigest())


def load_openai_encoding():
    """tiktoken's ``cl100k_base`` encoding, from tiktoken's cache only (never downloaded).

    Returns: a ``tiktoken.Encoding`` (``decode(ids) -> str``, ``n_vocab``).
    Raises: ``RuntimeError`` with one line saying what is missing: tiktoken not installed, or
        the file not at :func:`tiktoken_cache_file` (download :data:`CL100K_URL` there, or point
        ``TIKTOKEN_CACHE_DIR`` at a folder holding it).
    """
    try:
        import tiktoken
    except ImportError:
        raise RuntimeError("--token-ids openai needs tiktoken: pip install "
                           "'runtime[openai-ids]'") from None
    path = tiktoken_cache_file()
    if not os.path.isfile(path):
        raise RuntimeError(f"--token-ids openai needs tiktoken's cl100k_base file at {path} "
                           f"(download {CL100K_URL} to that name, or set TIKTOKEN_CACHE_DIR to "
                           "a folder holding it); nothing is downloaded")
    try:
        return tiktoken.get_encoding("cl100k_base")
    except Exception as e:  # noqa: BLE001 - a corrupt file: tiktoken would try to download
        raise RuntimeError(f"--token-ids openai: tiktoken cannot read {path}: "
                           f"{type(e).__name__}: {e}") from None


class OpenAIIds:
    """Decodes OpenAI token arrays to the texts they spell.

    Args:
        encoding: an object with ``decode(list[int]) -> str`` and ``n_vocab`` (tiktoken's
            ``Encoding``, or a stand-in in tests).
    """

    def __init__(self, encoding):
        self.encoding = encoding
        self.vocab_size = int(encoding.n_vocab)

    def texts(self, seqs) -> list:
        """``[decode(ids) for ids in seqs]``; ``seqs`` hold ints in ``[0, vocab_size)`` (the
        parser checked them). Undecodable byte runs become U+FFFD, as tiktoken's ``decode``."""
        return [self.encoding.decode([int(t) for t in s]) for s in seqs]
