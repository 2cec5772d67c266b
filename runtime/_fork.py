"""Repairs a forked child needs before it can import or compile: imported first by ``runtime``.

Only the forking thread comes along into a child (``os.fork()``, ``multiprocessing``'s ``fork``
start method, gunicorn ``--preload``). A lock another thread held at the fork stays held forever
there. Two such locks are taken by the runtime's own background threads (the cpu stream workers,
the device thread) the first time work runs: Python's per-module import lock, while a worker
imports a module on first use (``threadpoolctl`` at the first stream item, ``numba`` with
``runtime.kernels.cpu_loops`` at the first nn kernel), and numba's compiler lock while a worker
compiles (or loads from the cache) a loop. A fork while work is pending in a fresh process then
made the child hang at its first use of that module or of numba (issue 24 item 4's kind).

Before the fork, :func:`_before_fork` waits for a compile, or a start of numba's threading layer,
another thread has in progress (its half-built numba and LLVM state would be copied into the
child; the layer's start-up locks would stay held there). In the child,
:func:`forget_imports_of_other_threads` drops every import another thread had in
progress (the module, half initialised, leaves ``sys.modules`` with its lock; the child imports
it afresh when it needs it), :func:`free_numba_compiler_lock` replaces numba's compiler lock and
llvmlite's LLVM lock when another thread held them (a compile that outlasted that wait), and
:func:`renew_locks` replaces the locks of objects that outlive a fork (:func:`lock_for`: a
``StaticGraph``, a ``CapturedGraph``, a model, a graph's owner), so calling a parent's object
raises ``ServerForked`` instead of waiting for a parent thread's call. Registered before the
runtime's other fork handlers (which may import).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref


def forget_imports_of_other_threads() -> list:
    """(in a forked child) Forget the imports other threads had in progress at the fork: their
    module locks are held by threads that do not exist here, so importing the module would wait
    forever. Returns the module names dropped. An import the forking thread itself has in
    progress (a fork at a module's top level) is left alone."""
    bs = sys.modules.get("_frozen_importlib") or sys.modules.get("importlib._bootstrap")
    locks = getattr(bs, "_module_locks", None)
    if not locks:
        return []
    me = threading.get_ident()
    dropped = []
    for name, ref in list(locks.items()):
        try:
            lock = ref() if callable(ref) else ref
        except Exception:  # noqa: BLE001 - an interpreter's own layout: leave it
            continue
        owner = getattr(lock, "owner", None)
        if owner is None or owner == me:
            continue
        locks.pop(name, None)
        mod = sys.modules.get(name)
        if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False):
            dropped.append(name)        # half initialised: imported afresh on first use here
    if dropped:                         # with its submodules: a package imported again binds
        prefixes = tuple(n + "." for n in dropped)      # them as attributes only when it
        for name in [n for n in sys.modules if n in dropped or n.startswith(prefixes)]:
            del sys.modules[name]                       # imports them itself
    return dropped


