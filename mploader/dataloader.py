"""``mploader.DataLoader``: MXNet Gluon's DataLoader on the slot ring."""
from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import _bad_samples, _diagnose, _engine, _metrics, _pinning, _state, _steps
from ._collate import Alloc, collate_gluon
from ._executors import START_METHODS
from ._face import Face
from ._options import LoaderOptions, check_callable, check_choice, check_dataset, check_int
from .batchify import collate
from .sampler import BatchSampler, RandomSampler, SequentialSampler, next_pass

_LAST_BATCH = ("keep", "discard", "rollover")


class BatchifyFetch(Face):
    """The Gluon face's worker contract (:class:`mploader._face.Face`): one batch of
    indices.

    ``load`` reads ``[dataset[i] for i in indices]``.  Batchify functions with a
    ``collate(samples, alloc)`` method (the default, which is Gluon's
    ``default_batchify_fn`` rule, and those of :mod:`mploader.batchify`) write
    straight into ``alloc``'s arrays; any other callable is called as
    ``batchify_fn(samples)`` and its arrays are copied into the slot once.  A list of
    samples under the default rule is plannable.
    """

    __slots__ = ("batchify_fn",)

    def __init__(self, batchify_fn: Callable | None) -> None:
        self.batchify_fn = batchify_fn

    def load(self, dataset: Any, indices: Sequence[Any]) -> Any:
        return [dataset[i] for i in indices]

    def collate(self, samples: Sequence[Any], alloc: Alloc) -> Any:
        if self.batchify_fn is None:
            return collate_gluon(samples, alloc)
        return collate(self.batchify_fn, samples, alloc)

    def plannable(self, dataset: Any, samples: Any) -> bool:
        return self.batchify_fn is None and type(samples) is list


def make_fetch(batchify_fn: Callable | None = None) -> BatchifyFetch:
    """The Gluon face's ``fetch`` for ``batchify_fn`` (None: Gluon's default rule)."""
    return BatchifyFetch(batchify_fn)


