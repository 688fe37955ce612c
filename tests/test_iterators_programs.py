"""mploader.MultiprocessIterator under random programs of steps -- ``next()``, ``reset()``,
a snapshot through ``serialize`` into a new iterator with another ``n_processes`` --
against a reference written from Chainer 7.8.1's source
(``chainer/iterators/_statemachine.py``'s ``iterator_statemachine`` and
``MultiprocessIterator``'s properties), step by step: every batch, ``epoch``,
``is_new_epoch``, ``epoch_detail``, ``previous_epoch_detail`` and ``current_position``.
Hypothesis draws the programs (a fixed seed in the suite's default profile;
``MPLOADER_HYPOTHESIS=explore MPLOADER_PROGRAMS=300`` explores more, with ``-o timeout=0``).
"""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest
from _util import DictDeserializer, DictSerializer
from hypothesis import given, settings
from hypothesis import strategies as st

from mploader import MultiprocessIterator


class Shuffle:
    """An order sampler: a permutation from its own NumPy RandomState, as Chainer's
    ``ShuffleOrderSampler`` (two with the same seed give the same orders)."""

    def __init__(self, seed: int) -> None:
        self.random = np.random.RandomState(seed)

    def __call__(self, order: np.ndarray, position: int) -> np.ndarray:
        return self.random.permutation(len(order))


class Reference:
    """Chainer 7.8.1's iterator state machine, written from its source: a batch takes
    ``batch_size`` indices from the current position; at the end of the order the
    epoch advances, ``is_new_epoch`` is set, the position returns to 0 and the order
    sampler gives the next order (``order_sampler(order, 0)``), and with ``repeat``
    the batch goes on in it; without ``repeat`` the batch ends there and later calls
    raise StopIteration.  ``previous_epoch_detail`` is ``epoch_detail`` before the
    last ``next()``, one that raised StopIteration included (None before the first)."""

    def __init__(self, n: int, batch_size: int, repeat: bool, seed: int | None) -> None:
        self.n, self.batch_size, self.repeat = n, batch_size, repeat
        self.order_sampler = Shuffle(seed) if seed is not None else None   # None: shuffle=False, no order
        self.reset()

    def reset(self) -> None:
        self.position, self.epoch, self.is_new_epoch = 0, 0, False
        self.order = self.order_sampler(np.arange(self.n), 0) if self.order_sampler else np.arange(self.n)
        self.previous = -1.0

    @property
    def epoch_detail(self) -> float:
        return self.epoch + self.position / len(self.order)

    def next(self) -> list:
        self.previous = self.epoch_detail   # (before the end's StopIteration too, as Chainer's __next__)
        if not self.repeat and self.epoch > 0:
            raise StopIteration
        i, epoch, order, left = self.position, self.epoch, self.order, self.batch_size
        taken = []
        self.is_new_epoch = False
        while left > 0:
            k = min(left, len(order) - i)
            taken += [int(x) for x in order[i:i + k]]
            left -= k
            i += k
            if i == len(order):
                epoch += 1
                self.is_new_epoch = True
                i = 0
                if not self.repeat:
                    break
                if self.order_sampler is not None:
                    new = self.order_sampler(order, i)
                    assert len(new) == len(order)
                    order = new
        self.position, self.epoch, self.order = i, epoch, order
        return taken


def _view(it) -> tuple:
    """What a user reads of an iterator's progress."""
    previous = it.previous_epoch_detail
    return (it.epoch, it.is_new_epoch, round(it.epoch_detail, 9), None if previous is None else round(previous, 9),
            it.current_position)


def _ref_view(ref: Reference) -> tuple:
    previous = None if ref.previous < 0 else round(ref.previous, 9)
    return ref.epoch, ref.is_new_epoch, round(ref.epoch_detail, 9), previous, ref.position


STEPS = st.one_of(st.tuples(st.just("next"), st.integers(1, 6)), st.tuples(st.just("next"), st.integers(1, 6)),
                  st.tuples(st.just("reset")), st.tuples(st.just("snapshot"), st.sampled_from([0, 1, 2])))


@settings(max_examples=int(os.environ.get("MPLOADER_PROGRAMS", "15")), deadline=None)
@given(n=st.sampled_from([5, 12]), batch_size=st.integers(1, 7), repeat=st.booleans(), shuffle=st.booleans(),
       procs=st.sampled_from([0, 1, 2]), n_prefetch=st.sampled_from([1, 3]),
       program=st.lists(STEPS, min_size=1, max_size=10))
def test_random_programs_follow_chainers_state_machine(n, batch_size, repeat, shuffle, procs, n_prefetch, program):
    ref = Reference(n, batch_size, repeat, seed=3 if shuffle else None)

    def make(n_processes, sampler):
        order = dict(order_sampler=sampler) if shuffle else dict(shuffle=False)
        return MultiprocessIterator(list(range(n)), batch_size, repeat=repeat, n_processes=n_processes,
                                    n_prefetch=n_prefetch, dataset_timeout=None, **order)
    it = make(procs, Shuffle(3))
    try:
        assert _view(it) == _ref_view(ref)
        for i, step in enumerate(program):
            where = f"step {i} {step} of {program}"
            if step[0] == "next":
                for _ in range(step[1]):
                    try:
                        want = ref.next()
                    except StopIteration:
                        with pytest.raises(StopIteration):
                            next(it)
                        continue
                    assert list(next(it)) == want, where
                    assert _view(it) == _ref_view(ref), where
            elif step[0] == "reset":
                # The iterator's planner calls its order sampler ahead of the caller (as
                # Chainer's prefetch thread does): the reference's sampler goes on from
                # where the iterator's stands, and both draw the new order.
                if shuffle:
                    ref.order_sampler.random = copy.deepcopy(it.order_sampler.random)
                ref.reset()
                it.reset()
            else:
                saved = DictSerializer()
                it.serialize(saved)
                it.finalize()
                # A new iterator (another process count) restored from the snapshot; the
                # order sampler's own state is the user's to restore, as in Chainer.
                it = make(step[1], Shuffle(0))
                if shuffle:
                    it.order_sampler.random = copy.deepcopy(ref.order_sampler.random)
                it.serialize(DictDeserializer(saved.target))
            assert _view(it) == _ref_view(ref), where
    finally:
        it.finalize()
