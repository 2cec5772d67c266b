"""Imports point down and never in a cycle (issue 29 item 1; GUIDE "imports point down").

Walks every ``import`` statement of every module under ``runtime/`` with ``ast`` (function-level
and ``TYPE_CHECKING`` ones included: a deferred import is still a dependency), resolves each to
the runtime module it names, and checks the graph: no cycle, and no edge from a lower layer to a
higher one (``LAYERS``). Importing ``a.b.c`` also runs the package faces ``a.b``, so those count
as edges too (all but the root ``runtime`` face, which every module's import runs first).
"""

import ast
import collections
import pathlib

import runtime

ROOT = pathlib.Path(runtime.__file__).resolve().parent

#: lowest first; a module may import its own layer or one below, never one above. A name is a
#: module or a package (everything under it).
LAYERS = [
    ["runtime.errors", "runtime.kernel", "runtime.streams"],
    ["runtime.kernels"],
    ["runtime.backends"],
    ["runtime.server"],
    ["runtime.client"],
    ["runtime.tensor", "runtime.capture", "runtime.static_graph"],
    ["runtime.models"],
    ["runtime", "runtime.serving", "runtime.corpus", "runtime.cluster", "runtime.bench",
     "runtime.testing", "runtime.demo", "runtime.__main__"],
]

#: Edges the owners are removing (each owner deletes its line when it lands; the goal is none):
#: H4 moves the cpu thread rule into a leaf module (issue 30 / issue 24 item 5).
KNOWN = {
    ("runtime.kernels.threads", "runtime.backends.cpu"),
    ("runtime.backends.cpu", "runtime.kernels.threads"),
    # H8 (issue 29 item 1) after H7's suite rework: each section owns its renderer.
    ("runtime.bench.report", "runtime.bench.suite"),
}


def modules() -> dict:
    """``{dotted name: path}`` for every module under runtime/ (packages by their face)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, mods: dict):
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _with_faces(target: str, importer: str, mods: dict) -> list:
    """``target`` and the package faces above it that importing it runs (not the root face, nor
    the importer's own packages, which are running already)."""
    out = [target]
    parts = target.split(".")
    for i in range(2, len(parts)):
        face = ".".join(parts[:i])
        if face in mods and not (importer == face or importer.startswith(face + ".")):
            out.append(face)
    return out


def edges() -> list:
    """``[(importer, imported, line)]`` over every import statement in runtime/."""
    mods = modules()
    out = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_resolve(a.name, mods) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module
                targets = [_resolve(f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src, mods)
                           for a in node.names]
            for t in targets:
                if t is None or t == name:
                    continue
                out += [(name, face, node.lineno) for face in _with_faces(t, name, mods)]
    return out


def layer(name: str) -> int:
    best, rank = -1, None
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{name} is in no layer: add it to LAYERS"
    return rank


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1
                    stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_walk_sees_function_level_and_relative_imports():
    found = {(a, b) for a, b, _ in edges()}
    # server/__init__.py imports backends.base at module level, relative
    assert ("runtime.server", "runtime.backends.base") in found
    # the server imports its checker inside a method
    assert ("runtime.server.server", "runtime.server.checker") in found
    assert len(modules()) > 50


def test_no_import_cycles():
    graph = collections.defaultdict(set)
    for a, b, _ in edges():
        if (a, b) not in KNOWN:
            graph[a].add(b)
    for name in modules():
        graph[name]
    assert cycles(graph) == []


def test_imports_point_down():
    up = sorted({f"{a}:{line} -> {b}" for a, b, line in edges()
                 if layer(b) > layer(a) and (a, b) not in KNOWN})
    assert up == [], "imports from a lower layer to a higher one:\n" + "\n".join(up)


def test_known_exceptions_still_exist():
    """Each owner deletes its line from ``KNOWN`` when its fix lands; this fails until then."""
    found = {(a, b) for a, b, _ in edges()}
    assert KNOWN <= found, f"fixed, remove from KNOWN: {sorted(KNOWN - found)}"