class DataLoader:
    """Loads samples from a dataset and returns batches, as ``mxnet.gluon.data.DataLoader``.

    Iterating the loader (``for batch in loader``) runs one epoch; ``len(loader)`` is
    the number of batches the next epoch yields (``len(batch_sampler)``).  An
    iterator keeps working after the loader object itself is gone, and starting a new
    iteration of the same loader ends the previous one (it raises RuntimeError if
    used again).  ``close()`` or a ``with`` block stops the workers; otherwise they
    stop when the loader and its iterators have been garbage-collected.

    Workers are forked processes that collate each batch directly into a slot of a
    shared-memory ring; every array of a returned batch is a zero-copy view of that
    slot (``base`` chain ends in a ``SlotLease``).  The slot is reused only after
    every view of it -- and anything built on them, e.g. ``torch.from_numpy`` -- has
    been garbage-collected, so a returned batch never changes.

    Parameters
    ----------
    dataset : Dataset
        Anything with ``__getitem__`` and ``__len__`` (numpy arrays included).
    batch_size : int, optional
        Samples per batch; required unless ``batch_sampler`` is given.
    shuffle : bool
        Shuffle the samples each epoch (permutation drawn from a generator seeded by
        (seed, epoch)).  Not with ``sampler``.
    sampler : Sampler, optional
        Yields sample indices.  Not with ``shuffle``.
    last_batch : {'keep', 'discard', 'rollover'}, optional
        What to do with an incomplete last batch (default 'keep'), as Gluon.
    batch_sampler : Sampler, optional
        Yields lists of indices.  Not with batch_size, shuffle, sampler, last_batch.
    batchify_fn : callable, optional
        ``batchify_fn(samples) -> batch``.  Default: :func:`mploader.default_batchify`,
        Gluon's ``default_batchify_fn`` rule (tuples are batched field by field into a
        list; anything else becomes ``np.asarray(samples)``), written straight into the
        slot.  ``mploader.batchify.Nested()`` also recurses into lists and dicts.
    num_workers : int
        Worker processes; 0 loads in the calling process.
    pin_memory : bool
        When torch with a usable CUDA device is installed and the loader uses worker
        processes, the shared region is page-locked (``cudaHostRegister``) as it
        grows, so every returned array is already in pinned memory and
        ``torch.from_numpy(a).cuda(non_blocking=True)`` copies asynchronously without
        an extra copy (Gluon copied each batch into pinned memory instead).  Otherwise
        (no torch, no CUDA, ``num_workers=0``, ``thread_pool=True`` or ``copy=True``)
        it is a no-op: batches are ordinary host memory.
    pin_device_id : int
        CUDA device whose context registers the region; the registration is
        portable, i.e. pinned for every device.
    prefetch : int, optional
        Batches in flight (default ``2 * num_workers``); at least 1 with workers (Gluon
        returned no batch at all with 0) and at most
        ``mploader._options.MAX_PREFETCH`` (the ring's slot limit minus 3).
    thread_pool : bool
        Use ``num_workers`` threads instead of processes (no shared memory).
    timeout : float
        Seconds one batch may take once the loader waits for it (default 120);
        None or 0 disables.  Exceeding it raises ``TimeoutError``.
    try_nopython : bool or None, optional
        Accepted for compatibility with Gluon 2.0, where it asks MXNet to compile
        the pipeline to C++; mploader has no such pipeline, so every value means
        "use the Python pipeline" (Gluon's behaviour when the compilation is not
        possible, except that ``True`` does not raise).
    shared_mem : int, optional
        Payload bytes per slot, at most ``mploader._options.MAX_SLOT_BYTES``; None
        sizes slots from the first batch with 25 % headroom.  Batches that do not fit
        make the slot grow.
    copy : bool
        Return owned arrays instead of views into shared memory.
    seed : int, optional
        Base seed.  Before each batch the worker seeds ``random``, NumPy's global RNG
        and torch's (if imported) from (seed, epoch, batch index), so an epoch's
        batches are the same for any ``num_workers``.  None: the rule of every face,
        :func:`mploader._options.default_seed` (read from NumPy's global random state
        without advancing it, so ``np.random.seed`` makes runs reproducible).
    start_method : {"fork", "spawn", "forkserver"}
        How worker processes start (mploader's keyword; Gluon forks).  With "spawn"
        or "forkserver" the dataset and ``batchify_fn`` are pickled to each worker and
        the ring reaches it as a passed file descriptor; use it when the training
        process runs torch/MKL work in other threads while workers start
        (docs/design.md, "Faults").
    stall_timeout : float, "auto" or None
        The watchdog (mploader's keyword; README, "Long runs"): a worker that has
        worked on one batch for longer than this many seconds has its Python stack
        logged on the ``"mploader"`` logger, is killed and replaced, and the batch is
        loaded again -- the loop sees the same batches, bit-identical.  "auto"
        (default): ``max(60, 10 x the p99 batch time)``, 600 s for the first 20
        batches.  None: off (a forked worker that does not start within 10 s of
        its fork is still killed and forked again: docs/design.md, "The watchdog").
    max_retries : int
        Times a stalled batch is loaded again (default 1); once more raises
        ``mploader.StallError`` carrying every stack taken.
    on_error : {"raise", "skip", "substitute"}
        What a sample whose ``dataset[i]`` raises becomes (mploader's keyword):
        "raise" (default, as Gluon) raises from the batch's ``next()``; "substitute"
        loads another sample in its place, chosen from (seed, epoch, index) -- batches
        stay full and every rank gets as many; "skip" leaves it out (the batch is one
        shorter: unsafe for distributed training).  Not with ``num_workers=0`` or
        ``thread_pool``.  Every bad sample is in ``stats()["bad_samples"]`` and
        checkpoints.
    max_bad_fraction : float or None
        The budget: more bad samples in an epoch than this fraction of its samples
        delivered so far (default 0.01, judged from ``1 / max_bad_fraction``
        samples on) raises ``mploader.BadSampleBudgetError``.  None: no limit.
    max_bad_samples : int or None
        The budget: more distinct bad samples over the run raises
        ``BadSampleBudgetError``.  None (default): no limit.
    bad_sample_log : str, path or None
        A JSON-lines file that gets one line per bad sample (index, epoch,
        batch_index, type, message, substitute).

    Raises
    ------
    TypeError
        An argument has the wrong type: ``dataset`` lacks ``__getitem__``/``__len__``,
        ``batchify_fn`` is not callable, an integer argument is not an integer.
    ValueError
        An argument is out of range or conflicts with another (the message names the
        argument, its value and the limit).
    """

    #: The ``fetch`` class (GluonNLP's ShardedDataLoader replaces it).
    _fetch_class: type = BatchifyFetch
    #: The face's name in checkpoint states.
    _face = "gluon"

    def __init__(self, dataset: Any, batch_size: int | None = None, shuffle: bool = False, sampler: Any = None,
                 last_batch: str | None = None, batch_sampler: Any = None, batchify_fn: Callable | None = None,
                 num_workers: int = 0, pin_memory: bool = False, pin_device_id: int = 0,
                 prefetch: int | None = None, thread_pool: bool = False, timeout: float | None = 120,
                 try_nopython: bool | None = None, *, shared_mem: int | None = None, copy: bool = False,
                 seed: int | None = None, start_method: str = "fork", stall_timeout: float | str | None = "auto",
                 max_retries: int = 1, on_error: str = "raise", max_bad_fraction: float | None = 0.01,
                 max_bad_samples: int | None = None, bad_sample_log: Any = None) -> None:
        check_dataset(dataset, needs_len=batch_sampler is None)
        start_method = check_choice("start_method", start_method, START_METHODS)
        check_callable("batchify_fn", batchify_fn, none_ok=True)
        # A pass of 'rollover' leaves its last indices to the next one only if it was
        # pulled to its end: Gluon's depth, so that after a break the carry is Gluon's.
        carries = (last_batch if batch_sampler is None else getattr(batch_sampler, "last_batch", None)) == "rollover"
        self._options = options = LoaderOptions(
            num_workers=num_workers, prefetch=prefetch, shared_mem=shared_mem, timeout_s=timeout, seed=seed,
            copy=copy, thread_pool=thread_pool, deep_queue=not carries, stall_timeout=stall_timeout,
            max_retries=max_retries, on_error=on_error, max_bad_fraction=max_bad_fraction,
            max_bad_samples=max_bad_samples, bad_sample_log=bad_sample_log, arg_names={"timeout_s": "timeout"})
        self._shuffler: RandomSampler | None = None
        if batch_sampler is None:
            if batch_size is None:
                raise ValueError("batch_size must be specified unless batch_sampler is specified")
            batch_size = check_int("batch_size", batch_size, minimum=1)
            if last_batch is not None:
                check_choice("last_batch", last_batch, _LAST_BATCH)
            if sampler is None:
                if shuffle:
                    sampler = self._shuffler = RandomSampler(len(dataset), seed=options.base_seed)
                else:
                    sampler = SequentialSampler(len(dataset))
            elif shuffle:
                raise ValueError(f"shuffle must not be specified if sampler is specified, got shuffle={shuffle!r}")
            batch_sampler = BatchSampler(sampler, batch_size, last_batch if last_batch else "keep")
        elif batch_size is not None or shuffle or sampler is not None or last_batch is not None:
            raise ValueError("batch_size, shuffle, sampler and last_batch must not be specified if batch_sampler "
                             f"is specified, got batch_size={batch_size!r}, shuffle={shuffle!r}, "
                             f"sampler={sampler!r}, last_batch={last_batch!r}")
        self._dataset = dataset
        self._batch_sampler = batch_sampler
        self._pin_device_id = check_int("pin_device_id", pin_device_id, minimum=0)
        self._pin_memory = bool(pin_memory)
        self._try_nopython = try_nopython
        self._fetch = self._fetch_class(batchify_fn)
        self._epoch = 0
        self._ckpt = _state.MapState(self._face, dataset, batch_sampler)
        self._engine: _engine.Engine | None = None
        self._meter = _metrics.Meter()   # in-process loading only (the engine has its own)
        self._meter_counts = {"batches": 0}
        self._pinner: _pinning.HostPinner | None = None
        self._start_method = start_method
        if options.num_workers > 0 and not options.thread_pool:
            self._engine, self._pinner = self._new_engine()

    def _new_engine(self) -> tuple[_engine.Engine, _pinning.HostPinner | None]:
        """An engine for the current options, and its pinner (None: not pinned)."""
        options = self._options
        runtime = _pinning.cuda_runtime(self._pin_device_id) if self._pin_memory and not options.copy else None
        pinner = _pinning.HostPinner(*runtime) if runtime is not None else None
        engine = _engine.Engine(self._dataset, self._fetch, on_grow=pinner.on_grow if pinner is not None else None,
                                start_method=self._start_method,
                                poll_held=pinner.poll if pinner is not None else None, **options.engine_kwargs())
        if pinner is not None:
            weakref.finalize(engine, pinner.release)
        return engine, pinner

    def __len__(self) -> int:
        """Number of batches per epoch (``len(batch_sampler)``)."""
        return len(self._batch_sampler)

    def __iter__(self) -> _LoaderIter:
        epoch = self._epoch
        self._epoch += 1
        if self._shuffler is not None:
            self._shuffler.set_epoch(epoch)
        progress, tasks = self._ckpt.start_epoch(epoch)
        options = self._options
        gen: Iterator[Any]
        own = None
        if self._engine is not None:
            engine = self._engine
            if engine.busy():
                # Another iterator of this loader is still under way (a peek inside the
                # training loop): this one runs on workers of its own, stopped when it
                # ends, and the other goes on undisturbed (docs/faces.md, "Gluon").
                engine = own = self._new_engine()[0]
            # upstream_pulls: after each next(), the batch sampler is pulled as far as
            # Gluon's _MultiWorkerIter pulls it (the first pulls wait for the first next())
            gen = engine.run(tasks, lookahead=None if own is not None else
                             functools.partial(_next_tasks, weakref.ref(self)), upstream_pulls=True)
        elif options.thread_pool and options.num_workers > 0:
            gen = _metrics.MeteredRun(_engine.ThreadRun(self._dataset, self._fetch, tasks, options.num_workers,
                                                        options.in_flight, options.timeout_s),
                                      self._meter, self._meter_counts)
        else:
            gen = _metrics.MeteredRun(_engine.InlineRun(self._dataset, self._fetch, tasks, options.base_seed),
                                      self._meter, self._meter_counts)
        return _LoaderIter(gen, len(self), self._engine, progress, own)

    # ---- checkpoints (issue 11; format in docs/design.md, "Checkpoint state") ----

    def state_dict(self) -> dict:
        """Where iteration stands, as a versioned, JSON-safe dict (``"version": 1``).

        Callable at any time: before the first ``iter()``, mid-epoch, between
        epochs.  The dict is a snapshot (later iteration does not change it) and is
        JSON-serialisable whenever the batch sampler's and dataset's own
        ``state_dict()`` are.  It holds the epoch, the number of batches the user
        has received in it (batches in flight are not counted: they are built again
        after a resume), the base seed, and the states of the batch sampler and of
        the dataset, when they have ``state_dict``: a batch sampler's state taken when
        the epoch started when it describes the whole pass, or right after the last
        batch received was pulled when it counts what the pass yielded (e.g. a
        ``BatchSampler`` over torchdata's ``StatefulDistributedSampler``;
        docs/design.md, "Checkpoint state").
        The worker count is not part of it: the state loads into a loader with any
        ``num_workers`` (0 included) and the batches that follow are bit-identical,
        random augmentations included (each batch's worker seeds its RNGs from
        ``(seed, epoch, batch_index)``).  mploader extension: Gluon has no checkpoints.

        Raises
        ------
        ValueError
            A sampler whose order cannot be rebuilt, such as ``RandomSampler(seed=None)``
            (its ``state_dict`` raises).
        """
        extra: dict[str, Any] = {"num_workers": self._options.num_workers}
        if self._engine is not None and self._options.on_error != "raise":
            extra["bad_samples"] = self._engine.bad_sample_state()   # the report and the budget's counts
        return self._ckpt.state(self._epoch, self._options.base_seed, extra)

    def load_state_dict(self, state: dict) -> None:
        """Resume from a :meth:`state_dict`: the next ``iter()`` continues the saved epoch
        with the batch after the last one the saved loader returned, and later epochs
        follow as they would have.  The loader adopts the saved seed (with workers
        already running and another seed, they are restarted).  Any ``num_workers``.

        Raises
        ------
        TypeError
            ``state`` is not a dict.
        mploader._state.StateMismatchError
            (a ValueError) The state is of another version or kind, or from a loader
            over a dataset of another length, with another batch sampler type, batch
            size, ``last_batch`` or sampler type: the message prints both values.
        """
        bad = _bad_samples.parse_state(state.get("bad_samples")) if isinstance(state, dict) else None
        loaded = self._ckpt.load(state)
        self._epoch = loaded["epoch"]
        self._adopt_seed(loaded["seed"])
        if bad is not None and self._engine is not None:
            self._engine.load_bad_samples(bad)
        if self._engine is not None and loaded["dataset_state"] is not None and self._engine.worker_pids():
            self._engine.stop_workers()   # they hold the dataset as it was when they forked

    def _adopt_seed(self, seed: int) -> None:
        if seed == self._options.base_seed:
            return
        self._options = dataclasses.replace(self._options, seed=seed)
        if self._shuffler is not None:
            self._shuffler.load_state_dict({**self._shuffler.state_dict(), "seed": seed})
        if self._engine is not None:
            self._engine.set_seed(seed)

    def stats(self) -> dict:
        """Transport counters (ints): ``batches`` delivered; ``slot`` zero-copy through a
        slot; ``fallback_inband`` through a slot with some leaves pickled in the
        descriptor (object arrays, arbitrary objects); ``fallback_pipe`` pickled through a
        worker's pipe; ``no_free_slot`` dispatched while every slot was held; ``grown``
        batches for which a slot grew (with ``shared_mem=None`` slots start empty, so each
        slot's first batch counts); ``errors`` re-raised worker exceptions;
        ``num_slots``; ``shm_bytes`` (bytes of shared memory the ring spans).

        Input-pipeline metrics of the current epoch (docs/metrics.md; without worker
        processes only the times and rates, as loading happens inside ``next()``):
        ``wait_s`` (float, seconds the caller was blocked in ``next()``), ``wall_s``
        (seconds since the epoch's first batch was requested, until its
        StopIteration), ``first_batch_s``, ``epoch_batches``, ``epoch_no_free_slot``,
        ``epoch_fallback_pipe``; ``batches_per_s`` and ``bytes_per_s`` over the last
        ~10 s; ``worker_busy`` (list of float in [0, 1] per worker id, the fraction of
        the epoch it spent on tasks; None where not measured); ``ready_batches``
        (published, waiting to be returned) and ``held_slots`` (slots held by batches
        the caller still refers to); ``seeding`` (``"fast"`` or ``"fallback"``: how the
        workers seed and capture the global RNGs, docs/design.md "Per-batch seeding").
        Long runs (README): ``stalls`` and ``respawns`` (int: batches the watchdog
        found stuck, workers it replaced); ``bad_samples`` (list of dict, one per bad
        sample: ``index``, ``epoch``, ``batch_index``, ``type``, ``message``,
        ``substitute`` -- the index used in its place, None under "skip") and
        ``bad_sample_count``.
        :func:`mploader.diagnose` turns them into a verdict."""
        if self._engine is None:
            out = _metrics.idle_transport_stats()
            out.update(_metrics.inline_stats(self._meter, self._meter_counts))
            return out
        return self._engine.stats()

    def log_stats_every(self, seconds: float | None, logger: Any = None) -> None:
        """Log :meth:`stats` and :func:`mploader.diagnose`'s verdict at INFO level on
        ``logger`` (default ``logging.getLogger("mploader")``), from the first ``next()``
        after every ``seconds`` seconds; None or 0 stops.  No thread is started: a loop
        that does not call ``next()`` is not reported on.

        Raises
        ------
        ValueError
            ``seconds`` is negative or NaN, or the loader has no worker processes
            (``num_workers=0`` or ``thread_pool=True``: nothing is measured).
        TypeError
            ``seconds`` is not a number, or ``logger`` not a ``logging.Logger``.
        """
        if self._engine is None:
            raise ValueError("log_stats_every needs worker processes (num_workers > 0 and thread_pool=False); "
                             f"this loader has num_workers={self._options.num_workers}, "
                             f"thread_pool={self._options.thread_pool}")
        _diagnose.log_stats_every(self._engine, seconds, logger)

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (empty before the first iteration)."""
        return self._engine.worker_pids() if self._engine is not None else []

    def close(self) -> None:
        """Stop the workers and release shared memory not held by live batches.  Idempotent."""
        if self._pinner is not None:
            self._pinner.release()
        if self._engine is not None:
            self._engine.close()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _next_tasks(ref: weakref.ref) -> Iterator[tuple] | None:
    """The tasks the loader's next ``iter()`` will make, where its order is fixed now
    (:func:`mploader.sampler.next_pass`; no loaded state pending): the engine
    dispatches the first ones while this epoch ends, and uses them only if the next
    epoch asks for the same (docs/design.md, "No gap between epochs").  Called by the
    engine once an epoch's tasks are all dispatched; draws nothing from any RNG."""
    loader = ref()
    if loader is None or loader._ckpt.pending is not None:
        return None
    batches = next_pass(loader._batch_sampler)
    if batches is None:
        return None
    epoch = loader._epoch
    return ((epoch, i, indices) for i, indices in enumerate(batches))


