"""How the parent waits: interrupts deferred around its critical steps, a wait clock
that does not count time the process was stopped, and the spin-before-sleep policy.

docs/design.md, "Faults", says why each exists.
"""
from __future__ import annotations

import _signal  # the C module behind signal (pyproject: no stub, ignored)
import os
import signal
import threading
import time
from typing import Any

__all__ = ["WaitClock", "defer_signals", "restore_signals", "SPIN_S", "spin_for"]


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


#: Signals whose Python handlers are held back during a dispatch or a handoff (not
#: the synchronous fault signals, which cannot wait).
_DEFERRABLE = frozenset(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGBUS,
                                                    signal.SIGFPE, signal.SIGILL, signal.SIGTRAP, signal.SIGABRT}


def defer_signals() -> Any:
    """Block signal delivery to this thread (only the main thread runs Python signal
    handlers, so other threads need nothing); returns the mask to restore.  A
    handler already triggered runs at the first check after this call -- before
    anything of the critical section happened -- and one triggered later runs
    after :func:`restore_signals`, once it is complete."""
    if threading.current_thread() is not _MAIN:
        return None
    return _sigmask(signal.SIG_BLOCK, _DEFERRABLE)


def restore_signals(old: Any) -> None:
    if old is not None:
        _sigmask(signal.SIG_SETMASK, old)


# The C function itself: signal.pthread_sigmask converts the old mask to a set of
# Signals enum members, which costs ~70 us for a full mask; ints are all we need.
_sigmask = _signal.pthread_sigmask


_MAIN = threading.main_thread()