def bind_missing_submodule(exc: BaseException) -> bool:
    """Repair what ``exc`` says an interrupted import left: True when an ``AttributeError`` in
    its chain is ``module 'a' has no attribute 'b'`` while module ``a.b`` is loaded, after
    binding it as attribute ``b`` of ``a``.

    An import interrupted by an asynchronous exception (KeyboardInterrupt, a signal handler's,
    ``PyThreadState_SetAsyncExc``) leaves the submodules it had finished in ``sys.modules``
    while the package that was importing them is dropped; the package imported again finds
    them there and does not bind them (a package binds a submodule as an attribute only when
    it loads it), so ``pycparser.c_ast`` and the like raised ``AttributeError`` for the rest
    of the process (SOAK7: the wgpu backend was then "unavailable here" for good). A module
    in ``sys.modules`` ran to its end (a failed one is removed), so binding it is what the
    import would have done.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        pkg, name = getattr(exc, "obj", None), getattr(exc, "name", None)
        if isinstance(exc, AttributeError) and isinstance(name, str) and \
                type(pkg).__name__ == "module":
            full = f"{getattr(pkg, '__name__', '')}.{name}"
            mod = sys.modules.get(full)
            if mod is not None and sys.modules.get(pkg.__name__) is pkg and \
                    not hasattr(pkg, name):
                setattr(pkg, name, mod)
                return True
        exc = exc.__cause__ or exc.__context__
    return False


def _held_elsewhere(lock) -> bool:
    """Whether re-entrant ``lock`` is held by a thread other than this one."""
    if lock.acquire(False):
        lock.release()
        return False
    return True


def free_numba_compiler_lock() -> bool:
    """(in a forked child) Replace numba's global compiler lock, llvmlite's LLVM lock and
    numba's threading-layer start-up locks when a thread that did not come along held them (a
    compile or a start-up still in progress after the fork's wait, :func:`_before_fork`): the
    child's first compile (first parallel loop) would wait for them forever.
    Returns whether one was replaced."""
    replaced = False
    cl = sys.modules.get("numba.core.compiler_lock")
    holder = getattr(cl, "global_compiler_lock", None)
    lk = getattr(holder, "_lock", None)
    if lk is not None and _held_elsewhere(lk):
        holder._lock = threading.RLock()
        replaced = True
    ffi = sys.modules.get("llvmlite.binding.ffi")
    holder = getattr(getattr(ffi, "lib", None), "_lock", None)     # llvmlite's _LLVMLock
    lk = getattr(holder, "_lock", None)
    if lk is not None and _held_elsewhere(lk):
        holder._lock = threading.RLock()
        replaced = True
    par = sys.modules.get("numba.np.ufunc.parallel")       # the threading layer's start-up
    for name in ("_backend_init_process_lock", "_backend_init_thread_lock"):   # (SOAK9)
        lk = getattr(par, name, None)
        if hasattr(lk, "acquire") and hasattr(lk, "release") and _held_elsewhere(lk):
            setattr(par, name, threading.RLock())
            replaced = True
    return replaced


#: seconds a fork waits for a compile another thread has in progress (:func:`_before_fork`)
FORK_WAIT_S = 60.0
_held: list = []            # the compile locks the forking thread took for the fork


def _compile_locks() -> list:
    """numba's compiler lock and llvmlite's library lock (the order numba takes them in), then
    numba's threading-layer start-up locks (the process lock, then the thread lock:
    ``numba.np.ufunc.parallel._launch_threads``' order; a parallel compile takes them under
    the compiler lock), those of the modules imported so far.

    The start-up locks (SOAK9): a fork while another thread started numba's threading layer
    (the first nn kernel of the process importing ``runtime.kernels.cpu_loops``) left them held
    in the child, whose own first nn kernel then waited for ever in ``_set_init_process_lock``
    (forks9 soak, two matmul threads and a fork: 2 of ~30 children); a start-up finishing
    first is also never copied half done."""
    cl = sys.modules.get("numba.core.compiler_lock")
    ffi = sys.modules.get("llvmlite.binding.ffi")
    par = sys.modules.get("numba.np.ufunc.parallel")
    locks = [getattr(getattr(cl, "global_compiler_lock", None), "_lock", None),
             getattr(getattr(getattr(ffi, "lib", None), "_lock", None), "_lock", None),
             getattr(par, "_backend_init_process_lock", None),
             getattr(par, "_backend_init_thread_lock", None)]
    return [lk for lk in locks if hasattr(lk, "acquire") and hasattr(lk, "release")]


def _before_fork() -> None:
    """(in the parent, before a fork) Wait for a compile another thread has in progress (a cpu
    worker compiling, or loading from numba's cache, a kernel's loops): its half-built state of
    numba and LLVM would be copied into the child, whose own first compile then hung inside
    LLVM (``ExecutionEngine.add_module``) even with numba's lock replaced there. The forking
    thread takes the locks (at most :data:`FORK_WAIT_S` each; past that the fork goes on and
    the child relies on :func:`free_numba_compiler_lock`), and both sides release them after."""
    for lk in _compile_locks():
        if not lk.acquire(timeout=FORK_WAIT_S):
            break
        _held.append(lk)


def _release_held() -> None:
    while _held:
        _held.pop().release()


#: objects whose locks a forked child makes afresh: ``{object: {attribute: factory}}``
_renewed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def lock_for(obj, attr: str = "_lock", factory=threading.RLock):
    """Set ``obj.<attr>`` to a new lock (``factory()``) that a forked child gets afresh, and
    return it: for objects that outlive a fork (a ``StaticGraph``, a ``CapturedGraph``, a model,
    a graph's owner) and serialise calls with a lock. A parent thread inside such a call at the
    fork (a serving loop) held the lock for ever in the child, so the child's call hung there
    instead of raising ``ServerForked`` from the server it cannot use (found by ADV2). The lock
    stays a plain ``threading`` lock (no cost per acquire); the child's fork handler replaces
    it (the forking thread's own hold, if any, is lost: the child never unwinds into it)."""
    lock = factory()
    setattr(obj, attr, lock)
    _renewed.setdefault(obj, {})[attr] = factory
    return lock


def renew_locks() -> int:
    """(in a forked child) Replace every lock made by :func:`lock_for`; returns how many."""
    n = 0
    for obj, attrs in list(_renewed.items()):
        for attr, factory in attrs.items():
            setattr(obj, attr, factory())
            n += 1
    return n


def _after_fork_in_child() -> None:
    _release_held()                     # the forking thread is this child's thread: its own
    forget_imports_of_other_threads()
    free_numba_compiler_lock()
    renew_locks()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_release_held,
                        after_in_child=_after_fork_in_child)
