"""``mploader.DataLoader``: MXNet Gluon's DataLoader on the slot ring."""
from __future__ import annotations

import ctypes
import numbers
import warnings
import weakref
from typing import Any, Callable, Iterator

import numpy as np

from . import _engine
from ._collate import collate
from .sampler import BatchSampler, RandomSampler, SequentialSampler

_LAST_BATCH = ("keep", "discard", "rollover")


def make_fetch(batchify_fn: Callable | None, sharded: bool = False) -> Callable:
    """``fetch(dataset, indices, alloc)`` for one batch of indices.

    Batchify functions with a ``collate(samples, alloc)`` method (the default, and
    those of :mod:`mploader.batchify`) write straight into ``alloc``'s arrays; any
    other callable is called as ``batchify_fn(samples)`` and its arrays are copied
    into the slot once.

    With ``sharded`` (GluonNLP's ShardedDataLoader), a batch whose first element is a
    list or tuple is a list of shards: the result is the list of the shards'
    batchified results, all built by the same call (one worker, one slot).
    """
    if batchify_fn is None:
        into = collate
    elif hasattr(batchify_fn, "collate"):
        into = batchify_fn.collate
    else:
        def into(samples, alloc):
            return batchify_fn(samples)

    def one(dataset, indices, alloc):
        return into([dataset[i] for i in indices], alloc)
    if not sharded:
        return one

    def fetch(dataset, indices, alloc):
        if len(indices) and isinstance(indices[0], (list, tuple)):
            return [one(dataset, shard, alloc) for shard in indices]
        return one(dataset, indices, alloc)
    return fetch


def check_dataset(dataset: Any, needs_len: bool) -> None:
    if not hasattr(dataset, "__getitem__") or (needs_len and not hasattr(dataset, "__len__")):
        raise TypeError(f"dataset must support __getitem__{' and __len__' if needs_len else ''}, "
                        f"got {type(dataset).__name__}")


def check_nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


#: cudaHostRegisterPortable: the registration counts for every CUDA context.
_CUDA_HOST_REGISTER_PORTABLE = 1
#: madvise(2) advice that undoes MADV_DONTFORK (include/uapi/asm-generic/mman-common.h).
_MADV_DOFORK = 11


def cuda_runtime(device_id: int) -> tuple[Any, Callable[[], Any]] | None:
    """torch's CUDA runtime bindings and a context manager factory selecting
    ``device_id``, when torch with a usable CUDA device is installed; else None."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        return torch.cuda.cudart(), lambda: torch.cuda.device(device_id)
    except Exception:  # noqa: BLE001 - a broken CUDA setup means: do not pin
        return None


def _madvise_dofork(address: int, nbytes: int) -> None:
    """Make sure workers forked later still inherit a registered range (some drivers
    mark page-locked memory MADV_DONTFORK; the region is MAP_SHARED, so inheriting
    it is safe)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _MADV_DOFORK)
    except Exception:  # noqa: BLE001 - best effort
        pass


