"""Every public name has a docstring (wgpu-py's tests/test_api.py does the same)."""

import inspect

import runtime
import runtime.testing
import runtime.testing.plugin


def public_objects():
    names = [(runtime, n) for n in runtime.__all__] + [(runtime.testing, n) for n in
                                                        runtime.testing.__all__]
    names += [(runtime.testing.plugin, n) for n in dir(runtime.testing.plugin)
              if n.startswith(("pytest_", "runtime_")) or n in ("Variant", "variants")]
    for mod, name in names:
        obj = getattr(mod, name)
        if inspect.ismodule(obj):
            continue
        yield name, obj
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if inspect.isfunction(member) or isinstance(member, (property, classmethod, staticmethod)):
                    yield f"{name}.{attr}", member


def test_every_public_name_has_a_docstring():
    missing = []
    for name, obj in public_objects():
        target = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
        doc = inspect.getdoc(target.fget if isinstance(target, property) else target)
        if not doc or len(doc) < 10:
            missing.append(name)
    assert not missing, f"public names without a docstring: {missing}"


def test_every_backend_implements_the_whole_interface():
    from runtime.backends.base import check_interface
    from runtime.server import BACKENDS, backend_class
    for name in BACKENDS:
        try:
            cls = backend_class(name)         # runs check_interface at import
        except runtime.UnsupportedError:
            continue
        check_interface(cls)
