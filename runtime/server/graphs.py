"""Graphs that change: what a capture recorded, and updating or re-instantiating it.

A capture window keeps, besides the backend recording, the ops it recorded in order
(``Window.ops``, then ``GraphState.ops``): a :class:`LaunchRec` per launch (kernel, handle ids
per binding, params, workgroup count, the conditional scope it sits in), a :class:`CondRec`
where a ``capture_if``/``capture_while`` node opens, and ``("else", index)`` / ``("end",
index)`` markers. From them the server:

- answers ``Graph.launches()`` / ``Graph.describe()`` with plain data (:func:`launches`,
  :func:`describe`), the same on every backend for the same recording;
- applies ``Graph.update(rebind=, params=, count=)`` (:func:`update`): validated as a whole
  first (``ValueError``, nothing changed), then the backend patches its graph
  (``Backend.update_graph``: cpu and wgpu swap in patched dispatch lists, so a replay enqueued
  before the update keeps the old ones) or, where it cannot, the graph is rebuilt from the ops
  (``fallback_reason`` says why). The server's sets follow the new bindings: read/write sets,
  read-only inputs (marks), retained and pinned slots, liveness (``required``/``freed``),
  the cross-stream fences of the new buffers, the checker's record of the graph;
- builds ``Graph.instantiate(rebind=)``: a new graph from the same ops against other buffers
  (:func:`instantiate`), with no warm-up and no capture;
- records conditional nodes (:func:`cond_begin`, :func:`cond_else`, :func:`cond_end`).

Update and instantiate run as server handlers, in queue order: an update takes effect for the
replays enqueued after it, never racing one in flight (CUDA ``cudaGraphExecUpdate`` semantics).
"""

from __future__ import annotations

from ..errors import CaptureRefused, InvalidHandle, ServerError
from ..kernel import normalize_count
from .capture import GraphState, Window, maybe_written, merge, sources
from .ops import CondRec, LaunchRec, cond_recs, launch_recs, used_ids


# -- plain data ------------------------------------------------------------------------------
def _count_data(count):
    return list(count) if isinstance(count, tuple) else {"indirect": count}


def launches(g: GraphState, server) -> list:
    """``Graph.launches()``: one dict per recorded launch, in recording order.

    Each: ``{"index", "kernel", "bindings": [{"name", "access", "dtype", "handle",
    "nbytes"}], "params": {name: value}, "count": [x, y, z] | {"indirect": handle id},
    "scope": [[node index, branch], ...]}``.
    """
    nbytes = _nbytes(g, server)
    out = []
    for i, rec in enumerate(launch_recs(g.ops)):
        k = rec.kernel
        out.append({
            "index": i, "kernel": k.name,
            "bindings": [{"name": b.name, "access": b.access, "dtype": b.dtype, "handle": hid,
                          "nbytes": nbytes.get(hid)} for b, hid in zip(k.bindings, rec.hids)],
            "params": dict(zip(k.param_names, rec.params)),
            "count": _count_data(rec.count),
            "scope": [list(s) for s in rec.scope]})
    return out


def _nbytes(g: GraphState, server) -> dict:
    """``{handle id: nbytes}`` of the handles ``g`` uses."""
    return {st.id: st.nbytes for st in g.handles}


def describe(g: GraphState, server) -> dict:
    """``Graph.describe()``: the graph as plain data (see ``Graph.describe``)."""
    ls = launches(g, server)
    nb = _nbytes(g, server)
    dtypes: dict = {}
    for rec in launch_recs(g.ops):
        for b, hid in zip(rec.kernel.bindings, rec.hids):
            dtypes.setdefault(hid, b.dtype)
    for c in cond_recs(g.ops):
        dtypes.setdefault(c.cond, c.dtype)
    order: list = []
    for op in g.ops:
        ids = op.used() if isinstance(op, LaunchRec) else [op.cond] if isinstance(op, CondRec) \
            else []
        for hid in ids:
            if hid not in order:
                order.append(hid)
    label = {hid: f"b{i}" for i, hid in enumerate(order)}
    for launch in ls:
        for b in launch["bindings"]:
            b["buffer"] = label[b["handle"]]
        if "indirect" in launch["count"]:
            launch["count"]["buffer"] = label[launch["count"]["indirect"]]
    nodes = [{"index": c.index, "kind": c.kind, "cond": c.cond, "cond_buffer": label[c.cond],
              "max_iterations": c.max_iterations, "scope": [list(s) for s in c.scope]}
             for c in cond_recs(g.ops)]
    freed = set(g.freed)
    return {
        "id": g.id, "stream": int(g.stream), "backend": server.backend.name,
        "hardware": bool(server.backend.hardware_graphs),
        "launches": ls, "nodes": nodes,
        "buffers": [{"buffer": label[h], "handle": h, "nbytes": nb.get(h),
                     "dtype": dtypes.get(h, "u32"),
                     "access": ("read_write" if h in g.writes else "read"),
                     "freed": h in freed} for h in order],
        "reads": sorted(g.reads), "writes": sorted(g.writes),
        "retained": len(g.retained),
        "retained_bytes": sum(slot.nbytes for slot in g.retained),
        "fallback_reason": g.fallback_reason,
    }


