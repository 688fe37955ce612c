"""The engine: dispatch, receive in order, prefetch, worker lifecycle.

Every face (Gluon DataLoader, Chainer MultiprocessIterator, GluonNLP
ShardedDataLoader) turns its sampling state into a stream of tasks
``(epoch, batch_index, indices)`` and hands it to :meth:`Engine.run`, which yields
the batches in task order.  ``fetch(dataset, indices, alloc)`` -- run in a worker
-- turns indices into a batch, allocating its arrays with ``alloc`` (a slot view
in a worker process, ``np.empty`` otherwise).

Three executors share that interface: forked worker processes over the slot ring
(the point of the library), the calling process (``num_workers=0``) and a thread
pool (``thread_pool=True``).  docs/design.md describes the protocol.
"""
from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing.connection
import os
import pickle
import random
import select
import signal
import sys
import time
import warnings
import weakref
from typing import Any, Callable, Iterable

import numpy as np

from . import _ring
from ._descriptor import decode
from ._worker import PIPE_HEADER, RETIRE, WorkerContext, batch_seed, seed_rngs, worker_main

Task = tuple  # (epoch, batch_index, indices)

#: How often a waiting parent checks for dead workers and timeouts (seconds).
POLL_S = 0.05
#: Grace given to workers to exit on their own at close() (seconds).
CLOSE_GRACE_S = 0.5


class WorkerError(RuntimeError):
    """A worker process died (signal or non-zero exit) while the loader needed it.

    Attributes
    ----------
    pid : int
        The worker's process id.
    exitcode : int or None
        Its exit status; None when it died by a signal.
    signal : int or None
        The signal that killed it, if any.
    batch : int or None
        Sequence number of the batch it held.
    indices : list or None
        Sample indices of that batch.
    """

    def __init__(self, message: str, *, pid: int, exitcode: int | None, signal: int | None,
                 batch: int | None, indices: Any) -> None:
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode
        self.signal = signal
        self.batch = batch
        self.indices = indices


class _WorkerTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of a re-raised error."""


def rebuild_error(record: dict) -> BaseException:
    """The exception a worker reported, with the batch's indices and worker traceback.

    The original type and arguments are kept when the exception could be pickled;
    the context (pid, batch, sample indices, the worker's traceback) is attached as
    a note (Python >= 3.11) and as the ``__cause__``.
    """
    context = (f"raised in mploader worker pid {record['pid']} while {record.get('stage', 'loading')} "
               f"batch {record['seq']}, sample indices {record['indices']!r}")
    exc = None
    if record["exc"] is not None:
        try:
            exc = pickle.loads(record["exc"])
        except Exception:  # noqa: BLE001
            exc = None
    if exc is None:
        exc = RuntimeError(f"{record['type']}: {record['message']}")
    exc.mploader_indices = record["indices"]
    if hasattr(exc, "add_note"):
        exc.add_note(context)
    exc.__cause__ = _WorkerTraceback(f"{context}\n\nWorker traceback:\n{record['traceback']}")
    return exc


def _describe_exit(status: int) -> tuple[int | None, int | None, str]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return None, sig, f"was killed by signal {sig} ({name})"
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
    return code, None, f"exited with code {code}"


class _Worker:
    __slots__ = ("wid", "pid", "pidfd", "conn", "outstanding", "sent", "retiring", "mailbox", "status")

    def __init__(self, wid: int, pid: int, conn: Any) -> None:
        self.wid = wid
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.conn = conn
        self.outstanding: collections.deque = collections.deque()  # _Task objects in dispatch order
        self.sent = 0
        self.retiring = False
        self.mailbox: dict[int, bytes] = {}
        self.status: int | None = None  # wait status once reaped


class _Task:
    __slots__ = ("seq", "slot", "worker", "epoch", "batch_index", "indices", "stale", "generation", "lease")

    def __init__(self, seq, slot, worker, epoch, batch_index, indices, generation=0):
        self.generation = generation
        self.seq = seq
        self.slot = slot
        self.worker = worker
        self.epoch = epoch
        self.batch_index = batch_index
        self.indices = indices
        self.stale = False
        self.lease: list = []  # the SlotLease once taken (Region.wait appends it)


class _Resources:
    """What must be released when the engine goes away (held apart from the engine
    so that ``weakref.finalize`` can release it without keeping the engine alive)."""

    def __init__(self) -> None:
        self.region: _ring.Region | None = None
        self.workers: list[_Worker] = []

    def kill_workers(self, grace_s: float) -> None:
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                w.conn.close()
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        alive = [w for w in workers if w.status is None]
        while alive:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = _exited([w.pidfd for w in alive], left)
            for w in alive:
                if w.pidfd in ready:
                    _reap(w)
            alive = [w for w in alive if w.status is None]
        for w in alive:
            try:
                os.kill(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reap(w, block=True)
        for w in workers:
            os.close(w.pidfd)

    def close(self) -> None:
        self.kill_workers(CLOSE_GRACE_S)
        if self.region is not None:
            self.region.close()
            self.region = None

    def close_parent_ends(self) -> None:
        """In a forked child: close the inherited parent ends of the workers' pipes
        and their pidfds (this process must not hold them)."""
        for w in self.workers:
            try:
                w.conn.close()
                os.close(w.pidfd)
            except OSError:
                pass

    def drop_in_child(self) -> None:
        """In a worker forked for another loader: let go of this loader's resources."""
        self.close_parent_ends()
        self.workers = []
        if self.region is not None:
            self.region.forget()
            self.region = None


def _exited(pidfds: list[int], timeout_s: float) -> set[int]:
    """The pidfds among ``pidfds`` whose process has exited, waiting up to ``timeout_s``.

    poll(), not select(): a training process may hold more than FD_SETSIZE (1024)
    descriptors, and select() cannot watch a descriptor numbered above that.
    """
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(max(0, int(timeout_s * 1000)))}


