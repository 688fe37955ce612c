"""What a worker of :class:`mploader.torch.DataLoader` runs: start-up and fetch.

Both objects are module-level classes so that spawn/forkserver workers can unpickle
them; the engine pickles them together with the dataset (one pickle), so the
dataset :class:`WorkerInit` publishes in ``get_worker_info()`` is the very object
:class:`Fetch` reads from.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torch.utils.data._utils import worker as _torch_worker

from . import _rng_state
from . import _worker as _mpl_worker
from ._face import Face
from ._torch_collate import collate_into, convert_into, pack, plan_tensor_column, stock_default_collate

_MASK32 = 0xFFFFFFFF


def numpy_seed_state(base_seed: int, worker_id: int) -> list[int]:
    """The four uint32 words torch's worker passes to ``np.random.seed``: NumPy's
    ``SeedSequence`` hashing of ``[worker_id, base_seed & MASK32, base_seed >> 32, 0]``
    (torch's ``_generate_state``; constants from numpy/random/bit_generator.pyx)."""
    init_a, mult_a, init_b, mult_b = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
    mix_l, mix_r, xshift = 0xCA01F9DD, 0x4973F715, 16
    hash_const = init_a

    def hashmix(value: int) -> int:
        nonlocal hash_const
        value = (value ^ hash_const) & _MASK32
        hash_const = (hash_const * mult_a) & _MASK32
        value = (value * hash_const) & _MASK32
        return (value ^ (value >> xshift)) & _MASK32

    def mix(x: int, y: int) -> int:
        r = (((mix_l * x) & _MASK32) - ((mix_r * y) & _MASK32)) & _MASK32
        return (r ^ (r >> xshift)) & _MASK32

    pool = [hashmix(v) for v in (worker_id, base_seed & _MASK32, base_seed >> 32, 0)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    out, hash_b = [], init_b
    for v in pool:
        v = (v ^ hash_b) & _MASK32
        hash_b = (hash_b * mult_b) & _MASK32
        v = (v * hash_b) & _MASK32
        out.append((v ^ (v >> xshift)) & _MASK32)
    return out


class WorkerInit:
    """The engine's ``worker_init``: what torch's ``_worker_loop`` does before its
    first task.

    ``torch.set_num_threads(1)``; unless batches are seeded by the engine
    (``per_batch``), ``random`` and torch are seeded with ``base_seed + worker_id``
    and NumPy's global RNG with :func:`numpy_seed_state`; ``get_worker_info()``
    returns torch's ``WorkerInfo(id, num_workers, seed, dataset)``; then the user's
    ``worker_init_fn(worker_id)``.  ``base_seed`` is set by the parent before the
    workers of an epoch start (torch draws a new one for every iterator).

    ``rng_states`` (set by the parent with ``base_seed``; issue 11): a resumed
    checkpoint's RNG states per worker id, a :func:`mploader._rng_state.to_json`
    dict or None.  A worker with a state restores it after ``worker_init_fn``, so
    it goes on drawing where the saved loader's worker ``i`` stood after its last
    batch the user received.
    """

    def __init__(self, dataset: Any, worker_init_fn: Callable[[int], None] | None, per_batch: bool) -> None:
        self.dataset = dataset
        self.worker_init_fn = worker_init_fn
        self.per_batch = per_batch
        self.base_seed = 0
        self.rng_states: list[dict | None] | None = None

    def __call__(self, worker_id: int, num_workers: int) -> None:
        torch.set_num_threads(1)
        seed = self.base_seed + worker_id
        if not self.per_batch:
            random.seed(seed)
            torch.manual_seed(seed)
            np.random.seed(numpy_seed_state(self.base_seed, worker_id))
        _torch_worker._worker_info = _torch_worker.WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=self.dataset)
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)
        state = self.rng_states[worker_id] if self.rng_states and worker_id < len(self.rng_states) else None
        if state is not None and not self.per_batch:
            _rng_state.restore(state)


#: What a worker's payload is (the second item of a :class:`Fetch` batch).
ARRAYS, PACKED, EXHAUSTED = 0, 1, 2

#: How a batch's samples become what the worker returns (see :class:`Fetch`).
DEFAULT, CONVERT, CUSTOM = "default", "convert", "custom"


