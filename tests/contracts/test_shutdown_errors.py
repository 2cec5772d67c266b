"""No error is dropped by a shutdown (issue 23 item 3): the errors still queued when the server
closes go, once, to the next blocking call, with its ``ServerClosed``."""

import time

import numpy as np
import pytest

import runtime
from runtime.errors import LaunchError, ServerClosed


def test_an_error_queued_at_shutdown_is_raised_with_the_next_server_closed():
    c = runtime.client("cpu", scheduler="thread", seed=2323)      # a server of its own

    def cpu(y, *, count):
        raise ValueError("fails at execution")
    bad = runtime.Kernel("fails_late", [runtime.Binding("y", "f32", "read_write")], cpu=cpu)
    y = c.create(np.zeros(4, np.float32))
    c.launch(bad, 1, [y])                         # nobody blocks on this stream before ...
    be = c._server.backend                        # private: wait until the worker ran it
    deadline = time.monotonic() + 10
    while be.load()[0] and time.monotonic() < deadline:
        time.sleep(0.01)                          # (it ran on a worker: its error is queued)
    c.shutdown()                                  # ... the shutdown
    with pytest.raises(ServerClosed) as info:
        c.sync()
    assert isinstance(info.value, LaunchError) and "fails_late" in str(info.value)
    with pytest.raises(ServerClosed) as again:
        c.sync()
    assert not isinstance(again.value, LaunchError)   # raised once
