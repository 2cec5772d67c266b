"""The capture state machine (CubeCL D1 scenario 21), tested without a device; scenarios 22-23
run through a server on every backend in tests/contracts/test_capture_replay.py."""

import pytest

from runtime.errors import GraphStateError
from runtime.server import capture as cap


def test_transitions_follow_the_capture_order():                          # 21
    s = cap.NO_CAPTURE
    for op in ("begin", "end"):
        with pytest.raises(GraphStateError):
            cap.transition(s, op, 1)
    s = cap.transition(s, "prepare", 1)
    assert s == cap.PREPARE
    for op in ("prepare", "end"):
        with pytest.raises(GraphStateError):
            cap.transition(s, op, 1)
    s = cap.transition(s, "begin", 1)
    assert s == cap.CAPTURE
    for op in ("begin", "prepare"):
        with pytest.raises(GraphStateError):
            cap.transition(s, op, 1)
    assert cap.transition(s, "end", 1) == cap.NO_CAPTURE
