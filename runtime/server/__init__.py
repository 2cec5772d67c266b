"""The device server: one per (backend, device), on its own thread, owning every table.

``get_server`` starts servers lazily; ``shutdown`` stops them (also at interpreter exit). A
process forked from one with servers starts without any: the inherited ones raise
``ServerForked`` there, and its first ``get_server`` starts a fresh one.
"""

from __future__ import annotations

import atexit
import importlib
import os
import threading

from .._fork import bind_missing_submodule
from ..backends.base import check_interface, check_probe
from .. import _threads
from ..errors import ServerClosed, UnsupportedError
from .._env import env_switch
from .server import ComputeServer

__all__ = ["ComputeServer", "get_server", "shutdown", "available_backends", "backend_unavailable",
           "BACKENDS", "register_backend"]

#: backend name -> (module, class name), imported only when first asked for (tinygrad style),
#: or a class given to :func:`register_backend`.
BACKENDS = {"cpu": ("runtime.backends.cpu", "CpuBackend"),
            "wgpu": ("runtime.backends.wgpu", "WgpuBackend"),
            "cuda": ("runtime.backends.cuda", "CudaBackend")}
#: the order ``backend=None`` tries: hardware first, the embedded default last.
PREFERENCE = ("cuda", "wgpu", "cpu")

_servers: dict = {}
_lock = threading.Lock()
#: name -> its ``probe()`` answer, or the reason it cannot run here (a str): the one cache behind
#: ``available_backends``, ``backend_unavailable`` and ``backend=None``.
_probes: dict = {}
#: submodules a probe may bind back before its failure is the answer (``_probed``)
MAX_REBINDS = 8


def backend_class(name: str):
    """The backend class for ``name``.

    Raises: ``ValueError`` (unknown name); ``UnsupportedError`` (its library is missing).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)} or None")
    entry = BACKENDS[name]
    if isinstance(entry, type):
        cls = entry
    else:
        mod_name, cls_name = entry
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            raise UnsupportedError(f"backend {name!r} is not available: {e}") from e
        cls = getattr(mod, cls_name)
    check_interface(cls)
    return cls


def register_backend(name: str, cls) -> None:
    """Make ``runtime.client(name)`` open ``cls`` (a ``runtime.backends.base.Backend`` subclass).

    Raises: ``TypeError`` naming what the class leaves unimplemented (``check_interface``: a
    verb, ``probe``, part of the graph verbs) or a ``probe()`` answer of the wrong shape;
    ``ValueError`` for a name that is not an identifier. Nothing is registered when it raises.
    ``probe()`` runs here; a backend whose device is missing (``UnsupportedError``) registers.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"backend name must be an identifier, got {name!r}")
    check_interface(cls)
    try:
        info = cls.probe()
    except UnsupportedError:
        info = None
    if info is not None:
        check_probe(cls, info)
    with _lock:
        BACKENDS[name] = cls
        _probes.pop(name, None)


def _probe(cls) -> dict:
    return check_probe(cls, cls.probe())


def _probed(name: str):
    """``name``'s probe answer or the reason it cannot run, probed once per process (a failure
    after an interrupted import is probed again once the package it left is repaired:
    ``runtime._fork.bind_missing_submodule``, at most :data:`MAX_REBINDS` times)."""
    got = _probes.get(name)
    if got is None:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)}")
        for _ in range(MAX_REBINDS + 1):
            try:
                got = _probe(backend_class(name))
                break
            except Exception as e:  # noqa: BLE001 - the reason is the answer
                got = f"{name} backend unavailable here: {type(e).__name__}: {e}"
                if not bind_missing_submodule(e):   # SOAK7: an interrupted import had left a
                    break                           # package without a submodule: once more
        _probes[name] = got
    return got


def backend_unavailable(name: str):
    """None when backend ``name`` can run here, else the reason it cannot (a str).

    "Can run" means its library imports and its ``probe()`` finds a device (cuda: a driver
    and a device; wgpu: an adapter, software ones included; cpu: always): the check
    ``runtime.client(name)`` makes before it opens a server (``UnsupportedError`` with this
    reason). Probed once per process (a backend
    registered again with ``register_backend`` is probed afresh); ``runtime.available_backends``
    and the ``runtime.testing`` fixtures ask this same function.

    Raises: ``ValueError`` for a name that is not a backend.
    """
    got = _probed(name)
    return got if isinstance(got, str) else None


