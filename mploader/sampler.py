"""Index samplers: which dataset items a loader reads, and in which order.

These are the samplers of MXNet Gluon 1.8 (``mxnet.gluon.data.sampler``) plus
``mxnet.gluon.contrib.data.IntervalSampler``, re-implemented without MXNet.
Every sampler is re-iterable: each call to ``iter()`` starts a new pass over
the indices, and ``len()`` gives the number of items the next pass yields.

Indices are yielded as Python ``int`` (Gluon's ``RandomSampler`` yields
``numpy.int64``; the values are the same).

The one extension over Gluon is the optional ``seed`` of :class:`RandomSampler`,
which makes every epoch's permutation a pure function of ``(seed, epoch)`` so
that a run can be reproduced, or resumed at a given epoch, independently of
any other use of NumPy's global random state.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import numpy as np

from . import _state
from ._options import check_callable, check_choice, check_int

__all__ = [
    "Sampler",
    "SequentialSampler",
    "RandomSampler",
    "BatchSampler",
    "FilterSampler",
    "IntervalSampler",
]

_LAST_BATCH_CHOICES = ("keep", "discard", "rollover")




#: Longest permutation :func:`seeded_permutation` keeps (8 MiB of int64 each): beyond it
#: the permutation itself costs milliseconds, and the seeding it spares is noise.
KEEP_PERMUTATION_MAX = 1 << 20


def seeded_permutation(seed: int, epoch: int, length: int) -> np.ndarray:
    """``numpy.random.default_rng([seed, epoch]).permutation(length)``: ndarray of shape
    ``(length,)``, dtype int64, read-only.  The last two of at most
    :data:`KEEP_PERMUTATION_MAX` indices are kept: a loader that stages the next epoch
    draws its order from a copy of the sampler ahead of time, and the real pass then
    takes the same array instead of seeding again (seeding costs ~130 us with cold
    caches, more than the rest of an epoch's start; docs/design.md, "No gap between
    epochs")."""
    if length <= KEEP_PERMUTATION_MAX:
        return _kept_permutation(seed, epoch, length)
    return _permutation(seed, epoch, length)


def _permutation(seed: int, epoch: int, length: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(length)
    order.flags.writeable = False
    return order


_kept_permutation = functools.lru_cache(maxsize=2)(_permutation)

class Sampler:
    """Base class for samplers, as ``mxnet.gluon.data.Sampler``.

    Subclasses define ``__iter__`` (one pass over the indices; every call
    starts a new pass) and ``__len__`` (the number of items the next pass
    yields).

    Raises
    ------
    NotImplementedError
        From ``__iter__`` and ``__len__`` of the base class itself.
    """

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError(
            f"{type(self).__name__} must implement __iter__"
        )

    def __len__(self) -> int:
        raise NotImplementedError(
            f"{type(self).__name__} must implement __len__"
        )


class SequentialSampler(Sampler):
    """Yield ``start, start + 1, ..., start + length - 1`` in order.

    As ``mxnet.gluon.data.SequentialSampler`` (Gluon 1.8, with ``start``).

    Parameters
    ----------
    length : int
        Number of indices per pass; ``>= 0``.
    start : int, default 0
        First index.

    Raises
    ------
    TypeError
        If ``length`` or ``start`` is not an int.
    ValueError
        If ``length`` is negative.

    Examples
    --------
    >>> list(SequentialSampler(4, start=2))
    [2, 3, 4, 5]
    """

    def __init__(self, length: int, start: int = 0) -> None:
        self._length = check_int("length", length, minimum=0)
        self._start = check_int("start", start)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._start, self._start + self._length))

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return f"SequentialSampler(length={self._length}, start={self._start})"


