"""mploader.MultiprocessIterator against Chainer 7.8.1's documented and upstream behaviour.

Expected progressions are written out by hand from Chainer's iterator state machine:
a batch takes ``batch_size`` indices from the current position; reaching the end of
the epoch (position + batch_size >= epoch size) asks the order sampler for the next
order, increments ``epoch``, sets ``is_new_epoch`` and, with ``repeat``, completes the
batch from the new order.  ``previous_epoch_detail`` is ``epoch_detail`` before the
last ``next()``.  Every behaviour is checked with n_processes 0 (in-process), 1 and 2.
"""
from __future__ import annotations

import copy
import gc
import multiprocessing
import os
import pickle
import threading
import warnings

import numpy as np
import pytest
from _util import DictDeserializer, DictSerializer, arrays_in, lease_of

import mploader
from mploader import MultiprocessIterator, ShuffleOrderSampler
from mploader._ring import SlotLease

pytestmark = pytest.mark.timeout(60)

PROCS = [0, 1, 2]
FORK = multiprocessing.get_context("fork")


# ---------------------------------------------------------------- datasets and helpers


class Indexed:
    """Example i is the int i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return int(i)


class Thing:
    """An arbitrary (picklable) object inside an example."""

    def __init__(self, i):
        self.i = i

    def __eq__(self, other):
        return isinstance(other, Thing) and other.i == self.i


class Mixed:
    """Examples of every kind: tuples, dicts, arrays of differing shapes, numbers, objects."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        i = int(i)
        kind = i % 5
        if kind == 0:
            return np.full((i % 4 + 1, 3), i, np.float32), i
        if kind == 1:
            return {"image": np.arange(i + 1, dtype=np.int16), "label": i, "name": f"item{i}"}
        if kind == 2:
            return np.full(i, i, np.int64)
        if kind == 3:
            return float(i) / 2
        return Thing(i), [i, str(i)], None


