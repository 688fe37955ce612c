"""Where batches are computed: worker processes, the calling process, a thread pool.

* :func:`start_worker` starts one worker process (forked, or started by the zygote
  or a ``multiprocessing`` spawn/forkserver context) and returns its
  :class:`~mploader._channel.Channel` (its socket, its pidfd -- or where pidfd_open
  is refused, a pipe that reads EOF when it exits -- its exit status, and the
  scheduler's records on it); :func:`stop_workers` ends a group of them (close the
  sockets, a grace period, then SIGKILL).
* :class:`InlineRun` -- ``num_workers=0``: each batch loaded when asked for.
* :class:`ThreadRun` -- ``thread_pool=True``: daemon threads, plain arrays.
"""
from __future__ import annotations

import _imp
import errno
import gc
import importlib
import multiprocessing
import multiprocessing.connection
import os
import queue
import random
import select
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from . import _fds, _spec, _steps, _zygote
from ._channel import Channel
from ._worker import WorkerBoot, WorkerSpec, batch_seed, fork_main, seed_rngs, spawn_main

START_METHODS = ("fork", "spawn", "forkserver")
#: Grace given to workers to exit on their own at close() and stop_workers() (seconds).
CLOSE_GRACE_S = 0.5


def exited(workers: list[Channel], timeout_s: float) -> list[Channel]:
    """The workers among ``workers`` whose process has ended, waiting up to ``timeout_s``.

    poll(), not select(): a training process may hold more than FD_SETSIZE (1024)
    descriptors, and select() cannot watch a descriptor numbered above that.  A pidfd
    is readable once its process has exited; the fallback pipe reports POLLHUP once
    the worker (and anything it forked) has closed its end, i.e. exited.
    """
    if not workers:
        return []
    poller = select.poll()
    for w in workers:
        poller.register(w.pidfd, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(max(0, int(timeout_s * 1000)))}
    return [w for w in workers if w.pidfd in ready]


def start_worker(spec: WorkerSpec, wid: int, region: Any, start_method: str,
                 drop_in_child: Callable[[], None], busy: tuple | None = None,
                 transport: _spec.Transport | None = None) -> Channel:
    """Start worker ``wid``: ``fork`` runs :func:`fork_main` in a child of this
    process; ``spawn``/``forkserver`` fork it from this process's zygote
    (:mod:`mploader._zygote`; with ``MPLOADER_ZYGOTE=0``, ``multiprocessing`` starts
    a fresh interpreter), which receives ``spec`` in a memfd (``transport``'s, packed
    once per generation of workers: :mod:`mploader._spec`) and the region's memfd as
    passed descriptors.  ``busy``: the worker's busy-time cell
    (:meth:`mploader._metrics.BusyCells.boot`), or None.

    Every descriptor made here is >= 3 and close-on-exec (:mod:`mploader._fds`).
    Where pidfd_open is refused, the worker watches this process's lifeline and this
    process watches the worker through a pipe.  Nothing is left behind by a start
    that fails: a child already forked is killed and reaped.

    Raises
    ------
    OSError
        EMFILE with a message naming ``RLIMIT_NOFILE``, the descriptors each loader
        uses and how to raise the limit, when too few are left to start the worker.
    pickle.PicklingError
        (spawn, forkserver) Part of ``spec`` cannot be pickled even by value; the
        message names its attribute path (``dataset.transform.fn``).
    RuntimeError
        Called in a zygote while it imports the parent's main script (a script with
        no ``if __name__ == "__main__":`` guard; :func:`mploader._zygote.importing_main_error`).
    """
    what = f"worker {wid} of a loader with num_workers={spec.num_workers}"
    refused = _zygote.importing_main_error()
    if refused is not None:
        raise refused
    how = descriptor_kind(start_method)
    _fds.check_headroom(spec.num_workers, how, what)
    try:
        return _start_worker(spec, wid, region, start_method, drop_in_child, busy, transport)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise _fds.descriptors_exhausted(spec.num_workers, how, what) from exc
        raise


