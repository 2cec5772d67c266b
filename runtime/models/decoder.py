"""A small causal transformer decoder whose decode step is captured once and serves every step.

**Random weights.** The weights are random (``numpy.random.default_rng(config.seed)``, default
seed 0), not a trained model: the point is the runtime, so the tokens it produces are
deterministic but meaningless. :func:`reference_generate` is a plain numpy implementation of the
same model, used by the tests to check the kernels.

The model (GPT-2 shaped, pre-layer-norm): ``x = wte[token] + wpe[pos]``; per layer
``x += attn(ln1(x)) @ w_o + b_o`` and ``x += gelu(ln2(x) @ w_1 + b_1) @ w_2 + b_2``; then
``logits = ln_f(x) @ w_out`` and greedy ``argmax``.

**One graph for every step.** Everything that changes from step to step lives on the device, in
buffers the step reads, so the launch parameters recorded once are right for every position:

- ``token`` (``i32 [1]``) and ``pos`` (``i32 [1]``): read by the embedding gather
  (``kernels.decode.embed_at``), the KV-cache append (``kv_append`` writes K/V row ``pos``) and the
  attention (``causal_attend`` masks rows ``> pos``);
- ``k_cache``/``v_cache`` (``f32 [layers, max_len, dim]``): appended to in place;
- the step ends with ``argmax`` (the next token, on the device) and ``feed_back``: a
  device-to-device copy of that token into ``token``, its record in ``hist`` (``i32 [max_len]``,
  ``hist[p]`` = the token chosen for position ``p``) and ``pos += 1``.

So the replayed loop is ``graph.replay()`` per token with no host round trip; the tokens are read
from ``hist`` once at the end (or, to measure the other way, the step's ``next`` output each step).
A prompt is fed by writing ``token`` before the steps that consume prompt tokens (a host write,
fire-and-forget); ``feed_back`` overwrites it afterwards.

``Decoder.generate(prompt, n, graph=False)`` runs the same kernels eagerly (each step launches
its ~25 kernels one by one and allocates its activations), ``graph=True`` replays the captured
step (a ``runtime.StaticGraph``); both give identical tokens. ``per_sequence=True`` generates
the whole sequence in one replay (``capture_while`` around the step, the end test on the
device): over the raw client (:meth:`Decoder.loop_graph`), or with ``graph=True`` as a
``StaticGraph(loop="go")`` (:meth:`Decoder.sequence_graph`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from .. import _fork
from ..streams import StreamId
from ..kernels import decode as D
from ..kernels.pointwise import grid
from ..kernels.nn import erf_np
from ..static_graph import StaticGraph
from ..tensor import Tensor

__all__ = ["DecoderConfig", "Decoder", "init_weights", "reference_generate"]

LN_EPS = 1e-5


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the decoder.

    Attributes:
        vocab: vocabulary size (token ids ``0 .. vocab-1``).
        dim: model width ``H``; ``heads`` must divide it, head dim ``H / heads <= 64``.
        heads: attention heads.
        layers: transformer blocks.
        ffn: hidden width of the MLP.
        max_len: KV-cache rows = the longest prompt + generation (``<= 1024``).
        seed: the seed of the random weights.
    """

    vocab: int = 256
    dim: int = 64
    heads: int = 4
    layers: int = 2
    ffn: int = 256
    max_len: int = 128
    seed: int = 0

    def check(self) -> None:
        """Raises ``ValueError`` for sizes the kernels cannot run."""
        if self.dim % self.heads or self.dim // self.heads > D.MAX_HEAD_DIM:
            raise ValueError(f"DecoderConfig: dim {self.dim} must split into {self.heads} heads "
                             f"of at most {D.MAX_HEAD_DIM}")
        if not 1 <= self.max_len <= D.MAX_CACHE:
            raise ValueError(f"DecoderConfig: max_len must be in [1, {D.MAX_CACHE}], got "
                             f"{self.max_len}")
        if min(self.vocab, self.dim, self.layers, self.ffn) < 1:
            raise ValueError(f"DecoderConfig: sizes must be positive, got {self}")


