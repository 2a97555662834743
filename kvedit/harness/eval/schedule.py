"""In what order `kvedit eval` runs its samples, and when it stops: groups and the deadline.

A run may be cut short (a lent GPU machine ends a command after a fixed time) and must still
leave figures that mean something. So the samples run in groups, each group whole (prefill,
baseline, every policy x ratio, released) before the next, and the groups are rounds: the
samples are interleaved so that the first group holds the first sample of every task, length
and seed, the second the second, and so on. A run cut after k groups has k samples of each
task x length x seed, every cell measured on them, instead of all samples of some tasks and
none of others. A group also bounds what the kvedit server must hold at once (the group's
chunks and captured queries, not the whole suite's).

`Deadline` decides what may start: a group or a cell starts only when the time it is expected
to take (judged by the same step done before: the previous group, or the mean of this group's
cells so far, else of the previous group's) still ends before the deadline. Nothing is
interrupted: what started finishes, and the results say what was done.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


def interleave(samples: list) -> list:
    """The samples in rounds: sample index i of every seed, task and length before index i+1
    (stable within a round: seed, then task, then length, as the suite lists them)."""
    return sorted(samples, key=lambda s: s.index)


def rounds(samples: list, per_group: int) -> list[list]:
    """`interleave`d samples cut into groups of `per_group` (the last may be shorter)."""
    ordered = interleave(samples)
    if per_group <= 0:
        raise ValueError(f"samples per group must be positive, got {per_group}")
    return [ordered[i:i + per_group] for i in range(0, len(ordered), per_group)]


@dataclass
class Deadline:
    """Seconds from `t0` (time.monotonic()) after which nothing new starts; None: no limit."""
    seconds: float | None
    t0: float = field(default_factory=time.monotonic)
    stopped: str | None = None  # why the run stopped early (None: it did not)

    def left(self) -> float | None:
        return None if self.seconds is None else self.seconds - (time.monotonic() - self.t0)

    def allows(self, expected_s: float | None, what: str) -> bool:
        """Whether `what`, expected to take `expected_s` (None: not known yet, so it starts
        if any time is left), ends before the deadline; the first refusal is remembered."""
        left = self.left()
        if left is None:
            return True
        if left > (expected_s or 0.0):
            return True
        if self.stopped is None:
            self.stopped = (f"{what} not started: {max(0.0, left):.0f} s left to the deadline, "
                            f"it takes ~{expected_s or 0:.0f} s")
        return False


def mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None