def _reap(w: _Worker, block: bool = False) -> bool:
    if w.status is not None:
        return True
    try:
        pid, status = os.waitpid(w.pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        w.status = 0
        return True
    if pid == 0:
        return False
    w.status = status
    return True


_LIVE: "weakref.WeakSet[_Resources]" = weakref.WeakSet()


class Engine:
    """Runs batches on forked workers over a slot ring and yields them in order.

    Parameters
    ----------
    dataset : object with ``__getitem__``
        Inherited by the workers at fork time (never pickled).
    fetch : callable ``(dataset, indices, alloc) -> batch``
        Runs in the worker; ``alloc(shape, dtype)`` returns uninitialised arrays in
        the slot.
    num_workers : int
        Worker processes, >= 1.
    prefetch : int
        Batches in flight, >= 1.
    shared_mem : int or None
        Payload bytes per slot; None sizes slots from the first batch (+25 %).
    timeout_s : float or None
        Seconds one batch may take from the moment the parent waits for it; None
        or 0 disables.
    seed : int
        Base seed; batch (epoch, i) seeds the worker's RNGs from (seed, epoch, i).
    copy : bool
        Return owned arrays instead of views into the slot.
    maxtasksperchild : int or None
        Replace a worker after this many batches.
    num_slots : int or None
        Slots in the ring; default ``prefetch + 3``.
    on_slow : callable ``(seq, waited_s) -> None`` or None
        Called once per batch whose wait exceeds ``slow_after_s`` seconds.
    """

    def __init__(self, dataset: Any, fetch: Callable, *, num_workers: int, prefetch: int,
                 shared_mem: int | None, timeout_s: float | None, seed: int, copy: bool = False,
                 maxtasksperchild: int | None = None, num_slots: int | None = None,
                 on_slow: Callable[[int, float], None] | None = None, slow_after_s: float | None = None) -> None:
        self.dataset = dataset
        self.fetch = fetch
        self.num_workers = num_workers
        self.prefetch = max(1, prefetch)
        self.shared_mem = shared_mem
        self.timeout_s = timeout_s or None
        self.seed = seed
        self.copy = copy
        self.maxtasksperchild = maxtasksperchild
        self.num_slots = num_slots or self.prefetch + 3
        self.on_slow = on_slow
        self.slow_after_s = slow_after_s
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _Resources.close, self._res)
        _LIVE.add(self._res)
        self._seq = 0
        self._next_wid = 0
        self._slot_hint = 0
        self._stale: list[_Task] = []
        self._stale_pipe: set[int] = set()
        self._current: Callable[[], Run | None] = lambda: None
        self._retired_pending = False
        self._generation = 0  # bumped when all workers are killed after a failure
        self._warned_full = False
        self._closed = False
        self._stats = collections.Counter()

    # ---- lifecycle ----

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the workers and release the region (leases stay valid).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stale.clear()
        self._finalizer()

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._res.workers if w.status is None]

    def stats(self) -> dict:
        """Counters: batches, slot (fast path), fallback_inband, fallback_pipe, no_free_slot,
        grown, errors; plus num_slots and shm_bytes (bytes the region's file spans)."""
        out = {k: self._stats.get(k, 0) for k in
               ("batches", "slot", "fallback_inband", "fallback_pipe", "no_free_slot", "grown", "errors")}
        region = self._res.region
        out["num_slots"] = self.num_slots
        out["shm_bytes"] = region.file_bytes if region is not None else 0
        return out

    def _start(self) -> None:
        if self._closed:
            raise RuntimeError("the loader is closed")
        res = self._res
        if res.region is None:
            slot_bytes = self.shared_mem if self.shared_mem is not None else 0
            res.region = _ring.create_region(self.num_slots, slot_bytes)
        live = []
        for w in res.workers:
            # A worker that died between runs (e.g. its forking thread ended and
            # PR_SET_PDEATHSIG fired, or a batch of an abandoned run crashed it) owes
            # nobody anything: replace it silently and free the slots it held.
            if w.status is None and not _reap(w):
                live.append(w)
                continue
            os.close(w.pidfd)
            for t in w.outstanding:
                if t.slot >= 0 and res.region.state(t.slot) in (_ring.STATE_ASSIGNED, _ring.STATE_READY):
                    res.region.reclaim(t.slot)
            dead = set(map(id, w.outstanding))
            self._stale = [t for t in self._stale if id(t) not in dead]
            w.outstanding.clear()
        res.workers = live
        while len([w for w in res.workers if not w.retiring]) < self.num_workers:
            res.workers.append(self._spawn())

    def _spawn(self) -> _Worker:
        res = self._res
        parent_conn, child_conn = multiprocessing.Pipe(duplex=True)
        wid = self._next_wid
        self._next_wid += 1
        parent_pid = os.getpid()

        def drop() -> None:
            parent_conn.close()
            for other in list(_LIVE):
                other.drop_in_child() if other is not res else res.close_parent_ends()

        ctx = WorkerContext(worker_id=wid, region=res.region, conn=child_conn, dataset=self.dataset,
                            fetch=self.fetch, seed=self.seed, parent_pid=parent_pid, drop=drop)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            worker_main(ctx)
        child_conn.close()
        return _Worker(wid, pid, parent_conn)

    # ---- running ----

    def run(self, tasks: Iterable[Task]) -> "Run":
        """An iterator over the batch of each task, in task order, ``prefetch`` in flight.

        Starting a run supersedes the previous one: its batches in flight are
        discarded (their slots freed as they complete) and its ``next()`` raises
        RuntimeError.  See :class:`Run` for the errors raised.
        """
        previous = self._current()
        if previous is not None:
            previous._abandon()
        self._start()
        run = Run(self, tasks)
        self._current = weakref.ref(run)  # weak: a run keeps its engine alive, not the reverse
        return run

    def _dispatch(self, epoch: int, batch_index: int, indices: Any) -> _Task:
        res = self._res
        seq = self._seq
        self._seq += 1
        workers = [w for w in res.workers if not w.retiring]
        worker = min(workers, key=lambda w: len(w.outstanding))
        region = res.region
        slot = region.find_free(self._slot_hint)
        if slot >= 0:
            region.assign(slot, seq)
            self._slot_hint = (slot + 1) % self.num_slots
        else:
            self._stats["no_free_slot"] += 1
            if not self._warned_full:
                self._warned_full = True
                warnings.warn(
                    f"mploader: all {self.num_slots} slots are held by batches that are still alive; "
                    "further batches travel pickled through a pipe until some are released "
                    "(drop references to old batches, or pass copy=True)", RuntimeWarning, stacklevel=4)
        task = _Task(seq, slot, worker, epoch, batch_index, indices, self._generation)
        try:
            worker.conn.send_bytes(pickle.dumps((seq, slot, epoch, batch_index, indices), protocol=5))
        except OSError:
            if slot >= 0:
                region.reclaim(slot)
            self._raise_dead(worker)
        worker.outstanding.append(task)
        worker.sent += 1
        if self.maxtasksperchild and worker.sent >= self.maxtasksperchild:
            worker.conn.send_bytes(RETIRE)
            worker.retiring = True
            res.workers.append(self._spawn())
        return task

    def _await(self, task: _Task) -> None:
        """Block until ``task``'s batch is ready (slot LEASED or message in the mailbox).

        Raises WorkerError / TimeoutError / RuntimeError (closed), or whatever
        ``on_slow`` raises; the task is not consumed in any of those cases.
        """
        region = self._res.region
        start = time.monotonic()
        warned = False
        while True:
            if task.slot >= 0:
                if task.lease or region.wait(task.slot, POLL_S, task.lease):
                    break
            elif task.seq in task.worker.mailbox or (self._pump(task.worker, POLL_S)
                                                      and task.seq in task.worker.mailbox):
                break
            waited = time.monotonic() - start
            if self._closed:
                raise RuntimeError("the loader was closed while waiting for a batch")
            self._check_health(task)
            if self.timeout_s is not None and waited > self.timeout_s:
                w = task.worker
                raise TimeoutError(
                    f"batch {task.seq} (sample indices {task.indices!r}) took more than {self.timeout_s} s "
                    f"in worker {w.wid} (pid {w.pid}); raise DataLoader(timeout=...) if loading is slow")
            if self.on_slow is not None and not warned and self.slow_after_s is not None \
                    and waited > self.slow_after_s:
                warned = True
                self.on_slow(task.seq, waited)

    def _consume(self, task: _Task) -> Any:
        """Turn a ready task into its batch (or re-raise its worker's exception)."""
        self._finish_task(task)
        self._stats["batches"] += 1
        if task.slot < 0:
            return self._from_pipe(task)
        lease = task.lease.pop()
        seq, kind, flags, desc_off, desc_len = lease.seq, lease.kind, lease.flags, lease.desc_off, lease.desc_len
        if seq != task.seq:
            del lease
            raise RuntimeError(f"slot {task.slot} holds batch {seq}, expected {task.seq}")
        if flags & _ring.FLAG_GROWN:
            self._stats["grown"] += 1
        if kind == _ring.KIND_PIPE:
            del lease
            while task.seq not in task.worker.mailbox:
                if not self._pump(task.worker, POLL_S):
                    self._check_health(task)
            return self._from_pipe(task)
        if kind == _ring.KIND_ERROR:
            record = decode(lease, desc_off, desc_len, copy=True)
            del lease
            self._stats["errors"] += 1
            raise rebuild_error(record)
        if flags & _ring.FLAG_INBAND:
            self._stats["fallback_inband"] += 1
        else:
            self._stats["slot"] += 1
        return decode(lease, desc_off, desc_len, self.copy)

    def _from_pipe(self, task: _Task) -> Any:
        msg = task.worker.mailbox.pop(task.seq)
        kind = PIPE_HEADER.unpack_from(msg)[1]
        obj = pickle.loads(memoryview(msg)[PIPE_HEADER.size:])
        if kind == _ring.KIND_ERROR:
            self._stats["errors"] += 1
            raise rebuild_error(obj)
        self._stats["fallback_pipe"] += 1
        return obj

    def _finish_task(self, task: _Task) -> None:
        w = task.worker
        if w.outstanding and w.outstanding[0] is task:
            w.outstanding.popleft()
        else:
            w.outstanding.remove(task)
        if w.retiring and not w.outstanding:
            self._retired_pending = True

    def _pump(self, w: _Worker, timeout_s: float) -> bool:
        """Move messages waiting on ``w``'s pipe into its mailbox; True if any arrived."""
        got = False
        try:
            while w.conn.poll(timeout_s if not got else 0):
                msg = w.conn.recv_bytes()
                seq = PIPE_HEADER.unpack_from(msg)[0]
                got = True
                if seq in self._stale_pipe:
                    self._stale_pipe.discard(seq)
                else:
                    w.mailbox[seq] = msg
        except (EOFError, OSError):
            pass
        return got

    def _check_health(self, task: _Task) -> None:
        """Raise WorkerError if a worker died other than by retiring."""
        res = self._res
        alive = [w for w in res.workers if w.status is None]
        ready = _exited([w.pidfd for w in alive], 0) if alive else set()
        for w in alive:
            if w.pidfd not in ready:
                continue
            _reap(w, block=True)
            if w.retiring and os.WIFEXITED(w.status) and os.WEXITSTATUS(w.status) == 0:
                continue  # retired after publishing all its batches (maxtasksperchild)
            # It may have published our batch just before dying.
            if w is task.worker and task.slot >= 0 and res.region.state(task.slot) == _ring.STATE_READY:
                return
            self._raise_dead(w)

    def _raise_dead(self, w: _Worker) -> None:
        _reap(w, block=True)
        code, sig, how = _describe_exit(w.status)
        held = w.outstanding[0] if w.outstanding else None
        what = (f"while loading batch {held.seq} (sample indices {held.indices!r})" if held is not None
                else "while idle")
        raise WorkerError(f"mploader worker {w.wid} (pid {w.pid}) {how} {what}", pid=w.pid, exitcode=code,
                          signal=sig, batch=held.seq if held else None,
                          indices=held.indices if held else None)

    def _reap_retired(self) -> None:
        """Forget retired workers that have delivered everything and exited."""
        res = self._res
        for w in [w for w in res.workers if w.retiring and not w.outstanding]:
            if _reap(w):
                os.close(w.pidfd)
                res.workers.remove(w)
            else:
                self._retired_pending = True

    def _fail(self) -> None:
        """After a dead or stuck worker: stop all workers, free every slot they held."""
        res = self._res
        res.kill_workers(0)
        self._generation += 1
        region = res.region
        for slot in range(self.num_slots):
            if region.state(slot) in (_ring.STATE_ASSIGNED, _ring.STATE_READY):
                region.reclaim(slot)
        self._stale.clear()
        self._stale_pipe.clear()

    def _reap_stale(self) -> None:
        """Free the slots of batches nobody will consume (an abandoned iteration)."""
        if not self._stale:
            return
        region = self._res.region
        keep = []
        for t in self._stale:
            w = t.worker
            if t.slot >= 0:
                if t.lease or region.wait(t.slot, 0, t.lease):
                    kind = t.lease.pop().kind
                    self._finish_task(t)
                    if kind == _ring.KIND_PIPE:
                        self._stale_pipe.add(t.seq)
                else:
                    keep.append(t)
                    continue
            else:
                self._stale_pipe.add(t.seq)
                self._finish_task(t)
            if t.seq in self._stale_pipe and t.seq in w.mailbox:
                del w.mailbox[t.seq]
                self._stale_pipe.discard(t.seq)
        for w in self._res.workers:
            self._pump(w, 0)
        self._stale = keep


