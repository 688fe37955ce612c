"""The batch transports that the benchmarks compare, behind one interface.

Each transport turns a map-style dataset (``len()`` and ``__getitem__``) and an
ordered list of batches (lists of indices) into a stream of collated numpy
batches, in the order of that list:

``mploader``
    :class:`mploader.DataLoader` with forked workers that collate into a slot
    of a shared-memory ring; the batches are zero-copy views.
``pickle``
    The MXNet Gluon / GluonNLP design: a forked :class:`multiprocessing.pool.Pool`
    whose initializer stores the dataset in a global; a worker fetches the
    samples, collates them with :func:`collate` (:func:`numpy.stack` for arrays,
    :func:`numpy.asarray` for numbers) and returns the batch, which
    the pool pickles through its result pipe.  About ``2 * workers`` batches are
    in flight, results are taken in order.
``queue``
    Forked worker processes that collate and ``put`` each batch on one
    :class:`multiprocessing.Queue`; the parent puts it back in order by
    sequence number.
``mploader.torch``
    :class:`mploader.torch.DataLoader` (persistent forked workers,
    ``prefetch_factor=2``, ``default_collate``); the batches are tensors over the
    slot, turned into numpy arrays with ``Tensor.numpy()`` (zero-copy).
    ``mploader.torch-tensors`` and ``torch-tensors`` (opt-in, ``--transports``)
    run the two torch loaders over the dataset in torch style
    (:class:`TensorSamples`: samples of tensors).  ``mploader.torch-seed`` (the
    transport suite) passes ``seed=``, under which each task goes to the
    least-loaded worker, not torch's round robin.
``torch``
    :class:`torch.utils.data.DataLoader` with persistent forked workers,
    ``prefetch_factor=2`` and its default collate; tensors are turned into
    numpy arrays with ``Tensor.numpy()`` (zero-copy).
``inline``
    No worker: the calling process fetches and collates with :func:`collate`.
    This is the reference the others are checked against.

A batch is yielded as a tuple with one array per field of the sample (for a
sample ``(ndarray, int)``: ``(images (B, ...), labels (B,))``); a sample that
is a bare array or number gives a bare array.  Arrays yielded by ``mploader``
and ``torch`` may live in shared memory that is reused once the consumer lets go
of them: copy what must outlive the next batch.

Adding a transport
------------------
This module is the one place: subclass :class:`Transport`, give it a ``name``,
the modules it ``requires`` (it is left out where one does not import), the
``suites`` that run it by default (``"images"``, ``"transport"``), implement
``_epoch`` (and ``_close`` if it holds workers), and decorate it with
:func:`register`.  Both suites, ``--transports``, the tables and the checksum
verification pick it up; the report lists transports in registration order.
A transport whose library wants its own kind of dataset (a torch-style one
returning tensors, say) wraps the numpy dataset it is given in ``__init__``;
whatever it yields must be numpy arrays (``Tensor.numpy()`` is zero-copy).

Examples
--------
>>> import numpy as np
>>> ds = [(np.full(3, i, np.float32), i) for i in range(8)]
>>> with open_transport("inline", ds, workers=0) as t:
...     [labels.tolist() for _, labels in t.epoch([[0, 1], [5, 4]])]
[[0, 1], [5, 4]]
"""
from __future__ import annotations

import collections
import importlib
import multiprocessing
import os
import queue as _queue_mod
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = [
    "SUITES",
    "Transport",
    "available_transports",
    "collate",
    "missing_requirements",
    "open_transport",
    "register",
    "transport_names",
]

#: The suites a transport can take part in by default.
SUITES = ("images", "transport")

_FORK = multiprocessing.get_context("fork")


# --------------------------------------------------------------------------
# collation shared by pickle, queue and inline


def collate(samples: Sequence[Any]) -> Any:
    """Collate a list of samples into one batch, as Gluon's default batchify.

    Arrays are stacked with :func:`numpy.stack`; numbers (Python or numpy
    scalars) become an array with :func:`numpy.asarray`; tuples/lists are
    collated field by field.

    Parameters
    ----------
    samples : sequence
        Samples of one structure: arrays, numbers, or tuples/lists of those
        (nested to any depth).

    Returns
    -------
    numpy.ndarray or tuple
        For array/number samples an array of shape ``(len(samples), *shape)``;
        for tuple/list samples a tuple with one collated entry per field.
    """
    first = samples[0]
    if isinstance(first, (tuple, list)):
        return tuple(collate(field) for field in zip(*samples))
    if isinstance(first, np.ndarray):
        return np.stack(samples)
    return np.asarray(samples)