class RandomSampler(Sampler):
    """Yield a random permutation of ``range(length)`` on every pass.

    As ``mxnet.gluon.data.RandomSampler``, plus an optional ``seed``.

    Where the randomness comes from:

    * ``seed=None`` (Gluon's behaviour): each pass shuffles
      ``numpy.arange(length)`` with ``numpy.random.shuffle``, i.e. it draws
      from, and advances, NumPy's global random state. ``numpy.random.seed``
      therefore controls it, exactly as it does in Gluon.
    * ``seed=<int>`` (mploader extension): the pass for epoch ``k`` is
      ``numpy.random.default_rng([seed, k]).permutation(length)``. It does not
      touch the global random state, and the order of epoch ``k`` depends on
      nothing but ``(seed, k, length)``. Epochs are counted by calls to
      ``iter()``: the first pass is epoch 0, the next epoch 1, and so on.
      :meth:`set_epoch` moves the counter, e.g. to resume a run at epoch 7.

    The permutation is drawn when ``iter()`` is called (not lazily at the
    first ``next()``), so calling ``iter()`` consumes an epoch even if the
    pass is abandoned.

    Parameters
    ----------
    length : int
        Number of indices per pass; ``>= 0``.
    seed : int or None, default None
        ``None`` for NumPy's global random state, or a non-negative int.

    Raises
    ------
    TypeError
        If ``length`` or ``seed`` is not an int (or ``None`` for ``seed``).
    ValueError
        If ``length`` or ``seed`` is negative.

    Examples
    --------
    >>> s = RandomSampler(5, seed=42)
    >>> first, second = list(s), list(s)          # epochs 0 and 1
    >>> s.set_epoch(0)
    >>> list(s) == first                          # epoch 0 again
    True
    """

    def __init__(self, length: int, seed: int | None = None) -> None:
        self._length = check_int("length", length, minimum=0)
        self._seed = check_int("seed", seed, minimum=0, none_ok=True)
        self._epoch = 0

    @property
    def seed(self) -> int | None:
        """int or None: the seed given at construction."""
        return self._seed

    @property
    def epoch(self) -> int:
        """int: the epoch number the next pass (next ``iter()``) will use."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use epoch ``epoch``; later passes count on from it.

        With ``seed=None`` this only moves the counter reported by
        :attr:`epoch`; the order still comes from NumPy's global state.

        Parameters
        ----------
        epoch : int
            Non-negative epoch number.

        Raises
        ------
        TypeError
            If ``epoch`` is not an int.
        ValueError
            If ``epoch`` is negative.
        """
        self._epoch = check_int("epoch", epoch, minimum=0)

    def state_dict(self) -> dict:
        """The checkpoint state ``{"version": 1, "kind": "RandomSampler", "length",
        "seed", "epoch"}`` (JSON-safe): the next pass is the permutation of
        ``(seed, epoch)``.

        Raises
        ------
        ValueError
            ``seed=None``: the order comes from NumPy's global random state, which a
            checkpoint cannot rebuild (give the sampler a seed to resume it).
        """
        if self._seed is None:
            raise ValueError("RandomSampler(seed=None) draws its order from NumPy's global random state, which a "
                             "checkpoint cannot rebuild: pass seed=<int> to save and resume it")
        return self._state_from_token((self._epoch, self._seed))

    def _state_token(self) -> tuple | None:
        """(mploader._state.peek) What :meth:`state_dict` is a function of now: the
        epoch and the seed (:meth:`load_state_dict` may change it later); None without
        a seed (no state) or for a subclass."""
        return (self._epoch, self._seed) if type(self) is RandomSampler and self._seed is not None else None

    def _state_from_token(self, token: tuple) -> dict:
        return {"version": _state.VERSION, "kind": "RandomSampler", "length": self._length, "seed": token[1],
                "epoch": token[0]}

    def load_state_dict(self, state: dict) -> None:
        """Adopt a :meth:`state_dict`: its seed and the epoch of the next pass.

        Raises
        ------
        mploader._state.StateMismatchError
            Another version or kind, or another ``length`` (both values printed).
        """
        _state.check_state(state, "RandomSampler", "sampler")
        _state.check_same("length", state.get("length"), self._length, "sampler")
        self._seed = check_int("seed", state.get("seed"), minimum=0)
        self._epoch = check_int("epoch", state.get("epoch"), minimum=0)

    def __iter__(self) -> Iterator[int]:
        epoch = self._epoch
        self._epoch = epoch + 1
        if self._seed is None:
            indices = np.arange(self._length)
            np.random.shuffle(indices)
        else:
            indices = seeded_permutation(self._seed, epoch, self._length)
        return iter(indices.tolist())

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return (
            f"RandomSampler(length={self._length}, seed={self._seed}, "
            f"epoch={self._epoch})"
        )


