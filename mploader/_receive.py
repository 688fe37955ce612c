"""The scheduler's receiving side: waiting for batches, reading the workers' sockets,
the workers' health, stale batches, retirement, and the one reset path.

:class:`Receive` is the base of :class:`~mploader._scheduler.Scheduler` (with
:class:`~mploader._dispatch.Dispatch` between them): read top down,
:meth:`Receive._await` / :meth:`Receive._first_ready` wait for a task's batch,
:meth:`Receive._check_wait` is every wait slice's round (the sockets, the health
of the workers, the watchdog, the timeout), and :meth:`Receive.reset` is the only
place where workers are given up with what they held (reason "stop", "failure" or
"dead").  The state lives on the scheduler (its ``__init__``) and on each worker's
:class:`~mploader._channel.Channel`.
"""
from __future__ import annotations

import collections
import time
from typing import Any

from . import _bad_samples, _ring, _steps
from ._channel import Channel, Task, take
from ._errors import UNKNOWN_STATUS, WorkerError
from ._executors import CLOSE_GRACE_S, exited, stop_workers
from ._metrics import Meter
from ._protocol import PIPE_HEADER
from ._run import Run
from ._waiting import WaitClock

__all__ = ["Receive", "POLL_S", "ANY_POLL_S", "REASONS"]

#: How often a waiting parent checks for dead workers, timeouts and close() (seconds).
POLL_S = 0.05
#: Wait slice when batches are taken in completion order (in_order=False): the
#: parent cannot sleep on several futex words at once, so it looks at every slot
#: in flight at least this often (seconds).
ANY_POLL_S = 0.002
#: Why workers are given up (:meth:`Receive.reset`).
REASONS = ("stop", "failure", "dead")


