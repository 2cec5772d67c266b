"""The ops a capture window records besides the backend recording (see ``graphs.py``)."""

from __future__ import annotations


class LaunchRec:
    """One recorded launch.

    Attributes:
        kernel: the ``runtime.Kernel``.
        count: ``(x, y, z)`` workgroups, or the handle id of an indirect count buffer.
        hids: handle ids, one per binding, in order.
        params: the packed params tuple (``Kernel.pack_params``).
        scope: ``((node index, "then" | "else" | "body"), ...)``: the conditional nodes it sits
            in, outermost first (empty at top level).
    """

    __slots__ = ("kernel", "count", "hids", "params", "scope")

    def __init__(self, kernel, count, hids, params, scope=()):
        self.kernel, self.count, self.hids, self.params, self.scope = (kernel, count, tuple(hids),
                                                                      tuple(params), scope)

    def replace(self, **kw) -> "LaunchRec":
        d = {k: getattr(self, k) for k in self.__slots__}
        d.update(kw)
        return LaunchRec(**d)

    def used(self) -> list:
        """Handle ids it uses: its bindings, then its indirect count buffer."""
        return list(self.hids) + ([] if isinstance(self.count, tuple) else [self.count])


class CondRec:
    """A recorded ``capture_if`` (``kind="if"``) or ``capture_while`` (``"while"``) node.

    Attributes:
        kind, index (its number among the graph's nodes, in recording order), cond (handle id
        of its 1-element i32/u32 condition), max_iterations (None: the backend's default
        bound), scope (the nodes it sits in, as ``LaunchRec.scope``), dtype (``"i32"`` or
        ``"u32"``: the condition handle's).
    """

    __slots__ = ("kind", "index", "cond", "max_iterations", "scope", "dtype")

    def __init__(self, kind, index, cond, max_iterations, scope=(), dtype="i32"):
        self.kind, self.index, self.cond = kind, index, cond
        self.max_iterations, self.scope, self.dtype = max_iterations, scope, dtype

    def replace(self, **kw) -> "CondRec":
        d = {k: getattr(self, k) for k in self.__slots__}
        d.update(kw)
        return CondRec(**d)


def launch_recs(ops) -> list:
    return [op for op in ops if isinstance(op, LaunchRec)]


def cond_recs(ops) -> list:
    return [op for op in ops if isinstance(op, CondRec)]


def used_ids(ops) -> set:
    """Every handle id the ops use (bindings, indirect counts, conditions)."""
    out = set()
    for op in ops:
        if isinstance(op, LaunchRec):
            out.update(op.used())
        elif isinstance(op, CondRec):
            out.add(op.cond)
    return out
