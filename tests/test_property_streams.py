"""Property test: random multi-client, multi-stream programs that obey the replay contract
match a plain sequential numpy model under the seeded interleaving scheduler.

Each client issues its calls from its own OS thread (one worker thread per client), one call
at a time, so the program order is the model's order while the device order is whatever the
seeded scheduler picks. Contract kept by construction (seed 001): a replay's buffers are not
pending on other streams after its recording (every stream is synced before a replay, except
the first replay right after a capture, whose record-time dependencies the server fences), the
replay is followed by a sync of its capture stream, and a live graph's buffers are never freed
before it, except by ``release_graph_with_inputs`` (either order, replay pending).

Issue 13's shapes are generated too: a free with pending work followed by a window allocation
on another stream (the pool hands the buffer over), graph release before and after its inputs,
a user kernel that fails at execution inside a graph and inside a warm-up (the model keeps a
set of *marked* buffers: a read of one must raise ``ReplayFailed`` until a later write lands),
and ``wait_event``/``record_event`` inside a window (refused at once).
"""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

import pytest

import runtime
from runtime import StreamId
from runtime import kernels as K

N = 8
OPS = {
    "add_scalar": (K.add_scalar, lambda x, y: x + np.float32(1.5), {"alpha": 1.5}),
    "mul_scalar": (K.mul_scalar, lambda x, y: x * np.float32(-0.5), {"alpha": -0.5}),
    "copy": (K.copy, lambda x, y: x.copy(), {}),
    "accumulate": (K.accumulate, lambda x, y: y + x, {}),
}
values = st.lists(st.integers(-8, 8), min_size=N, max_size=N).map(lambda v: np.array(v, np.float32))


def _fail_if_negative(x, y, count, n):
    if x[0] < 0:
        raise ValueError("x[0] is negative")
    y[:n] = x[:n]


#: a user kernel that fails at execution when its input's first element is negative, else copies
FAIL = runtime.Kernel("fail_if_negative", [runtime.Binding("x", "f32", "read"),
                                           runtime.Binding("y", "f32", "read_write")],
                      [runtime.Param("n", "u32")], cpu=_fail_if_negative)
#: every kernel the programs launch (``OPS`` is what the plain launch and capture rules draw)
ALL = {**OPS, "fail_if_negative": (FAIL, lambda x, y: x.copy(), {})}


