"""A run: one pass over a task stream (an epoch), as the faces iterate it.

:class:`Run` only asks the engine for its next batch (``Engine.next_batch``: under
the engine's lock, the scheduler puts it in ``run.handoff``) and hands it over; it
registers itself with the scheduler the engine gave it, so that a run dropped or
superseded mid-epoch hands its batches in flight back as stale (docs/design.md,
"Faults").  It reaches no private of the engine (tests/test_scheduler_privates.py).  The input-pipeline meter times
its ``next()`` (mploader._metrics).
"""
from __future__ import annotations

import collections
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ._channel import Task

__all__ = ["Run", "EMPTY", "Body", "cancel_dropped"]

#: ``Run.handoff`` when no batch waits in it.
EMPTY = object()
_EMPTY = EMPTY   # (the name bench/metrics_cost.py uses)

_clock = time.monotonic  # the metrics' clock (CLOCK_MONOTONIC, shared with the workers)


def cancel_dropped(res: Any, inflight: collections.deque, ref: Any = None) -> None:
    """A run was abandoned or dropped: the workers skip its tasks in flight that they
    have not started (``BusyCells.cancel_below``; seqs grow, and a run abandoned has
    dispatched nothing since a newer run began, so no live run's task is below the
    word).  Also the callback of the run's second weak reference (``ref``)."""
    busy = res.busy
    if inflight and busy is not None:
        busy.cancel_below(inflight[-1].seq + 1)   # (appended in seq order)


class Body:
    """A face iterator's ``_gen`` where its body is Python code (the torch and Chainer
    faces): an iterator whose ``__next__`` is the face iterator's ``_mpl_next``, which
    :func:`mploader._steps.serial_next` calls with the face iterator's lock held.
    Holds the face iterator weakly (no iterator <-> body cycle); once it is gone,
    ``next()`` raises StopIteration."""

    __slots__ = ("it",)

    def __init__(self, it: Any) -> None:
        self.it = weakref.ref(it)

    def __iter__(self) -> Body:
        return self

    def __next__(self) -> Any:
        it = self.it()
        if it is None:
            raise StopIteration
        return it._mpl_next()


class Run:
    """One pass over a task stream (an epoch).  ``next()`` returns the next batch in
    task order (or completion order with ``in_order=False``); an exception raised
    by ``dataset[i]`` or collation consumes only its own batch.

    Raises
    ------
    WorkerError
        A worker died owing a batch; the run ends and the workers are restarted by
        the next run.
    TimeoutError
        A batch took longer than ``timeout_s`` (time the process was stopped does not
        count); the run ends.
    RuntimeError
        The run was superseded by a newer one, the loader was closed, or it is used
        in a forked child of the process that created it.
    Exception
        Whatever ``dataset[i]`` or collation raised, with its original type; its
        ``__cause__`` is a :class:`~mploader._errors.WorkerTraceback`.
    """

    def __init__(self, engine: Any, scheduler: Any, tasks: Iterable[tuple], in_order: bool,
                 tagged: bool = False, staged: bool = False) -> None:
        # ``engine``: the Engine, whose public ``next_batch(run)`` takes its lock, checks
        # the process and asks the scheduler (a run keeps its engine alive); per batch
        # ``self._engine.next_batch``: two attribute lookups that CPython 3.11 specialises
        # (a bound method kept in the run would be one lookup that it does not).
        self._engine = engine
        # ``scheduler``: the engine's Scheduler (adopt below, abandon)
        self._scheduler = scheduler
        # ``tagged``: next() returns (worker id, batch index, batch or exception, failed, side)
        # and raises no worker exception (_steps.hand_off; the torch and Chainer faces)
        self.tagged = tagged
        self.source: Iterator[tuple] = iter(tasks)
        self.pushback: collections.deque = collections.deque()
        self.inflight: collections.deque[Task] = collections.deque()
        self.in_order = in_order
        self.handoff: Any = EMPTY  # the next batch, between the scheduler and __next__
        self.failed = False         # handoff is an exception for __next__ to raise
        self.source_error: BaseException | None = None  # what the source raised (_steps.pull)
        self.exhausted = False
        self.done = False
        self.superseded = False
        # No gap between epochs (docs/design.md): ``lookahead``, the face's prediction of
        # the next epoch's tasks (a callable returning an iterator of them, or None), which
        # the scheduler dispatches ahead once this run's source is exhausted; ``staged``,
        # the run holding the tasks so dispatched before this run began, which its first
        # fill takes over when they equal its own first tasks (Scheduler._take_over).
        self.lookahead: Callable[[], Iterator[tuple] | None] | None = None
        self.staged: Run | None = None
        self.whole = False   # (a staged run) its tasks are the whole predicted pass
        # After each hand-off the source is pulled as torch's and Gluon's iterators pull
        # their batch sampler (Engine.run's ``upstream_pulls``; Scheduler.pull_ahead).
        self.upstream_pulls = False
        # The scheduler's meter times next() (its counters restart with the run), and the
        # run's weak reference (self._ref) hands its batches in flight back as stale once
        # it is dropped (Scheduler.adopt).
        # ``staged``: this run holds tasks dispatched ahead for the next epoch (it is never
        # iterated; the epoch's meter is not restarted for it).
        self._meter, self._counts, self._ref = scheduler.adopt(self, staged)

    def __iter__(self) -> Run:
        return self

    def __next__(self) -> Any:
        if self.done:  # first: an exhausted run stays exhausted (Python's iterator protocol)
            raise StopIteration
        if self.superseded:
            raise RuntimeError("this iterator was superseded by a newer iteration of the same loader")
        meter = self._meter
        t0 = _clock()
        if t0 >= meter.tick_at:  # the run's first two calls, a window mark, a periodic report
            meter.tick(t0, self._counts)
        try:
            self._engine.next_batch(self)
        except StopIteration:
            self.done = True
            meter.finish(_clock())
            raise
        finally:
            # Before the handoff is read: an interrupt here leaves the batch in the run.
            meter.wait += _clock() - t0
        # Taken with no call and no jump between the read and the return (CPython 3.10
        # runs pending handlers at every jump, 3.11+ at backward ones; all of them after
        # a call returns): an interrupt cannot land after the batch left the run and
        # before the caller has it.
        if self.failed:  # the worker's exception (it consumed its batch)
            self.failed = False
            exc = self.handoff
            self.handoff = EMPTY
            raise exc
        batch = self.handoff
        self.handoff = EMPTY
        return batch

    def drained(self) -> bool:
        """Whether every batch of the run was taken, though ``next()`` has not yet
        raised StopIteration: the source is exhausted, nothing is in flight or pushed
        back, no batch or error waits in the handoff (a trainer that takes
        ``len(loader)`` batches and never asks for the end, as Lightning's fetcher)."""
        return (self.exhausted and not self.inflight and not self.pushback and self.handoff is EMPTY
                and self.source_error is None)

    def abandon(self) -> None:
        """Superseded (a newer run, stopped workers): the batches in flight become
        stale, and the workers skip those they have not started.  A run already
        :meth:`drained` ends instead: its ``next()`` raises StopIteration, as torch's
        exhausted iterator does.  Tasks staged for this run and not yet taken over go
        too (an interrupt in its sampler at its first fill keeps the run alive in the
        exception's traceback: they would hold their slots until it is collected).
        Called under the engine's lock."""
        staged, self.staged = self.staged, None
        if staged is not None:
            self._counts["staged_dropped"] += len(staged.inflight)
            self._scheduler.abandon(staged)
        if self.drained():
            self.done = True
            return
        self.superseded = True
        self._scheduler.abandon(self)