class HostPinner:
    """Page-locks an engine's shared region for CUDA, so batch views are pinned memory.

    The region's file grows inside a fixed address reservation (docs/design.md,
    "Growth"), so :meth:`update` registers (``cudaHostRegister``, portable) only the
    part of the file not registered yet; called after each batch arrives, it makes
    every byte a returned batch views page-locked, at the cost of one registration
    per growth of the region.  :meth:`release` unregisters every range.  The pinner
    holds the ``Region`` object, so the mapping cannot disappear before
    :meth:`release` has run.  Ranges a slot grew out of stay registered (and hence
    resident) until then.

    Parameters
    ----------
    cudart : object
        ``torch.cuda.cudart()``: ``cudaHostRegister(ptr, nbytes, flags)`` and
        ``cudaHostUnregister(ptr)``, each returning a cudaError (0 on success).
    device : callable
        Returns a context manager that selects the pinning device.
    resources : object
        The engine's resources; ``resources.region`` is the Region once started.
    """

    def __init__(self, cudart: Any, device: Callable[[], Any], resources: Any) -> None:
        self._cudart = cudart
        self._device = device
        self._resources = resources
        self._region: Any = None
        self._registered_bytes = 0
        self._ranges: list[int] = []
        self._failed = False

    @property
    def ranges(self) -> list[int]:
        """Start addresses of the registered ranges."""
        return list(self._ranges)

    def update(self) -> None:
        """Register the region's bytes that are not registered yet (none: no-op)."""
        if self._failed:
            return
        region = self._region
        if region is None:
            region = self._resources.region
            if region is None:
                return
            self._region = region
        end = region.file_bytes
        start = self._registered_bytes
        if end <= start:
            return
        address = region.address + start
        with self._device():
            rc = self._cudart.cudaHostRegister(address, end - start, _CUDA_HOST_REGISTER_PORTABLE)
        code = int(getattr(rc, "value", rc))
        if code != 0:
            self._failed = True
            warnings.warn(f"pin_memory: cudaHostRegister of {end - start} bytes of the shared region failed "
                          f"(cudaError {code}); batches are returned in unpinned memory", RuntimeWarning,
                          stacklevel=3)
            return
        _madvise_dofork(address, end - start)
        self._ranges.append(address)
        self._registered_bytes = end

    def release(self) -> None:
        """Unregister every range and let go of the region.  Idempotent."""
        ranges, self._ranges = self._ranges, []
        for address in ranges:
            try:
                with self._device():
                    self._cudart.cudaHostUnregister(address)
            except Exception:  # noqa: BLE001 - at exit CUDA may already be gone
                pass
        self._region = None
        self._failed = True