def descriptor_kind(start_method: str) -> str:
    """How workers started with ``start_method`` hold descriptors (a key of
    :data:`mploader._fds.HOW`): "fork", "zygote", or the method itself."""
    return start_method if start_method == "fork" or not _zygote.enabled() else "zygote"


def _start_worker(spec: WorkerSpec, wid: int, region: Any, start_method: str,
                  drop_in_child: Callable[[], None], busy: tuple | None,
                  transport: _spec.Transport | None) -> Channel:
    parent_pid = os.getpid()
    lifeline = -1 if _fds.pidfd_usable() else _fds.lifeline()
    parent_conn, child_conn = _fds.connection_pair()
    owned: list[Any] = [parent_conn, child_conn]  # closed if the start fails
    pid = 0
    proc: Any = None
    try:
        if start_method == "fork":
            watch_r, watch_w = _fds.pipe() if lifeline >= 0 else (-1, -1)
            owned += [watch_r, watch_w]

            def drop() -> None:  # in the child, once it watches the parent (a hang here is not for ever)
                parent_conn.close()
                if watch_r >= 0:
                    os.close(watch_r)  # (watch_w stays open until this worker exits)
                drop_in_child()
                _torch_one_thread()

            boot = WorkerBoot(wid, parent_pid, child_conn, region=region, drop=drop, busy=busy, lifeline=lifeline)
            for stream in (sys.stdout, sys.stderr):
                try:
                    if stream is not None:
                        stream.flush()
                except (OSError, ValueError, AttributeError):
                    pass
            quiet = _import_quiet()
            # Everything alive now is frozen out of the collector for the fork: the child's
            # collections then never touch (copy) the parent's objects' pages, nor run
            # finalizers of parent objects that become garbage there (gc.freeze docs).
            gc.freeze()
            try:
                pid = os.fork()
                if pid == 0:  # pragma: no cover - runs in the child
                    if quiet:
                        _import_unlock()
                    fork_main(spec, boot)
            finally:
                gc.unfreeze()
                if quiet:
                    _import_unlock()
            child_conn.close()
            if watch_w >= 0:
                os.close(watch_w)
                owned.remove(watch_w)
            worker = Channel(wid, pid, parent_conn, watch_fd=watch_r)
            return worker
        if _zygote.enabled():
            _zygote.warm()  # its start (imports) overlaps the pickling below
        own_transport = transport is None  # (a one-off: closed once the worker has its memfd)
        if transport is None:
            transport = _spec.Transport()
            owned.append(transport)
        packed = transport.get(spec)
        boot = WorkerBoot(wid, parent_pid, child_conn, region_fd=_fds.PassedFd(region.fd), busy=busy,
                          lifeline=_fds.PassedFd(lifeline) if lifeline >= 0 else -1,
                          spec_fd=_fds.PassedFd(packed.fd))
        name = f"mploader-worker-{wid}"
        if _zygote.enabled():
            proc = _zygote.start_worker(boot, packed.modules, name)
            owned.append(proc.sentinel)
            pid = proc.pid
            watch = proc.sentinel  # its status pipe: readable once the zygote has reaped it
        else:
            ctx: Any = multiprocessing.get_context(start_method)
            proc = ctx.Process(target=spawn_main, args=(None, boot), name=name, daemon=True)
            with _fds.stdio_reserved():
                proc.start()
            pid = proc.pid
            watch = _fds.dup(proc.sentinel) if lifeline >= 0 else -1
            owned.append(watch)
        child_conn.close()
        if own_transport:
            transport.close()
        return Channel(wid, pid, parent_conn, proc, watch_fd=watch)
    except BaseException:
        if pid > 0:  # started: it must not outlive a start that failed, nor stay a zombie
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if proc is not None:
                proc.join()
                multiprocessing.active_children()
            else:
                os.waitpid(pid, 0)
        for x in owned:
            try:
                x.close() if not isinstance(x, int) else (os.close(x) if x >= 0 else None)
            except OSError:
                pass
        raise


