"""Kernels for one autoregressive decode step whose control values live on the device.

A captured decode step must serve every position without recapture, so nothing that changes from
step to step may be a launch parameter (params are baked into a graph at recording). These
kernels read the token id and the position from one-element ``i32`` device buffers instead:

- :data:`embed_at`: ``out = wte[token] + wpe[pos]`` (embedding row gather by a device token id);
- :data:`kv_append`: write this step's K and V rows into the cache at row ``pos``;
- :data:`causal_attend`: single-query attention over cache rows ``j <= pos`` (the causal mask is
  computed on the device from ``pos``);
- :data:`argmax`: the index of the largest logit, on the device (ties: the lowest index, as
  ``np.argmax``);
- :data:`feed_back`: the device-to-device copy of the chosen token into the token buffer, the
  token's record in the history buffer, and ``pos += 1``.

(The bitwise copy ``StaticGraph`` restores its inputs with is ``runtime.kernels.copy_words``.)

Each is one description (:func:`runtime.kernels.shader.program`): a single body gives the WGSL and
CUDA C sources, and a numpy callable the cpu one. Positions are clamped to ``[0, T)`` on the
device (``T`` = cache rows), so a runaway position never writes outside the cache; callers keep
``pos < T`` (``runtime.models.decoder`` checks it on the host before decoding).
"""

from __future__ import annotations

import numpy as np

from .pointwise import WORKGROUP, covers, covers_total, grid, touches
from .shader import NAN_HELPERS, program, tree_reduce

R, RW, W = "read", "read_write", "write"
#: invocations per workgroup of :data:`causal_attend` and :data:`argmax`.
DECODE_WORKGROUP = 64
#: largest cache length :data:`causal_attend` supports (its scores live in workgroup memory).
MAX_CACHE = 1024
#: largest head dimension :data:`causal_attend` supports.
MAX_HEAD_DIM = DECODE_WORKGROUP


def _clamp(p, T):
    return min(max(int(p), 0), int(T) - 1)


# ---------------------------------------------------------------------------------------------
def _embed_at_cpu(token, pos, wte, wpe, out, *, H, T, count):
    t, q = int(token[0]), _clamp(pos[0], T)
    if not 0 <= t < wte.size // max(int(H), 1):   # (a negative t sliced a row from the end)
        raise IndexError(f"embed_at: token {t} outside [0, {wte.size // max(int(H), 1)})")
    out[:H] = wte[t * H:(t + 1) * H] + wpe[q * H:(q + 1) * H]


#: ``out[c] = wte[token[0], c] + wpe[pos[0], c]`` for ``c < H``: ``token``/``pos`` are one-element
#: ``i32`` buffers read on the device (``token`` must index inside ``wte``: outside it the launch
#: fails with ``LaunchError``: ``IndexError`` on cpu, a device-side check on wgpu
#: (``Kernel.checks``, found after the submit; its output reads raise); cuda does not check;
#: ``pos`` is clamped to ``[0, T)``, ``T`` = rows of ``wpe``, at least 1: 0 is a ``ValueError`` at
#: the call). Launch over ``grid(H)``.
embed_at = program(
    "embed_at", [("token", "i32", R), ("pos", "i32", R), ("wte", "f32", R), ("wpe", "f32", R),
                 ("out", "f32", W)], [("H", "u32"), ("T", "u32")], (WORKGROUP, 1, 1), f"""
    let c = (wg.y * nwg.x + wg.x) * {WORKGROUP}u + lidx;
    if (c < p.H) {{
        let t = u32(token[0]);
        let q = min(u32(max(pos[0], 0)), p.T - 1u);
        if (t >= arrayLength(&wte) / p.H) {{
            atomicMax(&err_flag[0], 1u);
        }} else if (q * p.H + c >= arrayLength(&wpe)) {{
            atomicMax(&err_flag[0], 2u);
        }} else {{
            out[c] = wte[t * p.H + c] + wpe[q * p.H + c];
        }}
    }}""", cpu=_embed_at_cpu, elements={"out": "H"}, ranges={"T": (1, None)},
    checks=("token outside the rows of wte", "position outside the rows of wpe"))


# ---------------------------------------------------------------------------------------------
def _kv_append_cpu(qkv, pos, kc, vc, *, H, T, off, count):
    q = _clamp(pos[0], T)
    kc[off + q * H:off + (q + 1) * H] = qkv[H:2 * H]
    vc[off + q * H:off + (q + 1) * H] = qkv[2 * H:3 * H]


