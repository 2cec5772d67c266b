"""The capture state machine and the window's bookkeeping, written once for every backend.

States per stream (CubeCL ``stream/capture.rs``): ``NO_CAPTURE -> PREPARE -> CAPTURE -> NO_CAPTURE``.

- ``prepare`` (``graph_prepare``): from ``NO_CAPTURE`` only. Arms warm-up priming: buffers freed
  on this stream are held back from the pool until ``begin``, so the pool grows to the warm-up's
  working set and the recorded run finds every buffer it needs already allocated.
- ``begin`` (``start_capture``): from ``PREPARE`` only.
- ``end`` (``stop_capture``): from ``CAPTURE`` only.
- ``abort``: back to ``NO_CAPTURE`` from anywhere (a refused or failed window).

Errors: a transition out of order raises ``GraphStateError`` and leaves the state untouched.
"""

from __future__ import annotations

from ..errors import GraphStateError

NO_CAPTURE, PREPARE, CAPTURE = "no capture", "prepared", "capturing"


def transition(state: str, op: str, stream_id) -> str:
    """The state after ``op`` (``"prepare"``, ``"begin"``, ``"end"``) from ``state``.

    Raises:
        GraphStateError: the transition is out of order; nothing changed.
    """
    if op == "prepare":
        if state == NO_CAPTURE:
            return PREPARE
        why = "it is already prepared" if state == PREPARE else "a capture is already recording on it"
        raise GraphStateError(f"graph_prepare on stream {stream_id}: {why}; finish it with "
                              "start_capture()/stop_capture() first")
    if op == "begin":
        if state == PREPARE:
            return CAPTURE
        if state == NO_CAPTURE:
            raise GraphStateError(f"start_capture on stream {stream_id}: call graph_prepare() "
                                  "first, then run the work once as a warm-up")
        raise GraphStateError(f"start_capture on stream {stream_id}: a capture is already "
                              "recording on it; call stop_capture() first")
    if op == "end":
        if state == CAPTURE:
            return NO_CAPTURE
        raise GraphStateError(f"stop_capture on stream {stream_id}: no capture is recording on "
                              "it (call graph_prepare(), warm up, start_capture() first)")
    raise ValueError(op)


class Window:
    """What one capture window touched and refused.

    Attributes:
        recording: the backend recording (``Backend.begin_graph``).
        reads / writes: handle ids the recorded launches read / write (the graph's read and
            write sets; a ``read_write`` binding counts in both).
        allocs: handle states allocated on the capturing stream inside the window (retained by
            the graph on software graphs).
        refusals: messages of late refusals (a write, a free of a used handle, a fresh
            allocation on a hardware graph); ``stop_capture`` raises ``CaptureRefused`` with them.
        deferred: handle states freed during the window whose buffers must outlive it.
        event / event_pos: an event recorded on the stream as the window opened, so other
            streams can order against the work before it without recording on a capturing stream.
    """

    __slots__ = ("recording", "reads", "writes", "allocs", "refusals", "deferred", "event",
                 "event_pos", "launches")

    def __init__(self, recording, event, event_pos):
        self.recording = recording
        self.reads: set = set()
        self.writes: set = set()
        self.allocs: list = []
        self.refusals: list[str] = []
        self.deferred: list = []
        self.event, self.event_pos = event, event_pos
        self.launches = 0

    def uses(self, hid: int) -> bool:
        return hid in self.reads or hid in self.writes
