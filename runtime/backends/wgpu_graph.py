"""The wgpu backend's software graphs (used only by :mod:`.wgpu`).

A :class:`WgpuGraph` is a list of resolved dispatches (pipeline, bind group, count) re-encoded
into one submit per replay (CubeCL ``cubecl-wgpu/src/compute/graph.rs``); ``capture_if`` and
``capture_while`` become :class:`WgpuCond` nodes run with no host round trip: a gate dispatch
(:data:`GATE_WGSL`) writes the indirect counts of its branches' dispatches, a loop is unrolled
(at most :data:`MAX_UNROLLED` dispatches). :data:`COUNT_CHECK_WGSL` checks an indirect
dispatch's counts against the device's limit before it runs (``Kernel.checks``).
"""

from __future__ import annotations


class WgpuGraph:
    """A software graph: resolved dispatches ``(pipeline, bind_group, count, indirect_buf,
    kernel, written buffers)``; for an indirect dispatch ``count`` is the byte offset of its
    three u32 in ``indirect_buf`` (0 for a launch's own count buffer).

    ``tree`` is what was recorded: dispatches and :class:`WgpuCond` nodes; ``tasks`` is its
    flattening (the two are the same list when there are no nodes). ``stack``/``nodes`` are the
    open lists and nodes while recording.

    Holding the bind groups keeps their buffers and uniform buffers alive on the device side;
    the server retains the runtime handles (CubeCL ``cubecl-wgpu/src/compute/graph.rs``).
    """

    __slots__ = ("stream", "tasks", "tree", "stack", "nodes", "count", "checks", "status",
                 "checked")

    def __init__(self, stream):
        self.stream, self.tasks = stream, []
        self.tree = self.tasks
        self.stack = [self.tasks]
        self.nodes: list = []
        self.count = 0
        self.checks: list = []     # (flags buffer, node) of every capture_while node
        self.checked = ()          # kernels with device-side checks it dispatches (Kernel.checks)
        self.status = None         # MAP_READ buffer: one u32 per check, copied by each replay

    def __len__(self):
        return len(self.tasks)


def _oversize(tree):
    """The first loop node in ``tree`` (nested included) too big to unroll, or None."""
    for t in tree:
        if not isinstance(t, tuple):
            if t.oversize:
                return t
            inner = _oversize(t.then) or _oversize(t.other)
            if inner is not None:
                return inner
    return None


class WgpuCond:
    """A ``capture_if``/``capture_while`` node of a :class:`WgpuGraph`, with no host round trip.

    A gate dispatch (:data:`GATE`, one invocation) reads the condition and the enclosing
    node's flag and writes this node's flags (``[then, else]`` for an if; ``[body]`` for a
    while, and-ed with its previous value each iteration) and, for every dispatch directly in
    its branches, the three u32 indirect counts: the recorded count if its branch is on, else
    0. A while loop is unrolled: ``max_iterations`` times (gate, body). Nested nodes read this
    node's flag as their parent flag.

    Attributes: ``kind``, ``cond`` (``(buf, nbytes)``), ``max_iterations``, ``index``,
    ``then``/``other`` (recorded dispatches and nested nodes), ``parent`` (``(flags buffer,
    flag index)`` of the enclosing branch), ``flags`` (8-byte buffer), ``flat`` (the
    flattened dispatches).
    """

    __slots__ = ("kind", "cond", "max_iterations", "index", "then", "other", "parent", "flags",
                 "flat", "oversize", "bufs")

    def __init__(self, kind, cond, max_iterations, index, parent, flags):
        self.kind, self.cond, self.max_iterations, self.index = kind, cond, max_iterations, index
        self.then, self.other = [], []
        self.parent, self.flags = parent, flags
        self.flat: list = []
        self.oversize = 0           # a loop past MAX_UNROLLED: its unrolled size (not built)
        self.bufs = ()              # its gate's count table and indirect args (``_finish``)


#: the most dispatches one unrolled ``capture_while`` may expand to (``max_iterations`` x (the
#: body's dispatches + a gate)); past it ``stop_capture`` raises ``LaunchError`` instead of
#: building it. A list entry costs ~3 KB (bind group, indirect slot): 2**19 is ~1.5 GB and
#: seconds of encoding per replay, and covers a 32-layer decode step looped over 1,024 tokens;
#: ``max_iterations=2**40`` built for ever on the owner thread, stalling every client.
MAX_UNROLLED = 1 << 19


#: The gate of a conditional node (see :class:`WgpuCond`): mode 0 = if, 1 = first while
#: iteration, 2 = a later one, 3 = after the last unrolled iteration (``flags[2]``: the loop
#: would go on: ``LoopLimitExceeded``); ``pidx``: the parent's flag; ``n``: dispatches it gates.
GATE_WGSL = """
@group(0) @binding(0) var<storage, read> cond: array<u32>;
@group(0) @binding(1) var<storage, read> parent: array<u32>;
@group(0) @binding(2) var<storage, read_write> flags: array<u32>;
@group(0) @binding(3) var<storage, read> counts: array<u32>;
@group(0) @binding(4) var<storage, read_write> args: array<u32>;
struct Params { mode: u32, pidx: u32, n: u32 }
@group(0) @binding(5) var<uniform> p: Params;
@compute @workgroup_size(1)
fn main() {
    let on = parent[p.pidx] != 0u;
    let c = cond[0] != 0u;
    if (p.mode == 0u) {
        flags[0] = select(0u, 1u, on && c);
        flags[1] = select(0u, 1u, on && !c);
    } else if (p.mode == 1u) {
        flags[0] = select(0u, 1u, on && c);
    } else if (p.mode == 2u) {
        flags[0] = select(0u, 1u, on && c && flags[0] != 0u);
    } else {
        flags[2] = select(0u, 1u, on && c && flags[0] != 0u);
    }
    for (var i = 0u; i < p.n; i = i + 1u) {
        let f = flags[counts[4u * i + 3u]] != 0u;
        for (var k = 0u; k < 3u; k = k + 1u) {
            args[3u * i + k] = select(0u, counts[4u * i + k], f);
        }
    }
}
"""


#: :meth:`WgpuBackend._count_gate`'s kernel: ``atomicMax(err_flag)`` when a count at word ``at``
#: of ``counts`` is past ``limit``.
COUNT_CHECK_WGSL = """
@group(0) @binding(0) var<storage, read> counts: array<u32>;
struct Params { at: u32, limit: u32 }
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read_write> err_flag: array<atomic<u32>>;
@compute @workgroup_size(1, 1, 1)
fn main() {
    if (counts[p.at] > p.limit || counts[p.at + 1u] > p.limit || counts[p.at + 2u] > p.limit) {
        atomicMax(&err_flag[0], 1u);
    }
}
"""


def _checked(tasks) -> tuple:
    """The kernels with device-side checks (``Kernel.checks``) that ``tasks`` dispatch."""
    return tuple({t[4]: None for t in tasks if t[4].checks})
