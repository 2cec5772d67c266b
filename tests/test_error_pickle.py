"""Errors raised to callers survive pickling (issue 23 item 3): they cross process pools and
Ray, so a copy unpickled in another process keeps its classes (a combined ``ServerUnhealthy``
included), its message and its attributes."""

import pickle
import subprocess
import sys

import numpy as np
import pytest

import runtime
import runtime.errors as E


def _errors():
    out = [getattr(E, n)(f"message of {n}") for n in E.__all__
           if isinstance(getattr(E, n), type) and issubclass(getattr(E, n), E.ServerError)
           and getattr(E, n) is not E.ServerUnhealthy]
    stale = E.ReplayFailed("read of handle 3: stale", E.LaunchError("kernel k raised"))
    race = E.StreamRaceError("a race")
    race.handle, race.streams, race.ops = 3, (1, 2), ("write", "read")
    out += [stale, race, E.ServerUnhealthy([E.LaunchError("x")]),
            E.unhealthy([stale, E.LaunchError("y"), E.InvalidHandle("z")]),
            E.unhealthy([E.CaptureRefused("refused"), E.OutOfMemory("oom")])]
    return out


def _describe(e) -> tuple:
    return (type(e).__name__, tuple(c.__name__ for c in type(e).__mro__), str(e),
            sorted((k, repr(v)) for k, v in e.__dict__.items()))


def test_every_error_round_trips_in_this_process():
    for e in _errors():
        assert _describe(pickle.loads(pickle.dumps(e))) == _describe(e)


def test_every_error_round_trips_in_another_process():
    errs = _errors()
    code = ("import pickle, sys\n"
            "errs = pickle.loads(sys.stdin.buffer.read())\n"
            "print(repr([(type(e).__name__, tuple(c.__name__ for c in type(e).__mro__), str(e),"
            " sorted((k, repr(v)) for k, v in e.__dict__.items())) for e in errs]))\n")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(errs),
                         capture_output=True, check=True, timeout=120).stdout.decode()
    assert out.strip() == repr([_describe(e) for e in errs])


def test_a_drained_kernel_failure_round_trips():
    """What a caller actually catches: a read of a marked buffer with the stream's failure."""
    c = runtime.client("cpu", scheduler="interleave", seed=0)

    def cpu(y, *, count):
        raise KeyError("a body raising anything")
    bad = runtime.Kernel("bad", [runtime.Binding("y", "f32", "read_write")], cpu=cpu)
    y = c.create(np.zeros(4, np.float32))
    c.launch(bad, 1, [y])
    with pytest.raises(E.ReplayFailed) as info:
        c.read(y)
    err = info.value
    assert isinstance(err, E.LaunchError)         # typed, with the stream's own failure
    copy = pickle.loads(pickle.dumps(err))
    assert isinstance(copy, E.ReplayFailed) and isinstance(copy, E.LaunchError)
    assert str(copy) == str(err) and "KeyError" in str(copy)
    c.shutdown()


def test_a_kernel_body_raising_systemexit_is_a_typed_error_and_the_server_goes_on():
    c = runtime.client("cpu")

    def cpu(y, *, count):
        raise SystemExit("a body calling sys.exit")
    bad = runtime.Kernel("exits", [runtime.Binding("y", "f32", "read_write")], cpu=cpu)
    y, z = c.create(np.zeros(4, np.float32)), c.create(np.ones(4, np.float32))
    c.launch(bad, 1, [y])
    with pytest.raises(E.LaunchError, match="exits.*SystemExit"):
        c.sync()
    with pytest.raises(E.ReplayFailed):
        c.read(y)
    np.testing.assert_array_equal(c.read(z), np.ones(4, np.float32))
    c.shutdown()
