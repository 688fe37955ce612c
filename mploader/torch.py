"""``mploader.torch.DataLoader``: torch's DataLoader with workers that collate into the ring.

Change one import::

    # from torch.utils.data import DataLoader
    from mploader.torch import DataLoader

The class *is* a ``torch.utils.data.DataLoader`` (a subclass): its constructor is
torch's, so every argument check, error message, warning, attribute rule and
``len()`` is the installed torch's own, and ``isinstance(loader,
torch.utils.data.DataLoader)`` holds for libraries that check it.  What differs is
how batches travel from workers (docs/faces.md, "PyTorch"): each worker collates
its batch straight into a slot of mploader's shared-memory ring and the training
loop receives tensors that are zero-copy views of that slot
(``torch.from_numpy`` over the slot), kept alive by the slot's lease.

This is the only module of mploader that imports torch at import time.  Besides
torch's public API it relies on these internals (check them when supporting a new
torch release): ``torch.utils.data.dataloader._BaseDataLoaderIter`` (and its
``_reset``/``_next_data``/``_next_index`` hooks and attributes),
``_SingleProcessDataLoaderIter``, ``DataLoader._get_iterator``/``_auto_collation``,
``torch.utils.data._utils.worker._worker_info``/``WorkerInfo``,
``torch.utils.data._utils.collate.default_collate_fn_map``,
``torch.utils.data._utils.pin_memory.pin_memory`` and
``torch._C._autograd._profiler_enabled`` (optional).
"""
from __future__ import annotations

import copy
import functools
import inspect
import multiprocessing
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data import IterableDataset, default_collate, default_convert, get_worker_info
from torch.utils.data.dataloader import _BaseDataLoaderIter

from . import _bad_samples, _diagnose, _engine, _metrics, _options, _pinning, _steps, _torch_state, _zygote
from ._errors import WorkerTraceback, add_note
from ._run import Body
from ._torch_collate import to_tensors, unpack
from ._torch_worker import CONVERT, CUSTOM, DEFAULT, EXHAUSTED, PACKED, CapturingFetch, Fetch, WorkerInit
from .sampler import next_pass

__all__ = ["DataLoader", "get_worker_info", "default_collate", "default_convert"]

_T_co = TypeVar("_T_co", covariant=True)
#: Whether torch's profiler (torch.profiler / torch.autograd.profiler, emit_nvtx, emit_itt) is
#: on; a torch without this internal gets "always", i.e. torch's own span on every batch.
_profiler_enabled: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)
#: torch >= 2.6 takes ``in_order``; with older torch the face keeps it itself.
_TORCH_HAS_IN_ORDER = "in_order" in inspect.signature(_TorchDataLoader.__init__).parameters


#: Tensors of fewer bytes than this come out as owned copies, not views of the slot:
#: an evaluation loop that keeps every batch's labels (``all_labels.append(y)``,
#: torchmetrics) would otherwise keep every batch's slot alive.  Not with
#: ``pin_memory`` on an accelerator, where every tensor must lie in the pinned region
#: (docs/faces.md).  The copies' cost: ``python bench/small_leaf_copy.py``.
SMALL_LEAF_BYTES = 4096


def _trainer_record(loader: Any, dataset: Any, **kwargs: Any) -> None:
    """Record this constructor's arguments the way Lightning records a DataLoader's.

    Lightning (``lightning.fabric.utilities.data._replace_dunder_methods``, 2.x)
    re-instantiates a loader made inside a ``*_dataloader`` hook (to inject a
    ``DistributedSampler``, for ``overfit_batches``) from the arguments its wrapped
    ``__init__`` saw.  It wraps the ``__init__`` of every DataLoader subclass that
    exists when the hook starts; when ``mploader.torch`` is first imported inside the
    hook, only torch's ``__init__`` is wrapped, which would record torch's arguments
    without ``seed``, ``copy``, ``shared_mem`` and ``snapshot_every_n_steps``.  So when
    torch's ``__init__`` is wrapped (it then carries ``__wrapped__``) and nothing was
    recorded yet, this records ours: the dataset positionally, everything else by
    keyword, as the wrapper records a keyword call.  A loader made outside the hooks
    is rebuilt from its public attributes (``vars(loader)``), which include ours.
    """
    init = torch.utils.data.DataLoader.__init__
    if getattr(init, "__wrapped__", None) is None or hasattr(loader, "__pl_saved_args"):
        return
    for name, value in (("__pl_saved_args", (dataset,)), ("__pl_saved_kwargs", kwargs),
                        ("__pl_saved_arg_names", ("dataset",)), ("__pl_saved_default_kwargs", {}),
                        ("__dataset", dataset)):
        object.__setattr__(loader, name, value)


