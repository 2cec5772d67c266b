"""Schedule search with a guarantee: PCT and bounded exhaustive search of the cpu device order.

The cpu interleaving scheduler defers every stream item until someone waits, then picks which
ready stream head runs next. A stream-ordering bug is an order of those picks; this module
searches them for a test function ``test(client)`` (issue its work, read, ``assert``):

- **PCT** (``strategy="pct"``, the kit's default random strategy): Burckhardt, Kothari,
  Musuvathi, Nagarakatte, "A randomized scheduler with probabilistic guarantees of finding
  bugs", ASPLOS 2010. Each stream gets a random priority above ``depth``; the highest-priority
  ready stream always runs; at ``depth - 1`` change points, drawn uniformly among the first
  ``k`` *choice steps* (picks with two or more ready streams: a change elsewhere orders
  nothing), the running stream drops to priority ``depth - i``. One run finds a bug of depth
  ``d`` (``d`` orderings that must all happen) with probability at least ``1 / (n k^(d-1))``
  for ``n`` streams; :func:`pct_runs` is the number of runs that makes a miss at most ``miss``
  likely. ``k`` is learned: the most choice steps a run took so far (``steps`` seeds it).
- **Exhaustive** (``strategy="exhaustive"``): every order of the picks, by stateless
  depth-first search (the test is run again per order, so it must issue the same work each
  time: one issuing thread, or threads that wait for each other), with sleep-set partial-order
  reduction: two stream heads that run kernels or copies on disjoint buffers (or only read a
  shared one) commute, so only one of their orders is explored. Event records, event waits
  and the completions a host waits on commute with nothing. Bounded by ``max_runs``; a search
  cut there says so (``Exploration.complete`` is False, and the plugin warns).

A failing order is minimised before it is reported (:func:`minimise`: fewest context switches
between streams that still fail), and the report (:class:`ScheduleFailure`) names the racing
accesses of that run: pairs of kernels/copies on different streams that touch one buffer, at
least one writing, with no happens-before between them (stream order, event waits, host
waits), each with its operation, stream, buffer and where the test issued it.

Accesses are taken from the server's message handlers as they enqueue (launch, replay, write,
create, read); work enqueued by anything else (a finalizer) counts as touching every buffer.
"""

from __future__ import annotations

import math
import os
import random
import sys
from collections import deque
from typing import Callable, NamedTuple

from ..backends.cpu_schedule import SIGNAL, WAIT, InterleavingScheduler, encode_trace
from ..errors import LivenessError, StreamRaceError
from ..frontend.client import client as make_client
from ..streams import StreamId

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SYNC = (WAIT, SIGNAL)
#: runs per PCT search when the caller gives no number.
DEFAULT_PCT_RUNS = 100
#: interleavings an exhaustive search tries before it stops (and says it stopped).
DEFAULT_MAX_RUNS = 2000
#: re-runs the minimiser may spend on one failure.
MINIMISE_RUNS = 200


def pct_runs(streams: int, steps: int, depth: int, miss: float = 1e-3) -> int:
    """Runs after which PCT has missed a bug of ``depth`` with probability at most ``miss``:
    ``ceil(ln(1/miss) * n * k^(d-1))`` for ``n = streams``, ``k = steps`` (choice steps).

    Raises: ``ValueError`` (a count < 1, ``miss`` outside (0, 1)).
    """
    if streams < 1 or steps < 1 or depth < 1 or not 0 < miss < 1:
        raise ValueError(f"pct_runs needs streams, steps, depth >= 1 and 0 < miss < 1, got "
                         f"{streams}, {steps}, {depth}, {miss}")
    return math.ceil(math.log(1 / miss) * streams * steps ** (depth - 1))