class _LoaderIter:
    """One epoch of a :class:`DataLoader`; keeps the engine alive on its own."""

    def __init__(self, gen: Iterator[Any], length: int, engine: Any,
                 progress: _state.MapProgress | None = None, own_engine: Any = None) -> None:
        self._gen = gen
        self._progress = progress
        self._len = length
        self._engine = engine
        self._own_engine = own_engine   # workers started for this iterator alone (closed at its end)
        self._lock = threading.Lock()   # one next() at a time (threads sharing the iterator)
        # an in-process run's box (MeteredRun.held): serial_next empties it once the batch is delivered
        self._held = getattr(gen, "held", None)

    def __iter__(self) -> _LoaderIter:
        return self

    # The next batch with the lock held (threads sharing the iterator: each batch
    # once, in order), counted in the progress: in C, so that from the run to the
    # caller the batch passes through no Python frame, where an interrupt would drop it.
    __next__ = _steps.serial_next

    def _ended(self, exc: BaseException) -> None:
        """``serial_next``'s hook: the run raised ``exc`` (before it propagates), not a
        batch's own exception (``serial_next`` counts that one in the progress, in C:
        an interrupt here would have lost it and its count).  Idempotent: after an
        interrupt here the next ``next()`` raises StopIteration again and comes back."""
        if isinstance(exc, StopIteration):
            progress = self._progress
            if progress is not None:
                progress.finished = True
            if self._own_engine is not None:
                self._own_engine.close()

    next = __next__

    def __len__(self) -> int:
        return self._len