# -- conditional nodes while recording --------------------------------------------------------
def cond_begin(server, s, kind: str, hid: int, max_iterations, dtype: str = "i32") -> bool:
    """Open a ``capture_if``/``capture_while`` node in the window of ``s``; False when ``s``
    is not capturing (the client then runs it eagerly).

    Raises: ``InvalidHandle`` (unknown condition); ``ValueError`` (a while loop without
    ``max_iterations`` on a backend that unrolls loops, wgpu); ``UnsupportedError`` (the
    backend has no conditional nodes, e.g. cuda without CUDA 12.4 conditional nodes). Nothing
    changes when it raises.
    """
    w = s.window
    if w is None:
        return False
    st = server.handles.get(hid)
    if st is None:
        raise InvalidHandle(f"capture_{kind}: condition handle {hid} is unknown or freed on "
                            f"server {server.name}")
    be = server.backend
    if kind == "while" and max_iterations is None and getattr(be, "unrolls_loops", False):
        raise ValueError(f"capture_while on {be.name}: pass max_iterations= (the loop is "
                         "unrolled to it: one gated copy of the body per iteration)")
    node = CondRec(kind, len(cond_recs(w.ops)), hid, max_iterations, tuple(w.scopes), dtype)
    be.begin_cond(w.recording, kind, (st.slot.buf, st.nbytes), max_iterations)
    w.ops.append(node)
    w.scopes.append((node.index, "then" if kind == "if" else "body"))
    w.states[hid] = st
    w.reads.add(hid)
    if hid not in w.writes:
        w.inputs.add(hid)
    merge(w.fences, st.writes, s.id)
    return True


def cond_else(server, s) -> None:
    """Switch the innermost open ``capture_if`` node of ``s`` to its false branch."""
    w = s.window
    if w is None or not w.scopes or w.scopes[-1][1] != "then":
        raise CaptureRefused(f"capture_if on stream {s.id}: no open capture_if node to switch to "
                             "its false branch")
    idx = w.scopes[-1][0]
    server.backend.else_cond(w.recording)
    w.scopes[-1] = (idx, "else")
    w.ops.append(("else", idx))


def cond_end(server, s, error=None) -> None:
    """Close the innermost open node of ``s``. ``error``: the body raised it: the window is
    refused (``stop_capture`` raises ``CaptureRefused`` naming it)."""
    w = s.window
    if w is None or not w.scopes:
        return
    idx = w.scopes.pop()[0]
    server.backend.end_cond(w.recording)
    w.ops.append(("end", idx))
    if error is not None:
        w.refusals.append(f"the body of conditional node {idx} raised {error}")


# -- building a backend graph from ops ---------------------------------------------------------
def build(server, s, ops, lookup):
    """A backend graph on stream ``s`` from ``ops`` (every kernel compiled already); ``lookup``
    as :func:`_lookup`. Raises what the backend's graph verbs raise (the recording is
    dropped)."""
    be = server.backend

    def _resolve(_server, hid):
        return lookup(hid)
    rec = be.begin_graph(s.raw)
    try:
        for op in ops:
            if isinstance(op, LaunchRec):
                prog = server.programs[op.kernel]
                states = [_resolve(server, h) for h in op.hids]
                count = op.count
                if not isinstance(count, tuple):
                    cst = _resolve(server, count)
                    count = (cst.slot.buf, cst.nbytes)
                be.record_launch(rec, prog, count, [(st.slot.buf, st.nbytes) for st in states],
                                 op.params)
            elif isinstance(op, CondRec):
                cst = _resolve(server, op.cond)
                be.begin_cond(rec, op.kind, (cst.slot.buf, cst.nbytes), op.max_iterations)
            elif op[0] == "else":
                be.else_cond(rec)
            else:
                be.end_cond(rec)
        return be.end_graph(rec)
    except BaseException:
        be.abort_graph(rec)
        raise


