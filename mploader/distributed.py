"""``mploader.DistributedBatchSampler``: data-parallel batches whose order does not
depend on the number of ranks, so a checkpoint resumes on any number of them.

torch's ``DistributedSampler`` deals sample ``i`` of the epoch's order to rank
``i % world_size``: the split depends on the world size, and it cannot resume
mid-epoch.  Here the epoch is a sequence of *global* batches of
``global_batch_size`` indices, a function of ``(seed, epoch)`` only; every rank
takes its contiguous share of each global batch.  The position is the number of
global batches consumed, the same on every rank, so a run checkpointed after ``k``
global batches with ``W`` ranks resumes with any ``W'`` dividing
``global_batch_size`` and consumes exactly the samples of the epoch not yet seen,
each once, in the same global-batch order as an uninterrupted run.
"""
from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _state
from ._options import check_int
from .sampler import seeded_permutation

__all__ = ["DistributedBatchSampler"]

_KIND = "DistributedBatchSampler"


def _default_rank_world() -> tuple[int, int]:
    """``torch.distributed``'s (rank, world size) when it is initialised, else (0, 1).
    torch is not imported for this: a process group exists only if it already is."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


class DistributedBatchSampler:
    """Yields this rank's share of every global batch of an epoch.

    Epoch ``e``'s order is ``numpy.random.default_rng([seed, e]).permutation(length)``
    (``range(length)`` without ``shuffle``); global batch ``j`` is
    ``order[j * global_batch_size:(j + 1) * global_batch_size]``, and rank ``r`` of
    ``world_size`` gets the slice ``[r * b, (r + 1) * b)`` of it, ``b =
    global_batch_size // world_size``.  With ``drop_last=False`` an incomplete last
    global batch is filled up with indices from the start of the order (as torch's
    ``DistributedSampler`` pads), so those samples are seen twice in that epoch.

    Use it as a batch sampler: ``mploader.DataLoader(dataset,
    batch_sampler=DistributedBatchSampler(len(dataset), 256))`` (or
    ``mploader.torch.DataLoader``, ``torch.utils.data.DataLoader``).  Call
    :meth:`set_epoch` before each epoch, as with ``DistributedSampler``: a pass
    without it repeats the epoch.

    Parameters
    ----------
    length : int
        Samples in the dataset, >= 0.
    global_batch_size : int
        Indices per global batch (all ranks together), >= 1; a multiple of
        ``world_size``.
    shuffle : bool
        Permute the samples every epoch (from ``(seed, epoch)``).
    seed : int
        Non-negative; the same on every rank.
    drop_last : bool
        Drop an incomplete last global batch (True) or pad it (False).
    rank, world_size : int, optional
        This process's rank and the number of ranks; default ``torch.distributed``'s
        when a process group is initialised, else 0 and 1.

    Raises
    ------
    TypeError
        An integer argument is not an int.
    ValueError
        A value out of range, ``rank >= world_size``, or ``world_size`` does not
        divide ``global_batch_size`` (the message names both values).

    Notes
    -----
    :meth:`state_dict` is ``(epoch, global batches consumed)`` plus the
    configuration, with no rank or world size: every rank of a new run may load the
    state rank 0 of the old run saved.  Inside an mploader loader, save the
    *loader's* ``state_dict()`` (it counts the batches the user received; this
    sampler's own count runs ahead by the batches in flight).
    """

    def __init__(self, length: int, global_batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, rank: int | None = None, world_size: int | None = None) -> None:
        self._length = check_int("length", length, minimum=0)
        self._global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
        self._seed = check_int("seed", seed, minimum=0)
        self._shuffle = bool(shuffle)
        self._drop_last = bool(drop_last)
        default_rank, default_world = _default_rank_world() if rank is None or world_size is None else (0, 1)
        self._world_size = check_int("world_size", default_world if world_size is None else world_size, minimum=1)
        self._rank = check_int("rank", default_rank if rank is None else rank, minimum=0)
        if self._rank >= self._world_size:
            raise ValueError(f"rank must be smaller than world_size, got rank={self._rank}, "
                             f"world_size={self._world_size}")
        if self._global_batch_size % self._world_size:
            raise ValueError(f"global_batch_size must be a multiple of world_size, got global_batch_size="
                             f"{self._global_batch_size}, world_size={self._world_size}")
        self._epoch = 0
        self._start = 0   # global batch the next pass starts at (load_state_dict)
        self._pass: Any = lambda: None   # weak reference to the pass in progress

    # ---- configuration ----

    @property
    def rank(self) -> int:
        """int: this process's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """int: the number of ranks."""
        return self._world_size

    @property
    def global_batch_size(self) -> int:
        """int: indices per global batch."""
        return self._global_batch_size

    @property
    def batch_size(self) -> int:
        """int: indices per batch of this rank, ``global_batch_size // world_size``."""
        return self._global_batch_size // self._world_size

    @property
    def epoch(self) -> int:
        """int: the epoch of the next pass."""
        return self._epoch

    @property
    def num_global_batches(self) -> int:
        """int: global batches per epoch."""
        n, g = self._length, self._global_batch_size
        return n // g if self._drop_last else -(-n // g)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch``, from its first global batch.

        Raises
        ------
        TypeError, ValueError
            ``epoch`` is not a non-negative int.
        """
        self._epoch = check_int("epoch", epoch, minimum=0)
        self._start = 0
        self._pass = lambda: None

    def __len__(self) -> int:
        """Batches of a whole epoch (``num_global_batches``)."""
        return self.num_global_batches

    # ---- the order ----

    def global_order(self, epoch: int) -> np.ndarray:
        """ndarray of shape (num_global_batches * global_batch_size,), dtype int64: the
        epoch's global order, padded (``drop_last=False``) or truncated (True) to whole
        global batches.  A function of ``(seed, epoch)`` only.  Read-only when it is the
        permutation itself (shared with :func:`mploader.sampler.seeded_permutation`'s
        cache): copy it to change it."""
        n = self._length
        if self._shuffle:
            order = seeded_permutation(self._seed, epoch, n)   # read-only, shared: never written
        else:
            order = np.arange(n, dtype=np.int64)
        total = self.num_global_batches * self._global_batch_size
        if total <= n:
            return order[:total]
        return np.resize(order, total)   # repeats the order from its start (padding)

    def __iter__(self) -> _Pass:
        it = _Pass(self, self._epoch, self._start)
        self._start = 0
        self._pass = weakref.ref(it)
        return it

    def _next_pass(self) -> _Pass | None:
        """The pass of epoch ``epoch + 1`` from its start, as ``set_epoch(epoch + 1)``
        then ``iter()`` would make it, detached from this sampler (nothing here
        changes); None while a loaded state positions the next pass
        (:func:`mploader.sampler.next_pass`: a guess the loader verifies)."""
        if self._start:
            return None
        return _Pass(self, self._epoch + 1, 0)

    # ---- checkpoints ----

    def _config(self) -> dict:
        return {"length": self._length, "global_batch_size": self._global_batch_size, "shuffle": self._shuffle,
                "seed": self._seed, "drop_last": self._drop_last}

    def _check(self, state: Any) -> tuple[int, int]:
        _state.check_state(state, _KIND, "sampler")
        for name, here in self._config().items():
            _state.check_same(name, state.get(name), here, "sampler")
        epoch = check_int("epoch", state.get("epoch"), minimum=0)
        consumed = check_int("global_batches_consumed", state.get("global_batches_consumed"), minimum=0,
                             maximum=self.num_global_batches)
        return epoch, consumed

    def _make_state(self, epoch: int, consumed: int) -> dict:
        return {"version": _state.VERSION, "kind": _KIND, **self._config(), "epoch": epoch,
                "global_batches_consumed": consumed}

    def state_dict(self) -> dict:
        """``{"version": 1, "kind": "DistributedBatchSampler", "length",
        "global_batch_size", "shuffle", "seed", "drop_last", "epoch",
        "global_batches_consumed"}`` (JSON-safe, rank-independent): the pass in
        progress and the global batches it has yielded, or, between passes, where
        the next pass starts."""
        current = self._pass()
        if current is not None and not current.exhausted:
            return current.state_dict()
        return self._make_state(self._epoch, self._start)

    def _state_token(self) -> tuple | None:
        """(mploader._state.peek) What :meth:`state_dict` is a function of now: the
        epoch and the global batches consumed; None for a subclass."""
        if type(self) is not DistributedBatchSampler:
            return None
        current = self._pass()
        if current is not None and not current.exhausted:
            return current.epoch, current.position
        return self._epoch, self._start

    def _state_from_token(self, token: tuple) -> dict:
        return self._make_state(*token)

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass continue the saved epoch after its consumed global batches.

        Raises
        ------
        mploader._state.StateMismatchError
            (a ValueError) Another version or kind, or another ``length``,
            ``global_batch_size``, ``shuffle``, ``seed`` or ``drop_last`` (both values
            printed).  ``rank`` and ``world_size`` may differ.
        ValueError
            ``global_batches_consumed`` beyond the epoch.
        """
        self._epoch, self._start = self._check(state)
        self._pass = lambda: None

    def __repr__(self) -> str:
        return (f"DistributedBatchSampler(length={self._length}, global_batch_size={self._global_batch_size}, "
                f"shuffle={self._shuffle}, seed={self._seed}, drop_last={self._drop_last}, rank={self._rank}, "
                f"world_size={self._world_size})")