def _usable_best(name: str) -> bool:
    """Whether ``backend=None`` should pick ``name``: it can run here, and (all but cpu) on a
    hardware device (software adapters are slower than numpy)."""
    if name == "cpu":
        return True
    got = _probed(name)
    return not isinstance(got, str) and bool(got["hardware"])


def available_backends() -> dict:
    """``{name: None, or the reason it cannot run here}`` for every registered backend: one
    :func:`backend_unavailable` answer per name (the same probe, the same cache)."""
    return {name: backend_unavailable(name) for name in list(BACKENDS)}


def resolve_backend(name):
    """``name``, or for ``None`` the ``RUNTIME_BACKEND`` variable, else the best available.

    Raises: ``ValueError`` when ``RUNTIME_BACKEND`` names no backend (the message names the
    variable: the caller passed no name)."""
    if name is None:
        name = os.environ.get("RUNTIME_BACKEND") or None
        if name is not None and name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r} in the RUNTIME_BACKEND environment "
                             f"variable; choose one of {sorted(BACKENDS)} or unset it")
    if name is None:
        for cand in PREFERENCE:
            if _usable_best(cand):
                return cand
    return name


def _option_key(options: dict) -> tuple:
    items = []
    for k, v in sorted(options.items()):
        items.append((k, v if isinstance(v, (int, float, str, bool, type(None))) else id(v)))
    return tuple(items)


def get_server(backend=None, device: int = 0, **options) -> ComputeServer:
    """The running server for ``(backend, device, options)``, started on first use.

    Options: ``check`` (bool, default from ``RUNTIME_CHECK``) turns on the stream-ordering
    checker; ``max_idle_bytes`` bounds the pool's idle bytes; the rest go to the backend
    (cpu: ``scheduler``, ``seed``). Servers with different
    options are different servers (each with its own device thread).

    Raises: ``ValueError`` (unknown backend, bad device index, ``max_idle_bytes`` not a number
        of bytes >= 0, ``RUNTIME_CHECK`` neither on nor off); ``UnsupportedError``.
    """
    name = resolve_backend(backend)
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise ValueError(f"device must be a non-negative int, got {device!r}")
    _check_max_idle(options.get("max_idle_bytes"))
    if "check" not in options and env_switch("RUNTIME_CHECK", False):
        options["check"] = True
    key = (name, device, _option_key(options))
    with _lock:
        srv = _servers.get(key)
        if srv is not None and not srv.closed:
            return srv
        why = backend_unavailable(name)       # probed once per process
        if why is not None:
            raise UnsupportedError(why)
        cls = backend_class(name)
        label = _label(name, device, options)
        check = bool(options.pop("check", False))
        max_idle = options.pop("max_idle_bytes", None)
        for k in [k for k, old in _servers.items() if old.closed]:
            del _servers[k]             # stopped servers (client.shutdown()): bounded by live ones
        _check_options(name, cls, options)
        be = srv = None
        try:
            be = _open(cls, device, options)
            srv = ComputeServer(be, label, check=check, max_idle_bytes=max_idle)
            _servers[key] = srv
        except BaseException:
            # (a bad max_idle_bytes, or an asynchronous exception landing anywhere in here,
            # SOAK7): no device thread or backend worker is left running for nobody
            if srv is not None:
                _servers.pop(key, None)
                srv.shutdown()
            elif be is not None:
                be.close()
            raise
        return srv


def _check_max_idle(v) -> None:
    """Refuse a ``max_idle_bytes`` that is not a number of bytes >= 0 (``None``: the default).

    Raises: ``ValueError`` naming it (``-5`` was taken as "keep nothing idle", silently)."""
    if v is None:
        return
    ok = not isinstance(v, (bool, str, bytes))
    if ok:
        try:
            ok = int(v) >= 0
        except (TypeError, ValueError, OverflowError):       # inf, nan, objects
            ok = False
    if not ok:
        raise ValueError(f"max_idle_bytes must be a number of bytes >= 0 (0: the pool keeps "
                         f"no idle buffer), got {v!r}")