def _fetch_collate(dataset: Any, indices: Sequence[int]) -> Any:
    return collate([dataset[i] for i in indices])


def _as_batch(batch: Any) -> Any:
    """Normalise a batch to the transports' common form: lists become tuples."""
    if isinstance(batch, list):
        return tuple(_as_batch(b) for b in batch)
    if isinstance(batch, tuple):
        return tuple(_as_batch(b) for b in batch)
    return batch


def _torch_to_numpy(batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return tuple(_torch_to_numpy(b) for b in batch)
    if hasattr(batch, "numpy"):
        return batch.numpy()
    return np.asarray(batch)


class _SwappableBatches:
    """A re-iterable batch sampler whose list of batches can be replaced.

    Parameters
    ----------
    batches : list of list of int
        The batches of the next epoch.
    """

    def __init__(self, batches: Sequence[Sequence[int]] = ()) -> None:
        self.batches: Sequence[Sequence[int]] = list(batches)

    def __iter__(self) -> Iterator[Sequence[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


# --------------------------------------------------------------------------
# the interface


class Transport:
    """One transport with its workers; a context manager.

    Use :func:`open_transport` to make one.  Workers (if any) are started once
    and reused by every :meth:`epoch`.

    Attributes
    ----------
    name : str
        The transport's name, one of :func:`transport_names`.
    requires : tuple of str
        Modules that must import for the transport to be available.
    suites : tuple of str
        The suites (of :data:`SUITES`) that run it when ``--transports`` is not given.
    workers : int
        Number of worker processes (0 for ``inline``).
    """

    name: str = "?"
    requires: tuple[str, ...] = ()
    suites: tuple[str, ...] = SUITES

    def __init__(self, dataset: Any, *, workers: int, seed: int = 0,
                 prefetch: int | None = None) -> None:
        self.dataset = dataset
        self.workers = int(workers)
        self.seed = seed
        self.prefetch = prefetch
        self._closed = False

    def epoch(self, batches: Sequence[Sequence[int]]) -> Iterator[Any]:
        """Iterate over the collated batches of one epoch, in the given order.

        Parameters
        ----------
        batches : list of list of int
            Indices of each batch, in the order the batches are wanted.

        Yields
        ------
        tuple of numpy.ndarray
            One collated batch per entry of `batches`.
        """
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")
        return self._epoch([list(map(int, b)) for b in batches])

    def _epoch(self, batches: list[list[int]]) -> Iterator[Any]:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """Stop the workers and free the transport's resources; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close()

    def _close(self) -> None:
        pass

    def verdict(self) -> str | None:
        """``mploader.diagnose``'s kind for the last epoch (``"input-bound"``,
        ``"compute-bound"``, ``"transport-bound"`` or ``"unknown"``), or None for a
        transport that keeps no metrics (every peer)."""
        return None

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the way
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nowhere to report it from __del__
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.name} workers={self.workers} {state}>"


class _Inline(Transport):
    name = "inline"
    suites = ("images",)  # the transport suite's reference is collate-limit

    def _epoch(self, batches: list[list[int]]) -> Iterator[Any]:
        dataset = self.dataset
        for indices in batches:
            yield _fetch_collate(dataset, indices)


def _verdict(loader: Any) -> str | None:
    """``mploader.diagnose(loader).kind`` (None once the transport is closed)."""
    if loader is None:
        return None
    import mploader

    return mploader.diagnose(loader).kind


class _MPLoader(Transport):
    name = "mploader"
    requires = ("mploader",)

    def __init__(self, dataset: Any, **kw: Any) -> None:
        super().__init__(dataset, **kw)
        import mploader

        self._sampler = _SwappableBatches()
        self._loader: Any = mploader.DataLoader(  # None once closed
            dataset, batch_sampler=self._sampler, num_workers=self.workers,
            seed=self.seed, prefetch=self.prefetch)

    #: How a delivered batch becomes the checked batch (zero-copy views of the slot).
    _convert = staticmethod(_as_batch)

    def _epoch(self, batches: list[list[int]]) -> Iterator[Any]:
        self._sampler.batches = batches
        for batch in self._loader:
            out = self._convert(batch)
            del batch  # hold the batch (and its slot) only through `out`
            yield out
            del out

    def _close(self) -> None:
        loader, self._loader = getattr(self, "_loader", None), None
        if loader is not None:
            loader.close()

    def verdict(self) -> str | None:
        return _verdict(self._loader)


# ---- pickle: multiprocessing.Pool, as MXNet Gluon / GluonNLP ----

_pool_dataset: Any = None


def _pool_init(dataset: Any) -> None:
    global _pool_dataset
    _pool_dataset = dataset


def _pool_work(indices: list[int]) -> Any:
    return _fetch_collate(_pool_dataset, indices)


class _Pickle(Transport):
    name = "pickle"

    def __init__(self, dataset: Any, **kw: Any) -> None:
        super().__init__(dataset, **kw)
        self._pool: Any = _FORK.Pool(  # None once closed
           max(1, self.workers), initializer=_pool_init,
                                initargs=(dataset,))
        self._inflight = self.prefetch if self.prefetch else 2 * max(1, self.workers)

    def _epoch(self, batches: list[list[int]]) -> Iterator[Any]:
        # Ordered, chunksize 1, a bounded number in flight: MXNet's
        # _MultiWorkerIter keeps `prefetch` apply_async results in a FIFO.
        pending: collections.deque = collections.deque()
        it = iter(batches)
        for indices in it:
            pending.append(self._pool.apply_async(_pool_work, (indices,)))
            if len(pending) >= self._inflight:
                break
        while pending:
            result = pending.popleft().get()
            for indices in it:
                pending.append(self._pool.apply_async(_pool_work, (indices,)))
                break
            yield result

    def _close(self) -> None:
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.terminate()
            pool.join()


# ---- queue: forked workers put batches on one multiprocessing.Queue ----


def _queue_worker(dataset: Any, tasks: Any, results: Any) -> None:
    while True:
        task = tasks.get()
        if task is None:
            break
        epoch, seq, indices = task
        try:
            batch = _fetch_collate(dataset, indices)
        except Exception as exc:  # noqa: BLE001 - sent back and raised in the parent
            results.put((epoch, seq, None, exc))
        else:
            results.put((epoch, seq, batch, None))
    results.close()
    results.join_thread()


class _Queue(Transport):
    name = "queue"
    suites = ("transport",)

    def __init__(self, dataset: Any, **kw: Any) -> None:
        super().__init__(dataset, **kw)
        self._tasks = _FORK.Queue()
        self._results = _FORK.Queue()
        self._inflight = self.prefetch if self.prefetch else 2 * max(1, self.workers)
        self._epoch_id = 0
        self._procs = []
        for _ in range(max(1, self.workers)):
            p = _FORK.Process(target=_queue_worker, args=(dataset, self._tasks, self._results),
                              daemon=True)
            p.start()
            self._procs.append(p)

    def _get(self) -> tuple:
        while True:
            try:
                return self._results.get(timeout=1.0)
            except _queue_mod.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"queue worker {dead[0].pid} died "
                                       f"(exit code {dead[0].exitcode})") from None

    def _epoch(self, batches: list[list[int]]) -> Iterator[Any]:
        self._epoch_id += 1
        epoch = self._epoch_id
        n = len(batches)
        sent = 0
        done: dict[int, Any] = {}
        while sent < min(n, self._inflight):
            self._tasks.put((epoch, sent, batches[sent]))
            sent += 1
        for want in range(n):
            while want not in done:
                e, seq, batch, exc = self._get()
                if e != epoch:
                    continue  # left over from an abandoned epoch
                if exc is not None:
                    raise exc
                done[seq] = batch
            batch = done.pop(want)
            if sent < n:
                self._tasks.put((epoch, sent, batches[sent]))
                sent += 1
            yield batch
            del batch

    def _close(self) -> None:
        procs, self._procs = getattr(self, "_procs", []), []
        if not procs:
            return
        for _ in procs:
            self._tasks.put(None)
        # Drain results so that no worker blocks flushing its queue at exit.
        deadline = time.monotonic() + 5.0
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            try:
                self._results.get(timeout=0.05)
            except (_queue_mod.Empty, OSError, EOFError):
                pass
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        for q in (self._tasks, self._results):
            q.close()
            q.join_thread()


# ---- torch: torch.utils.data.DataLoader, persistent workers ----


# the registry: the order of registration is the order of every report

_REGISTRY: dict[str, type[Transport]] = {}


def register(cls: type[Transport]) -> type[Transport]:
    """Class decorator: make a :class:`Transport` subclass one of the benchmarks' transports.

    Parameters
    ----------
    cls : type
        A subclass of :class:`Transport` with a new ``name`` and ``suites`` from
        :data:`SUITES`.

    Returns
    -------
    type
        `cls`, registered after those registered before it.

    Raises
    ------
    TypeError
        If `cls` is not a :class:`Transport` subclass.
    ValueError
        If its name is taken or empty, or a suite is unknown.
    """
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TypeError(f"register expects a Transport subclass, got {cls!r}")
    if not cls.name or cls.name == Transport.name or cls.name in _REGISTRY:
        raise ValueError(f"transport name {cls.name!r} is empty or already registered")
    bad = [s for s in cls.suites if s not in SUITES]
    if bad:
        raise ValueError(f"transport {cls.name!r}: unknown suites {bad}; expected some of {SUITES}")
    _REGISTRY[cls.name] = cls
    return cls


# The torch transports live in peers_torch (imported here: they use the names above).
from .peers_torch import _MPLTorch, _MPLTorchSeed, _MPLTorchTensors, _Torch, _TorchTensors  # noqa: E402

for _cls in (_MPLoader, _MPLTorch, _MPLTorchSeed, _MPLTorchTensors, _Pickle, _Queue, _Torch, _TorchTensors, _Inline):
    register(_cls)


def transport_names(suite: str | None = None) -> list[str]:
    """Registered transports, in registration order.

    Parameters
    ----------
    suite : str or None, optional
        Only those that `suite` (one of :data:`SUITES`) runs by default.

    Returns
    -------
    list of str
    """
    return [n for n, c in _REGISTRY.items() if suite is None or suite in c.suites]


def missing_requirements(name: str) -> list[str]:
    """The modules of transport `name`'s ``requires`` that do not import here.

    Raises
    ------
    ValueError
        If `name` is not registered.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; expected one of {transport_names()}") from None
    missing = []
    for module in cls.requires:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a broken install (OSError, RuntimeError) too
            missing.append(module)
    return missing


def available_transports(suite: str | None = None) -> list[str]:
    """Names of the transports usable here, in registration order.

    Parameters
    ----------
    suite : str or None, optional
        Only those that `suite` runs by default.

    Returns
    -------
    list of str
        :func:`transport_names` without those whose ``requires`` do not import
        (``torch`` without torch).
    """
    return [n for n in transport_names(suite) if not missing_requirements(n)]


def open_transport(name: str, dataset: Any, *, workers: int, seed: int = 0,
                   prefetch: int | None = None) -> Transport:
    """Start one transport over `dataset`.

    Parameters
    ----------
    name : str
        One of :func:`transport_names`.
    dataset : object
        Map-style dataset: ``len(dataset)`` and ``dataset[i]``; its samples are
        arrays, numbers, or tuples of those.
    workers : int
        Number of worker processes (ignored by ``inline``; ``torch`` with 0
        loads in the calling process).
    seed : int, optional
        Seed handed to mploader (other transports do no random work).
    prefetch : int or None, optional
        Batches in flight: mploader's ``prefetch``; ``pickle`` and ``queue``
        keep this many tasks submitted (default ``2 * workers``); ``torch``
        uses ``prefetch_factor = max(1, prefetch // workers)`` (default 2).

    Returns
    -------
    Transport
        The started transport; close it (or use it as a context manager).

    Raises
    ------
    ValueError
        If `name` is unknown.
    ImportError
        If the transport's library (mploader's engine, torch) is missing.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; expected one of {transport_names()}") from None
    if os.name != "posix" and name in ("pickle", "queue", "torch"):
        raise RuntimeError(f"transport {name!r} needs fork (POSIX)")
    return cls(dataset, workers=workers, seed=seed, prefetch=prefetch)