def init_weights(cfg: DecoderConfig) -> dict:
    """Random float32 weights (fixed seed ``cfg.seed``), scaled so activations stay O(1).

    Returns: ``{name: np.ndarray}``: ``wte [V, H]``, ``wpe [T, H]``, ``ln_f_g``/``ln_f_b [H]``,
    ``w_out [H, V]`` and per layer ``l{i}.`` ``ln1_g, ln1_b, w_qkv [H, 3H], b_qkv, w_o [H, H], b_o,
    ln2_g, ln2_b, w_1 [H, F], b_1, w_2 [F, H], b_2``.
    """
    cfg.check()
    rng = np.random.default_rng(cfg.seed)
    H, F, V, T = cfg.dim, cfg.ffn, cfg.vocab, cfg.max_len

    def mat(r, c):
        return (rng.standard_normal((r, c)) / math.sqrt(r)).astype(np.float32)

    def vec(n, scale=0.02, base=0.0):
        return (base + scale * rng.standard_normal(n)).astype(np.float32)

    w = {"wte": rng.standard_normal((V, H)).astype(np.float32),
         "wpe": (0.5 * rng.standard_normal((T, H))).astype(np.float32)}
    for i in range(cfg.layers):
        w.update({f"l{i}.ln1_g": vec(H, 0.1, 1.0), f"l{i}.ln1_b": vec(H),
                  f"l{i}.w_qkv": mat(H, 3 * H), f"l{i}.b_qkv": vec(3 * H),
                  f"l{i}.w_o": mat(H, H), f"l{i}.b_o": vec(H),
                  f"l{i}.ln2_g": vec(H, 0.1, 1.0), f"l{i}.ln2_b": vec(H),
                  f"l{i}.w_1": mat(H, F), f"l{i}.b_1": vec(F),
                  f"l{i}.w_2": mat(F, H), f"l{i}.b_2": vec(H)})
    w["ln_f_g"], w["ln_f_b"], w["w_out"] = vec(H, 0.1, 1.0), vec(H), mat(H, V)
    return w


