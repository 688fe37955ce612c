"""The scheduler: dispatch, receive (in order or not), stale batches, retirement, failure.

One :class:`Scheduler` per engine owns the parent's side of the protocol of
docs/design.md ("Slot protocol", "Wire protocol"); a :class:`Run` is one pass over
a task stream (an epoch) and only asks the scheduler for its next batch.  Read top
down: :meth:`Scheduler.next_batch` -> :meth:`_fill` / :meth:`_dispatch` ->
:meth:`_await` -> :meth:`_consume`; failures end in :meth:`_fail`.

Threading: every entry point runs under the engine's lock, so ``close()`` from
another thread waits until a ``next()`` in progress has returned or raised (a
waiting ``next()`` notices ``closing`` within one wait slice, POLL_S).
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import pickle
import select
import signal
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from . import _bad_samples, _hot, _memory, _ring, _watchdog
from ._descriptor import decode
from ._errors import UNKNOWN_STATUS, BatchFailure, WorkerError, warn_at_caller
from ._executors import WorkerProcess, exited, stop_workers
from ._metrics import Meter
from ._options import SMALL_BATCHES_BYTES
from ._protocol import PIPE_HEADER, frame_retire, frame_task
from ._waiting import WaitClock, spin_for

_LOG = logging.getLogger("mploader")

if TYPE_CHECKING:
    from ._engine import Engine

#: How often a waiting parent checks for dead workers, timeouts and close() (seconds).
POLL_S = 0.05
#: Wait slice when batches are taken in completion order (in_order=False): the
#: parent cannot sleep on several futex words at once, so it looks at every slot
#: in flight at least this often (seconds).
ANY_POLL_S = 0.002


_EMPTY = object()


class _Task:
    __slots__ = ("seq", "slot", "worker", "epoch", "batch_index", "indices", "generation", "box", "stale", "consumed",
                 "pinned", "via_pipe", "source")

    def __init__(self, seq: int, slot: int, worker: WorkerProcess, epoch: int, batch_index: int, indices: Any,
                 generation: int, source: tuple) -> None:
        self.seq = seq
        self.slot = slot
        self.worker = worker
        self.epoch = epoch
        self.batch_index = batch_index
        self.indices = indices
        self.generation = generation
        self.box: list = []         # [SlotLease] once E3 was taken (kept across interruptions)
        self.stale = False
        self.consumed = False       # its batch was handed off, or its exception raised
        self.via_pipe = slot < 0    # the batch comes (or came) through the worker's pipe
        self.source = source        # the task tuple, to dispatch again if sending failed

    def published(self, region: Any) -> bool:
        """Whether the worker finished this batch (nothing more is owed by it)."""
        if self.via_pipe:
            return self.seq in self.worker.mailbox
        return bool(self.box) or region.state(self.slot) == _ring.STATE_READY


def _take(region: Any, task: _Task, timeout_s: float, spin_s: float = 0.0) -> bool:
    """Wait for ``task``'s slot and take E3; the lease lands in ``task.box`` inside the
    C call, so an interrupt raised right after it cannot drop it (the task keeps it
    and a later ``next()`` consumes it)."""
    if not task.box:
        region.wait(task.slot, timeout_s, task.box, spin_s)
    return bool(task.box)


class Scheduler:
    """The parent's side of the engine (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        # A proxy: the engine owns the scheduler, and must not be kept alive by it
        # (dropping the loader stops the workers without waiting for the cyclic GC).
        self.engine = weakref.proxy(engine)
        self.res = engine._res
        self.seq = 0
        self.slot_hint = 0
        self.generation = 0          # bumped when all workers are killed after a failure
        self.stale: list[_Task] = []
        self.stale_pipe: set[int] = set()
        self.warned_full = False
        self.file_bytes = 0
        self.spin_s = spin_for(engine.num_workers)
        # Batches kept in flight: prefetch, raised towards auto_prefetch while batches
        # are small (see _adapt_depth); a deeper queue costs fewer wake-ups per batch.
        self.depth = engine.prefetch
        self.auto_max = engine.auto_prefetch or engine.prefetch
        self.calm = 0                # batches to wait before the depth rises again (_adapt_depth)
        # Task records buffered per worker, sent by _hot.flush with one send() each (what a
        # full socket did not take stays here); and those that never reached a dead
        # worker's socket, for _resend.
        self.pending: dict[WorkerProcess, list[tuple[_Task | None, bytes]]] = {}
        self.unsent: dict[WorkerProcess, list[tuple[_Task | None, bytes]]] = {}
        # Runs superseded or dropped (weak references, appended by their death) whose
        # batches in flight are not yet stale, and each run's inflight deque.
        self.dropped: list[weakref.ref] = []
        self.runs: dict[weakref.ref, collections.deque] = {}
        self.cancels: set[weakref.ref] = set()   # runs' second references (_cancel_dropped), some dead
        self.stats: collections.Counter = collections.Counter()
        self.meter = Meter()         # input-pipeline metrics (_metrics; Run.__next__ times the waits)
        # What the ring's FREE slots hold, and the memory budget's rules (_memory)
        self.memory = _memory.RingMemory(engine.num_slots, engine.on_grow is not None, engine._lock, engine._res,
                                         engine.shared_mem or 0)
        # Stuck workers replaced while the parent waits (_watchdog; None: off)
        self.watchdog = (_watchdog.Watchdog(engine.stall_timeout, engine.max_retries)
                         if engine.stall_timeout is not None else None)
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
            self._fill(run)
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
            self._fail()
            raise
        finally:
            if run.in_order:  # only the head is ever consumed
                while inflight and inflight[0].consumed:
                    inflight.popleft()
            elif inflight:
                for t in [t for t in inflight if t.consumed]:
                    inflight.remove(t)

    def _fill(self, run: Run) -> None:
        """Dispatch tasks until ``prefetch`` are in flight or the source is exhausted.

        Each step is split so that an interrupt (a signal handler that raises, in
        whatever thread the signal arrived) loses nothing: the source items (as many
        as there is room for) are pulled by one C call that records each item as it
        is taken, or the exception the source raised (``_hot.pull``; a generator is
        finished by an exception, so the pass then ends with an error, never a
        silent StopIteration), the waits that can block (a worker to start, a slot
        held by an abandoned batch) come between steps, and each dispatch -- E1, the
        task, its buffered record, ``inflight`` -- is one C call (``_hot.dispatch``;
        docs/design.md, "Faults").  The records are sent at the end, one ``send()``
        per worker (:meth:`_send_pending`); records left over by an interrupted call
        are sent first, and always before anything waits for their batches."""
        engine = self.engine
        if self.pending or self.unsent:
            self._send_pending()
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
                    _hot.pull(run, depth - len(run.inflight))
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
                    worker.replaced = True
                    self.res.workers.append(engine._start_worker(worker.wid))
        finally:
            if self.pending:
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

    def _dispatch(self, run: Run, source: tuple, worker: WorkerProcess, slot: int) -> None:
        """Make ``source`` (the head of ``run.pushback``) a task of ``worker``, in
        ``slot`` (E1) or through the pipe (slot -1), and buffer its record for
        :meth:`_send_pending`: what may raise first (the record: pickling), then one
        C call for every change (``_hot.dispatch``)."""
        seq = self.seq
        region = self.res.region
        frame = frame_task(seq, slot, source[0], source[1], source[2])
        task = _Task(seq, slot, worker, source[0], source[1], source[2], self.generation, source)
        limit = self.engine.maxtasksperchild
        retire = frame_retire() if limit and worker.sent + 1 >= limit and not worker.retiring else None
        _hot.dispatch(self, run, task, frame, region, retire)
        if slot >= 0:
            # Large batches take the lowest FREE slot, so they occupy only the slots
            # they need (about in-flight + 2; round robin would grow all
            # auto_prefetch + 3 of them in turn); a deep queue of small batches goes
            # round robin, which keeps a slot just released out of the way of the
            # worker's next write (docs/design.md, "Batches in flight").
            self.slot_hint = (slot + 1) % region.nslots if self.depth > self.engine.prefetch else 0

    def _send_pending(self) -> None:
        """Send the buffered records (``_hot.flush``: one ``send()`` per worker, and
        what was sent recorded in the same C call), give the tasks that could not
        reach a dead worker to others (:meth:`_resend`), and wait for a worker whose
        socket is full to take the rest, until nothing is left or no worker can take
        them now.  While it waits, what the worker sends is read (it may be blocked sending a batch through the pipe:
        a parent blocked in a write to it would never read that, and both would wait
        for ever)."""
        clock: WaitClock | None = None
        while True:
            if self.pending:
                _hot.flush(self)
            if self.unsent:
                if not self._resend():
                    return
                continue  # the tasks handed on are buffered: send them
            if not self.pending:
                return
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
        if engine._closing:
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
        for dead in list(self.unsent):
            items = self.unsent[dead]
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
                self.unsent.pop(dead, None)
                continue
            # Detached, so the dead worker owes nothing and is replaced; still in `unsent`
            # (an interrupted loop is finished by the next call).
            for t in tasks:
                if t in dead.outstanding:
                    dead.outstanding.remove(t)
                    dead.done = 0
            while items:
                task, frame = items[0]
                if task is None:  # the dead worker's RETIRE
                    items.pop(0)
                    continue
                worker = self._pick_worker(task.source[3] if len(task.source) > 3 else None)
                if worker is None:
                    return False
                _hot.hand_over(self, task, worker, frame, items)
            self.unsent.pop(dead, None)  # (replace_dead may have dropped it, emptied)
        return True

    def _running_worker(self, pinned: int | None) -> WorkerProcess | None:
        """:meth:`_pick_worker` while every worker is running and none retires, without
        building lists; None otherwise (the caller takes the general path)."""
        workers = self.res.workers
        if len(workers) != self.engine.num_workers:
            return None
        if pinned is None:
            best, least = None, 0
            for w in workers:
                if w.retiring or w.status is not None:
                    return None
                left = self._load(w)
                if best is None or left < least:
                    best, least = w, left
            return best
        if 0 <= pinned < len(workers):
            w = workers[pinned]  # started in wid order (after a replacement maybe not: the general path)
            if w.wid == pinned and not w.retiring and w.status is None:
                return w
        return None

    def _load(self, w: WorkerProcess) -> int:
        """How busy ``w`` is, for choosing the worker of a task.  Refilled one task at
        a time (``prefetch`` in flight: large batches), its tasks not yet published:
        a worker whose batches wait to be consumed is idle, and counting them (as the
        tasks it owes) gave the next task to the worker still busy while the other
        slept -- small batches (0.79 MB), 2 workers: 9,549-11,535 -> 12,579-14,827
        b/s.  Refilled in bursts (a deep queue of small batches), the tasks it owes:
        looking at every task's slot cost the parent more than it gained."""
        return self._unfinished(w) if self.depth <= self.engine.prefetch else len(w.outstanding)

    def _unfinished(self, w: WorkerProcess) -> int:
        """Tasks ``w`` has not published yet.  A worker publishes its tasks in order,
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

    def _pick_worker(self, pinned: int | None) -> WorkerProcess | None:
        """The live, non-retiring worker with the least load (:meth:`_load`; or ``pinned``);
        None when there is none to give the task to (a dead worker whose published
        batches are still to be delivered is not replaced before they are)."""
        running = self._running_worker(pinned)
        if running is not None:
            return running
        workers = [w for w in self.res.workers if not w.retiring and w.status is None]
        if len(workers) < self.engine.num_workers:
            self.engine._ensure_workers()
            workers = [w for w in self.res.workers if not w.retiring and w.status is None]
        if pinned is not None:
            if not 0 <= pinned < self.engine.num_workers:
                raise ValueError(f"task pinned to worker {pinned}, but the workers are 0.."
                                 f"{self.engine.num_workers - 1}")
            workers = [w for w in workers if w.wid == pinned]
        return min(workers, key=self._load) if workers else None

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

    def _first_ready(self, run: Run) -> _Task:
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
                    if _take(region, t, 0):
                        return t
            if oldest.via_pipe:
                self._pump(oldest.worker, ANY_POLL_S)
            else:
                _take(region, oldest, ANY_POLL_S)
            self._check_wait(oldest, clock, ANY_POLL_S)

    def _await(self, task: _Task) -> None:
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
            elif _take(region, task, POLL_S, self.spin_s):
                if task.box[0].kind != _ring.KIND_PIPE:
                    return
                _hot.follow_pipe(task)  # the batch did not fit the region: it follows on the pipe
                continue
            self._check_wait(task, clock, POLL_S)

    def _check_wait(self, task: _Task, clock: WaitClock, slice_s: float) -> None:
        engine = self.engine
        waited_s = clock.tick(slice_s)
        if engine._closing:
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
            self.watchdog.check(self, _clock())
        if engine.timeout_s is not None and waited_s > engine.timeout_s:
            w = task.worker
            raise TimeoutError(
                f"batch {task.seq} (sample indices {task.indices!r}) took more than {engine.timeout_s} s "
                f"in worker {w.wid} (pid {w.pid}); raise DataLoader(timeout=...) if loading is slow")
        if engine.on_slow is not None and engine.slow_after_s is not None and waited_s > engine.slow_after_s \
                and not clock.warned:
            clock.warned = True
            engine.on_slow(task.seq, waited_s)

    def _consume(self, task: _Task, run: Run) -> None:
        """Turn a task whose batch is there into ``run.handoff``: the batch, or the
        worker's exception (or the reason the batch cannot be read), which
        ``Run.__next__`` raises.  The batch is read first (an interrupt there leaves
        it with the task, to be read again); then one C call hands it off, marks the
        task consumed and takes the lease from ``task.box`` (``_hot.hand_off``), so an
        interrupt at any point loses nothing (docs/design.md, "Faults")."""
        failed = False
        if task.via_pipe:
            msg = task.worker.mailbox[task.seq]
            kind = PIPE_HEADER.unpack_from(msg)[1]
            try:
                value = pickle.loads(memoryview(msg)[PIPE_HEADER.size:])
                if kind == _ring.KIND_ERROR:
                    value, failed = _failure_exception(value), True
            except Exception as exc:  # noqa: BLE001 -- an unreadable batch is used up: next() raises it
                value, failed = exc, True
            _hot.hand_off(run, task, value, failed, task.worker.mailbox)
            if kind == _ring.KIND_ERROR:
                self.stats["errors"] += 1
            elif not failed:
                self.stats["fallback_pipe"] += 1
                self.stats["batches"] += 1
                self.meter.bytes += len(msg) - PIPE_HEADER.size
            return
        lease = task.box[0]
        if lease.seq != task.seq:
            _hot.hand_off(run, task, RuntimeError(f"slot {task.slot} holds batch {lease.seq}, expected batch "
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
                value = decode(lease, lease.desc_off, lease.desc_len, self.engine.copy,
                               self.engine.copy_below_bytes)
        except Exception as exc:  # noqa: BLE001 -- a corrupt descriptor uses the batch up: next() raises it
            value, failed = exc, True
        _hot.hand_off(run, task, value, failed, None)
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

    def memory_stats(self) -> dict[str, int]:
        """``memory_budget_bytes`` (this process's rings together) and
        ``memory_held_bytes`` (this ring's slots, as the parent last saw them)."""
        return {"memory_budget_bytes": _memory.budget_bytes(), "memory_held_bytes": self.memory.held}

    def _note_growth(self) -> None:
        region = self.res.region
        size = region.file_bytes
        if size != self.file_bytes:
            self.file_bytes = size
            if self.engine.on_grow is not None:
                covered = self.engine.on_grow(region)
                if covered is not None and covered < size:
                    self.file_bytes = covered  # the rest is not in the file yet: again next batch

    def _finish_task(self, task: _Task) -> None:
        w = task.worker
        if w.outstanding and w.outstanding[0] is task:
            w.outstanding.popleft()
            w.done = max(0, w.done - 1)
        elif task in w.outstanding:
            w.outstanding.remove(task)
            w.done = 0

    # ---- pipes and health ----

    def _pump(self, w: WorkerProcess, timeout_s: float) -> bool:
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

    def _check_health(self, task: _Task) -> None:
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
            owed = self._owed(w)
            if owed is not None and not task.published(region):
                self._raise_dead(w, owed)

    def _owed(self, w: WorkerProcess) -> _Task | None:
        region = self.res.region
        for t in w.outstanding:
            if not t.stale and not t.published(region):
                return t
        return None

    def _raise_dead(self, w: WorkerProcess, held: _Task | None = None) -> None:
        w.reap(block=True)
        if held is None:
            held = self._owed(w)
        what = (f"while loading batch {held.seq} (sample indices {held.indices!r})" if held is not None
                else "while idle")
        status = w.status if w.status is not None else UNKNOWN_STATUS
        raise WorkerError(f"mploader worker {w.wid} (pid {w.pid}) {status.describe()} {what}", pid=w.pid,
                          exitcode=status.exitcode, signal=status.signal,
                          batch=held.seq if held else None, indices=held.indices if held else None,
                          worker_id=w.wid)

    # ---- retirement, staleness, failure ----

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
        _hot.abandon_runs(self)
        res = self.res
        region = res.region
        keep = []
        for w in res.workers:
            if w.status is None and not w.reap():
                keep.append(w)
                continue
            if any(not t.stale and t.generation == self.generation for t in w.outstanding):
                keep.append(w)
                continue
            for t in w.outstanding:
                # (a task whose batch went by pipe, or whose slot was freed, holds no slot)
                if t.slot >= 0 and not t.box and not t.via_pipe and not t.consumed and \
                        region.state(t.slot) in (_ring.STATE_ASSIGNED, _ring.STATE_READY):
                    region.reclaim(t.slot)
            dead = set(map(id, w.outstanding))
            self.stale = [t for t in self.stale if id(t) not in dead]
            # Its records not yet sent go with it (their slots were just reclaimed); tasks
            # _resend already detached from it are kept, to be given to other workers.
            self.pending.pop(w, None)
            items = self.unsent.get(w)
            if items is not None:
                items[:] = [(t, f) for t, f in items if t is not None and id(t) not in dead]
                if not items:
                    del self.unsent[w]
            w.outstanding.clear()
            w.done = 0
            w.close_fds()
        res.workers = keep

    def _reap_stale(self) -> None:
        """Free the slots of batches nobody will consume (an abandoned iteration).
        Each task is dropped in one C call (``_hot.drop_stale``: E4, its pipe message
        to discard, marked consumed); what follows is repeated harmlessly by the next
        call if an interrupt cuts the loop."""
        _hot.abandon_runs(self)
        if not self.stale:
            return
        region = self.res.region
        keep = []
        for t in self.stale:
            w = t.worker
            if not t.consumed:  # (consumed: dropped by a call that an interrupt cut short)
                if t.via_pipe:
                    _hot.drop_stale(t, self.stale_pipe)
                elif _take(region, t, 0):
                    _hot.drop_stale(t, self.stale_pipe if t.box[0].kind == _ring.KIND_PIPE else None)
                else:
                    keep.append(t)
                    continue
            self._finish_task(t)
            if t.seq in self.stale_pipe and t.seq in w.mailbox:
                del w.mailbox[t.seq]
                self.stale_pipe.discard(t.seq)
        for w in self.res.workers:
            if w.status is None:
                self._pump(w, 0)
        self.stale = keep

    def _fail(self) -> None:
        """After a dead or stuck worker: stop all workers, free every slot they held."""
        res = self.res
        workers, res.workers = res.workers, []
        stop_workers(workers, 0)
        self.generation += 1
        region = res.region
        for slot in range(region.nslots):
            if region.state(slot) in (_ring.STATE_ASSIGNED, _ring.STATE_READY):
                region.reclaim(slot)
        self.stale.clear()
        self.stale_pipe.clear()
        self.pending.clear()
        self.unsent.clear()


_clock = time.monotonic  # the metrics' clock (CLOCK_MONOTONIC, shared with the workers)


def _failure_exception(failure: Any) -> BaseException:
    if isinstance(failure, BatchFailure):
        return failure.to_exception()
    return RuntimeError(f"a worker reported an unreadable failure record: {failure!r}")


def _cancel_dropped(res: Any, inflight: collections.deque, ref: Any = None) -> None:
    """A run was abandoned or dropped: the workers skip its tasks in flight that they
    have not started (``BusyCells.cancel_below``; seqs grow, and a run abandoned has
    dispatched nothing since a newer run began, so no live run's task is below the
    word).  Also the callback of the run's second weak reference (``ref``)."""
    busy = res.busy
    if inflight and busy is not None:
        busy.cancel_below(inflight[-1].seq + 1)   # (appended in seq order)


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

    def __init__(self, engine: Engine, tasks: Iterable[tuple], in_order: bool) -> None:
        self._engine = engine
        self.source: Iterator[tuple] = iter(tasks)
        self.pushback: collections.deque = collections.deque()
        self.inflight: collections.deque[_Task] = collections.deque()
        self.in_order = in_order
        self.handoff: Any = _EMPTY  # the next batch, between the scheduler and __next__
        self.failed = False         # handoff is an exception for __next__ to raise
        self.source_error: BaseException | None = None  # what the source raised (_hot.pull)
        self.exhausted = False
        self.done = False
        self.superseded = False
        scheduler = engine._scheduler
        self._meter = scheduler.meter
        # A run dropped mid-epoch hands its batches in flight to the scheduler as stale,
        # so their slots are freed as they complete: its death appends its weak
        # reference to ``scheduler.dropped`` (a C call: nothing an interrupt can cut),
        # and the scheduler's next step takes them (_hot.abandon_runs).
        self._ref = weakref.ref(self, scheduler.dropped.append)
        scheduler.runs[self._ref] = self.inflight
        # ... and tells the workers at once to skip its tasks they have not started
        # (a second reference, held by the scheduler -- whose dead ones are pruned
        # here -- and whose callback holds neither: only speeds things up).
        cancels = scheduler.cancels
        if cancels:
            cancels.difference_update([r for r in cancels if r() is None])
        cancels.add(weakref.ref(self, functools.partial(_cancel_dropped, scheduler.res, self.inflight)))

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
            meter.tick(t0, self._engine._scheduler.stats)
        try:
            self._engine._next_batch(self)
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
            self.handoff = _EMPTY
            raise exc
        batch = self.handoff
        self.handoff = _EMPTY
        return batch

    def abandon(self) -> None:
        """Superseded (a newer run, stopped workers): the batches in flight become
        stale, and the workers skip those they have not started.  Called under the
        engine's lock."""
        self.superseded = True
        scheduler = self._engine._scheduler
        _cancel_dropped(scheduler.res, self.inflight)
        scheduler.dropped.append(self._ref)
        _hot.abandon_runs(scheduler)