class _Pass(Iterator[list]):
    """One pass of a :class:`DistributedBatchSampler`: yields this rank's share (a list
    of ``batch_size`` ints) of global batches ``position, position + 1, ...``.  Has
    its own ``state_dict`` / ``load_state_dict`` (the same format as the sampler's)."""

    def __init__(self, sampler: DistributedBatchSampler, epoch: int, position: int) -> None:
        self._sampler = sampler
        self.epoch = epoch
        self.position = position
        self.exhausted = False
        self._order: np.ndarray | None = None

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> list:
        s = self._sampler
        if self.position >= s.num_global_batches:
            self.exhausted = True
            raise StopIteration
        if self._order is None:
            self._order = s.global_order(self.epoch)
        g, b = s.global_batch_size, s.batch_size
        start = self.position * g + s.rank * b
        self.position += 1
        return self._order[start:start + b].tolist()

    def __len__(self) -> int:
        return max(self._sampler.num_global_batches - self.position, 0)

    def state_dict(self) -> dict:
        """The sampler's state format: this pass's epoch and global batches yielded."""
        return self._sampler._make_state(self.epoch, self.position)

    def _state_token(self) -> tuple | None:
        """(mploader._state.peek) The epoch and the global batches yielded."""
        return (self.epoch, self.position) if type(self._sampler) is DistributedBatchSampler else None

    def _state_from_token(self, token: tuple) -> dict:
        return self._sampler._make_state(*token)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state (any rank's, any world size).

        Raises
        ------
        mploader._state.StateMismatchError
            As :meth:`DistributedBatchSampler.load_state_dict`.
        """
        epoch, self.position = self._sampler._check(state)
        if epoch != self.epoch:
            self.epoch, self._order = epoch, None
        self.exhausted = False