def draw_seed(seed: int | None) -> int:
    """The loader's base seed: ``seed``, or one draw from NumPy's global RNG (so
    ``np.random.seed`` makes loaders reproducible, as torch's loader does with
    ``torch.manual_seed``)."""
    if seed is None:
        return int(np.random.randint(0, 2**63 - 1, dtype=np.int64))
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    return int(seed)


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
        ``batchify_fn(samples) -> batch``.  Default: :func:`mploader.default_batchify`
        (stacks arrays and numbers, recursing into tuples, lists, dicts).
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
        Batches in flight (default ``2 * num_workers``).
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
        Payload bytes per slot; None sizes slots from the first batch with 25 %
        headroom.  Batches that do not fit make the slot grow.
    copy : bool
        Return owned arrays instead of views into shared memory.
    seed : int, optional
        Base seed.  Before each batch the worker seeds ``random``, NumPy's global RNG
        and torch's (if imported) from (seed, epoch, batch index), so an epoch's
        batches are the same for any ``num_workers``.  None draws one from NumPy's
        global RNG.

    Raises
    ------
    TypeError
        ``dataset`` lacks ``__getitem__``/``__len__``; ``seed`` not an int.
    ValueError
        An argument is out of range or conflicts with another (the message names it).
    """

    #: Whether batches of shards (lists of index lists) are batchified per shard
    #: (GluonNLP's ShardedDataLoader).
    _sharded = False

    def __init__(self, dataset: Any, batch_size: int | None = None, shuffle: bool = False, sampler: Any = None,
                 last_batch: str | None = None, batch_sampler: Any = None, batchify_fn: Callable | None = None,
                 num_workers: int = 0, pin_memory: bool = False, pin_device_id: int = 0,
                 prefetch: int | None = None, thread_pool: bool = False, timeout: float | None = 120,
                 try_nopython: bool | None = None, *, shared_mem: int | None = None, copy: bool = False,
                 seed: int | None = None) -> None:
        check_dataset(dataset, needs_len=batch_sampler is None)
        self._seed = draw_seed(seed)
        self._shuffler: RandomSampler | None = None
        if batch_sampler is None:
            if batch_size is None:
                raise ValueError("batch_size must be specified unless batch_sampler is specified")
            if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
                raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
            if last_batch is not None and last_batch not in _LAST_BATCH:
                raise ValueError(f"last_batch must be one of 'keep', 'discard', 'rollover', got {last_batch!r}")
            if sampler is None:
                if shuffle:
                    sampler = self._shuffler = RandomSampler(len(dataset), seed=self._seed)
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
        self._num_workers = check_nonneg_int("num_workers", num_workers)
        if prefetch is not None:
            check_nonneg_int("prefetch", prefetch)
        self._prefetch = int(prefetch) if prefetch is not None else 2 * self._num_workers
        if shared_mem is not None:
            check_nonneg_int("shared_mem", shared_mem)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or timeout < 0):
            raise ValueError(f"timeout must be a non-negative number of seconds or None, got {timeout!r}")
        self._timeout = float(timeout) if timeout else None
        self._thread_pool = bool(thread_pool)
        self._pin_memory = bool(pin_memory)
        self._pin_device_id = pin_device_id
        self._copy = bool(copy)
        self._try_nopython = try_nopython
        self._fetch = make_fetch(batchify_fn, sharded=self._sharded)
        self._epoch = 0
        self._engine: _engine.Engine | None = None
        self._pinner: HostPinner | None = None
        if self._num_workers > 0 and not self._thread_pool:
            self._engine = _engine.Engine(dataset, self._fetch, num_workers=self._num_workers,
                                          prefetch=self._prefetch, shared_mem=shared_mem,
                                          timeout_s=self._timeout, seed=self._seed, copy=self._copy)
            runtime = cuda_runtime(pin_device_id) if self._pin_memory and not self._copy else None
            if runtime is not None:
                self._pinner = HostPinner(runtime[0], runtime[1], self._engine._res)
                weakref.finalize(self._engine, self._pinner.release)

    def __len__(self) -> int:
        """Number of batches per epoch (``len(batch_sampler)``)."""
        return len(self._batch_sampler)

    def _tasks(self, epoch: int) -> Iterator[tuple]:
        if self._shuffler is not None:
            self._shuffler.set_epoch(epoch)
        for i, indices in enumerate(self._batch_sampler):
            yield epoch, i, indices

    def __iter__(self) -> "_LoaderIter":
        epoch = self._epoch
        self._epoch += 1
        tasks = self._tasks(epoch)
        if self._engine is not None:
            gen = self._engine.run(tasks)
        elif self._thread_pool and self._num_workers > 0:
            gen = _engine.ThreadRun(self._dataset, self._fetch, tasks, self._num_workers, self._prefetch,
                                    self._timeout)
        else:
            gen = _engine.InlineRun(self._dataset, self._fetch, tasks, self._seed)
        return _LoaderIter(gen, len(self), self._engine, self._pinner)

    def stats(self) -> dict:
        """Transport counters (ints): ``batches`` delivered; ``slot`` zero-copy through a
        slot; ``fallback_inband`` through a slot with some leaves pickled in the
        descriptor (object arrays, arbitrary objects); ``fallback_pipe`` pickled through a
        worker's pipe; ``no_free_slot`` dispatched while every slot was held; ``grown``
        batches for which a slot grew (with ``shared_mem=None`` slots start empty, so each
        slot's first batch counts); ``errors`` re-raised worker exceptions;
        ``num_slots``; ``shm_bytes`` (bytes of shared memory the ring spans)."""
        if self._engine is None:
            return {"batches": 0, "slot": 0, "fallback_inband": 0, "fallback_pipe": 0, "no_free_slot": 0,
                    "grown": 0, "errors": 0, "num_slots": 0, "shm_bytes": 0}
        return self._engine.stats()

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (empty before the first iteration)."""
        return self._engine.worker_pids() if self._engine is not None else []

    def close(self) -> None:
        """Stop the workers and release shared memory not held by live batches.  Idempotent."""
        if self._pinner is not None:
            self._pinner.release()
        if self._engine is not None:
            self._engine.close()

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _LoaderIter:
    """One epoch of a :class:`DataLoader`; keeps the engine alive on its own."""

    def __init__(self, gen: Iterator[Any], length: int, engine: Any, pinner: HostPinner | None = None) -> None:
        self._gen = gen
        self._len = length
        self._engine = engine
        self._pinner = pinner

    def __iter__(self) -> "_LoaderIter":
        return self

    def __next__(self) -> Any:
        batch = next(self._gen)
        if self._pinner is not None:
            self._pinner.update()
        return batch

    next = __next__

    def __len__(self) -> int:
        return self._len
