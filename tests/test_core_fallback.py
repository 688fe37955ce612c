"""Fallback, never refusal: whatever cannot be stacked into a slot still arrives, and counts.

* object arrays, arbitrary Python objects and ragged samples come back equal to
  ``default_batchify`` and are counted (``fallback_inband``);
* a batch larger than the slot grows the slot (``grown``) and the later batches
  stay on the fast path (``slot``);
* holding every batch alive runs the ring out of slots: one RuntimeWarning, the
  rest travel through the pipe (``fallback_pipe``/``no_free_slot``), no deadlock.
"""
from __future__ import annotations

import collections
import gc
import warnings

import numpy as np
import pytest
from _util import lease_of

import mploader
from mploader._ring import SlotLease

pytestmark = pytest.mark.timeout(60)


class Thing:
    """An arbitrary (picklable, comparable) Python object."""

    def __init__(self, i):
        self.i = i

    def __eq__(self, other):
        return type(other) is Thing and other.i == self.i

    def __repr__(self):
        return f"Thing({self.i})"


class Fn:
    """``dataset[i] = fn(i)`` over ``n`` samples."""

    def __init__(self, n, fn):
        self.n = n
        self.fn = fn

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.fn(i)


def assert_equal(got, want, path="batch"):
    """Deep equality; arrays must match in type, dtype, shape and values."""
    if isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, path
        assert got.dtype == want.dtype and got.shape == want.shape, f"{path}: {got.dtype}{got.shape}"
        if want.dtype.hasobject:
            assert got.tolist() == want.tolist(), path
        else:
            assert got.tobytes() == want.tobytes(), path
        return
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            assert_equal(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for j, (g, w) in enumerate(zip(got, want)):
            assert_equal(g, w, f"{path}[{j}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def run_and_compare(dataset, batch_size, num_workers=2, **kw):
    """Iterate one epoch; each batch must equal default_batchify of its samples.
    Returns the loader's stats."""
    n = len(dataset)
    with mploader.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, seed=0, **kw) as dl:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            count = 0
            for k, got in enumerate(dl):
                idx = range(k * batch_size, min(n, (k + 1) * batch_size))
                assert_equal(got, mploader.default_batchify([dataset[i] for i in idx]), f"batch {k}")
                count += 1
            del got
        assert count == len(dl)
        return dl.stats()


def object_array_sample(i):
    return np.array([i, "s" * (i % 3), None, Thing(i)], dtype=object), np.arange(3) + i


def test_object_arrays_travel_inband():
    stats = run_and_compare(Fn(20, object_array_sample), 4)
    assert stats["batches"] == 5
    assert stats["fallback_inband"] == 5
    assert stats["slot"] == 0 and stats["fallback_pipe"] == 0


def test_arbitrary_objects_travel_inband():
    stats = run_and_compare(Fn(18, lambda i: {"obj": Thing(i), "x": np.full(4, i, np.float32),
                                              "mixed": (Thing(-i), i)}), 5)
    assert stats["batches"] == 4
    assert stats["fallback_inband"] == 4
    assert stats["slot"] == 0 and stats["fallback_pipe"] == 0


def test_ragged_lists_travel_inband():
    """Variable-length Python lists (e.g. token ids) cannot be stacked: pickled in-band."""
    stats = run_and_compare(Fn(20, lambda i: (list(range(i % 5 + 1)), np.float64(i))), 4)
    assert stats["batches"] == 5
    assert stats["fallback_inband"] == 5
    assert stats["slot"] == 0 and stats["fallback_pipe"] == 0


@pytest.mark.parametrize("text", [lambda i: "word " * (i % 4) + "é", lambda i: "nul\0" * (i % 3) + "\udc80"],
                         ids=["plain", "with NULs and a lone surrogate"])
def test_strings_travel_inband(text):
    """Strings (NUL-joined in the descriptor, or pickled when they hold a NUL) come
    back as the list default_batchify makes, counted as in-band."""
    stats = run_and_compare(Fn(20, lambda i: (text(i), i, [i] * (i % 3))), 4)
    assert stats["batches"] == 5 and stats["fallback_inband"] == 5
    assert stats["slot"] == 0 and stats["fallback_pipe"] == 0


def test_ragged_arrays_delivered_as_list_of_views():
    """Ragged ndarrays come back as the list default_batchify makes; each array still
    lives in the slot (zero-copy), so no pipe is involved."""
    ds = Fn(16, lambda i: np.arange(i % 3 + 1, dtype=np.int16) * i)
    stats = run_and_compare(ds, 4)
    assert stats["batches"] == 4
    assert stats["fallback_pipe"] == 0
    assert stats["slot"] + stats["fallback_inband"] == 4
    with mploader.DataLoader(ds, batch_size=4, num_workers=1, seed=0) as dl:
        batch = next(iter(dl))
        assert type(batch) is list and len(batch) == 4
        assert all(isinstance(lease_of(a), SlotLease) for a in batch)
        del batch


Pair = collections.namedtuple("Pair", "first second")

STACKABLE = {
    "namedtuple": lambda i: Pair(np.arange(2) + i, i),
    "namedtuple in tuple": lambda i: (Pair(np.arange(2) + i, i),),
    "namedtuples in list": lambda i: [Pair(np.arange(2) + i, i), Pair(np.ones(1), float(i))],
    "dict in tuple": lambda i: ({"a": np.arange(3) + i}, i),
    "tuple in dict": lambda i: {"x": (np.arange(3) + i, i), "y": i},
}


@pytest.mark.parametrize("make", list(STACKABLE.values()), ids=list(STACKABLE))
def test_stackable_structures_count_as_fast_path(make):
    """Nested containers of stackable leaves are all zero-copy: counted ``slot``, never
    as a fallback."""
    stats = run_and_compare(Fn(12, make), 4)
    assert stats["batches"] == 3
    assert stats["slot"] == 3, stats
    assert stats["fallback_inband"] == 0 and stats["fallback_pipe"] == 0, stats


def test_user_batchify_arrays_copied_into_slot():
    """A batchify_fn without ``collate`` returns heap arrays; they arrive as slot views."""
    ds = Fn(12, lambda i: np.full((2, 2), i, np.int32))

    def batchify(samples):
        return {"sum": np.sum(samples, axis=0), "all": np.stack(samples), "n": len(samples)}

    with mploader.DataLoader(ds, batch_size=3, num_workers=2, batchify_fn=batchify, seed=0) as dl:
        for k, got in enumerate(dl):
            want = batchify([ds[i] for i in range(3 * k, 3 * k + 3)])
            assert_equal(got, want, f"batch {k}")
            assert isinstance(lease_of(got["all"]), SlotLease)
        del got
        stats = dl.stats()
    assert stats["slot"] == 4 and stats["fallback_pipe"] == 0 and stats["fallback_inband"] == 0


def test_batch_larger_than_slot_grows_then_fast_path():
    ds = Fn(400, lambda i: np.full(256, i, np.float64))  # 2 KiB per sample, 16 KiB per batch of 8
    with mploader.DataLoader(ds, batch_size=8, num_workers=2, prefetch=4, shared_mem=4096, seed=0) as dl:
        num_slots = dl.stats()["num_slots"]
        assert len(dl) == 50 > 3 * num_slots
        history = []
        for k, got in enumerate(dl):
            np.testing.assert_array_equal(got, np.repeat(np.arange(8 * k, 8 * k + 8, dtype=np.float64), 256)
                                          .reshape(8, 256))
            assert isinstance(lease_of(got), SlotLease), f"batch {k} is not a slot view"
            history.append(dl.stats())
        del got
    first = history[0]
    assert first["grown"] == 1, "the first batch did not fit a 4096-byte slot: it must grow it"
    assert first["slot"] == 1
    last = history[-1]
    assert 1 <= last["grown"] <= num_slots, "each slot grows at most once"
    assert history[2 * num_slots]["grown"] == last["grown"], "later batches must not grow again"
    assert last["slot"] == 50 and last["fallback_pipe"] == 0 and last["fallback_inband"] == 0
    assert last["shm_bytes"] >= 8 * 2048


def test_one_large_batch_grows_then_fast_path():
    big = 5

    def sample(i):
        n = 16384 if i // 4 == big else 16  # batch 5 is 512 KiB, the others 512 B
        return np.full(n, i, np.float64)

    with mploader.DataLoader(Fn(80, sample), batch_size=4, num_workers=2, seed=0) as dl:
        history = []
        for k, got in enumerate(dl):
            assert got.shape == (4, 16384 if k == big else 16)
            np.testing.assert_array_equal(got[:, 0], np.arange(4 * k, 4 * k + 4))
            assert (got == got[:, :1]).all()
            assert isinstance(lease_of(got), SlotLease)
            history.append(dl.stats())
        del got
    assert history[big]["grown"] > history[big - 1]["grown"]
    assert history[-1]["slot"] == 20 and history[-1]["fallback_pipe"] == 0
    assert history[-1]["shm_bytes"] >= 4 * 16384 * 8


@pytest.mark.parametrize("num_workers", [1, 2])
def test_holding_every_batch_falls_back_to_pipe_with_one_warning(num_workers):
    ds = Fn(30, lambda i: (np.arange(6, dtype=np.int32) + i, float(i)))
    with mploader.DataLoader(ds, batch_size=1, num_workers=num_workers, prefetch=2 * num_workers, seed=0) as dl:
        num_slots = dl.stats()["num_slots"]
        assert len(dl) == 30 > num_slots
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            held = list(dl)
        runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(runtime) == 1, [str(w.message) for w in caught]
        assert "slots are held" in str(runtime[0].message)
        assert runtime[0].filename == __file__   # the user's line (list(dl)), not an engine frame
        assert len(caught) == 1
        for k, (arr, num) in enumerate(held):
            np.testing.assert_array_equal(arr, [np.arange(6, dtype=np.int32) + k])
            assert arr.dtype == np.int32
            np.testing.assert_array_equal(num, [float(k)])
        stats = dl.stats()
        assert stats["batches"] == 30
        assert stats["no_free_slot"] >= 1 and stats["fallback_pipe"] >= 1
        assert stats["fallback_pipe"] == stats["no_free_slot"]
        assert stats["slot"] + stats["fallback_pipe"] == 30
        assert stats["slot"] <= num_slots

        # Released batches free their slots: the next epoch is all fast path again.
        del held, arr, num
        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for k, (arr, _num) in enumerate(dl):
                assert arr[0, 0] == k
                assert isinstance(lease_of(arr), SlotLease)
            del arr, _num
        after = dl.stats()
        assert after["slot"] == stats["slot"] + 30
        assert after["fallback_pipe"] == stats["fallback_pipe"]