class Fetch(Face):
    """The torch face's worker contract (:class:`mploader._face.Face`).

    The batch is ``(payload, kind)`` (which worker built it, the engine says:
    ``Engine.run(tagged=True)``): ``kind`` ARRAYS -- the batch with
    arrays where torch has tensors (the parent applies
    :func:`~mploader._torch_collate.to_tensors`); PACKED -- a
    :func:`~mploader._torch_collate.pack` result (the parent unpacks it); EXHAUSTED
    -- no batch, this worker's IterableDataset replica is exhausted (payload None).

    For a map-style dataset ``indices`` is what the (batch) sampler yielded and the
    samples are ``dataset.__getitems__(indices)`` when the dataset has it, else
    ``[dataset[i] for i in indices]`` (``dataset[indices]`` without auto-batching),
    as torch's ``_MapDatasetFetcher``.

    For an IterableDataset ``indices`` is ``("iter", epoch, n)``: the worker takes
    the next ``n`` samples (one sample for ``n=None``) from its own iterator over its
    copy of the dataset, a new iterator whenever ``epoch`` changes; once that
    iterator is exhausted (or, with ``drop_last``, cannot fill a batch) the kind is
    EXHAUSTED, as torch's ``_IterableDatasetFetcher`` raises StopIteration.

    ``mode``: DEFAULT (:func:`collate_into`, or ``default_collate`` + :func:`pack`
    when ``default_collate_fn_map`` was extended), CONVERT (:func:`convert_into`),
    CUSTOM (``collate_fn`` + :func:`pack`).  A map-style batch collated by torch's
    own ``default_collate`` is plannable (tensor columns: :func:`plan_tensor_column`).

    No :meth:`side` here; :class:`CapturingFetch` sends the worker's RNG states
    beside the batch.
    """

    other_columns = staticmethod(plan_tensor_column)

    def __init__(self, mode: str, collate_fn: Callable, auto_collation: bool, drop_last: bool) -> None:
        self.mode = mode
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self._epoch: Any = None
        self._iter: Any = None
        self._ended = False

    def load(self, dataset: Any, indices: Any) -> Any:
        if isinstance(dataset, IterableDataset):
            return self._next_samples(dataset, indices)   # (_END when the replica has no batch left)
        if self.auto_collation:
            return _map_samples(dataset, indices)
        return dataset[indices]

    def collate(self, samples: Any, alloc: Callable) -> Any:
        """The payload, or :class:`_Packed` around it, or ``_END``."""
        if samples is _END:
            return _END
        if self.mode == DEFAULT and stock_default_collate():
            return collate_into(samples, alloc)
        if self.mode == CONVERT:
            return convert_into(samples)
        return _Packed(pack(self.collate_fn(samples)))

    def plannable(self, dataset: Any, samples: Any) -> bool:
        return (self.mode == DEFAULT and self.auto_collation and not isinstance(dataset, IterableDataset)
                and stock_default_collate())

    def wrap(self, collated: Any) -> tuple[Any, int]:
        if collated is _END:
            return (None, EXHAUSTED)
        if type(collated) is _Packed:
            return (collated.packed, PACKED)
        return (collated, ARRAYS)

    def _next_samples(self, dataset: Any, indices: Any) -> Any:
        _, epoch, n = indices
        if epoch != self._epoch:
            self._epoch, self._iter, self._ended = epoch, None, False
            self._iter = iter(dataset)
        if self._ended:
            return _END
        if n is None:
            try:
                return next(self._iter)
            except StopIteration:
                self._ended = True
                return _END
        data = []
        for _ in range(n):
            try:
                data.append(next(self._iter))
            except StopIteration:
                self._ended = True
                break
        if not data or (self.drop_last and len(data) < n):
            return _END
        return data


class CapturingFetch(Fetch):
    """:class:`Fetch` for torch's per-worker seeding: the batch's :meth:`side`
    record, ``rng``, is the worker's RNG states after the batch -- after collation,
    which may draw too -- (:func:`mploader._rng_state.capture`, ``bytes``), which a
    checkpoint needs (docs/design.md, "Checkpoint state").  An exception raised by
    the batch carries them as its ``mploader_rng`` attribute, when its type can take
    one.

    ``rng`` is None when the states are those this worker sent with its previous
    batch of the same run (the task's epoch): a dataset that draws no random numbers
    then sends its ~10 KB of states once per run instead of with every batch.  The
    parent keeps the last states it received per worker, and receives every batch of
    a run in the worker's order; a run's first batch always carries them (a batch of
    an abandoned run may have been dropped unseen)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sent: bytes | None = None   # the states sent with this run's previous batch
        self._sent_epoch = -1

    def _new_run(self) -> None:
        epoch = _mpl_worker.task_epoch
        if epoch != self._sent_epoch or epoch < 0:
            self._sent, self._sent_epoch = None, epoch

    def _failed(self, exc: BaseException) -> None:
        """``exc`` carries the states as ``mploader_rng`` when its type can take them;
        whether they reach the parent depends on the exception: the next batch sends them."""
        self._sent = None
        try:
            exc.mploader_rng = _rng_state.capture()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - an exception type without attributes: the state is not known
            pass

    def load(self, dataset: Any, indices: Any) -> Any:
        self._new_run()
        try:
            return super().load(dataset, indices)
        except Exception as exc:
            self._failed(exc)
            raise

    def collate(self, samples: Any, alloc: Callable) -> Any:
        try:
            return super().collate(samples, alloc)
        except Exception as exc:
            self._failed(exc)
            raise

    def side(self) -> bytes | None:
        # Taken after collation, which may draw too, or, for a plannable batch, before
        # it: torch's own default_collate (the only rule with plans) draws nothing.
        rng = _rng_state.capture_if_changed(self._sent)
        if rng is not None:
            self._sent = rng
        return rng


class _Packed:
    """:meth:`Fetch.collate`'s result for a PACKED batch."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


#: ``_next_samples``' answer when the replica has no (full) batch left.
_END = object()


def _map_samples(dataset: Any, indices: Any) -> Any:
    """A map-style dataset's samples of one batch, as torch's ``_MapDatasetFetcher``:
    ``dataset.__getitems__(indices)`` when the dataset has it, else one
    ``dataset[i]`` per index."""
    getitems = getattr(dataset, "__getitems__", None)
    return getitems(indices) if getitems else [dataset[i] for i in indices]
