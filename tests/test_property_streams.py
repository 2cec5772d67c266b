"""Property test: random multi-client, multi-stream programs that obey the replay contract
match a plain sequential numpy model under the seeded interleaving scheduler.

Each client issues its calls from its own OS thread (one worker thread per client), one call
at a time, so the program order is the model's order while the device order is whatever the
seeded scheduler picks. Contract kept by construction (seed 001): a replay's buffers are not
pending on other streams (every stream is synced before a replay), the replay is followed by a
sync of its capture stream, and buffers a live graph uses are never freed.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

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

    def _launch(self, k, op, src, dst):
        kern, f, params = OPS[op]
        self.clients[k].launch(kern, 1, [self.handles[src], self.handles[dst]], {**params, "n": N})

    @rule(k=st.integers(0, 2), op=st.sampled_from(sorted(OPS)), src=buffers, dst=buffers)
    def launch(self, k, op, src, dst):
        if src in self.handles and dst in self.handles and src != dst:
            k %= len(self.clients)
            self.on(k, self._launch, k, op, src, dst)
            self.model[dst] = OPS[op][1](self.model[src], self.model[dst])

    @rule(k=st.integers(0, 2), hid=buffers)
    def read(self, k, hid):
        if hid in self.handles:
            k %= len(self.clients)
            got = self.on(k, self.clients[k].read, self.handles[hid])
            np.testing.assert_array_equal(got, self.model[hid])

    @rule(hid=buffers)
    def free(self, hid):
        in_graph = any(hid in {s for _, s, _ in l} | {d for _, _, d in l} for _, _, l in self.graphs)
        if hid in self.handles and not in_graph:
            self.handles.pop(hid).release()
            del self.model[hid]

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
            self.model[dst] = OPS[op][1](self.model[src], self.model[dst])
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
        for _ in range(times):
            self.on(k, g.replay)
            for op, src, dst in launches:
                self.model[dst] = OPS[op][1](self.model[src], self.model[dst])
        self.on(k, self.clients[k].sync)               # the replay's work completes here

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
                np.testing.assert_array_equal(self.on(0, self.clients[0].read, self.handles[hid]),
                                              self.model[hid])
            self.c.shutdown()
            for p in self.pools:
                p.shutdown()


StreamPrograms.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestStreamPrograms = StreamPrograms.TestCase