class BatchSampler(Sampler):
    """Group the indices of another sampler into lists of ``batch_size``.

    As ``mxnet.gluon.data.BatchSampler`` (Gluon 1.8). When ``batch_size`` does
    not divide the number of indices of a pass, ``last_batch`` decides what
    happens to the incomplete final batch:

    * ``'keep'``: yield it as a shorter batch.
      ``len == ceil(len(sampler) / batch_size)``.
    * ``'discard'``: drop it. ``len == len(sampler) // batch_size``.
    * ``'rollover'``: keep it back and put it at the front of the next pass,
      which fills it up with its first indices. ``len`` counts the carried
      indices: ``(n_carried + len(sampler)) // batch_size``. For example with
      10,000 indices and ``batch_size=31`` the first pass yields 322 batches and
      carries 18 indices, the second yields ``(18 + 10000) // 31 == 323`` and
      carries 5, and so on.

    Like Gluon's, ``__iter__`` is a generator: the carried remainder is taken
    over when the pass starts (first ``next()``), and a pass abandoned before
    its end carries nothing into the next one.

    Parameters
    ----------
    sampler : Sampler or sized iterable
        Source of indices; re-iterated on every pass.
    batch_size : int
        Indices per batch; ``>= 1``.
    last_batch : {'keep', 'discard', 'rollover'}, default 'keep'
        What to do with an incomplete final batch.

    Yields
    ------
    list of int
        One batch of indices, ``batch_size`` long except possibly the last
        one with ``last_batch='keep'``.

    Raises
    ------
    TypeError
        If ``batch_size`` is not an int.
    ValueError
        If ``batch_size < 1`` or ``last_batch`` is not one of the three values.

    Examples
    --------
    >>> list(BatchSampler(SequentialSampler(10), 3, 'keep'))
    [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    >>> b = BatchSampler(SequentialSampler(10), 3, 'rollover')
    >>> list(b), list(b)
    ([[0, 1, 2], [3, 4, 5], [6, 7, 8]], [[9, 0, 1], [2, 3, 4], [5, 6, 7]])
    """

    def __init__(
        self, sampler: Any, batch_size: int, last_batch: str = "keep"
    ) -> None:
        self._batch_size = check_int("batch_size", batch_size, minimum=1)
        check_choice("last_batch", last_batch, _LAST_BATCH_CHOICES)
        self._sampler = sampler
        self._last_batch = last_batch
        self._prev: list[Any] = []

    @property
    def batch_size(self) -> int:
        """int: indices per full batch."""
        return self._batch_size

    @property
    def last_batch(self) -> str:
        """str: ``'keep'``, ``'discard'`` or ``'rollover'``."""
        return self._last_batch

    def __iter__(self) -> Iterator[list[Any]]:
        batch, self._prev = self._prev, []
        size = self._batch_size
        indices = iter(self._sampler)
        # Each batch's indices pulled in C (islice), as many as one at a time would
        # pull before the yield: 256 indices cost ~2 µs instead of ~25 µs of appends.
        while True:
            batch.extend(islice(indices, size - len(batch)))
            if len(batch) < size:
                break
            yield batch
            batch = []
        if batch:
            if self._last_batch == "keep":
                yield batch
            elif self._last_batch == "rollover":
                self._prev = batch
            # 'discard': drop it

    def state_dict(self) -> dict:
        """The checkpoint state (JSON-safe when the sampler's is): ``{"version": 1,
        "kind": "BatchSampler", "batch_size", "last_batch", "sampler_type",
        "carry"`` (the indices ``'rollover'`` carries into the next pass) ``,
        "sampler"`` (the sampler's ``state_dict()``, or None when it has none)``}``.
        Taken between passes, it rebuilds the next pass."""
        return self._make_state(list(self._prev), _state.save(self._sampler))

    def _make_state(self, carry: list, sampler_state: Any) -> dict:
        return {"version": _state.VERSION, "kind": "BatchSampler", "batch_size": self._batch_size,
                "last_batch": self._last_batch, "sampler_type": _state.type_name(self._sampler),
                "carry": carry, "sampler": sampler_state}

    #: (mploader._state.Snapshots) Where :meth:`_state_token` gives a token, the state
    #: moves only as a pass begins (the carry taken, the sampler's epoch counted) and
    #: after its last batch (the new carry): never between two pulls.
    _state_tokens_per_pass = True

    def _state_token(self) -> tuple | None:
        """(mploader._state.peek) What :meth:`state_dict` is a function of now -- the
        carry and the sampler's token (``()``: a :class:`SequentialSampler`, which has
        no state) -- for exactly this class over a :class:`SequentialSampler` or a
        seeded :class:`RandomSampler`; None otherwise."""
        if type(self) is not BatchSampler:
            return None
        inner = self._sampler
        if type(inner) is SequentialSampler:
            return tuple(self._prev), ()
        token = inner._state_token() if type(inner) is RandomSampler else None
        return (tuple(self._prev), token) if token is not None else None

    def _state_from_token(self, token: tuple) -> dict:
        carry, inner = token
        return self._make_state(list(carry), self._sampler._state_from_token(inner) if inner else None)

    def load_state_dict(self, state: dict) -> None:
        """Adopt a :meth:`state_dict`: the carried indices and the sampler's state.

        Raises
        ------
        mploader._state.StateMismatchError
            Another version or kind, ``batch_size``, ``last_batch`` or sampler type
            (both values printed), a sampler state for a sampler without
            ``load_state_dict``, or a ``carry`` that no pass of this batch sampler
            leaves: not a list of the sampler's indices, ``batch_size`` or more of
            them, or any with ``last_batch`` other than ``'rollover'``.
        """
        _state.check_state(state, "BatchSampler", "batch sampler")
        for name, here in (("batch_size", self._batch_size), ("last_batch", self._last_batch),
                           ("sampler_type", _state.type_name(self._sampler))):
            _state.check_same(name, state.get(name), here, "batch sampler")
        carry = state.get("carry", [])
        if not isinstance(carry, list):
            raise _state.StateMismatchError(f"cannot load the state: carry must be a list of indices, got "
                                            f"{carry!r:.80}")
        if isinstance(self._sampler, (SequentialSampler, RandomSampler)) and not all(
                type(i) is int and 0 <= i < len(self._sampler) for i in carry):
            raise _state.StateMismatchError(f"cannot load the state: carry must hold indices of the sampler, ints "
                                            f"in [0, {len(self._sampler) - 1}], got {carry!r:.80}")
        carry = list(carry)
        if carry and self._last_batch != "rollover":   # only 'rollover' carries indices into a pass
            raise _state.StateMismatchError(f"cannot load the state: carry must be empty with last_batch="
                                            f"{self._last_batch!r} (only 'rollover' carries indices), got "
                                            f"{carry!r:.80}")
        if len(carry) >= self._batch_size:
            raise _state.StateMismatchError(f"cannot load the state: carry must hold fewer than batch_size="
                                            f"{self._batch_size} indices, got {len(carry)}")
        _state.restore(self._sampler, state.get("sampler"), "sampler")
        self._prev = carry

    def _next_pass(self) -> Iterator[list[Any]] | None:
        """The batches the next pass will yield, drawn from copies (nothing of this
        sampler, of its sampler or of any global random state changes), where they
        are fixed now: over a :class:`SequentialSampler` or a seeded
        :class:`RandomSampler` (exactly those types); None otherwise."""
        sampler = self._sampler
        if type(sampler) is RandomSampler and sampler.seed is not None:
            sampler = copy.copy(sampler)   # (its epoch moves with the copy's pass only)
        elif type(sampler) is not SequentialSampler:
            return None
        ahead = BatchSampler(sampler, self._batch_size, self._last_batch)
        ahead._prev = list(self._prev)
        return iter(ahead)

    def __len__(self) -> int:
        n = len(self._sampler)
        if self._last_batch == "keep":
            return (n + self._batch_size - 1) // self._batch_size
        if self._last_batch == "discard":
            return n // self._batch_size
        return (len(self._prev) + n) // self._batch_size

    def __repr__(self) -> str:
        return (
            f"BatchSampler({self._sampler!r}, batch_size={self._batch_size}, "
            f"last_batch={self._last_batch!r})"
        )