class DataLoader(_TorchDataLoader[_T_co]):
    """``torch.utils.data.DataLoader`` whose workers collate into a shared-memory ring.

    Parameters
    ----------
    dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
    pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
    prefetch_factor, persistent_workers, pin_memory_device, in_order
        Exactly torch's (the installed torch's constructor validates them and raises
        its own errors).  Batches, their order, the samplers' use of ``generator``,
        worker seeding (a base seed drawn from ``generator`` -- or torch's global RNG
        -- at every ``iter()``; worker ``i`` seeds ``random`` and torch with
        ``base_seed + i`` and NumPy from both), ``get_worker_info()``,
        ``worker_init_fn``, round-robin task assignment, IterableDataset replicas,
        ``prefetch_factor`` batches in flight per worker, ``persistent_workers``,
        ``in_order`` and ``timeout`` behave as torch's.
    shared_mem : int, optional
        mploader: initial payload bytes per slot; None (default) sizes slots from
        the first batch with 25 % headroom, and a larger batch grows its slot.
    copy : bool
        mploader: return tensors that own their memory instead of views of the slot.
    seed : int, optional
        mploader's stronger seeding, opt-in: before each batch the worker seeds
        ``random``, NumPy's global RNG and torch from ``(seed, epoch, batch index)``,
        so an epoch's batches (random augmentations included) are the same for any
        ``num_workers``, 0 included (there the caller's RNG states are restored after
        each batch).  None (default): torch's per-worker seeding.
    stall_timeout : float, "auto" or None
        mploader's watchdog (README, "Long runs"): a worker that has worked on one
        batch longer than this many seconds has its Python stack logged on the
        ``"mploader"`` logger, is killed and replaced (same worker id), and the batch
        is loaded again.  The loop sees the same batches in the same order; with
        ``seed=`` bit-identical, under torch's per-worker seeding the replacement's
        RNGs start afresh from ``base_seed + id``, so that worker's random
        augmentations differ from then on (docs/faces.md).  "auto" (default):
        ``max(60, 10 x p99 batch time)``, 600 s for the first 20 batches; None: off
        (torch's behaviour: wait for ever, or ``timeout``), but for the start-up
        deadline of forked workers (10 s from the fork to the worker's first step:
        docs/design.md, "The watchdog"), which torch does not have.
    max_retries : int
        Times a stalled batch is loaded again (default 1); one more stall raises
        ``mploader.StallError`` carrying every stack taken.
    on_error : {"raise", "skip", "substitute"}
        "raise" (default, as torch); "substitute": a sample whose ``dataset[i]``
        raises is replaced by another, chosen from (seed, epoch, index) -- batches
        stay full and every DDP rank gets as many (``__getitems__`` is then not
        used: samples are read one at a time); "skip": left out (unsafe for DDP).
        Map-style datasets with workers only.
    max_bad_fraction, max_bad_samples, bad_sample_log
        The budget (default: 1 % of an epoch's samples; ``max_bad_samples`` distinct
        samples over the run) beyond which ``mploader.BadSampleBudgetError`` ends the
        run, and a JSON-lines file of the bad samples; ``stats()["bad_samples"]`` and
        checkpoints carry the report.

    Notes
    -----
    With ``num_workers=0`` (and no ``seed``) iteration is torch's own single-process
    iterator.  With workers, a batch that ``default_collate`` would build is computed
    in the worker straight into the slot; tensors come back as
    ``torch.from_numpy(slot view)`` -- a returned tensor never changes, whatever later
    batches, epochs or ``close()`` do, and its slot is reused once every tensor of the
    batch has been garbage-collected.  A custom ``collate_fn`` runs in the worker; the
    tensors and arrays it returns are copied into the slot once (only their own
    elements, never a whole storage) and come back as tensors and arrays
    respectively.  ``pin_memory=True`` without an accelerator warns at ``iter()``
    as torch does and returns unpinned tensors.

    Raises
    ------
    Whatever torch's constructor raises for its arguments; TypeError/ValueError
    naming ``shared_mem``, ``copy`` or ``seed`` for bad mploader arguments.  While
    iterating: the worker's exception re-raised as torch does (same type, message
    "Caught X in DataLoader worker process N. Original Traceback ..."), with the
    sample indices in its ``__cause__`` (``mploader._errors.WorkerTraceback``) and a
    note; ``RuntimeError("DataLoader timed out after N seconds")``;
    ``mploader.WorkerError`` (a RuntimeError) when a worker dies.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None, sampler: Any = None,
                 batch_sampler: Any = None, num_workers: int = 0, collate_fn: Callable | None = None,
                 pin_memory: bool = False, drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Callable[[int], None] | None = None, multiprocessing_context: Any = None,
                 generator: Any = None, *, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True, shared_mem: int | None = None,
                 copy: bool = False, seed: int | None = None, snapshot_every_n_steps: int | None = None,
                 stall_timeout: float | str | None = "auto", max_retries: int = 1, on_error: str = "raise",
                 max_bad_fraction: float | None = 0.01, max_bad_samples: int | None = None,
                 bad_sample_log: Any = None) -> None:
        extra = {"in_order": in_order} if _TORCH_HAS_IN_ORDER else {}
        # mploader's state of this loader, one object (auto_prefetch: prefetch_factor=None,
        # torch's 2 raised for small batches)
        self._mpl = _torch_state.LoaderState(auto_prefetch=prefetch_factor is None)
        _trainer_record(self, dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                        batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                        pin_memory=pin_memory, drop_last=drop_last, timeout=timeout, worker_init_fn=worker_init_fn,
                        multiprocessing_context=multiprocessing_context, generator=generator,
                        prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                        pin_memory_device=pin_memory_device, in_order=in_order, shared_mem=shared_mem, copy=copy,
                        seed=seed, snapshot_every_n_steps=snapshot_every_n_steps, stall_timeout=stall_timeout,
                        max_retries=max_retries, on_error=on_error, max_bad_fraction=max_bad_fraction,
                        max_bad_samples=max_bad_samples, bad_sample_log=bad_sample_log)
        # By keyword: a trainer that records the arguments torch's __init__ received
        # (Lightning, for a loader class defined inside its hooks) must not record the
        # sampler positionally and then pass a new one by keyword.
        super().__init__(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                         batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                         pin_memory=pin_memory, drop_last=drop_last, timeout=timeout, worker_init_fn=worker_init_fn,
                         multiprocessing_context=multiprocessing_context, generator=generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, **extra)
        if not _TORCH_HAS_IN_ORDER:  # torch < 2.6: the face provides it
            self.in_order = in_order
        self.shared_mem = _options.check_int(
            "shared_mem", shared_mem, minimum=0, maximum=_options.MAX_SLOT_BYTES, none_ok=True,
            why_max=" bytes (the largest slot the ring can make)")
        if not isinstance(copy, bool):
            raise TypeError(f"copy must be a bool, got {copy!r} ({type(copy).__name__})")
        self.seed = _options.check_int("seed", seed, minimum=0, none_ok=True)
        if num_workers > 0 and self.prefetch_factor * num_workers > _options.MAX_PREFETCH:
            raise ValueError(f"prefetch_factor * num_workers must be at most {_options.MAX_PREFETCH} (the ring "
                             f"holds at most {_options.MAX_SLOTS} slots), got {self.prefetch_factor} * "
                             f"{num_workers}")
        self.copy = copy
        # Long runs (README): the watchdog and the bad-sample policy, validated as every face's
        long_runs = _options.LoaderOptions(
            num_workers=num_workers, stall_timeout=stall_timeout, max_retries=max_retries, on_error=on_error,
            max_bad_fraction=max_bad_fraction, max_bad_samples=max_bad_samples, bad_sample_log=bad_sample_log)
        if on_error != "raise" and isinstance(dataset, IterableDataset):
            raise ValueError(f"on_error={on_error!r} needs a map-style dataset (an IterableDataset's samples have "
                             f"no index to substitute), got {type(dataset).__name__}")
        self.stall_timeout, self.max_retries = long_runs.stall_timeout, long_runs.max_retries
        self.on_error, self.max_bad_fraction = long_runs.on_error, long_runs.max_bad_fraction
        self.max_bad_samples, self.bad_sample_log = long_runs.max_bad_samples, long_runs.bad_sample_log
        # checkpoints (issue 11, mploader/_torch_state.py)
        self.snapshot_every_n_steps = _torch_state.check_snapshot_every(snapshot_every_n_steps)
        # Workers from the zygote (spawn, forkserver): it starts now, so that its imports
        # overlap the user's set-up before the first iter() (issue 27)
        _zygote.warm_for_loader(multiprocessing_context, num_workers, (dataset, collate_fn, worker_init_fn))

    # ---- iterators ----

    def _get_iterator(self) -> _BaseDataLoaderIter:
        _torch_state.iterator_starting(self)   # before the iterator draws its base seed
        if self.num_workers == 0:
            if self.seed is None:
                return _torch_state.SingleIter(self)
            return _SeededInlineIter(self)
        self.check_worker_number_rationality()
        keep = _torch_state.global_rng_to_keep(self)   # torch's draw of a base seed that a state replaces
        it = _RingIter(self)
        if keep is not None:
            torch.random.set_rng_state(keep)
        return it

    @property
    def _mpl_engine(self) -> _engine.Engine | None:
        """The loader's engine (None before the first multi-worker ``iter()`` and after
        ``close()``); read-only, for tests and benchmarks."""
        return self._mpl.engine

    def _mpl_get_engine(self) -> tuple[_engine.Engine, WorkerInit]:
        """The loader's engine (created at the first multi-worker ``iter()``, again
        when ``num_workers``, the start method or the collate function changed)."""
        ctx = self.multiprocessing_context  # torch's setter made a name a context object
        if ctx is None:  # torch then uses torch.multiprocessing, i.e. the default context
            ctx = multiprocessing.get_context()
        start_method = ctx if isinstance(ctx, str) else ctx.get_start_method()
        key = (self.num_workers, start_method, self.prefetch_factor, self.timeout, self.collate_fn,
               self.worker_init_fn, bool(self.pin_memory))
        mpl = self._mpl
        if mpl.engine is None or mpl.engine_key != key or mpl.engine.closed:
            self.close()
            mpl.engine, init, pinner = self._mpl_new_engine(start_method)
            mpl.host_pinner = pinner
            mpl.pinned = pinner is not None
            mpl.engine_key = key
            if mpl.report is not None:
                _diagnose.log_stats_every(mpl.engine, *mpl.report)
            mpl.init = init
        assert mpl.init is not None
        return mpl.engine, mpl.init

    def _mpl_new_engine(self, start_method: str | None = None) -> tuple[_engine.Engine, WorkerInit, Any]:
        """A new engine for this loader's current attributes, its ``WorkerInit`` and its
        pinner (None: batches are not pinned).  ``start_method`` None: the one of the
        loader's engine (an iterator's own engine: :meth:`_RingIter._reset`)."""
        if start_method is None:
            assert self._mpl.engine is not None
            start_method = self._mpl.engine.start_method
        if self.collate_fn is default_collate and self._auto_collation:
            mode = DEFAULT
        elif self.collate_fn is default_convert and not self._auto_collation:
            mode = CONVERT
        else:
            mode = CUSTOM
        fetch = (CapturingFetch if self.seed is None else Fetch)(
            mode, self.collate_fn, self._auto_collation, self.drop_last)
        init = WorkerInit(self.dataset, self.worker_init_fn, per_batch=self.seed is not None,
                          num_workers=self.num_workers)
        pinner = self._mpl_pinner()
        engine = _engine.Engine(
            self.dataset, fetch, num_workers=self.num_workers,
            prefetch=self.prefetch_factor * self.num_workers, shared_mem=self.shared_mem,
            timeout_s=self.timeout or None, seed=self.seed or 0, copy=self.copy,
            worker_init=init, reseed_per_batch=self.seed is not None, start_method=start_method,
            on_grow=pinner.on_grow if pinner is not None else None, auto_prefetch=_auto_depth(self),
            poll_held=pinner.poll if pinner is not None else None,
            copy_below_bytes=SMALL_LEAF_BYTES if pinner is None else 0, warn_when_full=False,
            stall_timeout=self.stall_timeout, max_retries=self.max_retries, on_error=self.on_error,
            max_bad_fraction=self.max_bad_fraction, max_bad_samples=self.max_bad_samples,
            bad_sample_log=self.bad_sample_log)
        if self._mpl.bad_loaded is not None:
            engine.load_bad_samples(self._mpl.bad_loaded)
            self._mpl.bad_loaded = None
        if pinner is not None:
            weakref.finalize(engine, pinner.release)
        return engine, init, pinner

    def _mpl_pinner(self) -> _pinning.HostPinner | None:
        """With ``pin_memory`` and a usable CUDA device (and not ``copy``): a pinner that
        page-locks the region as it grows, so tensors come out of the ring pinned."""
        if not self.pin_memory or self.copy or not torch.cuda.is_available():
            return None
        runtime = _pinning.cuda_runtime(torch.cuda.current_device())
        return _pinning.HostPinner(*runtime) if runtime is not None else None

    # ---- mploader extras ----

    def close(self) -> None:
        """Stop the workers and release the shared memory (tensors already returned
        stay valid); with ``pin_memory`` on CUDA, unregister the pinned region.
        Idempotent; the loader starts new workers if iterated again."""
        mpl = self._mpl
        engine, mpl.engine = mpl.engine, None
        pinner, mpl.host_pinner = mpl.host_pinner, None
        if engine is not None:
            engine.close()
        if pinner is not None:
            pinner.release()

    def __enter__(self) -> DataLoader[_T_co]:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict:
        """Pickling (deepcopy, spawned trainers) drops the workers; the copy starts its own."""
        state = self.__dict__.copy()
        state.update(_iterator=None, _mpl=self._mpl.detached())
        return state

    # ---- checkpoints (issue 11; mploader/_torch_state.py, docs/design.md "Checkpoint state") ----

    def state_dict(self) -> dict:
        """Where iteration stands, as torchdata 0.11 ``StatefulDataLoader.state_dict()``:
        callable at any time (before ``iter()``, mid-epoch, between epochs), a snapshot
        later iteration does not change, a versioned dict (``"version": 1``) that is
        JSON-serialisable whenever the samplers' and dataset's own states are.

        Map-style datasets: the epoch, the batches received in it (batches in flight
        are not counted; with ``in_order=False`` the indices received out of order),
        the duck-typed states of the batch sampler, its iterator and the dataset, the
        state of the generator torch's ``RandomSampler`` draws from, and ``seed``.
        It loads into a loader with any ``num_workers`` (torchdata refuses another
        count): with ``seed=`` the batches that follow are bit-identical, random
        augmentations included.  Without it (torch's per-worker seeding) the state
        also holds the base seed, each worker's RNG states (``random``, NumPy,
        torch) after its last batch received and the batches in flight with their
        workers (``"worker_rng"``), so a loader with the *same* ``num_workers``
        resumes the augmentations exactly too; with another count the indices and
        order are exact and the workers start from the saved base seed ``+ id``
        (as torchdata's), so the augmentations are not.  ``RandomSampler(generator=None)``
        draws from torch's global RNG: a state taken between epochs is exact when
        nothing else draws from it between ``load_state_dict()`` and ``iter()``
        (pass ``generator=`` to be independent of it).  IterableDatasets: the epoch,
        the batches received from each worker and ``num_workers``; resuming rebuilds
        the replicas and drops the batches each one delivered before (as torchdata
        does for datasets without ``state_dict``), with ``in_order=False`` too.

        Raises
        ------
        ValueError
            A sampler whose ``state_dict`` raises.
        """
        state = _torch_state.state_dict(self)
        if self.on_error != "raise":   # the bad samples' report and budget counts (README, "Long runs")
            engine = self._mpl.engine
            state = dict(state)
            if engine is not None:
                state["bad_samples"] = engine.bad_sample_state()
            else:   # (none yet: what a checkpoint loaded, or nothing)
                ledger = _bad_samples.Ledger(None, None, None)
                if self._mpl.bad_loaded is not None:
                    ledger.load(self._mpl.bad_loaded)
                state["bad_samples"] = ledger.state()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from a :meth:`state_dict`: the next ``iter()`` continues the saved epoch
        after the batches the saved loader had returned.  The loader adopts the saved
        ``seed`` (a new engine is made when it differs).

        Raises
        ------
        TypeError
            ``state`` is not a dict.
        mploader._state.StateMismatchError
            (a ValueError) Another version or kind; another dataset length, batch
            sampler type or sampler state; for an IterableDataset another dataset type
            or ``num_workers`` -- the message prints both values.
        """
        bad = _bad_samples.parse_state(state.get("bad_samples")) if isinstance(state, dict) else None
        _torch_state.load_state_dict(self, state)
        if bad is not None and self.on_error != "raise":
            self._mpl.bad_loaded = bad
            if self._mpl.engine is not None:
                self._mpl.engine.load_bad_samples(bad)
                self._mpl.bad_loaded = None

    def stats(self) -> dict:
        """The engine's counters and input-pipeline metrics, as
        ``mploader.DataLoader.stats`` (docs/metrics.md): ``wait_s`` is the time spent
        in the engine's ``next()`` (turning arrays into tensors is not counted).
        Zeros before the first multi-worker iteration, after ``close()`` and with
        ``num_workers=0``."""
        engine = self._mpl.engine
        if engine is None:
            out = _metrics.idle_transport_stats()
            out.update(_metrics.empty_stats())
            return out
        return engine.stats()

    def log_stats_every(self, seconds: float | None, logger: Any = None) -> None:
        """As ``mploader.DataLoader.log_stats_every``: log ``stats()`` and the verdict of
        ``mploader.diagnose`` at INFO level on ``logger`` (default: the ``"mploader"``
        logger) at the first ``next()`` after every ``seconds``; None or 0 stops.

        Raises
        ------
        ValueError
            ``seconds`` is negative or NaN, or ``num_workers=0``.
        TypeError
            ``seconds`` is not a number, or ``logger`` not a ``logging.Logger``.
        """
        if self.num_workers == 0:
            raise ValueError("log_stats_every needs worker processes, got num_workers=0")
        _diagnose.check_report(seconds, logger)
        self._mpl.report = (seconds, logger)
        if self._mpl.engine is not None:
            _diagnose.log_stats_every(self._mpl.engine, seconds, logger)


class _RingIter(_BaseDataLoaderIter):
    """One pass (or, with ``persistent_workers``, every pass) over a DataLoader on
    mploader's engine.  Task assignment is torch's ``_try_put_index``: round-robin
    over the workers still active (with ``in_order=False``, only to workers holding
    fewer than ``prefetch_factor * num_workers // active`` tasks); with ``seed=``, a
    map-style dataset and ``in_order=True``, the least-loaded worker (the engine's
    pick: a batch does not depend on its worker there)."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        if self._num_workers <= 0:
            raise AssertionError("num_workers must be greater than 0 for MultiProcessingDataLoaderIter")
        if self._prefetch_factor <= 0:
            raise AssertionError("prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter")
        self._is_iterable = isinstance(self._dataset, IterableDataset)
        self._engine: _engine.Engine | None = None
        self._own_engine = False   # the engine is this iterator's alone (see _reset)
        self._run: Any = None
        self._mpl_streams: _torch_state.WorkerStreams | None = None
        self._mpl_ended = False    # StopIteration was raised (again on every later next())
        # One next() at a time (threads sharing the iterator), by _steps.serial_next:
        # the lock is released in C, so no signal handler runs between the batch's
        # leaving the run and the caller's having it (as the Gluon face's).
        self._lock = threading.Lock()
        # The record taken from the run (_steps.take) until the batch made from it is
        # the caller's (serial_next empties it): an interrupt in between leaves it here.
        self._held: list = []
        self._gen = Body(self)
        self._progress = None
        self._reset(loader, first_iter=True)

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        if not first_iter:
            self._drain_abandoned(loader)
        super()._reset(loader, first_iter)
        del self._held[:]   # a record of the abandoned pass
        engine = self._engine
        pinned = loader._mpl.pinned
        resume = _torch_state.worker_resume(loader)   # a checkpoint's workers (torch's seeding)
        if first_iter or not self._persistent_workers or engine is None or engine.closed or resume is not None:
            # New workers for this iterator, seeded from this iterator's base seed
            # (torch draws one per iterator; persistent workers keep theirs and,
            # as torch's, ignore later changes to the loader's attributes) -- or
            # from the checkpoint's base seed and RNG states.
            engine, init = loader._mpl_get_engine()
            self._own_engine = not self._persistent_workers and engine.busy()
            if self._own_engine:
                # Another iterator of this loader is still under way (a peek inside
                # the training loop): as each of torch's non-persistent iterators,
                # this one gets workers of its own, closed when it ends, and the
                # other goes on undisturbed.
                engine, init, pinner = loader._mpl_new_engine()
                pinned = pinner is not None
            else:
                engine.stop_workers()
                pinned = loader._mpl.pinned
            if resume is not None:
                self._base_seed = resume["base_seed"]
            init.base_seed = self._base_seed
            init.rng_states = resume["states"] if resume is not None else None
            self._mpl_streams = (None if loader.seed is not None else
                                 _torch_state.WorkerStreams(self._base_seed, self._num_workers, init.rng_states))
        elif self._mpl_streams is not None:
            self._mpl_streams.new_epoch()
        self._engine = engine
        self._mpl_ended = False
        self._pinned_region = pinned
        # With seed= a batch is a function of its task alone, so which worker builds it
        # changes nothing in it: map-style tasks in order go to the least-loaded worker,
        # as in the Gluon face (docs/faces.md, "Tasks"); otherwise torch's round robin.
        free = loader.seed is not None and self._in_order and not self._is_iterable
        self._dispatch = _Dispatch(self._num_workers, self._prefetch_factor, self._in_order, round_robin=not free)
        if resume is not None:
            self._dispatch.resume(resume["assigned"], resume["next_worker"])
        self._epoch = loader._mpl.next_epoch()
        # torch's iterator iterates the batch sampler in __init__ and again in _reset;
        # a persistent one's later epochs only in _reset.
        per_epoch = 1 if self._persistent_workers else 2
        self._mpl_pos = _torch_state.begin(loader, self._epoch, self._sampler_iter, per_epoch)
        _torch_state.track_workers(loader, self._mpl_streams, self._dispatch)
        # No gap between epochs (docs/design.md): persistent workers with per-batch seeding
        # (a batch is a function of its task alone) over an order fixed in advance.
        ahead = (functools.partial(_next_tasks, weakref.ref(loader))
                 if self._persistent_workers and loader.seed is not None and self._in_order
                 and not self._is_iterable and not self._own_engine else None)
        # upstream_pulls: after each next(), the sampler is pulled as far as torch's
        # iterator pulls it, before next() returns (the first pulls wait for the first
        # next(): docs/faces.md); in completion order and for IterableDatasets the
        # round robin needs the result settled first (_Dispatch), so the fill pulls.
        self._run = engine.run(self._dispatch.tasks(self._epoch, self._mpl_pos.pairs, self._is_iterable),
                               in_order=self._in_order, tagged=True, lookahead=ahead,
                               upstream_pulls=self._in_order and not self._is_iterable)

    def _drain_abandoned(self, loader: DataLoader) -> None:
        """A new epoch of persistent workers with torch's seeding while the previous
        one was left early (``break``): as torch's ``_reset``, let the workers build
        the batches torch would have sent -- ``prefetch_factor * num_workers`` beyond
        the results taken -- and drop them, keeping the RNG states they carry, so
        that every worker's random stream goes on as torch's (superseding the run
        would cancel them).  Nothing to do for a finished epoch or a new engine."""
        run, engine, streams = self._run, self._engine, self._mpl_streams
        if (run is None or self._mpl_ended or streams is None or not self._persistent_workers
                or engine is None or engine.closed or _torch_state.worker_resume(loader) is not None):
            return
        self._dispatch.limit = self._prefetch_factor * self._num_workers + self._dispatch.received()
        held = self._held
        while True:
            try:
                _steps.take(run, held)
            except StopIteration:
                break
            except RuntimeError:
                if run.source_error is not None:   # the sampler raised (an interrupt): the pass ends
                    break
                raise
            wid, _, value, failed, side = held[0]   # a batch, or one that raised: dropped as the others
            rng = getattr(value, "mploader_rng", None) if failed else side
            if rng is not None:
                streams.received(wid, rng)
            del held[:]
        self._mpl_ended = True

    #: ``_mpl_next`` with ``_lock`` held (threads sharing the iterator: each batch
    #: once, in order), through ``_gen``; the lock is released in C.
    __next__ = _steps.serial_next

    def _ended(self, exc: BaseException) -> None:
        """(``_steps.serial_next``'s hook for the run's exceptions: nothing to do here.)"""

    def _mpl_next(self) -> Any:
        # torch's __next__ opens a record_function span around every batch, which costs
        # ~5 µs even when no profiler listens (a third of a tiny batch's parent CPU);
        # here the span is opened only while a profiler is enabled (docs/faces.md).
        # IterableDatasets and the first call after exhaustion keep torch's own path
        # (its length-mismatch warning, its _reset call).
        if self._is_iterable or self._sampler_iter is None or _profiler_enabled():
            return super().__next__()
        data = self._next_data()
        self._num_yielded += 1
        return data

    def _next_data(self) -> Any:
        # Each record of the (tagged) run -- (worker id, batch index, value, failed,
        # side: the worker's RNG states after the batch or None), as the scheduler
        # knows them -- is taken into self._held (_steps.take) and
        # stays there until serial_next has handed its batch to the caller.  What is
        # done for it here is idempotent per record (sets keyed by batch index, single
        # stores), so an interrupt at any point is followed by the same record again,
        # and the batch is neither lost nor counted twice (docs/design.md, "Faults").
        pos, held, dispatch, streams = self._mpl_pos, self._held, self._dispatch, self._mpl_streams
        while True:
            if self._mpl_ended:
                raise StopIteration   # exhausted: again, as torch's (its workers may serve a newer iterator)
            try:
                _steps.take(self._run, held)
            except StopIteration:
                self._mpl_ended = True
                pos.finish()
                if self._own_engine and self._engine is not None:
                    self._engine.close()
                elif not self._persistent_workers and self._engine is not None:
                    self._engine.stop_workers(self._run)   # (not a newer iterator's workers)
                raise
            except TimeoutError as exc:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds") from exc
            wid, batch_index, value, failed, side = held[0]
            dispatch.received_from(wid, batch_index)
            if failed:   # the batch's exception used it up
                if streams is not None:
                    streams.received(wid, getattr(value, "mploader_rng", None))
                if not pos.from_worker(wid, batch_index):
                    del held[:]
                    continue   # (dropped: an IterableDataset's resume replayed it)
                cause = value.__cause__
                if isinstance(cause, WorkerTraceback):   # raised by the dataset or collate_fn
                    error = _as_torch_error(value, cause)
                    del held[:]
                    raise error from cause
                del held[:]
                raise value   # the batch cannot be read (a corrupt descriptor)
            payload, kind = value
            if side is not None and streams is not None:
                streams.after[wid] = side   # the worker's RNGs after this batch (checkpoints)
            if kind == EXHAUSTED:
                dispatch.active[wid] = False
                pos.exhausted(batch_index)
                del held[:]
                continue
            if not pos.from_worker(wid, batch_index):
                del held[:]
                continue   # IterableDataset resume: received before the checkpoint
            data = unpack(payload) if kind == PACKED else to_tensors(payload)
            if self._pin_memory and not self._pinned_region:
                # No pinned region (copy=True, or an accelerator other than CUDA): pin as torch does.
                data = torch.utils.data._utils.pin_memory.pin_memory(data, self._pin_memory_device)
            return data


def _next_tasks(ref: weakref.ref) -> Iterator[tuple] | None:
    """The tasks a persistent iterator's next pass will give the engine (none names a
    worker: staging needs ``seed=``, under which the engine picks them), where the
    batch sampler's order is fixed now and can be drawn without changing anything:
    torch's ``BatchSampler`` over a ``SequentialSampler``, or over a ``RandomSampler``
    with its own ``generator`` (drawn from a copy of the generator: the real one draws
    when torch's iterator does, in torch's order), and mploader's samplers
    (:func:`mploader.sampler.next_pass`).
    None otherwise, and while a loaded state is pending.  The engine dispatches the
    first ones as the epoch ends and uses them only if the next pass asks for the same
    (docs/design.md, "No gap between epochs")."""
    loader = ref()
    if loader is None or _torch_state.worker_resume(loader) is not None:
        return None
    ckpt = loader._mpl.ckpt
    if ckpt is None or getattr(ckpt, "pending", None) is not None:
        return None
    batches = _next_batches(loader._index_sampler)
    if batches is None:
        return None
    epoch = loader._mpl.epoch
    # (staged only with seed=, in order, map-style: no task names a worker; _RingIter._reset)
    return ((epoch, i, indices, None) for i, indices in enumerate(batches))


def _next_batches(index_sampler: Any) -> Iterator[Any] | None:
    """(:func:`_next_tasks`) The index lists of ``index_sampler``'s next pass, drawn
    from copies, or None."""
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    if type(index_sampler) is not BatchSampler:
        return next_pass(index_sampler)
    sampler = index_sampler.sampler
    if type(sampler) is RandomSampler and isinstance(sampler.generator, torch.Generator):
        generator = torch.Generator(device=sampler.generator.device)
        generator.set_state(sampler.generator.get_state())
        sampler = copy.copy(sampler)
        sampler.generator = generator
    elif type(sampler) is not SequentialSampler:
        return None
    return iter(BatchSampler(sampler, index_sampler.batch_size, index_sampler.drop_last))


def _auto_depth(loader: DataLoader) -> int | None:
    """With torch's default ``prefetch_factor`` (None: 2), a map-style loader in order
    keeps up to AUTO_PREFETCH_PER_WORKER batches per worker in flight while batches
    are small (docs/design.md, "Batches in flight"); None otherwise (an explicit
    ``prefetch_factor``, ``in_order=False``, an IterableDataset, persistent workers
    with torch's seeding, a sampler that keeps a ``torch.Generator``: torch's count).
    Persistent workers build every batch in flight when an epoch is left early
    (:meth:`_RingIter._drain_abandoned`), so their random streams follow torch's only
    with torch's count in flight; and a sampler's own generator goes on across epochs
    (torch's ``RandomSampler`` draws its next pass's ``randperm`` when its pass is
    pulled to the end), so after a ``break`` its state is torch's only if the sampler
    was pulled as far as torch's iterator pulls it."""
    if not loader._mpl.auto_prefetch or not loader.in_order or isinstance(loader.dataset, IterableDataset) \
            or loader.num_workers <= 0 or (loader.persistent_workers and loader.seed is None) \
            or _keeps_generator(loader._index_sampler):
        return None
    return max(loader.prefetch_factor * loader.num_workers,
               min(_options.AUTO_PREFETCH_PER_WORKER * loader.num_workers, _options.MAX_PREFETCH))


