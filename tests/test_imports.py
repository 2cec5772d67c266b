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
    ["runtime._fork", "runtime._threads", "runtime.errors", "runtime.kernel", "runtime.streams",
     "runtime.cpu_threads", "runtime._env"],
    ["runtime.kernels"],
    ["runtime.backends"],
    ["runtime.server"],
    ["runtime.frontend"],
    ["runtime.tensor", "runtime.captured", "runtime.static_graph"],
    ["runtime.models"],
    ["runtime", "runtime.serving", "runtime.corpus", "runtime.cluster", "runtime.bench",
     "runtime.testing", "runtime.__main__"],
]

#: Edges an owner is still removing, as ``(importer, imported)`` pairs (each owner deletes its
#: line when its fix lands). None left: the cpu thread-rule cycle (H4) and the bench report <->
#: suite cycle are gone.
KNOWN: set = set()


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


def edges(missing=None) -> list:
    """``[(importer, imported, line)]`` over every import statement in runtime/; imports of a
    ``runtime.*`` module that does not exist are appended to ``missing``."""
    mods = modules()
    out = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets, gone = [], []
            if isinstance(node, ast.Import):
                targets = [_resolve(a.name, mods) for a in node.names]
                gone = [a.name for a in node.names if a.name.startswith("runtime.") and
                        a.name not in mods]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module
                gone = [src] if src.split(".")[0] == "runtime" and src not in mods else []
                targets = [_resolve(f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src, mods)
                           for a in node.names]
            if gone and missing is not None:
                missing += [f"{name}:{node.lineno} {g}" for g in gone]
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


def test_every_import_names_a_module_that_exists():
    """A module renamed or moved (issue 29 item 2) leaves no import of its old path behind."""
    missing = []
    edges(missing)
    mods = set(modules()) | {".".join(d.relative_to(ROOT.parent).parts)   # namespace packages
                             for d in ROOT.rglob("*") if d.is_dir() and d.name != "__pycache__"}
    for folder in ("tests", "benchmarks", "examples"):
        for path in sorted((ROOT.parent / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
                missing += [f"{path.relative_to(ROOT.parent)}:{node.lineno} {n}" for n in names
                            if n and n.startswith("runtime.") and n not in mods]
    assert missing == []


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


def _bound_names(face: pathlib.Path) -> dict:
    """``{name: what binds it}`` for the top-level names a package face binds."""
    out = {}
    for node in ast.parse(face.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                is_module = node.level == 1 and node.module is None
                out[a.asname or a.name] = "module" if is_module and a.asname is None else "name"
        elif isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.partition(".")[0]] = "import"
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = "def"
        elif isinstance(node, ast.Assign):
            out.update({t.id: "assign" for t in node.targets if isinstance(t, ast.Name)})
    return out


def test_a_module_name_is_the_module():
    """``import runtime.x.y as m`` gives the module ``y``, never a function a package face
    binds under the same name (issue 29 item 2: ``runtime.capture``, ``runtime.client``,
    ``runtime.kernels.elementwise`` and ``runtime.bench.machine`` were functions)."""
    mods = modules()
    shadowed = []
    for name, path in mods.items():
        if path.name != "__init__.py":
            continue
        for bound, how in _bound_names(path).items():
            if f"{name}.{bound}" in mods and how != "module":
                shadowed.append(f"{name}.{bound} ({how})")
    assert shadowed == []
    # and at run time, for the faces users import
    import importlib
    import sys
    for name in ["runtime.captured", "runtime.frontend", "runtime.frontend.client",
                 "runtime.kernels.pointwise", "runtime.bench.results", "runtime.streams"]:
        module = importlib.import_module(name)
        parent, _, leaf = name.rpartition(".")
        assert getattr(sys.modules[parent], leaf) is module, name


def test_public_import_paths_still_work():
    """The paths README, docs/contract.md and the docstrings tell users to import from."""
    import runtime.bench
    import runtime.kernels
    import runtime.server
    import runtime.testing
    from runtime import ComputeClient, Graph, Handle, StreamId  # noqa: F401
    from runtime.errors import ServerError  # noqa: F401
    from runtime.kernels import WORKGROUP, elementwise, grid  # noqa: F401
    from runtime.testing import programs, run_program  # noqa: F401
    for name in runtime.__all__:
        assert getattr(runtime, name) is not None
    assert callable(runtime.client) and callable(runtime.capture)
    assert callable(runtime.bench.machine) and callable(runtime.bench.write_json)
    assert callable(runtime.server.register_backend)
    assert runtime.StreamId is runtime.streams.StreamId
