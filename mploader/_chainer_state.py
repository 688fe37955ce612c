"""Chainer's iteration state machine, for :mod:`mploader.iterators`.

The order samplers (public, re-exported by :mod:`mploader.iterators`), the state
``(current_position, epoch, is_new_epoch, order)`` of Chainer 7.8.1's iterators, one
batch step of the state machine (:func:`advance`) and the planner that runs it ahead
of the caller to make engine tasks (:func:`plan`).
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, cast

import numpy as np

__all__ = ["OrderSampler", "ShuffleOrderSampler"]


class OrderSampler:
    """Base class of order samplers, as ``chainer.iterators.OrderSampler``.

    An order sampler is called by the iterator when it starts (and at every
    ``reset()``) and whenever an epoch ends; it returns the order of the next epoch.
    """

    def __call__(self, current_order: np.ndarray, current_position: int) -> np.ndarray:
        """Return the next order.

        Parameters
        ----------
        current_order : ndarray of shape (N,), integer dtype
            The order of the epoch that just ended (``arange(len(dataset))`` at
            start/reset).  The iterator passes a copy; modifying it is harmless.
        current_position : int
            Where the iterator stood in that order when the epoch ended.

        Returns
        -------
        ndarray of shape (N,)
            Dataset indices in the order of the next epoch; N must stay constant.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")


class ShuffleOrderSampler(OrderSampler):
    """Random orders, as ``chainer.iterators.ShuffleOrderSampler``.

    Parameters
    ----------
    random_state : numpy.random.RandomState, optional
        Source of the permutations; default NumPy's global RandomState, so
        ``numpy.random.seed`` controls the orders exactly as it does in Chainer.
    """

    def __init__(self, random_state: Any = None) -> None:
        if random_state is None:
            random_state = cast(Any, np.random.random).__self__  # the global RandomState
        self._random = random_state

    def __call__(self, current_order: np.ndarray, current_position: int) -> np.ndarray:
        return self._random.permutation(len(current_order))


class State(NamedTuple):
    """Where iteration stands: as Chainer's ``IteratorState``."""

    current_position: int
    epoch: int
    is_new_epoch: bool
    order: np.ndarray | None


def _span(order: np.ndarray | None, start: int, stop: int) -> np.ndarray:
    if order is None:
        return np.arange(start, stop, dtype=np.intp)
    return np.array(order[start:stop])


def advance(state: State, batch_size: int, repeat: bool, order_sampler: Callable | None,
             dataset_len: int) -> tuple[State, np.ndarray | None]:
    """One batch of Chainer's iterator state machine.

    Returns the state after the batch and the batch's dataset indices, or
    ``(state, None)`` once a non-repeating iterator has finished its epoch.  A
    batch that reaches the end of the epoch calls ``order_sampler(order, position)``
    for the next order and, with ``repeat``, is completed from that order; a batch
    larger than the epoch wraps around as many times as needed.

    Raises
    ------
    ValueError
        A repeating iterator over an empty epoch, or an order sampler that changed
        the length of the order.
    """
    pos, epoch, _, order = state
    if not repeat and epoch > 0:
        return state, None
    n = dataset_len if order is None else len(order)
    if repeat and n == 0:
        raise ValueError("the epoch size must be positive for an iterator with repeat=True, got an empty "
                         + ("dataset" if order is None else "order"))
    end = pos + batch_size
    is_new_epoch = False
    parts = []
    while end >= n:
        parts.append(_span(order, pos, n))
        if order is not None:
            assert order_sampler is not None  # an order exists only with an order sampler
            new_order = np.asarray(order_sampler(order.copy(), pos))
            if len(new_order) != len(order):
                raise ValueError(f"order_sampler returned an order of size {len(new_order)}, expected "
                                 f"{len(order)}: the size of the order must not change between epochs")
            order = new_order
        epoch += 1
        is_new_epoch = True
        pos = 0
        if not repeat:
            end = 0
            break
        end -= n
    parts.append(_span(order, pos, end))
    return State(end, epoch, is_new_epoch, order), np.concatenate(parts)


def plan(state: State, batch_size: int, repeat: bool, order_sampler: Callable | None, dataset_len: int,
          states: collections.deque, failure: list) -> Iterator[tuple]:
    """Engine tasks from ``state`` on; queues the state after each task in ``states``.

    A task is ``(epoch, position, indices)`` of the batch's first example, so a
    batch's worker seed depends only on where it starts.  An exception raised by
    the state machine (order sampler) ends the plan and is kept in ``failure``; the
    iterator raises it when the caller reaches that batch, not earlier.
    """
    while True:
        try:
            new_state, indices = advance(state, batch_size, repeat, order_sampler, dataset_len)
        except Exception as exc:  # noqa: BLE001 - re-raised by MultiprocessIterator.__next__
            failure.append(exc)
            return
        if indices is None:
            return
        states.append(new_state)
        yield state.epoch, state.current_position, indices.tolist()
        state = new_state