class Run:
    """One pass over a task stream (an epoch) on an :class:`Engine`.

    ``next()`` returns the next batch in task order.  An exception raised by
    ``dataset[i]`` or batchify consumes only its own batch: the next call goes on
    with the following one, as torch's DataLoader does.

    Raises
    ------
    WorkerError
        A worker died; the run ends and workers are restarted by the next run.
    TimeoutError
        A batch took longer than the engine's ``timeout_s``; the run ends.
    RuntimeError
        The run was superseded by a newer one, or the engine was closed.
    Exception
        Whatever ``dataset[i]`` or batchify raised, with the batch's indices and the
        worker's traceback attached (see :func:`rebuild_error`).
    """

    def __init__(self, engine: Engine, tasks: Iterable[Task]) -> None:
        self._engine = engine
        self._source = iter(tasks)
        self._inflight: collections.deque[_Task] = collections.deque()
        self._exhausted = False
        self._done = False
        self._superseded = False
        # A run dropped mid-epoch hands its batches in flight to the engine as stale,
        # so their slots are freed as they complete.
        self._abandon_inflight = weakref.finalize(self, _make_stale, engine, self._inflight)

    def __iter__(self) -> "Run":
        return self

    def __next__(self) -> Any:
        engine = self._engine
        if self._superseded:
            raise RuntimeError("this iterator was superseded by a newer iteration of the same loader")
        if self._done:
            raise StopIteration
        if engine.closed:
            self._done = True
            raise RuntimeError("the loader is closed")
        try:
            engine._reap_stale()
            if engine._retired_pending:
                engine._retired_pending = False
                engine._reap_retired()
            inflight = self._inflight
            while not self._exhausted and len(inflight) < engine.prefetch:
                t = next(self._source, None)
                if t is None:
                    self._exhausted = True
                    break
                inflight.append(engine._dispatch(*t))
            if not inflight:
                self._done = True
                raise StopIteration
            task = inflight.popleft()
            try:
                engine._await(task)
            except BaseException:
                inflight.appendleft(task)  # still owed: a later next() waits for it again
                raise
            return engine._consume(task)
        except (WorkerError, TimeoutError):
            self._inflight.clear()
            self._done = True
            engine._fail()
            raise

    def _abandon(self) -> None:
        self._superseded = True
        self._abandon_inflight()