def _window_of(lookup, ops, sid) -> Window:
    """A closed window describing ``ops`` (their sets, states and cross-stream fences);
    ``lookup(handle id) -> HandleState``."""
    _resolve = lookup
    w = Window(None, None, -1)
    w.ops = list(ops)
    for op in ops:
        if isinstance(op, LaunchRec):
            w.launches += 1
            for b, hid in zip(op.kernel.bindings, op.hids):
                st = _resolve(hid)
                w.states[hid] = st
                w.reads.add(hid)
                merge(w.fences, st.writes, sid)
                if b.access == "read":
                    w.inputs.add(hid)
                else:
                    w.writes.add(hid)
                    merge(w.fences, st.reads, sid)
            extra = [] if isinstance(op.count, tuple) else [op.count]
        elif isinstance(op, CondRec):
            extra = [op.cond]
        else:
            extra = []
        for hid in extra:
            st = _resolve(hid)
            w.states[hid] = st
            w.reads.add(hid)
            w.inputs.add(hid)
            merge(w.fences, st.writes, sid)
    w.inputs -= w.writes
    return w


# -- validation of update / instantiate --------------------------------------------------------
def _apply(server, g: GraphState, rebind, params, count) -> list:
    """The ops of ``g`` with ``rebind`` (``{old id: new id}``), ``params`` (``{index: {name:
    value}}``) and ``count`` (``{index: (x, y, z)}``) applied. Raises ``ValueError`` (nothing
    changed) for a handle the graph does not use, a size mismatch, an index out of range, an
    unknown param name or a bad value; ``InvalidHandle`` for a new handle the server lost."""
    used = used_ids(g.ops)
    for old, new in (rebind or {}).items():
        if old not in used:
            raise ValueError(f"rebind of graph {g.id}: handle {old} is not used by the graph "
                             f"(it uses {sorted(used)})")
        nst = server.handles.get(new)
        if nst is None:
            raise InvalidHandle(f"rebind of graph {g.id}: the new handle {new} is unknown or "
                                f"freed on server {server.name}")
        ost = next((st for st in g.handles if st.id == old), None)
        if ost is not None and ost.nbytes != nst.nbytes:
            raise ValueError(f"rebind of graph {g.id}: handle {old} holds {ost.nbytes} bytes, "
                             f"handle {new} {nst.nbytes}; a rebind must keep nbytes and dtype")
    recs = launch_recs(g.ops)
    n = len(recs)
    for what, table in (("params", params), ("count", count)):
        for i in (table or {}):
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                raise ValueError(f"update of graph {g.id}: {what} index {i!r} is out of range: "
                                 f"the graph has {n} launches (see Graph.launches())")
    new_params = {}
    for i, values in (params or {}).items():
        k = recs[i].kernel
        if not isinstance(values, dict):
            raise ValueError(f"update of graph {g.id}: params[{i}] must be a dict "
                             f"{{name: value}}, got {type(values).__name__}")
        unknown = sorted(set(values) - set(k.param_names))
        if unknown:
            raise ValueError(f"update of graph {g.id}: launch {i} ({k.name}) has no params "
                             f"{unknown}; it takes {list(k.param_names)}")
        merged = dict(zip(k.param_names, recs[i].params))
        merged.update(values)
        try:
            new_params[i] = k.pack_params(merged)
        except (TypeError, ValueError) as e:    # (the type of launch()'s own error)
            raise type(e)(f"update of graph {g.id}: launch {i}: {e}") from None
        if k.element_checks or k.product_checks:    # past a bound buffer: refused (h_launch)
            sizes = _nbytes(g, server)
            msg = k.elements_error(new_params[i], [sizes[h] for h in recs[i].hids], recs[i].hids)
            if msg is not None:
                raise ValueError(f"update of graph {g.id}: launch {i}: {msg}")
    new_counts = {}
    lim = server.backend.max_workgroups
    for i, c in (count or {}).items():
        try:
            c = normalize_count(c)
        except (TypeError, ValueError) as e:
            raise ValueError(f"update of graph {g.id}: count of launch {i}: {e}") from None
        if lim is not None and any(a > b for a, b in zip(c, lim)):
            raise ValueError(f"update of graph {g.id}: count {c} of launch {i} exceeds the "
                             f"{server.backend.name} limit of {lim} per dimension")
        new_counts[i] = c
    for i in set(new_params) | set(new_counts):     # a grid short of the work (h_launch)
        k, c = recs[i].kernel, new_counts.get(i, recs[i].count)
        if k.count_error is not None and type(c) is tuple and c[0] and c[1] and c[2]:
            msg = k.count_error(c, new_params.get(i, recs[i].params))
            if msg is not None:
                raise ValueError(f"update of graph {g.id}: launch {i}: {msg}")
    rb = rebind or {}
    out, li = [], 0
    for op in g.ops:
        if isinstance(op, LaunchRec):
            cnt = new_counts.get(li, op.count)
            if not isinstance(cnt, tuple):
                cnt = rb.get(cnt, cnt)
            out.append(op.replace(hids=tuple(rb.get(h, h) for h in op.hids), count=cnt,
                                  params=new_params.get(li, op.params)))
            li += 1
        elif isinstance(op, CondRec):
            out.append(op.replace(cond=rb.get(op.cond, op.cond)))
        else:
            out.append(op)
    for i, op in enumerate(launch_recs(out)):        # the launch rule, kept by a rebind
        written = {h for b, h in zip(op.kernel.bindings, op.hids) if b.access != "read"}
        for b, h in zip(op.kernel.bindings, op.hids):
            if b.access == "read" and h in written:
                raise ValueError(f"rebind of graph {g.id}: launch {i} ({op.kernel.name}) would "
                                 f"bind handle {h} to {b.name} (read) and to a read_write "
                                 "binding; aliasing a written buffer with a read binding is "
                                 "refused on every backend (the WebGPU rule)")
    return out