def _torch_one_thread() -> None:
    """In a forked worker of a process that imported torch: ``torch.set_num_threads(1)``,
    as torch's DataLoader workers do (``worker_init`` runs later and may raise it).

    torch's CPU build runs its intra-op work (``at::parallel_for``, MKL) on GNU
    OpenMP, and libgomp is not fork-safe: the forking thread's thread pool is
    inherited, but its threads are not, so once the training thread has run any
    parallel op (a model's forward, ``torch.ones(512, 512)``), a worker's first
    parallel op waits forever for them (gdb: ``gomp_team_barrier_wait_end`` under
    ``gomp_team_end``).  With one thread no team is formed.
    """
    torch = sys.modules.get("torch")
    set_num_threads = getattr(torch, "set_num_threads", None)  # None: no torch, or not torch's
    if set_num_threads is not None:
        set_num_threads(1)


def _foreign_import_locks() -> list[str]:
    """Names of the modules whose import lock another thread holds right now."""
    locks = getattr(getattr(importlib, "_bootstrap", None), "_module_locks", None)
    if not locks:
        return []
    me = threading.get_ident()
    names = []
    for name, ref in list(locks.items()):
        lock: Any = ref()
        if lock is not None and lock.count and lock.owner != me:
            names.append(name)
    return names


def _import_quiet() -> bool:
    """Wait until no other thread is inside an import, then take the global import
    lock (so none can start one) and return True -- the caller forks and then calls
    :func:`_import_unlock`.  False: this Python has no such locks; fork anyway.

    A module another thread is importing when a worker forks stays half initialised
    in the worker forever, and its import lock stays owned by a thread that does not
    exist there: the worker's own ``import`` of it (a dataset that imports torch)
    hangs, or finds a partial module.  A thread inside an import needs the global
    lock only to start the next one, so it is waited for without holding it.
    """
    bootstrap = getattr(importlib, "_bootstrap", None)
    manager = getattr(bootstrap, "_ModuleLockManager", None)
    if manager is None:  # pragma: no cover - a Python without importlib's module locks
        return False
    while True:
        for name in _foreign_import_locks():
            with manager(name):  # waits for that import to finish
                pass
        _imp.acquire_lock()
        if not _foreign_import_locks():
            return True
        _imp.release_lock()


def _import_unlock() -> None:
    try:
        _imp.release_lock()
    except RuntimeError:  # pragma: no cover - not held (a child whose lock was reset)
        pass


