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
import os
import pickle
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from . import _ring
from ._descriptor import decode
from ._errors import BatchFailure, WorkerError
from ._executors import WorkerProcess, exited, stop_workers
from ._protocol import PIPE_HEADER, encode_retire, encode_task

if TYPE_CHECKING:
    from ._engine import Engine

#: How often a waiting parent checks for dead workers, timeouts and close() (seconds).
POLL_S = 0.05
#: Wait slice when batches are taken in completion order (in_order=False): the
#: parent cannot sleep on several futex words at once, so it looks at every slot
#: in flight at least this often (seconds).
ANY_POLL_S = 0.002


class _Task:
    __slots__ = ("seq", "slot", "worker", "epoch", "batch_index", "indices", "generation", "lease", "stale",
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
        self.lease: Any = None      # the SlotLease once E3 was taken (kept across interruptions)
        self.stale = False
        self.via_pipe = slot < 0    # the batch comes (or came) through the worker's pipe
        self.source = source        # the task tuple, to dispatch again if sending failed

    def published(self, region: Any) -> bool:
        """Whether the worker finished this batch (nothing more is owed by it)."""
        if self.via_pipe:
            return self.seq in self.worker.mailbox
        return self.lease is not None or region.state(self.slot) == _ring.STATE_READY


def _wait_lease(region: Any, slot: int, timeout_s: float) -> Any:
    """E3 and the slot's lease in one step (None on timeout)."""
    got = region.wait(slot, timeout_s)
    if got is True:  # TEMPORARY: the pre-redesign ring (wait -> bool, then lease(), meta())
        return _CompatLease(region.lease(slot), region.meta(slot))
    return got or None


class _CompatLease:
    def __init__(self, raw: Any, meta: tuple) -> None:
        self.raw = raw
        self.seq, self.kind, self.flags, self.used, self.desc_off, self.desc_len = meta[:6]


def _raw(lease: Any) -> Any:
    return getattr(lease, "raw", lease)


class Scheduler:
    """The parent's side of the engine (see the module docstring)."""

    def __init__(self, engine: "Engine") -> None:
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
        self.stats: collections.Counter = collections.Counter()

    # ---- the batch loop ----

    def next_batch(self, run: "Run") -> Any:
        self._reap_stale()
        self._reap_retired()
        inflight = run.inflight
        try:
            self._fill(run)
            if not inflight:
                raise StopIteration
            task = inflight[0] if run.in_order else self._first_ready(run)
            self._await(task)
            batch = self._consume(task)   # raises the worker's exception (batch consumed)
        except (WorkerError, TimeoutError):
            run.inflight.clear()
            run.done = True
            self._fail()
            raise
        except BaseException as exc:
            if getattr(exc, "_mploader_consumed", False):
                inflight.remove(task)
            raise
        inflight.remove(task) if not run.in_order else inflight.popleft()
        return batch

    def _fill(self, run: "Run") -> None:
        engine = self.engine
        while not run.exhausted and len(run.inflight) < engine.prefetch:
            source = run.pushback.popleft() if run.pushback else next(run.source, None)
            if source is None:
                run.exhausted = True
                return
            self._dispatch(run, source)

    def _dispatch(self, run: "Run", source: tuple) -> None:
        """Send one task to a worker: a FREE slot (E1) if there is one, else the pipe."""
        epoch, batch_index, indices = source[0], source[1], source[2]
        worker = self._pick_worker(source[3] if len(source) > 3 else None)
        slot = self._free_slot()
        seq = self.seq
        self.seq += 1
        region = self.res.region
        if slot >= 0:
            region.assign(slot, seq)
            self.slot_hint = (slot + 1) % region.nslots
        task = _Task(seq, slot, worker, epoch, batch_index, indices, self.generation, source)
        msg = encode_task(seq, slot, epoch, batch_index, indices)
        run.inflight.append(task)
        worker.outstanding.append(task)
        sent = False
        try:
            worker.conn.send_bytes(msg)
            sent = True
        except OSError:
            self._undo_dispatch(run, task, source, requeue=False)
            self._raise_dead(worker)
        except BaseException:
            if not sent:  # interrupted before the message left: dispatch it again later
                self._undo_dispatch(run, task, source, requeue=True)
            raise
        worker.sent += 1
        engine = self.engine
        if engine.maxtasksperchild and worker.sent >= engine.maxtasksperchild and not worker.retiring:
            worker.retiring = True
            try:
                worker.conn.send_bytes(encode_retire())
            except OSError:
                pass
            self.res.workers.append(engine._start_worker(worker.wid))

    def _undo_dispatch(self, run: "Run", task: _Task, source: tuple, requeue: bool) -> None:
        if task in run.inflight:
            run.inflight.remove(task)
        if task in task.worker.outstanding:
            task.worker.outstanding.remove(task)
        if task.slot >= 0 and self.res.region.state(task.slot) == _ring.STATE_ASSIGNED:
            self.res.region.reclaim(task.slot)
        if requeue:
            run.pushback.appendleft(source)

    def _pick_worker(self, pinned: int | None) -> WorkerProcess:
        """The live, non-retiring worker with the fewest batches owed (or ``pinned``)."""
        workers = [w for w in self.res.workers if not w.retiring and w.status is None]
        if len(workers) < self.engine.num_workers:
            self.engine._ensure_workers()
            workers = [w for w in self.res.workers if not w.retiring and w.status is None]
        if pinned is not None:
            workers = [w for w in workers if w.wid == pinned]
            if not workers:
                raise ValueError(f"task pinned to worker {pinned}, but the workers are 0.."
                                 f"{self.engine.num_workers - 1}")
        return min(workers, key=lambda w: len(w.outstanding))

    def _free_slot(self) -> int:
        """A FREE slot, waiting for abandoned batches' slots when only they are busy;
        -1 (pipe fallback, warned once) when the user holds every slot."""
        region = self.res.region
        slot = region.find_free(self.slot_hint)
        while slot < 0 and any(t.slot >= 0 for t in self.stale):
            # The slots are held by batches of an abandoned iteration that are still
            # loading: they are ahead of any new task in their worker's queue, so
            # waiting for them costs nothing and keeps the new batch on the fast path.
            stale = next(t for t in self.stale if t.slot >= 0)
            self._await(stale)
            self._reap_stale()
            slot = region.find_free(self.slot_hint)
        if slot < 0:
            self.stats["no_free_slot"] += 1
            if not self.warned_full:
                self.warned_full = True
                warnings.warn(
                    f"mploader: all {region.nslots} slots are held by batches that are still alive; "
                    "further batches travel pickled through a pipe until some are released "
                    "(drop references to old batches, or pass copy=True)", RuntimeWarning, stacklevel=6)
        return slot

    def _first_ready(self, run: "Run") -> _Task:
        """in_order=False: the first batch in flight that is ready, waiting in short
        slices (health, timeout and close checked as for an in-order wait)."""
        region = self.res.region
        oldest = run.inflight[0]
        clock = _WaitClock()
        while True:
            for t in run.inflight:
                if t.lease is not None or t.seq in t.worker.mailbox:
                    return t
                if t.via_pipe:
                    self._pump(t.worker, 0)
                    if t.seq in t.worker.mailbox:
                        return t
                else:
                    t.lease = _wait_lease(region, t.slot, 0)
                    if t.lease is not None:
                        return t
            if oldest.via_pipe:
                self._pump(oldest.worker, ANY_POLL_S)
            else:
                oldest.lease = _wait_lease(region, oldest.slot, ANY_POLL_S)
            self._check_wait(oldest, clock, ANY_POLL_S)

    def _await(self, task: _Task) -> None:
        """Block until ``task``'s batch is there (its lease taken, or its message in the
        mailbox).  Raises WorkerError, TimeoutError, RuntimeError (closed) or whatever
        ``on_slow`` raises; the task stays owed in every case."""
        region = self.res.region
        clock = _WaitClock()
        while True:
            if task.via_pipe:
                if task.seq in task.worker.mailbox or (self._pump(task.worker, POLL_S)
                                                       and task.seq in task.worker.mailbox):
                    return
            elif task.lease is not None:
                return
            else:
                task.lease = _wait_lease(region, task.slot, POLL_S)
                if task.lease is not None:
                    if task.lease.kind != _ring.KIND_PIPE:
                        return
                    # The batch did not fit the region: it follows on the pipe.
                    task.lease = None
                    task.via_pipe = True
                    continue
            self._check_wait(task, clock, POLL_S)

    def _check_wait(self, task: _Task, clock: "_WaitClock", slice_s: float) -> None:
        engine = self.engine
        waited_s = clock.tick(slice_s)
        if engine._closing:
            raise RuntimeError("the loader was closed while waiting for a batch")
        self._check_health(task)
        if engine.timeout_s is not None and waited_s > engine.timeout_s:
            w = task.worker
            raise TimeoutError(
                f"batch {task.seq} (sample indices {task.indices!r}) took more than {engine.timeout_s} s "
                f"in worker {w.wid} (pid {w.pid}); raise DataLoader(timeout=...) if loading is slow")
        if engine.on_slow is not None and engine.slow_after_s is not None and waited_s > engine.slow_after_s \
                and not clock.warned:
            clock.warned = True
            engine.on_slow(task.seq, waited_s)

    def _consume(self, task: _Task) -> Any:
        """Turn a task whose batch is there into the batch, or raise its worker's
        exception (marked consumed)."""
        self._finish_task(task)
        self.stats["batches"] += 1
        if task.via_pipe:
            return self._from_pipe(task)
        lease = task.lease
        if lease.seq != task.seq:
            task.lease = None
            raise _consumed(RuntimeError(f"slot {task.slot} holds batch {lease.seq}, expected batch {task.seq}: "
                                         "the slot header was overwritten"))
        if lease.flags & _ring.FLAG_GROWN:
            self.stats["grown"] += 1
            self._note_growth()
        try:
            if lease.kind == _ring.KIND_ERROR:
                failure = decode(_raw(lease), lease.desc_off, lease.desc_len, copy=True)
                self.stats["errors"] += 1
                raise _failure_exception(failure)
            batch = decode(_raw(lease), lease.desc_off, lease.desc_len, self.engine.copy)
        except Exception as exc:  # a worker's exception, or a corrupt descriptor: the batch is used up
            task.lease = None
            raise _consumed(exc) from exc.__cause__
        self.stats["fallback_inband" if lease.flags & _ring.FLAG_INBAND else "slot"] += 1
        task.lease = None
        return batch

    def _from_pipe(self, task: _Task) -> Any:
        msg = task.worker.mailbox.pop(task.seq)
        kind = PIPE_HEADER.unpack_from(msg)[1]
        obj = pickle.loads(memoryview(msg)[PIPE_HEADER.size:])
        if kind == _ring.KIND_ERROR:
            self.stats["errors"] += 1
            raise _consumed(_failure_exception(obj))
        self.stats["fallback_pipe"] += 1
        return obj

    def _note_growth(self) -> None:
        region = self.res.region
        size = region.file_bytes
        if size != self.file_bytes:
            self.file_bytes = size
            if self.engine.on_grow is not None:
                self.engine.on_grow(region)

    def _finish_task(self, task: _Task) -> None:
        w = task.worker
        if w.outstanding and w.outstanding[0] is task:
            w.outstanding.popleft()
        elif task in w.outstanding:
            w.outstanding.remove(task)

    # ---- pipes and health ----

    def _pump(self, w: WorkerProcess, timeout_s: float) -> bool:
        """Move messages waiting on ``w``'s pipe into its mailbox; True if any arrived."""
        got = False
        try:
            while w.conn.poll(timeout_s if not got else 0):
                msg = w.conn.recv_bytes()
                seq = PIPE_HEADER.unpack_from(msg)[0]
                got = True
                if seq in self.stale_pipe:
                    self.stale_pipe.discard(seq)
                else:
                    w.mailbox[seq] = msg
        except (EOFError, OSError):
            pass
        return got

    def _check_health(self, task: _Task) -> None:
        """Raise WorkerError if a worker died owing a batch (the first one it had not
        finished is named).  A worker that died owing nothing is replaced at the
        next dispatch; a retiring worker that exited after its last batch is normal."""
        workers = [w for w in self.res.workers if w.status is None]
        for w in exited(workers, 0):
            w.reap(block=True)
            self._pump(w, 0)  # what it sent before dying counts as delivered
            owed = self._owed(w)
            if owed is not None:
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
        status = w.status
        raise WorkerError(f"mploader worker {w.wid} (pid {w.pid}) {status.describe()} {what}", pid=w.pid,
                          exitcode=status.exitcode, signal=status.signal,
                          batch=held.seq if held else None, indices=held.indices if held else None,
                          worker_id=w.wid)

    # ---- retirement, staleness, failure ----

    def _reap_retired(self) -> None:
        """Forget retired workers that have delivered everything and exited."""
        res = self.res
        for w in [w for w in res.workers if w.retiring and not w.outstanding]:
            if w.reap():
                w.close_fds()
                res.workers.remove(w)

    def replace_dead(self) -> None:
        """Before a run or a dispatch: workers that died owing nothing (idle deaths,
        batches of an abandoned run) are replaced and their slots reclaimed."""
        res = self.res
        region = res.region
        keep = []
        for w in res.workers:
            if w.status is None and not w.reap():
                keep.append(w)
                continue
            for t in w.outstanding:
                if t.slot >= 0 and t.lease is None and region.state(t.slot) in (_ring.STATE_ASSIGNED,
                                                                               _ring.STATE_READY):
                    region.reclaim(t.slot)
            dead = set(map(id, w.outstanding))
            self.stale = [t for t in self.stale if id(t) not in dead]
            w.outstanding.clear()
            w.close_fds()
        res.workers = keep

    def make_stale(self, inflight: collections.deque) -> None:
        """Hand the batches in flight of an abandoned run to the reaper."""
        for t in inflight:
            if t.generation == self.generation:  # older ones died with their workers
                t.stale = True
                if t.lease is not None:   # received but never consumed
                    self._finish_task(t)
                    t.lease = None
                    continue
                self.stale.append(t)
        inflight.clear()

    def _reap_stale(self) -> None:
        """Free the slots of batches nobody will consume (an abandoned iteration)."""
        if not self.stale:
            return
        region = self.res.region
        keep = []
        for t in self.stale:
            w = t.worker
            if not t.via_pipe:
                lease = t.lease if t.lease is not None else _wait_lease(region, t.slot, 0)
                if lease is None:
                    keep.append(t)
                    continue
                if lease.kind == _ring.KIND_PIPE:
                    self.stale_pipe.add(t.seq)
                t.lease = None
                del lease  # E4: the slot is FREE again
            else:
                self.stale_pipe.add(t.seq)
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


class _WaitClock:
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


def _consumed(exc: BaseException) -> BaseException:
    exc._mploader_consumed = True  # type: ignore[union-attr]
    return exc


def _failure_exception(failure: Any) -> BaseException:
    if isinstance(failure, BatchFailure):
        return failure.to_exception()
    return RuntimeError(f"a worker reported an unreadable failure record: {failure!r}")


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

    def __init__(self, engine: "Engine", tasks: Iterable[tuple], in_order: bool) -> None:
        self._engine = engine
        self.source: Iterator[tuple] = iter(tasks)
        self.pushback: collections.deque = collections.deque()
        self.inflight: collections.deque[_Task] = collections.deque()
        self.in_order = in_order
        self.exhausted = False
        self.done = False
        self.superseded = False
        # A run dropped mid-epoch hands its batches in flight to the scheduler as
        # stale, so their slots are freed as they complete.
        self._abandon = weakref.finalize(self, _abandon, weakref.ref(engine), self.inflight)

    def __iter__(self) -> "Run":
        return self

    def __next__(self) -> Any:
        if self.superseded:
            raise RuntimeError("this iterator was superseded by a newer iteration of the same loader")
        if self.done:
            raise StopIteration
        try:
            return self._engine._next_batch(self)
        except StopIteration:
            self.done = True
            raise

    def abandon(self) -> None:
        self.superseded = True
        self._abandon()


def _abandon(engine_ref: Callable[[], Any], inflight: collections.deque) -> None:
    engine = engine_ref()
    if engine is not None and not engine.closed and engine._owner_pid == os.getpid():
        with engine._lock:
            engine._scheduler.make_stale(inflight)
    inflight.clear()