# -- what each stream item does -----------------------------------------------------------------
class Item:
    """One stream item as the search sees it.

    Attributes:
        stream, seq: the stream's index and the item's 1-based place in it (``key``).
        kind: the backend's item kind: work (a kernel, replay or copy: ``RUN``, ``CALL``),
            ``WAIT`` (an event wait) or ``SIGNAL`` (an event or a completion).
        op: what enqueued it, e.g. ``"launch of add_scalar"``, ``"replay of graph 3"``.
        reads, writes: ids of the backend buffers it reads / writes (``None``: unknown, it
            conflicts with everything).
        handles: ``{buffer id: (handle id, buffer number)}`` of those buffers at the time
            (buffers are numbered in the order the run first touched them).
        site: ``"file:line"`` of the call in the test that issued it.
        vc: its vector clock ``{stream index: seq}``: the items that happen before it.
    """

    __slots__ = ("stream", "seq", "kind", "op", "reads", "writes", "handles", "site", "vc",
                 "ran")

    def __init__(self, stream, seq, kind, op, reads, writes, handles, site, vc):
        self.stream, self.seq, self.kind, self.op = stream, seq, kind, op
        self.reads, self.writes, self.handles, self.site, self.vc = (reads, writes, handles,
                                                                     site, vc)
        self.ran = None

    @property
    def work(self) -> bool:
        """Whether it runs a kernel, a replay or a copy (not an event record/wait or a
        completion)."""
        return self.kind not in _SYNC

    @property
    def key(self) -> tuple:
        """``(stream, seq)``: the item's identity across runs of the same test."""
        return (self.stream, self.seq)

    def before(self, other: "Item") -> bool:
        """Whether this item happens before ``other`` (stream order, events, host waits)."""
        return other.vc.get(self.stream, 0) >= self.seq

    def conflicts(self, other: "Item"):
        """The buffers both touch with at least one write (``None`` reads/writes: all)."""
        if not (self.work and other.work):
            return set()
        if self.writes is None or other.writes is None:
            return {"?"}
        mine, theirs = self.reads | self.writes, other.reads | other.writes
        return (self.writes & theirs) | (other.writes & mine)

    def independent(self, other: "Item") -> bool:
        """Whether running the two in either order gives the same state: both kernels/copies
        on different streams that do not conflict (partial-order reduction)."""
        return (self.stream != other.stream and self.work and other.work
                and not self.conflicts(other))

    def describe(self, buf) -> str:
        """``"<op> on stream S writes handle H (buffer B), issued at file:line"``."""
        what = "writes" if buf in (self.writes or ()) else "reads"
        named = (self.handles or {}).get(buf)
        where = (f"handle {named[0]} (buffer {named[1]})" if named is not None
                 else "every buffer (work the search cannot see into)")
        return f"{self.op} on stream {self.stream} {what} {where}, issued at {self.site}"