def next_pass(batch_sampler: Any) -> Iterator[list[Any]] | None:
    """The index lists the next pass of ``batch_sampler`` will yield, where they are
    fixed now and can be drawn without changing anything (the sampler, its epoch,
    NumPy's or torch's global random state): mploader's :class:`BatchSampler` over a
    :class:`SequentialSampler` or a seeded :class:`RandomSampler`, and
    :class:`~mploader.DistributedBatchSampler` (its next epoch, as ``set_epoch(epoch
    + 1)`` makes it).  None for any other sampler, subclasses included.  A guess a
    loader verifies: it dispatches these batches ahead (docs/design.md, "No gap
    between epochs") and uses them only if the real pass asks for the same."""
    from .distributed import DistributedBatchSampler

    if type(batch_sampler) in (BatchSampler, DistributedBatchSampler):
        return batch_sampler._next_pass()
    return None


class FilterSampler(Sampler):
    """Yield, in order, the indices ``i`` for which ``fn(dataset[i])`` is true.

    As ``mxnet.gluon.data.FilterSampler``: the predicate is evaluated once,
    over the whole dataset, at construction; every pass yields the same
    indices.

    Parameters
    ----------
    fn : callable
        ``fn(sample) -> bool``.
    dataset : sized, indexable
        Anything with ``len()`` and ``dataset[i]`` for ``0 <= i < len``.

    Raises
    ------
    TypeError
        If ``fn`` is not callable.
    Exception
        Whatever ``fn`` or ``dataset[i]`` raises, unchanged.

    Examples
    --------
    >>> list(FilterSampler(lambda x: x % 2 == 0, [5, 6, 7, 8]))
    [1, 3]
    """

    def __init__(self, fn: Callable[[Any], Any], dataset: Any) -> None:
        check_callable("fn", fn)
        self._fn = fn
        self._dataset = dataset
        self._indices = [i for i in range(len(dataset)) if fn(dataset[i])]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)

    def __repr__(self) -> str:
        return f"FilterSampler(fn={self._fn!r}, {len(self._indices)} indices)"


