"""The watchdog: a worker stuck on one batch is replaced and the batch loaded again.

A worker is *stuck* when it has worked on the same batch for longer than the stall
limit (docs/design.md, "Faults", "The watchdog").  The parent sees that without any
message from the worker: each worker's busy cell (:class:`mploader._metrics.BusyCells`)
holds the monotonic time at which its task in progress began.  The check piggy-backs
on the parent's waits (``Scheduler._check_wait``, every wait slice) and runs at most
every :func:`check_interval` seconds: a loop whose batches are ready never pays for it.

What happens to a stuck worker (:meth:`Watchdog.check`):

1. its Python stack, every thread, is taken inside the worker -- ``faulthandler``
   was registered for SIGUSR1 at the worker's start (:func:`mploader._stacks.install`), writing into
   a memfd of the worker, which the parent reads through ``/proc/<pid>/fd`` -- and
   logged on the ``"mploader"`` logger at WARNING;
2. it is SIGKILLed and a replacement with the same worker id is started;
3. every task it had not finished is given again, with the same seq and slot, to
   the replacement or another worker (the scheduler's ``Dispatch.replace_stuck``):
   the loop sees the same batches in the same order; with per-batch seeding they
   are bit-identical.

The watchdog decides and the scheduler acts: it reads the workers and their busy
cells, and calls the scheduler's public methods (``owed``, ``replace_stuck``);
tests/test_scheduler_privates.py pins that it touches no private of the scheduler.

A batch that is stuck again more than ``max_retries`` times raises
:class:`StallError`, which carries every stack taken for it.

Stall limit, default (``stall_timeout="auto"``): ``max(FLOOR_S, P99_FACTOR x p99)``
where p99 is the 99th percentile of this loader's batch times as its workers
measured them (from publication back to the task's start), rounded up to a power of
two; while fewer than :data:`WARMUP_BATCHES` batches were timed, ``WARMUP_FLOOR_S``.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Any

from ._dispatch import Dispatch as Scheduler  # the scheduler's parts the watchdog calls
from ._executors import exited
from ._stacks import take_stack

__all__ = ["StallError", "Watchdog", "FLOOR_S", "P99_FACTOR", "WARMUP_BATCHES", "WARMUP_FLOOR_S",
           "DEFAULT_MAX_RETRIES"]

_LOG = logging.getLogger("mploader")

#: The default limit is never below this (seconds): a network filesystem's hiccup or
#: a garbage collection in the worker is not a hang.
FLOOR_S = 60.0
#: ... and is this multiple of the p99 batch time, so that a loader whose batches
#: legitimately take seconds (large images, long audio) keeps a wide margin.
P99_FACTOR = 10.0
#: Batches timed before the p99 is trusted; until then the limit is WARMUP_FLOOR_S.
WARMUP_BATCHES = 20
#: The limit while fewer than WARMUP_BATCHES batches were timed (seconds): the first
#: batches include imports, cold caches and the first open of every file.
WARMUP_FLOOR_S = 600.0
#: How often a batch may be loaded again after a stall before StallError.
DEFAULT_MAX_RETRIES = 1
#: How long the parent waits for a SIGKILLed worker to be gone (seconds).
KILL_WAIT_S = 5.0
#: The start-up deadline of a forked worker (seconds of the parent's time): from the
#: fork to the child's first step (mploader._metrics.booted).  In between run only the
#: interpreter's child-side clean-up and the at-fork handlers, microseconds; a child
#: still there after this is deadlocked on a lock another thread held at the fork
#: (CPython's thread states, a library's) and is killed and forked again.
BOOT_LIMIT_S = 10.0
#: Forks of one worker id that may miss the deadline, one after another, before
#: StallError: a fork that deadlocks every time is not retried for ever.
BOOT_RETRIES = 3


class StallError(TimeoutError):
    """A batch whose worker got stuck on it more than ``max_retries`` times.

    Attributes
    ----------
    seq : int
        The batch's sequence number in the engine.
    indices : object
        Its sample indices (what the sampler yielded).
    stacks : list of str
        The worker's Python stack (every thread, as ``faulthandler`` prints it) at
        each stall, oldest first; ``"(no stack: ...)"`` where none could be taken.
    """

    def __init__(self, message: str, seq: int, indices: Any, stacks: list[str]) -> None:
        super().__init__(message)
        self.seq = seq
        self.indices = indices
        self.stacks = stacks


def check_interval(limit_s: float) -> float:
    """Seconds between two checks: a tenth of the limit, within [0.05, 1]."""
    return min(1.0, max(0.05, limit_s / 10))


def _kill(w: Any) -> None:
    """SIGKILL worker ``w`` and reap it if it is gone within KILL_WAIT_S (one in
    uninterruptible sleep dies when the kernel lets it; the parent does not wait)."""
    try:
        os.kill(w.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if exited([w], KILL_WAIT_S):
        w.reap(block=True)


class Watchdog:
    """The parent's side (see the module docstring).  One per scheduler; called under
    the engine's lock.

    Parameters
    ----------
    stall_timeout : float, "auto" or None
        Seconds one batch may keep its worker busy; "auto": the default rule;
        None: no batch limit, only the forked workers' start-up deadline
        (BOOT_LIMIT_S).
    max_retries : int
        How often a batch is loaded again after a stall before StallError.
    """

    def __init__(self, stall_timeout: float | str | None, max_retries: int) -> None:
        # None: batches are never timed out, but forked workers keep their start-up deadline
        self.enabled = stall_timeout is not None
        self.fixed = None if stall_timeout in ("auto", None) else float(stall_timeout)
        self.max_retries = max_retries
        self.next_at = 0.0
        self.last = 0.0
        self.limit_s = self.fixed if self.fixed is not None else WARMUP_FLOOR_S
        self.limit_at = 0.0
        # worker -> [task start seen in its cell, seconds the parent has watched it]
        self.watched: dict[Any, list[float]] = {}
        self.stacks: dict[int, list[str]] = {}   # seq -> the stacks of its stalls
        self.stalls = 0
        self.respawns = 0
        self.boot_misses: dict[int, int] = {}   # worker id -> forks in a row that missed BOOT_LIMIT_S

    def limit(self, sched: Scheduler, now: float) -> float:
        """The stall limit in force (seconds), recomputed at most every 5 s."""
        if self.fixed is not None:
            return self.fixed
        if now >= self.limit_at:
            self.limit_at = now + 5.0
            busy = sched.res.busy
            timed, p99 = busy.p99() if busy is not None else (0, 0.0)
            self.limit_s = WARMUP_FLOOR_S if timed < WARMUP_BATCHES else max(FLOOR_S, P99_FACTOR * p99)
        return self.limit_s

    def check(self, sched: Scheduler, now: float) -> None:
        """Look at every live worker's task in progress (at most every
        :func:`check_interval`); replace the stuck ones.  Raises StallError."""
        if now < self.next_at:
            return
        limit = self.limit(sched, now) if self.enabled else float("inf")
        interval = check_interval(min(limit, BOOT_LIMIT_S))
        # Only time the parent saw pass counts, each gap at most twice the interval: a
        # job stopped (SIGSTOP, a paused container) does not make its workers stuck.
        step = min(now - self.last, 2 * interval) if self.last else 0.0
        self.last = now
        self.next_at = now + interval
        busy = sched.res.busy
        if busy is None:
            return
        starts = busy.starts()
        stuck = []
        if len(self.watched) > len(sched.res.workers):   # workers gone since (stopped, replaced)
            self.watched = {w: v for w, v in self.watched.items() if w in sched.res.workers}
        booting = []
        for w in sched.res.workers:
            start = starts.get(id(w), 0.0)
            if start >= 0 and w.status is None and w.wid in self.boot_misses:
                del self.boot_misses[w.wid]   # this fork of it took its first step
            if w.status is not None or not start:
                self.watched.pop(w, None)
                continue
            seen = self.watched.get(w)
            if seen is None or seen[0] != start:
                self.watched[w] = seen = [start, min(now - abs(start), step)]
            else:
                seen[1] += step
            if start < 0:
                if seen[1] > BOOT_LIMIT_S and now + start > BOOT_LIMIT_S:
                    booting.append(w)
            elif seen[1] > limit and now - start > limit:
                stuck.append(w)
        for w in booting:
            self._boot_missed(sched, w, now + self.watched.pop(w)[0])
        for w in stuck:
            self._replace(sched, w, now - self.watched.pop(w)[0])

    def _boot_missed(self, sched: Scheduler, w: Any, waited_s: float) -> None:
        """A forked worker that never took its first step: killed and forked again,
        its tasks given to the new one (or others), as a stuck worker's; StallError
        once BOOT_RETRIES forks of its id in a row missed the deadline."""
        stack = take_stack(w.pid)   # (none, as a rule: its handler is installed later, in the worker)
        misses = self.boot_misses[w.wid] = self.boot_misses.get(w.wid, 0) + 1
        self.stalls += 1
        _LOG.warning("mploader: worker %d (pid %d) did not start within %.1f s of its fork (deadline %.1f s; "
                     "a lock held by another thread at the fork, as a rule): killing it and forking it again; "
                     "its stack:\n%s", w.wid, w.pid, waited_s, BOOT_LIMIT_S, stack)
        _kill(w)
        if misses > BOOT_RETRIES:
            task = sched.owed(w)
            raise StallError(
                f"worker {w.wid} did not start within {BOOT_LIMIT_S:.0f} s of its fork {misses} times in a row "
                f"(each time deadlocked before its first step, as a rule on a lock another thread of this "
                f"process held at the fork); use start_method='forkserver' or 'spawn'",
                task.seq if task is not None else -1, task.indices if task is not None else None, [stack])
        sched.replace_stuck(w)
        self.respawns += 1

    def _replace(self, sched: Scheduler, w: Any, busy_s: float) -> None:
        task = sched.owed(w)
        stack = take_stack(w.pid)
        self.stalls += 1
        what = (f"batch {task.seq} (sample indices {task.indices!r:.200})" if task is not None
                else "a batch of an abandoned pass")
        _LOG.warning("mploader: worker %d (pid %d) has worked on %s for %.1f s (stall limit %.1f s): "
                     "killing it and loading the batch again; its Python stack:\n%s",
                     w.wid, w.pid, what, busy_s, self.limit_s, stack)
        stacks = None
        if task is not None:
            stacks = self.stacks.setdefault(task.seq, [])
            stacks.append(stack)
        _kill(w)
        if stacks is not None and task is not None and len(stacks) > self.max_retries:
            joined = "\n\n".join(f"--- stall {k + 1} ---\n{s}" for k, s in enumerate(stacks))
            raise StallError(
                f"batch {task.seq} (sample indices {task.indices!r:.200}) got its worker stuck {len(stacks)} times "
                f"(stall limit {self.limit_s:.1f} s, max_retries={self.max_retries}); the workers' stacks:\n{joined}",
                task.seq, task.indices, list(stacks))
        # What it sent before it died counts as delivered; what it had not finished is
        # given again, same seq and slot, the replacement starts now.
        sched.replace_stuck(w)
        self.respawns += 1