class StreamPrograms(RuleBasedStateMachine):
    buffers = Bundle("buffers")

    @initialize(seed=st.integers(0, 2**16), nclients=st.integers(2, 3))
    def start(self, seed, nclients):
        self.c = runtime.client("cpu", scheduler="interleave", seed=seed)
        self.clients = [self.c.with_stream(StreamId.new()) for _ in range(nclients)]
        self.pools = [ThreadPoolExecutor(1) for _ in range(nclients)]
        self.model = {}          # local buffer name -> np.ndarray
        self.handles = {}        # local buffer name -> Handle
        self.graphs = []         # (Graph, client index, [(op, src id, dst id)])
        self.marked = set()      # buffers whose last writer failed: a read raises ReplayFailed

    def on(self, k, fn, *args):
        return self.pools[k].submit(fn, *args).result()

    @rule(target=buffers, k=st.integers(0, 2), v=values)
    def create(self, k, v):
        k %= len(self.clients)
        h = self.on(k, self.clients[k].create, v)
        name = self.next_name = getattr(self, "next_name", 0) + 1   # stable across runs
        self.model[name], self.handles[name] = v.copy(), h
        return name

    @rule(k=st.integers(0, 2), hid=buffers, v=values)
    def write(self, k, hid, v):
        if hid in self.handles:
            k %= len(self.clients)
            self.on(k, self.clients[k].write, self.handles[hid], v)
            self.model[hid] = v.copy()
            self.marked.discard(hid)

    def _launch(self, k, op, src, dst):
        self._launch_handles(k, op, self.handles[src], self.handles[dst])

    @rule(k=st.integers(0, 2), op=st.sampled_from(sorted(OPS)), src=buffers, dst=buffers)
    def launch(self, k, op, src, dst):
        if src in self.handles and dst in self.handles and src != dst:
            k %= len(self.clients)
            self.on(k, self._launch, k, op, src, dst)
            self._eager(op, src, dst)

    def _eager(self, op, src, dst):
        """Model of an eager launch that does not fail: a marked input marks its output."""
        self.model[dst] = ALL[op][1](self.model[src], self.model[dst])
        if src in self.marked:
            self.marked.add(dst)
        else:
            self.marked.discard(dst)

    def _check(self, k, hid):
        if hid in self.marked:
            with pytest.raises(runtime.ReplayFailed):
                self.on(k, self.clients[k].read, self.handles[hid])
        else:
            got = self.on(k, self.clients[k].read, self.handles[hid])
            np.testing.assert_array_equal(got, self.model[hid])

    @rule(k=st.integers(0, 2), hid=buffers)
    def read(self, k, hid):
        if hid in self.handles:
            self._check(k % len(self.clients), hid)

    @rule(hid=buffers)
    def free(self, hid):
        in_graph = any(hid in {s for _, s, _ in l} | {d for _, _, d in l} for _, _, l in self.graphs)
        if hid in self.handles and not in_graph:
            self._forget(hid)

    def _forget(self, hid):
        self.handles.pop(hid).release()
        del self.model[hid]
        self.marked.discard(hid)

    @rule(k=st.integers(0, 2), data=st.data())
    def capture(self, k, data):
        live = sorted(self.handles)
        if len(live) < 2:
            return
        k %= len(self.clients)
        c = self.clients[k]
        launches = []
        for _ in range(data.draw(st.integers(1, 4))):
            src, dst = data.draw(st.permutations(live))[:2]
            launches.append((data.draw(st.sampled_from(sorted(OPS))), src, dst))
        self.on(k, c.graph_prepare)
        for op, src, dst in launches:                  # warm-up: executes
            self.on(k, self._launch, k, op, src, dst)
            self._eager(op, src, dst)
        self.on(k, c.start_capture)
        for op, src, dst in launches:                  # recorded, not executed
            self.on(k, self._launch, k, op, src, dst)
        g = self.on(k, c.stop_capture)
        self.graphs.append((g, k, launches))

    @precondition(lambda self: self.graphs)
    @rule(i=st.integers(0, 100), times=st.integers(1, 3))
    def replay(self, i, times):
        g, k, launches = self.graphs[i % len(self.graphs)]
        for j, c in enumerate(self.clients):           # nothing pending elsewhere (contract)
            self.on(j, c.sync)
        self._replay(g, k, launches, times)

    def _replay(self, g, k, launches, times):
        """Replay ``times``, then sync the capture stream; the model of each replay: launches up
        to a failing one run, a failure marks the whole write set (and the sync raises it), a
        marked read-only input marks the write set of a replay that runs."""
        writes = {d for _, _, d in launches}
        inputs = {s for _, s, _ in launches} - writes
        failed = False
        for _ in range(times):
            self.on(k, g.replay)
            propagated = bool(inputs & self.marked)
            for op, src, dst in launches:
                if op == "fail_if_negative" and self.model[src][0] < 0:
                    failed = propagated = True
                    break
                self.model[dst] = ALL[op][1](self.model[src], self.model[dst])
            if propagated:
                self.marked |= writes
            else:
                self.marked -= writes
        if failed:                                     # reported on the capture stream
            with pytest.raises(runtime.LaunchError, match="fail_if_negative"):
                self.on(k, self.clients[k].sync)
        else:
            self.on(k, self.clients[k].sync)           # the replay's work completes here

    @rule(k=st.integers(0, 2), src=buffers, dst=buffers, dst2=buffers,
          op=st.sampled_from(["add_scalar", "mul_scalar", "copy"]))
    def capture_failing(self, k, src, dst, dst2, op):
        """A graph [fail_if_negative(src -> dst), op(dst -> dst2)]; its warm-up fails when
        src[0] < 0 (then start_capture raises and nothing is recorded)."""
        if not ({src, dst, dst2} <= set(self.handles) and len({src, dst, dst2}) == 3):
            return
        k %= len(self.clients)
        c = self.clients[k]
        for j, cj in enumerate(self.clients):          # the buffers are not pending elsewhere
            self.on(j, cj.sync)
        launches = [("fail_if_negative", src, dst), (op, dst, dst2)]
        self.on(k, c.graph_prepare)
        if self.model[src][0] < 0:                     # the warm-up fails at execution
            self.on(k, self._launch, k, "fail_if_negative", src, dst)
            self.marked.add(dst)
            with pytest.raises(runtime.ServerUnhealthy, match="fail_if_negative"):
                self.on(k, c.start_capture)
            with pytest.raises(runtime.GraphStateError):   # back to no capture
                self.on(k, c.stop_capture)
            return
        for o, s_, d in launches:
            self.on(k, self._launch, k, o, s_, d)
            self._eager(o, s_, d)
        self.on(k, c.start_capture)
        for o, s_, d in launches:
            self.on(k, self._launch, k, o, s_, d)
        self.graphs.append((self.on(k, c.stop_capture), k, launches))

    @rule(j=st.integers(0, 2), k=st.integers(1, 2), src=buffers, v=values,
          op=st.sampled_from(["add_scalar", "mul_scalar", "copy"]))
    def free_pending_then_window_alloc(self, j, k, src, v, op):
        """Stream j fills a buffer and frees it with the work pending; stream k (another) then
        allocates inside a capture window (the pool hands it that buffer), records op(src ->
        it) and replays at once: the replay must come after j's pending work."""
        if src not in self.handles:
            return
        n = len(self.clients)
        j %= n
        k = (j + 1 + k % (n - 1)) % n
        cj, ck = self.clients[j], self.clients[k]
        t = self.on(j, cj.create, v)
        self.on(j, self._launch_handles, j, "copy", self.handles[src], t)
        t.release()                                    # the copy may not have run yet
        self.on(k, ck.graph_prepare)
        self.on(k, ck.start_capture)
        out = self.on(k, ck.empty, N, np.float32)      # may be t's buffer
        self.on(k, self._launch_handles, k, op, self.handles[src], out)
        g = self.on(k, ck.stop_capture)
        name = self.next_name = getattr(self, "next_name", 0) + 1
        self.model[name], self.handles[name] = np.zeros(N, np.float32), out
        launches = [(op, src, name)]
        self._replay(g, k, launches, 1)
        self.graphs.append((g, k, launches))

    def _launch_handles(self, k, op, x, y):
        kern, _, params = ALL[op]
        self.clients[k].launch(kern, 1, [x, y], {**params, "n": N})

    @precondition(lambda self: self.graphs)
    @rule(i=st.integers(0, 100), graph_first=st.booleans(), k=st.integers(0, 2), v=values)
    def release_graph_with_inputs(self, i, graph_first, k, v):
        """Replay a graph and, with the replay pending, release it and the buffers only it uses,
        in either order; then another stream creates a buffer (maybe one of theirs)."""
        j = i % len(self.graphs)
        g, gk, launches = self.graphs.pop(j)
        others = {h for _, _, l in self.graphs for _, s_, d in l for h in (s_, d)}
        mine = sorted({h for _, s_, d in launches for h in (s_, d)} - others)
        for jj, c in enumerate(self.clients):
            self.on(jj, c.sync)
        self.on(gk, g.replay)
        writes = {d for _, _, d in launches}
        for op, src, dst in launches:                  # model only the kept buffers' values
            if op == "fail_if_negative" and self.model[src][0] < 0:
                break
            self.model[dst] = ALL[op][1](self.model[src], self.model[dst])
        if graph_first:
            g.release()
        for h in mine:
            self._forget(h)
        if not graph_first:
            g.release()
        k = (gk + 1 + k % (len(self.clients) - 1)) % len(self.clients)
        name = self.next_name = getattr(self, "next_name", 0) + 1
        self.handles[name] = self.on(k, self.clients[k].create, v)
        self.model[name] = v.copy()
        try:
            self.on(gk, self.clients[gk].sync)
        except runtime.LaunchError:                    # the pending replay failed: its marks
            self.marked |= writes & set(self.handles)
            return
        self.marked -= writes

    @rule(k=st.integers(0, 2), j=st.integers(1, 2))
    def wait_event_in_window(self, k, j):
        """record_event / wait_event on a capturing stream are refused at once."""
        n = len(self.clients)
        k %= n
        j = (k + 1 + j % (n - 1)) % n
        c, other = self.clients[k], self.clients[j]
        self.on(k, c.graph_prepare)
        self.on(k, c.start_capture)
        token = self.on(j, other.record_event)
        with pytest.raises(runtime.CaptureRefused):
            self.on(k, c.wait_event, token)
        with pytest.raises(runtime.CaptureRefused):
            self.on(k, c.record_event)
        self.on(k, c.stop_capture).release()          # the window went on: an empty graph

    @precondition(lambda self: self.graphs)
    @rule(i=st.integers(0, 100))
    def clone_and_release(self, i):
        j = i % len(self.graphs)
        g, k, launches = self.graphs[j]
        self.graphs[j] = (g.clone(), k, launches)
        g.release()

    @precondition(lambda self: self.graphs)
    @rule(i=st.integers(0, 100))
    def release_graph(self, i):
        g, _, _ = self.graphs.pop(i % len(self.graphs))
        g.release()

    @invariant()
    def server_alive(self):
        if hasattr(self, "c"):
            assert not self.c.closed

    def teardown(self):
        if hasattr(self, "c"):
            for hid in sorted(self.handles):            # final check of every live buffer
                self._check(0, hid)
            self.c.shutdown()
            for p in self.pools:
                p.shutdown()


#: programs per CI run (``RUNTIME_PROPERTY_EXAMPLES`` raises it for a local soak)
EXAMPLES = int(os.environ.get("RUNTIME_PROPERTY_EXAMPLES", "500"))
StreamPrograms.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=20,
                                            deadline=None)
TestStreamPrograms = StreamPrograms.TestCase