class IntervalSampler(Sampler):
    """Yield ``range(length)`` in strides of ``interval``.

    As ``mxnet.gluon.contrib.data.IntervalSampler``: first
    ``0, interval, 2*interval, ...``; with ``rollover=True`` then
    ``1, 1 + interval, ...``, and so on up to offset ``interval - 1``, so every
    index is visited exactly once. With ``rollover=False`` only the first
    stride is yielded, yet ``len()`` is still ``length`` (as in Gluon).

    Parameters
    ----------
    length : int
        Number of indices; must be greater than ``interval``.
    interval : int
        Stride; ``>= 1``.
    rollover : bool, default True
        Whether to continue from the next offset after reaching the end.

    Raises
    ------
    TypeError
        If ``length`` or ``interval`` is not an int.
    ValueError
        If ``interval < 1`` or ``interval >= length`` (Gluon asserts the latter).

    Examples
    --------
    >>> list(IntervalSampler(13, interval=3))
    [0, 3, 6, 9, 12, 1, 4, 7, 10, 2, 5, 8, 11]
    >>> list(IntervalSampler(13, interval=3, rollover=False))
    [0, 3, 6, 9, 12]
    """

    def __init__(self, length: int, interval: int, rollover: bool = True) -> None:
        self._length = check_int("length", length, minimum=0)
        self._interval = check_int("interval", interval, minimum=1)
        if self._interval >= self._length:
            raise ValueError(
                f"interval must be smaller than length, got interval={self._interval}, "
                f"length={self._length}"
            )
        self._rollover = bool(rollover)

    def __iter__(self) -> Iterator[int]:
        n_offsets = self._interval if self._rollover else 1
        for offset in range(n_offsets):
            yield from range(offset, self._length, self._interval)

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return (
            f"IntervalSampler(length={self._length}, interval={self._interval}, "
            f"rollover={self._rollover})"
        )