def example_equal(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(example_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(example_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def snapshot(it):
    return (it.epoch, it.current_position, it.is_new_epoch, it.epoch_detail, it.previous_epoch_detail)


class Roll:
    """A deterministic, picklable order sampler: the next order is the current one rolled by one."""

    def __call__(self, order, position):
        return np.roll(order, 1)


@pytest.fixture(params=PROCS, ids=lambda n: f"procs{n}")
def procs(request):
    return request.param


def make(dataset, batch_size, procs, **kw):
    kw.setdefault("dataset_timeout", None)
    return MultiprocessIterator(dataset, batch_size, n_processes=procs, **kw)


# ---------------------------------------------------------------- progressions


def test_progression_repeat_batches_divide_epoch(procs):
    with make(Indexed(6), 2, procs, shuffle=False) as it:
        assert snapshot(it) == (0, 0, False, 0.0, None)
        got = [(it.next(), snapshot(it)) for _ in range(7)]
    assert got == [
        ([0, 1], (0, 2, False, 2 / 6, 0.0)),
        ([2, 3], (0, 4, False, 4 / 6, 2 / 6)),
        ([4, 5], (1, 0, True, 1.0, 4 / 6)),
        ([0, 1], (1, 2, False, 1 + 2 / 6, 1.0)),
        ([2, 3], (1, 4, False, 1 + 4 / 6, 1 + 2 / 6)),
        ([4, 5], (2, 0, True, 2.0, 1 + 4 / 6)),
        ([0, 1], (2, 2, False, 2 + 2 / 6, 2.0)),
    ]


def test_progression_repeat_batch_crosses_epoch(procs):
    with make(Indexed(5), 2, procs, shuffle=False) as it:
        got = [(it.next(), snapshot(it)) for _ in range(6)]
    assert got == [
        ([0, 1], (0, 2, False, 0.4, 0.0)),
        ([2, 3], (0, 4, False, 0.8, 0.4)),
        ([4, 0], (1, 1, True, 1.2, 0.8)),
        ([1, 2], (1, 3, False, 1.6, 1.2)),
        ([3, 4], (2, 0, True, 2.0, 1.6)),
        ([0, 1], (2, 2, False, 2.4, 2.0)),
    ]


def test_batch_larger_than_epoch_wraps_several_times(procs):
    calls = []

    def backwards(order, position):
        calls.append((order.tolist(), position))
        return order[::-1].copy()

    with make(Indexed(3), 7, procs, order_sampler=backwards) as it:
        assert calls == [([0, 1, 2], 0)]
        # the initial order is [2, 1, 0]; each end of epoch reverses it again
        assert it.next() == [2, 1, 0, 0, 1, 2, 2]
        assert snapshot(it) == (2, 1, True, 2 + 1 / 3, 0.0)
        assert calls[:3] == [([0, 1, 2], 0), ([2, 1, 0], 0), ([0, 1, 2], 0)]
        assert it.next() == [1, 0, 0, 1, 2, 2, 1]
        assert calls[3:5] == [([2, 1, 0], 1), ([0, 1, 2], 0)]
        assert snapshot(it) == (4, 2, True, 4 + 2 / 3, 2 + 1 / 3)


def test_no_repeat_ends_with_partial_batch_then_stops_every_time(procs):
    with make(Indexed(5), 2, procs, repeat=False, shuffle=False) as it:
        assert it.next() == [0, 1]
        assert it.next() == [2, 3]
        assert it.next() == [4]
        assert snapshot(it) == (1, 0, True, 1.0, 0.8)
        for _ in range(3):
            with pytest.raises(StopIteration):
                it.next()
            assert snapshot(it) == (1, 0, True, 1.0, 1.0)
        assert list(it) == []


def test_no_repeat_exact_and_oversized_batches(procs):
    with make(Indexed(4), 2, procs, repeat=False, shuffle=False) as it:
        assert list(it) == [[0, 1], [2, 3]]
        assert snapshot(it) == (1, 0, True, 1.0, 1.0)
    with make(Indexed(3), 5, procs, repeat=False, shuffle=False) as it:
        assert list(it) == [[0, 1, 2]]
        assert (it.epoch, it.is_new_epoch) == (1, True)


def test_no_repeat_calls_order_sampler_at_epoch_end(procs):
    calls = []

    def sampler(order, position):
        calls.append((order.tolist(), position))
        return np.array([3, 1, 2, 0])

    with make(Indexed(4), 3, procs, repeat=False, order_sampler=sampler) as it:
        assert list(it) == [[3, 1, 2], [0]]
    assert calls == [([0, 1, 2, 3], 0), ([3, 1, 2, 0], 3)]


def test_reset_goes_back_to_the_start(procs):
    calls = []

    def sampler(order, position):
        calls.append(position)
        return np.roll(order, 1)

    with make(Indexed(5), 2, procs, repeat=False, order_sampler=sampler) as it:
        first = list(it)
        assert first == [[4, 0], [1, 2], [3]]
        it.reset()
        assert calls[0] == 0 and calls[-1] == 0
        assert snapshot(it) == (0, 0, False, 0.0, None)
        assert list(it) == first
        it.reset()
        assert it.next() == [4, 0]


# ---------------------------------------------------------------- orders


def test_shuffle_none_and_true_follow_numpy_global_state(procs):
    n = 7
    for shuffle in (None, True):
        np.random.seed(1234)
        with make(Indexed(n), n, procs, shuffle=shuffle) as it:
            got = [it.next() for _ in range(3)]
        ref = np.random.RandomState(1234)
        assert got == [ref.permutation(n).tolist() for _ in range(3)]


def test_shuffle_order_sampler_with_random_state(procs):
    sampler = ShuffleOrderSampler(np.random.RandomState(5))
    with make(Indexed(6), 4, procs, order_sampler=sampler) as it:
        got = [it.next() for _ in range(3)]
    ref = np.random.RandomState(5)
    first, second = ref.permutation(6).tolist(), ref.permutation(6).tolist()
    assert got == [first[:4], first[4:] + second[:2], second[2:]]
    assert ShuffleOrderSampler()._random is np.random.random.__self__


def test_shuffle_false_is_index_order_and_every_epoch_is_a_permutation(procs):
    with make(Indexed(10), 3, procs, shuffle=False) as it:
        assert [x for _ in range(10) for x in it.next()] == list(range(10)) * 3
    with make(Indexed(10), 5, procs) as it:
        for _ in range(4):
            assert sorted(it.next() + it.next()) == list(range(10))


def test_epoch_size_is_the_order_length(procs):
    sampler = lambda order, position: np.array([0, 2, 4, 6])  # noqa: E731 - a lambda on purpose
    with make(Indexed(10), 3, procs, order_sampler=sampler) as it:
        assert it.next() == [0, 2, 4]
        assert it.epoch_detail == 0.75
        assert it.next() == [6, 0, 2]
        assert snapshot(it) == (1, 2, True, 1.5, 0.75)


def test_order_sampler_changing_size_raises_when_its_batch_is_due(procs):
    def shrinking(order, position):
        return np.arange(len(order) - 1 if position else len(order))

    with make(Indexed(5), 2, procs, order_sampler=shrinking, n_prefetch=4) as it:
        assert it.next() == [0, 1]
        assert it.next() == [2, 3]
        for _ in range(2):
            with pytest.raises(ValueError, match=r"order_sampler returned an order of size 4, expected 5"):
                it.next()
            assert snapshot(it) == (0, 4, False, 0.8, 0.4)


def test_shuffle_with_order_sampler_is_refused():
    with pytest.raises(ValueError, match=r"shuffle must be None when an order_sampler is given, got shuffle=False"):
        MultiprocessIterator(Indexed(3), 1, shuffle=False, order_sampler=Roll(), n_processes=0)


def test_repeating_over_an_empty_dataset_raises(procs):
    with make(Indexed(0), 2, procs, shuffle=False) as it:
        with pytest.raises(ValueError, match=r"epoch size must be positive .* repeat=True, got an empty dataset"):
            it.next()


@pytest.mark.parametrize("kwargs, exc_type, message", [
    (dict(batch_size=0), ValueError, r"batch_size must be a positive integer, got 0"),
    (dict(batch_size=2.0), TypeError, r"batch_size must be a positive integer, got 2.0 \(float\)"),
    (dict(n_processes=-1), ValueError, r"n_processes must be a non-negative integer, got -1"),
    (dict(n_prefetch="2"), TypeError, r"n_prefetch must be a non-negative integer, got '2' \(str\)"),
    (dict(n_prefetch=0, n_processes=2), ValueError,
     r"n_prefetch must be a positive integer when n_processes > 0 .*, got 0"),
    (dict(n_prefetch=5000), ValueError,
     r"n_prefetch must be at most 4093 \(the ring holds at most 4096 slots and the engine uses n_prefetch \+ 3\), "
     r"got 5000"),
    (dict(n_processes=5000), ValueError, r"n_processes must be at most 4093 .*, got 5000"),
    (dict(shared_mem=-5), ValueError, r"shared_mem must be a non-negative integer or None, got -5"),
    (dict(shared_mem=2**40), ValueError,
     r"shared_mem must be at most \d+ bytes per example with batch_size=2 \(a slot holds at most 1099511627776 "
     r"bytes\), got 1099511627776"),
    (dict(dataset_timeout=-1.0), ValueError,
     r"dataset_timeout must be a non-negative number of seconds or None, got -1.0"),
    (dict(dataset_timeout="1"), TypeError,
     r"dataset_timeout must be a non-negative number of seconds or None, got '1' \(str\)"),
    (dict(maxtasksperchild=0), ValueError, r"maxtasksperchild must be a positive integer or None, got 0"),
    (dict(order_sampler=3), TypeError, r"order_sampler must be callable or None, got 3"),
    (dict(seed="x"), TypeError, r"seed must be a non-negative integer or None, got 'x' \(str\)"),
])
def test_argument_errors_name_the_argument(kwargs, exc_type, message):
    args = dict(dataset=Indexed(4), batch_size=2, n_processes=0)
    args.update(kwargs)
    with pytest.raises(exc_type, match=message) as info:
        MultiprocessIterator(**args)
    assert type(info.value) is exc_type


def test_dataset_without_len_is_refused():
    with pytest.raises(TypeError, match=r"dataset must support __getitem__ and __len__, got object"):
        MultiprocessIterator(object(), 2)


# ---------------------------------------------------------------- batch contents


def test_batch_is_the_list_of_examples_as_returned(procs):
    ds = Mixed(23)
    with make(ds, 4, procs, repeat=False, shuffle=False) as it:
        for k, batch in enumerate(it):
            assert type(batch) is list
            want = [ds[i] for i in range(4 * k, min(4 * k + 4, 23))]
            assert example_equal(batch, want)
            for arr in arrays_in(batch):
                if procs:
                    assert isinstance(lease_of(arr), SlotLease), "arrays are zero-copy views of the slot"


def test_kept_batches_never_change(procs):
    ds = Mixed(15)
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all slots held: the rest travel through the pipe
        with make(ds, 4, procs, shuffle=False) as it:
            for _ in range(20):
                kept.append((it.next(), it.current_position, it.epoch))
    for batch, position, _epoch in kept:
        start = (position - len(batch)) % 15
        assert example_equal(batch, [ds[(start + j) % 15] for j in range(len(batch))])


def test_seeded_worker_randomness_is_independent_of_n_processes():
    class Noisy:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return int(i), int(np.random.randint(1 << 30))

    runs = []
    for procs in PROCS:
        with make(Noisy(), 2, procs, shuffle=False, seed=7) as it:
            runs.append([it.next() for _ in range(6)])
    assert runs[0] == runs[1] == runs[2]


def test_shared_mem_and_prefetch_are_accepted(procs):
    ds = Mixed(12)
    with make(ds, 3, procs, shuffle=False, shared_mem=256, n_prefetch=3) as it:
        for k in range(8):
            batch = it.next()
            assert example_equal(batch, [ds[(3 * k + j) % 12] for j in range(3)])


# ---------------------------------------------------------------- serialize, pickle, copy


def test_serialize_saves_chainer_keys_with_minus_one_for_none(procs):
    with make(Indexed(5), 2, procs, order_sampler=Roll()) as it:
        s = DictSerializer()
        it.serialize(s)
        assert s.target["previous_epoch_detail"] == -1
        assert sorted(s.target) == ["current_position", "epoch", "is_new_epoch", "order", "previous_epoch_detail"]
        for _ in range(3):
            it.next()
        s = DictSerializer()
        it.serialize(s)
        t = s.target
        assert (t["current_position"], t["epoch"], t["is_new_epoch"], t["previous_epoch_detail"]) == (1, 1, True, 0.8)
        assert t["order"].tolist() == [3, 4, 0, 1, 2]
        assert it.next() == [4, 0]  # saving did not disturb iteration
    with make(Indexed(5), 2, procs, shuffle=False) as it:
        s = DictSerializer()
        it.serialize(s)
        assert "order" not in s.target


def test_serialize_round_trip_mid_epoch(procs):
    with make(Indexed(7), 3, procs, order_sampler=Roll()) as a:
        for _ in range(4):
            a.next()
        s = DictSerializer()
        a.serialize(s)
        with make(Indexed(7), 3, procs, order_sampler=Roll()) as b:
            b.next()
            b.serialize(DictDeserializer(s.target))
            assert snapshot(b) == snapshot(a)
            assert [b.next() for _ in range(6)] == [a.next() for _ in range(6)]
            assert snapshot(b) == snapshot(a)


def test_deserialize_old_snapshots(procs):
    """``_order`` instead of ``order``; no ``previous_epoch_detail``: guessed as Chainer does."""
    with make(Indexed(5), 2, procs, order_sampler=Roll()) as it:
        it.next()
        it.serialize(DictDeserializer({"current_position": 3, "epoch": 2, "is_new_epoch": False,
                                       "_order": np.array([4, 3, 2, 1, 0])}))
        assert snapshot(it) == (2, 3, False, 2.6, 2.2)
        assert it.next() == [1, 0]
        it.serialize(DictDeserializer({"current_position": 0, "epoch": 0, "is_new_epoch": False,
                                       "order": np.arange(5)}))
        assert it.previous_epoch_detail is None
        assert it.next() == [0, 1]


def test_pickled_mid_epoch_continues(procs):
    with make(Indexed(9), 4, procs, order_sampler=Roll()) as it:
        for _ in range(3):
            it.next()
        blob = pickle.dumps(it)
        with pickle.loads(blob) as other:
            assert snapshot(other) == snapshot(it)
            assert [other.next() for _ in range(5)] == [it.next() for _ in range(5)]


def test_copy_stands_where_the_original_stands(procs):
    with make(Indexed(9), 4, procs, order_sampler=Roll()) as it:
        it.next()
        it.next()
        with copy.copy(it) as other:
            assert snapshot(other) == snapshot(it)
            assert [other.next() for _ in range(4)] == [it.next() for _ in range(4)]
            other.next()
            assert other.epoch_detail != it.epoch_detail


def test_unpicklable_order_sampler_works_with_workers():
    state = {"calls": 0}

    def sampler(order, position):  # a closure: cannot be pickled
        state["calls"] += 1
        return order[::-1].copy()

    with make(Indexed(4), 3, 2, order_sampler=sampler) as it:
        assert [it.next() for _ in range(3)] == [[3, 2, 1], [0, 0, 1], [2, 3, 3]]
    assert state["calls"] >= 3


# ---------------------------------------------------------------- errors, timeouts, workers


class Failing:
    """Example 3 raises."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 3:
            raise KeyError(f"bad example {i}")
        return int(i)


def test_dataset_error_consumes_only_its_batch(procs):
    with make(Failing(), 2, procs, shuffle=False) as it:
        assert it.next() == [0, 1]
        with pytest.raises(KeyError, match="bad example 3"):
            it.next()
        assert snapshot(it) == (0, 4, False, 0.5, 0.25)
        assert it.next() == [4, 5]


class Gated:
    """Example 0 waits (at most ``wait_s``, None: for ever) for ``gate``; ``started``
    tells that it is waiting."""

    def __init__(self, wait_s=20):
        self.gate = FORK.Event()
        self.started = FORK.Event()
        self.wait_s = wait_s

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 0:
            self.started.set()
            self.gate.wait(self.wait_s)
        return int(i)


def test_timeout_warning_is_issued_from_next(procs):
    ds = Gated()
    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        seen.append((category, filename))
        ds.gate.set()  # let the batch finish once the warning is out

    with make(ds, 2, procs, shuffle=False, dataset_timeout=0.05) as it:
        with warnings.catch_warnings():
            warnings.simplefilter("always", MultiprocessIterator.TimeoutWarning)
            warnings.showwarning = show
            assert it.next() == [0, 1]
    assert seen == [(MultiprocessIterator.TimeoutWarning, __file__)]
    assert issubclass(MultiprocessIterator.TimeoutWarning, RuntimeWarning)


def test_timeout_warning_as_error_leaves_the_batch_owed(procs):
    ds = Gated()
    with make(ds, 2, procs, shuffle=False, dataset_timeout=0.05) as it:
        with warnings.catch_warnings():
            warnings.simplefilter("error", MultiprocessIterator.TimeoutWarning)
            with pytest.raises(MultiprocessIterator.TimeoutWarning, match=r"dataset_timeout"):
                it.next()
        assert snapshot(it) == (0, 0, False, 0.0, None)
        ds.gate.set()
        assert it.next() == [0, 1]
        assert it.next() == [2, 3]


@pytest.mark.parametrize("dataset_timeout", [30.0, 0.0001], ids=["default-timeout", "timeout-always-hit"])
def test_inline_path_starts_one_thread_not_one_per_batch(monkeypatch, dataset_timeout):
    """n_processes=0 with a dataset_timeout (the default) loads batches on a helper
    thread so that next() can warn while the dataset stalls: one thread for the
    iterator's life, not one per batch (a reset starts a new run, still no new
    thread), ended by finalize() or by garbage collection."""
    created = []

    class CountingThread(threading.Thread):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.append(self)

    monkeypatch.setattr(threading, "Thread", CountingThread)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MultiprocessIterator.TimeoutWarning)
        with MultiprocessIterator(Indexed(10), 3, shuffle=False, n_processes=0,
                                  dataset_timeout=dataset_timeout) as it:
            got = [it.next() for _ in range(20)]
            it.reset()
            got.append(it.next())
    assert got[:4] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]] and got[-1] == [0, 1, 2]
    assert len(created) == 1, f"{len(created)} threads for 21 batches"
    created[0].join(10)
    assert not created[0].is_alive(), "the helper thread ends with the iterator"
    # dropped without finalize(): the thread ends when the iterator is collected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MultiprocessIterator.TimeoutWarning)
        it = MultiprocessIterator(Indexed(10), 3, shuffle=False, n_processes=0, dataset_timeout=dataset_timeout)
        assert it.next() == [0, 1, 2]
        del it
    gc.collect()
    assert len(created) == 2
    created[1].join(10)
    assert not created[1].is_alive(), "the helper thread ends when the iterator is collected"


@pytest.mark.parametrize("procs", [1, 2], ids=lambda n: f"procs{n}")
def test_finalize_from_another_thread_interrupts_next(procs):
    """The worker waits for ever: finalize() returns only because it does not wait for it
    (otherwise the module's timeout fails the test)."""
    ds = Gated(wait_s=None)
    it = make(ds, 2, procs, shuffle=False)
    took = []

    def finalize_when_waiting():
        ds.started.wait(20)
        it.finalize()
        took.append(True)

    thread = threading.Thread(target=finalize_when_waiting)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="closed"):
            it.next()
    finally:
        thread.join(20)
    assert took == [True]
    it.finalize()
    with pytest.raises(RuntimeError, match="finalized"):
        it.next()


def test_finalize_is_idempotent_and_blocks_reset(procs, no_leaks):
    it = make(Indexed(6), 2, procs, shuffle=False)
    assert it.next() == [0, 1]
    it.finalize()
    it.finalize()
    with pytest.raises(NotImplementedError, match="Reset of finalized MultiProcessIterator"):
        it.reset()
    with pytest.raises(RuntimeError, match="finalized"):
        it.next()
    del it


def test_context_manager_leaves_nothing_behind(procs, no_leaks):
    with make(Mixed(10), 3, procs) as it:
        batch = it.next()
        assert it is iter(it)
    assert len(batch) == 3
    del batch, it


class CrashOnce:
    """Example 2 kills its worker the first time it is read."""

    def __init__(self):
        self.crashed = FORK.Value("i", 0)

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i == 2 and os.getpid() != PARENT and not self.crashed.value:
            self.crashed.value = 1  # (never exit holding the Value's lock)
            os._exit(3)
        return int(i)


PARENT = os.getpid()


@pytest.mark.parametrize("procs", [1, 2], ids=lambda n: f"procs{n}")
def test_dead_worker_is_reported_and_the_batch_retried(procs):
    with make(CrashOnce(), 2, procs, shuffle=False) as it:
        assert it.next() == [0, 1]
        with pytest.raises(mploader.WorkerError, match="exited with code 3"):
            it.next()
        assert snapshot(it) == (0, 2, False, 2 / 6, 0.0)
        assert it.next() == [2, 3]
        assert it.next() == [4, 5]


class Pids:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return int(i), os.getpid()


@pytest.mark.parametrize("procs, per_child", [(0, 1), (1, 2), (2, 1)])
def test_maxtasksperchild_over_many_epochs_never_stalls(procs, per_child):
    n_batches = 48
    with make(Pids(), 2, procs, shuffle=False, maxtasksperchild=per_child) as it:
        batches = [it.next() for _ in range(n_batches)]
        assert it.epoch == n_batches * 2 // 8
    assert [i for b in batches for i, _ in b] == list(range(8)) * (n_batches * 2 // 8)
    pids = [b[0][1] for b in batches]
    if procs == 0:
        assert set(pids) == {os.getpid()}
    else:
        assert os.getpid() not in pids
        # each worker built at most per_child batches
        assert len(set(pids)) >= n_batches // per_child
        assert all(pids.count(p) <= per_child for p in set(pids))


@pytest.mark.parametrize("procs", [1, 2], ids=lambda n: f"procs{n}")
def test_dropping_the_iterator_stops_its_workers_at_once(procs):
    import gc

    import psutil

    gc.disable()  # the workers must stop by reference counting alone
    try:
        it = make(Indexed(10), 2, procs, shuffle=False)
        assert it.next() == [0, 1]
        pids = set(it._engine.worker_pids())
        assert len(pids) == procs
        del it
        children = {p.pid for p in psutil.Process().children()}
        assert not pids & children
    finally:
        gc.enable()
