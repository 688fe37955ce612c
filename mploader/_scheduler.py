"""The scheduler: the batch loop of one engine, its counters and its reports.

One :class:`Scheduler` per engine owns the parent's side of the protocol of
docs/design.md ("Slot protocol", "Wire protocol"); a :class:`~mploader._run.Run`
is one pass over a task stream (an epoch) and only asks the scheduler for its next
batch.  The scheduler is three parts, one module each, stacked by role:

* :mod:`._receive` (the base): waiting for batches, reading the sockets, the
  workers' health, stale batches, retirement, and :meth:`~Receive.reset`, the one
  path by which workers are given up ("stop", "failure", "dead");
* :mod:`._dispatch`: tasks to workers and slots, the records' flow to the sockets;
* this module: :meth:`Scheduler.next_batch` (the loop: fill, await, consume), the
  consumption of a batch, the depth of the queue, and what the engine asks of the
  scheduler (:meth:`Scheduler.report`, :meth:`Scheduler.attach`, ...): the engine
  calls these methods and never touches the scheduler's fields.

Each worker's state lives in its :class:`~mploader._channel.Channel`.  Read top
down: :meth:`Scheduler.next_batch` -> ``_fill`` / ``_dispatch`` -> ``_await`` ->
:meth:`Scheduler._consume`; failures end in ``reset("failure")``.

Threading: every entry point runs under the engine's lock, so ``close()`` from
another thread waits until a ``next()`` in progress has returned or raised (a
waiting ``next()`` notices ``closing`` within one wait slice, POLL_S).
"""
from __future__ import annotations

import collections
import functools
import itertools
import pickle
import weakref
from collections.abc import Callable
from typing import Any

from . import _bad_samples, _memory, _ring, _steps, _watchdog
from ._channel import Channel, Task
from ._descriptor import PIPE_SIDE, decode, pipe_side, side_record
from ._dispatch import Dispatch
from ._errors import BatchFailure, WorkerError
from ._metrics import COUNTER_KEYS, Meter, Snapshot, engine_stats
from ._options import SMALL_BATCHES_BYTES
from ._protocol import PIPE_HEADER
from ._receive import ANY_POLL_S, POLL_S, REASONS
from ._run import EMPTY, Run, cancel_dropped
from ._waiting import spin_for

__all__ = ["Scheduler", "Run", "POLL_S", "ANY_POLL_S", "REASONS", "STAGE_NEXT_EPOCH", "STAGE_KEYS"]

_EMPTY = EMPTY   # (the name bench/metrics_cost.py uses)

#: Whether runs dispatch the next epoch's first tasks ahead where their face predicts
#: them (docs/design.md, "No gap between epochs"); the start-up suite's A/B (a loader
#: named ``<name>/unstaged``, bench/mploader_bench/startup.py) and the tests turn it off.
STAGE_NEXT_EPOCH = True
#: ``stats()`` keys of the staging: batches dispatched ahead, taken over by the next
#: epoch, dropped (the next epoch asked for other batches, or the workers stopped).
STAGE_KEYS = ("staged", "staged_used", "staged_dropped")