#: Append this step's keys and values to the cache: ``kc[off + pos*H + c] = qkv[H + c]`` and
#: ``vc[off + pos*H + c] = qkv[2H + c]`` for ``c < H``, where ``qkv`` is the packed ``[3H]``
#: projection (q | k | v), ``pos`` a one-element ``i32`` buffer read on the device (clamped to
#: ``[0, T)``; ``T >= 1``: 0 is a ``ValueError`` at the call) and ``off`` the element offset of
#: this layer's ``[T, H]`` cache block. Launch over ``grid(H)``.
kv_append = program(
    "kv_append", [("qkv", "f32", R), ("pos", "i32", R), ("kc", "f32", RW), ("vc", "f32", RW)],
    [("H", "u32"), ("T", "u32"), ("off", "u32")], (WORKGROUP, 1, 1), f"""
    let c = (wg.y * nwg.x + wg.x) * {WORKGROUP}u + lidx;
    if (c < p.H) {{
        let q = min(u32(max(pos[0], 0)), p.T - 1u);
        let at = p.off + q * p.H + c;
        if (at >= arrayLength(&kc) || at >= arrayLength(&vc) || 2u * p.H + c >= arrayLength(&qkv)) {{
            atomicMax(&err_flag[0], 1u);
        }} else {{
            kc[at] = qkv[p.H + c];
            vc[at] = qkv[2u * p.H + c];
        }}
    }}""", cpu=_kv_append_cpu, ranges={"T": (1, None)},
    checks=("the position's row (off + pos * H) past kc or vc, or qkv shorter than 3H",))


# ---------------------------------------------------------------------------------------------
def _causal_attend_cpu(qkv, pos, kc, vc, out, *, heads, hd, T, off, scale, count):
    H = heads * hd
    L = _clamp(pos[0], T) + 1
    q = qkv[:H].reshape(heads, 1, hd) * np.float32(scale)
    k = kc[off:off + T * H].reshape(T, heads, hd)[:L].transpose(1, 2, 0)     # [heads, hd, L]
    v = vc[off:off + T * H].reshape(T, heads, hd)[:L].transpose(1, 0, 2)     # [heads, L, hd]
    s = q @ k                                                                 # [heads, 1, L]
    s -= s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    out[:H] = ((e @ v) / e.sum(axis=-1, keepdims=True)).reshape(H)


#: Single-query causal attention over the cache, one workgroup per head ``h``:
#: ``out[h*hd + d] = sum_j softmax_j(scale * q_h . kc[j, h]) vc[j, h, d]`` over cache rows
#: ``j <= pos[0]`` (the mask comes from the device position; later rows are never read). ``q`` is
#: the first ``H = heads*hd`` values of the packed ``qkv``; ``off`` is the layer's element offset
#: in ``kc``/``vc`` (``[T, H]`` blocks). ``1 <= T <= MAX_CACHE``, ``1 <= hd <= MAX_HEAD_DIM``
#: (``Kernel.ranges``: a launch outside them raises ``ValueError`` on every backend).
#: Launch over ``(heads, 1, 1)``.
causal_attend = program(
    "causal_attend", [("qkv", "f32", R), ("pos", "i32", R), ("kc", "f32", R), ("vc", "f32", R),
                      ("out", "f32", W)],
    [("heads", "u32"), ("hd", "u32"), ("T", "u32"), ("off", "u32"), ("scale", "f32")],
    (DECODE_WORKGROUP, 1, 1), f"""
    let h = wg.x;
    let H = p.heads * p.hd;
    if (p.off + p.T * H > arrayLength(&kc) || p.off + p.T * H > arrayLength(&vc)
            || H > arrayLength(&qkv) || H > arrayLength(&out)) {{
        if (lidx == 0u) {{ atomicMax(&err_flag[0], 1u); }}
        return;
    }}
    let last = min(u32(max(pos[0], 0)), p.T - 1u);
    for (var d = lidx; d < p.hd; d += {DECODE_WORKGROUP}u) {{
        qs[d] = qkv[h * p.hd + d] * p.scale;
    }}
    workgroupBarrier();
    var mx = -3.0e38f;
    for (var j = lidx; j < p.T; j += {DECODE_WORKGROUP}u) {{
        var s = -3.0e38f;
        if (j <= last) {{
            let krow = p.off + j * H + h * p.hd;
            s = 0.0f;
            for (var d = 0u; d < p.hd; d++) {{ s += qs[d] * kc[krow + d]; }}
        }}
        sc[j] = s;
        mx = max(mx, s);
    }}
    red[lidx] = mx;{tree_reduce("max", DECODE_WORKGROUP)}
    let m = red[0];
    workgroupBarrier();
    var l = 0.0f;
    for (var j = lidx; j < p.T; j += {DECODE_WORKGROUP}u) {{
        var e = 0.0f;
        if (j <= last) {{ e = exp(sc[j] - m); }}
        sc[j] = e;
        l += e;
    }}
    red[lidx] = l;{tree_reduce("+", DECODE_WORKGROUP)}
    let inv = 1.0f / red[0];
    for (var d = lidx; d < p.hd; d += {DECODE_WORKGROUP}u) {{
        var acc = 0.0f;
        for (var j = 0u; j <= last; j++) {{ acc += sc[j] * vc[p.off + j * H + h * p.hd + d]; }}
        out[h * p.hd + d] = acc * inv;
    }}""", shared=[("qs", "f32", MAX_HEAD_DIM), ("sc", "f32", MAX_CACHE),
                  ("red", "f32", DECODE_WORKGROUP)], cpu=_causal_attend_cpu,
    ranges={"T": (1, MAX_CACHE), "hd": (1, MAX_HEAD_DIM)},
    checks=("kc or vc shorter than off + T * H, or qkv / out shorter than H = heads * hd",))