def _open(cls, device: int, options: dict):
    """``cls(device, **options)``; on a thread of its own for a backend whose library starts
    threads of its own (``cls.foreign_threads``: wgpu-py's poll thread), SOAK7.

    On CPython 3.10/3.11 an asynchronous exception aimed at a thread that starts another can
    land in the new one, which dies before it runs, and ``Thread.start`` waits for ever
    (``runtime._threads``); our own starts have a way out, a library's do not: a
    KeyboardInterrupt aimed at a caller of ``runtime.client("wgpu")`` hung it inside wgpu-py's
    ``GPUDevice.__init__``, holding the server table's lock, so every later
    ``runtime.client()`` of the process hung too. On a private thread nobody aims at, the
    caller's wait is where such an exception lands (it propagates; a backend finished after
    it is closed). Raises what the constructor raises; ``ServerClosed`` when the thread does
    not start."""
    if not getattr(cls, "foreign_threads", False):
        return cls(device, **options)
    box: dict = {}
    done = _threads.Event()        # (SOAK8: an interrupted wait leaves no lock held)
    lock = threading.Lock()

    def build():
        try:
            box["backend"] = cls(device, **options)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        with lock:
            done.set()
            left = box.get("abandoned")
        if left and "backend" in box:
            box.pop("backend").close()
    t = threading.Thread(target=build, name="runtime-open-backend", daemon=True)
    try:                    # (the start too: the thread may run, and build, before it returns)
        if not _threads.start(t):
            raise ServerClosed(_threads.not_started(t.name))
        while not done.wait(0.05):
            pass
    except BaseException:
        with lock:
            box["abandoned"] = True
            be = box.pop("backend", None) if done.is_set() else None
        if be is not None:
            be.close()
        raise
    if "error" in box:
        raise box.pop("error")
    return box.pop("backend")


def _label(name: str, device: int, options: dict) -> str:
    """The server's name (its device thread's, its errors', its trace lane's):
    ``runtime-cpu:0``, with the options that make it another server than the default one,
    ``runtime-cpu:0 (check=True)``, so two servers of one device never read the same."""
    if not options:
        return f"runtime-{name}:{device}"
    shown = ", ".join(f"{k}={v!r}"[:40] for k, v in sorted(options.items()))
    return f"runtime-{name}:{device} ({shown})"


def _check_options(name: str, cls, options: dict) -> None:
    """A ``TypeError`` naming the options ``cls`` does not take and the ones it does (the
    constructor's own "unexpected keyword argument" names a class and one option only)."""
    import inspect
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return                          # (it checks them itself: the wgpu backend)
    takes = [p for p in params if p not in ("self", "device")]
    bad = sorted(k for k in options if k not in takes)
    if bad:
        raise TypeError(f"the {name} backend takes no option {', '.join(map(repr, bad))}: it "
                        f"takes {', '.join(t + '=' for t in takes) or 'none'} (and check=, "
                        "max_idle_bytes=, as every backend)")


def shutdown() -> None:
    """Stop every server (queued work runs first); clients then raise ``ServerClosed``."""
    servers: list = []
    try:
        with _lock:
            servers = list(_servers.items())
            _servers.clear()
        for _, srv in servers:
            srv.shutdown()
    except BaseException:
        # SOAK8: interrupted (an asynchronous exception): the servers not stopped yet stay
        # listed, so a later shutdown (or interpreter exit) stops them, never running for nobody
        with _lock:
            for key, srv in servers:
                if not srv.closed:
                    _servers.setdefault(key, srv)
        raise


def _after_fork_in_child() -> None:
    # the parent's servers are closed here (queue.py); the child's first runtime.client(...)
    # starts a fresh one. The table's lock may have been held by another thread at the fork.
    global _lock
    _lock = threading.Lock()
    _servers.clear()
    _probes.clear()     # probed again here: a device the parent opened may not be usable


atexit.register(shutdown)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
