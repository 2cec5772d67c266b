"""Time budgets of the benchmark suite: a section gets seconds, and cuts repetitions to fit.

``python -m runtime bench --budget-s S`` gives the whole run ``S`` seconds. Before each
(backend, section) the suite hands that section a :class:`Budget`: the run's seconds still
left, times the section's weight over the weights of every section still to run (time a fast
section leaves unused rolls over to the ones after it). A section splits its budget among its
rows (:meth:`Budget.split`) and stops repeating a row once its share is spent, after at least
``min_reps`` repetitions (:meth:`Budget.stop`): a budget makes rows noisier, it never drops a
row. Every cut is recorded (:attr:`Budget.cuts`) and the report says which rows ran fewer
repetitions than planned, so a cut is never silent.
"""

from __future__ import annotations

import math

from .timing import clock


class Budget:
    """Seconds a piece of the suite may take, from its creation on.

    Args:
        seconds: the allowance in seconds; ``None`` is unbounded (nothing is ever cut).
        cuts: the list cuts are appended to (shared with sub-budgets; default a new list).
    Raises: ``ValueError`` (negative ``seconds``).
    """

    def __init__(self, seconds: float | None = None, cuts: list | None = None):
        if seconds is not None and seconds < 0:
            raise ValueError(f"a budget is >= 0 seconds, got {seconds}")
        self.seconds = seconds
        self.start = clock()
        self.cuts: list = [] if cuts is None else cuts

    def __repr__(self):
        return f"Budget({'unbounded' if self.seconds is None else f'{self.seconds:.1f} s'})"

    def left(self) -> float:
        """Seconds left (``inf`` when unbounded; negative once overrun)."""
        if self.seconds is None:
            return math.inf
        return self.seconds - (clock() - self.start)

    def spent(self) -> float:
        """Seconds since the budget was made."""
        return clock() - self.start

    def expired(self) -> bool:
        """True once the allowance is used up (never when unbounded)."""
        return self.left() <= 0

    def part(self, share: float) -> "Budget":
        """A sub-budget of ``share`` (0..1) of the seconds left now, recording into the same
        ``cuts``."""
        return Budget(None if self.seconds is None else max(0.0, self.left()) * share,
                      self.cuts)

    def split(self, weights):
        """Sub-budgets for consecutive pieces of work, one per weight, made lazily: the i-th
        gets the seconds left when it is made times ``w_i / (w_i + ... + w_n)``, so what an
        early piece leaves unused goes to the later ones. Yields ``Budget`` objects."""
        weights = [float(w) for w in weights]
        for i, w in enumerate(weights):
            rest = sum(weights[i:])
            yield self.part(w / rest if rest > 0 else 1.0)

    def stop(self, done: int, planned: int, what: str, min_reps: int = 2) -> bool:
        """Whether a loop of ``planned`` repetitions should stop after ``done`` of them: True
        when the budget is spent and at least ``min_reps`` ran; the cut is then recorded as
        ``"<what>: <done> of <planned> repetitions"``."""
        if done < planned and done >= min_reps and self.expired():
            self.cut(f"{what}: {done} of {planned} repetitions")
            return True
        return False

    def cut(self, note: str) -> None:
        """Record that the budget shortened something (the report lists ``note``)."""
        self.cuts.append(note)


def unbounded() -> Budget:
    """A budget that never cuts (a section called outside the suite)."""
    return Budget(None)