class Receive:
    """The scheduler's receiving side and the workers' health (see the module docstring)."""

    # The scheduler's state this part reads and writes (set in Scheduler.__init__)
    engine: Any                  # a weak proxy of the Engine: its options, closing, start_worker
    res: Any                     # the engine's _Resources: region, workers (channels), busy
    generation: int
    stale: list[Task]
    stale_pipe: set[int]
    spin_s: float
    stats: collections.Counter
    meter: Meter
    watchdog: Any                # mploader._watchdog.Watchdog or None
    ledger: _bad_samples.Ledger | None
    outbox: dict[Channel, None]    # the channels that hold records (pending or unsent)
    staged: Run | None             # the next epoch's tasks dispatched ahead (Scheduler._stage)
    dropped: list                  # weak references of runs superseded or dropped (_steps.abandon_runs)

    @property
    def pending(self) -> list[Channel]:
        """The channels with task records buffered and not yet sent (``Channel.pending``)."""
        return [w for w in self.outbox if w.pending]

    @property
    def unsent(self) -> list[Channel]:
        """The channels with records that never reached their (dead) worker (``Channel.unsent``)."""
        return [w for w in self.outbox if w.unsent]

    def _settle(self, w: Channel) -> None:
        """``w`` leaves the outbox once it holds no record."""
        if not w.pending and not w.unsent:
            self.outbox.pop(w, None)

    # ---- waiting for a batch ----

    def _first_ready(self, run: Run) -> Task:
        """in_order=False: the first batch in flight that is ready, waiting in short
        slices (health, timeout and close checked as for an in-order wait)."""
        region = self.res.region
        oldest = run.inflight[0]
        clock = WaitClock()
        while True:
            for t in run.inflight:
                if t.box or t.seq in t.worker.mailbox:
                    return t
                if t.via_pipe:
                    self._pump(t.worker, 0)
                    if t.seq in t.worker.mailbox:
                        return t
                else:
                    if take(region, t, 0):
                        return t
            if oldest.via_pipe:
                self._pump(oldest.worker, ANY_POLL_S)
            else:
                take(region, oldest, ANY_POLL_S)
            self._check_wait(oldest, clock, ANY_POLL_S)

    def _await(self, task: Task) -> None:
        """Block until ``task``'s batch is there (its lease taken, or its message in the
        mailbox).  Raises WorkerError, TimeoutError, RuntimeError (closed) or whatever
        ``on_slow`` raises; the task stays owed in every case."""
        region = self.res.region
        clock = WaitClock()
        while True:
            if task.via_pipe:
                if task.seq in task.worker.mailbox or (self._pump(task.worker, POLL_S)
                                                       and task.seq in task.worker.mailbox):
                    return
            elif take(region, task, POLL_S, self.spin_s):
                if task.box[0].kind != _ring.KIND_PIPE:
                    return
                _steps.follow_pipe(task)  # the batch did not fit the region: it follows on the pipe
                continue
            self._check_wait(task, clock, POLL_S)

    def _check_wait(self, task: Task, clock: WaitClock, slice_s: float) -> None:
        engine = self.engine
        waited_s = clock.tick(slice_s)
        if engine.closing:
            raise RuntimeError("the loader was closed while waiting for a batch")
        # What the live workers sent is read every slice: a worker can be blocked
        # sending a batch through its pipe that nothing waits for yet (a batch of an
        # abandoned run ahead of the one awaited), and would never get to the batch
        # awaited (docs/design.md, "Wire protocol").
        for w in self.res.workers:
            if w.status is None:
                self._pump(w, 0)
        self._check_health(task)
        if self.watchdog is not None:  # (rate-limited inside: at most every check_interval)
            self.watchdog.check(self, time.monotonic())
        if engine.timeout_s is not None and waited_s > engine.timeout_s:
            w = task.worker
            raise TimeoutError(
                f"batch {task.seq} (sample indices {task.indices!r}) took more than {engine.timeout_s} s "
                f"in worker {w.wid} (pid {w.pid}); raise DataLoader(timeout=...) if loading is slow")
        if engine.on_slow is not None and engine.slow_after_s is not None and waited_s > engine.slow_after_s \
                and not clock.warned:
            clock.warned = True
            engine.on_slow(task.seq, waited_s)

    # ---- sockets and health ----

    def _pump(self, w: Channel, timeout_s: float) -> bool:
        """Move messages waiting on ``w``'s pipe into its mailbox; True if any arrived."""
        got = False
        try:
            while w.conn.poll(timeout_s if not got else 0):
                msg = w.conn.recv_bytes()
                seq, kind = PIPE_HEADER.unpack_from(msg)
                got = True
                if kind == _bad_samples.KIND_REPORT and self.ledger is not None:
                    self.ledger.receive(msg)
                elif seq in self.stale_pipe:
                    self.stale_pipe.discard(seq)
                else:
                    w.mailbox[seq] = msg
        except (EOFError, OSError):
            pass
        return got

    def _check_health(self, task: Task) -> None:
        """While ``task`` is not there: raise WorkerError if a worker died owing a
        batch, naming the first batch it had not finished (the one it was loading).
        Batches a dead worker published before dying are delivered first; a worker
        that died owing nothing is replaced at the next dispatch."""
        alive = [w for w in self.res.workers if w.status is None]
        for w in exited(alive, 0):
            w.reap(block=True)
        # Every dead worker is looked at, not only one that just died: an interrupt
        # may have ended the previous check right after the reap.
        region = self.res.region
        for w in self.res.workers:
            if w.status is None:
                continue
            self._pump(w, 0)  # what it sent before dying counts as delivered
            self.drop_staged(w)
            owed = self.owed(w)
            if owed is not None and not task.published(region):
                self._raise_dead(w, owed)

    def owed(self, w: Channel) -> Task | None:
        """The first task ``w`` has not finished (the one it is loading), or None; a
        task staged for the next epoch (``staged``) is owed to no run yet."""
        region = self.res.region
        staged = self.staged
        ahead = staged.inflight if staged is not None else ()
        for t in w.outstanding:
            if not t.stale and not t.published(region) and t not in ahead:
                return t
        return None

    def drop_staged(self, w: Channel | None = None) -> None:
        """Abandon the tasks staged for the next epoch (their batches stale, the slots
        freed as they complete) -- with ``w``, only if that (dead or stuck) worker holds
        one: trouble on a batch dispatched ahead is never the current epoch's, and the
        next epoch meets it, if at all, as it would have without the staging (a worker
        that died idle is replaced silently; a stuck one is replaced, the batch loaded
        when the next epoch asks for it)."""
        staged = self.staged
        if staged is None or (w is not None and not any(t.worker is w for t in staged.inflight)):
            return
        self.staged = None
        self.stats["staged_dropped"] += len(staged.inflight)
        self.abandon_quietly(staged)

    def abandon_quietly(self, staged: Any) -> None:
        """Make the tasks of ``staged`` (a run of staged tasks) stale, their slots freed as
        they complete, without the workers' cancel word: the current run's tasks,
        dispatched before these, are below it and still wanted (a worker would publish
        them empty)."""
        staged.superseded = True
        self.dropped.append(staged._ref)
        _steps.abandon_runs(self)

    def _raise_dead(self, w: Channel, held: Task | None = None) -> None:
        w.reap(block=True)
        if held is None:
            held = self.owed(w)
        what = (f"while loading batch {held.seq} (sample indices {held.indices!r})" if held is not None
                else "while idle")
        status = w.status if w.status is not None else UNKNOWN_STATUS
        raise WorkerError(f"mploader worker {w.wid} (pid {w.pid}) {status.describe()} {what}", pid=w.pid,
                          exitcode=status.exitcode, signal=status.signal,
                          batch=held.seq if held else None, indices=held.indices if held else None,
                          worker_id=w.wid)

    # ---- retirement, staleness, reset ----

    def _reap_retired(self) -> None:
        """Forget retired workers that have delivered everything and exited."""
        res = self.res
        if not self.engine.maxtasksperchild:
            return  # nobody retires
        for w in [w for w in res.workers if w.retiring and not w.outstanding]:
            if w.reap():
                w.close_fds()
                res.workers.remove(w)

    def replace_dead(self) -> None:
        """Before a run or a dispatch: workers that died owing nothing (idle deaths,
        batches of an abandoned run) are replaced and their slots reclaimed.  A dead
        worker with batches of the current run still in flight is kept: the ones it
        published are delivered, and the wait names the one it was loading."""
        _steps.abandon_runs(self)
        res = self.res
        keep = []
        for w in res.workers:
            if w.status is None and not w.reap():
                keep.append(w)
                continue
            self.drop_staged(w)
            if any(not t.stale and t.generation == self.generation for t in w.outstanding):
                keep.append(w)
                continue
            self.reset("dead", w)
        res.workers = keep

    def reset(self, reason: str, dead: Channel | None = None) -> None:
        """Give workers up, with everything they held: the one path for it.

        ``reason``: "stop" (``Engine.stop_workers``: every worker is asked to exit and
        given ``CLOSE_GRACE_S``; the runs dropped meanwhile are abandoned first),
        "failure" (a worker died owing a batch, a timeout, a stall, the bad-sample
        budget: every worker is killed at once) or "dead" (``dead``, a worker that
        died owing nothing of the current generation, which :meth:`replace_dead`
        drops from the workers).  The slots their tasks held are reclaimed (E5), their
        records not yet sent and their tasks are forgotten, and so are the stale
        tasks of theirs; after "stop" and "failure" the generation changes, so that no
        task of the old workers is made stale again (its slot is reclaimed here).
        Records of a dead worker's tasks that ``_resend`` already detached from it
        stay, to be given to other workers.  Sent to other workers, a forgotten
        record would write a batch of an abandoned run into a slot handed to a new
        task (``test_engine.py::test_stop_workers_forgets_task_records_not_yet_sent``).
        """
        res = self.res
        region = res.region
        if reason == "dead" and dead is not None:
            for t in dead.outstanding:
                # (a task whose batch went by pipe, or whose slot was freed, holds no slot)
                if t.slot >= 0 and not t.box and not t.via_pipe and not t.consumed and \
                        region.state(t.slot) in (_ring.STATE_ASSIGNED, _ring.STATE_READY):
                    region.reclaim(t.slot)
            gone = set(map(id, dead.outstanding))
            self.stale = [t for t in self.stale if id(t) not in gone]
            # Its records not yet sent go with it (their slots were just reclaimed); tasks
            # _resend already detached from it are kept, to be given to other workers.
            dead.forget_records([(t, f) for t, f in dead.unsent if t is not None and id(t) not in gone])
            self._settle(dead)
            dead.outstanding.clear()
            dead.done = 0
            dead.close_fds()
            return
        if reason not in ("stop", "failure"):
            raise ValueError(f"reason must be one of {', '.join(REASONS)} (with the dead worker for 'dead'), "
                             f"got {reason!r}")
        if reason == "stop":
            _steps.abandon_runs(self)
        # Tasks dispatched ahead for the next epoch go with the workers (their run, no
        # longer referenced, lists itself as dropped; its tasks are of the old generation).
        staged, self.staged = self.staged, None
        if staged is not None:
            self.stats["staged_dropped"] += len(staged.inflight)
            staged.inflight.clear()   # (counted: its slots are reclaimed below, its death adds none)
        workers, res.workers = res.workers, []
        stop_workers(workers, CLOSE_GRACE_S if reason == "stop" else 0)
        self.generation += 1
        if region is not None:
            for slot in range(region.nslots):
                if region.state(slot) in (_ring.STATE_ASSIGNED, _ring.STATE_READY):
                    region.reclaim(slot)
        self.stale.clear()
        self.stale_pipe.clear()
        for w in [*self.outbox, *workers]:
            w.forget_records()
        self.outbox.clear()

    def teardown(self, grace_s: float) -> None:
        """The engine's release (``close()``, or its ``weakref.finalize``: garbage
        collection, interpreter exit): every worker is asked to exit, given ``grace_s``
        seconds (then SIGKILL), and given up.  Not :meth:`reset`: the finalizer runs
        without the engine's lock (at interpreter exit another thread may be in
        ``next()``), so this touches the list of workers and their processes only,
        not the tasks, slots and records the batch loop works on."""
        res = self.res
        workers, res.workers = res.workers, []
        stop_workers(workers, grace_s)

    def drop_in_child(self, forget: bool) -> None:
        """In a forked child of the process that started the workers (a worker of this
        loader or of another, any ``os.fork()``): close this process's copies of the
        workers' descriptors -- the parent's workers go on; with ``forget`` the
        workers are given up here too (another loader's, or this one's teardown in
        the child)."""
        res = self.res
        for w in res.workers:
            w.close_fds()
        if forget:
            res.workers = []

    def _reap_stale(self) -> None:
        """Free the slots of batches nobody will consume (an abandoned iteration).
        Each task is dropped in one C call (``_steps.drop_stale``: E4, its pipe message
        to discard, marked consumed); what follows is repeated harmlessly by the next
        call if an interrupt cuts the loop."""
        _steps.abandon_runs(self)
        if not self.stale:
            return
        region = self.res.region
        keep = []
        for t in self.stale:
            w = t.worker
            if not t.consumed:  # (consumed: dropped by a call that an interrupt cut short)
                if t.via_pipe:
                    _steps.drop_stale(t, self.stale_pipe)
                elif take(region, t, 0):
                    _steps.drop_stale(t, self.stale_pipe if t.box[0].kind == _ring.KIND_PIPE else None)
                else:
                    keep.append(t)
                    continue
            t.worker.finish(t)
            if t.seq in self.stale_pipe and t.seq in w.mailbox:
                del w.mailbox[t.seq]
                self.stale_pipe.discard(t.seq)
        for w in self.res.workers:
            if w.status is None:
                self._pump(w, 0)
        self.stale = keep
