"""Every public name has a docstring, and one that says the errors it raises (wgpu-py's
tests/test_api.py does the same): the faces of ``runtime``, ``runtime.testing`` (and its pytest
plugin), ``runtime.bench``, ``runtime.kernels`` and ``runtime.serving`` (issue 29 item 5)."""

import ast
import importlib
import inspect
import pathlib
import textwrap

import runtime
import runtime.testing.plugin

PACKAGES = ["runtime", "runtime.testing", "runtime.bench", "runtime.kernels", "runtime.serving"]


def public_objects():
    """``(dotted name, object)`` for every public name of ``PACKAGES`` and the plugin, and the
    public methods and properties of every public class."""
    names = []
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        names += [(pkg, mod, n) for n in mod.__all__]
    plugin = runtime.testing.plugin
    names += [("runtime.testing.plugin", plugin, n) for n in dir(plugin)
              if n.startswith(("pytest_", "runtime_")) or n in ("Variant", "variants")]
    for pkg, mod, name in names:
        obj = getattr(mod, name)
        if inspect.ismodule(obj) or not (callable(obj) or inspect.isclass(obj)):
            continue                      # constants and kernels: see the kernel test below
        yield f"{pkg}.{name}", obj
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if inspect.isfunction(member) or isinstance(member, (property, classmethod, staticmethod)):
                    yield f"{pkg}.{name}.{attr}", member


def _function(obj):
    obj = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
    return obj.fget if isinstance(obj, property) else obj


def _raises(fn) -> bool:
    """Whether ``fn``'s own body has a ``raise X`` (a bare re-raise does not count)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError):
        return False
    return any(isinstance(n, ast.Raise) and n.exc is not None for n in ast.walk(tree))


def test_the_walk_covers_the_five_faces():
    names = {n for n, _ in public_objects()}
    for probe in ("runtime.client", "runtime.Event", "runtime.testing.programs",
                  "runtime.bench.compare", "runtime.kernels.grid",
                  "runtime.serving.Batcher.submit"):
        assert probe in names


def test_every_public_name_has_a_docstring():
    missing = []
    for name, obj in public_objects():
        doc = inspect.getdoc(_function(obj))
        if not doc or len(doc) < 10:
            missing.append(name)
    assert not missing, f"public names without a docstring: {missing}"


def test_every_public_function_that_raises_says_what_it_raises():
    """A public function or method whose body raises names its errors in its docstring
    (``Raises:`` or a sentence with "raise"); a class, its ``__init__``'s."""
    silent = []
    for name, obj in public_objects():
        fn = _function(obj)
        if inspect.isclass(fn):
            init = vars(fn).get("__init__")
            if inspect.isfunction(init) and _raises(init):
                docs = (inspect.getdoc(fn) or "") + (inspect.getdoc(init) or "")
                if "raise" not in docs.lower():
                    silent.append(name)
        elif inspect.isfunction(fn) and _raises(fn):
            if "raise" not in (inspect.getdoc(fn) or "").lower():
                silent.append(name)
    assert not silent, f"public names that raise without saying what: {silent}"


def test_every_kernel_of_the_library_has_a_doc_comment():
    """``runtime.kernels``' kernels are objects: each has a ``#:`` comment above its
    definition saying what it computes, over which shapes, and how to launch it."""
    import runtime.kernels as K
    folder = pathlib.Path(K.__file__).parent
    documented = set()
    for path in folder.glob("*.py"):
        lines = path.read_text().splitlines()
        for k, line in enumerate(lines):
            head = line.split("=")[0].strip()
            if "=" in line and head.isidentifier() and k and lines[k - 1].startswith("#:"):
                documented.add(head)
    kernels = [n for n in K.__all__ if isinstance(getattr(K, n), runtime.Kernel)]
    assert len(kernels) > 15
    assert sorted(set(kernels) - documented) == []


def test_every_backend_implements_the_whole_interface():
    from runtime.backends.base import check_interface
    from runtime.server import BACKENDS, backend_class
    for name in BACKENDS:
        try:
            cls = backend_class(name)         # runs check_interface at import
        except runtime.UnsupportedError:
            continue
        check_interface(cls)