def stop_workers(workers: list[Channel], grace_s: float) -> None:
    """End ``workers``: close their pipes (an idle worker exits on EOF), wait up to
    ``grace_s`` seconds, SIGKILL the rest, reap all, close their descriptors."""
    for w in workers:
        try:
            w.conn.close()
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    alive = [w for w in workers if not w.reap()]
    while alive:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for w in exited(alive, left):
            w.reap()
        alive = [w for w in alive if w.status is None]
    for w in alive:
        try:
            os.kill(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        w.reap(block=True)
    for w in workers:
        w.close_fds()
    if any(w.process is not None for w in workers):
        multiprocessing.active_children()  # lets multiprocessing forget the spawned processes


class _Failed:
    """The sampler raised ``error`` on the feeder thread: the pass cannot go on."""
    __slots__ = ("error", "raised")

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.raised = False


_END = object()    # the feeder's record for the end of the pass
_STOP = object()   # a token that ends the feeder thread


def _feed(source: Any, tokens: queue.SimpleQueue, results: queue.SimpleQueue,
          submit: Callable[[tuple], Any] | None) -> None:
    """A feeder thread: one task of ``source`` (the sampler's task stream) onto
    ``results`` per token taken from ``tokens`` (``submit(task)`` when given: the
    task handed to a pool first); then ``_END``, or ``_Failed`` when the source
    raised, and the thread ends.  The sampler runs here, not in the main thread,
    where a signal handler's exception (KeyboardInterrupt) would finish its generator."""
    while tokens.get() is not _STOP:
        try:
            t = next(source)
        except StopIteration:
            results.put(_END)
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            results.put(_Failed(exc))
            return
        results.put(t if submit is None else submit(t))
        del t


def _start_feeder(source: Any, prefetch: int,
                  submit: Callable[[tuple], Any] | None) -> tuple[queue.SimpleQueue, queue.SimpleQueue]:
    """Start a feeder thread (:func:`_feed`) over ``source`` and return its
    ``(tokens, results)``, a run's fields that :func:`mploader._steps.take_pulled`
    reads (with ``asked``); at most ``prefetch`` tasks are pulled ahead of the run's
    box (1: on demand)."""
    tokens: queue.SimpleQueue = queue.SimpleQueue()
    results: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(prefetch - 1):
        tokens.put(None)
    threading.Thread(target=_feed, args=(source, tokens, results, submit), name="mploader-feeder",
                     daemon=True).start()
    return tokens, results


def _source_failed(record: _Failed) -> BaseException:
    """What ``next()`` raises once the sampler raised: its exception the first
    time, then an error that says the pass cannot go on (as the engine's runs do)."""
    if not record.raised:
        record.raised = True
        return record.error
    err = record.error
    exc = RuntimeError(f"this pass cannot go on: its sampler's iterator raised {type(err).__name__} inside it, "
                       "which ends a Python generator; every batch it gave before was delivered; start a new pass "
                       "(iter(loader))")
    exc.__cause__ = err
    return exc


class InlineRun:
    """``num_workers=0``: load each batch in the calling process when asked for.

    With ``reseed_per_batch`` the RNGs are seeded as a worker would seed them and
    the caller's RNG states are restored after each batch.  An exception consumes
    only its own batch.

    After :meth:`hold` (the Gluon face, through :class:`mploader._metrics.MeteredRun`)
    the run is safe against interrupts (issue 25 s.2): the sampler runs on a feeder
    thread (no signal handler runs there, so none finishes its generator), each task
    is taken into the box in one C step (:func:`mploader._steps.take_pulled`), and
    the batch made from it stays in the box until the face's C ``__next__``
    (:func:`mploader._steps.serial_next`) delivered it and emptied the box.  An
    interrupt while the batch is made (KeyboardInterrupt: not an ``Exception``)
    leaves the task in the box and the next ``next()`` makes the batch again; one
    after it was made leaves the batch there and the next ``next()`` returns it.
    """

    def __init__(self, dataset: Any, fetch: Callable, tasks: Iterable[tuple], seed: int,
                 reseed_per_batch: bool = True) -> None:
        self._dataset = dataset
        self._fetch = fetch
        self._source = iter(tasks)
        self._seed = seed
        self._reseed = reseed_per_batch
        self._box: list | None = None
        self._saved: tuple | None = None   # the caller's RNG states while a batch is made

    def hold(self) -> list:
        """Switch to the interrupt-safe mode (see the class) and return the box, which
        the caller empties once it has delivered the batch (``serial_next``'s ``it._held``)."""
        if self._box is None:
            self._box = []
            self.tokens, self.results = _start_feeder(self._source, 1, None)
            self.asked = False
            weakref.finalize(self, self.tokens.put, _STOP)   # a run left mid-pass: its feeder ends
        return self._box

    def __iter__(self) -> InlineRun:
        return self

    def __next__(self) -> Any:
        box = self._box
        if box is None:
            return self._next_plain()
        if self._saved is not None:   # an interrupt cut the last restore short
            self._restore()
        if len(box) == 2:   # made, not delivered: an interrupt came after
            return box[1]
        _steps.take_pulled(self, box)
        record = box[0]
        if record is _END:
            raise StopIteration
        if type(record) is _Failed:
            raise _source_failed(record)
        epoch, batch_index, indices = record[:3]
        try:
            if self._reseed:
                self._save()
                seed_rngs(batch_seed(self._seed, epoch, batch_index))
            box.append(self._fetch(self._dataset, indices, np.empty))
        except Exception:
            del box[:]   # the batch's own exception consumes it
            raise
        finally:
            if self._saved is not None:
                self._restore()
        return box[1]

    def _save(self) -> None:
        torch = sys.modules.get("torch")
        self._saved = (random.getstate(), np.random.get_state(),
                       torch.random.get_rng_state() if torch is not None else None)

    def _restore(self) -> None:
        saved = self._saved
        assert saved is not None
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch = sys.modules.get("torch")
        if saved[2] is not None and torch is not None:
            torch.random.set_rng_state(saved[2])
        self._saved = None

    def _next_plain(self) -> Any:
        epoch, batch_index, indices = next(self._source)[:3]
        if not self._reseed:
            return self._fetch(self._dataset, indices, np.empty)
        torch = sys.modules.get("torch")
        saved = (random.getstate(), np.random.get_state(),
                 torch.random.get_rng_state() if torch is not None else None)
        try:
            seed_rngs(batch_seed(self._seed, epoch, batch_index))
            return self._fetch(self._dataset, indices, np.empty)
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            if torch is not None:
                torch.random.set_rng_state(saved[2])


class _Future:
    __slots__ = ("done", "value", "error", "cancelled")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.cancelled = False


def _pool_thread(jobs: queue.SimpleQueue[Any]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        fut, fn, args = job
        if fut.cancelled:
            continue
        try:
            fut.value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            fut.error = exc
        fut.done.set()
        del fut, fn, args, job


class ThreadRun:
    """``thread_pool=True``: load batches on ``num_workers`` threads; plain arrays.

    The threads are daemon threads, so a sample that never returns cannot keep the
    process alive after the script ends (``concurrent.futures`` joins its threads
    at exit).  The process-wide RNGs are not reseeded per batch (the threads share
    them).  ``close()`` (or exhaustion, or garbage collection) stops the threads.
    A feeder thread pulls the sampler and hands each task to the pool, at most
    ``prefetch`` ahead; each ``(task, future)`` is taken into the box (:meth:`hold`)
    in one C step and its batch stays there until delivered, as in
    :class:`InlineRun`: an interrupt loses no batch and finishes no generator.
    """

    def __init__(self, dataset: Any, fetch: Callable, tasks: Iterable[tuple], num_workers: int, prefetch: int,
                 timeout_s: float | None) -> None:
        self._timeout_s = timeout_s or None
        self._box: list = []
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        threads = [threading.Thread(target=_pool_thread, args=(jobs,), name=f"mploader-thread-{i}",
                                    daemon=True) for i in range(num_workers)]
        for t in threads:
            t.start()

        def submit(t: tuple) -> tuple:   # on the feeder thread
            fut = _Future()
            jobs.put((fut, fetch, (dataset, t[2], np.empty)))
            return t, fut

        self.tokens, self.results = _start_feeder(iter(tasks), max(1, prefetch), submit)
        self.asked = False
        self._finalizer = weakref.finalize(self, _stop_pool, jobs, self.tokens, self.results, len(threads))

    def hold(self) -> list:
        """The box (see the class), which the caller empties once it has delivered the batch."""
        return self._box

    def __iter__(self) -> ThreadRun:
        return self

    def __next__(self) -> Any:
        box = self._box
        if len(box) == 2:   # made, not delivered: an interrupt came after
            return box[1]
        _steps.take_pulled(self, box)
        record = box[0]
        if record is _END:
            self.close()
            raise StopIteration
        if type(record) is _Failed:
            raise _source_failed(record)
        t, fut = record
        if not fut.done.wait(self._timeout_s):
            raise TimeoutError(f"batch {t[1]} of epoch {t[0]} (sample indices {t[2]!r}) took more than "
                               f"{self._timeout_s} s in a pool thread")
        if fut.error is not None:
            del box[:]   # the batch's own exception consumes it
            raise fut.error
        box.append(fut.value)
        return box[1]

    def close(self) -> None:
        self._finalizer()


def _stop_pool(jobs: queue.SimpleQueue[Any], tokens: queue.SimpleQueue[Any], results: queue.SimpleQueue[Any],
               nthreads: int) -> None:
    tokens.put(_STOP)
    while True:   # the tasks pulled ahead: their batches are not wanted
        try:
            record = results.get_nowait()
        except queue.Empty:
            break
        if type(record) is tuple:
            record[1].cancelled = True
    for _ in range(nthreads):
        jobs.put(None)
