"""The engine every face runs on: a slot ring, its workers, and a scheduler.

A face turns its sampling state into a stream of tasks ``(epoch, batch_index,
indices)`` (optionally a fourth element, the worker id the task must run on) and
hands it to :meth:`Engine.run`, which yields the batches.  ``fetch(dataset,
indices, alloc)`` -- run in a worker -- turns indices into a batch, allocating its
arrays with ``alloc`` (a slot view in a worker process, ``np.empty`` otherwise).

Layout (docs/design.md, "The engine"): this module owns the lifecycle (region,
workers, close, fork safety); :mod:`._scheduler` the batch loop;
:mod:`._executors` the processes and the in-process and thread executors;
:mod:`._worker` the worker loop; :mod:`._protocol` the wire format;
:mod:`._errors` the errors.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from . import _memory, _ring, _spec
from ._channel import Channel
from ._errors import WorkerError
from ._executors import CLOSE_GRACE_S, START_METHODS, InlineRun, ThreadRun, start_worker
from ._metrics import BusyCells
from ._scheduler import Run, Scheduler
from ._worker import WorkerSpec

__all__ = ["Engine", "InlineRun", "ThreadRun", "WorkerError", "Run", "CLOSE_GRACE_S"]


class _Pid:
    """This process's PID, cached: ``next()`` checks it on every batch, and
    ``os.getpid()`` is a system call (193 ns against 23 ns for the attribute, timeit;
    end to end within this machine's noise on tiny batches).  Refreshed in a child
    by ``os.register_at_fork`` (os.fork, multiprocessing's fork, and workers); a child
    made by a C-level ``fork()`` that bypasses it keeps the parent's value."""

    current = os.getpid()

    @classmethod
    def refresh(cls) -> None:
        cls.current = os.getpid()


os.register_at_fork(after_in_child=_Pid.refresh)


class _Resources:
    """What must be released when the engine goes away, held apart from the engine so
    that ``weakref.finalize`` can release it without keeping the engine alive.

    ``owner_pid`` is the process that created it: in a forked child (a worker of
    another loader, or any ``os.fork()`` of the training process) the finalizer only
    lets go of this process's copies of the descriptors -- it never stops the
    parent's workers (issue: a child's ``sys.exit()`` used to SIGKILL them).

    ``workers`` is the scheduler's (its one writer): the release and the fork path
    ask the scheduler, which the finalizer is handed with this object
    (``Receive.teardown``, ``Receive.drop_in_child``).
    """

    def __init__(self) -> None:
        self.region: Any = None
        self.workers: list[Channel] = []
        self.busy: BusyCells | None = None    # the workers' busy counters (_metrics)
        self.transport = _spec.Transport()    # the spec as spawn/forkserver workers receive it
        self.owner_pid = os.getpid()
        self.released = False   # release() has begun (close(), or the finalizer: gc or interpreter exit)

    def release(self, scheduler: Scheduler, grace_s: float = CLOSE_GRACE_S) -> None:
        self.released = True   # first: a next() in another thread that fails from here on knows why
        if os.getpid() != self.owner_pid:
            scheduler.drop_in_child(forget=True)
            return
        scheduler.teardown(grace_s)
        if self.busy is not None:
            self.busy.close()
        self.transport.close()
        if self.region is not None:
            # Closed and dropped: the mapping goes with the last lease that holds the
            # Region (every batch still alive keeps its memory valid).
            self.region.close()
            self.region = None

    def drop_in_child(self, scheduler: Scheduler) -> None:
        """In a forked worker: let go of this (other) loader's descriptors and mapping."""
        scheduler.drop_in_child(forget=True)
        if self.busy is not None:
            self.busy.forget()
            self.busy = None
        self.transport.forget()
        if self.region is not None:
            self.region.forget()
            self.region = None


_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()


def _drop_all_in_child(keep: _Resources) -> None:
    for engine in list(_LIVE):
        if engine._res is keep:
            engine._scheduler.drop_in_child(forget=False)
        else:
            engine._res.drop_in_child(engine._scheduler)


class Engine:
    """Runs batches on worker processes over a slot ring and yields them.

    Parameters
    ----------
    dataset : object with ``__getitem__``
        Inherited by forked workers (never pickled); pickled for spawn/forkserver.
    fetch : callable ``(dataset, indices, alloc) -> batch``
        Runs in the worker; ``alloc(shape, dtype)`` returns uninitialised arrays in
        the slot.  Must be picklable (module level) for spawn/forkserver.
    num_workers : int
        Worker processes, >= 1 (ids 0..num_workers-1).
    prefetch : int
        Batches in flight, >= 1.
    shared_mem : int or None
        Initial payload bytes per slot; None sizes slots from the first batch.
    timeout_s : float or None
        Seconds one batch may take once the parent waits for it (time the process
        is stopped does not count); None or 0 disables.
    seed : int
        Base seed; with ``reseed_per_batch`` batch (epoch, i) seeds the worker's
        RNGs from (seed, epoch, i).
    copy : bool
        Return owned arrays instead of views into the slot.
    auto_prefetch : int or None
        When set, the batches in flight rise from ``prefetch`` up to this while
        batches are small (at most ``mploader._options.SMALL_BATCHES_BYTES`` of them
        in flight; docs/design.md, "Batches in flight"); None keeps ``prefetch``.
    maxtasksperchild : int or None
        Replace a worker after this many batches.
    num_slots : int or None
        Slots in the ring; default ``prefetch + 3`` (``auto_prefetch + 3`` where set).
    on_slow : callable ``(seq, waited_s) -> None`` or None
        Called once per batch whose wait exceeds ``slow_after_s`` seconds.
    worker_init : callable ``(worker_id, num_workers) -> None`` or None
        Runs in each worker before its first task; an exception there is raised
        (original type) by ``next()`` for every batch that worker is given.
    reseed_per_batch : bool
        False: the engine never reseeds ``random``/NumPy/torch (``worker_init`` does).
    start_method : {"fork", "spawn", "forkserver"}
        How workers start.
    on_grow : callable ``(region) -> int | None`` or None
        Called in the parent after a delivered batch made the region's file larger
        (CUDA pinning registers the new range).  It may return how many bytes of the
        region it has dealt with: fewer than ``region.file_bytes`` (a worker has
        reserved a range but not yet allocated it in the file) and it is called again
        after the next batch even if the region did not grow meanwhile.
    stall_timeout : float, "auto" or None
        Seconds a worker may work on one batch before the watchdog takes its stack,
        kills it and loads the batch again on a replacement (mploader._watchdog);
        "auto": ``max(60, 10 x p99 batch time)`` (600 s for the first 20 batches);
        None (default): no batch is timed out (a forked worker that does not start
        within 10 s of its fork is still replaced: docs/design.md, "The watchdog").
    max_retries : int
        Times a batch is loaded again after a stall before ``StallError``.
    on_error : {"raise", "skip", "substitute"}
        What a sample whose ``dataset[i]`` raises becomes (mploader._bad_samples).
    max_bad_fraction, max_bad_samples : float, int or None
        The bad samples' budget: ``BadSampleBudgetError`` beyond it.
    bad_sample_log : str or None
        A JSON-lines file that gets one line per bad sample.
    poll_held : callable ``(wait: bool) -> int`` or None
        With a ``release_hook`` on the region (CUDA pinning keeps a released slot
        LEASED until the GPU's copies from it are done): releases the slots that may
        be reused now, or with ``wait=True`` waits for the oldest first; returns how
        many.  Called before every search for a free slot.

    Raises
    ------
    ValueError
        ``start_method`` unknown, or a count out of range.
    """

    def __init__(self, dataset: Any, fetch: Callable, *, num_workers: int, prefetch: int,
                 shared_mem: int | None, timeout_s: float | None, seed: int, copy: bool = False,
                 auto_prefetch: int | None = None,
                 maxtasksperchild: int | None = None, num_slots: int | None = None,
                 on_slow: Callable[[int, float], None] | None = None, slow_after_s: float | None = None,
                 worker_init: Callable[[int, int], None] | None = None, reseed_per_batch: bool = True,
                 start_method: str = "fork", on_grow: Callable[[Any], int | None] | None = None,
                 poll_held: Callable[[bool], int] | None = None, copy_below_bytes: int = 0,
                 warn_when_full: bool = True, stall_timeout: float | str | None = None,
                 max_retries: int = 1, on_error: str = "raise", max_bad_fraction: float | None = None,
                 max_bad_samples: int | None = None, bad_sample_log: str | None = None) -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 for an Engine, got {num_workers}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if auto_prefetch is not None and not prefetch <= auto_prefetch <= _ring.MAX_SLOTS - 3:
            raise ValueError(f"auto_prefetch must be between prefetch ({prefetch}) and {_ring.MAX_SLOTS - 3}, "
                             f"got {auto_prefetch}")
        self.num_slots = num_slots or (auto_prefetch or prefetch) + 3
        if self.num_slots > _ring.MAX_SLOTS:
            raise ValueError(f"prefetch must be at most {_ring.MAX_SLOTS - 3} (the ring has at most "
                             f"{_ring.MAX_SLOTS} slots), got {prefetch}")
        self.dataset = dataset
        self.fetch = fetch
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.auto_prefetch = auto_prefetch   # the most in flight while batches are small (None: prefetch)
        self.shared_mem = shared_mem
        self.timeout_s = timeout_s or None
        self.seed = seed
        self.copy = copy
        # Arrays of fewer bytes are delivered as owned copies, the rest as views of the
        # slot (docs/design.md, "The lease rule"): a kept label must not keep its batch.
        self.copy_below_bytes = copy_below_bytes
        # All slots held by live batches: a RuntimeWarning (Gluon, Chainer), or one INFO
        # line on the "mploader" logger (the torch face: torch's DataLoader says nothing).
        self.warn_when_full = warn_when_full
        self.maxtasksperchild = maxtasksperchild
        self.on_slow = on_slow
        self.slow_after_s = slow_after_s
        self.on_grow = on_grow
        self.poll_held = poll_held
        # The watchdog (mploader._watchdog): seconds a worker may spend on one batch,
        # "auto" (the default rule) or None (off); and how often a batch is loaded
        # again after a stall before StallError.
        self.stall_timeout = stall_timeout
        self.max_retries = max_retries
        # The bad-sample policy and its budget (mploader._bad_samples)
        self.on_error = on_error
        self.max_bad_fraction = max_bad_fraction
        self.max_bad_samples = max_bad_samples
        self.bad_sample_log = bad_sample_log
        self.start_method = start_method
        self.spec = WorkerSpec(dataset, fetch, seed, reseed_per_batch, worker_init, num_workers, on_error)
        self._res = _Resources()
        self._owner_pid = self._res.owner_pid
        self._lock = threading.RLock()
        self._closing = False
        self._closed = False
        self._current: Callable[[], Run | None] = lambda: None
        self._scheduler = Scheduler(self, self._res, self._lock)
        # The finalizer holds the scheduler (which holds this engine only through a
        # weak proxy): the workers are the scheduler's to stop (Receive.teardown).
        self._finalizer = weakref.finalize(self, _Resources.release, self._res, self._scheduler)
        _LIVE.add(self)

    # ---- lifecycle ----

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def closing(self) -> bool:
        """``close()`` has begun (maybe in another thread): a waiting ``next()`` gives up."""
        return self._closing

    @property
    def region(self) -> Any:
        """The shared region (``mploader._ring.Region``), None before the first run."""
        return self._res.region

    def close(self) -> None:
        """Stop the workers and release the region (leases stay valid).  Idempotent;
        safe from another thread: a ``next()`` waiting there raises RuntimeError."""
        self._closing = True
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._scheduler.close()
            self._finalizer()

    def stop_workers(self, run: Run | None = None) -> None:
        """End the worker processes but keep the region; the next run starts new ones
        (``persistent_workers=False``).  Batches in flight are abandoned.  With ``run``:
        only while ``run`` is the current run (an old iterator that ends late leaves
        the workers to the newer run that took them)."""
        with self._lock:
            previous = self._current()
            if run is not None and previous is not run:
                return
            if previous is not None:
                previous.abandon()
            self._scheduler.reset("stop")

    def set_seed(self, seed: int) -> None:
        """Use base seed ``seed`` from the next run on (a checkpoint's seed): running
        workers, which hold the old one, are stopped and restarted by that run."""
        with self._lock:
            if seed == self.seed:
                return
            if self.worker_pids():
                self.stop_workers()
            self.seed = seed
            self.spec = dataclasses.replace(self.spec, seed=seed)

    def worker_pids(self) -> list[int]:
        return self._scheduler.worker_pids()

    def staged_slots(self) -> list[int]:
        """The ring's slots that hold the next epoch's first batches, dispatched ahead
        while this epoch ended (docs/design.md, "No gap between epochs"), and those the
        current run took and has not yet compared with its own tasks (it compares them
        as it pulls its source): not leaked, the run takes them over or frees them."""
        with self._lock:
            slots = self._scheduler.staged_slots()
            run = self._current()
            taken = run.staged if run is not None else None
            if taken is not None:
                slots += [t.slot for t in taken.inflight if t.slot >= 0]
            return slots

    def stats(self) -> dict:
        """Counters: batches, slot (fast path), fallback_inband, fallback_pipe, no_free_slot,
        grown, errors; stalls and respawns (the watchdog's: mploader._watchdog); bad_samples
        (one dict per bad sample: index, epoch, batch_index, type, message, substitute)
        and bad_sample_count (mploader._bad_samples); plus num_slots and shm_bytes (bytes the region's file spans);
        plus the input-pipeline metrics of :func:`mploader._metrics.engine_stats`
        (docs/metrics.md)."""
        return self._scheduler.report(self._current())

    def set_report(self, report: Callable[[], None] | None, every_s: float) -> None:
        """Call ``report`` at the first ``next()`` after every ``every_s`` seconds
        (None: no report); :func:`mploader._diagnose.log_stats_every` sets it."""
        self._scheduler.set_report(report, every_s)

    def bad_sample_state(self) -> dict | None:
        """The bad samples' report and budget counts for a checkpoint (JSON-safe);
        None with ``on_error="raise"``."""
        return self._scheduler.bad_sample_state()

    def load_bad_samples(self, parsed: tuple) -> None:
        """Restore :func:`mploader._bad_samples.parse_state`'s result (a checkpoint's)."""
        self._scheduler.load_bad_samples(parsed)

    def _check_usable(self) -> None:
        if _Pid.current != self._owner_pid:
            raise RuntimeError(f"this loader was created in process {self._owner_pid} and cannot be used in its "
                               f"forked child {os.getpid()}: create a new loader in the child")
        if self._closed or self._closing:
            raise RuntimeError("the loader is closed")

    def ensure_workers(self) -> None:
        """Create the region if needed and have the scheduler start the missing
        workers (ids 0..N-1: ``Dispatch.staff``)."""
        res = self._res
        if res.region is None:
            reserve = _memory.reserve_bytes()
            try:
                res.region = _ring.create_region(self.num_slots, self.shared_mem or 0, reserve)
            except OSError as exc:
                raise _memory.region_error(exc, reserve) from exc
            if self.on_grow is not None:  # its pages will be page-locked: no slot regrows into given-back pages
                res.region.set_pinned()
            busy = None
            if res.busy is None:
                res.busy = busy = BusyCells(self.num_workers, passed_fd=self.start_method != "fork")
            self._scheduler.attach(res.region, busy)
        self._scheduler.staff()

    def start_worker(self, wid: int) -> Channel:
        """Start worker ``wid`` and return its channel (not yet among the workers: the
        scheduler, which calls it, adds it)."""
        res = self._res
        region = res.region
        if res.released or region is None:
            # The finalizer ran at interpreter exit while another thread iterates:
            # nothing may start now (next_batch turns this into a quiet exit).
            raise RuntimeError(f"worker {wid} cannot start: the loader's resources were released")
        busy = res.busy
        cell = busy.allocate() if busy is not None else -1
        if busy is not None and self.start_method == "fork":
            busy.booting(cell)   # the start-up deadline (mploader._watchdog), until the child's first step
        try:
            worker = start_worker(self.spec, wid, region, self.start_method, lambda: _drop_all_in_child(res),
                                  busy=busy.boot(cell) if busy is not None else None, transport=res.transport)
        except BaseException:
            if busy is not None:
                busy.clear_start(cell)
            raise
        if busy is not None:
            busy.own(cell, worker)
        return worker

    # ---- running ----

    def run(self, tasks: Iterable[tuple], in_order: bool = True, tagged: bool = False,
            lookahead: Callable[[], Iterator[tuple] | None] | None = None, upstream_pulls: bool = False) -> Run:
        """An iterator over the batch of each task, ``prefetch`` in flight; in task
        order, or in completion order with ``in_order=False``.  ``tagged``: each item
        is ``(worker_id, batch_index, value, failed, side)`` -- the worker that built
        the batch and the task's batch index, as the scheduler holds them; ``value`` is
        the batch, or with ``failed`` the exception ``next()`` would have raised;
        ``side`` the batch's side record (``bytes`` or None: mploader._face.Face.side).

        Starting a run supersedes the previous one: its batches in flight are
        discarded (their slots freed as they complete) and its ``next()`` raises
        RuntimeError.  See :class:`~mploader._run.Run` for the errors raised.

        ``lookahead`` (no gap between epochs, docs/design.md): a callable the scheduler
        calls once this run's tasks are all dispatched, returning the tasks the face
        expects of its next run (an iterator, drawn from without side effects) or
        None; their first ones are dispatched into the depth the run no longer uses,
        and the next run takes them over only if its own first tasks are equal.

        ``upstream_pulls`` (runs in order only): pull ``tasks`` as torch's and Gluon's
        multi-process iterators pull their batch sampler once a batch was asked for --
        one more as each batch is handed off, before ``next()`` returns, so that after
        ``k`` batches ``prefetch + k`` were pulled -- while the depth is ``prefetch``
        (docs/design.md, "Batches in flight", *When the sampler is pulled*; the first
        pulls wait for the first ``next()``, as before); an exception the source raises
        then propagates from that ``next()``.
        """
        with self._lock:
            self._check_usable()
            previous = self._current()
            if previous is not None:
                previous.abandon()
            self.ensure_workers()
            run = Run(self, self._scheduler, tasks, in_order, tagged)
            run.lookahead = lookahead
            run.staged = self._scheduler.take_staged(in_order, tagged)
            self._current = weakref.ref(run)  # weak: a run keeps its engine alive, not the reverse
            run.upstream_pulls = upstream_pulls and in_order
            return run

    def busy(self) -> bool:
        """Whether a run of this engine is still under way: neither exhausted, ended by
        an error, superseded, nor :meth:`~mploader._run.Run.drained` (a new iterator of
        the face then needs workers of its own, as each of torch's non-persistent
        iterators has).

        Raises
        ------
        RuntimeError
            The engine is closed, or this is a forked child of the process that made
            it (as :meth:`run`: asked just before a run is made).
        """
        self._check_usable()
        run = self._current()
        return run is not None and not run.done and not run.superseded and not run.drained()

    def next_batch(self, run: Run) -> None:
        """Put ``run``'s next batch in ``run.handoff`` (``Run.__next__`` calls it): under
        the engine's lock, in the process that made the engine, while it is open; the
        scheduler's ``next_batch`` raises StopIteration at the end of the run."""
        with self._lock:
            self._check_usable()
            try:
                self._scheduler.next_batch(run)
                return
            except Exception as exc:
                if not self._res.released or self._closing:
                    raise
                failure = exc
        _released_under(failure)   # outside the lock: an atexit close() must not wait for it


def _released_under(exc: Exception) -> None:
    """A ``next()`` failed because the engine's resources were released without
    ``close()``: by its ``weakref.finalize`` at interpreter exit, while another thread
    was still iterating (a run keeps its engine alive, so the collector cannot have
    released it).  A daemon thread then waits quietly to be ended with the
    interpreter (as torch's does), instead of printing a traceback of whatever the
    teardown broke (a closed descriptor, a stopped worker); any other thread gets a
    RuntimeError that says so."""
    if threading.current_thread().daemon:
        threading.Event().wait()   # never set: the interpreter ends this thread
    raise RuntimeError("the loader's workers were stopped while this thread was iterating it "
                       "(interpreter exit)") from exc