def _differ(a: tuple, b: tuple) -> bool:
    """Whether param tuples ``a`` and ``b`` differ as the kernel sees them: ``-0.0`` and
    ``0.0`` compare equal in Python but are different f32 params (``x * -0.0`` is ``-0.0``)."""
    return a != b or repr(a) != repr(b)


def _changes(server, old_ops, new_ops, lookup):
    """What a backend patch needs: ``({launch index: (program, count, args, params)},
    {node index: (buf, nbytes)})`` for the launches and conditions that changed."""

    def _resolve(_server, hid):
        return lookup(hid)
    changes, conds = {}, {}
    li = 0
    for a, b in zip(old_ops, new_ops):
        if isinstance(a, LaunchRec):
            if a.hids != b.hids or a.count != b.count or _differ(a.params, b.params):
                states = [_resolve(server, h) for h in b.hids]
                count = b.count
                if not isinstance(count, tuple):
                    cst = _resolve(server, count)
                    count = (cst.slot.buf, cst.nbytes)
                changes[li] = (server.programs[b.kernel], count,
                               [(st.slot.buf, st.nbytes) for st in states], b.params)
            li += 1
        elif isinstance(a, CondRec) and a.cond != b.cond:
            cst = _resolve(server, b.cond)
            conds[a.index] = (cst.slot.buf, cst.nbytes)
    return changes, conds


def _check_stream(server, s, what: str) -> None:
    server.capture.on_event(s, what)


# -- update ----------------------------------------------------------------------------------
def update(server, g: GraphState, rebind, params, count) -> None:
    """Apply ``Graph.update`` to ``g`` (see the module doc). All or nothing: validation and the
    backend patch (or rebuild) happen before any server state changes."""
    s = server.streams[g.stream]
    _check_stream(server, s, f"update of graph {g.id}")
    new_ops = _apply(server, g, rebind, params, count)
    changes, conds = _changes(server, g.ops, new_ops, _lookup(server, g))
    if not changes and not conds and not rebind:
        g.fallback_reason = None              # (says why the *last* update rebuilt the graph)
        return
    be = server.backend
    try:
        graph = be.update_graph(s.raw, g.graph, changes, conds) if (changes or conds) else g.graph
        reason = None
        if graph is None:                         # the backend cannot patch: rebuild from the ops
            graph = build(server, s, new_ops, _lookup(server, g))
            reason = getattr(be, "update_fallback_reason", None) or (
                f"{be.name}: the graph was rebuilt from its recording (the backend cannot patch "
                "an instantiated graph in place)")
        old_graph = g.graph
        _rebind_state(server, g, new_ops, s)
        g.fallback_reason = reason
        if graph is not old_graph:
            g.graph = graph
            if not server.capture.on_destroy(s, old_graph):
                be.destroy_graph(s.raw, old_graph)
        g.set_defer()                         # (the graph, patched or new, and its sets)
    except (ServerError, ValueError, TypeError):
        raise                                 # refused before anything changed (all or nothing)
    except BaseException:
        # interrupted half-way (an asynchronous exception: a signal handler's): the backend
        # graph and the server's read/write sets may disagree, so a replay could read a buffer
        # whose failure mark the sets do not see. The graph is destroyed (its replays raise
        # UnknownGraph), never replayed from a state nobody knows (ADV5)
        server.h_graph_destroy(g.id)
        raise