# ---------------------------------------------------------------------------------------------
def _argmax_cpu(x, out, *, n, count):
    out[0] = int(np.argmax(x[:n]))


#: ``out[0] = argmax_i x[i]`` over ``i < n`` (``i32``), with ``np.argmax``'s rules on every
#: backend: the first NaN wins, else the first maximum (ties go to the lowest index). ``n >= 1``
#: (``Kernel.ranges``: 0 is a ``ValueError`` at the call). One workgroup: launch over ``(1, 1, 1)``.
argmax = program(
    "argmax", [("x", "f32", R), ("out", "i32", W)], [("n", "u32")], (DECODE_WORKGROUP, 1, 1),
    f"""
    var bv = -3.4e38f;
    var bi = 0xffffffffu;
    for (var i = lidx; i < p.n; i += {DECODE_WORKGROUP}u) {{
        let v = x[i];
        if (bi == 0xffffffffu || above(v, bv)) {{ bv = v; bi = i; }}
    }}
    vals[lidx] = bv;
    idxs[lidx] = bi;
    workgroupBarrier();
    for (var st = {DECODE_WORKGROUP // 2}u; st > 0u; st = st / 2u) {{
        if (lidx < st) {{
            let ov = vals[lidx + st];
            let oi = idxs[lidx + st];
            let tie = (is_nan(ov) && is_nan(vals[lidx])) || ov == vals[lidx];
            if (oi != 0xffffffffu && (idxs[lidx] == 0xffffffffu || above(ov, vals[lidx])
                                      || (tie && oi < idxs[lidx]))) {{
                vals[lidx] = ov;
                idxs[lidx] = oi;
            }}
        }}
        workgroupBarrier();
    }}
    if (lidx == 0u) {{ out[0] = i32(idxs[0]); }}""",
    shared=[("vals", "f32", DECODE_WORKGROUP), ("idxs", "u32", DECODE_WORKGROUP)],
    helpers=NAN_HELPERS + """
fn above(a: f32, b: f32) -> bool {
    return (is_nan(a) && !is_nan(b)) || (!is_nan(a) && !is_nan(b) && a > b);
}
""", cpu=_argmax_cpu, elements={"x": "n"}, ranges={"n": (1, None)})


# ---------------------------------------------------------------------------------------------
def _feed_back_cpu(nxt, token, pos, hist, *, T, count):
    t = nxt[0]
    token[0] = t
    q = int(pos[0]) + 1
    if 0 <= q < T:
        hist[q] = t
    pos[0] = q


#: The end of a self-feeding decode step, on one invocation: ``token[0] = nxt[0]`` (the chosen
#: token becomes the next step's input: a device-to-device copy), ``hist[pos[0] + 1] = nxt[0]``
#: (the token's record, when the row exists: ``hist`` has ``T`` entries) and ``pos[0] += 1``.
#: Launch over ``(1, 1, 1)``.
feed_back = program(
    "feed_back", [("nxt", "i32", R), ("token", "i32", RW), ("pos", "i32", RW),
                  ("hist", "i32", RW)], [("T", "u32")], (1, 1, 1), """
    let t = nxt[0];
    token[0] = t;
    let q = pos[0] + 1;
    if (q >= 0 && u32(q) < p.T) { hist[u32(q)] = t; }
    pos[0] = q;""", cpu=_feed_back_cpu, elements={"hist": "T"})


def _decode_continue_cpu(nxt, pos, stop, go, *, count):
    go[0] = 1 if (pos[0] < stop[1] and nxt[0] != stop[0]) else 0


#: The loop test of a decode loop in one replay (``capture_while``), on one invocation:
#: ``go[0] = pos[0] < stop[1] && nxt[0] != stop[0]``: keep going while the last position is
#: not reached and the chosen token is not the end token (``stop = [end token or -1, last
#: position]``, written by the host once per sequence). Launch over ``(1, 1, 1)``.
decode_continue = program(
    "decode_continue", [("nxt", "i32", R), ("pos", "i32", R), ("stop", "i32", R),
                        ("go", "i32", RW)], [], (1, 1, 1), """
    go[0] = select(0, 1, pos[0] < stop[1] && nxt[0] != stop[0]);""", cpu=_decode_continue_cpu)


# The workgroup counts they need (Kernel.count_error, pointwise.covers): a short count is
# refused on every backend (the cpu bodies do the whole row whatever the count).
covers(embed_at, covers_total("H"), "grid(H)")
covers(kv_append, covers_total("H"), "grid(H)")
covers(causal_attend, lambda c, p: c[0] >= p["heads"], "(heads, 1, 1)")
# what they rewrite of a longer buffer (the rest keeps a failure's mark: contract 4)
touches(causal_attend, {"out": lambda c, p: p["heads"] * p["hd"]})
touches(argmax, {"out": lambda c, p: 1})


__all__ = ["embed_at", "kv_append", "causal_attend", "argmax", "feed_back",
           "decode_continue", "grid", "DECODE_WORKGROUP", "MAX_CACHE", "MAX_HEAD_DIM"]