class Decoder:
    """The decoder on one device: weights uploaded once, eager and captured decode loops.

    Args:
        client: a ``ComputeClient``; the decoder makes its own client on the same server, pinned
            to a fresh stream (weights, eager steps and reads run there).
        config: a :class:`DecoderConfig` (default: the defaults).
        weights: ``{name: np.ndarray}`` as :func:`init_weights` returns (default: that).

    Thread safety: ``generate`` holds the decoder's lock (one decode at a time per decoder).
    """

    def __init__(self, client, config: DecoderConfig | None = None, weights: dict | None = None):
        self.config = cfg = config or DecoderConfig()
        cfg.check()
        self.client = client.with_stream(StreamId.new())
        self.weights = weights if weights is not None else init_weights(cfg)
        self.w = {n: Tensor.from_numpy(self.client, a) for n, a in self.weights.items()}
        self._graph: StaticGraph | None = None
        _fork.lock_for(self, "_lock", threading.Lock)   # (a forked child gets it afresh)
        self._loops: dict = {}       # loop bound (_bucket) -> (Graph, state tensors)
        self._sequences: dict = {}   # loop bound (_bucket) -> StaticGraph (sequence_graph)

    # -- the step ---------------------------------------------------------------------------------
    def state_spec(self) -> dict:
        """The step's device state: ``{name: (shape, dtype)}``."""
        cfg = self.config
        cache = (cfg.layers, cfg.max_len, cfg.dim)
        return {"token": ((1,), "i32"), "pos": ((1,), "i32"), "k_cache": (cache, "f32"),
                "v_cache": (cache, "f32"), "hist": ((cfg.max_len,), "i32")}

    def step(self, token: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor, hist: Tensor,
             next: Tensor) -> None:  # noqa: A002 - the output's name in the graph signature
        """Launch one decode step (about ``10 * layers + 5`` kernels) on ``token``'s client.

        Args:
            token, pos: ``i32 [1]``: the input token and its position (read on the device).
            k_cache, v_cache: ``f32 [layers, max_len, dim]``: row ``pos`` of each layer is
                written, rows ``<= pos`` are attended over.
            hist: ``i32 [max_len]``: ``hist[pos + 1]`` receives the chosen token.
            next: ``i32 [1]``: receives the chosen token (argmax of the logits).
        Returns: None; on exit ``token`` holds the chosen token and ``pos`` is one more.
        Streams: every launch on ``token.client``'s stream (all tensors must be on it).
        Capture: no host reads or writes: recordable as is; one graph serves every position.
        """
        cfg, w = self.config, self.w
        c = token.client
        H, T, heads = cfg.dim, cfg.max_len, cfg.heads
        hd = H // heads
        x = Tensor.empty(c, (1, H))
        c.launch(D.embed_at, grid(H), [token.handle, pos.handle, w["wte"].handle,
                                       w["wpe"].handle, x.handle], {"H": H, "T": T})
        for i in range(cfg.layers):
            lw = {k.split(".", 1)[1]: v for k, v in w.items() if k.startswith(f"l{i}.")}
            h = x.layer_norm(lw["ln1_g"], lw["ln1_b"], eps=LN_EPS)
            qkv = h.matmul(lw["w_qkv"], lw["b_qkv"])
            off = i * T * H
            c.launch(D.kv_append, grid(H), [qkv.handle, pos.handle, k_cache.handle,
                                            v_cache.handle], {"H": H, "T": T, "off": off})
            a = Tensor.empty(c, (1, H))
            c.launch(D.causal_attend, (heads, 1, 1),
                     [qkv.handle, pos.handle, k_cache.handle, v_cache.handle, a.handle],
                     {"heads": heads, "hd": hd, "T": T, "off": off, "scale": 1 / math.sqrt(hd)})
            x = x + a.matmul(lw["w_o"], lw["b_o"])
            h = x.layer_norm(lw["ln2_g"], lw["ln2_b"], eps=LN_EPS)
            x = x + h.matmul(lw["w_1"], lw["b_1"], activation="gelu").matmul(lw["w_2"], lw["b_2"])
        logits = x.layer_norm(w["ln_f_g"], w["ln_f_b"], eps=LN_EPS).matmul(w["w_out"])
        c.launch(D.argmax, (1, 1, 1), [logits.handle, next.handle], {"n": cfg.vocab})
        c.launch(D.feed_back, (1, 1, 1), [next.handle, token.handle, pos.handle, hist.handle],
                 {"T": T})

    def step_graph(self) -> StaticGraph:
        """The captured step: a ``StaticGraph`` with no inputs, output ``next`` (``i32 [1]``) and
        the state of :meth:`state_spec`; built on first use and kept.

        Use: ``g.write(pos=[0], token=[t0])``, then ``g.replay()`` per token (or ``g()`` to also
        read ``next``), ``g.read("hist")`` at the end; ``g.reset()`` zeroes the state.
        """
        if self._graph is None:
            self._graph = StaticGraph(self.client, inputs={}, outputs={"next": ((1,), "i32")},
                                      state=self.state_spec(), body=self.step)
        return self._graph

    # -- decoding ---------------------------------------------------------------------------------
    def _check(self, prompt, n: int) -> np.ndarray:
        cfg = self.config
        p = np.asarray(prompt)
        if p.ndim != 1 or p.size < 1 or p.dtype.kind not in "iu":
            raise ValueError(f"prompt must be a non-empty 1-D sequence of token ids, got "
                             f"{prompt!r}")
        if p.min() < 0 or p.max() >= cfg.vocab:
            raise ValueError(f"prompt token ids must be in [0, {cfg.vocab}), got {p.tolist()}")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if p.size + n > cfg.max_len:
            raise ValueError(f"prompt ({p.size}) + n ({n}) exceeds max_len {cfg.max_len}")
        return p.astype(np.int32)

    def _bucket(self, max_tokens: int) -> int:
        """The loop bound a graph for ``max_tokens`` steps is built with: the next power of two,
        at most ``max_len``. The loop stops on the device at ``stop[1]`` (the last position), so
        a larger bound runs the same steps; one graph per bucket keeps the graphs (each with its
        own KV cache) at ``log2(max_len) + 1`` however many lengths a service is asked for
        (one per distinct ``n`` grew with the requests)."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) \
                or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        return int(min(self.config.max_len, 1 << (int(max_tokens) - 1).bit_length()))

    def loop_graph(self, max_tokens: int):
        """The decode loop in one graph: ``capture_while(go, step + decode_continue,
        max_iterations=...)`` over its own state, the bound ``max_tokens`` rounded up to a
        power of two (at most ``max_len``; built on first use per bucket and kept: at most
        ``log2(max_len) + 1`` graphs). The loop test runs on the device
        (``kernels.decode.decode_continue``): it stops at ``stop[1]`` (the last position) or
        when the chosen token equals ``stop[0]`` (the end token, -1 for none).

        Returns: ``(graph, tensors)``: a ``runtime.Graph`` on the decoder's stream and
            ``{"token", "pos", "k_cache", "v_cache", "hist", "next", "go", "stop"}``.
        Raises: ``UnsupportedError`` where the backend has no loop nodes (cuda without CUDA
            12.4 conditional nodes).
        """
        max_tokens = self._bucket(max_tokens)
        hit = self._loops.get(max_tokens)
        if hit is not None:
            return hit
        c = self.client
        st = {k: Tensor.from_numpy(c, np.zeros(s, "i4" if d == "i32" else "f4"))
              for k, (s, d) in self.state_spec().items()}
        st["next"] = Tensor.from_numpy(c, np.zeros(1, np.int32))
        st["go"] = Tensor.from_numpy(c, np.zeros(1, np.int32))
        st["stop"] = Tensor.from_numpy(c, np.array([-1, 0], np.int32))
        names = list(self.state_spec())

        def body():
            self.step(next=st["next"], **{k: st[k] for k in names})
            c.launch(D.decode_continue, (1, 1, 1), [st["next"].handle, st["pos"].handle,
                                                  st["stop"].handle, st["go"].handle])
        c.graph_prepare()
        try:
            body()    # warm-up: compiles, and sizes the pool so the recording allocates nothing
            c.start_capture()   # (cuda refuses a fresh allocation inside the window)
            c.capture_while(st["go"].handle, body, max_iterations=max_tokens)
        except BaseException:
            c.abort_capture()
            raise
        g = c.stop_capture(retain=True)
        self._loops[max_tokens] = (g, st)
        return g, st

    def sequence_graph(self, max_tokens: int) -> StaticGraph:
        """The decode loop as a ``StaticGraph`` with ``loop="go"``: state :meth:`state_spec` plus
        ``go`` (``i32 [1]``) and ``stop`` (``i32 [2]``: end token or -1, last position), output
        ``next``; its body is the step then ``kernels.decode.decode_continue`` (the end test, on
        the device), recorded inside ``capture_while(go, ..., max_iterations=...)``, the bound
        ``max_tokens`` rounded up to a power of two (at most ``max_len``). Built on first use per
        bucket and kept (at most ``log2(max_len) + 1``).

        Use: ``g.reset()``; ``g.write(token=[t], stop=[end, last_pos], go=[1])``; ``g.replay()``
        (one replay for the whole sequence); ``g.read("hist")``.
        Raises: ``UnsupportedError`` where the backend has no loop nodes.
        """
        max_tokens = self._bucket(max_tokens)
        g = self._sequences.get(max_tokens)
        if g is None:
            def body(next, go, stop, **state):  # noqa: A002 - the output's name
                self.step(next=next, **state)
                state["token"].client.launch(D.decode_continue, (1, 1, 1),
                                             [next.handle, state["pos"].handle, stop.handle,
                                              go.handle])
            g = StaticGraph(self.client, inputs={}, outputs={"next": ((1,), "i32")},
                            state={**self.state_spec(), "go": ((1,), "i32"),
                                   "stop": np.array([-1, 0], np.int32)},
                            body=body, loop="go", max_iterations=max_tokens)
            self._sequences[max_tokens] = g
        return g

    def _generate_static_sequence(self, p: np.ndarray, n: int, end_token) -> np.ndarray:
        """:meth:`sequence_graph`: one replay per prompt token but the last, then one for the
        whole generation (as :meth:`_generate_sequence`)."""
        g = self.sequence_graph(n)
        g.reset()
        for i in range(p.size - 1):
            g.write(token=p[i:i + 1], stop=[-1, i + 1], go=[1])
            g.replay()
        g.write(token=p[-1:], stop=[-1 if end_token is None else int(end_token),
                                    p.size + n - 1], go=[1])
        g.replay()
        return g.read("hist")[p.size:p.size + n]

    def _generate_sequence(self, p: np.ndarray, n: int, end_token) -> np.ndarray:
        """One replay per prompt token but the last (each runs one step), then one replay for
        the whole generation."""
        g, st = self.loop_graph(n)
        c = self.client
        for t in st.values():       # all of the loop's state, the KV cache and next included,
            h = t.handle            # as sequence_graph's reset(): a failure's marks clear here
            c.write(h, np.zeros(h.size, h.dtype))   # (before, one failed generation left every
                                                    # later one raising: ADV6)
        go = np.ones(1, np.int32)
        for i in range(p.size - 1):                     # prefill: one step each
            c.write(st["token"].handle, p[i:i + 1])
            c.write(st["stop"].handle, np.array([-1, i + 1], np.int32))
            c.write(st["go"].handle, go)
            g.replay()
        c.write(st["token"].handle, p[-1:])
        c.write(st["stop"].handle, np.array([-1 if end_token is None else end_token,
                                             p.size + n - 1], np.int32))
        c.write(st["go"].handle, go)
        g.replay()
        return st["hist"].numpy()[p.size:p.size + n]

    def generate(self, prompt, n: int, graph: bool = False, read_each_step: bool = False,
                 timings: dict | None = None, end_token: int | None = None,
                 per_sequence: bool = False) -> np.ndarray:
        """Greedy-decode ``n`` tokens after ``prompt``.

        Args:
            prompt: 1-D token ids (``len(prompt) + n <= max_len``).
            n: tokens to generate (at most).
            graph: replay the captured step (``True``) or launch every kernel eagerly (``False``).
            read_each_step: read the chosen token to the host after every step (a round trip per
                token) instead of once, from ``hist``, at the end.
            timings: if a dict, receives ``{"steps", "seconds", "per_token_ms", "tokens"}`` of
                the decode loop (from the first step to the tokens on the host; capture
                excluded): the steps run (prompt tokens but the first, then one per generated
                token), the seconds, ``seconds / steps`` in ms and the tokens returned.
            end_token: stop after this token (it is the last one returned); None: ``n`` tokens.
                ``per_sequence`` stops on the device after it; the other modes run all ``n``
                steps and cut the tokens after it (``timings["steps"]`` says which).
            per_sequence: one replay for the whole generation (the loop and its end test run on
                the device), plus one per prompt token but the last: :meth:`loop_graph`, or
                with ``graph=True`` the ``StaticGraph`` of :meth:`sequence_graph`.
        Returns: ``np.ndarray`` ``int32 [<= n]``, the generated tokens (the same in every mode).
        Raises: ``ValueError`` (bad prompt, ``n`` or ``end_token``); ``UnsupportedError``
            (``per_sequence`` on a backend without loop nodes).
        Streams: the decoder's stream (eager, per sequence) or the step graph's own stream.
        """
        p = self._check(prompt, n)
        if end_token is not None and not 0 <= int(end_token) < self.config.vocab:
            raise ValueError(f"end_token must be a token id in [0, {self.config.vocab}), got "
                             f"{end_token!r}")
        steps = p.size + n - 1
        with self._lock:
            if per_sequence:
                # captured outside the timing
                run = self._generate_static_sequence if graph else self._generate_sequence
                self.sequence_graph(n) if graph else self.loop_graph(n)
                t0 = time.perf_counter()
                out = run(p, n, end_token)
                seen = None
            elif graph:
                g = self.step_graph()
                g.reset()
                t0 = time.perf_counter()
                seen = []
                for i in range(steps):
                    if i < p.size:
                        g.write(token=p[i:i + 1])
                    if read_each_step:
                        seen.append(int(g()["next"][0]))
                    else:
                        g.replay()
                out = g.read("hist")[p.size:p.size + n]
            else:
                st = {k: Tensor.from_numpy(self.client, np.zeros(s, "i4" if d == "i32" else "f4"))
                      for k, (s, d) in self.state_spec().items()}
                nxt = Tensor.empty(self.client, (1,), "i32")
                self.client.sync()
                t0 = time.perf_counter()
                seen = []
                for i in range(steps):
                    if i < p.size:
                        st["token"].write(p[i:i + 1])
                    self.step(next=nxt, **st)
                    if read_each_step:
                        seen.append(int(nxt.numpy()[0]))
                out = st["hist"].numpy()[p.size:p.size + n]
            dt = time.perf_counter() - t0
        if read_each_step and seen is not None:
            assert seen[p.size - 1:] == out.tolist(), "per-step tokens differ from hist"
        if end_token is not None:
            hit = np.flatnonzero(out == int(end_token))
            if hit.size:
                out = out[:hit[0] + 1]
        if per_sequence:          # the device loop stopped after the end token: steps it ran
            steps = p.size - 1 + int(out.size)
        if timings is not None:
            timings.update(steps=steps, seconds=dt, per_token_ms=1e3 * dt / steps,
                           tokens=int(out.size))
        return out

    def release(self) -> None:
        """Release the step graph and the weights."""
        if self._graph is not None:
            self._graph.release()
            self._graph = None
        for g, _ in self._loops.values():
            g.release()
        for g in self._sequences.values():
            g.release()
        self._loops, self._sequences = {}, {}
        self.w = {}


def reference_generate(weights: dict, cfg: DecoderConfig, prompt, n: int) -> np.ndarray:
    """The same model in plain float32 numpy, full recompute per step (for tests).

    Returns: ``int32 [n]`` greedy tokens after ``prompt``.
    """
    H, heads = cfg.dim, cfg.heads
    hd = H // heads

    def ln(x, g, b):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / np.sqrt(v + np.float32(LN_EPS)) * g + b

    def gelu(x):
        return x * np.float32(0.5) * (1 + erf_np(x * np.float32(0.7071067811865476)))

    toks = [int(t) for t in prompt]
    for _ in range(n):
        S = len(toks)
        x = weights["wte"][toks] + weights["wpe"][:S]
        for i in range(cfg.layers):
            lw = {k.split(".", 1)[1]: v for k, v in weights.items() if k.startswith(f"l{i}.")}
            qkv = ln(x, lw["ln1_g"], lw["ln1_b"]) @ lw["w_qkv"] + lw["b_qkv"]
            q, k, v = (qkv[:, j * H:(j + 1) * H].reshape(S, heads, hd).transpose(1, 0, 2)
                       for j in range(3))
            s = q @ k.transpose(0, 2, 1) / np.float32(math.sqrt(hd))
            s = s + np.triu(np.full((S, S), -np.inf, np.float32), 1)
            e = np.exp(s - s.max(-1, keepdims=True))
            a = ((e / e.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(S, H)
            x = x + a @ lw["w_o"] + lw["b_o"]
            x = x + gelu(ln(x, lw["ln2_g"], lw["ln2_b"]) @ lw["w_1"] + lw["b_1"]) @ lw["w_2"] \
                + lw["b_2"]
        logits = ln(x[-1], weights["ln_f_g"], weights["ln_f_b"]) @ weights["w_out"]
        toks.append(int(np.argmax(logits)))
    return np.array(toks[len(prompt):], np.int32)