class Scheduler(Dispatch):
    """The parent's side of the engine (see the module docstring).

    Parameters
    ----------
    engine : Engine
        Held through a weak proxy: the engine owns the scheduler and must not be
        kept alive by it.  The scheduler reads its options and ``closing``, and
        calls ``start_worker`` when a worker is missing (``staff``, ``start_successor``).
    res : _Resources
        The engine's region, busy cells and transport, and the list of workers,
        which the scheduler writes (mploader._engine._Resources).
    lock : threading.RLock
        The engine's lock, under which every entry point runs.
    """

    def __init__(self, engine: Any, res: Any, lock: Any) -> None:
        # A proxy: the engine owns the scheduler, and must not be kept alive by it
        # (dropping the loader stops the workers without waiting for the cyclic GC).
        self.engine = weakref.proxy(engine)
        self.res = res
        self.seq = 0
        self.slot_hint = 0
        self.pick_from = 0   # where the least-loaded pick starts looking (Dispatch._running_worker)
        self.generation = 0          # bumped when all workers are killed after a failure
        self.stale: list[Task] = []
        self.stale_pipe: set[int] = set()
        self.warned_full = False
        self.file_bytes = 0
        self.spin_s = spin_for(engine.num_workers)
        # Batches kept in flight: prefetch, raised towards auto_prefetch while batches
        # are small (see _adapt_depth); a deeper queue costs fewer wake-ups per batch.
        self.depth = engine.prefetch
        self.auto_max = engine.auto_prefetch or engine.prefetch
        self.calm = 0                # batches to wait before the depth rises again (_adapt_depth)
        # The channels that hold task records (buffered for _steps.flush's one send() per
        # worker, or never sent to a dead worker, for _resend): a dict used as an ordered
        # set; each channel owns its records (Channel.pending, Channel.unsent).
        self.outbox: dict[Channel, None] = {}
        # Runs superseded or dropped (weak references, appended by their death) whose
        # batches in flight are not yet stale, and each run's inflight deque.
        self.dropped: list[weakref.ref] = []
        self.runs: dict[weakref.ref, collections.deque] = {}
        self.cancels: set[weakref.ref] = set()   # runs' second references (adopt, cancel_dropped), some dead
        # The next epoch's first tasks, dispatched ahead while the current epoch ends (a
        # Run that is never iterated; None: nothing staged), and the run whose successor
        # they are for: docs/design.md, "No gap between epochs" (_stage, take_staged,
        # _take_over).
        self.staged: Run | None = None
        self.staged_after: weakref.ref | None = None
        self.stats: collections.Counter = collections.Counter()
        self.meter = Meter()         # input-pipeline metrics (_metrics; Run.__next__ times the waits)
        # What the ring's FREE slots hold, and the memory budget's rules (_memory)
        self.memory = _memory.RingMemory(engine.num_slots, engine.on_grow is not None, lock, res,
                                         engine.shared_mem or 0)
        # Stuck workers replaced while the parent waits (_watchdog), and forked workers
        # that never started (with stall_timeout=None: only the latter)
        self.watchdog = _watchdog.Watchdog(engine.stall_timeout, engine.max_retries)
        # The bad samples' report and budget (_bad_samples; None: on_error="raise")
        self.ledger = (_bad_samples.Ledger(engine.max_bad_fraction, engine.max_bad_samples, engine.bad_sample_log)
                       if engine.on_error != "raise" else None)

    # ---- the batch loop ----

    def next_batch(self, run: Run) -> None:
        """Put the run's next batch in ``run.handoff`` (see :class:`Run`), or raise."""
        inflight = run.inflight
        while inflight and inflight[0].consumed:  # an interrupt hit after its batch was handed off
            inflight.popleft()
        if run.handoff is not _EMPTY:
            return
        self._reap_stale()
        self._reap_retired()
        if self.memory.outliers:
            self.memory.trim_outliers()
        try:
            first = run.staged is not None and not run.inflight   # (the call that begins the take-over)
            if run.staged is not None:   # the run's first calls: the tasks dispatched ahead for it
                self._take_over(run)
            self._fill(run)
            # Not in the call that begins a take-over: the next call stages, so the
            # epoch's first batch does not wait for the following epoch's prediction and
            # dispatch (they queue behind this epoch's tasks either way).  Once every task
            # left of the pass is staged for this run (``Run.whole``), as soon as the
            # source is exhausted: the workers never run dry while the run compares.
            if ((run.exhausted or (run.staged is not None and run.staged.whole and not run.staged.pushback))
                    and STAGE_NEXT_EPOCH and not first and (run.lookahead is not None or self.staged is not None)):
                self._stage(run)
            if not inflight:
                if run.source_error is not None:
                    self._source_failed(run)
                if self.memory.held:
                    # the epoch is over: this ring is idle until its next one
                    self.memory.trim_at_epoch_end(_memory.budget_bytes())
                raise StopIteration
            task = inflight[0] if run.in_order else self._first_ready(run)
            self._await(task)
            if self.ledger is not None:   # its bad samples' reports came before it: settle them
                self._pump(task.worker, 0)
                self.ledger.settle(task.seq, task.epoch, _bad_samples.count_samples(task.indices))
            self._consume(task, run)   # raises the worker's exception (batch consumed)
        except (WorkerError, TimeoutError, _bad_samples.BadSampleBudgetError):
            run.inflight.clear()
            run.done = True
            staged, run.staged = run.staged, None
            if staged is not None:   # (its tasks go with the workers: their slots are reclaimed by the reset)
                self.stats["staged_dropped"] += len(staged.inflight)
                staged.inflight.clear()
            self.reset("failure")
            raise
        finally:
            if run.in_order:  # only the head is ever consumed
                while inflight and inflight[0].consumed:
                    inflight.popleft()
            elif inflight:
                for t in [t for t in inflight if t.consumed]:
                    inflight.remove(t)
        if run.upstream_pulls:
            # The batch is in the hand-off: what the sampler raises here propagates
            # (recorded in run.source_error) and the next call returns the batch.
            self.pull_ahead(run)

    def pull_ahead(self, run: Run) -> None:
        """Pull ``run``'s source until ``depth`` of its items are pulled and not handed
        off (in flight or pushed back), as torch's and Gluon's multi-process iterators
        keep ``prefetch`` indices sent beyond the batches returned: called after each
        hand-off of a run with ``upstream_pulls``, so that the sampler's side effects
        (the carry of ``last_batch='rollover'``, torch's ``RandomSampler`` drawing its
        next pass's ``randperm`` at the end of its pass) happen at the same ``next()``
        as upstream's (docs/design.md, "Batches in flight", *When the sampler is
        pulled*).  Nothing while the depth is above ``prefetch`` (small batches: the
        deeper queue, not upstream's anyway, pulls as it dispatches, in bursts).
        Dispatch stays with :meth:`_fill`.  Raises what the source raises (recorded in
        ``run.source_error`` by ``_steps.pull``)."""
        if run.staged is not None:   # taking staged tasks over: the step pulls as upstream's
            self._take_over(run)
            return
        if self.depth > self.engine.prefetch or run.exhausted or run.source_error is not None:
            return
        room = self.depth - len(run.inflight) - len(run.pushback)
        if room > 0:
            _steps.pull(run, room)

    def _consume(self, task: Task, run: Run) -> None:
        """Turn a task whose batch is there into ``run.handoff``: the batch, or the
        worker's exception (or the reason the batch cannot be read), which
        ``Run.__next__`` raises.  The batch is read first (an interrupt there leaves
        it with the task, to be read again); then one C call hands it off, marks the
        task consumed and takes the lease from ``task.box`` (``_steps.hand_off``), so an
        interrupt at any point loses nothing (docs/design.md, "Faults")."""
        failed = False
        side = None   # the batch's side record (mploader._face.Face.side), for a tagged run
        if task.via_pipe:
            msg = task.worker.mailbox[task.seq]
            kind = PIPE_HEADER.unpack_from(msg)[1]
            try:
                if kind & PIPE_SIDE:
                    kind &= ~PIPE_SIDE
                    data, side = pipe_side(msg)
                    value = pickle.loads(data)
                else:
                    value = pickle.loads(memoryview(msg)[PIPE_HEADER.size:])
                if kind == _ring.KIND_ERROR:
                    value, failed = _failure_exception(value), True
            except Exception as exc:  # noqa: BLE001 -- an unreadable batch is used up: next() raises it
                value, failed = exc, True
            _steps.hand_off(run, task, value, failed, task.worker.mailbox, side)
            if kind == _ring.KIND_ERROR:
                self.stats["errors"] += 1
            elif not failed:
                self.stats["fallback_pipe"] += 1
                self.stats["batches"] += 1
                self.meter.bytes += len(msg) - PIPE_HEADER.size
            return
        lease = task.box[0]
        if lease.seq != task.seq:
            _steps.hand_off(run, task, RuntimeError(f"slot {task.slot} holds batch {lease.seq}, expected batch "
                                                  f"{task.seq}: the slot header was overwritten"), True, None)
            return
        if lease.flags & _ring.FLAG_GROWN:
            self.stats["grown"] += 1
            self._note_growth()
        nbytes = lease.nbytes
        kind = lease.kind
        try:
            if kind == _ring.KIND_ERROR:
                value, failed = _failure_exception(decode(lease, lease.desc_off, lease.desc_len, copy=True)), True
            else:
                desc_off, desc_len = lease.desc_off, lease.desc_len
                value = decode(lease, desc_off, desc_len, self.engine.copy, self.engine.copy_below_bytes)
                if nbytes > desc_off + desc_len:   # (the bytes after the descriptor: a side record)
                    side = side_record(lease)
        except Exception as exc:  # noqa: BLE001 -- a corrupt descriptor uses the batch up: next() raises it
            value, failed = exc, True
        _steps.hand_off(run, task, value, failed, None, side)
        if failed:
            if kind == _ring.KIND_ERROR:
                self.stats["errors"] += 1
            return
        self.meter.bytes += nbytes
        if self.auto_max != self.engine.prefetch and (
                self.depth < self.auto_max or nbytes * self.depth > SMALL_BATCHES_BYTES):
            self._adapt_depth(nbytes)  # (else the depth is already what it would set)
        memory = self.memory
        memory.recent.append(nbytes)
        budget = _memory.budget_bytes()
        capacity = lease.capacity
        if capacity * (self.depth + 2) > budget:   # in flight, held by the loop, just dropped
            self.depth = _memory.depth_cap(capacity, budget)
        elif self.depth < self.engine.prefetch and capacity * (self.engine.prefetch + 2) <= budget:
            self.depth = self.engine.prefetch
        if (memory.capacity[task.slot] != capacity and memory.note(task.slot, capacity)) or memory.held > budget:
            memory.trim_to_budget(budget)
        self.stats["batches"] += 1
        self.stats["fallback_inband" if lease.flags & _ring.FLAG_INBAND else "slot"] += 1

    def _source_failed(self, run: Run) -> None:
        """The run's source raised (``run.source_error``) and every batch pulled before
        was delivered: end the run with an error, never StopIteration."""
        err = run.source_error
        exc = RuntimeError(
            f"this pass cannot go on: its sampler's iterator raised {type(err).__name__} inside it, which ends "
            f"a Python generator; every batch it gave before was delivered; start a new pass (iter(loader))")
        run.done = True
        raise exc from err

    def _adapt_depth(self, nbytes: int) -> None:
        """Default prefetch only: keep as many batches in flight as fit
        SMALL_BATCHES_BYTES (one more per batch while below, at once back down when
        batches grow), between ``prefetch`` and ``auto_prefetch`` (docs/design.md,
        "Batches in flight")."""
        fit = SMALL_BATCHES_BYTES // max(nbytes, 1)
        target = max(self.engine.prefetch, min(self.auto_max, fit))
        if target < self.depth:
            self.depth = target
            # Held down for a window of batches: with large batches among small ones
            # (one in five of 32 MiB), rising again at the next small batch kept a
            # deep queue of a mixture in flight, a fifth of it large (1.1 GB).
            self.calm = _memory.WINDOW
        elif self.calm:
            self.calm -= 1
        else:
            self.depth = min(target, self.depth + 1)

    def _note_growth(self) -> None:
        region = self.res.region
        size = region.file_bytes
        if size != self.file_bytes:
            self.file_bytes = size
            if self.engine.on_grow is not None:
                covered = self.engine.on_grow(region)
                if covered is not None and covered < size:
                    self.file_bytes = covered  # the rest is not in the file yet: again next batch

    # ---- no gap between epochs ----

    def _stage(self, run: Run) -> None:
        """``run``'s source is exhausted, or what is left of its pass is all staged for it
        and being taken over (the whole predicted pass: ``Run.whole``): dispatch the next
        epoch's first tasks, as its face predicts them (``run.lookahead``), into the
        depth the run no longer uses (its tasks and those staged for it counted) --
        only where a worker runs and a slot is FREE now (``_dispatch_ready``: no wait, no
        worker started, never the pipe).  They belong to a run of their own
        (``self.staged``, never iterated), which the next run takes over if its own
        first tasks are the same (:meth:`_take_over`), and which is abandoned like any
        other run otherwise.  A prediction that raises stages nothing more."""
        staged = self.staged
        if staged is None:
            make, run.lookahead = run.lookahead, None
            if make is None:
                return
            # Drawn here, at most as many as can ever be in flight: the staged run's
            # source is then a list's iterator, which no interrupt can break (a
            # KeyboardInterrupt inside a Python generator would finish it and be kept,
            # with its traceback, in the staged run).
            try:
                source = make()
                ahead = list(itertools.islice(source, max(self.depth, self.auto_max))) if source is not None else []
            except Exception:  # noqa: BLE001 -- a prediction that fails only costs the gap
                return
            if not ahead:
                return
            staged = Run(self.engine, self, iter(ahead), run.in_order, run.tagged, staged=True)
            staged.whole = len(ahead) < max(self.depth, self.auto_max)   # the whole predicted pass
            # Its tasks still in it when it dies were neither taken over nor dropped by a
            # step (the run that took it was collected before its first next()): dropped.
            weakref.finalize(staged, _count_dropped, self.stats, staged.inflight).atexit = False
            self.staged_after = run._ref
            self.staged = staged
        elif self.staged_after is not run._ref:
            return   # staged for another run's successor: left as it is until the next run
        room = self.depth - len(run.inflight) - len(staged.inflight) - (
            len(run.staged.inflight) if run.staged is not None else 0)
        room = min(room, self.memory.stage_room(_memory.budget_bytes()) - len(staged.inflight))
        if room <= 0 or staged.exhausted or staged.source_error is not None:
            return
        if not staged.pushback:
            _steps.pull(staged, room)   # (a list's iterator: raises nothing)
            if not staged.pushback:
                staged.exhausted = True
                return
        n = self._dispatch_ready(staged, len(staged.inflight) + room)
        if n:
            self.stats["staged"] += n
            if self.outbox:
                self._send_pending()

    def take_staged(self, in_order: bool, tagged: bool) -> Run | None:
        """The tasks dispatched ahead (a run never iterated), for a new run with these
        flags to take over at its first fill; None when nothing was staged.  Staged
        tasks of another kind of run are abandoned now."""
        staged, self.staged = self.staged, None
        self.staged_after = None
        if staged is None:
            return None
        if (staged.in_order, staged.tagged) != (in_order, tagged):
            self.stats["staged_dropped"] += len(staged.inflight)
            self.abandon(staged)
            return None
        return staged

    def staged_slots(self) -> list[int]:
        """The slots of the tasks dispatched ahead for the next epoch (ASSIGNED while
        a worker loads them, READY once it published them), in dispatch order.  Stale
        batches already published (a staging dropped while no run steps this engine:
        e.g. its run left in an interrupt's traceback) are freed first, as the next
        step would."""
        self._reap_stale()
        staged = self.staged
        return [t.slot for t in staged.inflight if t.slot >= 0] if staged is not None else []

    def _take_over(self, run: Run) -> None:
        """A step of ``run``'s take-over of the tasks staged for it (``run.staged``),
        at each of its calls while some are left: ``run`` pulls its own tasks as its
        upstream pulls them (``prefetch`` pulled and not handed off, at most the depth;
        at most ``pulled - handed off`` more after each hand-off: :meth:`pull_ahead`),
        and the staged tasks equal to the pulled ones -- same epoch, batch index,
        indices and worker, in order -- become ``run``'s in one step
        (``_steps.adopt``); the others wait for the pulls that follow.  The first
        difference, or the end of ``run``'s source, drops every staged task left: they
        are abandoned (their batches stale, their slots freed as they complete; the
        workers' cancel word only while none of ``run``'s tasks is in flight, as it
        covers every seq below it) and ``run`` dispatches its own tasks as usual.  So a
        run never gets a batch other than the one its own task asks for, nor out of
        its order.  While staged tasks are left, ``_fill`` dispatches nothing (they are
        the next in order).  Repeated harmlessly after an interrupt."""
        staged = run.staged
        assert staged is not None
        tasks = staged.inflight
        # As many as upstream's iterator keeps pulled and not handed off: a sampler's
        # side effects follow its pulls (torch's RandomSampler draws once more at the
        # end of its pass), so at upstream's depth the pulls are the same with the
        # staging or without; in a deeper queue they are upstream's, not a burst of the
        # whole depth at the epoch's first next() (docs/design.md, "No gap between epochs").
        want = min(self.depth, self.engine.prefetch) - len(run.inflight) - len(run.pushback)
        if want <= 0 and not run.pushback and tasks:
            return   # nothing to pull or compare now
        ended = run.exhausted or run.source_error is not None
        if want > 0 and not ended and tasks:
            try:
                ended = _steps.pull(run, want) < want
            except BaseException:
                # The sampler raised (a Ctrl-C in it): this pass cannot go on, and its
                # exception's traceback may keep the run alive -- the staged tasks must
                # not stay with it, holding their slots.
                self._drop_staged_for(run, staged)
                run.staged = None
                raise
        m = min(len(run.pushback), len(tasks))
        if m == 0 and not ended and tasks:
            return   # nothing pulled to compare yet: a later step
        # the equal ones, up to the first that differs or is no longer of these workers
        n = _steps.adopt(run, staged, self.generation) if m else 0
        if n:
            self.stats["staged_used"] += n
            if tasks and n == m and not ended:
                return   # the rest: compared as the run pulls on
        if tasks:   # (first: while the run holds it, its death cannot send the cancel word)
            self._drop_staged_for(run, staged)
        run.staged = None

    def _drop_staged_for(self, run: Run, staged: Run) -> None:
        """The tasks left in ``staged`` will not be ``run``'s: counted as dropped, their
        batches stale (slots freed as they complete); the workers skip those not begun
        only while no task of ``run`` is in flight (the cancel word covers every seq
        below it, and ``run``'s adopted tasks are below the staged ones).  Called while
        ``run.staged`` still holds ``staged``: its death, which sends the cancel word for
        the tasks it still holds, cannot come before they are made stale and cleared."""
        self.stats["staged_dropped"] += len(staged.inflight)
        if not run.inflight:
            self.abandon(staged)
        else:
            self.abandon_quietly(staged)
        if self.staged is not None and self.staged_after is run._ref:
            # Staged for run's successor while run took its own over (Run.whole): run's
            # tasks dispatched from now on come after them, so run's cancel word, when it
            # is superseded, would cover them; and the prediction was wrong once already.
            self.drop_staged()

    # ---- runs ----

    def adopt(self, run: Run, staged: bool = False) -> tuple[Meter, collections.Counter, weakref.ref]:
        """A new run: the epoch's meter restarts, and the run is followed so that, dropped
        mid-epoch, it hands its batches in flight back as stale (their slots freed as they
        complete): its death appends its weak reference to ``dropped`` (a C call: nothing
        an interrupt can cut), and the next step takes them (``_steps.abandon_runs``); a
        second reference, whose callback holds neither the run nor the scheduler, tells
        the workers at once to skip its tasks they have not started (only speeds things
        up; the dead ones are pruned here).  Returns what ``Run.__next__`` uses: the
        meter, the counters, and the run's first weak reference (for :meth:`abandon`).
        ``staged``: a run of tasks dispatched ahead (:meth:`_stage`): the epoch's meter
        goes on."""
        if not staged:
            self.meter.begin_epoch()
        ref = weakref.ref(run, self.dropped.append)
        self.runs[ref] = run.inflight
        cancels = self.cancels
        if cancels:
            cancels.difference_update([r for r in cancels if r() is None])
        cancels.add(weakref.ref(run, functools.partial(cancel_dropped, self.res, run.inflight)))
        return self.meter, self.stats, ref

    def abandon(self, run: Run) -> None:
        """``run`` was superseded (a newer run, stopped workers): its batches in flight
        become stale, and the workers skip those they have not started."""
        cancel_dropped(self.res, run.inflight)
        self.dropped.append(run._ref)
        _steps.abandon_runs(self)

    # ---- what the engine asks ----

    def worker_pids(self) -> list[int]:
        """The PIDs of the workers that are running (not yet seen exited), in start order."""
        return [w.pid for w in self.res.workers if w.status is None]

    def memory_stats(self) -> dict[str, int]:
        """``memory_budget_bytes`` (this process's rings together) and
        ``memory_held_bytes`` (this ring's slots, as the parent last saw them)."""
        return {"memory_budget_bytes": _memory.budget_bytes(), "memory_held_bytes": self.memory.held}

    def attach(self, region: Any, busy: Any) -> None:
        """The engine made the ring ``region`` and, when not None, the workers' busy
        cells ``busy`` (mploader._metrics.BusyCells)."""
        self.file_bytes = region.file_bytes
        if busy is not None:
            self.meter.busy = busy

    def close(self) -> None:
        """The engine closes: the batches of abandoned runs are forgotten, and so is
        what was staged for the next epoch."""
        self.staged = self.staged_after = None
        self.stale.clear()

    def set_report(self, report: Callable[[], None] | None, every_s: float) -> None:
        """Call ``report`` at the first ``next()`` after every ``every_s`` seconds (None: never)."""
        self.meter.set_report(report, every_s)

    def bad_sample_state(self) -> dict | None:
        """The bad samples' report and budget counts (JSON-safe); None with ``on_error="raise"``."""
        return self.ledger.state() if self.ledger is not None else None

    def load_bad_samples(self, parsed: tuple) -> None:
        """Restore :func:`mploader._bad_samples.parse_state`'s result (a checkpoint's)."""
        if self.ledger is not None:
            self.ledger.load(parsed)

    def report(self, run: Run | None) -> dict:
        """The engine's ``stats()`` (docs/metrics.md): the counters, the ring's slots
        and bytes, the memory budget, the metrics of :func:`mploader._metrics.engine_stats`
        (from a :class:`~mploader._metrics.Snapshot` taken here; ``run``: the current
        run, whose batches in flight count as ready or held), the watchdog's and the
        bad samples' counts.  Safe from another thread than the iterating one (a
        reading racing an update is off by one batch)."""
        counts = self.stats
        out: dict[str, Any] = {k: counts.get(k, 0) for k in COUNTER_KEYS}
        for k in STAGE_KEYS:   # (no gap between epochs: batches dispatched ahead, taken over, dropped)
            out[k] = counts.get(k, 0)
        region = self.res.region
        out["num_slots"] = self.engine.num_slots
        out["shm_bytes"] = region.file_bytes if region is not None else 0
        out.update(self.memory_stats())
        out.update(engine_stats(self.snapshot(run), self.meter))
        watchdog = self.watchdog
        out["stalls"] = watchdog.stalls if watchdog is not None else 0
        out["respawns"] = watchdog.respawns if watchdog is not None else 0
        ledger = self.ledger
        out.update(ledger.stats() if ledger is not None else {"bad_samples": [], "bad_sample_count": 0})
        return out

    def snapshot(self, run: Run | None) -> Snapshot:
        """What the metrics read of this engine, copied now (:class:`mploader._metrics.Snapshot`)."""
        engine = self.engine
        counts = self.stats
        ready, held = self._occupancy(run)
        return Snapshot(counts={k: counts.get(k, 0) for k in COUNTER_KEYS}, num_workers=engine.num_workers,
                        forked=engine.start_method == "fork",
                        worker_pids=self.worker_pids(),
                        ready_batches=ready, held_slots=held)

    def _occupancy(self, run: Run | None) -> tuple[int, int]:
        """(batches published and waiting to be returned, slots held by the user).

        READY slots are published and not taken; a batch whose lease the scheduler took
        but has not returned yet (``in_order=False`` looks ahead, an interrupt) is
        waiting too, and its LEASED slot is not the user's; pipe batches in a mailbox
        are waiting.  The other LEASED slots are held by batches the user still refers to.
        """
        region = self.res.region
        if region is None:
            return 0, 0
        for _ in range(3):
            try:
                inflight = list(run.inflight) if run is not None else []
                stale = list(self.stale)
                break
            except RuntimeError:  # the deque changed while another thread copied it
                continue
        else:
            inflight, stale = [], []
        ready = held = 0
        for slot in range(region.nslots):
            state = region.state(slot)
            if state == _ring.STATE_READY:
                ready += 1
            elif state == _ring.STATE_LEASED:
                held += 1
        for t in inflight:
            if t.consumed:
                continue
            if t.box:
                ready += 1
                held -= 1
            elif t.via_pipe and t.seq in t.worker.mailbox:
                ready += 1
        for t in stale:
            if t.box:
                held -= 1
        return ready, max(0, held)


def _count_dropped(stats: collections.Counter, inflight: collections.deque) -> None:
    """A staged run died: the tasks it still holds (none when it was taken over or
    abandoned, which empties it) count as dropped."""
    stats["staged_dropped"] += len(inflight)


def _failure_exception(failure: Any) -> BaseException:
    if isinstance(failure, BatchFailure):
        return failure.to_exception()
    return RuntimeError(f"a worker reported an unreadable failure record: {failure!r}")
