"""The scheduler's dispatching side: tasks to workers and slots, the task records'
flow to the sockets, and the choice of a worker.

:class:`Dispatch` sits between :class:`~mploader._receive.Receive` (its base: the
waits, the sockets' reading, health and reset) and
:class:`~mploader._scheduler.Scheduler`.  Read top down: :meth:`Dispatch._fill`
pulls items from the run's source and dispatches them (:meth:`Dispatch._dispatch`,
one C step each) to the worker :meth:`Dispatch._pick_worker` chooses and the slot
:meth:`Dispatch._free_slot` finds; :meth:`Dispatch._send_pending` sends the
buffered records, never blocking on a worker (docs/design.md, "Wire protocol").
"""
from __future__ import annotations

import logging
import os
import select
import signal

from . import _steps
from ._channel import Channel, Task
from ._errors import warn_at_caller
from ._executors import exited
from ._protocol import frame_retire, frame_task
from ._receive import POLL_S, Receive
from ._run import Run
from ._waiting import WaitClock

__all__ = ["Dispatch"]

_LOG = logging.getLogger("mploader")


class Dispatch(Receive):
    """The scheduler's dispatching side (see the module docstring)."""

    # The scheduler's state this part reads and writes besides Receive's (Scheduler.__init__)
    seq: int
    slot_hint: int
    pick_from: int
    depth: int
    warned_full: bool

    # ---- filling the queue ----

    def _fill(self, run: Run) -> None:
        """Dispatch tasks until ``prefetch`` are in flight or the source is exhausted.

        Each step is split so that an interrupt (a signal handler that raises, in
        whatever thread the signal arrived) loses nothing: the source items (as many
        as there is room for) are pulled by one C call that records each item as it
        is taken, or the exception the source raised (``_steps.pull``; a generator is
        finished by an exception, so the pass then ends with an error, never a
        silent StopIteration), the waits that can block (a worker to start, a slot
        held by an abandoned batch) come between steps, and each dispatch -- E1, the
        task, its buffered record, ``inflight`` -- is one C call (``_steps.dispatch``;
        docs/design.md, "Faults").  The records are sent at the end, one ``send()``
        per worker (:meth:`_send_pending`); records left over by an interrupted call
        are sent first, and always before anything waits for their batches."""
        engine = self.engine
        if self.outbox:
            self._send_pending()
        if run.staged is not None:
            return   # staged tasks are being taken over: they are the next in order (Scheduler._take_over)
        pushback = run.pushback
        depth = self.depth
        if depth > engine.prefetch and len(run.inflight) > depth // 2:
            # A deep queue of small batches is refilled in bursts, once half of it was
            # consumed: a worker woken by the first task of a burst finds the rest
            # queued, instead of being woken for every task (docs/design.md,
            # "Batches in flight").
            return
        try:
            while not run.exhausted and len(run.inflight) < depth:
                if not pushback:
                    if run.source_error is not None:  # the source is finished: no more items
                        run.exhausted = True
                        return
                    _steps.pull(run, depth - len(run.inflight))
                    if not pushback:
                        run.exhausted = True
                        return
                if self._dispatch_ready(run, depth):
                    continue
                source = pushback[0]
                worker = self._pick_worker(source[3] if len(source) > 3 else None)
                if worker is None:
                    return  # deliver what is there; the wait names the dead worker's batch
                slot = self._free_slot()
                self._dispatch(run, source, worker, slot)
                if worker.retiring and not worker.replaced:
                    self.start_successor(worker)
        finally:
            if self.outbox:
                self._send_pending()

    def _dispatch_ready(self, run: Run, depth: int) -> int:
        """The common case of :meth:`_fill`: dispatch the pulled items whose worker is
        running and for which a slot is FREE; the number dispatched (0: the next item
        needs the general path -- a worker to start or replace, a slot to wait for or
        the pipe, pinned slots to poll, a worker to retire)."""
        if self.engine.poll_held is not None or self.engine.maxtasksperchild:
            return 0
        pushback, inflight = run.pushback, run.inflight
        region = self.res.region
        n = 0
        while pushback and len(inflight) < depth:
            source = pushback[0]
            worker = self._running_worker(source[3] if len(source) > 3 else None)
            if worker is None:
                break
            slot = region.find_free(self.slot_hint)
            if slot < 0:
                break
            self._dispatch(run, source, worker, slot)
            n += 1
        return n

    def _dispatch(self, run: Run, source: tuple, worker: Channel, slot: int) -> None:
        """Make ``source`` (the head of ``run.pushback``) a task of ``worker``, in
        ``slot`` (E1) or through the pipe (slot -1), and buffer its record for
        :meth:`_send_pending`: what may raise first (the record: pickling), then one
        C call for every change (``_steps.dispatch``)."""
        seq = self.seq
        region = self.res.region
        frame = frame_task(seq, slot, source[0], source[1], source[2])
        task = Task(seq, slot, worker, source[0], source[1], source[2], self.generation, source)
        limit = self.engine.maxtasksperchild
        retire = frame_retire() if limit and worker.sent + 1 >= limit and not worker.retiring else None
        _steps.dispatch(self, run, task, frame, region, retire)
        if slot >= 0:
            # Large batches take the lowest FREE slot, so they occupy only the slots
            # they need (about in-flight + 2; round robin would grow all
            # auto_prefetch + 3 of them in turn); a deep queue of small batches goes
            # round robin, which keeps a slot just released out of the way of the
            # worker's next write (docs/design.md, "Batches in flight").
            self.slot_hint = (slot + 1) % region.nslots if self.depth > self.engine.prefetch else 0

    # ---- sending the records ----

    def _send_pending(self) -> None:
        """Send the buffered records (``_steps.flush``: one ``send()`` per worker, and
        what was sent recorded in the same C call), give the tasks that could not
        reach a dead worker to others (:meth:`_resend`), and wait for a worker whose
        socket is full to take the rest, until nothing is left or no worker can take
        them now.  While it waits, what the worker sends is read (it may be blocked sending a batch through the pipe:
        a parent blocked in a write to it would never read that, and both would wait
        for ever)."""
        clock: WaitClock | None = None
        while True:
            if self.outbox:
                _steps.flush(self)
            if not self.outbox:
                return  # everything sent (the common case)
            if self.unsent:
                if not self._resend():
                    return
                continue  # the tasks handed on are buffered: send them
            clock = clock or WaitClock()
            self._wait_writable(clock)

    def _wait_writable(self, clock: WaitClock) -> None:
        """One slice of waiting for the workers that still have records to take:
        until a socket can take more or a worker sends something (read into its
        mailbox at once).  Raises RuntimeError (closed) or TimeoutError, as a wait for
        a batch does; a worker that died is found by the next send (EPIPE)."""
        engine = self.engine
        poller = select.poll()
        by_fd = {}
        for w in self.pending:
            if w.fd >= 0:
                poller.register(w.fd, select.POLLOUT | select.POLLIN)
                by_fd[w.fd] = w
        for fd, events in poller.poll(int(POLL_S * 1000)):
            if events & select.POLLIN:
                self._pump(by_fd[fd], 0)
        waited_s = clock.tick(POLL_S)
        if engine.closing:
            raise RuntimeError("the loader was closed while sending tasks to its workers")
        if engine.timeout_s is not None and waited_s > engine.timeout_s:
            stuck = ", ".join(f"{w.wid} (pid {w.pid})" for w in self.pending)
            raise TimeoutError(f"worker {stuck} took no task for more than {engine.timeout_s} s; raise "
                               "DataLoader(timeout=...) if loading is slow")

    def _resend(self) -> bool:
        """Tasks whose records never reached their worker (its pipe closed: it died).
        If the worker owes no batch it was given, they go to other workers, with the
        same seq and slot (nothing was delivered for them; a replacement is started
        for the dead worker); if it owes one, they stay with it, and the wait names
        the batch it was loading.  False when no worker can take them now (they are
        tried again by the next call)."""
        region = self.res.region
        for dead in self.unsent:
            items = dead.unsent
            if not dead.reap():
                if not exited([dead], 1.0):  # its task pipe is closed: it can never be given work
                    try:
                        os.kill(dead.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                dead.reap(block=True)
            tasks = [t for t, _ in items if t is not None]
            mine = set(map(id, tasks))
            if any(not t.stale and id(t) not in mine and not t.published(region) for t in dead.outstanding):
                items.clear()
                self._settle(dead)
                continue
            # Detached, so the dead worker owes nothing and is replaced; still in `unsent`
            # (an interrupted loop is finished by the next call).
            for t in tasks:
                dead.finish(t)
            while items:
                task, frame = items[0]
                if task is None:  # the dead worker's RETIRE
                    items.pop(0)
                    continue
                worker = self._pick_worker(task.source[3] if len(task.source) > 3 else None)
                if worker is None:
                    return False
                _steps.hand_over(self, task, worker, frame, items)
            self._settle(dead)  # (replace_dead may have emptied it already)
        return True

    def staff(self) -> None:
        """Replace the workers that died owing nothing (:meth:`replace_dead`) and start
        the missing ones (ids 0..N-1; a retiring worker's id is missing).  A new
        generation (no worker left) gets the dataset as it is now (``res.transport``,
        mploader._spec).  The scheduler is the one writer of ``res.workers``, the
        engine's teardown included (``Receive.teardown``, ``Receive.drop_in_child``)."""
        self.replace_dead()
        res = self.res
        if not res.workers:
            res.transport.renew()
        have = {w.wid for w in res.workers if not w.retiring}
        for wid in range(self.engine.num_workers):
            if wid not in have:
                res.workers.append(self.engine.start_worker(wid))

    def start_successor(self, w: Channel) -> None:
        """Start the worker that takes ``w``'s id (``w`` retires, or the watchdog gave it
        up): ``w`` is given no task from now on."""
        w.retiring = w.replaced = True
        self.res.workers.append(self.engine.start_worker(w.wid))

    def replace_stuck(self, w: Channel) -> None:
        """The watchdog killed ``w``, stuck on a batch (mploader._watchdog): what it sent
        before it died counts as delivered; its tasks not yet published are given
        again, with the same seq and slot, to its successor (started here) or another
        worker; ``w`` is given up once it owes nothing (:meth:`replace_dead`).

        Not through :meth:`_resend`, which reaps the dead worker blocking: one in
        uninterruptible sleep (a hard-mounted NFS read) dies only when the kernel lets
        it, and the parent must not wait for that."""
        self._pump(w, 0)
        self.drop_staged(w)   # stuck on a batch staged for the next epoch: not loaded ahead again
        region = self.res.region
        items = []
        for t in list(w.outstanding):
            if not t.stale and not t.published(region):
                src = t.source
                items.append((t, frame_task(t.seq, t.slot, src[0], src[1], src[2])))
        self.start_successor(w)      # w is never given a task again; its wid is free
        for t, frame in items:
            src = t.source
            target = self._pick_worker(src[3] if len(src) > 3 else None)
            w.finish(t)
            if target is None:   # (no live worker for it now: the next dispatch tries again)
                self._keep_unsent(w, t, frame)
                continue
            _steps.hand_over(self, t, target, frame, [(t, frame)])
        if items:
            self._send_pending()
        self.replace_dead()   # gone once it owes nothing (the fast dispatch path counts workers)

    def _keep_unsent(self, w: Channel, task: Task, frame: bytes) -> None:
        """A record of ``w``'s (dead or dying) for :meth:`_resend` to give to another
        worker (:meth:`replace_stuck`'s, when no worker can take it now)."""
        w.unsent.append((task, frame))
        self.outbox[w] = None

    # ---- choosing a worker and a slot ----

    def _running_worker(self, pinned: int | None) -> Channel | None:
        """:meth:`_pick_worker` while every worker is running and none retires, without
        building lists; None otherwise (the caller takes the general path).  Of the
        least loaded, the first from ``pick_from`` (the one after the worker picked
        last), so equally loaded workers take tasks in turn (docs/design.md,
        "Workers")."""
        workers = self.res.workers
        n = len(workers)
        if n != self.engine.num_workers:
            return None
        if pinned is None:
            best, least = -1, 0
            start = self.pick_from
            for k in range(n):
                i = (start + k) % n
                w = workers[i]
                if w.retiring or w.status is not None:
                    return None
                left = self._unfinished(w)
                if best < 0 or left < least:
                    best, least = i, left
            self.pick_from = best + 1 if best + 1 < n else 0
            return workers[best]
        if 0 <= pinned < len(workers):
            w = workers[pinned]  # started in wid order (after a replacement maybe not: the general path)
            if w.wid == pinned and not w.retiring and w.status is None:
                return w
        return None

    def _unfinished(self, w: Channel) -> int:
        """Tasks ``w`` has not published yet: how busy it is, for choosing the worker of
        a task.  A worker whose batches only wait to be consumed is idle: counting them
        (as the tasks it owes) gave the next task to the worker still busy while the
        other slept (small batches, 0.79 MB, 2 workers: 9,549-11,535 -> 12,579-14,827
        b/s), and, in a deep queue refilled in bursts, kept the tasks in turn when one
        worker fell behind, so the loop waited on its batches while the other's were
        done (docs/design-log.md, "Workers").  A worker publishes its tasks in order,
        so its finished ones are a prefix of ``outstanding``; ``w.done`` caches the
        prefix's length (reset to 0 when ``outstanding`` changes other than at its
        ends), and each task is looked at until it is seen finished once."""
        out = w.outstanding
        k = w.done
        n = len(out)
        region = self.res.region
        while k < n and out[k].published(region):
            k += 1
        w.done = k
        return n - k

    def _pick_worker(self, pinned: int | None) -> Channel | None:
        """The live, non-retiring worker with the fewest unpublished tasks
        (:meth:`_unfinished`; or ``pinned``); None when there is none to give the task to
        (a dead worker whose published batches are still to be delivered is not
        replaced before they are)."""
        running = self._running_worker(pinned)
        if running is not None:
            return running
        workers = [w for w in self.res.workers if not w.retiring and w.status is None]
        if len(workers) < self.engine.num_workers:
            self.staff()
            workers = [w for w in self.res.workers if not w.retiring and w.status is None]
        if pinned is not None:
            if not 0 <= pinned < self.engine.num_workers:
                raise ValueError(f"task pinned to worker {pinned}, but the workers are 0.."
                                 f"{self.engine.num_workers - 1}")
            workers = [w for w in workers if w.wid == pinned]
        return min(workers, key=self._unfinished) if workers else None

    def _free_slot(self) -> int:
        """A FREE slot, waiting for abandoned batches' slots when only they are busy;
        -1 (pipe fallback, warned once) when the user holds every slot."""
        region = self.res.region
        poll = self.engine.poll_held
        if poll is not None:
            poll(False)  # slots whose GPU copies are done (pinned memory) are FREE again
        slot = region.find_free(self.slot_hint)
        if slot < 0 and self.pending:
            self._send_pending()  # the batches about to be waited for must have been asked for
        while slot < 0 and poll is not None and poll(True):
            slot = region.find_free(self.slot_hint)
        while slot < 0 and any(t.slot >= 0 and not t.consumed for t in self.stale):
            # The slots are held by batches of an abandoned iteration that are still
            # loading: they are ahead of any new task in their worker's queue, so
            # waiting for them costs nothing and keeps the new batch on the fast path.
            stale = next(t for t in self.stale if t.slot >= 0 and not t.consumed)
            self._await(stale)
            self._reap_stale()
            slot = region.find_free(self.slot_hint)
        if slot < 0:
            self.stats["no_free_slot"] += 1
            if not self.warned_full:
                self.warned_full = True
                message = (f"mploader: all {region.nslots} slots are held by batches that are still alive; "
                           "further batches travel pickled through a pipe until some are released "
                           "(drop references to old batches, or pass copy=True)")
                if self.engine.warn_when_full:
                    warn_at_caller(message, RuntimeWarning)
                else:
                    _LOG.info(message)
        return slot