def _user_site() -> str:
    """``file:line`` of the innermost caller outside the ``runtime`` package (the test)."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f = f.f_back
    if f is None:
        return "?"
    return f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno}"


class _Context(NamedTuple):
    handler: str
    args: tuple
    site: str


class _Sited:
    """A server message that tells the scheduler which call of the test it serves."""

    __slots__ = ("sched", "fn", "site")

    def __init__(self, sched, fn, site):
        self.sched, self.fn, self.site = sched, fn, site

    def __call__(self, *args):
        sched = self.sched
        outer = sched.ctx
        sched.ctx = _Context(getattr(self.fn, "__name__", "?"), args, self.site)
        try:
            return self.fn(*args)
        finally:
            sched.ctx = outer


class Recording(InterleavingScheduler):
    """An interleaving scheduler that knows what each stream item does and when it ran.

    Subclasses choose the next stream (``choose``). ``attach_server(server)`` makes the
    server's messages carry the test's call site; ``items`` lists every item in push order,
    ``executed`` in run order; ``choice_steps`` counts picks among two or more ready streams,
    ``preemptions`` the picks that switched away from a stream that was still ready (the
    context switches a schedule chose; the others were forced).
    """

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.server = None
        self.ctx = None
        self.items: list = []
        self.executed: list = []
        self.pending: dict = {}          # stream index -> deque of Items, parallel to its q
        self.last: dict = {}             # stream index -> last pushed Item
        self.host: dict = {}             # the host's vector clock
        self.events: dict = {}           # id(CpuEvent) -> the vc of its SIGNAL
        self.choice_steps = 0
        self.preemptions = 0             # switches away from a stream that could have run on
        self.buffers: dict = {}          # id(backend buffer) -> its number in this run

    # -- the server side ------------------------------------------------------------------
    def attach_server(self, server) -> None:
        """Wrap ``server.submit``/``call`` and the entries ``launch``/``replay``/``read`` so
        each message carries the test's call site."""
        self.server = server
        submit, call = server.submit, server.call

        def sited_submit(fn, *args, **kw):
            return submit(_Sited(self, fn, _user_site()), *args, **kw)

        def sited_call(fn, *args):
            return call(_Sited(self, fn, _user_site()), *args)

        def sited_replay(gid):          # (these schedulers never run a replay at once)
            return call(_Sited(self, server.h_replay, _user_site()), gid)

        def sited_read(sid, hid, dtype=None):
            return call(_Sited(self, server.h_read, _user_site()), sid, hid, dtype)

        def sited_launch(*args):
            submit(_Sited(self, server.h_launch, _user_site()), *args)
        server.submit, server.call = sited_submit, sited_call
        server.replay, server.read, server.launch = sited_replay, sited_read, sited_launch

    def _accesses(self, kind):
        """``(op, reads, writes, handles)`` of an item pushed now, from the running handler."""
        ctx = self.ctx
        if ctx is None:
            return "work enqueued outside a call of the test", None, None, {}
        name, args = ctx.handler, ctx.args
        op = name[2:] if name.startswith("h_") else name
        if kind in _SYNC:
            return op, set(), set(), {}
        srv = self.server
        reads, writes, handles = set(), set(), {}

        def label(b, hid):
            handles[b] = (hid, self.buffers.setdefault(b, len(self.buffers) + 1))

        def add(hid, write, read=True):
            st = srv.handles.get(hid) if srv is not None else None
            if st is None:
                return False
            b = id(st.slot.buf)
            label(b, hid)
            (writes if write else reads).add(b)
            if write and read:
                reads.add(b)
            return True
        try:
            if name == "h_launch":
                _, kernel, _, hids, _ = args
                op = f"launch of {kernel.name}"
                for b, hid in zip(kernel.bindings, hids):
                    add(hid, b.access != "read")
                return op, reads, writes, handles
            if name == "h_replay":
                g = srv.graphs[args[0]]
                op = f"replay of graph {args[0]}"
                for st in g.handles:
                    b = id(st.slot.buf)
                    label(b, st.id)
                    if st.id in g.writes:
                        writes.add(b)
                    if st.id in g.reads:
                        reads.add(b)
                return op, reads, writes, handles
            if name in ("h_write", "h_alloc"):
                op = "write" if name == "h_write" else "create"
                if add(args[1], True, read=False):
                    return op, reads, writes, handles
            if name == "h_read":
                if add(args[1], False):
                    return op, reads, writes, handles
        except (KeyError, ValueError, AttributeError, TypeError):
            pass
        return op, None, None, {}

    # -- the backend side -----------------------------------------------------------------
    def push(self, stream, item, defer: bool = False):
        """Queue ``item`` on ``stream`` and note what it does (``Item``, its vector clock);
        everything waits for a ``settle`` here, so ``defer`` changes nothing."""
        kind, payload = item
        op, reads, writes, handles = self._accesses(kind)
        prev = self.last.get(stream.index)
        vc = dict(prev.vc) if prev is not None else {}
        _join(vc, self.host)
        if kind == WAIT:
            _join(vc, self.events.get(id(payload), {}))
        seq = (prev.seq if prev is not None else 0) + 1
        vc[stream.index] = seq
        it = Item(stream.index, seq, kind, op, reads, writes, handles,
                  self.ctx.site if self.ctx is not None else "?", vc)
        if kind == SIGNAL and not hasattr(payload, "set"):      # a CpuEvent (no Completion)
            self.events[id(payload)] = vc
        self.last[stream.index] = it
        self.items.append(it)
        self.pending.setdefault(stream.index, deque()).append(it)
        super().push(stream, item, defer)

    def is_idle(self, stream) -> bool:
        """Whether ``stream`` has nothing queued; if so the host has seen its work done."""
        if stream.q:
            return False
        last = self.last.get(stream.index)
        if last is not None:          # the host saw the stream drained: its work is before
            _join(self.host, last.vc)
        return True

    def heads(self, ready) -> dict:
        """``{stream index: Item}`` of the ready heads."""
        return {s.index: self.pending[s.index][0] for s in ready}

    def choose(self, ready):
        """Ask ``pick`` (the strategy) for the next stream and note the step (choice steps,
        preemptions, the item that runs)."""
        if len(ready) > 1:
            self.choice_steps += 1
        s = self.pick(ready)
        picks = self.picks
        if picks and s.index != picks[-1] and any(r.index == picks[-1] for r in ready):
            self.preemptions += 1
        it = self.pending[s.index].popleft()
        it.ran = len(self.executed)
        self.executed.append(it)
        return s

    def pick(self, ready):
        """The strategy: the stream to run next among ``ready`` (default: the lowest)."""
        return ready[0]

    def settle(self, comp, stream):
        """Run ready stream heads (``InterleavingScheduler.settle``) until ``comp`` is done;
        then the host has seen ``stream``'s work up to it."""
        super().settle(comp, stream)
        if comp.done:
            last = self.last.get(stream.index)
            if last is not None and last.ran is not None:
                _join(self.host, last.vc)
        return comp

    def races(self) -> list:
        """``[(first, second, buffers)]``: pairs of items that both ran, on different streams,
        touching a buffer with at least one write, with no happens-before between them, in
        the order they ran. When there is none: the pairs of an item that ran and one issued
        but not run when the test failed (``second.ran`` is None), unordered and conflicting
        likewise (a read that returned before another stream's write to its buffer ran: the
        write raced it by not running at all)."""
        ran = [it for it in self.executed if it.work]
        out = []
        for i, a in enumerate(ran):
            for b in ran[i + 1:]:
                if a.stream == b.stream or a.before(b) or b.before(a):
                    continue
                bufs = a.conflicts(b)
                if bufs:
                    out.append((a, b, bufs))
        if not out:
            for b in self.items:
                if b.ran is not None or not b.work:
                    continue
                for a in ran:
                    if a.stream != b.stream and not a.before(b) and not b.before(a):
                        bufs = a.conflicts(b)
                        if bufs:
                            out.append((a, b, bufs))
        return out