def _make_stale(engine: Engine, inflight: collections.deque) -> None:
    if not engine.closed:
        for t in inflight:
            if t.generation == engine._generation:  # older ones died with their workers
                t.stale = True
                engine._stale.append(t)
    inflight.clear()


class InlineRun:
    """``num_workers=0``: load each batch in the calling process when asked for.

    The RNGs are seeded as a worker would seed them and the caller's RNG states are
    restored after each batch.  An exception consumes only its own batch.
    """

    def __init__(self, dataset: Any, fetch: Callable, tasks: Iterable[Task], seed: int) -> None:
        self._dataset = dataset
        self._fetch = fetch
        self._source = iter(tasks)
        self._seed = seed

    def __iter__(self) -> "InlineRun":
        return self

    def __next__(self) -> Any:
        epoch, batch_index, indices = next(self._source)
        torch = sys.modules.get("torch")
        saved = (random.getstate(), np.random.get_state(),
                 torch.random.get_rng_state() if torch is not None else None)
        try:
            seed_rngs(batch_seed(self._seed, epoch, batch_index))
            return self._fetch(self._dataset, indices, np.empty)
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            if saved[2] is not None:
                torch.random.set_rng_state(saved[2])


class ThreadRun:
    """``thread_pool=True``: load batches on a thread pool; plain arrays, no ring.

    The process-wide RNGs are not reseeded per batch (the threads share them).  The
    pool lives as long as this run; ``close()`` (or exhaustion) shuts it down.
    """

    def __init__(self, dataset: Any, fetch: Callable, tasks: Iterable[Task], num_workers: int, prefetch: int,
                 timeout_s: float | None) -> None:
        self._dataset = dataset
        self._fetch = fetch
        self._source = iter(tasks)
        self._prefetch = max(1, prefetch)
        self._timeout_s = timeout_s or None
        self._pool = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="mploader")
        self._pending: collections.deque = collections.deque()
        self._finalizer = weakref.finalize(self, _shutdown_pool, self._pool, self._pending)

    def __iter__(self) -> "ThreadRun":
        return self

    def __next__(self) -> Any:
        pending = self._pending
        while len(pending) < self._prefetch:
            t = next(self._source, None)
            if t is None:
                break
            pending.append((t, self._pool.submit(self._fetch, self._dataset, t[2], np.empty)))
        if not pending:
            self.close()
            raise StopIteration
        t, fut = pending.popleft()
        try:
            return fut.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"batch {t[1]} of epoch {t[0]} (sample indices {t[2]!r}) took more than "
                               f"{self._timeout_s} s in a pool thread") from None

    def close(self) -> None:
        self._finalizer()


def _shutdown_pool(pool: concurrent.futures.ThreadPoolExecutor, pending: collections.deque) -> None:
    for _, fut in pending:
        fut.cancel()
    pending.clear()
    pool.shutdown(wait=False, cancel_futures=True)
