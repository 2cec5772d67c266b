"""``str(graph)`` and ``graph.to_dot()``: the plain data of ``Graph.describe()`` as text.

Both use buffer labels (``b0, b1, ...`` in first-use order), never handle or graph ids in the
body, so the same recording prints the same on every backend. Pure functions of the dict.
"""

from __future__ import annotations


#: a binding's access as str(graph) prints it (the kernel's declaration: ``Binding.access``)
_ACCESS = {"read": "r", "write": "w", "read_write": "rw"}


def _plural(n: int, one: str, many: str) -> str:
    """``"1 launch"``, ``"2 launches"``."""
    return f"{n} {one if n == 1 else many}"


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _count(c) -> str:
    if isinstance(c, dict):
        return f"indirect {c.get('buffer', c['indirect'])}"
    return "x".join(str(v) for v in c)


def _scope(scope) -> str:
    return "/".join(f"n{i}.{b}" for i, b in scope) or "-"


def _size(n) -> str:
    return "?" if n is None else f"{n} B"


def table(d: dict) -> str:
    """A short table: a header line, one row per launch (index, scope, kernel, count, params,
    bindings as ``name=buffer:access``, ``r``/``w``/``rw`` as the kernel declares it), the
    conditional nodes, the buffers.

    Args: ``d``: ``Graph.describe()``'s dict.
    """
    kind = "hardware" if d["hardware"] else "software"
    lines = [f"Graph {d['id']} ({d['backend']}, {kind}, stream {d['stream']}): "
             f"{_plural(len(d['launches']), 'launch', 'launches')}, "
             f"{_plural(len(d['nodes']), 'conditional node', 'conditional nodes')}, "
             f"{_plural(d['retained'], 'buffer', 'buffers')} pinned ({d['retained_bytes']} B)"]
    rows = [("#", "scope", "kernel", "count", "params", "bindings")]
    for ln in d["launches"]:
        params = " ".join(f"{k}={_fmt(v)}" for k, v in ln["params"].items()) or "-"
        binds = " ".join(f"{b['name']}={b['buffer']}:{_ACCESS.get(b['access'], b['access'])}"
                         for b in ln["bindings"])
        rows.append((str(ln["index"]), _scope(ln["scope"]), ln["kernel"], _count(ln["count"]),
                     params, binds))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for n in d["nodes"]:
        lim = "" if n["max_iterations"] is None else f", max_iterations={n['max_iterations']}"
        lines.append(f"  node n{n['index']}: {n['kind']} {n['cond_buffer']} != 0{lim} "
                     f"(in {_scope(n['scope'])})")
    if d["buffers"]:
        lines.append("  buffers: " + ", ".join(
            f"{b['buffer']} {_size(b['nbytes'])} {b['dtype']} "
            f"{'written' if b['access'] != 'read' else 'read'}" for b in d["buffers"]))
    if d.get("fallback_reason"):
        lines.append(f"  fallback: {d['fallback_reason']}")
    return "\n".join(lines)


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(d: dict) -> str:
    """Graphviz DOT: launches as boxes ``L<i>``, data dependencies as edges labelled with the
    buffer, buffers first read from outside as ellipses, conditional nodes as clusters.

    Args: ``d``: ``Graph.describe()``'s dict.
    """
    out = ["digraph graph {", "  rankdir=TB;", '  node [shape=box, fontname="monospace"];']
    bufs = {b["buffer"]: b for b in d["buffers"]}
    nodes = {n["index"]: n for n in d["nodes"]}
    clusters: dict = {}       # scope tuple -> list of member lines
    sources: list = []
    last_writer: dict = {}
    edges: list = []

    def member(scope, line):
        clusters.setdefault(tuple(map(tuple, scope)), []).append(line)

    for n in d["nodes"]:
        member(n["scope"], f"N{n['index']} [shape=diamond, "
                           f"label={_q(n['kind'] + ' ' + n['cond_buffer'])}];")
        cb = n["cond_buffer"]
        if cb in last_writer:
            edges.append((last_writer[cb], f"N{n['index']}", cb))
        else:
            if cb not in sources:
                sources.append(cb)
            edges.append((cb, f"N{n['index']}", ""))
    for ln in d["launches"]:
        lid = f"L{ln['index']}"
        params = "\\n".join(f"{k}={_fmt(v)}" for k, v in ln["params"].items())
        label = f"{ln['index']}: {ln['kernel']}\\n{_count(ln['count'])}" + (
            f"\\n{params}" if params else "")
        member(ln["scope"], f"{lid} [label=\"{label}\"];")
        if ln["scope"]:
            idx, branch = ln["scope"][-1]
            edges.append((f"N{idx}", lid, branch if nodes[idx]["kind"] == "if" else ""))
        for b in ln["bindings"]:
            buf = b["buffer"]
            if b["access"] == "read" or buf in last_writer:
                if buf in last_writer:
                    if last_writer[buf] != lid:
                        edges.append((last_writer[buf], lid, buf))
                elif b["access"] == "read":
                    if buf not in sources:
                        sources.append(buf)
                    edges.append((buf, lid, ""))
        for b in ln["bindings"]:
            if b["access"] != "read":
                last_writer[b["buffer"]] = lid
    for buf in sources:
        b = bufs[buf]
        out.append(f"  {buf} [shape=ellipse, label=\"{buf}\\n{_size(b['nbytes'])} {b['dtype']}\"];")

    def emit(scope, depth):
        for line in clusters.get(scope, []):
            out.append("  " * depth + line)
        for key in sorted(k for k in clusters if len(k) == len(scope) + 1 and k[:-1] == scope):
            idx, branch = key[-1]
            n = nodes[idx]
            lim = "" if n["max_iterations"] is None else f" (max {n['max_iterations']})"
            out.append("  " * depth + f"subgraph cluster_n{idx}_{branch} {{")
            out.append("  " * (depth + 1) + f"label={_q(n['kind'] + ' ' + n['cond_buffer'] + ' ' + branch + lim)};")
            emit(key, depth + 1)
            out.append("  " * depth + "}")
    emit((), 1)
    for a, b, label in edges:
        out.append(f"  {a} -> {b}" + (f" [label={_q(label)}];" if label else ";"))
    for ln in d["launches"]:
        for b in ln["bindings"]:
            if b["access"] != "read" and last_writer.get(b["buffer"]) == f"L{ln['index']}":
                buf = b["buffer"]
                out.append(f"  L{ln['index']} -> {buf}_out [label={_q(buf)}];")
                out.append(f"  {buf}_out [shape=ellipse, label=\"{buf}\\n{_size(bufs[buf]['nbytes'])} "
                           f"{bufs[buf]['dtype']}\"];")
    out.append("}")
    return "\n".join(out)