def _keeps_generator(index_sampler: Any) -> bool:
    """(:func:`_auto_depth`) Whether the batch sampler, or the sampler it wraps, holds
    a ``torch.Generator`` (``generator=`` of torch's ``RandomSampler``,
    ``SubsetRandomSampler``, ``WeightedRandomSampler``, ``DataLoader(shuffle=True)``)."""
    return any(isinstance(getattr(s, "generator", None), torch.Generator)
               for s in (index_sampler, getattr(index_sampler, "sampler", None)))


class _Dispatch:
    """Torch's ``_try_put_index`` as a task stream the engine pulls from: round-robin
    over the workers still active (an IterableDataset replica that is exhausted makes
    its worker inactive); with ``in_order=False`` only to a worker holding fewer than
    ``prefetch_factor * num_workers // active`` tasks.  ``in_flight[w]``: the batch
    indices given to worker ``w`` whose results (a batch, an exception, a replica's
    end) the iterator has not received yet -- the engine tags each result with its
    worker and batch index, so a result settles exactly its own entry, and settling
    it again (the same record after an interrupt) changes nothing.  Holds no
    reference to the iterator (no iterator <-> run cycle).  With
    ``round_robin=False`` (``seed=``, map-style, in order) no task names a worker:
    the engine gives each to the least-loaded one (``Dispatch._pick_worker``); the
    round robin's bookkeeping (``in_flight``, :meth:`received`, :meth:`assigned`,
    ``limit``: torch's seeding's checkpoints and drained window) is not kept then."""

    def __init__(self, num_workers: int, prefetch_factor: int, in_order: bool, round_robin: bool = True) -> None:
        self.num_workers = num_workers
        self.max_tasks = prefetch_factor * num_workers
        self.in_order = in_order
        self.round_robin = round_robin
        self.active = [True] * num_workers
        self.in_flight: list[set[int]] = [set() for _ in range(num_workers)]
        self.cycle = 0
        self.preassigned: dict[int, int] = {}   # batch index -> worker, from a checkpoint
        self.limit: int | None = None   # tasks to yield at most (an epoch left early: torch's window)
        self.yielded = 0

    def resume(self, assigned: list, next_worker: int) -> None:
        """A checkpoint's round robin: the batches that were in flight (``[batch_index,
        worker_id]``) go to the workers that had them, then the cycle goes on from
        ``next_worker``."""
        self.preassigned = {b: w for b, w in assigned if 0 <= w < self.num_workers}
        self.cycle = next_worker % self.num_workers

    def received_from(self, worker_id: int, batch_index: int) -> None:
        """The result of ``batch_index`` from ``worker_id`` was taken (idempotent)."""
        if 0 <= worker_id < self.num_workers:
            self.in_flight[worker_id].discard(batch_index)

    def received(self) -> int:
        """Results taken so far (batches, exceptions, replicas' ends)."""
        return self.yielded - sum(len(s) for s in self.in_flight)

    def assigned(self) -> list[list[int]]:
        """``[batch_index, worker_id]`` of every batch in flight, by batch index."""
        return sorted([b, w] for w, batches in enumerate(self.in_flight) for b in batches)

    def _pick(self) -> int | None:
        active, in_flight = self.active, self.in_flight
        for _ in range(self.num_workers):
            w = self.cycle
            self.cycle = (w + 1) % self.num_workers
            if active[w] and (self.in_order or len(in_flight[w]) < self.max_tasks // sum(active)):
                return w
        return None

    def tasks(self, epoch: int, pairs: Iterable[tuple], iterable: bool) -> Iterable[tuple]:
        """``(epoch, batch_index, indices, worker_id)`` for each ``(batch_index, index)``
        pair (the checkpoint's stream over what the sampler yields); for an
        IterableDataset ``indices`` is ``("iter", epoch, batch size or None)``."""
        preassigned = self.preassigned
        if not self.round_robin:
            for send_idx, index in pairs:
                yield (epoch, send_idx, index, None)
            return
        pairs = iter(pairs)
        while True:
            # The limit first: a pull past torch's window (an epoch left early) would
            # run the sampler further than torch's does (torch's RandomSampler draws
            # once more at the end of its pass).
            if self.limit is not None and self.yielded >= self.limit:
                return
            pair = next(pairs, None)
            if pair is None:
                return
            send_idx, index = pair
            worker = preassigned.pop(send_idx, None) if preassigned else self._pick()
            if worker is None:
                worker = self._pick()
            if worker is None:
                if not any(self.active):
                    return
                continue  # torch drops the index too (it cannot happen with a sane prefetch)
            if iterable:
                index = ("iter", epoch, None if index is None else len(index))
            self.in_flight[worker].add(send_idx)
            self.yielded += 1
            yield (epoch, send_idx, index, worker)


def _as_torch_error(exc: BaseException, cause: Any) -> BaseException:
    """The exception torch's ``ExceptionWrapper.reraise`` would raise for ``exc`` raised
    in worker ``cause.worker_id``: same type, message "Caught X in DataLoader worker
    process N.\\nOriginal Traceback ...".  The engine's context (pid, batch, sample
    indices) stays reachable as ``__cause__`` and in a note."""
    exc_type = type(exc)
    msg = f"Caught {exc_type.__name__} in DataLoader worker process {cause.worker_id}.\nOriginal {cause.traceback}"
    new: BaseException
    if exc_type is KeyError:
        new = KeyError(_KeyErrorMessage(msg))
    elif getattr(exc_type, "message", None):
        try:
            new = exc_type(message=msg)  # type: ignore[call-arg]
        except Exception:  # noqa: BLE001 - as torch: unbuildable types become RuntimeError
            new = RuntimeError(msg)
    else:
        try:
            new = exc_type(msg)
        except Exception:  # noqa: BLE001
            new = RuntimeError(msg)
    add_note(new, f"mploader: worker {cause.worker_id} (pid {cause.pid}), batch {cause.batch}, "
                  f"sample indices {cause.indices!r}")
    return new


class _KeyErrorMessage(str):
    """A str whose repr is itself, so KeyError shows the message, not its repr (as torch)."""

    def __repr__(self) -> str:
        return str(self)


class _SeededInlineIter(_BaseDataLoaderIter):
    """``num_workers=0`` with ``seed``: torch's single-process iteration on the
    engine's in-process executor (:class:`mploader._engine.InlineRun`, every face's
    one), which seeds the RNGs from (seed, epoch, batch index) around each batch as a
    worker would and restores the caller's RNG states afterwards."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        if self._timeout != 0:
            raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")
        epoch = loader._mpl.next_epoch()
        pos = self._mpl_pos = _torch_state.begin(loader, epoch, self._sampler_iter)
        self._sampler_iter: Any = pos.indices()   # (a resumed epoch starts at the saved batch)
        self._it: Any = iter(self._dataset) if isinstance(self._dataset, IterableDataset) else None
        self._ended = False
        tasks = ((epoch, pos.current, index) for index in self._sampler_iter)
        self._inline = _engine.InlineRun(self._dataset, self._fetch_task, tasks, loader.seed)

    def _next_data(self) -> Any:
        return _torch_state.next_counted(self._mpl_pos, self._load)

    def _load(self) -> Any:
        data = next(self._inline)
        if self._pin_memory:
            data = torch.utils.data._utils.pin_memory.pin_memory(data, self._pin_memory_device)
        return data

    def _fetch_task(self, dataset: Any, index: Any, alloc: Any) -> Any:
        return self._fetch(index)

    def _fetch(self, index: Any) -> Any:
        dataset, collate_fn = self._dataset, self._collate_fn
        if isinstance(dataset, IterableDataset):
            if self._ended:
                raise StopIteration
            if not self._auto_collation:
                return collate_fn(next(self._it))
            data = []
            for _ in index:
                try:
                    data.append(next(self._it))
                except StopIteration:
                    self._ended = True
                    break
            if not data or (self._drop_last and len(data) < len(index)):
                raise StopIteration
            return collate_fn(data)
        if self._auto_collation:
            getitems = getattr(dataset, "__getitems__", None)
            return collate_fn(getitems(index) if getitems else [dataset[i] for i in index])
        return collate_fn(dataset[index])