def _rebind_state(server, g: GraphState, new_ops, s) -> None:
    """Make ``g``'s sets, pins, liveness and fences follow ``new_ops``."""
    w = _window_of(_lookup(server, g), new_ops, g.stream)
    old_states = {st.id: st for st in g.handles}
    g.ops = new_ops
    g.reads, g.writes, g.inputs = frozenset(w.reads), frozenset(w.writes), frozenset(w.inputs)
    g.handles = list(w.states.values())
    g.wstates = [st for st in g.handles if st.id in g.writes]
    g.istates = [st for st in g.handles if st.id in g.inputs]
    g.sources = sources(new_ops, {st.id: st.nbytes for st in g.handles})
    g.sstates = [st for st in g.handles if st.id in g.sources]
    maybe = maybe_written(new_ops, {st.id: st.nbytes for st in g.handles})
    g.mstates = [st for st in g.wstates if st.id in maybe]
    new_ids = {st.id for st in g.handles}
    for hid, st in old_states.items():          # handles it no longer uses
        if hid not in new_ids and g in st.graphs:
            del st.graphs[g]
            merge(st.replayed, {g.stream: g.last_pos})
    for st in g.handles:
        if st.id not in old_states and g not in st.graphs:
            st.graphs[g] = None
    alloc_ids = {id(sl) for sl in g.alloc_slots}
    slots = {id(st.slot): st.slot for st in g.handles}
    for sl in g.alloc_slots:
        slots[id(sl)] = sl
    old_slots = {id(sl): sl for sl in g.retained}
    for key, sl in slots.items():
        if key not in old_slots:
            sl.pins += 1
    g.retained = list(slots.values())   # before the unpins: an interrupt leaks a pin, never two
    fence = {g.stream: s.pos}
    for key, sl in old_slots.items():
        if key not in slots:
            sl.pins -= 1
            if sl.orphan and sl.pins == 0:
                f = dict(sl.fences)
                merge(f, fence)
                server.pool.give(sl, f)
    g.required = frozenset() if g.retain else frozenset(
        st.id for st in g.handles if id(st.slot) not in alloc_ids)
    g.freed = [h for h in g.freed if h in new_ids]
    merge(g.fences, w.fences)
    g.launches = w.launches
    if server.checker is not None:
        server.checker.on_graph(g)


def _lookup(server, g: GraphState):
    """``lookup(handle id) -> HandleState``: a live handle, or one ``g`` uses whose handle was
    freed (its slot stays pinned by ``g``; liveness reports a caller-owned one at replay)."""
    known = {st.id: st for st in g.handles}
    handles = server.handles

    def lookup(hid):
        st = handles.get(hid) or known.get(hid)
        if st is None:
            raise InvalidHandle(f"handle {hid} is unknown or freed on server {server.name}")
        return st
    return lookup


# -- instantiate -----------------------------------------------------------------------------
def instantiate(server, g: GraphState, rebind, gid: int, stream_id=None) -> GraphState:
    """A new graph from ``g``'s ops with ``rebind`` applied, on ``stream_id`` (default: ``g``'s
    capture stream), with no warm-up and no capture.

    Buffers it does not rebind are shared with ``g`` (the window's own allocations stay pinned
    by both). Raises ``ValueError``/``InvalidHandle`` (nothing made; also for a freed
    caller-owned handle that is not rebound), ``CaptureRefused`` (that stream is capturing).
    """
    sid = g.stream if stream_id is None else stream_id
    s = server._stream(sid)
    _check_stream(server, s, f"instantiate of graph {g.id}")
    new_ops = _apply(server, g, rebind, None, None)
    freed = set(g.freed)
    for hid in used_ids(new_ops):
        if hid in freed:
            raise InvalidHandle(f"instantiate of graph {g.id}: handle {hid} it uses was freed; "
                                "rebind it to a live handle")
    lookup = _lookup(server, g)
    w = _window_of(lookup, new_ops, sid)
    graph = build(server, s, new_ops, lookup)
    ng = GraphState(gid, sid, graph, w, g.retain)
    owned = {st.id for st in g.handles} - set(g.required)    # buffers g itself retains
    ng.alloc_slots = [st.slot for st in ng.handles if st.id in owned]
    ng.required = frozenset() if g.retain else frozenset(
        st.id for st in ng.handles if st.id not in owned)
    for slot in ng.retained:
        slot.pins += 1
    for st in ng.handles:
        st.graphs[ng] = None
    return ng
