"""How the parent waits: a wait clock that does not count time the process was
stopped, and the spin-before-sleep policy.  (The parent's steps that an interrupt
must not split are single C calls in ``mploader._steps``.)

docs/design.md, "Faults", says why each exists.
"""
from __future__ import annotations

import os
import time

__all__ = ["WaitClock", "SPIN_S", "spin_for"]


#: How long the parent spins on a slot before sleeping on its futex, where a core is
#: free for it (seconds).  A cross-process wake costs 20-30 us; a batch that is a few
#: microseconds from ready is cheaper to spin for.
SPIN_S = 50e-6


def spin_for(num_workers: int) -> float:
    """:data:`SPIN_S` when this process may run on a core of its own besides one per
    worker, else 0: where the workers need every core, spinning steals the CPU the
    batch is being made on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return SPIN_S if cores >= num_workers + 1 else 0.0


class WaitClock:
    """Seconds spent waiting, counting each slice at most twice its length, so time
    the process spent stopped (SIGSTOP, Ctrl-Z, a suspended container) is not
    counted against ``timeout``."""

    __slots__ = ("last", "waited", "warned")

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.waited = 0.0
        self.warned = False

    def tick(self, slice_s: float) -> float:
        now = time.monotonic()
        self.waited += min(now - self.last, 2 * slice_s)
        self.last = now
        return self.waited

