"""The capture state machine (CubeCL D1, scenarios 21-23), tested without a device."""

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


def test_a_rejected_transition_changes_nothing(client):                   # 22 (through a server)
    client.graph_prepare()
    with pytest.raises(GraphStateError, match="already prepared"):
        client.graph_prepare()
    client.start_capture()                          # still prepared: begin succeeds
    client.stop_capture()


def test_a_refused_window_returns_to_no_capture(client):                  # 23 (abort)
    import numpy as np
    h = client.create(np.zeros(4, np.float32))
    client.graph_prepare()
    client.start_capture()
    client.write(h, np.ones(4, np.float32))
    with pytest.raises(Exception):
        client.stop_capture()
    client.graph_prepare()                          # back in no capture: prepare succeeds
    client.start_capture()
    client.stop_capture()


def test_warmup_errors_abort_start_capture(client):
    import numpy as np
    import runtime
    h = client.create(np.zeros(4, np.float32))
    bad = runtime.Kernel("bad", [runtime.Binding("y", "f32", "read_write")], wgsl="nope", cuda="nope")
    client.graph_prepare()
    client.launch(bad, 1, [h])                      # fails to compile on every backend: queued
    with pytest.raises(runtime.ServerUnhealthy, match="bad"):
        client.start_capture()
    with pytest.raises(GraphStateError):            # back in no capture (CubeCL wgpu)
        client.stop_capture()
    client.graph_prepare()
    client.start_capture()
    client.stop_capture()