def _join(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


# -- strategies ---------------------------------------------------------------------------------
class PCTScheduler(Recording):
    """PCT (Burckhardt et al., ASPLOS 2010; see the module doc).

    Args:
        seed: the run's randomness (priorities and change points).
        depth: ``d``, the bug depth searched for (>= 1): ``d - 1`` priority change points.
        steps: ``k``, the choice steps a run takes (an estimate; change points are drawn from
            ``1..k``).
    Raises: ``ValueError`` (``depth`` or ``steps`` < 1).
    """

    def __init__(self, seed: int = 0, depth: int = 2, steps: int = 16):
        if depth < 1 or steps < 1:
            raise ValueError(f"PCT needs depth >= 1 and steps >= 1, got {depth}, {steps}")
        super().__init__(0)
        self.seed, self.depth, self.steps = seed, depth, steps
        self.rng = random.Random(f"pct:{seed}")
        n = min(depth - 1, steps)
        self.change_points = dict(zip(sorted(self.rng.sample(range(1, steps + 1), n)),
                                      range(1, n + 1)))
        self.priority: dict = {}

    def __repr__(self):
        return f"PCTScheduler(seed={self.seed!r}, depth={self.depth}, steps={self.steps})"

    def pick(self, ready):
        """The ready stream of highest priority, after this step's change point if any."""
        prio = self.priority
        for s in ready:
            if s.index not in prio:
                prio[s.index] = self.depth + self.rng.random()
        best = max(ready, key=lambda s: prio[s.index])
        if len(ready) > 1:
            i = self.change_points.get(self.choice_steps)
            if i is not None:                  # the i-th change point: it drops below all
                prio[best.index] = self.depth - i
                best = max(ready, key=lambda s: prio[s.index])
        return best


class RandomScheduler(Recording):
    """A uniformly random ready stream at each pick (the kit's earlier strategy)."""

    def pick(self, ready):
        """A uniformly random ready stream."""
        return ready[self.rng.randrange(len(ready))]


class Planned(Recording):
    """Follow ``plan`` (stream indices), then the lowest ready stream; ``on_choice(ready,
    heads, chosen)`` is told every choice step (the exhaustive search records them).

    A planned stream that is not ready is skipped (``diverged`` counts it)."""

    def __init__(self, plan, on_choice=None):
        super().__init__(0)
        self.plan, self.step, self.diverged = list(plan), 0, 0
        self.on_choice = on_choice

    def pick(self, ready):
        """The planned stream, else the lowest ready one (``on_choice`` may change it)."""
        chosen = None
        while self.step < len(self.plan) and chosen is None:
            k = self.plan[self.step]
            self.step += 1
            chosen = next((s for s in ready if s.index == k), None)
            if chosen is None:
                self.diverged += 1
        if chosen is None:
            chosen = ready[0]
        if self.on_choice is not None and len(ready) > 1:
            chosen = self.on_choice(ready, self.heads(ready), chosen)
        return chosen


# -- running a test -----------------------------------------------------------------------------
class Outcome(NamedTuple):
    """One run: the ``error`` the test raised (None: passed) and its ``scheduler``."""

    error: object
    scheduler: Recording


def run_once(test: Callable, scheduler: Recording, check: bool = False) -> Outcome:
    """Run ``test(client)`` once on a fresh cpu server with ``scheduler``.

    The client is pinned to a fresh stream; make more with ``client.with_stream(
    runtime.StreamId.new())``. The server is shut down afterwards. Returns an ``Outcome``;
    an ``Exception`` the test raises is its ``error`` (``KeyboardInterrupt`` passes through).
    """
    c = make_client("cpu", scheduler=scheduler, check=check)
    scheduler.attach_server(c._server)
    c.set_stream(StreamId.new())
    try:
        test(c)
        error = None
    except Exception as e:  # noqa: BLE001 - the test's failure is the answer
        error = e
    finally:
        c.shutdown()
    return Outcome(error, scheduler)


def switches(picks) -> int:
    """Context switches of a schedule: consecutive picks on different streams."""
    return sum(1 for a, b in zip(picks, picks[1:]) if a != b)


def _segments(picks) -> list:
    """``[(stream, start, end)]`` maximal runs of one stream (end exclusive)."""
    out, start = [], 0
    for i in range(1, len(picks) + 1):
        if i == len(picks) or picks[i] != picks[start]:
            out.append((picks[start], start, i))
            start = i
    return out


def minimise(test: Callable, picks, check: bool = False, error_type=None,
             max_runs: int = MINIMISE_RUNS) -> tuple:
    """The failing schedule ``picks`` with fewest context switches that still fails.

    Context switches are counted as preemptions (``Recording.preemptions``: a switch away
    from a stream that could have run on; a switch because a stream ran dry or waits on an
    event is forced and costs nothing). Greedy: for each switch, try pulling the interrupted
    stream's next segment forward to close it, pushing the interrupting segment back by one
    segment, or moving it last; keep a candidate whose run fails (with ``error_type``, when
    given) with fewer preemptions; repeat until no candidate helps or ``max_runs`` re-runs
    are spent.

    Returns: ``(picks, outcome)`` of the minimal failing run found (the run of ``picks`` if
    nothing smaller fails).
    """
    out = run_once(test, Planned(picks), check)
    if out.error is None:
        return list(picks), None          # not reproducible: report it as it was
    best, best_picks, runs = out, out.scheduler.picks, 1
    fewest = out.scheduler.preemptions
    improved = True
    while improved and runs < max_runs:
        improved = False
        for cand in _candidates(best_picks):
            if runs >= max_runs:
                break
            out = run_once(test, Planned(cand), check)
            runs += 1
            got = out.scheduler.picks
            if (out.error is not None and (error_type is None or isinstance(out.error,
                                                                                 error_type))
                    and out.scheduler.preemptions < fewest):
                best, best_picks, improved = out, got, True
                fewest = out.scheduler.preemptions
                break
    return best_picks, best


def _candidates(picks):
    segs = _segments(picks)
    for j in range(1, len(segs)):
        s, a, b = segs[j - 1]
        t, c, d = segs[j]
        nxt = next((seg for seg in segs[j + 1:] if seg[0] == s), None)
        if nxt is not None:               # pull s's next segment forward: s runs on
            _, e, f = nxt
            yield picks[:c] + picks[e:f] + picks[c:e] + picks[f:]
        if j + 1 < len(segs):             # push t's segment back behind the next one
            _, e, f = segs[j + 1]
            yield picks[:c] + picks[e:f] + picks[c:d] + picks[f:]
        yield picks[:c] + picks[d:] + picks[c:d]           # t's segment last


# -- the searches -------------------------------------------------------------------------------
class Exploration:
    """What a search did.

    Attributes:
        strategy, runs: the strategy and how many runs it made.
        complete: exhaustive only: every interleaving (up to partial-order reduction) ran.
        failure: the ``ScheduleFailure`` found, or None.
        steps: the most choice steps one run took (PCT's ``k``).
    """

    def __init__(self, strategy):
        self.strategy, self.runs, self.complete, self.failure, self.steps = (strategy, 0,
                                                                             False, None, 0)

    def __repr__(self):
        state = "failed" if self.failure else ("complete" if self.complete else "passed")
        return f"Exploration({self.strategy}, runs={self.runs}, steps={self.steps}, {state})"


class ScheduleFailure(AssertionError):
    """A schedule under which the test fails.

    Attributes:
        error: what the test raised under it.
        trace: the minimised schedule (``runtime.client("cpu", scheduler="trace", trace=...)``
            or ``--runtime-trace`` runs it again).
        races: ``[(first, second, buffers)]`` racing accesses of that run (:class:`Item` s).
        found: how the search found it (strategy, run, seed).
    """

    def __init__(self, error, trace, races, found, preemptions):
        self.error, self.trace, self.races, self.found = error, trace, races, found
        self.preemptions = preemptions        # (as found, minimised)
        super().__init__(self.report())

    def report(self) -> str:
        """The failure as text: how it was found, the error, the minimised schedule, the racing
        accesses (operation, stream, buffer, the test line of each) and how to run it again."""
        lines = [f"runtime.testing: the test fails under this device order ({self.found}): "
                 f"{type(self.error).__name__}: {self.error}".rstrip(),
                 f"schedule (minimised from {self.preemptions[0]} to {self.preemptions[1]} "
                 f"context switches a schedule chose): {self.trace or '(none)'}"]
        if self.races:
            lines.append("racing accesses (no event or host wait orders them):")
            for a, b, bufs in self.races:
                buf = sorted(bufs, key=str)[0]
                lines.append(f"  - {a.describe(buf)}")
                if b.ran is None:
                    lines.append(f"    ran while {b.describe(buf)} had not run yet")
                else:
                    lines.append(f"    ran before {b.describe(buf)}")
        elif isinstance(self.error, (StreamRaceError, LivenessError)):
            lines.append("the stream-ordering checker refused the unordered access before it "
                         "ran: its message above names both sides")
        else:
            lines.append("no racing kernel or copy accesses ran in this run: the failure "
                         "comes from elsewhere (the host logic, or work the search cannot "
                         "see into)")
        lines.append(f"run it again: runtime.client('cpu', scheduler='trace', trace="
                     f"{self.trace!r}) (or pytest --runtime-trace FILE)")
        return "\n".join(lines)

    def _picks(self):
        from ..backends.cpu_schedule import decode_trace
        return decode_trace(self.trace)


def failure(test: Callable, outcome: Outcome, check: bool, found: str) -> ScheduleFailure:
    """The ``ScheduleFailure`` of a failed run: its schedule minimised (:func:`minimise`), the
    racing accesses of the minimal run. ``found`` says how the search found it."""
    picks, best = minimise(test, outcome.scheduler.picks, check, type(outcome.error))
    best = best or outcome
    return ScheduleFailure(best.error, encode_trace(picks), best.scheduler.races(), found,
                           (outcome.scheduler.preemptions, best.scheduler.preemptions))


def explore(test: Callable, strategy: str = "pct", *, runs: int | None = None,
            depth: int = 2, seed=0, steps: int | None = None, check: bool = False,
            max_runs: int = DEFAULT_MAX_RUNS, reduce: bool = True,
            raises: bool = True) -> Exploration:
    """Search device orders of ``test(client)`` for one that makes it fail.

    Args:
        test: called once per run with a cpu client on a fresh server (pinned to a fresh
            stream); it fails by raising (``assert``).
        strategy: ``"pct"`` (default), ``"random"`` (uniform picks) or ``"exhaustive"``.
        runs: runs of ``pct``/``random`` (default :data:`DEFAULT_PCT_RUNS`).
        depth: PCT's bug depth ``d``.
        seed: the search's seed: run ``i`` uses seed ``f"{seed}:{i}"``.
        steps: PCT's ``k``: the first run draws change points from ``1..steps`` (default
            16), every later one from ``1..max(steps, the most choice steps a run took)``
            (without ``steps``: the most a run took).
        check: run with the stream-ordering checker (``check=True``); off by default, so a
            race shows as wrong data rather than a ``StreamRaceError``.
        max_runs: the exhaustive search's bound.
        reduce: the exhaustive search's partial-order reduction (off: every interleaving).
        raises: raise the ``ScheduleFailure`` (default) rather than return it in the result.
    Returns: an ``Exploration``.
    Raises: ``ScheduleFailure`` (with ``raises``); ``ValueError`` (unknown strategy, bad
        counts); ``RuntimeError`` (exhaustive: the test issued different work when run again).
    """
    if strategy not in ("pct", "random", "exhaustive"):
        raise ValueError(f"strategy must be 'pct', 'random' or 'exhaustive', got {strategy!r}")
    result = Exploration(strategy)
    if strategy == "exhaustive":
        _exhaustive(test, result, check, max_runs, reduce)
    else:
        n = DEFAULT_PCT_RUNS if runs is None else runs
        if n < 1:
            raise ValueError(f"runs must be >= 1, got {n}")
        k = steps or 16                   # until a run has shown how many there are
        seen = 0
        for i in range(n):
            sched = (PCTScheduler(f"{seed}:{i}", depth, k) if strategy == "pct"
                     else RandomScheduler(f"{seed}:{i}"))
            out = run_once(test, sched, check)
            result.runs += 1
            seen = max(seen, sched.choice_steps)
            k = max(steps or 1, seen, 1)
            result.steps = seen
            if out.error is not None:
                result.failure = failure(test, out, check,
                                          f"{strategy} run {i} of seed {seed!r}, depth {depth}")
                break
    if result.failure is not None and raises:
        raise result.failure
    return result


class _Node:
    __slots__ = ("ready", "heads", "chosen", "done", "sleep")

    def __init__(self, ready, heads, chosen, sleep):
        self.ready, self.heads, self.chosen, self.sleep = ready, heads, chosen, sleep
        self.done: set = set()


def _exhaustive(test, result, check, max_runs, reduce=True) -> None:
    """Stateless DFS over the choice steps with sleep sets (see the module doc)."""
    stack: list = []
    prefix: list = []
    while True:
        depth = [0]
        redundant = [False]

        def on_choice(ready, heads, chosen, prefix=prefix):
            i = depth[0]
            depth[0] += 1
            if i < len(prefix):
                node = stack[i]
                if sorted(heads) != sorted(node.heads) or any(
                        heads[k].key != node.heads[k].key for k in heads):
                    raise RuntimeError(
                        "exhaustive search: the test enqueued different work when run again "
                        "(issue from one thread, or make threads wait for each other)")
                return next(s for s in ready if s.index == prefix[i])
            if redundant[0]:
                return chosen
            if i == 0 or not reduce:
                sleep = set()
            else:
                parent = stack[i - 1]
                ran = parent.heads[parent.chosen]
                asleep = [parent.heads[d] for d in parent.done if d != parent.chosen]
                asleep += list(parent.sleep)
                sleep = {x for x in asleep if x.independent(ran)}
            keys = {x.key for x in sleep}
            awake = [s for s in ready if heads[s.index].key not in keys]
            if not awake:                 # every order from here was covered elsewhere
                redundant[0] = True
                return chosen
            pick = awake[0]
            stack.append(_Node(sorted(heads), heads, pick.index, sleep))
            return pick

        sched = Planned([], on_choice)
        out = run_once(test, sched, check)
        result.runs += 1
        result.steps = max(result.steps, sched.choice_steps)
        if out.error is not None:
            if isinstance(out.error, RuntimeError) and "exhaustive search" in str(out.error):
                raise out.error
            result.failure = failure(test, out, check,
                                      f"exhaustive run {result.runs}")
            return
        while stack:                      # the deepest choice with an order left to try
            node = stack[-1]
            node.done.add(node.chosen)
            keys = {x.key for x in node.sleep}
            left = [k for k in node.ready if k not in node.done and node.heads[k].key not in keys]
            if left:
                node.chosen = left[0]
                break
            stack.pop()
        if not stack:
            result.complete = True
            return
        if result.runs >= max_runs:
            return
        prefix = [n.chosen for n in stack]
