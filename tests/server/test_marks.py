"""Write marks (runtime.server.marks): a failure reaches every reader enqueued before it was
found, through chains of any length, and the chains shrink once their work is known to have
run (issue 17)."""

import numpy as np
import pytest

import runtime
from runtime import kernels as K
from runtime.errors import LaunchError, ReplayFailed
from runtime.server.marks import Mark


class _Stream:
    def __init__(self):
        self.done = 0


def _chain(n):
    s = _Stream()
    first = Mark(("launch", "first", 1), stream=s, pos=1)
    m = first
    for i in range(n):
        m = Mark(("launch", f"k{i}", 1), parents=((i, m),), stream=s, pos=i + 2)
    return s, first, m


def test_a_failure_found_late_reaches_the_end_of_a_long_chain_without_recursion():
    _, first, last = _chain(5000)
    assert last.error is None
    first.fail(LaunchError("found at execution"))
    err = last.error
    assert isinstance(err, LaunchError) and "it read handle 4999" in str(err)
    assert last.parents == ()                      # a failure is final: the chain is dropped


def test_resolving_drops_the_parents_whose_work_ran():
    s, first, last = _chain(50)
    done = lambda m: m.pos <= s.done               # noqa: E731
    assert last.resolve(done) is None and len(last.parents) == 1   # nothing known to have run
    s.done = 52                                    # a fence after all of it completed
    assert last.resolve(done) is None
    assert last.parents == () and last.final(done)


def test_after_an_unrelated_failure_resolving_walks_the_chain_and_prunes_it():
    s, first, last = _chain(50)
    Mark(("launch", "elsewhere", 2)).fail(LaunchError("an unrelated failure"))
    done = lambda m: m.pos <= s.done               # noqa: E731
    s.done = 30                                    # half of the chain ran
    assert last.resolve(done) is None and len(last.parents) == 1
    s.done = 52
    assert last.resolve(done) is None and last.parents == ()


def test_a_stream_of_dependent_launches_keeps_short_chains_once_synced():
    c = runtime.client("cpu", scheduler="interleave", seed=0)
    x = c.create(np.zeros(64, np.float32))
    y = c.empty(64, np.float32)
    for _ in range(300):                           # each launch reads the other's output
        c.launch(K.add_scalar, K.grid(64), [x, y], {"alpha": 1.0, "n": 64})
        c.launch(K.add_scalar, K.grid(64), [y, x], {"alpha": 1.0, "n": 64})
    np.testing.assert_array_equal(c.read(x), np.full(64, 600, np.float32))
    c.launch(K.add_scalar, K.grid(64), [x, y], {"alpha": 1.0, "n": 64})
    mark = c._server.handles[y.id].mark           # private: the server's mark is what is tested
    assert mark.parents == ()                      # x's writer is known to have run
    c.shutdown()


def test_a_launch_reading_a_buffer_whose_writer_failed_at_execution_is_marked():
    c = runtime.client("cpu", scheduler="interleave", seed=0)

    def cpu(x, y, *, count):
        raise ValueError("fails at execution")
    bad = runtime.Kernel("bad", [runtime.Binding("x", "f32", "read"),
                                 runtime.Binding("y", "f32", "read_write")], cpu=cpu)
    x, t = c.create(np.ones(64, np.float32)), c.empty(64, np.float32)
    y = c.empty(64, np.float32)
    c.launch(bad, 1, [x, t])                       # deferred: not run yet
    c.launch(K.add_scalar, K.grid(64), [t, y], {"alpha": 1.0, "n": 64})
    with pytest.raises(ReplayFailed, match="launch of bad") as info:
        c.read(y)
    assert isinstance(info.value, LaunchError)     # with the stream's own failure
    c.shutdown()


def test_the_server_keeps_no_read_result_alive():
    """The server learns that a stream ran up to a read from the read's completion, through a
    tick: not by keeping the completion, whose value is the caller's array."""
    import gc
    import weakref
    c = runtime.client("cpu", scheduler="interleave", seed=0)
    x = c.create(np.ones(1 << 16, np.float32))
    out = c.read(x)
    ref = weakref.ref(out.base if out.base is not None else out)
    del out
    gc.collect()
    assert ref() is None
    c.shutdown()
