"""Tests for mploader.sampler against the documented Gluon 1.8 behaviour."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mploader
from mploader.sampler import (
    BatchSampler,
    FilterSampler,
    IntervalSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

# ---------------------------------------------------------------- reference


def reference_batches(indices, batch_size, last_batch, carried):
    """Gluon 1.8 BatchSampler, one pass, written out plainly.

    Returns (batches, carried_for_next_pass).
    """
    stream = list(carried) + list(indices)
    n_full = len(stream) // batch_size
    batches = [stream[k * batch_size:(k + 1) * batch_size] for k in range(n_full)]
    rest = stream[n_full * batch_size:]
    if rest and last_batch == "keep":
        batches.append(rest)
    return batches, (rest if last_batch == "rollover" else [])


# ---------------------------------------------------------------- Sampler


def test_base_sampler_is_abstract():
    with pytest.raises(NotImplementedError, match="__iter__"):
        iter(Sampler())
    with pytest.raises(NotImplementedError, match="__len__"):
        len(Sampler())


# ---------------------------------------------------------------- SequentialSampler


def test_sequential_default_start():
    s = SequentialSampler(5)
    assert list(s) == [0, 1, 2, 3, 4]
    assert len(s) == 5


def test_sequential_with_start_and_reiterable():
    s = SequentialSampler(4, start=10)
    assert list(s) == [10, 11, 12, 13]
    assert list(s) == [10, 11, 12, 13]
    assert len(s) == 4


def test_sequential_empty():
    assert list(SequentialSampler(0)) == []


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"length": -1}, ValueError, "length must be a non-negative integer, got -1"),
        ({"length": 2.0}, TypeError, "length must be a non-negative integer, got 2.0 (float)"),
        ({"length": True}, TypeError, "length must be a non-negative integer, got True (bool)"),
        ({"length": 3, "start": "a"}, TypeError, "start must be an integer, got 'a' (str)"),
    ],
)
def test_sequential_validation(kwargs, exc, message):
    with pytest.raises(exc) as info:
        SequentialSampler(**kwargs)
    assert str(info.value) == message


def test_numpy_ints_accepted():
    assert list(SequentialSampler(np.int64(3), start=np.int32(1))) == [1, 2, 3]


# ---------------------------------------------------------------- RandomSampler


def test_random_unseeded_is_permutation_and_reiterable():
    s = RandomSampler(100)
    a, b = list(s), list(s)
    assert sorted(a) == list(range(100))
    assert sorted(b) == list(range(100))
    assert a != b  # 1/100! chance of a false failure
    assert len(s) == 100
    assert all(type(i) is int for i in a)


def test_random_unseeded_follows_numpy_global_state_like_gluon():
    # Gluon: indices = np.arange(n); np.random.shuffle(indices)
    np.random.seed(1234)
    got = [list(RandomSampler(50)) for _ in range(3)]
    np.random.seed(1234)
    expected = []
    for _ in range(3):
        idx = np.arange(50)
        np.random.shuffle(idx)
        expected.append(idx.tolist())
    assert got == expected


def test_random_seeded_matches_documented_generator():
    s = RandomSampler(64, seed=7)
    for epoch in range(3):
        assert list(s) == np.random.default_rng([7, epoch]).permutation(64).tolist()


def test_the_kept_permutation_cannot_be_changed_through_a_pass_or_the_global_order():
    """The last two seeded permutations are kept (a staged epoch's order is drawn
    once): a pass's list, a changed copy, and passes of other seeds in between leave
    the next pass of the same (seed, epoch) equal to the documented generator."""
    reference = np.random.default_rng([5, 0]).permutation(40).tolist()
    s = RandomSampler(40, seed=5)
    first = list(s)
    first.reverse()   # the caller's list is its own
    order = mploader.DistributedBatchSampler(40, 8, seed=5, rank=0, world_size=1).global_order(0)
    with pytest.raises(ValueError, match="read-only"):
        order[0] = -1
    for seed in (6, 7, 8):   # more (seed, epoch) keys than the cache keeps
        assert list(RandomSampler(40, seed=seed)) == np.random.default_rng([seed, 0]).permutation(40).tolist()
    s.set_epoch(0)
    assert list(s) == reference
    assert order.tolist() == reference


def test_only_short_permutations_are_kept(monkeypatch):
    """A long permutation is drawn every time and held by nobody after its pass (a kept
    one of 100M indices would hold 800 MB); a short one is drawn once."""
    import mploader.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "KEEP_PERMUTATION_MAX", 16)
    short = sampler_module.seeded_permutation(1, 2, 16)
    assert sampler_module.seeded_permutation(1, 2, 16) is short
    long_ = sampler_module.seeded_permutation(1, 2, 17)
    again = sampler_module.seeded_permutation(1, 2, 17)
    assert again is not long_ and not again.flags.writeable
    assert again.tolist() == long_.tolist() == np.random.default_rng([1, 2]).permutation(17).tolist()


def test_random_seeded_reproducible_per_epoch_and_different_across_epochs():
    a = RandomSampler(200, seed=3)
    b = RandomSampler(200, seed=3)
    epochs_a = [list(a) for _ in range(4)]
    epochs_b = [list(b) for _ in range(4)]
    assert epochs_a == epochs_b
    for perm in epochs_a:
        assert sorted(perm) == list(range(200))
    assert len({tuple(p) for p in epochs_a}) == 4


def test_random_seeds_differ():
    assert list(RandomSampler(200, seed=1)) != list(RandomSampler(200, seed=2))


def test_random_seeded_does_not_touch_global_state():
    np.random.seed(99)
    before = np.random.get_state()[1].copy(), np.random.get_state()[2]
    list(RandomSampler(100, seed=5))
    after = np.random.get_state()[1], np.random.get_state()[2]
    assert np.array_equal(before[0], after[0]) and before[1] == after[1]


def test_random_set_epoch_replays_and_counts_on():
    s = RandomSampler(30, seed=11)
    epochs = [list(s) for _ in range(5)]
    assert s.epoch == 5
    s.set_epoch(2)
    assert s.epoch == 2
    assert list(s) == epochs[2]
    assert list(s) == epochs[3]
    assert s.epoch == 4


def test_random_epoch_counted_at_iter_not_at_next():
    s = RandomSampler(10, seed=0)
    iter(s)  # abandoned pass still consumes epoch 0
    assert s.epoch == 1
    assert list(s) == np.random.default_rng([0, 1]).permutation(10).tolist()


def test_random_set_epoch_unseeded_only_moves_counter():
    s = RandomSampler(10)
    s.set_epoch(4)
    assert s.epoch == 4
    assert sorted(s) == list(range(10))
    assert s.epoch == 5


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (lambda: RandomSampler(-2), ValueError, "length must be a non-negative integer, got -2"),
        (lambda: RandomSampler(3, seed=-1), ValueError, "seed must be a non-negative integer or None, got -1"),
        (lambda: RandomSampler(3, seed=1.5), TypeError, "seed must be a non-negative integer or None, got 1.5 (float)"),
        (lambda: RandomSampler(3, seed=1).set_epoch(-1), ValueError,
         "epoch must be a non-negative integer, got -1"),
        (lambda: RandomSampler(3, seed=1).set_epoch("1"), TypeError,
         "epoch must be a non-negative integer, got '1' (str)"),
    ],
)
def test_random_validation(call, exc, message):
    with pytest.raises(exc) as info:
        call()
    assert str(info.value) == message


# ---------------------------------------------------------------- BatchSampler


def test_batch_docstring_example():
    assert list(BatchSampler(SequentialSampler(10), 3, "keep")) == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert list(BatchSampler(SequentialSampler(10), 3, "discard")) == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_batch_counts_10000_by_31():
    keep = BatchSampler(SequentialSampler(10_000), 31, "keep")
    discard = BatchSampler(SequentialSampler(10_000), 31, "discard")
    assert len(keep) == 323
    assert len(list(keep)) == 323
    assert len(list(keep)[-1]) == 10_000 - 322 * 31 == 18
    assert len(discard) == 322
    assert len(list(discard)) == 322
    assert all(len(b) == 31 for b in discard)


def test_batch_rollover_10000_by_31_carries_remainder():
    s = BatchSampler(SequentialSampler(10_000), 31, "rollover")
    # epoch 0: 322 batches, 18 indices (9982..9999) carried
    assert len(s) == 322
    epoch0 = list(s)
    assert len(epoch0) == 322
    assert all(len(b) == 31 for b in epoch0)
    assert epoch0[-1][-1] == 9981
    # epoch 1: len counts the carry; first batch starts with it
    assert len(s) == (18 + 10_000) // 31 == 323
    epoch1 = list(s)
    assert len(epoch1) == 323
    assert epoch1[0] == list(range(9982, 10_000)) + list(range(13))
    # 10018 - 323*31 = 5 carried into epoch 2
    assert len(s) == (5 + 10_000) // 31 == 322
    assert len(list(s)) == 322
    # nothing is lost or duplicated over several epochs
    seen = list(itertools.chain.from_iterable(epoch0 + epoch1))
    assert seen[:10_000] == list(range(10_000))


def test_batch_rollover_small():
    b = BatchSampler(SequentialSampler(10), 3, "rollover")
    assert list(b) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert len(b) == 3
    assert list(b) == [[9, 0, 1], [2, 3, 4], [5, 6, 7]]
    assert len(b) == 4  # 2 carried + 10
    assert list(b) == [[8, 9, 0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert len(b) == 3


def test_batch_rollover_abandoned_pass_drops_carry_like_gluon():
    b = BatchSampler(SequentialSampler(10), 3, "rollover")
    list(b)  # carries [9]
    it = iter(b)
    assert len(b) == (1 + 10) // 3
    assert next(it) == [9, 0, 1]  # carry taken over at the first next()
    del it
    assert len(b) == 3
    assert list(b) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


@pytest.mark.parametrize("last_batch", ["keep", "discard"])
def test_a_carry_in_a_state_without_rollover_is_refused(last_batch):
    """Only 'rollover' carries indices into a pass (Gluon's BatchSampler keeps none
    otherwise): a state whose carry is non-empty for 'keep'/'discard' was tampered
    with and is refused naming the carry, through the loader too (hypothesis found a
    'keep' state with carry [0, 0] accepted: the pass then had 22 indices, not 20)."""
    import mploader
    from mploader._state import StateMismatchError

    b = BatchSampler(SequentialSampler(20), 3, last_batch)
    state = b.state_dict()
    assert state["carry"] == []
    state["carry"] = [0, 0]
    with pytest.raises(StateMismatchError, match=f"carry must be empty with last_batch='{last_batch}'"):
        b.load_state_dict(state)
    assert list(b)[0] == [0, 1, 2]   # nothing of the refused state was taken
    loader = mploader.DataLoader(list(range(20)), batch_size=3, last_batch=last_batch)
    saved = loader.state_dict()
    saved["batch_sampler_state"]["carry"] = [0, 0]
    with pytest.raises(ValueError, match="batch_sampler_state") as info:
        loader.load_state_dict(saved)
    assert "carry must be empty" in str(info.value)
    assert sum(len(batch) for batch in loader) == (20 if last_batch == "keep" else 18)


def test_batch_reiterable_keep_with_random():
    b = BatchSampler(RandomSampler(20, seed=0), 6, "keep")
    a, c = list(b), list(b)
    assert [len(x) for x in a] == [6, 6, 6, 2]
    assert sorted(itertools.chain.from_iterable(a)) == list(range(20))
    assert sorted(itertools.chain.from_iterable(c)) == list(range(20))
    assert a != c


def test_batch_accepts_plain_sized_iterable():
    assert list(BatchSampler(range(5), 2, "discard")) == [[0, 1], [2, 3]]


@given(
    n=st.integers(0, 60),
    batch_size=st.integers(1, 13),
    last_batch=st.sampled_from(["keep", "discard", "rollover"]),
    passes=st.integers(1, 4),
)
@settings(max_examples=200, deadline=None)
def test_batch_matches_reference(n, batch_size, last_batch, passes):
    b = BatchSampler(SequentialSampler(n), batch_size, last_batch)
    carried = []
    for _ in range(passes):
        expected, carried_next = reference_batches(range(n), batch_size, last_batch, carried)
        assert len(b) == len(expected)
        assert list(b) == expected
        carried = carried_next


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"batch_size": 0}, ValueError, "batch_size must be a positive integer, got 0"),
        ({"batch_size": -3}, ValueError, "batch_size must be a positive integer, got -3"),
        ({"batch_size": 2.0}, TypeError, "batch_size must be a positive integer, got 2.0 (float)"),
        ({"batch_size": None}, TypeError, "batch_size must be a positive integer, got None (NoneType)"),
        ({"batch_size": 2, "last_batch": "foo"}, ValueError,
         "last_batch must be one of 'keep', 'discard', 'rollover', got 'foo'"),
        ({"batch_size": 2, "last_batch": None}, ValueError,
         "last_batch must be one of 'keep', 'discard', 'rollover', got None"),
    ],
)
def test_batch_validation(kwargs, exc, message):
    with pytest.raises(exc) as info:
        BatchSampler(SequentialSampler(4), **kwargs)
    assert str(info.value) == message


# ---------------------------------------------------------------- FilterSampler


def test_filter_sampler():
    data = [5, 6, 7, 8, 10, 11]
    s = FilterSampler(lambda x: x % 2 == 0, data)
    assert list(s) == [1, 3, 4]
    assert list(s) == [1, 3, 4]
    assert len(s) == 3


def test_filter_sampler_uses_getitem_and_evaluates_once():
    calls = []

    class Dataset:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            calls.append(i)
            return i * i

    s = FilterSampler(lambda x: x > 5, Dataset())
    assert list(s) == [3, 4, 5]
    list(s)
    assert calls == list(range(6))


def test_filter_sampler_numpy_dataset():
    data = np.arange(20).reshape(10, 2)
    s = FilterSampler(lambda row: row.sum() % 4 == 1, data)
    assert list(s) == [i for i in range(10) if data[i].sum() % 4 == 1]


def test_filter_sampler_rejects_non_callable():
    with pytest.raises(TypeError, match=r"fn must be callable, got 3"):
        FilterSampler(3, [1, 2])


# ---------------------------------------------------------------- IntervalSampler


def test_interval_gluon_examples():
    assert list(IntervalSampler(13, interval=3)) == [0, 3, 6, 9, 12, 1, 4, 7, 10, 2, 5, 8, 11]
    assert list(IntervalSampler(13, interval=3, rollover=False)) == [0, 3, 6, 9, 12]
    # Gluon reports `length` even without rollover
    assert len(IntervalSampler(13, interval=3, rollover=False)) == 13


@given(length=st.integers(2, 80), data=st.data())
@settings(max_examples=100, deadline=None)
def test_interval_visits_each_index_once(length, data):
    interval = data.draw(st.integers(1, length - 1))
    s = IntervalSampler(length, interval)
    out = list(s)
    assert sorted(out) == list(range(length))
    assert len(s) == length
    assert out == [j for i in range(interval) for j in range(i, length, interval)]
    assert list(s) == out


@pytest.mark.parametrize(
    "args, exc, message",
    [
        ((5, 5), ValueError, "interval must be smaller than length, got interval=5, length=5"),
        ((5, 0), ValueError, "interval must be a positive integer, got 0"),
        ((5, 1.0), TypeError, "interval must be a positive integer, got 1.0 (float)"),
    ],
)
def test_interval_validation(args, exc, message):
    with pytest.raises(exc) as info:
        IntervalSampler(*args)
    assert str(info.value) == message
