"""A KeyboardInterrupt landing anywhere in a call leaves no lock held (SOAK8).

CPython delivers an asynchronous exception (KeyboardInterrupt from a signal handler,
``PyThreadState_SetAsyncExc``) at a Python function's entry and right after a C function called
from Python returns. A ``with`` over a ``threading.Condition`` enters through the Condition's
Python-level ``__enter__``, which returns after its lock's C ``acquire``: an exception landing
there leaves the lock held for ever, with no ``with`` block to release it. SOAK8's soak found
the queue's room condition so orphaned by an interrupted ``write`` (every later write of the
server waited for it for ever: py-spy, ``DeviceQueue.submit`` -> ``Condition.__enter__``).

Each test interrupts one call at every such point in turn (``sys.setprofile``: every Python
function entry and every C function return, in every function the call runs on its thread),
then checks that the next use of the server completes with the right values (a server the
interrupt stopped: a fresh one), on a thread bounded by ``LIMIT_S`` so a hang fails the test.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import runtime
from runtime import kernels as K

LIMIT_S = 30.0
N = 16
MAX_POINTS = 400          # every point of the calls below (about 100 each), with room


def _interrupt_at(op, k: int) -> bool:
    """Run ``op()`` on a thread of its own with KeyboardInterrupt raised at its ``k``-th
    delivery point; returns whether the call got that far (bounded by ``LIMIT_S``)."""
    fired = []

    def profile(frame, event, arg):
        if event in ("call", "c_return") and not fired:
            count[0] += 1
            if count[0] == k:
                fired.append(event)
                sys.setprofile(None)
                raise KeyboardInterrupt
    count = [0]

    def work():
        sys.setprofile(profile)
        try:
            op()
        except (KeyboardInterrupt, runtime.ServerError):
            pass
        finally:
            sys.setprofile(None)
    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(LIMIT_S)
    assert not t.is_alive(), f"the call interrupted at point {k} hung"
    return bool(fired)


def _bounded(fn):
    box = []

    def work():
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - reported by the assertion
            box.append(e)
    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(LIMIT_S)
    assert not t.is_alive(), "the next call hung after the interruption"
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


class _Tenant:
    """A server of the test's own (fresh options), remade when an interrupt stopped it."""

    def __init__(self):
        self.make()

    def make(self):
        self.c = runtime.client("cpu", max_idle_bytes=(1 << 30) + 41)
        self.x = self.c.create(np.arange(N, dtype=np.float32))
        self.y = self.c.empty(N, np.float32)

    def next_use(self, op):
        """``op()`` again, then a launch and a read: right values, on a fresh server if the
        interrupt stopped this one."""
        def use():
            try:
                op()
                self.c.launch(K.add_scalar, 1, [self.x, self.y], {"alpha": 2.0, "n": N})
                return self.c.read(self.y)
            except runtime.ServerClosed:
                self.make()
                op()
                self.c.launch(K.add_scalar, 1, [self.x, self.y], {"alpha": 2.0, "n": N})
                return self.c.read(self.y)
        np.testing.assert_array_equal(_bounded(use), np.arange(N) + 2)


@pytest.mark.parametrize("what", ["write", "create"])
def test_a_keyboard_interrupt_landing_anywhere_in_a_write_leaves_no_lock_held(what):
    """Before: the interrupt landing in ``Condition.__enter__`` of the queue's room (a write
    counting its bytes) left the room's lock held and the next write hung."""
    t = _Tenant()
    data = np.ones(N, np.float32)

    def op():
        if what == "write":
            t.c.write(t.x, np.arange(N, dtype=np.float32))
        else:
            t.c.create(data)
    try:
        for k in range(1, MAX_POINTS):
            if not _interrupt_at(op, k):
                break
            t.next_use(op)
        assert k > 5, "the call ran no interruptible point"
    finally:
        runtime.shutdown()
